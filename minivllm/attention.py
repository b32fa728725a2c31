"""Attention: the dense/chunked reference pair and the KV caches the model attends through.

Chapter 02 shows that prefilling a prompt chunk by chunk through a KV cache is
exact: the chunk ``[a, b)`` attends to every cached key ``[0, b)`` with the
mask ``key <= a + row``. Chapter 01 uses :class:`ContiguousKVCache` for one
sequence; chapter 05 replaces it with paged attention over block tables.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "causal_chunk_mask",
    "dense_causal",
    "chunked_causal",
    "attend",
    "NoCache",
    "ContiguousKVCache",
]


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
        outs.append(_softmax_attention(q[..., a:b, :], k_seen, v_seen, causal_chunk_mask(a, b, q.device)))
        trace.append((a, b, tuple(k_seen.shape)))
    return torch.cat(outs, dim=-2), trace


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with a boolean mask.

    ``q`` is ``[..., heads, nq, dim]``; ``k``, ``v`` are ``[..., kv_heads, nk, dim]``
    with ``heads`` a multiple of ``kv_heads``; ``mask`` broadcasts to
    ``[..., heads, nq, nk]``. Uses torch's fused kernel where it has one.
    """
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class NoCache:
    """No KV cache: every forward sees only its own tokens (naive generation, chapter 01)."""

    def forward(self, layer: int, q, k, v, positions):
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

    def forward(self, layer: int, q, k, v, positions):
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
