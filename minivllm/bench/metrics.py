"""Serving metrics with vLLM's definitions: TTFT, TPOT, ITL, E2E, percentiles, goodput (chapter 11)."""

from __future__ import annotations


def percentile(values, q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation, as ``numpy.percentile``."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


def tpot(m) -> float | None:
    """Time per output token after the first, vLLM's definition: (E2E - TTFT) / (output tokens - 1)."""
    if m.finish_time is None or m.first_token_time is None or m.num_output_tokens < 2:
        return None
    return (m.e2e - m.ttft) / (m.num_output_tokens - 1)
