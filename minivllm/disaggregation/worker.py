"""The prefill and the decode worker processes: an engine each, the front's pipe, the KV link (chapter 16).

A worker is spawned by the front (``torch.multiprocessing``, spawn, so it
works from Jupyter and Colab), builds its own :class:`~minivllm.engine.LLMEngine`
and KV pool, joins the KV link (:mod:`minivllm.disaggregation.link`) and
checks the peer's fingerprint, then loops: the front's messages (add, abort,
stats, join a new epoch, shutdown), its engine's step, and transfers.

- The prefill worker runs each prompt with ``max_tokens=1``. Its scheduler
  holds a finished request's blocks (:func:`~minivllm.kv_transfer.holding_scheduler`);
  it sends the front the first token, then the KV to the decode worker
  through its handoff (:class:`~minivllm.disaggregation.handoff.KVHandoff`,
  ``kv_handoff_cls``), which frees the blocks on the ack; on no ack within the
  timeout (or a dead peer) it frees them too and the request fails; the
  worker reports the link down. An abort frees a request's held blocks and
  forgets it wherever it is, so one that finished in the step being handled
  (its abort drained while an earlier output of that step was sent) is
  dropped: nothing more is sent or transferred for it.
- The decode worker, between its steps, receives a posted transfer,
  allocates blocks, writes the KV and acknowledges (ACK_OWNED); from then on
  the request is its own. A request the front aborted gets an empty ack.
  KV that finds no free blocks waits in host memory (owned, acknowledged)
  and is admitted when blocks free up.

A value in the store without this launch's signature (a forged fingerprint
or header, or an earlier epoch's) is refused: the worker logs one line, drops
its link and tells the front, which has both workers form it again under a
new epoch; no process restarts and no request is lost but a transfer that was
under way on the broken link.

Every message to the front is a tuple ``(kind, ...)``; a worker leaves when
the front's process is gone.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections import Counter, deque
from dataclasses import replace

import torch

from minivllm.config import EngineConfig, resolve, resolve_function
from minivllm.disaggregation.handoff import KVHandoff
from minivllm.disaggregation.link import (ACK_EMPTY, ACK_OWNED, DECODE, PREFILL, BadSignature, LinkError, open_link,
                                          presence_store)
from minivllm.distributed.workers import name_process, watch_parent
from minivllm.engine import LLMEngine
from minivllm.kv_transfer import (first_delta, fingerprint, generator_state, held, holding_scheduler, params_from_json,
                                  params_to_json, read_kv, release, start_decode)

__all__ = ["worker_main", "PrefillWorker", "DecodeWorker"]

COUNTERS = ("bytes_sent", "bytes_received", "transfers", "empty_acks")
IDLE_POLL = 0.005
JOIN_TIMEOUT = 300.0  # seconds to wait for the peer at a (re)start: it may be loading its model  # seconds an idle worker waits for the front's next message


def worker_main(role: int, port: int, epoch: int, config: EngineConfig, conn, threads: int, core: int | None,
                timeout: float, secret: bytes) -> None:
    """A spawned worker's life; any failure is reported to the front with its traceback."""
    watch_parent(os.getppid(), f"minivllm-{cls_name(role)}-watchdog")
    name_process(f"mvllm-{cls_name(role)}")  # what ps shows: mvllm-prefill, mvllm-decode
    try:
        if core is not None:
            os.sched_setaffinity(0, {core})
        torch.set_num_threads(threads)
        conn.send(("hello", os.getpid()))
        cls = PrefillWorker if role == PREFILL else DecodeWorker
        cls(config, conn, port, epoch, timeout, secret).run()
    except BaseException as e:
        kind = "refused" if isinstance(e, ValueError) and not isinstance(e, BadSignature) else "error"
        print(f"minivllm {cls_name(role)} worker:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        try:
            conn.send((kind, str(e) if kind == "refused" else traceback.format_exc()))
        except OSError:  # the front is gone
            pass
        sys.exit(1)
    finally:
        conn.close()


def cls_name(role: int) -> str:
    return "prefill" if role == PREFILL else "decode"


class Worker:
    """What both workers share: the engine, the link, the front's messages, stats and fault points."""

    role = PREFILL

    def __init__(self, config: EngineConfig, conn, port: int, epoch: int, timeout: float, secret: bytes):
        self.engine = LLMEngine(self.engine_config(config))
        self.handoff = (resolve_function(config.kv_handoff_cls, "kv_handoff_cls") or KVHandoff)()
        self.conn, self.port, self.timeout, self.secret = conn, port, timeout, secret
        self.past = Counter()  # transfer counters of earlier epochs
        self.faults: dict[str, float] = {}  # fault point -> seconds to sleep there (-1: die there)
        self.running = True
        self.deferred: deque = deque()  # the front's messages that came while this worker waited for its peer
        self.join(epoch)

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        return config

    def join(self, epoch: int) -> None:
        """Form epoch ``epoch``'s group with the peer and check its fingerprint."""
        if getattr(self, "link", None) is not None:
            self.past.update({k: self.link.counters()[k] for k in COUNTERS})
        self.link = None
        epoch = self.meet(epoch)
        try:
            link = open_link(self.port, self.role, epoch, JOIN_TIMEOUT, self.timeout, self.secret)
        except RuntimeError as e:  # the peer dropped the group while it formed (it refused a value, moved on)
            return self.relink(f"the KV link could not be formed ({str(e).splitlines()[0][:200]})", epoch)
        try:
            link.handshake(fingerprint(self.engine), JOIN_TIMEOUT, self.handoff.check_fingerprints)
        except BadSignature as e:  # the group goes now: a transfer the peer starts on it fails at once
            return self.relink(str(e), epoch)
        self.link = link
        self.conn.send(("ready", epoch, self.info()))

    def relink(self, reason: str, epoch: int) -> None:
        """This epoch's link cannot be used: a value in the store this launch did not sign (forged, or an earlier
        epoch's), or a group the peer dropped. One line in the log, no link, and the front is told, so that both
        workers form the link again under a new epoch (their processes and requests kept). The front hears it
        before the group goes, so before the peer can find its transfer failing and report the link down."""
        print(f"minivllm {cls_name(self.role)} worker: {reason}; forming the KV link again (epoch {epoch})",
              file=sys.stderr, flush=True)
        self.conn.send(("relink", reason, epoch))
        self.link = None

    def meet(self, epoch: int) -> int:
        """Wait until epoch ``epoch``'s peer is there (bounded); a newer "join" meanwhile moves to its epoch.

        So a worker whose peer died again before they met never waits for a
        process that will not come; other messages wait in ``deferred``."""
        store = presence_store(self.port, JOIN_TIMEOUT)
        deadline = time.monotonic() + JOIN_TIMEOUT
        while True:
            here = torch.distributed.PrefixStore(f"epoch{epoch}/", store)
            here.set(f"present{self.role}", b"1")
            if here.check([f"present{1 - self.role}"]):
                return epoch
            if time.monotonic() > deadline:
                raise LinkError(f"the peer did not come to epoch {epoch} within {JOIN_TIMEOUT} s")
            if self.conn.poll(IDLE_POLL * 10):
                msg = self.conn.recv()
                if msg[0] == "join":
                    epoch = max(epoch, msg[1])
                elif msg[0] == "shutdown":
                    raise SystemExit(0)
                else:
                    self.deferred.append(msg)

    def info(self) -> dict:
        e = self.engine
        return {"pid": os.getpid(), "num_blocks": e.num_blocks, "max_model_len": e.max_model_len,
                "vocab_size": e.vocab_size, "fingerprint": fingerprint(e),
                "element_size": e.runner.kv_cache.k.element_size(), "handoff": type(self.handoff).__name__}

    def fault(self, point: str) -> None:
        """A fault the tests inject at a named point: sleep there, or die there (SIGKILL, a real crash)."""
        seconds = self.faults.get(point)
        if seconds is None:
            return
        if seconds < 0:
            os.kill(os.getpid(), 9)
        time.sleep(seconds)

    def stats(self) -> dict:
        """The engine's stats, the transfer counters, and whether the block invariants hold."""
        e = self.engine
        try:
            e.check_invariants()
            invariants = "ok"
        except AssertionError as err:
            invariants = f"broken: {err}"
        now = self.link.counters() if self.link else {}
        counters = {k: self.past[k] + now.get(k, 0) for k in COUNTERS}
        return {"engine": e.stats(), "invariants": invariants, "held": len(held(e)),
                "unfinished": len(e.requests), **counters}

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "abort":
            self.abort(msg[1])
        elif kind == "stats":
            self.conn.send(("stats", self.stats()))
        elif kind == "join":
            self.join(msg[1])
        elif kind == "fault":
            self.faults[msg[1]] = msg[2]
        elif kind == "shutdown":
            self.running = False
        else:
            self.handle_more(msg)

    def handle_more(self, msg: tuple) -> None:
        raise ValueError(f"unknown message {msg[0]!r}")

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    def drain(self) -> None:
        """Handle every message the front has sent so far."""
        while self.running and self.conn.poll(0):
            self.handle(self.conn.recv())

    def run(self) -> None:
        while self.running:
            if self.deferred:
                self.handle(self.deferred.popleft())
                continue
            busy = self.engine.has_unfinished_requests() or self.has_work()
            if self.conn.poll(0 if busy else IDLE_POLL):
                self.handle(self.conn.recv())
                continue
            if self.link is not None:
                self.work()

    def has_work(self) -> bool:
        return False

    def work(self) -> None:
        raise NotImplementedError


class PrefillWorker(Worker):
    """Runs prompts (max_tokens=1), sends the first token to the front and the KV to the decode worker."""

    role = PREFILL

    def __init__(self, *args):
        self.params: dict = {}  # request id -> the front's SamplingParams (the engine runs max_tokens=1)
        super().__init__(*args)

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        return replace(config, scheduler_cls=holding_scheduler(resolve(config.scheduler_cls)))

    def handle_more(self, msg: tuple) -> None:
        _, request_id, prompt_ids, params, priority, arrival_time = msg
        self.params[request_id] = params
        self.engine.add_request(request_id, prompt_ids, replace(params, max_tokens=1), priority, arrival_time)

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        release(self.engine, request_id)
        self.params.pop(request_id, None)

    def work(self) -> None:
        if not self.engine.has_unfinished_requests():
            return
        for out in self.engine.step():
            params = self.params.pop(out.request_id, None) if out.finished else None
            if params is not None:
                self.finished(out, params)
            # else: aborted after it finished in this step (the abort came while an earlier output of the step was
            # handled): the abort released its blocks and forgot its params, and nobody waits for it

    def finished(self, out, params) -> None:
        """Final at the prefill (stop, error, max_tokens 1) or handed to the decode worker."""
        c = out.outputs[0]
        if c.finish_reason != "length" or params.max_tokens == 1:
            release(self.engine, out.request_id)
            self.conn.send(("out", out))
            return
        self.conn.send(("first", out, first_delta(self.engine, out.prompt_token_ids, params, c.token_ids[0])))
        self.transfer(out, params, c.token_ids[0])

    def posted(self, request_id: str) -> None:
        """The header is out: from here an abort can only come as the decode worker's empty ack."""
        self.conn.send(("sending", request_id))
        self.fault("prefill:mid_send")

    def transfer(self, out, params, first_token: int) -> None:
        """Send the held KV through the handoff, which frees it on the ack, a timeout or a dead peer."""
        rid = out.request_id
        header = {"request_id": rid, "prompt_ids": list(out.prompt_token_ids), "params": params_to_json(params),
                  "first_token": first_token, "generator": generator_state(self.engine, rid)}
        self.fault("prefill:before_send")
        self.drain()  # an abort that came meanwhile: nothing is sent (the blocks were released)
        if rid not in held(self.engine):
            return
        failures = []  # fail(error)'s message, written when it is called: whether the blocks are free by then
        ack = self.handoff.transfer(rid, lambda: self.send(rid, header), lambda: release(self.engine, rid),
                                    lambda error: failures.append(self.failure(rid, error)))
        if failures:
            self.conn.send(("failed", rid, failures[0], True))  # the link failed: retryable
        elif ack is not None:
            self.conn.send(("sent", rid, ack))

    def send(self, rid: str, header: dict) -> int:
        """The handoff's ``send()``: header, KV, ack over the link; a LinkError reports the link down, then goes on."""
        if self.link is None:
            raise LinkError("the KV link is down (this transfer already failed)")
        try:
            return self.link.send_kv(header, read_kv(self.engine, rid), lambda: self.posted(rid))
        except LinkError as e:
            epoch, self.link = self.link.epoch, None
            self.conn.send(("link_down", str(e), epoch))  # first: the front restarts the peer, then fails the request
            raise

    def failure(self, rid: str, error) -> str:
        """The failed request's message: the link's error, and whether its blocks are free (as they now are)."""
        holder = held(self.engine).get(rid)
        blocks = "freed the request's blocks" if holder is None else f"still holds its {len(holder.block_table)} blocks"
        return f"KV transfer to the decode worker failed: {error}; the prefill worker {blocks}"


class DecodeWorker(Worker):
    """Receives prefilled requests between its steps and decodes them."""

    role = DECODE

    def __init__(self, *args):
        self.aborted: set[str] = set()  # aborted by the front, before their KV arrived
        self.waiting: deque = deque()  # acknowledged KV that found no free blocks yet
        super().__init__(*args)

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        before = len(self.waiting)
        self.waiting = deque(h for h in self.waiting if h[0]["request_id"] != request_id)
        if len(self.waiting) == before and request_id not in self.engine.requests:
            self.aborted.add(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting)

    def work(self) -> None:
        try:
            self.receive()
        except BadSignature as e:  # a forged header: no request is lost, the link is formed again
            return self.relink(str(e), self.link.epoch)
        except LinkError as e:
            epoch, self.link = self.link.epoch, None
            self.conn.send(("link_down", str(e), epoch))
        self.admit()
        if self.engine.has_unfinished_requests():
            for out in self.engine.step():
                self.conn.send(("out", out))

    def receive(self) -> None:
        """Take every transfer posted so far: ack it (owned, or empty for an aborted request)."""
        while (got := self.link.poll_kv()) is not None:
            k, header, kv = got
            self.fault("decode:before_ack")
            self.drain()  # an abort that came while the KV was in flight gets an empty ack
            rid = header["request_id"]
            if rid in self.aborted:
                self.aborted.discard(rid)
                self.link.ack(k, ACK_EMPTY)
                continue
            self.waiting.append((header, kv))
            self.link.ack(k, ACK_OWNED)
            self.conn.send(("owned", rid))

    def admit(self) -> None:
        """Start the waiting transfers, oldest first, while the pool has blocks and seats for them."""
        e = self.engine
        while self.waiting and len(e.scheduler.running) < e.config.max_num_seqs:
            header, kv = self.waiting[0]
            try:
                if not start_decode(e, header["request_id"], header["prompt_ids"], params_from_json(header["params"]),
                                    header["first_token"], kv, header.get("generator")):
                    return
            except ValueError as err:  # refused by this engine (e.g. its pool is smaller): the request fails
                self.conn.send(("failed", header["request_id"], f"the decode worker refused the request: {err}"))
            self.waiting.popleft()
