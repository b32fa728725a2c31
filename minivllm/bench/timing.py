"""The benchmarks' clocks: :mod:`minivllm.timing`, re-exported (chapter 11)."""

from minivllm.timing import PhaseClock, Timer, median_time, now

__all__ = ["now", "median_time", "Timer", "PhaseClock"]
