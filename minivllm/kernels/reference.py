"""The op table in PyTorch (chapter 18): the oracle of every kernel, and the fallback where none is built.

Each function computes exactly what its kernel computes, in the plainest
tensor code: the native kernels (``native``) and the Triton ones (``triton``)
are tested against these, and an engine without them runs these.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

QBLOCK = 32  # weights per Q4_1 and Q8_0 block (the GGUF's QK4_1, QK8_0)
Q4_1_BYTES = 20  # fp16 scale, fp16 minimum, 16 bytes of 4-bit quants
Q8_0_BYTES = 34  # fp16 scale, 32 int8 quants
Q8_1_BYTES = 36  # fp16 scale d, fp16 d * sum(quants), 32 int8 quants: llama.cpp's block_q8_1 (8-bit activations)

__all__ = ["write_kv", "paged_attention", "rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul", "linear",
           "q4_1_linear", "q8_0_linear", "q8_0_embedding", "dequantize_q4_1", "dequantize_q8_0", "quantize_q8_1",
           "q4_1_q8_1_linear", "q8_0_q8_0_linear", "int8_block_sums", "int8_dot_bound", "int8_rounding_bound",
           "prefill_attention"]


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Store token ``t``'s key and value ``[T, kv_heads, dim]`` in slot ``slot_mapping[t]`` of the caches
    ``[slots, kv_heads, dim]``; slot -1 (a padding row of a CUDA graph, chapter 12) stores nothing."""
    keep = slot_mapping >= 0
    k_cache[slot_mapping[keep]] = k[keep]
    v_cache[slot_mapping[keep]] = v[keep]


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start, block_size: int) -> torch.Tensor:
    """Every row of a step through the paged cache, each sequence to its own length (chapter 18).

    Sequence ``b`` owns the queries ``query_start[b]:query_start[b + 1]`` of
    ``q [T, heads, dim]``: the last of its ``seq_lens[b]`` tokens, so query
    ``i`` of ``n`` sits at position ``seq_lens[b] - n + i`` and sees the keys
    at or before it (chapter 02's rule). Its keys are slots
    ``block_table[b][p // block_size] * block_size + p % block_size`` of the
    caches ``[slots, kv_heads, dim]``; query head ``h`` reads KV head
    ``h // (heads // kv_heads)``. Returns ``[T, heads, dim]``.
    """
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(len(seq_lens)):
        first, last, length = int(query_start[b]), int(query_start[b + 1]), int(seq_lens[b])
        if last == first:
            continue
        p = torch.arange(length, device=q.device)
        slots = block_table[b].long()[p // block_size] * block_size + p % block_size
        keys = k_cache[slots].repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, length, dim]
        values = v_cache[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        queries = q[first:last].transpose(0, 1)  # [heads, n, dim]
        positions = torch.arange(length - (last - first), length, device=q.device)
        scores = queries.float() @ keys.float().transpose(1, 2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(p[None, None, :] > positions[None, :, None], float("-inf"))
        out[first:last] = (scores.softmax(-1) @ values.float()).transpose(0, 1).to(q.dtype)
    return out


def prefill_attention(q, k_cache, v_cache, block_table, seq_lens, query_start, block_size: int) -> torch.Tensor:
    """A step's prompt rows through the paged cache (chapter 18): :func:`paged_attention` itself, whose rule is
    every row's. A table may attend many rows of one sequence in tiles (the C++ table's ``prefill_attention``);
    the result is this one's, to float32 rounding."""
    return paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start, block_size)


def rms_norm(x, weight, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` per row, in float32 (Llama's RMSNorm)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps: float):
    """``residual += x``, then ``x = rms_norm(residual)``: a layer's residual add and the next norm, in place.
    Returns ``(x, residual)``."""
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps))
    return x, residual


def rotary(q, k, positions, cos, sin) -> None:
    """Rotary position embedding in place (rotate-half, as Llama): each query and key head ``[..., dim]`` of token
    ``t`` turned by the angles of ``positions[t]``, read from the tables ``cos``, ``sin`` ``[max_position, dim/2]``."""
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    for x in (q, k):
        x1, x2 = x[..., : x.shape[-1] // 2].clone(), x[..., x.shape[-1] // 2:].clone()
        x[..., : x.shape[-1] // 2] = x1 * c - x2 * s
        x[..., x.shape[-1] // 2:] = x2 * c + x1 * s


def silu_and_mul(x) -> torch.Tensor:
    """SwiGLU's middle: ``silu(gate) * up`` for ``x = [gate | up]`` ``[T, 2 * intermediate]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x, weight, bias=None) -> torch.Tensor:
    """``x @ weight.T + bias``: what the streaming matrix-vector kernel computes for a few rows."""
    return F.linear(x, weight, bias)


def dequantize_q4_1(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """The float32 weights ``[N, in_features]`` of Q4_1 blocks ``[N, in_features / 32 * 20]`` uint8: an fp16 scale
    ``d``, an fp16 minimum ``m``, 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31;
    weight = d * q + m (exact in float32)."""
    blocks = qweight.view(qweight.shape[0], in_features // QBLOCK, Q4_1_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    qs = blocks[..., 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # [N, blocks, 32]
    return (q * d + m).view(qweight.shape[0], in_features)


def dequantize_q8_0(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """The float32 weights of Q8_0 blocks ``[N, in_features / 32 * 34]`` uint8: an fp16 scale, 32 int8;
    weight = d * q."""
    blocks = qweight.view(qweight.shape[0], in_features // QBLOCK, Q8_0_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    return (blocks[..., 2:].contiguous().view(torch.int8).float() * d).view(qweight.shape[0], in_features)


def q4_1_linear(x, qweight, bias=None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` as the GGUF stores it in Q4_1 (:func:`dequantize_q4_1`)."""
    return F.linear(x, dequantize_q4_1(qweight, x.shape[-1]), bias)


def q8_0_linear(x, qweight, bias=None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` in Q8_0 (:func:`dequantize_q8_0`)."""
    return F.linear(x, dequantize_q8_0(qweight, x.shape[-1]), bias)


def q8_0_embedding(ids, table, width: int) -> torch.Tensor:
    """Rows ``ids`` of a Q8_0 embedding table, dequantised: ``[T, width]``."""
    return dequantize_q8_0(table[ids], width)


# -- 8-bit activations, as llama.cpp multiplies the GGUF's blocks (chapter 18) ------------------------------------
#
# llama.cpp (ggml-org/llama.cpp at 04e1dd75) rounds each activation row once per matmul to blocks of 32
# (ggml/src/ggml-cpu/arch/x86/quants.c, quantize_row_q8_1) and multiplies every weight block by them in integers
# (ggml_vec_dot_q4_1_q8_1; ggml_vec_dot_q8_0_q8_0 for Q8_0 weights, whose activations are Q8_0: Q8_1's d and
# quants without s, ggml-cpu.c's type_traits_cpu at 005913fd). The functions below compute the same integers
# exactly and the float scales in float64; the C++ kernels (csrc/int8_dot.h) sum those in float32, in one fixed
# order on every CPU: :func:`int8_dot_bound` says by how much the two may differ.

int8_dot_kind = "torch"  # what stats() names this table's integer dot product ("q8_1 torch")


def quantize_q8_1(x) -> torch.Tensor:
    """Rows ``x [R, K]`` (K a multiple of 32) as Q8_1 blocks ``uint8 [R, K / 32 * 36]``: per block of 32, an fp16
    ``d = max|x| / 127``, an fp16 ``s = d * sum(q)`` (the block's sum, for a Q4_1 weight's minimum) and 32 int8
    ``q = x * (127 / max|x|)`` rounded to the nearest integer, ties to even (so |q| <= 127); a block of zeros has
    d = 0 and q = 0. llama.cpp's ``quantize_row_q8_1`` (its AVX2 branch: x times 127 / max, rounded to even;
    ``s`` from the float d before d is rounded to fp16)."""
    R, K = x.shape
    xb = x.float().reshape(R, K // QBLOCK, QBLOCK)
    amax = xb.abs().amax(-1)
    full = torch.full_like(amax, 127.0)  # tensor / tensor divides as the C++ does (Python's 127 / t would multiply
    d = torch.div(amax, full)  # by t's rounded reciprocal: two roundings)
    inv = torch.where(amax > 0, torch.div(full, amax), torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None])  # ties to even
    s = d * q.sum(-1)
    halves = torch.stack([d.half(), s.half()], -1).view(torch.uint8)  # [R, blocks, 4]
    return torch.cat([halves, q.to(torch.int8).view(torch.uint8)], -1).reshape(R, K // QBLOCK * Q8_1_BYTES)


def _q8_1_parts(xq: torch.Tensor, in_features: int):
    """Q8_1 blocks ``[R, K / 32 * 36]`` as (d, s ``[R, blocks]`` float32, quants ``[R, blocks, 32]`` int8)."""
    blocks = xq.view(xq.shape[0], in_features // QBLOCK, Q8_1_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    s = blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
    return d, s, blocks[..., 4:].contiguous().view(torch.int8)


def _weight_parts(qweight: torch.Tensor, in_features: int, kind: str):
    """Q4_1 or Q8_0 blocks as (d, m ``[N, blocks]`` float32, m zero for Q8_0; quants ``[N, blocks, 32]``: 0-15 for
    Q4_1, weight j of a block in position j, -128-127 for Q8_0)."""
    per = {"q4_1": Q4_1_BYTES, "q8_0": Q8_0_BYTES}[kind]
    blocks = qweight.view(qweight.shape[0], in_features // QBLOCK, per)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    if kind == "q8_0":
        return d, torch.zeros_like(d), blocks[..., 2:].contiguous().view(torch.int8)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
    return d, m, torch.cat([blocks[..., 4:] & 0x0F, blocks[..., 4:] >> 4], dim=-1)


def int8_block_sums(xq, qweight, in_features: int, kind: str) -> torch.Tensor:
    """The integer dot product of every weight block with every activation block: ``int64 [R, N, blocks]``,
    ``sum_j q_w[n, b, j] * q_x[r, b, j]`` (exact: float64 holds every such sum, |sum| < 2^20)."""
    qx = _q8_1_parts(xq, in_features)[2]
    qw = _weight_parts(qweight, in_features, kind)[2]
    return torch.einsum("rbj,nbj->rnb", qx.double(), qw.double()).long()


def _int8_linear(x, qweight, bias, kind: str) -> torch.Tensor:
    xq = quantize_q8_1(x)
    dx, sx, _ = _q8_1_parts(xq, x.shape[-1])
    dw, mw, _ = _weight_parts(qweight, x.shape[-1], kind)
    sums = int8_block_sums(xq, qweight, x.shape[-1], kind).double()
    terms = (dw.double()[None] * dx.double()[:, None]) * sums  # d_w * d_x * sumi, each exact in float64
    if kind == "q4_1":
        terms = terms + mw.double()[None] * sx.double()[:, None]  # + m_w * s_x: the minimum's share
    out = terms.sum(-1)
    if bias is not None:
        out = out + bias.double()
    return out.float()


def q4_1_q8_1_linear(x, qweight, bias=None) -> torch.Tensor:
    """``x @ W.T + bias`` as llama.cpp computes it with Q4_1 weights: each row of ``x`` rounded to Q8_1
    (:func:`quantize_q8_1`), then per block ``d_w * d_x * sum(q_w * q_x) + m_w * s_x`` (the integer sum
    exact; the block terms summed in float64, then rounded to float32)."""
    return _int8_linear(x, qweight, bias, "q4_1")


def q8_0_q8_0_linear(x, qweight, bias=None) -> torch.Tensor:
    """``x @ W.T + bias`` as llama.cpp computes it with Q8_0 weights: the rows rounded to Q8_0 (Q8_1's d and
    quants), then per block ``d_w * d_x * sum(q_w * q_x)``."""
    return _int8_linear(x, qweight, bias, "q8_0")


def int8_dot_bound(x, qweight, kind: str, bias=None) -> torch.Tensor:
    """How far the C++ kernels' ``[R, N]`` may be from :func:`q4_1_q8_1_linear` / :func:`q8_0_q8_0_linear`.

    The integer sums are exact on both sides; only the float32 sums of the block terms round. The kernel adds
    each term into one of 8 lanes with a fused multiply-add per block (``K / 32`` roundings), adds the lanes
    pairwise (3), the minima's sum (``K / 32``, in parallel with the lanes) and the bias (1 each); the reference
    rounds once, to float32. Each rounding errs by at most 2^-24 of the magnitudes summed so far, so the two
    differ by at most ``(K / 32 + 8) * 2^-24 * M``, ``M`` the sum of the terms' magnitudes: ``|d_w d_x| *
    sum_j |q_w q_x|`` and ``|m_w s_x|`` over the blocks, and ``|bias|``."""
    xq = quantize_q8_1(x)
    dx, sx, qx = _q8_1_parts(xq, x.shape[-1])
    dw, mw, qw = _weight_parts(qweight, x.shape[-1], kind)
    products = torch.einsum("rbj,nbj->rnb", qx.double().abs(), qw.double().abs())
    M = ((dw.double()[None] * dx.double()[:, None]).abs() * products
         + (mw.double()[None] * sx.double()[:, None]).abs()).sum(-1)
    if bias is not None:
        M = M + bias.double().abs()
    return (x.shape[-1] // QBLOCK + 8) * 2.0 ** -24 * M


def int8_rounding_bound(x, weight) -> torch.Tensor:
    """How far rounding the rows of ``x [R, K]`` to 8 bits (:func:`quantize_q8_1`) may move ``x @ weight.T``
    (``weight [N, K]``, the float32 weights the blocks dequantise to), beside float32 rounding: ``[R, N]``.

    In a block with largest magnitude ``a``, ``q = x * (127 / a)`` rounded moves each ``x`` by at most half a
    step, ``a / 254``; storing ``d = a / 127`` as fp16 moves ``d * q`` by at most 2^-11 of ``a`` (2^-25 * 127
    absolute below fp16's normal range), and the float32 products by a few 2^-24 of ``a``. So each activation
    moves by at most ``e = a * (1/254 + 2^-10) + 127 * 2^-25``, and an output by at most ``sum_blocks e *
    sum_j |w_j|`` over the block's weights."""
    R, K = x.shape
    e = x.float().reshape(R, K // QBLOCK, QBLOCK).abs().amax(-1).double() * (1 / 254 + 2.0 ** -10) + 127 * 2.0 ** -25
    w = weight.double().abs().reshape(weight.shape[0], K // QBLOCK, QBLOCK).sum(-1)  # [N, blocks]
    return e @ w.T
