"""Timing that means what it says, on a CPU and on a GPU (chapters 01, 11 and 12).

GPU work is asynchronous: a CUDA kernel launch returns before the kernel
finishes, so a wall-clock reading must wait for the device first or it times
the launch, not the work. :class:`Timer` is the one interface: CUDA events on
a GPU, ``time.perf_counter`` on a CPU.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch

__all__ = ["now", "median_time", "Timer", "PhaseClock", "quiet_profile"]


def now(device=None) -> float:
    """``time.perf_counter()`` after the GPU has finished its queued work (when ``device`` is
    CUDA)."""
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


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class Timer:
    """Seconds of work between :meth:`start` and :meth:`stop`, on either device, through one interface.

    On a GPU it records CUDA events in the stream and waits for the end event,
    so the figure is the GPU's own time for the queued work, not the time to
    launch it; on a CPU it reads ``time.perf_counter``. Use as
    ``with Timer(device) as t: ...`` and read ``t.seconds``.
    """

    def __init__(self, device=None):
        self.cuda = _is_cuda(device)
        self.seconds: float | None = None

    def start(self) -> Timer:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def stop(self) -> float:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            self.seconds = self._start.elapsed_time(end) / 1e3
        else:
            self.seconds = time.perf_counter() - self._t0
        return self.seconds

    def __enter__(self) -> Timer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class PhaseClock:
    """Splits one engine step into named phases: ``mark(name)`` closes the phase that ran since the last mark.

    With ``sync`` on a GPU each mark first waits for the device, so a phase owns
    the kernels it launched (this costs a little overlap; chapter 11's breakdown
    turns it on, normal serving leaves it off).
    """

    def __init__(self, device=None, sync: bool = False):
        self.device = device if sync and _is_cuda(device) else None
        self.phases: dict[str, float] = {}
        self._last = now(self.device)

    def mark(self, name: str) -> None:
        t = now(self.device)
        self.phases[name] = self.phases.get(name, 0.0) + t - self._last
        self._last = t


@contextlib.contextmanager
def _fd2_silenced():
    """File descriptor 2 (the process's C-level stderr) to /dev/null for the block, then back."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def quiet_profile(**kwargs):
    """``torch.profiler.profile(**kwargs)`` without the lines its start and stop write to stderr (chapters 12, 18).

    Kineto, the profiler's C++ side, writes ``USDT: ... profiler_start`` and ``profiler_stop`` straight to file
    descriptor 2 (torch 2.13), where Python cannot catch it and a notebook shows it under the cell. Only the
    start and the stop run with fd 2 closed off; the profiled block keeps its stderr.
    """
    from torch.profiler import profile

    prof = profile(**kwargs)
    with _fd2_silenced():
        prof.start()
    try:
        yield prof
    finally:
        with _fd2_silenced():
            prof.__exit__(None, None, None)  # stop, and the profiler's own clean-up
