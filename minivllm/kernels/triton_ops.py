"""The op table's Triton kernels for CUDA (chapter 18): paged attention and the KV write; the rest is the reference.

:func:`paged_attention` has two programs, chosen by a rule on the step's
shapes (never a stopwatch; both compute the reference's numbers). A step
with more query rows than sequences (a prompt, a chunk, a speculative
verification) runs :func:`_attention_tiles` (chapter 18d): a program per
tile of ``BLOCK_M`` query rows (a few tokens of one sequence times the query
heads of one KV head), each key tile loaded once for all of them, scores and
values by ``tl.dot``, key tiles past the tile's last position skipped, as
vLLM's ``kernel_unified_attention``
(``vllm/v1/attention/ops/triton_unified_attention.py`` at v0.30.0) does. A
decode-only step (one row a sequence: what the CUDA graphs capture) keeps
:func:`_paged_attention`, one query token and one query head a program: a
decode tile fills only the group's rows of its 16 (3 for SmolLM2) and the
step gets 1/group of the programs, though it loads each key once for the
group rather than once a head (vLLM runs its tiles for decode too: which is
faster there is for a GPU to measure, not for this rule to claim). Each
walks its sequence's block table a tile of keys at a time with an online
softmax (the running maximum, the sum, the weighted values, rescaled when
the maximum grows). Under
``TRITON_INTERPRET=1`` the kernels run on the CPU (slowly: the tests use tiny
shapes). Arguments are checked in Python with tensor ops before launch,
except while a CUDA graph is being captured (the engine's own decode tables,
and a check would read the device back).
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
BLOCK_M = 16  # query rows of a tile (vLLM's 16): tokens times the query heads of one KV head


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


@triton.jit
def _attention_tiles(
    out,
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    query_start,
    num_seqs,
    q_stride,
    width,
    scale,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    GROUP: tl.constexpr = H // KVH
    # the tile's sequence: the last b whose tiles start at or before it (sequence b's first tile is
    # query_start[b] // BLOCK_Q + b), by binary search
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    first = tl.load(query_start + b)
    n = tl.load(query_start + b + 1) - first
    local = tile - (first // BLOCK_Q + b)  # the tile's index within its sequence
    if local * BLOCK_Q >= n:
        return  # past the sequence's queries: the grid is an upper bound
    context = tl.load(seq_lens + b) - n  # keys cached before the sequence's first query
    rows = tl.arange(0, BLOCK_M)
    i = local * BLOCK_Q + rows // GROUP  # row r: query token i of the sequence, query head h
    h = kvh * GROUP + rows % GROUP
    live = (rows < BLOCK_Q * GROUP) & (i < n)
    pos = context + i  # each row's position: it sees keys 0 .. pos
    d = tl.arange(0, D_PAD)
    dim = d < D
    query = tl.load(q + (first + i)[:, None] * q_stride + h[:, None] * D + d[None, :],
                    mask=live[:, None] & dim[None, :], other=0.0)  # [BLOCK_M, D_PAD]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    last = context + tl.minimum(local * BLOCK_Q + BLOCK_Q, n) - 1  # the tile's last query position
    for start in range(0, last + 1, TILE_N):  # key tiles past `last` are masked for every row: never loaded
        keys = start + tl.arange(0, TILE_N)
        inside = keys <= last
        block = tl.load(block_table + b * width + keys // BLOCK_SIZE, mask=inside, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        k = tl.load(k_cache + slot[None, :] * (KVH * D) + kvh * D + d[:, None],
                    mask=dim[:, None] & inside[None, :], other=0.0)  # [D_PAD, TILE_N]: keys as columns
        v = tl.load(v_cache + slot[:, None] * (KVH * D) + kvh * D + d[None, :],
                    mask=inside[:, None] & dim[None, :], other=0.0)  # [TILE_N, D_PAD]
        s = tl.dot(query, k, input_precision=PRECISION) * scale  # [BLOCK_M, TILE_N]: every row's scores at once
        s = tl.where(live[:, None] & (keys[None, :] <= pos[:, None]), s, float("-inf"))
        new_max = tl.maximum(m, tl.max(s, axis=1))
        new_max = tl.where(new_max > float("-inf"), new_max, 0.0)  # a padding row: every score masked
        rescale = tl.exp(m - new_max)
        p = tl.exp(s - new_max[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = new_max
    tl.store(out + (first + i)[:, None] * (H * D) + h[:, None] * D + d[None, :],
             (acc / tl.where(live, total, 1.0)[:, None]).to(out.dtype.element_ty), mask=live[:, None] & dim[None, :])


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
    """The reference's ``paged_attention``: the arguments checked, then the tiles or one query a program (the rule
    in the module's docstring)."""
    if not _capturing():
        _check_attention(q, k_cache, block_table, seq_lens, query_start, block_size)
    if q.shape[0] > len(seq_lens):  # some sequence has several query rows: tiles of queries (the module's rule)
        return attention_tiles(q, k_cache, v_cache, block_table, seq_lens, query_start, block_size)
    return attention_per_query(q, k_cache, v_cache, block_table, seq_lens, query_start, block_size)


def attention_per_query(q, k_cache, v_cache, block_table, seq_lens, query_start, block_size: int) -> torch.Tensor:
    """:func:`_paged_attention` over checked arguments: a program per query token and query head."""
    T, H, D = q.shape
    qlen = (query_start[1:] - query_start[:-1]).long()
    token_seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=q.device), qlen, output_size=T)
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if T:
        _paged_attention[(T, H)](out, q, k_cache, v_cache, block_table, seq_lens, query_start, token_seq, q.stride(0),
                                 block_table.shape[1], 1.0 / math.sqrt(D), H, k_cache.shape[1], D, block_size, TILE)
    return out


def tile_shape(heads: int, kv_heads: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_Q)``: a tile's rows and the query tokens they hold, ``BLOCK_Q`` tokens times the
    ``heads // kv_heads`` query heads of a KV head in at most ``BLOCK_M`` rows (16, or the group's power of two
    where it is larger), as vLLM's ``unified_attention`` sizes them."""
    group = heads // kv_heads
    rows = BLOCK_M if group <= BLOCK_M else triton.next_power_of_2(group)
    return rows, rows // group


def attention_tiles(q, k_cache, v_cache, block_table, seq_lens, query_start, block_size: int) -> torch.Tensor:
    """:func:`_attention_tiles` over checked arguments (chapter 18d). Its grid is ``T // BLOCK_Q + B`` tiles by the
    KV heads, no fewer than the ``ceil(queries / BLOCK_Q)`` tiles each sequence needs: a bound from the shapes alone
    (vLLM's), so nothing is read back from the device; the tiles past a sequence's queries return at once."""
    T, H, D = q.shape
    kvh = k_cache.shape[1]
    rows, block_q = tile_shape(H, kvh)
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if T:
        precision = "ieee" if q.dtype == torch.float32 else None  # float32 stays float32 (no TF32); else the default
        _attention_tiles[(T // block_q + len(seq_lens), kvh)](
            out, q, k_cache, v_cache, block_table, seq_lens, query_start, len(seq_lens), q.stride(0),
            block_table.shape[1], 1.0 / math.sqrt(D), H, kvh, D, max(D, 16), block_size, rows, block_q, TILE,
            precision)
    return out


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    row = k.shape[1] * k.shape[2]
    if not _capturing():
        if bool(((slot_mapping < -1) | (slot_mapping >= k_cache.shape[0])).any()):
            raise ValueError(f"slot_mapping holds a slot outside [-1, {k_cache.shape[0]})")
    if k.shape[0]:
        _write_kv[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), row,
                                 triton.next_power_of_2(row))
