"""Chapter 07, sampling and streaming: the check of the reader's nucleus (top-p) filter, against
minivllm's sampler.
"""

from __future__ import annotations

import torch

from minivllm.sampler import apply_top_k_top_p

__all__ = ["check_top_p_filter", "reference_top_p"]


def reference_top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """minivllm's top-p on a probability vector: :func:`~minivllm.sampler.apply_top_k_top_p` on its logs, in float64."""
    logits = probs.double().log()[None]
    filtered = apply_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([p], dtype=torch.float64))
    return filtered.softmax(dim=-1)[0]


def _top_p_cases():
    g = torch.Generator().manual_seed(0)
    hand = torch.tensor([0.05, 0.5, 0.1, 0.2, 0.15])  # deliberately not sorted
    cases = [(hand, p) for p in (0.3, 0.6, 0.76, 0.9, 0.99, 1.0)]
    for n, sharp in ((8, 1.0), (50, 3.0), (1000, 2.0)):
        probs = (torch.randn(n, generator=g) * sharp).softmax(dim=-1)
        cases += [(probs, p) for p in (0.05, 0.5, 0.9, 0.95)]
    return cases


def check_top_p_filter(fn) -> None:
    """Check ``fn(probs, p) -> probs``, nucleus (top-p) filtering of a 1-D probability vector (chapter 07).

    The result must keep the smallest set of most likely tokens whose mass
    reaches ``p`` (so the most likely token always stays), zero the others,
    renormalise to sum 1, keep the input's shape and leave the input unchanged.
    Compared with minivllm's :func:`~minivllm.sampler.apply_top_k_top_p`.
    """
    cases = _top_p_cases()
    for probs, p in cases:
        what = f"top_p_filter(probs of {probs.numel()} tokens, p={p})"
        if probs.numel() <= 8:
            what = f"top_p_filter({[round(x, 4) for x in probs.tolist()]}, p={p})"
        before = probs.clone()
        got = fn(probs, p)
        if not torch.equal(probs, before):
            raise AssertionError(f"{what}: the input tensor was modified in place; return a new tensor")
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
        if tuple(got.shape) != tuple(probs.shape):
            raise AssertionError(f"{what}: expected shape {tuple(probs.shape)}, got {tuple(got.shape)}")
        got = got.detach().double().cpu()
        expected = reference_top_p(probs, p)
        keep, kept = expected > 0, got > 0
        if not torch.equal(keep, kept):
            order = probs.argsort(descending=True)
            rank = {int(t): r for r, t in enumerate(order)}
            want = sorted(rank[int(t)] for t in keep.nonzero().flatten())
            have = sorted(rank[int(t)] for t in kept.nonzero().flatten())
            cum = probs.double()[order].cumsum(0)
            hint = ""
            if not have:
                hint = "; nothing kept: the most likely token always survives"
            elif have != list(range(len(have))):
                hint = "; keep the most likely tokens: sort by probability first"
            elif len(have) == len(want) - 1:
                hint = (f"; you dropped the token that makes the mass reach p: the top {len(have)} hold only "
                        f"{cum[len(have) - 1]:.4f} < p, so the next most likely token is needed too")
            elif len(have) == len(want) + 1:
                hint = f"; one token too many: the top {len(want)} already hold {cum[len(want) - 1]:.4f} >= p"
            n = len(have)
            raise AssertionError(f"{what}: keeps {n} token{'s' * (n != 1)}, expected the top {len(want)} "
                                 f"(ranks kept, 0 = most likely: {have[:12]}{'...' if n > 12 else ''}){hint}")
        if abs(float(got.sum()) - 1) > 1e-5:
            raise AssertionError(f"{what}: the kept tokens are right but sum to {float(got.sum()):.6f}; "
                                 f"renormalise so the result is a distribution (sum 1)")
        if not torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
            i = int((got - expected).abs().argmax())
            raise AssertionError(f"{what}: token {i} has probability {float(got[i]):.6f}, expected "
                                 f"{float(expected[i]):.6f} (its original probability divided by the kept mass)")
    print(f"check_top_p_filter: all {len(cases)} cases match minivllm's top-p filter.")
