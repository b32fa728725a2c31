"""Chapter 05, paged attention: the check of the reader's attention backend, a ``PagedKVCache`` subclass
whose ``forward(layer, q, k, v, positions, batch)`` writes a step's keys and values through the slot mapping
and attends each group of the step's ``PagedBatch`` through its block tables. Targeted steps on small random
pools against one ``ContiguousKVCache`` per sequence, then the live engine on SmolLM2.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from minivllm.attention import ContiguousKVCache, MiniPagedKVCache, PagedBatch
from minivllm.block_manager import slots
from minivllm.exercises._common import own_part, say
from minivllm.exercises.live import chat_prompts, check_live, greedy
from minivllm.models import load_tokenizer

__all__ = ["check_paged_attention", "METHODS"]

METHODS = ("forward",)  # what exercise 05 writes

LAYERS, LAYER = 2, 1  # the step runs layer 1 of 2: layer 0's pools must stay untouched


@dataclasses.dataclass
class _Case:
    what: str
    heads: int
    kv_heads: int
    block_size: int
    seqs: list[tuple[int, int]]  # (query_len, context_len) per sequence, in the step's flat order
    head_dim: int = 8
    seed: int = 0


_CASES = [
    _Case("one prompt prefilled from scratch", 4, 2, 4, [(6, 6)]),
    _Case("a decode and a prefill chunk (chapter 05's picture)", 6, 2, 4, [(1, 9), (5, 13)], seed=1),
    _Case("two decodes, a fresh prompt and a prefill chunk, mixed", 6, 2, 4, [(1, 9), (1, 17), (7, 7), (5, 13)], seed=2),
    _Case("several groups: a long decode split from short ones, prefill chunks of different lengths", 6, 3, 4,
          [(1, 3), (2, 10), (1, 6), (1, 300), (3, 3), (1, 5), (4, 21)], seed=3),
    _Case("multi-head attention (one query head per KV head), block size 1", 3, 3, 1, [(1, 4), (3, 5), (2, 2)], seed=4),
]


class _Step:
    """One step of a case: pools holding each sequence's history (and stale values elsewhere), its batch and tensors."""

    def __init__(self, case: _Case, cls):
        g = torch.Generator().manual_seed(case.seed)
        h, kvh, d, bs = case.heads, case.kv_heads, case.head_dim, case.block_size
        need = [math.ceil(c / bs) for _, c in case.seqs]
        self.num_blocks = sum(need) + 2
        order = torch.randperm(self.num_blocks, generator=g).tolist()  # scattered tables, not in order
        self.tables = [[order.pop() for _ in range(n)] for n in need]
        self.case, self.cache = case, cls(LAYERS, self.num_blocks, bs, kvh, d)
        self.cache.k.copy_(torch.randn(self.cache.k.shape, generator=g))  # stale values in every slot
        self.cache.v.copy_(torch.randn(self.cache.v.shape, generator=g))
        self.qkv = [(torch.randn(c, h, d, generator=g), torch.randn(c, kvh, d, generator=g),
                     torch.randn(c, kvh, d, generator=g)) for _, c in case.seqs]
        for (n, c), table, (_, k, v) in zip(case.seqs, self.tables, self.qkv):  # earlier steps wrote the history
            history = torch.tensor(slots(table, 0, c - n, bs), dtype=torch.long)
            self.cache.k[LAYER].view(-1, kvh, d)[history] = k[: c - n]
            self.cache.v[LAYER].view(-1, kvh, d)[history] = v[: c - n]
        self.batch = PagedBatch(self.tables, [c for _, c in case.seqs], [n for n, _ in case.seqs], bs, "cpu", h // kvh)
        self.q, self.k, self.v = (torch.cat([t[x][c - n:] for (n, c), t in zip(case.seqs, self.qkv)]) for x in range(3))
        self.positions = torch.tensor([p for n, c in case.seqs for p in range(c - n, c)])
        self.pools_before = self.cache.k.clone(), self.cache.v.clone()

    def expected(self) -> torch.Tensor:
        """One contiguous cache per sequence, fed its history and then this step's queries."""
        c_ = self.case
        outs = []
        for (n, c), (q, k, v) in zip(c_.seqs, self.qkv):
            cache = ContiguousKVCache(1, c_.kv_heads, c_.head_dim, c)
            if c > n:
                cache.forward(0, q[: c - n], k[: c - n], v[: c - n], torch.arange(c - n))
            outs.append(cache.forward(0, q[c - n:], k[c - n:], v[c - n:], torch.arange(c - n, c)))
        return torch.cat(outs)

    def minivllm(self, q=None, k=None, v=None, batch=None) -> torch.Tensor:
        """minivllm's own forward on a copy of the pools as they were before the step."""
        c_ = self.case
        cache = MiniPagedKVCache(LAYERS, self.num_blocks, c_.block_size, c_.kv_heads, c_.head_dim)
        cache.k.copy_(self.pools_before[0])
        cache.v.copy_(self.pools_before[1])
        return cache.forward(LAYER, self.q if q is None else q, self.k if k is None else k,
                             self.v if v is None else v, self.positions, batch or self.batch)

    def mistakes(self) -> dict[str, torch.Tensor]:
        """What characteristic mistakes compute on this step, by the hint that names them."""
        c_ = self.case
        kvh, d = c_.kv_heads, c_.head_dim
        flat_k, flat_v = (p[LAYER].view(-1, kvh, d) for p in self.pools_before)
        out = {"the keys were read before this step's keys and values were written: write them through "
               "batch.slot_mapping first, then gather (a query must see its own key)":
               self.minivllm(k=flat_k[self.batch.slot_mapping], v=flat_v[self.batch.slot_mapping])}
        # each mistake is minivllm's forward reading a wrong mask; fresh=False, so no group takes the causal rule
        ones = [dataclasses.replace(g, mask=torch.ones_like(g.mask), folded_mask=torch.ones_like(g.folded_mask),
                                    fresh=False) for g in self.batch.groups]
        out["the mask was ignored: each query may see only its sequence's keys up to its own position "
            "(g.mask; whole blocks hold unwritten slots and padding)"] = self.minivllm(batch=_with_groups(self.batch, ones))
        if any(g.mask.shape[1] == 1 for g in self.batch.groups):
            decode_unmasked = [dataclasses.replace(g, mask=torch.ones_like(g.mask), folded_mask=torch.ones_like(
                g.folded_mask), fresh=False) if g.mask.shape[1] == 1 else g for g in self.batch.groups]
            out["a decode group (one query per row) was attended without its mask: a decode query may see every key "
                "of its own sequence, but its row's whole blocks also hold slots past its last token and padding "
                "blocks (block 0, another sequence's keys); g.mask hides them, so apply it to every group"] = \
                self.minivllm(batch=_with_groups(self.batch, decode_unmasked))
        flipped = [dataclasses.replace(g, mask=~g.mask, folded_mask=~g.folded_mask, fresh=False)
                   for g in self.batch.groups]
        out["the mask is flipped: True in g.mask means 'may attend' (scores.masked_fill(~mask, -inf))"] = \
            self.minivllm(batch=_with_groups(self.batch, flipped))
        if c_.heads > kvh:
            perm = sorted(range(c_.heads), key=lambda i: (i % kvh, i))  # query head h reads KV head h % kv_heads
            tiled = torch.empty_like(self.q)
            tiled[:, perm] = self.minivllm(q=self.q[:, perm])
            out["query head h reads KV head h // (heads // kv_heads) (repeat_interleave), not h % kv_heads "
                "(repeat)"] = tiled
        return out


def _with_groups(batch: PagedBatch, groups) -> PagedBatch:
    other = PagedBatch.__new__(PagedBatch)
    other.__dict__.update(batch.__dict__, groups=groups)
    return other


def _padding_targets(batch: PagedBatch) -> set[int]:
    return {int(i) for g in batch.groups for i in g.query_index[~g.valid]}


def _hint(step: _Step, got: torch.Tensor, expected: torch.Tensor) -> str:
    if torch.isnan(got).any():
        return ("some outputs are NaN: a query row saw no key; is the mask flipped? True in g.mask means "
                "'may attend' (scores.masked_fill(~mask, -inf))")
    for hint, wrong in step.mistakes().items():
        if torch.allclose(got, wrong, atol=1e-5):
            return hint
    rows = {int(r) for r in ((got - expected).abs() > 1e-5).flatten(1).any(1).nonzero().flatten()}
    if rows and rows <= _padding_targets(step.batch):
        return (f"the output of token(s) {sorted(rows)} was overwritten by padding rows (valid False, query_index 0): "
                f"drop them: out[g.out_index] = o[g.valid]")
    return "each token's output must equal attention over its own sequence's keys up to its position"


def _check_step(cls, case: _Case) -> None:
    step = _Step(case, cls)
    what = f"{case.what} (query, context lengths {case.seqs}, {case.heads} heads, {case.kv_heads} KV heads, " \
           f"block size {case.block_size})"
    try:
        got = step.cache.forward(LAYER, step.q.clone(), step.k.clone(), step.v.clone(), step.positions, step.batch)
    except (RuntimeError, IndexError) as e:
        hint = ""
        if "shape" in str(e) or "size" in str(e):
            hint = ("; a group's attention output has B x Lq rows, padding rows included: keep o[g.valid] for "
                    "out[g.out_index]")
        raise AssertionError(f"{what}: forward raised {type(e).__name__}: {str(e).splitlines()[0]}{hint}") from None
    expected = step.expected()
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise AssertionError(f"{what}: forward must return [tokens, heads, head_dim] = {tuple(expected.shape)}, "
                             f"like q; got {shape}")
    err = (got - expected).abs().max().item()
    if not err <= 1e-5:
        raise AssertionError(f"{what}: the output differs from one ContiguousKVCache per sequence by up to {err:.3g} "
                             f"(tolerance 1e-5); {_hint(step, got, expected)}")
    kvh, d = case.kv_heads, case.head_dim
    for name, pool, new, before in (("keys", step.cache.k, step.k, step.pools_before[0]),
                                    ("values", step.cache.v, step.v, step.pools_before[1])):
        if not torch.equal(pool[LAYER].view(-1, kvh, d)[step.batch.slot_mapping], new):
            raise AssertionError(f"{what}: after forward the step's {name} are not in layer {LAYER}'s pool at "
                                 f"batch.slot_mapping: later steps read them from there (self.k[layer], self.v[layer])")
        if not torch.equal(pool[1 - LAYER], before[1 - LAYER]):
            raise AssertionError(f"{what}: forward for layer {LAYER} changed layer {1 - LAYER}'s pool: write into "
                                 f"self.k[layer] and self.v[layer] only")


_PADDED = _Case("two decodes padded to a batch of four as a CUDA-graph replay pads it (chapter 12: padding rows have "
                "slot -1, context length 1 and block 0 as their table)", 4, 2, 4, [(1, 9), (1, 5)], seed=5)


def _check_padding(cls, case: _Case = _PADDED, pad: int = 2) -> None:
    """Padding rows (slot -1) must write no real slot, and the real rows' outputs stay right."""
    step = _Step(case, cls)
    w, kvh, d = max(map(len, step.tables)), case.kv_heads, case.head_dim
    tables = torch.tensor([t + [0] * (w - len(t)) for t in step.tables] + [[0] * w] * pad)
    context = torch.tensor([c for _, c in case.seqs] + [1] * pad)
    real = step.batch.slot_mapping.tolist()
    slot_mapping = torch.tensor(real + [-1] * pad)
    batch = PagedBatch.for_decode(tables, context, slot_mapping, case.block_size, case.heads // kvh)
    g = torch.Generator().manual_seed(case.seed + 100)
    q, k, v = (torch.cat([x, torch.randn(pad, *x.shape[1:], generator=g)]) for x in (step.q, step.k, step.v))
    positions = torch.cat([step.positions, torch.zeros(pad, dtype=torch.long)])
    what = f"{case.what}"
    try:
        got = step.cache.forward(LAYER, q, k, v, positions, batch)
    except (RuntimeError, IndexError) as e:
        raise AssertionError(f"{what}: forward raised {type(e).__name__} on slot -1: {str(e).splitlines()[0]}; write "
                             "through self.k_slots[layer] and self.v_slots[layer], where slot -1 is the scratch "
                             "slot") from None
    for name, pool, before in (("key", step.cache.k, step.pools_before[0]), ("value", step.cache.v, step.pools_before[1])):
        changed = set((pool[LAYER] != before[LAYER]).reshape(-1, kvh * d).any(1).nonzero().flatten().tolist())
        if changed - set(real):
            s = min(changed - set(real))
            raise AssertionError(f"{what}: a padding row wrote its {name} into slot {s} (offset "
                                 f"{s % case.block_size} of block {s // case.block_size}), which holds a real "
                                 "sequence's KV; on a GPU that corrupts it. Write through self.k_slots[layer] and "
                                 "self.v_slots[layer], whose slot -1 is the scratch slot no block table reaches, not "
                                 "self.k[layer].view(-1, ...), whose slot -1 is the pool's last real slot")
    expected = step.expected()
    if not isinstance(got, torch.Tensor) or got.shape[0] != len(real) + pad or \
            not (got[:len(real)] - expected).abs().max().item() <= 1e-5:
        raise AssertionError(f"{what}: the real rows' outputs differ from one ContiguousKVCache per sequence; a "
                             "padding row's output is dropped (valid/out_index), it must not change the others'")


def check_paged_attention(cls, live: bool = True) -> None:
    """Check a ``PagedKVCache`` subclass's ``forward`` (chapter 05).

    Targeted steps (a prompt from scratch; decodes, fresh prompts and prefill
    chunks mixed; several groups; grouped and plain heads) on small pools full
    of stale values: the output must match one ``ContiguousKVCache`` per
    sequence within 1e-5 and the step's keys and values must land at the slot
    mapping of the right layer; a decode batch padded as chapter 12's CUDA
    graphs pad it (slot -1) must write no real slot. The first failure stops the check. Then, unless
    ``live=False``, SmolLM2 runs in the live engine with the class as its attention backend, chunked prefill
    mixing decodes and chunks. An empty subclass is "not written yet".
    """
    cls = own_part(cls, METHODS, MiniPagedKVCache)
    for case in _CASES:
        _check_step(cls, case)
    _check_padding(cls)
    say(f"check_paged_attention: all {len(_CASES)} steps match one contiguous cache per sequence, and the new keys "
          f"and values are in the pool; padding rows of a replayed decode batch (slot -1) write no real slot.")
    if not live:
        return
    tok = load_tokenizer("smollm2-135m")
    short = [p for p in chat_prompts(tok, 4) if len(p) < 100]  # three chat questions of about 36 tokens
    requests = [(f"r{i}", p, greedy(6)) for i, p in enumerate(short)]
    check_live("your paged attention", requests, parts={"attention_backend": cls}, tokenizer=tok, block_size=4,
               num_blocks=64, max_num_seqs=3, enable_chunked_prefill=True, max_prefill_chunk_size=16,
               max_num_batched_tokens=32)  # chunks of 16 next to decodes, blocks of 4: every step mixes kinds
