"""Chapter 05, paged attention: the checks of the reader's KV gather through a block table and of
one decode token's grouped-query attention over a paged pool, against contiguous attention.
"""

from __future__ import annotations

import torch

from minivllm.attention import attend

__all__ = ["check_gather_kv", "check_paged_decode_attention"]


_GATHER_CASES = [  # (num_blocks, block_size, kv_heads, head_dim, block_table, context_len)
    (8, 4, 2, 3, [5, 1, 6], 10),
    (8, 4, 2, 3, [3], 1),
    (8, 4, 1, 2, [7, 0], 8),       # context fills its blocks exactly
    (16, 2, 3, 4, [9, 2, 14, 0, 5], 9),
    (6, 1, 2, 2, [4, 1, 3], 3),    # block_size 1
]


def _gather_reference(pool, table, context_len):
    return pool[torch.tensor(table, dtype=torch.long)].flatten(0, 1)[:context_len]


def _pool(num_blocks, bs, kvh, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, bs, kvh, d, generator=g)


def check_gather_kv(fn) -> None:
    """Check ``fn(pool, block_table, context_len) -> [context_len, kv_heads, head_dim]`` (chapter 05).

    ``pool`` is one layer's K (or V) pool ``[num_blocks, block_size, kv_heads,
    head_dim]``; the result lists the sequence's keys in token order, read
    through its block table. A pure copy, so it must match exactly.
    """
    for n, (nb, bs, kvh, d, table, ctx) in enumerate(_GATHER_CASES):
        pool = _pool(nb, bs, kvh, d, seed=n)
        what = f"gather_kv(pool {list(pool.shape)}, block_table={table}, context_len={ctx})"
        expected = _gather_reference(pool, table, ctx)
        got = fn(pool.clone(), list(table), ctx)
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
        if tuple(got.shape) != tuple(expected.shape):
            hint = ""
            if got.dim() == 3 and got.shape[0] == len(table) * bs and ctx != len(table) * bs:
                hint = f" (the last block holds only {ctx - (len(table) - 1) * bs} real tokens: keep the first context_len)"
            elif got.dim() == 4:
                hint = " (flatten the block and offset axes into one token axis)"
            elif tuple(got.shape) == (kvh, ctx, d):
                hint = " (token axis first: [context_len, kv_heads, head_dim])"
            raise AssertionError(f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}{hint}")
        if torch.equal(got.cpu(), expected):
            continue
        tok = int((got.cpu() != expected).flatten(1).any(1).nonzero()[0])
        hint = ""
        if torch.equal(got.cpu(), pool.flatten(0, 1)[:ctx]):
            hint = "; it reads blocks 0, 1, 2... in order: the block table says which physical block holds each logical block"
        elif torch.equal(got.cpu(), _gather_reference(pool, sorted(table), ctx)):
            hint = "; the blocks come out sorted: keep the block table's order (it is token order)"
        raise AssertionError(
            f"{what}: token {tok} (logical block {tok // bs} = physical block {table[tok // bs]}, offset {tok % bs}) "
            f"differs{hint}")
    print(f"check_gather_kv: all {len(_GATHER_CASES)} block tables gather exactly the right keys.")


_DECODE_ATTN_CASES = [  # (num_blocks, block_size, heads, kv_heads, head_dim, block_table, context_len)
    (8, 4, 6, 2, 8, [5, 1, 6], 10),   # GQA: 3 query heads per KV head, last block partly filled
    (8, 4, 4, 4, 8, [2, 7], 8),       # plain multi-head attention, blocks full
    (8, 4, 9, 3, 16, [3], 1),         # the first decode token: one key
    (32, 16, 9, 3, 64, [30, 4, 17, 8], 50),  # SmolLM2's head layout
]


def _decode_attn_reference(q, k_pool, v_pool, table, ctx):
    k = _gather_reference(k_pool, table, ctx).transpose(0, 1)  # [kv_heads, ctx, d]
    v = _gather_reference(v_pool, table, ctx).transpose(0, 1)
    mask = torch.ones(1, ctx, dtype=torch.bool)
    return attend(q[:, None, :], k, v, mask)[:, 0, :]


def _decode_attn_variants(q, k_pool, v_pool, table, ctx):
    """Plausible wrong answers, to name the mistake when a reader's result equals one of them."""
    h, d = q.shape
    kvh = k_pool.shape[2]
    group = h // kvh
    k = _gather_reference(k_pool, table, ctx)  # [ctx, kvh, d]
    v = _gather_reference(v_pool, table, ctx)

    def softmax_attn(keys, values, scale):  # keys/values [ctx, h, d]
        w = torch.softmax(torch.einsum("hd,thd->ht", q, keys) * scale, dim=-1)
        return torch.einsum("ht,thd->hd", w, values)

    out = {}
    if group > 1:
        out["query head h reads KV head h // group (repeat_interleave), not h % num_kv_heads (repeat)"] = \
            softmax_attn(k.repeat(1, group, 1), v.repeat(1, group, 1), d ** -0.5)
    rep = lambda x: x.repeat_interleave(group, dim=1)  # noqa: E731
    out["the scores need the 1 / sqrt(head_dim) scale"] = softmax_attn(rep(k), rep(v), 1.0)
    full = len(table) * k_pool.shape[1]
    if full != ctx:
        kf = _gather_reference(k_pool, table, full)
        vf = _gather_reference(v_pool, table, full)
        out["the empty slots after context_len in the last block were attended to"] = \
            softmax_attn(rep(kf), rep(vf), d ** -0.5)
    return out


def check_paged_decode_attention(fn) -> None:
    """Check ``fn(q [heads, d], k_pool, v_pool, block_table, context_len) -> [heads, d]`` (chapter 05).

    One decode token attends to its sequence's ``context_len`` keys, read
    through the block table, with grouped-query heads. Compared with the
    contiguous reference within 1e-5.
    """
    for n, (nb, bs, h, kvh, d, table, ctx) in enumerate(_DECODE_ATTN_CASES):
        g = torch.Generator().manual_seed(100 + n)
        q = torch.randn(h, d, generator=g)
        k_pool, v_pool = torch.randn(2, nb, bs, kvh, d, generator=g)
        what = (f"paged_decode_attention(q [{h}, {d}], pools [{nb}, {bs}, {kvh}, {d}], "
                f"block_table={table}, context_len={ctx})")
        expected = _decode_attn_reference(q, k_pool, v_pool, table, ctx)
        got = fn(q.clone(), k_pool.clone(), v_pool.clone(), list(table), ctx)
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
        if tuple(got.shape) != tuple(expected.shape):
            raise AssertionError(f"{what}: expected shape {tuple(expected.shape)} (one output per query head), "
                                 f"got {tuple(got.shape)}")
        got = got.detach().cpu().float()
        err = (got - expected).abs().max().item()
        if err <= 1e-5:
            continue
        hint = next((f"; {name}" for name, wrong in _decode_attn_variants(q, k_pool, v_pool, table, ctx).items()
                     if torch.allclose(got, wrong, atol=1e-5)), "")
        raise AssertionError(f"{what}: differs from the reference by up to {err:.3g} (tolerance 1e-5){hint}")
    print(f"check_paged_decode_attention: all {len(_DECODE_ATTN_CASES)} cases match contiguous attention within 1e-5.")
