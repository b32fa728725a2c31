"""``AsyncLLM``: the engine loop in one background thread, one asyncio queue per request (chapter 13).

The web server's event loop must never wait for a forward pass, so the engine
gets a thread of its own that owns it: it takes new requests and aborts from a
thread-safe inbox, runs ``LLMEngine.step()``, and hands each ``RequestOutput``
to the queue of its request (``loop.call_soon_threadsafe``), where the request's
handler awaits it. That turn, and the inbox and streams it shares with the
callers, is :class:`~minivllm.serving.engine_loop.EngineLoop` (``loop_cls``, an
extension point: exercise 13). The same ``LLMEngine`` code path serves
``LLM.generate``.

- A request is validated (``LLMEngine.validate_request``) in the caller, so bad
  input raises ``ValueError`` before anything is queued.
- Backpressure: beyond ``max_num_seqs + max_queue_size`` requests in flight,
  :meth:`AsyncLLM.add_request` raises :class:`QueueFull` at once.
- A stream that is closed or cancelled before its last output aborts its request:
  the loop thread frees its blocks before the next step.
- :meth:`AsyncLLM.shutdown` stops accepting, lets requests in flight finish for
  a grace period, then aborts the rest (their streams raise :class:`ServerShuttingDown`).
- The loop never dies and never idles with an output undelivered: an error in
  a step, in publishing stats or in a health check fails the requests in
  flight (their streams raise :class:`RequestFailed`) and the loop goes on.
  An engine that can no longer step (``check_health`` raises
  :class:`~minivllm.distributed.WorkerError`: a tensor-parallel rank died) is
  shut down and built again from the builder; the requests in flight and new
  ones meanwhile get :class:`EngineRestarting` (a 503: retry), and :attr:`is_alive` is
  False (``/health`` answers 503).

Give it a function that builds the engine rather than the engine, as the
server does, and the loop thread builds it: then one thread does all the
tensor work. On a machine with few cores that matters: once two threads each
own an OpenMP team, more threads wait than there are cores, OpenMP stops
spinning for work, and a batch-1 decode step on a 2-core CPU slows from
about 36 to 55 ms.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import AsyncIterator, Callable

from minivllm.config import NOT_WRITTEN, check, is_int, not_written, resolve
from minivllm.distributed import WorkerError
from minivllm.engine import LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.serving.engine_loop import IDLE_WAIT_S, EngineLoop, MiniEngineLoop
from minivllm.timing import now

__all__ = ["AsyncLLM", "RequestStream", "QueueFull", "ServerShuttingDown", "EngineRestarting", "RequestFailed"]

log = logging.getLogger("minivllm.serving")
START_TIMEOUT_S = 600.0  # the longest the loop thread may take to build the engine


class QueueFull(Exception):
    """Too many requests in flight: the server answers 429 at once instead of queueing without bound."""


class ServerShuttingDown(Exception):
    """The server is draining: no new requests, and what is left at the deadline is aborted."""


class EngineRestarting(ServerShuttingDown):
    """The engine failed as a whole and is being built again: retry shortly (a 503, like draining)."""


class RequestFailed(Exception):
    """The engine loop itself failed while this request was in flight (not a per-request error)."""


class RequestStream:
    """One request's outputs, in order: ``async for out in stream``; closing it early aborts the request."""

    def __init__(self, owner: AsyncLLM, request_id: str, queue: asyncio.Queue):
        self.owner, self.request_id, self.queue = owner, request_id, queue
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                out = await self.queue.get()
                if isinstance(out, BaseException):
                    self.finished = True
                    raise out
                self.finished = out.finished
                yield out
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class AsyncLLM:
    """An ``LLMEngine`` served from one background thread to asyncio callers."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], max_queue_size: int | None = None,
                 metrics=None, loop_cls: type | str = MiniEngineLoop):
        """``engine``: an engine, or a function the loop thread calls to build one (its error is raised here).
        ``loop_cls``: the :class:`EngineLoop` (sub)class, or its dotted name, that the loop thread turns."""
        check(max_queue_size is None or (is_int(max_queue_size) and max_queue_size >= 0), "max_queue_size",
              "None (no limit) or an integer >= 0", max_queue_size)
        self.loop_cls = resolve(loop_cls, "loop_cls")
        check(issubclass(self.loop_cls, EngineLoop), "loop_cls", "a subclass of EngineLoop", self.loop_cls)
        left = not_written(self.loop_cls)  # EngineLoop itself only declares the turn (exercise 13)
        check(not left, "loop_cls", "an EngineLoop subclass whose turn is written (the default is MiniEngineLoop)",
              f"{self.loop_cls.__name__} ({NOT_WRITTEN}: {', '.join(left)})")
        self.metrics = metrics  # a ServerMetrics (or None): updated from the loop thread
        self.accepting = True
        self.loop: EngineLoop | None = None  # built by the loop thread, around the engine it builds
        self._stop = threading.Event()
        self._deadline: float | None = None
        self._ids = itertools.count()
        self._build = engine if callable(engine) else (lambda: engine)
        self._rebuildable = callable(engine)  # an engine given as it is cannot be built again
        self._healthy = True  # False while a failed engine is rebuilt (or when it cannot be)
        self.num_engine_restarts = 0
        self._started, self._start_error = threading.Event(), None
        self._thread = threading.Thread(target=self._run, name="minivllm-engine-loop", daemon=True)
        self._thread.start()
        self._started.wait(START_TIMEOUT_S)
        if self._start_error is not None:
            raise self._start_error
        if not self._started.is_set():
            raise RuntimeError(f"the engine was not built within {START_TIMEOUT_S} s")
        self.max_in_flight = None if max_queue_size is None else self.engine.config.max_num_seqs + max_queue_size

    @property
    def engine(self) -> LLMEngine:
        return self.loop.engine

    @property
    def num_in_flight(self) -> int:
        return len(self.loop.streams)

    @property
    def is_alive(self) -> bool:
        """Whether the loop thread runs and its engine can step now (``/health``; ``LLMEngine.is_ready``: a
        disaggregated engine's link is up)."""
        return self._thread.is_alive() and self._healthy and self.engine.is_ready()

    # -- the caller's side (the event loop) ------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None) -> RequestStream:
        """Validate and queue a request; returns its :class:`RequestStream`. Raises ValueError, QueueFull or
        ServerShuttingDown before anything is queued. Call it from a running event loop."""
        loop = asyncio.get_running_loop()
        request_id = request_id or f"req-{next(self._ids)}"
        arrival_time = now() if arrival_time is None else arrival_time
        _, ids = self.engine.validate_request(request_id, prompt, params, arrival_time=arrival_time)
        queue: asyncio.Queue = asyncio.Queue()
        self.loop.open(request_id, (loop, queue), ids, params.clone(), arrival_time,
                       check=lambda: self._check_room(request_id))
        return RequestStream(self, request_id, queue)

    def _check_room(self, request_id: str) -> None:
        if not self.accepting or not self._thread.is_alive():
            raise ServerShuttingDown("the server is shutting down and accepts no new requests")
        if not self._healthy:
            raise EngineRestarting("the engine failed and is being restarted; retry shortly")
        if request_id in self.loop.streams:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        if self.max_in_flight is not None and len(self.loop.streams) >= self.max_in_flight:
            raise QueueFull(f"{len(self.loop.streams)} requests in flight, the most this server queues "
                            f"(max_num_seqs {self.engine.config.max_num_seqs} + max_queue_size "
                            f"{self.max_in_flight - self.engine.config.max_num_seqs}); retry later")

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (vLLM's ``AsyncLLM.generate``); breaking out of the loop aborts it."""
        stream = self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Forget the request's queue now; the loop thread aborts it in the engine before its next step."""
        self.loop.close(request_id)

    def shutdown(self, grace_s: float) -> None:
        """Stop accepting; requests still running ``grace_s`` seconds from now are aborted.

        Safe in a signal handler: it only sets two attributes and takes no lock (a handler that waits for a
        lock its own thread holds deadlocks); the loop thread sees them within ``IDLE_WAIT_S`` or one step.
        A second call never moves the deadline later."""
        deadline = now() + grace_s
        self.accepting = False
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline

    def close(self, timeout_s: float = 10.0) -> None:
        """Abort everything, stop the loop thread and wait for it (bounded)."""
        self.shutdown(0.0)
        self._stop.set()
        if self.loop is not None:
            self.loop.wake.set()
        self._thread.join(timeout_s)
        if self._rebuildable and self.loop is not None:  # the engine it built is its own to stop
            self.engine.shutdown()

    # -- the loop thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.loop = self.loop_cls(self._build(), self.metrics)
        except BaseException as e:  # raised by the constructor, in the caller's thread
            self._start_error = e
            return
        finally:
            self._started.set()
        while not self._stop.is_set():
            try:
                self._once()
            # the engine cannot step any more: fail what is in flight, build it again
            except WorkerError as e:
                log.error("engine failed: %s", e)
                self._end_all(
                    EngineRestarting(f"engine failed: {e}; it is being restarted, retry shortly")
                )
                self._restart_engine()
            # a bug outside any one request: fail what is in flight, keep serving
            except Exception as e:
                log.exception("engine loop failed; aborting the requests in flight")
                self._end_all(RequestFailed(f"engine loop failed: {type(e).__name__}: {e}"))
                # nothing is in flight now: a turn that fails again must not spin
                self.loop.wake.wait(IDLE_WAIT_S)
                self.loop.wake.clear()
        self._end_all(ServerShuttingDown("aborted: the server stopped"))

    def _once(self) -> None:
        """The deadline, then one turn of the loop (adds and aborts, a step and its outputs routed, or a nap)."""
        if self._deadline is not None and now() >= self._deadline:
            self._end_all(ServerShuttingDown("aborted: the server shut down before this request finished"))
        outputs = self.loop.turn()
        if outputs is not None:
            self.loop.publish(outputs)

    def _restart_engine(self) -> None:
        """Shut the failed engine down and build a new one (unhealthy meanwhile; for good if it cannot be)."""
        self._healthy = False
        try:
            self.engine.shutdown()
        except Exception:
            log.exception("shutting the failed engine down")
        if not self._rebuildable:
            log.error("the engine was given as an object and cannot be rebuilt: /health stays 503")
            self._stop.wait()  # nothing more to serve; close() ends the loop
            return
        while not self._stop.is_set():
            try:
                self.loop.engine = self._build()
                self.num_engine_restarts += 1
                self._healthy = True
                log.warning("engine rebuilt (restart %d)", self.num_engine_restarts)
                return
            except Exception:
                log.exception("rebuilding the engine failed; trying again")
                self._stop.wait(1.0)

    def _end_all(self, error: BaseException) -> None:
        """Abort every request in flight; each stream raises ``error``."""
        try:
            self.loop.take_inbox()  # the aborts queued for requests whose streams are already closed
        except Exception:
            log.exception("taking the inbox failed; ending every open stream anyway")
        with self.loop.guard:
            ids = list(self.loop.streams)
        for request_id in ids:
            self.loop.abort(request_id)
            self.loop.deliver(request_id, error, last=True)
