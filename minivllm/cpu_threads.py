"""How long OpenMP's threads spin before they sleep: minivllm's default for a shared CPU (chapter 11).

PyTorch's CPU kernels run on an OpenMP team (GNU libgomp in the PyPI wheels).
Between two parallel regions, and at each region's closing barrier, a thread
that has nothing to do spins for ``GOMP_SPINCOUNT`` iterations before it
sleeps, 300,000 by default (milliseconds). On a machine to itself that hides
the wake-up; beside another CPU-bound process it is a trap: one thread of the
team is descheduled, and its partner burns its whole time slice spinning at the
barrier that waits for it. Measured with ``python -m minivllm.bench
contention`` on a 2-core machine (16 requests, 64 output tokens, medians of 5,
one busy loop per core when loaded): libgomp's default ran 4.8x slower loaded
than quiet, a spin count of 10,000 2.2x, at the same quiet throughput (and the
same batch-1 TPOT); 0 (``OMP_WAIT_POLICY=passive``) 1.3x, but 35% slower quiet.

libgomp reads its environment once, when it is loaded, so :func:`apply_defaults`
runs at ``import minivllm``, before anything imports torch; a process that
imported torch first keeps libgomp's default (:func:`spin_count_in_force` says
so). A value the user set (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``, which
libgomp turns into a spin count) is never replaced. Beside the value, minivllm
sets :data:`MARKER` to it: a worker process it spawns (tensor parallelism,
disaggregation) inherits both and knows the value is minivllm's, not the
user's. This module imports nothing of minivllm's and not torch.
"""

from __future__ import annotations

import os
import sys

__all__ = ["SPIN_COUNT", "LIBGOMP_SPIN_COUNT", "MARKER", "apply_defaults", "set_by_minivllm", "spin_count_in_force"]

SPIN_COUNT = 10_000  # minivllm's default GOMP_SPINCOUNT (see the module docstring for the measurement)
LIBGOMP_SPIN_COUNT = 300_000  # libgomp's own, when neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY is set
MARKER = "MINIVLLM_GOMP_SPINCOUNT"  # set with GOMP_SPINCOUNT: the value a child process inherits is minivllm's
_USER_KEYS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
_set_here: dict[str, str] = {}


def _inherited(environ) -> bool:
    """Whether ``GOMP_SPINCOUNT`` came from a minivllm parent process (its :data:`MARKER` agrees, no wait policy)."""
    value = environ.get("GOMP_SPINCOUNT")
    return value is not None and environ.get(MARKER) == value and "OMP_WAIT_POLICY" not in environ


def apply_defaults(environ=os.environ) -> dict[str, str]:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` (and :data:`MARKER`) unless the user chose a spin count or a
    wait policy, or torch (and with it libgomp) is already loaded; returns what it set (and remembers it for
    :func:`set_by_minivllm`). In a process spawned by minivllm, the inherited value counts as minivllm's."""
    if _inherited(environ):
        if environ is os.environ:
            _set_here.update({key: environ[key] for key in ("GOMP_SPINCOUNT", MARKER)})
        return {}
    if any(key in environ for key in _USER_KEYS) or "torch" in sys.modules:
        return {}
    values = {"GOMP_SPINCOUNT": str(SPIN_COUNT), MARKER: str(SPIN_COUNT)}
    environ.update(values)
    if environ is os.environ:
        _set_here.update(values)
    return values


def set_by_minivllm() -> dict[str, str]:
    """The variables :func:`apply_defaults` set in this process (a peer engine started from it should get its
    own defaults, not minivllm's: ``{k: v for k, v in os.environ.items() if k not in set_by_minivllm()}``)."""
    return {k: v for k, v in _set_here.items() if os.environ.get(k) == v}


def spin_count_in_force() -> str:
    """What libgomp spins with in this process, in words: minivllm's default, the user's choice, or libgomp's own
    (torch was imported before minivllm)."""
    if set_by_minivllm():
        return f"GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']} (minivllm's default)"
    chosen = {k: os.environ[k] for k in _USER_KEYS if k in os.environ}
    if chosen:
        return ", ".join(f"{k}={v}" for k, v in chosen.items()) + " (set by the user)"
    return f"libgomp's default ({LIBGOMP_SPIN_COUNT:,}): torch was imported before minivllm"
