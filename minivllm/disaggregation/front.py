"""The front of a disaggregated engine: it routes each request to the prefill worker, then the decode worker (chapter 16).

:class:`DisaggregatedEngine` has :class:`~minivllm.engine.LLMEngine`'s API
(``add_request``, ``step``, ``abort_request``, ``stats``,
``check_invariants``), so ``LLM(..., disaggregated=True)`` and the server's
``--disaggregated`` use it unchanged. It holds no model: a tokenizer, the
``TCPStore`` the workers meet on, two worker processes and a duplex pipe to
each. A request goes to the prefill worker; its first token comes back from
there, every later token from the decode worker, and the front stitches the
two into one stream (one ``RequestMetrics``: TTFT is the prefill's).

Faults: the front checks its workers at every step. A worker that died, a
link that broke (the other side reports it), or a worker that leaves a
heartbeat unanswered for longer than one transfer may take (twice
``kv_transfer_timeout``, the send then the ack, plus a step: stopped, or
stuck) is restarted **automatically** under a new link epoch, without waiting for
it: the requests it owned fail with ``finish_reason "error"``, a
message and ``retryable`` (the server answers 503: the same request may
succeed again), new ones queue until the workers meet again, and the others go
on. A value in the store that a worker refuses (not signed by this launch:
forged, or an earlier epoch's) makes both workers form the link again under a
new epoch, keeping their processes and requests; :meth:`is_ready` (the
server's ``/health``) is False until the link is back. The front never
blocks on a worker: each worker's messages go out through a sender thread of
its own, so a worker that stops reading cannot stall the front (or the
server's loop above it).
"""

from __future__ import annotations

import datetime
import os
import queue
import secrets
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, replace
from multiprocessing.connection import wait as wait_for_pipes

import torch.multiprocessing as mp

from minivllm.config import EngineConfig, check
from minivllm.disaggregation.link import DECODE, PREFILL
from minivllm.disaggregation.worker import worker_main
from minivllm.distributed.rendezvous import Signer, loopback_store
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
HEARTBEAT_S = 0.5  # a ready worker is asked for its stats this often; stall_limit() unanswered: stalled
STEP_MARGIN_S = 2.0  # what a worker's own step may add to a transfer's waits before it counts as stalled
EPOCH_STEP = 1 << 32  # link epochs grow by a random step up to this (see DisaggregatedEngine._next_epoch)


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
        self.compiling: dict = {}  # grammars LLMEngine.step waits for: none (the front refuses constraints)
        self._held, self._ready = [], []
        self.num_steps = self.num_failed_requests = 0
        self.restarts, self.epoch = Counter(), secrets.randbelow(EPOCH_STEP)  # see _next_epoch
        worker = replace(config, disaggregated=False)
        self.worker_configs = {PREFILL: prefill_config or worker, DECODE: decode_config or worker}
        self.cores = cores
        self.procs, self.conns, self.outboxes, self.info, self._stats = {}, {}, {}, {}, {}
        self._asked = {role: [] for role in ROLES}  # when each unanswered stats request went out, oldest first
        self._sent, self._answered, self._last_ask = Counter(), Counter(), Counter()  # stats requests, per role
        self._started_at: dict[int, float] = {}
        self.num_relinks = 0  # links formed again without a restart (a value in the store refused, a group dropped)
        self._serving = False  # a worker's refusal (a KV layout mismatch) is the constructor's ValueError until then
        self.signer = Signer()  # this launch's secret: the workers sign and check what crosses the store
        self.store = loopback_store(None, datetime.timedelta(seconds=START_TIMEOUT))
        self._closed = False
        weakref.finalize(self, _stop_all, self.procs, self.conns, self.outboxes)  # no worker outlives the front
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
        self._serving = True

    # -- worker processes ----------------------------------------------------------------------
    def _spawn(self, role: int) -> None:
        ctx = mp.get_context("spawn")
        mine, theirs = ctx.Pipe()
        core = None if self.cores is None else self.cores[role]
        threads = 1 if core is not None else max(1, _cores() // 2)
        p = ctx.Process(target=worker_main, name=f"minivllm-{ROLES[role]}", daemon=True,
                        args=(role, self.store.port, self.epoch, self.worker_configs[role], theirs, threads, core,
                              self.config.kv_transfer_timeout, self.signer.secret))
        p.start()
        theirs.close()
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_send_loop, args=(mine, outbox), name=f"minivllm-front-to-{ROLES[role]}",
                         daemon=True).start()
        self.procs[role], self.conns[role], self.outboxes[role] = p, mine, outbox
        self.info.pop(role, None)
        self._asked[role], self._started_at[role] = [], time.monotonic()
        self._sent[role] = self._answered[role] = 0

    def _ready_now(self, role: int) -> bool:
        return self.info.get(role, {}).get("epoch") == self.epoch

    def _await_ready(self, roles) -> None:
        """Pump messages until every role in ``roles`` reports ready for this epoch (bounded; at start only)."""
        deadline = time.monotonic() + START_TIMEOUT
        while not all(self._ready_now(r) for r in roles):
            for role in roles:
                if self.procs[role].exitcode is not None and not self._ready_now(role):
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
            self._heartbeat()
            self._check_workers()

    def _heartbeat(self) -> None:
        """Ask each ready worker for its stats every HEARTBEAT_S (the answers feed :meth:`stats`)."""
        t = time.monotonic()
        for role in ROLES:
            if self._ready_now(role) and t - self._last_ask[role] >= HEARTBEAT_S and len(self._asked[role]) < 4:
                self._ask_stats(role)

    def _ask_stats(self, role: int) -> int:
        """Send ``role`` a stats request; returns its number (answers come back in order)."""
        self._last_ask[role] = time.monotonic()
        self._asked[role].append(self._last_ask[role])
        self._sent[role] += 1
        self._send(role, ("stats",))
        return self._sent[role]

    def stall_limit(self) -> float:
        """Seconds a heartbeat may go unanswered: a transfer blocks a worker for up to two link
        timeouts (sending the KV, then waiting for the ack) and a step; only longer means stalled."""
        return 2 * self.config.kv_transfer_timeout + STEP_MARGIN_S

    def _stalled(self, role: int) -> str | None:
        """Why ``role`` counts as stalled: a stats request unanswered, or a (re)start, for too long."""
        t, limit = time.monotonic(), self.stall_limit()
        if self._ready_now(role):
            asked = self._asked[role]
            if asked and t - asked[0] > limit:
                return f"the {ROLES[role]} worker (pid {self.procs[role].pid}) answered nothing for {t - asked[0]:.0f} s"
        elif t - self._started_at[role] > START_TIMEOUT:
            return f"the {ROLES[role]} worker (pid {self.procs[role].pid}) did not start within {START_TIMEOUT} s"
        return None

    def _check_workers(self) -> None:
        for role in ROLES:
            if self.procs[role].exitcode is not None:
                self._restart(role, self._describe(role))
            elif self.info.get(role, {}).get("down"):
                self._restart(role, f"the {ROLES[role]} worker stopped answering on the KV link")
            elif (why := self._stalled(role)) is not None:
                self._restart(role, why + " (stalled)")

    def _restart(self, role: int, reason: str) -> None:
        """Fail what ``role`` owned, replace its process, and let both sides meet under a new epoch.

        It does not wait for the new process: requests queue in the workers' pipes until they meet."""
        owned = "prefill" if role == PREFILL else "decode"
        for req in [r for r in self.requests.values() if r.stage == owned]:
            self._fail(req, f"{reason}; the front restarted it", retryable=True)
        old, conn, outbox = self.procs[role], self.conns[role], self.outboxes[role]
        old.kill()  # a stopped process dies too (SIGKILL needs no cooperation)
        outbox.put(None)  # its sender thread leaves
        stop_process(old, 0)
        conn.close()
        self._next_epoch()
        self._spawn(role)
        other = 1 - role
        self._send(other, ("join", self.epoch))  # even while it still meets its last peer: it moves on to this one
        self.info.setdefault(other, {})["epoch"], self._started_at[other] = None, time.monotonic()
        self.restarts[ROLES[role]] += 1

    def _relink(self) -> None:
        """A worker refused a value in the store (or its peer dropped the group that was forming): both form the link
        again under a new epoch, without a restart. Their requests stay (a transfer under way on the broken link
        fails); new ones wait for the link."""
        self.num_relinks += 1
        self._next_epoch()
        for role in ROLES:
            self._send(role, ("join", self.epoch))
            self.info.setdefault(role, {})["epoch"], self._started_at[role] = None, time.monotonic()
            self.info[role].pop("down", None)  # the peer found the dropped link failing: no restart for that

    def _next_epoch(self) -> None:
        """A later epoch, by a random step: its keys in the store cannot be named, so nothing can be written there
        before the workers meet (a forger who planted values for the next epochs would keep the link down after
        it stopped)."""
        self.epoch += 1 + secrets.randbelow(EPOCH_STEP)

    def is_ready(self) -> bool:
        """Both workers are in the current epoch's link (False while a worker restarts or the link is re-formed)."""
        return not self._closed and all(self._ready_now(role) for role in ROLES)

    def _send(self, role: int, msg: tuple) -> None:
        """Queue ``msg`` for ``role``'s sender thread (never blocks; a dead worker's messages are dropped)."""
        self.outboxes[role].put(msg)

    def _on_message(self, role: int, msg: tuple) -> None:
        kind, rest = msg[0], msg[1:]
        if kind == "ready":
            self.info[role] = {**rest[1], "epoch": rest[0]}
            self._asked[role] = [time.monotonic() for _ in self._asked[role]]  # it was busy meeting its peer
        elif kind in ("refused", "error"):
            if kind == "refused" and not self._serving:  # the workers' KV layouts differ: the constructor fails
                raise ValueError(rest[0])
            self.info.setdefault(role, {})["error"] = rest[0].strip().splitlines()[-1]  # it died: restarted
        elif kind == "relink":
            if rest[1] == self.epoch:  # an earlier epoch's link is already replaced
                self._relink()
        elif kind == "stats":
            self._stats[role] = rest[0]
            self._answered[role] += 1
            if self._asked[role]:
                self._asked[role].pop(0)
        elif kind == "link_down":
            if rest[1] == self.epoch:  # a link of an earlier epoch is already replaced
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

    def _on_failed(self, role: int, req: FrontRequest, message: str, retryable: bool = False) -> None:
        self._fail(req, message, retryable)

    def _fail(self, req: FrontRequest, message: str, retryable: bool = False) -> None:
        """End ``req`` with finish_reason "error" and ``message``; whatever a worker still has of it is aborted.
        ``retryable``: a worker or the link failed, not the request (the server answers 503)."""
        for role in (DECODE, PREFILL):
            self._send(role, ("abort", req.request_id))
        last = req.last.outputs[0] if req.last is not None else CompletionOutput(0, "", [])
        metrics = req.last.metrics if req.last is not None else RequestMetrics(req.arrival_time)
        self.num_failed_requests += 1
        self._deliver(req, RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [CompletionOutput(
            0, last.text, list(last.token_ids), finish_reason="error")], True, metrics, message, retryable))

    def _deliver(self, req: FrontRequest, out: RequestOutput) -> None:
        req.last = out
        (self._ready if req.inbox is None else req.inbox).append(out)
        if out.finished:
            self.requests.pop(req.request_id, None)

    # -- LLMEngine's API -----------------------------------------------------------------------
    def validate_request(self, request_id, prompt, params, priority=0, arrival_time=None):
        """LLMEngine's checks, and what the two workers cannot split: one sample, no logprobs, no constraint (the
        prefill worker samples the first token, the decode worker the rest: one matcher cannot span the two)."""
        check(not isinstance(params, SamplingParams) or params.structured_outputs is None, "structured_outputs",
              "None with disaggregated=True (a constrained request runs on an engine without it)",
              getattr(params, "structured_outputs", None))
        text, ids = super().validate_request(request_id, prompt, params, priority, arrival_time)
        check(params.n == 1, "n", "1 with disaggregated=True (one sample per request)", params.n)
        check(params.logprobs is None, "logprobs", "None with disaggregated=True", params.logprobs)
        return text, ids

    def _add(self, request_id, prompt, params=None, priority=0, arrival_time=None, inbox=None) -> None:
        params = SamplingParams() if params is None else params
        text, ids = self.validate_request(request_id, prompt, params, priority, arrival_time)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        self.requests[request_id] = FrontRequest(request_id, text, ids, arrival, inbox)
        self._send(PREFILL, ("add", request_id, ids, params.clone(), priority, arrival))

    def has_unfinished_requests(self) -> bool:
        """A request still in a worker, or an output the workers sent that :meth:`step` has not handed out."""
        with self.lock:
            return bool(self.requests or self._ready or self._held)

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

    def check_health(self) -> None:
        """Raise WorkerError once the front is shut down (a worker that dies or stalls is restarted instead)."""
        if self._closed:
            raise WorkerError("the disaggregated engine is shut down")

    def worker_stats(self, timeout: float = 60.0) -> dict[str, dict]:
        """Both workers' engine stats, transfer counters and block invariants, as of now (waits, bounded)."""
        with self.lock:
            want = {role: self._ask_stats(role) for role in ROLES}
            deadline = time.monotonic() + timeout
            while any(self._answered[r] < want[r] for r in ROLES):  # answers come in order
                if time.monotonic() > deadline:
                    raise WorkerError(f"the workers did not report their stats within {timeout} s")
                self._pump(STEP_WAIT)
                for role in ROLES:
                    if self._sent[role] < want[role]:  # restarted meanwhile: ask the new process
                        want[role] = self._ask_stats(role)
            return {ROLES[r]: s for r, s in self._stats.items()}

    def stats(self) -> EngineStats:
        """The workers' latest heartbeat stats combined (never waits: a stalled worker cannot block it)."""
        with self.lock:
            self._pump(0)
            if len(self._stats) < len(ROLES):  # no heartbeat answered yet: an idle engine's figures
                blocks = 2 * self.num_blocks
                return EngineStats(0, 0, 0, 0, blocks, blocks, 0.0, 0, num_failed_requests=self.num_failed_requests)
            p, d = self._stats[PREFILL]["engine"], self._stats[DECODE]["engine"]
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
            for role, p in self.procs.items():
                if not self._ready_now(role):  # still starting or meeting its peer: it reads no message now
                    p.kill()
            _stop_all(self.procs, self.conns, self.outboxes)
            self.store = None  # the rendezvous server goes now, not during interpreter exit


def _send_loop(conn, outbox: queue.SimpleQueue) -> None:
    """A worker's sender thread: its messages, in order, until None or a broken pipe (the worker is gone)."""
    while (msg := outbox.get()) is not None:
        try:
            conn.send(msg)
        except (OSError, ValueError):
            return


def _stop_all(procs: dict, conns: dict, outboxes: dict) -> None:
    """SHUTDOWN to every worker, GRACE seconds for all of them together to leave, then a kill for the rest."""
    for outbox in outboxes.values():
        outbox.put(("shutdown",))
        outbox.put(None)
    deadline = time.monotonic() + GRACE
    for p in procs.values():
        stop_process(p, max(0.0, deadline - time.monotonic()))
    for conn in conns.values():
        conn.close()


def _cores() -> int:
    return len(os.sched_getaffinity(0))
