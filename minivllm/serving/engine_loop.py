"""``EngineLoop``: what ``AsyncLLM``'s background thread runs, one turn after another (chapter 13, exercise 13).

It holds what the loop thread shares with the callers, the **inbox** of new
requests and aborts, in the order they came, and the table of open
**streams** (each request's event loop and asyncio queue), and it runs the
**turn**: take the inbox into the engine, step, hand each output to its own
request's queue. ``AsyncLLM`` keeps the rest: building and rebuilding the
engine, the shutdown deadline, and failing what is in flight when a turn
raises. It is an extension point: ``AsyncLLM(engine, loop_cls=...)`` builds a
subclass instead (the reader's, in exercise 13). :class:`EngineLoop` is the
interface and what a turn is given; :class:`MiniEngineLoop` is minivllm's own
turn, ``AsyncLLM``'s default.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from minivllm.outputs import RequestOutput
from minivllm.timing import now

__all__ = ["EngineLoop", "MiniEngineLoop", "IDLE_WAIT_S", "STATS_EVERY_S"]

log = logging.getLogger("minivllm.serving")
IDLE_WAIT_S = 0.5  # an idle loop thread wakes this often (to publish stats, to notice a deadline)
STATS_EVERY_S = 0.1  # a busy loop thread refreshes the engine's stats (the gauges of /metrics) this often


class EngineLoop:
    """The inbox, the open streams and one turn of the engine loop; only the loop thread calls ``turn``."""

    def __init__(self, engine, metrics=None):
        self.engine, self.metrics = engine, metrics  # metrics: a ServerMetrics, or None
        self.inbox: deque = deque()  # ("add", request_id, token_ids, params, arrival_time) and ("abort", request_id)
        self.streams: dict[str, tuple] = {}  # request_id: (its event loop, its asyncio.Queue), while it is open
        self.guard = threading.Lock()  # the streams and the inbox change together
        self.wake = threading.Event()  # set when the inbox gets something
        self._stats_at = float("-inf")

    # -- the callers' side (any thread) --------------------------------------------------------------
    def open(self, request_id: str, target: tuple, token_ids, params, arrival_time: float, check=None) -> None:
        """Open a stream (``target``: its event loop and queue) and queue its request; ``check()`` (the room for it)
        runs under the same lock and may raise, then nothing changes."""
        with self.guard:
            if check is not None:
                check()
            self.streams[request_id] = target
            self.inbox.append(("add", request_id, token_ids, params, arrival_time))
        self.wake.set()

    def close(self, request_id: str) -> None:
        """The caller is gone: forget its stream now, and queue the request's abort for the loop thread."""
        with self.guard:
            if self.streams.pop(request_id, None) is None:
                return
            self.inbox.append(("abort", request_id))
        self.wake.set()

    # -- what a turn is given (the loop thread) --------------------------------------------------------
    def deliver(self, request_id: str, item, last: bool = False) -> None:
        """Hand ``item`` (an output, or an exception the stream raises) to the request's queue;
        ``last``: it is the request's final item, so its stream is closed. A stream already closed
        gets nothing; one whose event loop is gone is closed and its request aborted."""
        with self.guard:
            target = self.streams.pop(request_id, None) if last else self.streams.get(request_id)
        if target is None:
            return  # aborted by its caller meanwhile
        try:
            target[0].call_soon_threadsafe(target[1].put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody will read this request
            if not last:
                with self.guard:
                    self.streams.pop(request_id, None)
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort the request in the engine (its blocks are free at once) and forget it in the metrics."""
        self.engine.abort_request(request_id)
        if self.metrics is not None:
            self.metrics.forget(request_id)

    def idle(self) -> None:
        """Nothing to step: check the engine's health, refresh the stats, and sleep until the inbox gets something
        (at most ``IDLE_WAIT_S``)."""
        self.engine.check_health()
        self.publish([])
        self.wake.wait(IDLE_WAIT_S)
        self.wake.clear()

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Outputs into the metrics at every step; the engine's stats when idle or every ``STATS_EVERY_S``."""
        if self.metrics is None:
            return
        stats = None
        if not outputs or now() - self._stats_at >= STATS_EVERY_S:
            self._stats_at = now()
            try:
                stats = self.engine.stats()
            except Exception:  # the gauges wait for the next refresh; the outputs are still counted
                log.exception("reading the engine's stats failed")
        self.metrics.record(outputs, stats)

    # -- the turn (exercise 13 has the reader write these three; minivllm's own: MiniEngineLoop) ------
    def take_inbox(self) -> None:
        """Everything in the inbox into the engine, in order (``self.inbox.popleft()`` until it is empty): each add
        (``self.engine.add_request``; a refused one, a ``ValueError``, ends that request alone with the error, and
        the rest goes on), each abort (``self.abort``)."""
        raise NotImplementedError("not written yet: EngineLoop.take_inbox")

    def route(self, outputs: list[RequestOutput]) -> None:
        """Each output to its own request's stream; a finished one is its stream's last."""
        raise NotImplementedError("not written yet: EngineLoop.route")

    def turn(self) -> list[RequestOutput] | None:
        """One turn: the inbox, then a step and its outputs routed (returned); or, with nothing to do, idle (None)."""
        raise NotImplementedError("not written yet: EngineLoop.turn")


class MiniEngineLoop(EngineLoop):
    """minivllm's own turn (``AsyncLLM``'s default ``loop_cls``): exercise 13's three methods."""

    def take_inbox(self) -> None:
        while self.inbox:
            item = self.inbox.popleft()
            if item[0] == "abort":
                self.abort(item[1])
                continue
            _, request_id, token_ids, params, arrival_time = item
            try:
                self.engine.add_request(request_id, token_ids, params, arrival_time=arrival_time)
            except ValueError as e:  # validated by the caller, so only a race can get here
                self.deliver(request_id, e, last=True)

    def route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.deliver(out.request_id, out, last=out.finished)

    def turn(self) -> list[RequestOutput] | None:
        self.take_inbox()
        if not self.engine.has_unfinished_requests():
            self.idle()
            return None
        outputs = self.engine.step()
        self.route(outputs)
        return outputs
