"""Decode attention that reads the paged pool in place, compiled by ``torch.compile`` (chapter 12).

The eager path (:data:`~minivllm.attention.GATHER`) copies every sequence's
blocks out of the pool into one padded tensor, which SDPA then reads again.
:func:`paged_decode_attention` says the same computation without the copy:
the keys are *indexed* through the block table inside the score and output
sums, and Inductor turns that into loops that load each key straight from
its block. Eager PyTorch would materialise every intermediate (it is much
slower than the gather); compiled, it is one pass over the pool.

Compiling costs seconds, once per batch bucket: :class:`CompiledDecodeAttention`
pads the rows to a power of two (as CUDA graphs do), lets the block-table
width vary without recompiling, and counts the seconds it spent compiling.
Whether it is faster than the gather is a measurement, not a given: where the
gathered copy stays in the CPU's cache, both are bound by reading each
layer's KV from memory once (chapter 12 measures it in the engine).
"""

from __future__ import annotations

import math
import time

import torch

__all__ = ["COMPILED", "paged_decode_attention", "write_and_attend", "batch_bucket", "pad_to_bucket",
           "CompiledDecodeAttention"]

COMPILED = "compiled in-place decode"  # decode rows read the pool through the block table, compiled (CPU)

RECOMPILE_LIMIT = 64  # shapes one compiled function meets in a process (here buckets x dtypes x pool shapes; the
# compiled matvec's rows x weight shapes x models); torch's default (8) refuses the 9th


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """One query per row over its first ``context_lens[b]`` keys, read through ``block_tables[b]``.

    ``q`` is ``[B, heads, dim]``; the pools are ``[blocks, block_size,
    kv_heads, dim]``; ``block_tables`` is ``[B, W]``. Query head ``h`` reads
    KV head ``h // group``. Returns ``[B, heads, dim]``.

    The keys stay ``[B, W, block_size, kv_heads, dim]``, as the table hands
    them out, and the softmax and the sum of values run over (block, offset)
    together. Compiled, a key's address is then its block number times the
    block size plus its offset, with no division per key, and each key is
    loaded once for its KV head's whole group of queries. The softmax divides
    the weighted sum of values once, at the end, not every weight in the
    loop over keys (that saved about 8% of the time at 32 rows).
    """
    rows, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_pool.shape
    width = block_tables.shape[1]
    keys = k_pool[block_tables][..., None, :]  # [B, W, block_size, kv_heads, 1, dim]: an indexed load
    values = v_pool[block_tables][..., None, :]
    queries = q.view(rows, 1, 1, kv_heads, heads // kv_heads, dim)
    scores = (queries * keys).sum(-1) * (1.0 / math.sqrt(dim))  # [B, W, block_size, kv_heads, group]
    position = torch.arange(width * block_size, device=q.device).view(width, block_size)
    hidden = position >= context_lens[:, None, None]  # keys past the context (and the table's padding)
    scores = scores.masked_fill(hidden[..., None, None], float("-inf"))
    weights = (scores - scores.amax(dim=(1, 2), keepdim=True)).exp()  # a softmax over (block, offset), normalised below
    total = (weights[..., None] * values).sum(dim=(1, 2))  # [B, kv_heads, group, dim], unnormalised
    return (total / weights.sum(dim=(1, 2))[..., None]).reshape(rows, heads, dim)


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                     write: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """A decode step's whole attention for one layer: write ``k`` and ``v`` at slots ``write`` of the flat pools
    ``[slots + scratch, kv_heads, dim]``, then :func:`paged_decode_attention` over them, in place.

    Said in tensor ops alone, so ``compile_matvec`` traces it into a decoder
    layer's one compiled graph with the matmuls around it (chapter 12).
    """
    k_slots.index_copy_(0, write, k)
    v_slots.index_copy_(0, write, v)
    slots = k_slots.shape[0] - 1  # the last slot is the scratch slot, outside every block
    k_pool = k_slots[:slots].view(slots // block_size, block_size, *k_slots.shape[1:])
    v_pool = v_slots[:slots].view(slots // block_size, block_size, *v_slots.shape[1:])
    return paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens)


def batch_bucket(rows: int) -> int:
    """The padded batch a compiled call runs: the next power of two, so a few shapes cover every batch."""
    if rows < 1:
        raise ValueError(f"a decode batch needs at least 1 row, got {rows}")
    return 1 << (rows - 1).bit_length()


class CompiledDecodeAttention:
    """:func:`paged_decode_attention` under ``torch.compile``, padded to :func:`batch_bucket` rows.

    The block-table width is marked dynamic (one compile serves every
    context length); the batch is static per bucket, which keeps the loops
    fast. ``compile_seconds`` is the wall time of the calls that compiled
    (the first of each bucket, dtype and pool shape), ``buckets`` those
    shapes, ``bucket_sizes`` their batch buckets.
    """

    def __init__(self):
        config = torch._dynamo.config  # raised for the whole process: dynamo reads it as each call compiles
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        self.fn = torch.compile(paged_decode_attention, fullgraph=True, dynamic=False)
        self.compile_seconds = 0.0
        self.buckets: set[tuple] = set()  # (rows, dtype, pool shape, inference mode): one compile each

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({key[0] for key in self.buckets}))

    @torch.inference_mode()
    def warm_up(self, k_pool: torch.Tensor, v_pool: torch.Tensor, heads: int, max_rows: int) -> float:
        """Compile every bucket up to ``max_rows`` now (before anything is timed); the seconds it took."""
        start, rows = time.perf_counter(), 1
        while rows <= batch_bucket(max_rows):
            q = k_pool.new_zeros(rows, heads, k_pool.shape[-1])
            self(q, k_pool, v_pool, torch.zeros(rows, 2, dtype=torch.long, device=q.device),
                 torch.ones(rows, dtype=torch.long, device=q.device))
            rows *= 2
        return time.perf_counter() - start

    def __call__(self, q, k_pool, v_pool, block_tables, context_lens) -> torch.Tensor:
        """``paged_decode_attention`` of ``q``'s rows (``block_tables`` and ``context_lens`` may come padded)."""
        rows = q.shape[0]
        tables, context_lens = pad_to_bucket(block_tables, context_lens)
        padded = q.new_zeros(tables.shape[0], *q.shape[1:])  # the model's q is a view into the fused q/k/v:
        padded[:rows] = q  # copied into one layout (other strides would recompile), padding rows zero
        key = (tables.shape[0], q.dtype, tuple(k_pool.shape), torch.is_inference_mode_enabled())
        if key in self.buckets:
            return self.fn(padded, k_pool, v_pool, tables, context_lens)[:rows]
        start = time.perf_counter()
        out = self.fn(padded, k_pool, v_pool, tables, context_lens)
        self.buckets.add(key)
        self.compile_seconds += time.perf_counter() - start
        return out[:rows]


def pad_to_bucket(block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables and context lengths padded to :func:`batch_bucket` rows, the width marked dynamic.

    A padding row reads key 0 of block 0 (its output is dropped). Already
    padded inputs (a step's, prepared once for every layer) come back as they are.
    """
    rows, width = block_tables.shape
    bucket = batch_bucket(rows)
    if rows < bucket or width < 2:  # width 1 would be specialised (0/1), not dynamic
        tables = block_tables.new_zeros(bucket, max(width, 2))
        tables[:rows, :width] = block_tables
        block_tables, context_lens = tables, torch.cat([context_lens, context_lens.new_ones(bucket - rows)])
    torch._dynamo.mark_dynamic(block_tables, 1)
    return block_tables, context_lens
