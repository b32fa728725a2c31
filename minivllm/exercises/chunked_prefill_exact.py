"""Chapter 02, chunked prefill is exact: the check of the reader's causal mask for a chunk ``[a, b)``
of a prompt, against :func:`minivllm.attention.causal_chunk_mask`.
"""

from __future__ import annotations

import torch

from minivllm.attention import causal_chunk_mask

__all__ = ["check_chunk_mask"]


def _mask_rows(m: torch.Tensor) -> str:
    return "\n".join("    " + "".join("1" if x else "." for x in row) for row in m.tolist())


def check_chunk_mask(fn) -> None:
    """Check ``fn(a, b) -> bool tensor [b - a, b]``, the causal mask of chunk ``[a, b)`` (chapter 02).

    Compared with :func:`minivllm.attention.causal_chunk_mask` for every
    ``0 <= a < b <= 12`` and a few larger chunks: type, dtype, shape, values.
    """
    cases = [(a, b) for b in range(1, 13) for a in range(b)] + [(0, 64), (100, 101), (37, 80)]
    for a, b in cases:
        what = f"chunk_mask({a}, {b})"
        expected = causal_chunk_mask(a, b)
        got = fn(a, b)
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
        if got.dtype != torch.bool:
            raise AssertionError(f"{what}: expected dtype torch.bool (True = may attend), got {got.dtype}")
        if tuple(got.shape) != tuple(expected.shape):
            raise AssertionError(
                f"{what}: expected shape {tuple(expected.shape)} (one row per query in the chunk, "
                f"one column per key in [0, {b})), got {tuple(got.shape)}")
        got = got.cpu()
        if not torch.equal(got, expected):
            i = int((got != expected).any(dim=1).nonzero()[0])
            j = int((got[i] != expected[i]).nonzero()[0])
            picture = f"\n  expected:\n{_mask_rows(expected)}\n  got:\n{_mask_rows(got)}" if b <= 16 else ""
            raise AssertionError(
                f"{what}: row {i} (the query at position {a + i}) differs first at key {j}: expected "
                f"{bool(expected[i, j])}, got {bool(got[i, j])}; the query at position p sees keys 0..p{picture}")
    print(f"check_chunk_mask: all {len(cases)} chunks [a, b) match causal_chunk_mask.")
