"""Timing that means what it says, on a CPU and on a GPU (chapter 11; chapter 01 first uses it).

GPU work is asynchronous: a CUDA kernel launch returns before the kernel
finishes, so a wall-clock reading must wait for the device first or it times
the launch, not the work. :class:`Timer` is the one interface: CUDA events on
a GPU, ``time.perf_counter`` on a CPU.
"""

from __future__ import annotations

import time

import torch


def now(device=None) -> float:
    """``time.perf_counter()`` after the GPU has finished its queued work (when ``device`` is CUDA)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def median_time(fn, device=None, repeats: int = 3, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` runs, after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = now(device)
        fn()
        times.append(now(device) - start)
    return sorted(times)[len(times) // 2]
