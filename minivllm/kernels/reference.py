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

__all__ = ["write_kv", "paged_attention", "rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul", "linear",
           "q4_1_linear", "q8_0_linear", "q8_0_embedding", "dequantize_q4_1", "dequantize_q8_0"]


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
