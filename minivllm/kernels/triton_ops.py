"""The op table's Triton kernels for CUDA (chapter 18): paged attention and the KV write; the rest is the reference.

Each program of :func:`paged_attention` is one query token and one query
head: it finds its sequence, walks that sequence's block table to the
token's own position a tile of keys at a time, and keeps an online softmax
(the running maximum, the sum, the weighted values, rescaled when the maximum
grows), as the C++ kernel does for a tile of rows. vLLM's Triton backend
(``vllm/v1/attention/ops/triton_unified_attention.py`` at v0.30.0) does the same with tiles
of queries and a split over the keys. Under ``TRITON_INTERPRET=1`` the
kernels run on the CPU (slowly: the tests use tiny shapes). Arguments are
checked in Python with tensor ops before launch, except while a CUDA graph is
being captured (the engine's own decode tables, and a check would read the
device back).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minivllm.kernels.reference import (  # noqa: F401  (the table's other ops: PyTorch on the GPU)
    dequantize_q4_1, dequantize_q8_0, fused_add_rms_norm, linear, prefill_attention, q4_1_linear, q4_1_q8_1_linear,
    q8_0_embedding, q8_0_linear, q8_0_q8_0_linear, quantize_q8_1, rms_norm, rotary, silu_and_mul)

TILE = 16  # keys per step of a program's loop


def _capturing() -> bool:
    """Whether a CUDA graph is being captured (no check may read the device back then); never on the CPU."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@triton.jit
def _write_kv(k, v, k_cache, v_cache, slots, k_stride, v_stride, ROW: tl.constexpr, ROW_POW2: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    offs = tl.arange(0, ROW_POW2)
    inside = offs < ROW
    if slot >= 0:  # slot -1: a padding row writes nothing
        tl.store(k_cache + slot * ROW + offs, tl.load(k + t * k_stride + offs, mask=inside), mask=inside)
        tl.store(v_cache + slot * ROW + offs, tl.load(v + t * v_stride + offs, mask=inside), mask=inside)


@triton.jit
def _paged_attention(
    out,
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    query_start,
    token_seq,
    q_stride,
    width,
    scale,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(token_seq + t)
    first = tl.load(query_start + b)
    n = tl.load(query_start + b + 1) - first
    pos = tl.load(seq_lens + b) - n + (t - first)  # this query's position: it sees keys 0 .. pos
    kvh = h // (H // KVH)
    d = tl.arange(0, D)
    query = tl.load(q + t * q_stride + h * D + d).to(tl.float32)
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    for start in range(0, pos + 1, TILE_N):
        keys = start + tl.arange(0, TILE_N)
        seen = keys <= pos
        block = tl.load(block_table + b * width + keys // BLOCK_SIZE, mask=seen, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        row = slot[:, None] * (KVH * D) + kvh * D + d[None, :]
        k = tl.load(k_cache + row, mask=seen[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_cache + row, mask=seen[:, None], other=0.0).to(tl.float32)
        s = tl.where(seen, tl.sum(k * query[None, :], axis=1) * scale, -float("inf"))
        new_max = tl.maximum(m, tl.max(s, axis=0))
        rescale = tl.exp(m - new_max)
        p = tl.exp(s - new_max)
        total = total * rescale + tl.sum(p, axis=0)
        acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
        m = new_max
    tl.store(out + t * (H * D) + h * D + d, (acc / total).to(out.dtype.element_ty))


def _check_attention(q, k_cache, block_table, seq_lens, query_start, block_size: int) -> None:
    """The C++ kernel's checks, as tensor ops (one read back to the host)."""
    T, H, D = q.shape
    kvh = k_cache.shape[1]
    if min(H, kvh, D) < 1 or H % kvh or D & (D - 1) or k_cache.shape[2] != D:
        raise ValueError(f"q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)}: heads must divide by KV heads "
                         f"(at least one of each), and head_dim be a power of two")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32 or query_start.dtype != torch.int32:
        raise ValueError("block_table, seq_lens and query_start must be int32")
    qlen = query_start[1:] - query_start[:-1]
    used = torch.arange(block_table.shape[1], device=q.device)[None, :] < (seq_lens[:, None] + block_size - 1) // block_size
    bad = torch.stack([query_start[0] != 0, query_start[-1] != T, (qlen < 0).any(), (seq_lens < qlen).any(),
                       ((seq_lens + block_size - 1) // block_size > block_table.shape[1]).any(),
                       (((block_table < 0) | (block_table >= k_cache.shape[0] // block_size)) & used).any()])
    names = ["query_start[0] is not 0", "query_start[-1] is not the number of query tokens",
             "query_start decreases", "seq_lens is shorter than a sequence's queries",
             "seq_lens needs more blocks than block_table has columns", "block_table holds a block outside the pool"]
    flags = bad.tolist()
    if any(flags):
        raise ValueError("; ".join(name for name, flag in zip(names, flags) if flag))


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start, block_size: int) -> torch.Tensor:
    if not _capturing():
        _check_attention(q, k_cache, block_table, seq_lens, query_start, block_size)
    T, H, D = q.shape
    qlen = (query_start[1:] - query_start[:-1]).long()
    token_seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=q.device), qlen, output_size=T)
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if T:
        _paged_attention[(T, H)](out, q, k_cache, v_cache, block_table, seq_lens, query_start, token_seq, q.stride(0),
                                 block_table.shape[1], 1.0 / math.sqrt(D), H, k_cache.shape[1], D, block_size, TILE)
    return out


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    row = k.shape[1] * k.shape[2]
    if not _capturing():
        if bool(((slot_mapping < -1) | (slot_mapping >= k_cache.shape[0])).any()):
            raise ValueError(f"slot_mapping holds a slot outside [-1, {k_cache.shape[0]})")
    if k.shape[0]:
        _write_kv[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), row,
                                 triton.next_power_of_2(row))
