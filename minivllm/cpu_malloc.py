"""How the C allocator keeps a step's freed buffers for the next step (chapter 12).

A prefill step of 2,048 tokens allocates and frees buffers of up to 25 MB in
every layer (the MLP's gate and up projections: tokens x 3,072 floats).
glibc's malloc gives memory back to the kernel when the free space at the top
of its heap passes its trim threshold (by default twice the largest buffer
freed so far), and serves a buffer past its mmap threshold with a fresh
mapping. Either way the next step's buffers are new pages, and the kernel
zeroes each 4 KiB page when it is first touched: a minor page fault, about
2 µs here. On the course's 2-core CPU, running chapter 11's offline
workload three times a process, two of five processes took 64,000-430,000
faults a round, most in the 2,048-token prefill steps; with
:func:`keep_freed_memory`, none of five took more than 3,000, and the
kernel's time (system CPU) fell from 9.0 to 7.2 s a process. vLLM's CPU platform
preloads tcmalloc for the same reason, where its wheel bundles one.

:func:`keep_freed_memory` raises both thresholds with glibc's ``mallopt``,
once per process, when an engine is built on the CPU: the heap keeps up to
:data:`TRIM_THRESHOLD` of free space, and buffers up to
:data:`MMAP_THRESHOLD` (glibc's largest allowed) come from the heap. It
leaves the allocator alone where the user tuned it (a ``MALLOC_*`` variable
or ``GLIBC_TUNABLES``), preloaded another one (``LD_PRELOAD``), or where the
C library is not glibc. This module imports nothing of minivllm's and not
torch.
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys

__all__ = ["TRIM_THRESHOLD", "MMAP_THRESHOLD", "keep_freed_memory", "malloc_in_force", "users_choice",
           "repeated_step_faults", "USER_VARIABLES"]

TRIM_THRESHOLD = 1 << 30  # bytes of free heap top glibc keeps instead of handing back to the kernel
MMAP_THRESHOLD = 32 << 20  # the largest buffer served from the heap: glibc's ceiling for this setting on 64-bit
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
USER_VARIABLES = _MALLOC_VARIABLES + ("GLIBC_TUNABLES", "LD_PRELOAD")  # where users_choice looks
_outcome: str | None = None  # None before the first call; then "" where set, or why not


def users_choice(environ=os.environ) -> str | None:
    """How the user chose this process's allocator, in words (a ``MALLOC_*`` variable, glibc's malloc tunables, or
    an allocator in ``LD_PRELOAD``), or None."""
    for key in _MALLOC_VARIABLES:
        if key in environ:
            return f"{key} is set"
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    if "malloc" in environ.get("LD_PRELOAD", ""):
        return f"LD_PRELOAD={environ['LD_PRELOAD']}"
    return None


def keep_freed_memory(environ=os.environ) -> bool:
    """Have glibc keep a step's freed buffers for the next step (the module docstring says why); True where it is
    set, now or earlier in this process. Once per process; nothing where the user chose, or off glibc."""
    global _outcome
    if _outcome is None:
        choice = users_choice(environ)
        if choice is not None:
            _outcome = f"{choice} (the user's choice)"
        elif platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            _outcome = "the C library is not glibc"
        else:
            libc = ctypes.CDLL(None)
            set_both = (libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
                        and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1)
            _outcome = "" if set_both else "glibc refused the thresholds"
    return _outcome == ""


def malloc_in_force() -> str:
    """How this process's C allocator keeps freed memory, in words (for a benchmark's settings line)."""
    if _outcome == "":
        return (f"glibc malloc keeps freed memory (trim threshold {TRIM_THRESHOLD >> 20} MiB, "
                f"mmap threshold {MMAP_THRESHOLD >> 20} MiB: minivllm's default)")
    return f"the allocator as it was: {_outcome or 'no engine on the CPU in this process yet'}"


_STEPS = """
import resource, sys, torch
if sys.argv[1] == "engine":
    import minivllm
    minivllm.LLM("tiny-random", device="cpu")
from minivllm.cpu_malloc import malloc_in_force
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a 2,048-token prefill's pattern: three 24 MB buffers, all freed by the step's end
    buffers = [torch.ones(6_000_000) for _ in range(3)]  # 24 MB each
    del buffers
step(); step()
before = faults()
for _ in range(10): step()
print((faults() - before) / 10, malloc_in_force(), sep="|")
"""


def repeated_step_faults(engine: bool, env: dict | None = None) -> tuple[float, str]:
    """Page faults a step of three 24 MB buffers takes once repeated, and :func:`malloc_in_force`'s words, in a fresh
    interpreter: after building an engine on the CPU (``engine``) or as glibc sets itself. ``env`` (default: this
    process's environment) is the interpreter's whole environment."""
    out = subprocess.run([sys.executable, "-c", _STEPS, "engine" if engine else "plain"], capture_output=True,
                         text=True, timeout=300, env=os.environ if env is None else env)
    if out.returncode != 0:
        raise RuntimeError(f"the fresh interpreter failed: {out.stderr[-2000:]}")
    faults, words = out.stdout.strip().splitlines()[-1].split("|")
    return float(faults), words
