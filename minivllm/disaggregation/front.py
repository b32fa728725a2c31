"""The front of a disaggregated engine: it routes each request to the prefill worker, then the decode worker (chapter 16).

:class:`DisaggregatedEngine` has :class:`~minivllm.engine.LLMEngine`'s API
(``add_request``, ``step``, ``abort_request``, ``stats``,
``check_invariants``), so ``LLM(..., disaggregated=True)`` and the server's
``--disaggregated`` use it unchanged. It holds no model: a tokenizer, the
``TCPStore`` the workers meet on, two worker processes and a duplex pipe to
each. A request goes to the prefill worker; its first token comes back from
there, every later token from the decode worker, and the front stitches the
two into one stream (one ``RequestMetrics``: TTFT is the prefill's).

Faults: the front checks its workers at every step. A worker that died (or
a link that broke: the other side reports it) is restarted **automatically**
under a new link epoch; the requests it owned fail with ``finish_reason
"error"`` and a message, and the others go on.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, replace
from multiprocessing.connection import wait as wait_for_pipes

import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.config import EngineConfig, check
from minivllm.disaggregation.link import DECODE, PREFILL
from minivllm.disaggregation.worker import worker_main
from minivllm.distributed.workers import GRACE, WorkerError, stop_process
from minivllm.engine import LLMEngine
from minivllm.models import load_tokenizer
from minivllm.outputs import CompletionOutput, EngineStats, RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import RequestMetrics

__all__ = ["DisaggregatedEngine", "ROLES"]

ROLES = {PREFILL: "prefill", DECODE: "decode"}
START_TIMEOUT = 300.0  # seconds a worker may take to start (load its model) and meet its peer
STEP_WAIT = 0.05  # seconds a step waits for a worker's message when none is ready


@dataclass
class FrontRequest:
    """A request as the front tracks it: where it is, what the user has seen of it, who gets its outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    inbox: object = None  # the LLM call's deque, or None: LLMEngine.step's
    stage: str = "prefill"  # "prefill" until the decode worker owns it, then "decode"
    sending: bool = False  # its KV transfer has begun (the header is posted)
    first: RequestOutput | None = None  # the prefill worker's output (its metrics start the stitched ones)
    last: RequestOutput | None = None  # the latest output handed out


class DisaggregatedEngine(LLMEngine):
    """Prefill and decode in two worker processes behind one LLMEngine-like front (chapter 16)."""

    def __init__(self, config: EngineConfig | None = None, prefill_config: EngineConfig | None = None,
                 decode_config: EngineConfig | None = None, cores: tuple[int, int] | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        check(config.tensor_parallel_size == 1, "tensor_parallel_size", "1 with disaggregated=True",
              config.tensor_parallel_size)
        self.lock = threading.RLock()
        self.tokenizer = load_tokenizer(config.model)
        self.requests: dict[str, FrontRequest] = {}
        self._held, self._ready = [], []
        self.num_steps = self.num_failed_requests = 0
        self.restarts, self.epoch = Counter(), 0
        worker = replace(config, disaggregated=False)
        self.worker_configs = {PREFILL: prefill_config or worker, DECODE: decode_config or worker}
        self.cores = cores
        self.procs, self.conns, self.info, self._stats = {}, {}, {}, {}
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=START_TIMEOUT),
                                   wait_for_workers=False)
        self._closed = False
        weakref.finalize(self, _stop_all, self.procs, self.conns)  # no worker outlives a dropped front
        try:
            for role in ROLES:
                self._spawn(role)
            self._await_ready(ROLES)
        except BaseException:
            self.shutdown()
            raise
        self.vocab_size = self.info[PREFILL]["vocab_size"]
        self.max_model_len = min(i["max_model_len"] for i in self.info.values())
        self.num_blocks = min(i["num_blocks"] for i in self.info.values())

    # -- worker processes ----------------------------------------------------------------------
    def _spawn(self, role: int) -> None:
        ctx = mp.get_context("spawn")
        mine, theirs = ctx.Pipe()
        core = None if self.cores is None else self.cores[role]
        threads = 1 if core is not None else max(1, _cores() // 2)
        p = ctx.Process(target=worker_main, name=f"minivllm-{ROLES[role]}", daemon=True,
                        args=(role, self.store.port, self.epoch, self.worker_configs[role], theirs, threads, core,
                              self.config.kv_transfer_timeout))
        p.start()
        theirs.close()
        self.procs[role], self.conns[role] = p, mine
        self.info.pop(role, None)

    def _await_ready(self, roles) -> None:
        """Pump messages until every role in ``roles`` reports ready for this epoch (bounded)."""
        deadline = time.monotonic() + START_TIMEOUT
        while any(self.info.get(r, {}).get("epoch") != self.epoch for r in roles):
            for role in roles:
                if self.procs[role].exitcode is not None and self.info.get(role, {}).get("epoch") != self.epoch:
                    raise WorkerError(self._describe(role) + " while starting")
            if time.monotonic() > deadline:
                raise WorkerError(f"the disaggregated workers did not meet within {START_TIMEOUT} s")
            self._pump(STEP_WAIT, check=False)

    def _describe(self, role: int) -> str:
        p = self.procs[role]
        error = self.info.get(role, {}).get("error", "")
        return f"the {ROLES[role]} worker (pid {p.pid}) died (exit code {p.exitcode}){', after ' + error if error else ''}"

    def _pump(self, timeout: float, check: bool = True) -> None:
        """Read every message the workers sent (waiting up to ``timeout`` for one), then check they live."""
        if self._closed:
            raise WorkerError("the disaggregated engine is shut down")
        by_conn = {c: r for r, c in self.conns.items()}
        for conn in wait_for_pipes(list(by_conn), timeout):
            role = by_conn[conn]
            try:
                while conn.poll(0):
                    self._on_message(role, conn.recv())
            except (EOFError, OSError):  # it died: the check below restarts it
                pass
        if check:
            self._check_workers()

    def _check_workers(self) -> None:
        for role in ROLES:
            if self.procs[role].exitcode is not None or self.info.get(role, {}).get("down"):
                self._restart(role, self._describe(role) if self.procs[role].exitcode is not None
                              else f"the {ROLES[role]} worker stopped answering on the KV link")

    def _restart(self, role: int, reason: str) -> None:
        """Fail what ``role`` owned, replace its process, and let both sides meet under a new epoch."""
        owned = "prefill" if role == PREFILL else "decode"
        for req in [r for r in self.requests.values() if r.stage == owned]:
            self._fail(req, f"{reason}; the front restarted it")
        stop_process(self.procs[role], 0)
        self.conns[role].close()
        self.epoch += 1
        self._spawn(role)
        self._send(1 - role, ("join", self.epoch))
        self.info[1 - role]["epoch"] = None
        self._await_ready(ROLES)
        self.restarts[ROLES[role]] += 1

    def _send(self, role: int, msg: tuple) -> None:
        try:
            self.conns[role].send(msg)
        except (OSError, ValueError):  # a dead worker: the next check restarts it
            pass

    def _on_message(self, role: int, msg: tuple) -> None:
        kind, rest = msg[0], msg[1:]
        if kind == "ready":
            self.info[role] = {**rest[1], "epoch": rest[0]}
        elif kind in ("refused", "error"):
            if kind == "refused" and self.info.get(role, {}).get("epoch") is None:
                raise ValueError(rest[0])
            self.info.setdefault(role, {})["error"] = rest[0].strip().splitlines()[-1]
        elif kind == "stats":
            self._stats[role] = rest[0]
        elif kind == "link_down":
            self.info.setdefault(1 - role, {})["down"] = True
        elif kind in ("first", "out"):
            req = self.requests.get(rest[0].request_id)
            if req is not None:
                getattr(self, f"_on_{kind}")(role, req, *rest)
        elif kind in ("sending", "sent", "owned", "failed"):
            req = self.requests.get(rest[0])
            if req is not None:
                getattr(self, f"_on_{kind}")(role, req, *rest[1:])

    # -- a request's outputs -------------------------------------------------------------------
    def _on_first(self, role: int, req: FrontRequest, out: RequestOutput, delta: str) -> None:
        """The prefill's first token, shown while the request goes on to the decode worker."""
        req.first = out
        c = out.outputs[0]
        self._deliver(req, replace(out, finished=False, outputs=[
            CompletionOutput(0, delta, list(c.token_ids), delta, list(c.token_ids))]))

    def _on_out(self, role: int, req: FrontRequest, out: RequestOutput) -> None:
        if role == DECODE and req.first is not None:  # one stream: the prefill's arrival and first token
            m, first = out.metrics, req.first.metrics
            m.arrival_time, m.first_scheduled_time = first.arrival_time, first.first_scheduled_time
            m.first_token_time, m.num_cached_tokens = first.first_token_time, first.num_cached_tokens
            m.token_times[:1] = first.token_times[:1]
        self._deliver(req, out)

    def _on_sending(self, role: int, req: FrontRequest) -> None:
        req.sending = True

    def _on_sent(self, role: int, req: FrontRequest, ack: int) -> None:
        if ack:
            req.stage = "decode"

    def _on_owned(self, role: int, req: FrontRequest) -> None:
        req.stage = "decode"

    def _on_failed(self, role: int, req: FrontRequest, message: str) -> None:
        self._fail(req, message)

    def _fail(self, req: FrontRequest, message: str) -> None:
        """End ``req`` with finish_reason "error" and ``message``; whatever a worker still has of it is aborted."""
        for role in (DECODE, PREFILL):
            self._send(role, ("abort", req.request_id))
        last = req.last.outputs[0] if req.last is not None else CompletionOutput(0, "", [])
        metrics = req.last.metrics if req.last is not None else RequestMetrics(req.arrival_time)
        self.num_failed_requests += 1
        self._deliver(req, RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [CompletionOutput(
            0, last.text, list(last.token_ids), finish_reason="error")], True, metrics, message))

    def _deliver(self, req: FrontRequest, out: RequestOutput) -> None:
        req.last = out
        (self._ready if req.inbox is None else req.inbox).append(out)
        if out.finished:
            self.requests.pop(req.request_id, None)

    # -- LLMEngine's API -----------------------------------------------------------------------
    def _add(self, request_id, prompt, params=None, priority=0, arrival_time=None, inbox=None) -> None:
        params = SamplingParams() if params is None else params
        text, ids = self.validate_request(request_id, prompt, params, priority, arrival_time)
        check(params.n == 1, "n", "1 with disaggregated=True (one sample per request)", params.n)
        check(params.logprobs is None, "logprobs", "None with disaggregated=True", params.logprobs)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        self.requests[request_id] = FrontRequest(request_id, text, ids, arrival, inbox)
        self._send(PREFILL, ("add", request_id, ids, params.clone(), priority, arrival))

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is: the decode worker first (so a transfer in flight gets an empty ack)."""
        with self.lock:
            req = self.requests.pop(request_id, None)
            if req is None:
                return
            for role in (DECODE, PREFILL):
                self._send(role, ("abort", request_id))
            if req.inbox is not None:
                last = req.last.outputs[0] if req.last is not None else CompletionOutput(0, "", [])
                metrics = req.last.metrics if req.last is not None else RequestMetrics(req.arrival_time)
                req.inbox.append(RequestOutput(request_id, req.prompt, req.prompt_token_ids, [CompletionOutput(
                    0, last.text, list(last.token_ids), finish_reason="abort")], True, metrics))

    def _step(self) -> list[RequestOutput]:
        """Take the workers' messages (waiting briefly if none); the outputs of requests without an inbox."""
        self._pump(STEP_WAIT)
        self.num_steps += 1
        ready, self._ready = self._ready, []
        return ready

    def worker_stats(self, timeout: float = 60.0) -> dict[str, dict]:
        """Ask both workers for their engine stats, transfer counters and block invariants."""
        with self.lock:
            self._stats = {}
            for role in ROLES:
                self._send(role, ("stats",))
            deadline = time.monotonic() + timeout
            while len(self._stats) < len(ROLES):
                if time.monotonic() > deadline:
                    raise WorkerError(f"the workers did not report their stats within {timeout} s")
                self._pump(STEP_WAIT)
            return {ROLES[r]: s for r, s in self._stats.items()}

    def stats(self) -> EngineStats:
        s = self.worker_stats()
        p, d = s["prefill"]["engine"], s["decode"]["engine"]
        return EngineStats(num_running=d.num_running, num_prefilling=p.num_prefilling + p.num_running,
                           num_waiting=p.num_waiting, num_swapped=p.num_swapped + d.num_swapped,
                           num_free_blocks=p.num_free_blocks + d.num_free_blocks,
                           num_total_blocks=p.num_total_blocks + d.num_total_blocks,
                           prefix_cache_hit_rate=p.prefix_cache_hit_rate,
                           num_preemptions=p.num_preemptions + d.num_preemptions,
                           num_failed_requests=self.num_failed_requests)

    def check_invariants(self) -> None:
        """Both workers' block invariants (each checks its own pool and held blocks)."""
        for name, s in self.worker_stats().items():
            assert s["invariants"] == "ok", f"the {name} worker's blocks: {s['invariants']}"

    def inject_fault(self, worker: str, point: str, seconds: float = -1) -> None:
        """Tests: at ``point``, the worker sleeps ``seconds`` (or, with -1, kills itself: a real crash)."""
        self._send(next(r for r, n in ROLES.items() if n == worker), ("fault", point, seconds))

    def shutdown(self) -> None:
        """Stop both workers (a SHUTDOWN message, then a kill after a grace period). Idempotent."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            _stop_all(self.procs, self.conns)
            self.store = None  # the rendezvous server goes now, not during interpreter exit


def _stop_all(procs: dict, conns: dict) -> None:
    for role, conn in conns.items():
        try:
            conn.send(("shutdown",))
        except (OSError, ValueError):
            pass
    for p in procs.values():
        stop_process(p, GRACE)
    for conn in conns.values():
        conn.close()


def _cores() -> int:
    return len(os.sched_getaffinity(0))
