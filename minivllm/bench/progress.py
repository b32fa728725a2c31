"""Progress of one system's run on stderr, one short line at a time (``bench``, chapter 11).

Every system ``bench`` runs (minivllm's engine, the HF baselines, the peers in
their own processes) reports through a :class:`Progress`: tokens (or requests)
done of the total, requests finished, seconds elapsed. On a terminal the line
is rewritten in place; into a file or a pipe a new line is written every few
seconds, so a log shows that a long run is alive. No bar, no dependency.
"""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]

WIDTH = 100  # no printed line is longer


class Progress:
    """``name: 120/512 tokens, 3/16 requests, 12 s`` on ``stream`` (stderr), at most every ``every`` seconds.

    :meth:`update` counts what finished; :meth:`tick` only lets the clock show (a heartbeat while nothing is
    counted, e.g. a subprocess loading); :meth:`close` writes the last line. ``note`` is free text shown after
    the counts (what a peer's driver last said). Disabled, every method does nothing.
    """

    def __init__(self, name: str, total: int, unit: str = "tokens", requests: int | None = None,
                 enabled: bool = True, every: float | None = None, stream=None):
        self.name, self.total, self.unit, self.requests_total = name, total, unit, requests
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every if every is not None else (0.5 if self.tty else 3.0)
        self.done = self.requests_done = 0
        self.note = ""
        self.start = time.perf_counter()
        self._shown = -float("inf")
        self._last = ""
        self._closed = False
        self._show(force=True)

    def line(self) -> str:
        """The progress line as it stands (at most :data:`WIDTH` characters)."""
        parts = [f"{self.done}/{self.total} {self.unit}" if self.total else f"{self.done} {self.unit}"]
        if self.requests_total is not None:
            parts.append(f"{self.requests_done}/{self.requests_total} requests")
        parts.append(f"{time.perf_counter() - self.start:.0f} s")
        if self.note:
            parts.append(self.note)
        return f"  {self.name[:40]}: {', '.join(parts)}"[:WIDTH]

    def _show(self, force: bool = False, end: str = "") -> None:
        if not self.enabled or self._closed:
            return
        t = time.perf_counter()
        if not force and t - self._shown < self.every:
            return
        self._shown = t
        line = self.line()
        if self.tty:
            self.stream.write("\r" + line.ljust(WIDTH - 1)[:WIDTH - 1] + end)
        elif line != self._last:  # into a file: the last line is not written twice
            self.stream.write(line + "\n")
        self._last = line
        self.stream.flush()

    def update(self, n: int = 0, requests: int = 0) -> None:
        """``n`` more units and ``requests`` more finished requests."""
        self.done += n
        self.requests_done += requests
        self._show()

    def tick(self, note: str | None = None) -> None:
        """A heartbeat: show the elapsed time (and ``note``, if given) when a line is due."""
        if note is not None:
            self.note = note
        self._show()

    def close(self, stopped: bool = False) -> None:
        """The last line (``stopped``: the run was interrupted), then nothing more."""
        if stopped:
            self.note = "stopped"
        self._show(force=True, end="\n")
        self._closed = True

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.close(stopped=kind is not None)
