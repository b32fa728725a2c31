"""Chapter 18c, split-KV: the check of the reader's merge of partial softmaxes, ``merge_partials(partials)``.

A decode row's keys cut into chunks give one partial per chunk: for each query
head, the chunk's largest score ``m``, the sum ``l`` of ``exp(score - m)`` and
the values weighted by those exponentials, ``acc``, not yet divided. The
reader merges them into the row's attention output. :func:`check_merge_partials`
compares the merge with the softmax over every key at once (float64, so a
right merge is equal to rounding) on cases built to tell the usual mistakes
apart, and names the mistake; then, unless ``live=False``, it merges the
partials of a SmolLM2-shaped decode step cut as the C++ kernel cuts it
(:func:`minivllm.kernels.cpu.split_kv_plan`) and asks for the kernel's output.
"""

from __future__ import annotations

import math

import torch

from minivllm.exercises._common import is_minivllms, require_written, say
from minivllm.tolerances import ATTENTION_ATOL

__all__ = ["check_merge_partials", "partials_of", "CASES"]


def partials_of(scores: torch.Tensor, values: torch.Tensor, cuts: list[int]) -> list[tuple]:
    """The partials of the keys cut at ``cuts`` (chunk ``c`` is keys ``cuts[c] .. cuts[c + 1] - 1``): for each
    chunk ``(m [H], l [H], acc [H, D])`` from ``scores [H, n]`` and ``values [n, D]``; an empty chunk is
    ``m = -inf, l = 0, acc = 0``, as a kernel leaves one."""
    out = []
    for a, b in zip(cuts, cuts[1:]):
        s = scores[:, a:b]
        if b == a:
            heads = scores.shape[0]
            out.append((torch.full((heads,), -math.inf, dtype=scores.dtype), torch.zeros(heads, dtype=scores.dtype),
                        torch.zeros(heads, values.shape[1], dtype=scores.dtype)))
            continue
        m = s.max(dim=1).values
        p = torch.exp(s - m[:, None])
        out.append((m, p.sum(dim=1), p @ values[a:b]))
    return out


def _case(heads: int, dim: int, cuts: list[int], seed: int, lift: dict | None = None, dtype=torch.float64):
    """Random scores and values of ``cuts[-1]`` keys; ``lift`` raises the scores of some chunks by a constant
    (chunk index: amount), so the chunks' maxima differ by that much."""
    g = torch.Generator().manual_seed(seed)
    n = cuts[-1]
    scores = torch.randn(heads, n, generator=g, dtype=torch.float64) * 3
    values = torch.randn(n, dim, generator=g, dtype=torch.float64)
    for c, amount in (lift or {}).items():
        scores[:, cuts[c]:cuts[c + 1]] += amount
    return scores.to(dtype), values.to(dtype)


F32 = torch.float32  # as the C++ kernel's partials: exp overflows past 88
# (what the case is, heads, dim, chunk boundaries, seed, lift, dtype): the first cases are the plainest
CASES = [
    ("one chunk", 3, 8, [0, 37], 0, None, torch.float64),
    ("two equal chunks, their maxima apart", 3, 8, [0, 16, 32], 1, {1: 2.0}, torch.float64),
    ("chunks of different lengths", 3, 64, [0, 5, 40, 41, 100], 2, {0: 1.5, 2: -1.0}, torch.float64),
    ("float32, a later chunk's scores 100 above the first's", 2, 8, [0, 8, 16, 24], 3, {2: 100.0}, F32),
    ("float32, the first chunk 100 above the rest", 2, 8, [0, 8, 16, 24], 4, {0: 100.0}, F32),
    ("an empty chunk in the middle (m = -inf, l = 0)", 3, 8, [0, 10, 10, 30], 5, {2: 1.0}, torch.float64),
    ("an empty chunk first", 3, 8, [0, 0, 12, 30], 6, None, torch.float64),
    ("16 chunks, 9 heads", 9, 64, list(range(0, 257, 16)), 7, {5: 3.0, 11: -2.0}, torch.float64),
]
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}  # a right merge: within rounding of the whole softmax


def _hint(partials, got) -> str:
    """The mistake ``got`` looks like, in the reader's terms, by the wrong merges it equals."""
    def close(x):
        return x.shape == got.shape and torch.allclose(x, got, rtol=1e-5, atol=1e-5)

    ms = torch.stack([m for m, _, _ in partials]).double()  # [C, H]
    ls = torch.stack([l for _, l, _ in partials]).double()
    accs = torch.stack([a for _, _, a in partials]).double()  # [C, H, D]
    top = ms.max(dim=0).values
    w = torch.exp(ms - top)
    nonempty = ls > 0
    with torch.no_grad():
        outs = torch.where(nonempty[..., None], accs / ls.clamp_min(1e-300)[..., None], torch.zeros_like(accs))
        plain = accs.sum(0) / ls.sum(0)[:, None]
        mean_of_outputs = outs.sum(0) / nonempty.sum(0).clamp_min(1)[:, None]
        sum_of_outputs = outs.sum(0)
        by_max_only = (w[..., None] * outs).sum(0) / (w * nonempty).sum(0)[:, None]
        acc_not_rescaled = accs.sum(0) / (w * ls).sum(0)[:, None]
        sum_not_rescaled = (w[..., None] * accs).sum(0) / ls.sum(0)[:, None]
        flipped = torch.exp(top - ms)
        flipped = torch.where(torch.isfinite(flipped), flipped, torch.zeros_like(flipped))
        sign = (flipped[..., None] * accs).sum(0) / (flipped * ls).sum(0)[:, None]
    if close(plain):
        return ("you added the chunks' acc and l as they are: each is relative to its own chunk's maximum m_i, "
                "so bring each to the common maximum M first, multiplying both by exp(m_i - M)")
    if close(mean_of_outputs) or close(sum_of_outputs):
        return ("you combined the chunks' outputs acc_i / l_i without their weights: a chunk's share of the "
                "softmax is l_i * exp(m_i - M) over the sum of those, not 1 / chunks")
    if close(by_max_only):
        return ("you divided each chunk first (acc_i / l_i) and then weighted the outputs by exp(m_i - M) "
                "alone: the weight of a chunk's output is l_i * exp(m_i - M), its share of the whole sum")
    if close(acc_not_rescaled):
        return "you rescaled the sums l_i by exp(m_i - M) but not the weighted values acc_i: rescale both"
    if close(sum_not_rescaled):
        return "you rescaled the weighted values acc_i by exp(m_i - M) but not the sums l_i: rescale both"
    if close(sign):
        return "the rescale is exp(m_i - M) (at most 1, M the largest m_i), not exp(M - m_i)"
    return ("the merge: M = max_i m_i, L = sum_i l_i * exp(m_i - M), "
            "out = sum_i acc_i * exp(m_i - M) / L")


def _check_case(fn, name, heads, dim, cuts, seed, lift, dtype) -> float:
    scores, values = _case(heads, dim, cuts, seed, lift, dtype)
    partials = partials_of(scores, values, cuts)
    want = torch.softmax(scores.double(), dim=1) @ values.double()
    what = f"merge_partials of {len(partials)} chunk{'s' * (len(partials) > 1)} [{name}], cut at {cuts}"
    given = [tuple(t.clone() for t in p) for p in partials]
    got = fn(given)
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor [heads, dim], got {type(got).__name__}")
    if tuple(got.shape) != (heads, dim):
        raise AssertionError(f"{what}: expected the shape ({heads}, {dim}) (heads, dim), got {tuple(got.shape)}")
    for (m, l, a), (m0, l0, a0) in zip(given, partials):
        if not (torch.equal(m, m0) and torch.equal(l, l0) and torch.equal(a, a0)):
            raise AssertionError(f"{what}: your merge changed the partials it was given: work on copies")
    got = got.to(torch.float64)
    if not torch.isfinite(got).all():
        if "empty" in name:
            hint = ("an empty chunk has l = 0 and m = -inf: dividing its acc by its l is 0 / 0 = NaN, and -inf "
                    "as the common maximum makes exp(m_i - M) infinite; merge the sums first, divide once at "
                    "the end, and take M as the largest m_i")
        elif "100" in name:
            hint = ("exp overflowed (float32 holds exp(x) up to x = 88): exp(m_i - M) was taken with M below "
                    "some m_i (the first chunk's maximum?); take M = the largest m_i, so every factor is at most 1")
        else:
            hint = "take M = the largest m_i, and divide once at the end"
        raise AssertionError(f"{what}: the output has NaN or inf; {hint}")
    err = float((got - want).abs().max())
    if err > TOLERANCE[dtype]:
        hint = _hint(partials, got)
        raise AssertionError(f"{what}: differs from the softmax over every key by {err:.2e} (a right merge is "
                             f"within {TOLERANCE[dtype]:g}); {hint}")
    return err


def _check_live(fn) -> None:
    """A SmolLM2-shaped decode step (9 query heads on 3 KV heads, head_dim 64, 16-key blocks) of two rows, cut as
    the C++ kernel cuts it on 4 threads: the reader's merge of float32 partials against the kernel's output."""
    from minivllm.kernels import cpu_table
    from minivllm.kernels.cpu import split_kv_plan

    ops = cpu_table()
    lens, heads, kv_heads, dim, block = [700, 300], 9, 3, 64, 16
    g = torch.Generator().manual_seed(18)
    n_blocks = sum(-(-n // block) for n in lens)
    k_cache = torch.randn(n_blocks * block, kv_heads, dim, generator=g)
    v_cache = torch.randn(n_blocks * block, kv_heads, dim, generator=g)
    order = torch.randperm(n_blocks, generator=g).int()
    width = max(-(-n // block) for n in lens)
    tables, used = torch.zeros(len(lens), width, dtype=torch.int32), 0
    for b, n in enumerate(lens):
        tables[b, :-(-n // block)] = order[used:used + -(-n // block)]
        used += -(-n // block)
    q = torch.randn(len(lens), heads, dim, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    plan = split_kv_plan(lens, kv_heads, 4)
    group = heads // kv_heads
    mine = torch.empty(len(lens), heads, dim)
    for b, n in enumerate(lens):
        slots = (tables[b, torch.arange(n) // block].long() * block + torch.arange(n) % block)
        for h in range(kv_heads):
            keys, values = k_cache[slots, h], v_cache[slots, h]
            scores = q[b, h * group:(h + 1) * group] @ keys.T / math.sqrt(dim)  # [group, n]
            cuts = [k0 for (row, head, k0, _, _) in plan if row == b and head == h] + [n]
            mine[b, h * group:(h + 1) * group] = fn(partials_of(scores, values, cuts)).to(torch.float32)
    if ops is None:
        from minivllm.kernels import reference
        want, by = reference.paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, block), "the reference"
    else:
        want = ops.paged_attention_chunked(q, k_cache, v_cache, tables, seq_lens, starts, block,
                                           plan[0][3] - plan[0][2])
        by = "minivllm's C++ split-KV kernel"
    err = float((mine - want).abs().max())
    chunks = len(plan)
    if not err <= ATTENTION_ATOL:
        raise AssertionError(f"a SmolLM2-shaped decode step (rows of {lens[0]} and {lens[1]} keys, {chunks} chunks "
                             f"in float32): your merge differs from {by} by {err:.2e}, more than {ATTENTION_ATOL:g}")
    say(f"check_merge_partials: a SmolLM2-shaped decode step cut into {chunks} chunks as the kernel cuts it on 4 "
        f"threads merges to {by}'s output (max difference {err:.1e}).")


def check_merge_partials(fn, live: bool = True) -> None:
    """Check ``fn(partials) -> out`` (chapter 18c): ``partials`` a list of one ``(m, l, acc)`` per chunk of a
    row's keys, ``m [heads]`` the chunk's largest score, ``l [heads]`` the sum of ``exp(score - m)``, ``acc [heads,
    dim]`` the values weighted by them, not divided (an empty chunk: ``m = -inf``, ``l = 0``, ``acc = 0``);
    ``out [heads, dim]`` the softmax-weighted values over every key. Against the softmax over every key on
    targeted cases (the first failure stops the check, naming the mistake); then, unless ``live=False``, a
    SmolLM2-shaped decode step cut as minivllm's C++ kernel cuts it, against the kernel."""
    require_written(fn)
    if is_minivllms(fn):
        raise AssertionError(f"{fn.__name__} is minivllm's own function: the check runs your merge alone")
    worst = max(_check_case(fn, *case) for case in CASES)
    say(f"check_merge_partials: all {len(CASES)} cases equal the softmax over every key (largest difference "
        f"{worst:.1e}), empty chunks and maxima 100 apart included.")
    if live:
        _check_live(fn)
