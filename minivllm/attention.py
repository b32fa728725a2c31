"""Attention: the dense/chunked reference pair and the KV caches the model attends through.

Chapter 02 shows that prefilling a prompt chunk by chunk through a KV cache is
exact: the chunk ``[a, b)`` attends to every cached key ``[0, b)`` with the
mask ``key <= a + row``. Chapter 01 uses :class:`ContiguousKVCache` for one
sequence; chapter 05 replaces it with paged attention over block tables.

Every cache implements one protocol, :class:`KVCache`: each layer hands it the
step's queries, keys and values, their positions and the step's attention
metadata (a :class:`PagedBatch` for the paged cache, built once per step
before the first layer), and gets the attention output back.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from minivllm import kernels
from minivllm.block_manager import slots
from minivllm.copy_stream import BlockCopier

__all__ = [
    "causal_chunk_mask",
    "dense_causal",
    "chunked_causal",
    "attend",
    "attend_fresh",
    "fold_mask",
    "KVCache",
    "NoCache",
    "ContiguousKVCache",
    "AttentionGroup",
    "PagedBatch",
    "split_by_padding",
    "PagedKVCache",
    "MiniPagedKVCache",
    "GATHER",
    "VARLEN",
    "PAGED_KERNEL",
    "PREFILL_MIN_QUERIES",
    "KernelRows",
    "choose_attention_kernel",
]

MAX_GROUPS = 4  # padded attention calls a kind of row (decode, prefill) may be cut into, per step
GATHER = "gather+sdpa"  # gather each sequence's blocks, then SDPA over padded groups (every device)
VARLEN = "varlen+block_table"  # torch's varlen_attn reading the pool through the block table (FlashAttention, Ampere+)
PAGED_KERNEL = "paged_attention kernel"  # the kernel table's paged_attention, every row to its own length (chapter 18)
PREFILL_MIN_QUERIES = 2
"""A sequence with at least this many queries in a step (a prompt, a chunk after cached keys, a speculative
verification) is attended by the C++ table's ``prefill_attention`` (chapter 18); a decode row by its
``paged_attention``. Measured for the rule (interleaved rounds in one process on a loaded 2-core AMD EPYC, AVX2, one
thread: an indication): four sequences of n queries after 500 cached keys took the prefill kernel 1.5x paged's time
at n = 1 (a tile's 16 lanes hold a decode row's 3 query heads), 0.87x at 2, 0.66x and 0.68x at 4 and 8, 0.56x and
0.55x at 16 and 32 (the best of 30 rounds). Against SDPA no length is kept back: on one prompt of 128, 512 and
2,048 tokens (SmolLM2's heads, medians of 9 rounds) SDPA took 1.45x, 1.44x and 1.31x the prefill kernel's time (1.39x at
2,048 tokens on two threads), paged_attention 1.26x, 1.36x and 1.80x."""


def causal_chunk_mask(a: int, b: int, device=None) -> torch.Tensor:
    """Boolean mask ``[b - a, b]`` for queries ``[a, b)`` over keys ``[0, b)`` (chapter 02).

    Row ``i`` is the query at global position ``a + i``; it may see key ``j``
    exactly when ``j <= a + i``: every cached key before the chunk, and the
    chunk itself causally.
    """
    if not 0 <= a < b:
        raise ValueError(f"chunk [a, b) needs 0 <= a < b, got a={a}, b={b}")
    rows = torch.arange(a, b, device=device)[:, None]
    cols = torch.arange(b, device=device)[None, :]
    return cols <= rows


def _softmax_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d), masked) v over the last two dims."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over the whole sequence at once: the reference (chapter 02).

    Shapes ``(..., seq, dim)``; every query sees the keys at or before it.
    """
    n = q.shape[-2]
    return _softmax_attention(q, k, v, causal_chunk_mask(0, n, q.device))


def chunked_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int):
    """Causal attention computed chunk by chunk, as chunked prefill does (chapter 02).

    Chunk ``[a, b)`` of the queries attends to the keys ``[0, b)``, i.e. the
    keys cached so far plus its own. Returns ``(out, trace)`` where ``trace``
    lists ``(a, b, shape of the keys seen)`` for every chunk.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n = q.shape[-2]
    outs, trace = [], []
    for a in range(0, n, chunk_size):
        b = min(a + chunk_size, n)
        k_seen, v_seen = k[..., :b, :], v[..., :b, :]
        outs.append(
            _softmax_attention(q[..., a:b, :], k_seen, v_seen, causal_chunk_mask(a, b, q.device))
        )
        trace.append((a, b, tuple(k_seen.shape)))
    return torch.cat(outs, dim=-2), trace


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with a boolean ``mask[..., nq, nk]`` (True = may attend).

    ``q`` is ``[..., heads, nq, dim]``; ``k``, ``v`` are ``[..., kv_heads, nk, dim]``.
    Query head ``h`` reads KV head ``h // group``: the group's queries are folded
    into the query axis, so keys and values are never copied per head.
    """
    *lead, h, nq, d = q.shape
    group = h // k.shape[-3]
    if group > 1:
        q = q.reshape(*lead, k.shape[-3], group * nq, d)
    if mask.shape[-2] != q.shape[-2]:  # not folded yet (callers that reuse a mask fold it once)
        mask = fold_mask(mask, group)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(-3))
    return out.reshape(*lead, h, nq, d)


def attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention for rows of fresh prompts (chapter 12): each row's queries are its keys' positions from 0.

    ``q`` is ``[B, heads, Lq, dim]``; ``k``, ``v`` are ``[B, kv_heads, >= Lq, dim]``,
    key ``j`` at position ``j``. Query ``i`` sees keys ``0..i``, which is SDPA's own
    causal rule (the diagonal top left), so no mask is built or read, and for a
    long prompt the kernel skips the key tiles wholly above the diagonal. A
    padding query row (past its prompt's end) sees keys it should not, and its
    output is dropped.
    """
    n = q.shape[-2]
    return F.scaled_dot_product_attention(q, k[..., :n, :], v[..., :n, :], is_causal=True, enable_gqa=True)


@functools.cache
def causal_gqa_supported() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (2.5 and newer), which :func:`attend_fresh` needs."""
    try:
        x = torch.zeros(1, 2, 1, 8)
        F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], is_causal=True, enable_gqa=True)
    except TypeError:
        return False
    return True


def fold_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """``mask[..., nq, nk]`` repeated for the ``group`` query heads that :func:`attend` folds into the query axis."""
    if group == 1:
        return mask
    *lead, nq, nk = mask.shape
    return mask.unsqueeze(-3).expand(*lead, group, nq, nk).reshape(*lead, group * nq, nk)


class KVCache(Protocol):
    """What the model needs from a KV cache: store this layer's keys and values, return the attention output.

    ``q`` is ``[T, heads, dim]``, ``k`` and ``v`` ``[T, kv_heads, dim]`` for the
    step's ``T`` flat tokens at ``positions``; ``batch`` is the step's attention
    metadata (None for the single-sequence caches).
    """

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                batch: PagedBatch | None = None) -> torch.Tensor: ...


class NoCache:
    """No KV cache: every forward sees only its own tokens (naive generation, chapter 01)."""

    def forward(self, layer: int, q, k, v, positions, batch=None):
        # q: [T, H, D], k/v: [T, KVH, D] for one sequence, causal among themselves.
        n = q.shape[0]
        mask = causal_chunk_mask(0, n, q.device)
        out = attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask)
        return out.transpose(0, 1)


class ContiguousKVCache:
    """One sequence's KV cache, preallocated contiguously per layer (chapters 01 and 02).

    A forward over positions ``[a, b)`` writes its keys and values at ``[a, b)``
    and attends over ``[0, b)`` with :func:`causal_chunk_mask`, so a prompt can be
    prefilled whole, chunk by chunk, or one token at a time with the same result.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype=torch.float32, device="cpu"):
        shape = (num_layers, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # tokens whose KV is written

    @classmethod
    def for_model(cls, model, max_len: int):
        c = model.config
        p = next(model.parameters())
        return cls(c.num_hidden_layers, c.num_key_value_heads, model.head_dim, max_len, p.dtype, p.device)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def forward(self, layer: int, q, k, v, positions, batch=None):
        a = int(positions[0])
        b = a + q.shape[0]
        if b > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens, a forward needs {b}")
        self.k[layer, :, a:b] = k.transpose(0, 1)
        self.v[layer, :, a:b] = v.transpose(0, 1)
        if layer == self.k.shape[0] - 1:
            self.length = b
        mask = causal_chunk_mask(a, b, q.device)
        out = attend(q.transpose(0, 1), self.k[layer, :, :b], self.v[layer, :, :b], mask)
        return out.transpose(0, 1)


@dataclass
class AttentionGroup:
    """One padded rectangle of sequences attended in one call (chapter 05).

    ``block_tables[b]`` is row ``b``'s block table padded with block 0;
    ``mask[b, i, j]`` says whether its query row ``i`` may see key ``j``
    (``folded_mask`` is the same, repeated for the query heads that share a KV
    head); ``query_index`` picks the rows' queries out of the step's flat
    tokens, ``valid`` marks real (not padding) query rows and ``out_index``
    says where their outputs go back. ``every_token`` says the group is the
    whole step, one query per row in token order (a decode-only step): its
    queries and outputs are the step's own, with no gather or scatter.
    ``fresh`` says every row is a whole prompt (its context is its queries):
    the causal rule from position 0, which :func:`attend_fresh` applies
    without the mask, and ``spans`` where each such prompt's tokens lie in
    the step, so it is attended alone, unpadded, from the step's own keys
    (chapter 12).
    """

    block_tables: torch.Tensor  # [B, W] long
    mask: torch.Tensor  # [B, Lq, W * block_size] bool
    folded_mask: torch.Tensor  # [B, group * Lq, W * block_size] bool
    query_index: torch.Tensor  # [B, Lq] long
    valid: torch.Tensor  # [B, Lq] bool
    out_index: torch.Tensor  # [valid rows] long
    all_valid: bool  # no padding rows (every decode group): the output needs no boolean gather
    every_token: bool = False  # row b is token b, one query each: q and the output need no indexing
    context_lens: torch.Tensor | None = None  # [B] long: each row's context
    fresh: bool = False  # prefill rows whose every query is its own whole context (no cached keys before them)
    spans: tuple[tuple[int, int], ...] = ()  # fresh rows' (first token in the step, tokens): attended one by one
    built: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # built once per step, then reused

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``folded_mask`` as an additive float mask (0 where allowed, -inf elsewhere).

        SDPA converts a boolean mask to this form on every call; converting once
        per step saves it in every layer.
        """
        if dtype not in self.built:
            mask = torch.zeros(self.folded_mask.shape, dtype=dtype, device=self.folded_mask.device)
            self.built[dtype] = mask.masked_fill_(~self.folded_mask, float("-inf"))
        return self.built[dtype]


@dataclass(frozen=True)
class KernelRows:
    """Some sequences of a step, as a kernel table's attention takes them (chapter 18): their query tokens in the
    step (``tokens``, a slice where they are consecutive, the scheduler's order), their block tables, context
    lengths and query starts."""

    tokens: slice | torch.Tensor
    block_table: torch.Tensor  # [sequences, width] int32
    context_lens: torch.Tensor  # [sequences] int32
    cu_seq_q: torch.Tensor  # [sequences + 1] int32


class PagedBatch:
    """Where one engine step's tokens read and write KV in the paged pools (chapter 05).

    Sequence ``b`` feeds ``query_lens[b]`` tokens that end at ``context_lens[b]``
    (so its queries sit at positions ``context_lens[b] - query_lens[b]`` onward),
    flattened one sequence after another, writing their KV to ``slot_mapping``
    (the block manager's, or computed here by the same rule). Built once per
    step, before the first layer, and shared by every layer. A paged attention
    kernel (chapter 18) reads the ragged form: ``block_table`` (each row's
    table, padded), ``context_lens`` and ``cu_seq_q`` (where each sequence's
    queries start), every row to its own length. The PyTorch path reads
    ``groups``, built when first asked for: padded rectangles
    (:class:`AttentionGroup`), decodes (one query) apart from prefills, so no
    layer loops over sequences; a kind is split further, by length, only where
    the padding saved is worth one more attention call
    (:func:`split_by_padding`), so a small batch has at most two groups. Give
    ``num_queries_per_kv`` (query heads per KV head) so their masks are built
    folded for grouped-query attention.
    """

    def __init__(self, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                 block_size: int, device, num_queries_per_kv: int = 1, slot_mapping: list[int] | None = None):
        self.block_size = block_size
        self.num_queries_per_kv = num_queries_per_kv
        self.num_tokens = sum(query_lens)
        if slot_mapping is None:  # the block manager's rule (chapter 04), for batches built by hand
            slot_mapping = [s for table, ctx, n in zip(block_tables, context_lens, query_lens)
                            for s in slots(table, ctx - n, ctx, block_size)]
        self.slot_mapping = torch.tensor(slot_mapping, dtype=torch.long, device=device)
        self._varlen_metadata(block_tables, context_lens, query_lens, device)
        self._rows = (block_tables, context_lens, query_lens, device)

    @functools.cached_property
    def groups(self) -> list[AttentionGroup]:
        """The padded groups the PyTorch path attends (chapter 05), built on first use, once per step."""
        block_tables, context_lens, query_lens, device = self._rows
        starts = [0, *itertools.accumulate(query_lens)][:-1]  # where each sequence's tokens begin
        groups = []
        for wanted in (lambda n: n == 1, lambda n: n > 1):
            rows = sorted((b for b, n in enumerate(query_lens) if wanted(n)), key=lambda b: len(block_tables[b]))
            for part in split_by_padding(rows, [len(block_tables[b]) * self.block_size for b in rows],
                                         [query_lens[b] for b in rows]):  # in step order (free in a group)
                groups.append(self._group(sorted(part), block_tables, context_lens, query_lens, starts, device))
        return groups

    @functools.cached_property
    def prompt_split(self) -> tuple[KernelRows | None, KernelRows] | None:
        """The step cut for the C++ table's two attention kernels (chapter 18), once per step: ``(the rest, the
        prompts)``, the prompts being the sequences with at least :data:`PREFILL_MIN_QUERIES` queries (whole prompts
        and chunks after cached keys alike) and the rest None where it has no query; None where no sequence is a
        prompt (``paged_attention`` takes the whole step)."""
        rows = getattr(self, "_rows", None)  # None: a decode-only batch (for_decode)
        if rows is None:
            return None
        query_lens = rows[2]
        prompt = [n >= PREFILL_MIN_QUERIES for n in query_lens]
        if not any(prompt):
            return None
        starts = [0, *itertools.accumulate(query_lens)]
        rest = [b for b, p in enumerate(prompt) if not p]
        parts = [self._kernel_rows(seqs, starts) if sum(query_lens[b] for b in seqs) else None
                 for seqs in (rest, [b for b, p in enumerate(prompt) if p])]
        return parts[0], parts[1]

    def _kernel_rows(self, seqs: list[int], starts: list[int]) -> KernelRows:
        """:class:`KernelRows` of the sequences ``seqs`` (in step order), whose tokens begin at ``starts``."""
        device = self.block_table.device
        counts = [starts[b + 1] - starts[b] for b in seqs]
        if seqs == list(range(seqs[0], seqs[-1] + 1)):
            tokens = slice(starts[seqs[0]], starts[seqs[-1] + 1])
        else:
            tokens = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in seqs]).to(device)
        index = torch.tensor(seqs, device=device)
        return KernelRows(tokens, self.block_table[index].contiguous(), self.context_lens[index].contiguous(),
                          torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device=device))

    def write_slots(self, scratch_slot: int) -> torch.Tensor:
        """``slot_mapping`` with every -1 (a padding row) sent to ``scratch_slot``; built once per step."""
        cached = getattr(self, "_write_slots", None)
        if cached is None or cached[0] != scratch_slot:
            mapped = torch.where(self.slot_mapping < 0, scratch_slot, self.slot_mapping)
            cached = self._write_slots = (scratch_slot, mapped)
        return cached[1]

    def _varlen_metadata(self, block_tables, context_lens, query_lens, device) -> None:
        """What :data:`VARLEN` reads: cumulative query starts, context lengths and the int32 block tables."""
        width = max(map(len, block_tables), default=1)
        self.cu_seq_q = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device)
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
        self.cu_seq_k = torch.tensor([0, *itertools.accumulate(context_lens)], dtype=torch.int32, device=device)
        self.block_table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32,
                                        device=device)
        self.max_q, self.max_k = max(query_lens, default=1), max(context_lens, default=1)

    @classmethod
    def for_decode(cls, block_tables: torch.Tensor, context_lens: torch.Tensor, slot_mapping: torch.Tensor,
                   block_size: int, num_queries_per_kv: int = 1) -> PagedBatch:
        """A decode-only batch (one query per row) from device tensors, by tensor ops alone (chapter 12).

        Nothing here reads a tensor back to the host, so a CUDA graph can
        capture it and a replay rebuilds the masks from the static buffers.
        A padding row has context length 1 and slot -1: it reads key 0 of
        block 0 (its output is dropped) and writes nowhere.
        """
        self = cls.__new__(cls)
        B, W = block_tables.shape
        device = block_tables.device
        self.block_size, self.num_queries_per_kv, self.num_tokens = block_size, num_queries_per_kv, B
        self.slot_mapping = slot_mapping
        rows = torch.arange(B, device=device)
        mask = (torch.arange(W * block_size, device=device)[None, :] < context_lens[:, None]).unsqueeze(1)
        self.groups = [AttentionGroup(block_tables, mask, fold_mask(mask, num_queries_per_kv), rows[:, None],
                                      torch.ones(B, 1, dtype=torch.bool, device=device), rows, True, True,
                                      context_lens.long())]
        self.cu_seq_q = torch.arange(B + 1, dtype=torch.int32, device=device)
        self.context_lens = context_lens.to(torch.int32)
        self.cu_seq_k = torch.cat([torch.zeros(1, dtype=torch.int32, device=device),
                                   torch.cumsum(self.context_lens, 0, dtype=torch.int32)])
        self.block_table = block_tables.to(torch.int32)
        self.max_q, self.max_k = 1, W * block_size
        return self

    def _group(
        self, rows, block_tables, context_lens, query_lens, starts, device
    ) -> AttentionGroup:
        bs = self.block_size
        ctx = torch.tensor([context_lens[b] for b in rows], device=device)
        qlen = torch.tensor([query_lens[b] for b in rows], device=device)
        start = torch.tensor([starts[b] for b in rows], device=device)
        width = max(len(block_tables[b]) for b in rows)
        tables = torch.tensor(
            [block_tables[b] + [0] * (width - len(block_tables[b])) for b in rows],
            dtype=torch.long,
            device=device,
        )
        max_q = int(qlen.max())
        key_pos = torch.arange(width * bs, device=device)  # keys are read whole blocks at a time
        i = torch.arange(max_q, device=device)
        valid = i < qlen[:, None]  # [B, Lq]
        query_pos = ctx[:, None] - qlen[:, None] + i  # global position of each query row
        # [B, Lq, S]; also hides unused slots
        mask = key_pos[None, None, :] <= query_pos[:, :, None]
        mask &= valid[:, :, None]
        mask[:, :, 0] |= ~valid  # padded rows see one key, so softmax stays finite
        query_index = torch.where(valid, start[:, None] + i, 0)
        every_token = max_q == 1 and [starts[b] for b in rows] == list(range(self.num_tokens))
        fresh = max_q > 1 and all(context_lens[b] == query_lens[b] for b in rows)
        spans = tuple((starts[b], query_lens[b]) for b in rows) if fresh else ()
        return AttentionGroup(
            tables,
            mask,
            fold_mask(mask, self.num_queries_per_kv),
            query_index,
            valid,
            query_index[valid],
            bool(qlen.min() == max_q),
            every_token,
            ctx,
            fresh,
            spans,
        )


def split_by_padding(rows: list, key_lens: list[int], query_lens: list[int], max_groups: int = MAX_GROUPS,
                     min_saving: int = 1024, gather_cost: int = 6) -> list[list]:
    """Cut ``rows`` (sorted by ``key_lens``) into at most ``max_groups`` runs padded separately.

    A padded group of ``n`` rows costs ``n x longest key x (longest query +
    gather_cost)``: the query-key pairs of attention, plus copying each key and
    value out of the pool (worth about ``gather_cost`` queries). The cut that
    saves the most is made while it saves at least ``min_saving`` (about what
    one more attention call per layer costs), so similar lengths share a group
    and a lone long sequence gets its own. Each cut is found in one pass over
    the rows (running maxima of the query lengths from both ends).
    """
    def best_cut(lo, hi):
        """The cut of ``rows[lo:hi]`` that saves the most, as (saving, cut)."""
        suffix_q = [0] * (hi - lo + 1)
        for r in range(hi - 1, lo - 1, -1):
            suffix_q[r - lo] = max(query_lens[r], suffix_q[r - lo + 1])
        whole = (hi - lo) * key_lens[hi - 1] * (suffix_q[0] + gather_cost)
        best, prefix_q = (0, None), 0
        for cut in range(lo + 1, hi):
            prefix_q = max(prefix_q, query_lens[cut - 1])
            left = (cut - lo) * key_lens[cut - 1] * (prefix_q + gather_cost)
            right = (hi - cut) * key_lens[hi - 1] * (suffix_q[cut - lo] + gather_cost)
            if whole - left - right > best[0]:
                best = (whole - left - right, cut)
        return best

    runs = [(0, len(rows))] if rows else []
    while runs and len(runs) < max_groups:
        (saving, cut), r = max(((best_cut(lo, hi), r) for r, (lo, hi) in enumerate(runs)), key=lambda x: x[0][0])
        if cut is None or saving < min_saving:
            break
        lo, hi = runs[r]
        runs[r:r + 1] = [(lo, cut), (cut, hi)]
    return [rows[lo:hi] for lo, hi in runs]


class PagedKVCache:
    """Per-layer K/V pools ``[num_blocks, block_size, kv_heads, head_dim]`` (chapter 05).

    ``forward`` writes the step's keys and values through the slot mapping and
    attends: with a kernel table's ``paged_attention`` (``ops``: the C++
    kernels on the CPU, Triton's on CUDA; chapter 18), every row of the step in
    one call, each through its block table to its own length; else by
    gathering each sequence's keys through its block table (or, where
    :func:`choose_attention_kernel` finds it, with ``varlen_attn`` over the
    block table). ``attention_kernel`` says which. Whole blocks move between
    pools with :meth:`copy_blocks` (a fork's copy on write) and :meth:`swap`
    (to and from the CPU pool, chapter 10; pinned and on a side stream on CUDA,
    see :class:`~minivllm.copy_stream.BlockCopier`).

    Each layer's pool has one scratch slot after its last block: a slot
    mapping of -1 (a CUDA graph's padding row, chapter 12) writes there (or,
    through a kernel's ``write_kv``, nowhere), and no block table reaches it,
    so padding rows write nowhere that is read. ``k_slots`` and ``v_slots`` are
    the pools as flat slots with the scratch slot last, so
    ``k_slots[layer][slot_mapping] = k`` sends -1 there too (how exercise 05's
    backend writes).

    This class is the interface and the pools (an extension point,
    ``attention_backend``): exercise 05 subclasses it and writes
    :meth:`forward`; minivllm's own is :class:`MiniPagedKVCache`'s.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype=torch.float32, device="cpu", num_cpu_blocks: int = 0, num_queries_per_kv: int = 1,
                 attention_kernel: str | None = None, num_offload_blocks: int = 0, ops=kernels.reference):
        self.scratch_slot = num_blocks * block_size
        store = (num_layers, self.scratch_slot + 1, num_kv_heads, head_dim)  # [layer, slot (+ scratch), head, dim]
        self.k_slots = torch.zeros(store, dtype=dtype, device=device)
        self.v_slots = torch.zeros(store, dtype=dtype, device=device)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = self.k_slots[:, :self.scratch_slot].view(shape)
        self.v = self.v_slots[:, :self.scratch_slot].view(shape)
        # The swap space (chapter 10): the same layout in host memory, pinned on CUDA for fast copies.
        cpu_shape = (num_layers, num_cpu_blocks, block_size, num_kv_heads, head_dim)
        pin = torch.device(device).type == "cuda"
        self.cpu_k = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)
        self.cpu_v = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)
        tier_shape = (num_layers, num_offload_blocks, block_size, num_kv_heads, head_dim)  # the offload tier (ch. 14)
        self.tier_k = torch.zeros(tier_shape, dtype=dtype, pin_memory=pin)
        self.tier_v = torch.zeros(tier_shape, dtype=dtype, pin_memory=pin)
        self.block_size = block_size
        self.copier = BlockCopier(torch.device(device))
        self.ops = ops if ops is not kernels.reference else None  # a kernel table with paged_attention, or None
        self.attention_kernel = attention_kernel or (PAGED_KERNEL if self.ops is not None else
                                                     choose_attention_kernel(device, dtype, num_queries_per_kv))
        self.num_queries_per_kv = num_queries_per_kv
        self.fused_decode = True  # a model on the C++ table may run a few-row decode step's layers in one call that
        # writes these pools (chapter 18; EngineConfig.fused_decode): only through MiniPagedKVCache's own forward

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, num_offload_blocks: int = 0):
        """Pools for ``model``'s layers and KV heads, attended with the model's kernel table (chapter 18)."""
        c, p = model.config, next(model.parameters())
        return cls(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, model.head_dim,
                   p.dtype, p.device, num_cpu_blocks, c.num_attention_heads // c.num_key_value_heads,
                   num_offload_blocks=num_offload_blocks, ops=getattr(model, "ops", kernels.reference))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole device blocks, every layer: (source, destination) pairs."""
        if not pairs:
            return
        src, dst = (torch.tensor(x, dtype=torch.long, device=self.k.device) for x in zip(*pairs))
        for pool in (self.k, self.v):
            pool[:, dst] = pool[:, src]

    def swap(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        """Copy whole blocks, every layer: (device, cpu) pairs to the CPU pool, or (cpu, device) pairs back."""
        self._host_copy(((self.k, self.cpu_k), (self.v, self.cpu_v)), pairs, to_cpu)

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """Evicted cached blocks to the CPU offload tier: (device block, tier slot) pairs (chapter 14)."""
        self._host_copy(((self.k, self.tier_k), (self.v, self.tier_v)), pairs, True)

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """Offloaded blocks back into fresh device blocks: (tier slot, device block) pairs (chapter 14)."""
        self._host_copy(((self.k, self.tier_k), (self.v, self.tier_v)), pairs, False)

    def _host_copy(self, pools, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        """Whole blocks between each (device pool, host pool): out, or back in."""
        if not pairs:
            return
        if self.copier.asynchronous:  # CUDA: pinned copies on a side stream, ordered by events
            self.copier.swap(pools, pairs, to_cpu)
            return
        src_ids, dst_ids = (torch.tensor(x, dtype=torch.long) for x in zip(*pairs))
        for dev, cpu in pools:
            if to_cpu:  # a synchronous copy: the blocks may be reused by this very step
                cpu[:, dst_ids] = dev[:, src_ids.to(dev.device)].cpu()
            else:
                dev[:, dst_ids.to(dev.device)] = cpu[:, src_ids].to(dev.device)

    @staticmethod
    def bytes_per_token(model) -> int:
        """K and V, every layer: 2 * layers * kv_heads * head_dim * element size."""
        c, p = model.config, next(model.parameters())
        return 2 * c.num_hidden_layers * c.num_key_value_heads * model.head_dim * p.element_size()

    def forward(self, layer: int, q, k, v, positions, batch: PagedBatch):
        """The step's attention output ``[tokens, heads, head_dim]`` for layer ``layer``: first write the step's
        keys and values ``k``, ``v`` at ``batch.slot_mapping`` (through ``self.k_slots[layer]`` and
        ``self.v_slots[layer]``, where -1 is the scratch slot), then attend each group of ``batch.groups``
        through its block tables and mask. Exercise 05 (a subclass that overrides it sets
        ``forward.skips_padding_slots = True`` when slot -1 writes only the scratch slot: CUDA graphs rely on it)."""
        raise NotImplementedError("not written yet: PagedKVCache.forward")


class MiniPagedKVCache(PagedKVCache):
    """minivllm's own paged KV cache (the engine's default ``attention_backend``): exercise 05's ``forward``, by the
    kernel table's ``paged_attention`` where the model has one (chapter 18), else by the PyTorch attention
    :func:`choose_attention_kernel` chose (``attention_kernel`` says which)."""

    def forward(self, layer: int, q, k, v, positions, batch: PagedBatch):
        # every row in one call, to its own length (chapter 18)
        if self.attention_kernel == PAGED_KERNEL:
            k_slots, v_slots = self.k_slots[layer], self.v_slots[layer]
            self.ops.write_kv(k, v, k_slots, v_slots, batch.slot_mapping)
            split = batch.prompt_split if getattr(self.ops, "tiled_prefill", False) else None
            if split is not None:  # prompts by prefill_attention, the rest by paged_attention
                return self._attend_split(split, q, k_slots, v_slots)
            return self.ops.paged_attention(q, k_slots, v_slots, batch.block_table,
                                            batch.context_lens, batch.cu_seq_q, self.block_size)
        k_pool, v_pool = self.k[layer], self.v[layer]
        write = batch.write_slots(self.scratch_slot)  # -1: the scratch slot
        self.k_slots[layer].index_copy_(0, write, k)
        self.v_slots[layer].index_copy_(0, write, v)
        if self.attention_kernel == VARLEN:
            return varlen_paged(q, k_pool, v_pool, batch)
        out = None if batch.groups and batch.groups[0].every_token else torch.empty_like(q)
        for g in batch.groups:
            if g.fresh and self._attends_prompts_alone(q.device):
                # a whole prompt: its keys are this step's, already in k and v
                for start, n in g.spans:
                    rows = slice(start, start + n)
                    # [1, heads, n, D]
                    o = attend_fresh(*(t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v)))
                    out[rows] = o[0].transpose(0, 1)
                continue
            # [B, heads, Lq, D]
            queries = q.unsqueeze(2) if g.every_token else q[g.query_index].transpose(1, 2)
            o = self._attend_group(g, queries, k_pool, v_pool)  # [B, Lq, heads, D]
            if g.every_token:  # a decode-only step: row b is token b
                return o.flatten(0, 1)
            # decodes: no padding rows
            out[g.out_index] = o.flatten(0, 1) if g.all_valid else o[g.valid]
        return out

    def _attend_split(self, split: tuple[KernelRows | None, KernelRows], q, k_slots, v_slots) -> torch.Tensor:
        """A step with prompts on the C++ table (chapter 18): :attr:`PagedBatch.prompt_split`'s rest by
        ``paged_attention``, its prompts by ``prefill_attention``, both reading the pool in place."""
        rest, prompts = split
        if rest is None:  # every query of the step is a prompt's, in step order
            return self.ops.prefill_attention(q, k_slots, v_slots, prompts.block_table, prompts.context_lens,
                                              prompts.cu_seq_q, self.block_size)
        out = torch.empty_like(q)
        for rows, attention in ((rest, self.ops.paged_attention), (prompts, self.ops.prefill_attention)):
            out[rows.tokens] = attention(q[rows.tokens], k_slots, v_slots, rows.block_table, rows.context_lens,
                                         rows.cu_seq_q, self.block_size)
        return out

    def _attends_prompts_alone(self, device: torch.device) -> bool:
        """Whether a fresh group's prompts are attended one by one from the step's keys (chapter 12): unpadded,
        nothing gathered from the pool, no mask. On the CPU only, where it was measured: a GPU keeps one padded
        call a group rather than a kernel launch a prompt. Where a subclass attends its own way (``_attend_group``),
        or SDPA has no ``enable_gqa``, every group goes through ``_attend_group``."""
        return (device.type == "cpu" and type(self)._attend_group is MiniPagedKVCache._attend_group
                and causal_gqa_supported())

    def _attend_group(self, g: AttentionGroup, queries, k_pool, v_pool) -> torch.Tensor:
        """One group's output ``[B, Lq, heads, D]``: the group's blocks gathered, then a group of fresh prompts by
        SDPA's causal rule, any other by the group's mask."""
        B, W = g.block_tables.shape  # gather whole blocks, then see them as one run of keys
        _, block_size, kv_heads, d = k_pool.shape
        flat = g.block_tables.flatten()
        keys = k_pool.index_select(0, flat).view(B, W * block_size, kv_heads, d).transpose(1, 2)
        values = v_pool.index_select(0, flat).view(B, W * block_size, kv_heads, d).transpose(1, 2)
        if g.fresh and causal_gqa_supported():
            return attend_fresh(queries, keys, values).transpose(1, 2)
        return attend(queries, keys, values, g.additive_mask(queries.dtype)).transpose(1, 2)

    forward.skips_padding_slots = True  # a subclass that overrides forward must say so itself (CUDA graphs rely on it)


def varlen_attn_fn():
    """torch's ``varlen_attn`` (FlashAttention over flat tokens, with a block table), or None in older torch."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # torch >= 2.10; only on the CUDA path
    except ImportError:
        return None
    return varlen_attn if "block_table" in inspect.signature(varlen_attn).parameters else None


def varlen_paged(q, k_pool, v_pool, batch: PagedBatch) -> torch.Tensor:
    """Attention straight from the pools ``[blocks, block_size, kv_heads, dim]`` through the block table.

    Causal with the diagonal at each sequence's end (bottom right), which is
    exactly chapter 02's rule for a chunk at the end of its context.
    """
    return varlen_attn_fn()(q, k_pool, v_pool, batch.cu_seq_q, batch.cu_seq_k, batch.max_q, batch.max_k,
                            window_size=(-1, 0), enable_gqa=True, seqused_k=batch.context_lens,
                            block_table=batch.block_table)


def choose_attention_kernel(device, dtype, num_queries_per_kv: int = 1) -> str:
    """The best PyTorch attention this device runs correctly, chosen once when the pool is built (chapter 12).

    :data:`VARLEN` needs CUDA, Ampere or newer (FlashAttention), fp16/bf16 and
    a torch with ``varlen_attn(block_table=...)``, and must agree with
    :data:`GATHER` on a probe batch (a chunk after cached keys and decodes,
    grouped-query heads); anything else gets :data:`GATHER`. (A model with a
    kernel table attends with its ``paged_attention`` instead, chapter 18.)
    """
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or varlen_attn_fn() is None:
        return GATHER
    if torch.cuda.get_device_capability(device)[0] < 8:
        return GATHER
    return VARLEN if _agrees_safely(VARLEN, device, dtype, num_queries_per_kv) else GATHER


def _agrees_safely(kernel: str, device, dtype, group: int) -> bool:
    """:func:`_agrees`, where a kernel that raises (a refused block size) does not agree."""
    try:
        return _agrees(kernel, device, dtype, group)
    except Exception:  # the gather path is always right
        return False


@torch.inference_mode()
def _agrees(kernel: str, device, dtype, group: int, block_size: int = 16, kv_heads: int = 2, d: int = 64) -> bool:
    """Run one probe batch through ``kernel`` and :data:`GATHER` and compare (fp32 1e-4, else bf16 tolerance)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    reference = MiniPagedKVCache(1, 12, block_size, kv_heads, d, dtype, device, attention_kernel=GATHER)
    fast = MiniPagedKVCache(1, 12, block_size, kv_heads, d, dtype, device, attention_kernel=kernel)
    batch = PagedBatch([[3, 1, 4], [5], [7, 9]], [40, 9, 20], [8, 1, 1], block_size, device, group)
    shapes = ((batch.num_tokens, kv_heads * group, d), (batch.num_tokens, kv_heads, d))
    pools = torch.randn((2, *reference.k.shape), generator=g)
    for cache in (reference, fast):
        cache.k.copy_(pools[0])
        cache.v.copy_(pools[1])
    q, k, v = (torch.randn(shape, generator=g).to(device, dtype) for shape in (shapes[0], shapes[1], shapes[1]))
    expected = reference.forward(0, q, k, v, None, batch)
    got = fast.forward(0, q, k, v, None, batch)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    return kernel == fast.attention_kernel and bool(torch.allclose(got.float(), expected.float(), atol=tolerance,
                                                                   rtol=tolerance))
