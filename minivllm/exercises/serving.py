"""Chapter 13, serving: the check of the reader's engine loop (an ``EngineLoop`` subclass with ``take_inbox``,
``route`` and ``turn``). Targeted turns against a scripted engine first, each aimed at one classic mistake; then
the real server (FastAPI on uvicorn, 127.0.0.1, a free port) with ``AsyncLLM(loop_cls=...)`` turning the reader's
loop, against the OpenAI client: streams equal to ``LLM.generate``, and clients that leave leave nothing behind.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from minivllm.exercises._common import NOT_WRITTEN, own_part, say, unwritten
from minivllm.exercises.live import PARTS_DIR, load_part
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import RequestMetrics
from minivllm.serving.engine_loop import EngineLoop, MiniEngineLoop

__all__ = ["check_engine_loop", "your_loop", "served", "METHODS"]

METHODS = ("take_inbox", "route", "turn")  # what exercise 13 writes

MODEL = "tiny-random"  # the loop's behaviour does not depend on the weights: the fastest model there is
OPTIONS = dict(block_size=16, num_blocks=1024, max_num_seqs=4, device="cpu")
WAIT_S = 30.0  # the longest a live stream, or the server's return to idle, may take
_live: dict = {}  # the engine (and LLM.generate's texts) the live server runs: loaded once a session


# -- a scripted engine and streams that record what reaches them ----------------------------------------------

class _Now:
    """Stands in for a stream's event loop: runs the handoff at once, on the loop's thread."""

    @staticmethod
    def call_soon_threadsafe(fn, *args):
        fn(*args)


class _Queue:
    def __init__(self):
        self.items = []

    def put_nowait(self, item):
        self.items.append(item)


class _Metrics:
    def __init__(self):
        self.forgotten = []

    def record(self, outputs, stats):
        pass

    def forget(self, request_id):
        self.forgotten.append(request_id)


class _Engine:
    """Each step gives every running request one output, in the reverse of the order they were added; a request
    finishes after ``lengths[request_id]`` outputs (3 by default). ``refuse``: ids whose add raises ValueError."""

    def __init__(self, lengths=None, refuse=(), during_add=None):
        self.lengths, self.refuse = lengths or {}, set(refuse)
        self.during_add = during_add or {}  # request id: what happens (on another thread) while it is added
        self.running: dict[str, int] = {}  # request id: outputs so far
        self.log: list[tuple] = []  # ("add", id), ("abort", id), ("step", ids advanced)
        self.steps: list[list[RequestOutput]] = []

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0):
        self.log.append(("add", request_id))
        if request_id in self.during_add:
            self.during_add.pop(request_id)()
        if request_id in self.refuse:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        self.running[request_id] = 0

    def abort_request(self, request_id):
        self.log.append(("abort", request_id))
        self.running.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        outputs = []
        for rid in reversed(list(self.running)):
            k = self.running[rid] = self.running[rid] + 1
            finished = k >= self.lengths.get(rid, 3)
            text = f"{rid}.{k}"
            outputs.append(RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(
                0, text, [k], delta_text=text, delta_token_ids=[k], finish_reason="length" if finished else None)],
                finished, RequestMetrics(0.0)))
        for out in outputs:
            if out.finished:
                del self.running[out.request_id]
        self.log.append(("step", tuple(o.request_id for o in outputs)))
        self.steps.append(outputs)
        return outputs

    def check_health(self):
        pass

    def stats(self):
        return None


class _Guard:
    """The loop's lock as a handler's thread sees it, in one thread: what arrives while the lock is held is put in
    the inbox when it is released (the handler waited for it)."""

    def __init__(self):
        self.held, self.waiting = 0, []

    def __enter__(self):
        self.held += 1
        return self

    def __exit__(self, *exc):
        self.held -= 1
        while not self.held and self.waiting:
            self.waiting.pop(0)()

    def acquire(self, *args, **kwargs) -> bool:
        self.__enter__()
        return True

    def release(self) -> None:
        self.__exit__()

    def locked(self) -> bool:
        return self.held > 0


class _Inbox(deque):
    """``self.inbox``, which can have a handler put a request in it right after the loop read it whole (iterated
    it: ``list(self.inbox)``, ``for item in self.inbox``), as a handler's thread may at any moment."""

    after_read = None

    def __iter__(self):
        yield from super().__iter__()
        if self.after_read is not None:
            arrive, self.after_read = self.after_read, None
            arrive()


class _Probe:
    """The reader's loop around a scripted engine, driven one turn at a time from this thread."""

    def __init__(self, cls, engine: _Engine):
        self.engine, self.metrics = engine, _Metrics()
        self.loop = cls(engine, self.metrics)
        self.loop.guard, self.loop.inbox = _Guard(), _Inbox()
        self.queues: dict[str, _Queue] = {}
        self.idles = 0
        self.loop.idle = self._idle  # counted, never sleeps

    def _idle(self):
        self.idles += 1

    def add(self, request_id):
        self.queues[request_id] = _Queue()
        self.loop.open(request_id, (_Now, self.queues[request_id]), [1, 2, 3], SamplingParams(max_tokens=3), 0.0)

    def leave(self, request_id):
        self.loop.close(request_id)

    def arrive(self, request_id):
        """A handler on another thread opens ``request_id`` now: its request joins the inbox at once, or as soon as
        the loop releases its lock."""
        guard = self.loop.guard
        (guard.waiting.append if guard.locked() else lambda f: f())(lambda: self.add(request_id))

    def turn(self, what: str):
        start = len(self.engine.log)
        try:
            returned = self.loop.turn()
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"{what}: turn() raised {type(e).__name__}: {e}") from e
        return returned, self.engine.log[start:]


def _fail(what: str, problem: str, hint: str) -> None:
    raise AssertionError(f"{what}: {problem}; {hint}")


def _shown(log) -> str:
    return ", ".join(f"{kind} {ids}" for kind, ids in log) or "nothing"


# -- targeted turns ------------------------------------------------------------------------------------------------

def _check_idle(cls) -> None:
    what = "turn() with nothing to do (no request in the engine, nothing in the inbox)"
    probe = _Probe(cls, _Engine())
    returned, log = probe.turn(what)
    if any(kind == "step" for kind, _ in log):
        _fail(what, "it called self.engine.step()",
              "check self.engine.has_unfinished_requests() and, with nothing to run, call self.idle() instead of "
              "stepping: a loop that steps an empty engine never sleeps and spins a core at 100%")
    if probe.idles == 0:
        _fail(what, "it returned without calling self.idle()",
              "AsyncLLM calls turn() again at once, so this loop spins a core at 100% doing nothing: call "
              "self.idle(), which sleeps until the inbox gets something")
    if returned:
        _fail(what, f"it returned {returned!r}", "with no step, return None")


def _check_adds(cls) -> None:
    engine = _Engine(lengths={"r1": 5, "r2": 5})
    probe = _Probe(cls, engine)
    probe.add("r1")
    what = "turn() with r1 in the inbox and an idle engine"
    returned, log = probe.turn(what)
    if ("add", "r1") not in log:
        _fail(what, f"the engine saw {_shown(log)}",
              "take the inbox into the engine first (self.take_inbox(): each add is "
              "self.engine.add_request(request_id, token_ids, params, arrival_time=arrival_time))")
    if not any(kind == "step" for kind, _ in log):
        _fail(what, f"it did not step (the engine saw {_shown(log)}; self.idle() called {probe.idles} times)",
              "take the inbox before asking whether there is work: r1 is there to run, so step now")
    if returned is not engine.steps[-1]:
        _fail(what, f"turn() returned {returned!r}", "return the step's outputs (AsyncLLM counts them in the "
              "server's metrics)")
    probe.add("r2")
    what = "turn() with r1 running and r2 just put in the inbox"
    _, log = probe.turn(what)
    kinds = [entry for entry in log]
    if ("add", "r2") not in kinds or kinds.index(("add", "r2")) > next(
            (i for i, (k, _) in enumerate(kinds) if k == "step"), len(kinds)):
        _fail(what, f"the engine saw {_shown(log)}: r2 waited in the inbox while the engine stepped without it",
              "take the inbox before the step: a request that arrives during a step joins the very next one, "
              "not the one after (with the adds taken after the step, every request waits a whole step for "
              "nothing)")


def _expected(engine: _Engine, rid: str) -> list[RequestOutput]:
    return [out for outputs in engine.steps for out in outputs if out.request_id == rid]


def _check_routes(probe: _Probe, what: str, done: set) -> None:
    """After a turn: each open stream holds exactly its own outputs so far; finished ones are closed, the others
    open. ``done``: requests already checked finished or aborted."""
    engine = probe.engine
    for rid, queue in probe.queues.items():
        if rid in done:
            continue
        want, got = _expected(engine, rid), queue.items
        for i, item in enumerate(got):
            if i >= len(want) or item is not want[i]:
                if isinstance(item, RequestOutput) and item.request_id != rid:
                    _fail(what, f"{rid}'s stream received {item.request_id}'s output {item.outputs[0].text!r}",
                          "deliver each output to its own request: self.deliver(out.request_id, out, ...); a "
                          "step's outputs come in the engine's order, not in the order the requests arrived, "
                          "and a request that finished leaves the others' places")
                _fail(what, f"{rid}'s stream received {item!r} as its item {i}",
                      f"expected {want[i].outputs[0].text!r}" if i < len(want) else "it expected nothing more")
        if len(got) < len(want):
            step = next(s for s, outputs in enumerate(engine.steps, 1) if want[len(got)] in outputs)
            closed = rid not in probe.loop.streams and not got[-1:] == [want[-1]] and got
            if closed:
                _fail(what, f"{rid}'s stream was closed after its output {got[-1].outputs[0].text!r}, before the "
                      "rest", "pass last=True only with a finished output (last=out.finished): a stream closed "
                      "early gets nothing more, and its client waits for the rest forever")
            _fail(what, f"{rid}'s stream got {len(got)} of its {len(want)} outputs so far; step {step} gave "
                  f"{len(engine.steps[step - 1])} outputs ({', '.join(o.outputs[0].text for o in engine.steps[step - 1])}) "
                  f"and {want[len(got)].outputs[0].text!r} never reached it",
                  "deliver every output of a step: several requests advance in one step, and a finished one "
                  "is not the end of the list")
        finished = bool(want) and want[-1].finished
        if finished and rid in probe.loop.streams:
            _fail(what, f"{rid} finished (its output {want[-1].outputs[0].text!r} has finished=True) but its "
                  "stream is still open", "deliver a finished output with last=True, which closes the stream: an "
                  "open stream counts as in flight forever (AsyncLLM.num_in_flight, the limit past which the "
                  "server answers 429), and shutdown waits for it")
        if finished:
            done.add(rid)


def _check_routing(cls) -> None:
    engine = _Engine(lengths={"r1": 4, "r2": 2, "r3": 3})
    probe = _Probe(cls, engine)
    for rid in ("r1", "r2", "r3"):
        probe.add(rid)
    done: set = set()
    for turn in range(1, 7):
        if not engine.running and turn > 1:
            break
        what = (f"three requests (r1, r2, r3, finishing after 4, 2 and 3 outputs; each step gives its outputs "
                f"newest request first), turn {turn}")
        probe.turn(what)
        _check_routes(probe, what, done)
    if engine.running:
        raise AssertionError(f"three requests: after 6 turns the engine still runs {sorted(engine.running)}")


def _check_aborts(cls) -> None:
    engine = _Engine(lengths={"r1": 9, "r2": 9, "r3": 9})
    probe = _Probe(cls, engine)
    probe.add("r1")
    probe.add("r2")
    probe.turn("two requests, r1 and r2, first turn")
    probe.leave("r1")
    what = "turn() after r1's client left (its abort is in the inbox), with r2 running"
    _, log = probe.turn(what)
    step = next((i for i, (k, _) in enumerate(log) if k == "step"), len(log))
    if ("abort", "r1") not in log:
        _fail(what, f"the engine saw {_shown(log)}: it never aborted r1",
              "take the aborts out of the inbox too: self.abort(request_id). Otherwise a request nobody reads runs "
              "to its last token, holding its place in the batch and its KV blocks")
    if log.index(("abort", "r1")) > step:
        _fail(what, f"the engine saw {_shown(log)}: r1 ran one more step after its client left",
              "take the inbox (aborts too) before the step")
    if "r1" not in probe.metrics.forgotten:
        _fail(what, "the engine aborted r1 but the server's metrics never heard of it",
              "abort with self.abort(request_id), not self.engine.abort_request(...): it also forgets the request "
              "in the metrics and counts it in minivllm:requests_aborted_total")
    probe.add("r3")
    probe.leave("r3")
    what = "turn() after r3 was added and its client left before the loop saw it (the inbox: r3's add, then its abort)"
    _, log = probe.turn(what)
    if "r3" in engine.running:
        _fail(what, f"the engine saw {_shown(log)}: r3 is running with nobody to read it",
              "take the inbox in the order it came (self.inbox.popleft() until it is empty): an abort applied "
              "before its own add aborts nothing, and the add then starts a request nobody reads")


def _check_refused(cls) -> None:
    engine = _Engine(lengths={"r1": 9, "r3": 9}, refuse={"bad"})
    probe = _Probe(cls, engine)
    probe.add("r1")
    probe.add("r3")
    probe.turn("r1 and r3, first turn")
    probe.add("bad")
    probe.add("r2")
    probe.leave("r3")
    what = ("turn() with r1 and r3 running and in the inbox: a request 'bad' that the engine refuses (ValueError), "
            "then r2's add, then r3's abort (its client left)")
    try:
        _, log = probe.turn(what)
    except AssertionError as e:
        if "ValueError" in str(e):
            raise AssertionError(f"{e}; the engine's ValueError for 'bad' escaped the turn: AsyncLLM then fails "
                                 "every request in flight (r1 too). Catch it around add_request and end 'bad' "
                                 "alone: self.deliver(request_id, error, last=True)") from None
        raise
    items = probe.queues["bad"].items
    if not any(isinstance(item, ValueError) for item in items):
        _fail(what, f"'bad''s stream got {items!r}", "deliver the error to its stream, "
              "self.deliver(request_id, error, last=True): the stream raises it (the client gets a 400); a stream "
              "that never hears back waits forever")
    if "bad" in probe.loop.streams:
        _fail(what, "'bad''s stream got its error but is still open", "deliver the error with last=True")
    step = next((i for i, (k, _) in enumerate(log) if k == "step"), len(log))
    late = [entry for entry in (("add", "r2"), ("abort", "r3")) if entry not in log[:step]]
    if late:
        _fail(what, f"the engine saw {_shown(log)}: after the refused add, "
              + " and ".join(f"{rid}'s {kind}" for kind, rid in late) + " waited for the next turn",
              "one try around the whole inbox loop stops taking the inbox at the refused add: put the try around "
              "self.engine.add_request(...) alone, inside the loop, so that one refused request ends alone and the "
              "rest of the inbox (adds and aborts) still joins this step")
    if not any(kind == "step" and "r1" in ids for kind, ids in log):
        _fail(what, f"the engine saw {_shown(log)}: r1 did not step in that turn",
              "one refused request ends alone: take the rest of the inbox and step as usual")


def _check_arrivals(cls) -> None:
    """A handler's thread puts requests in the inbox at any moment, also while the loop takes it."""
    hint = ("take the inbox one item at a time, self.inbox.popleft() while self.inbox is not empty: a handler's "
            "thread appends to it at any moment, so never iterate over it (for item in self.inbox, list(self.inbox)) "
            "and then clear it")
    engine = _Engine(lengths={"r1": 3, "r2": 3})
    probe = _Probe(cls, engine)
    engine.during_add["r1"] = lambda: probe.arrive("r2")
    probe.add("r1")
    what = "a request r2 put in the inbox by its handler's thread while take_inbox was adding r1"
    try:
        probe.turn(f"turn() with r1 in the inbox ({what})")
        probe.turn(f"the turn after {what}")
    except AssertionError as e:
        if "mutated during iteration" in str(e):
            raise AssertionError(f"{e}: take_inbox was iterating over self.inbox when the handler appended to it, "
                                 f"and on the server that error ends every request in flight; {hint}") from None
        raise
    if ("add", "r2") not in engine.log:
        _fail(what, f"r2 never reached the engine (it saw {_shown(engine.log)}): the inbox was cleared after "
              "r2 arrived, so r2 was lost and its client waits forever", hint)
    engine = _Engine(lengths={"r1": 3, "r2": 3})
    probe = _Probe(cls, engine)
    probe.add("r1")
    probe.loop.inbox.after_read = lambda: probe.arrive("r2")
    what = ("a request r2 put in the inbox by its handler's thread right after take_inbox read the inbox (or, if "
            "take_inbox held self.guard meanwhile, as soon as it released it)")
    probe.turn(f"turn() with r1 in the inbox ({what})")
    probe.turn(f"the turn after {what}")
    if "r2" in probe.queues and ("add", "r2") not in engine.log:  # (a loop that never reads the inbox whole: no r2)
        _fail(what, f"r2 never reached the engine (it saw {_shown(engine.log)}): the inbox was cleared after r2 "
              "arrived, so r2 was lost and its client waits forever", hint + " (or do both under self.guard, the "
              "lock the handlers append under)")


_CASES = (_check_idle, _check_adds, _check_routing, _check_aborts, _check_refused, _check_arrivals)


# -- the live server ---------------------------------------------------------------------------------------------

class _Server:
    """The real app (FastAPI on uvicorn, in a thread of this process) over AsyncLLM turning ``loop_cls``."""

    def __init__(self, engine, loop_cls, model: str = MODEL):
        import uvicorn

        from minivllm.serving import AsyncLLM, OpenAIServing, ServerMetrics, build_app

        self.metrics = ServerMetrics(model)
        self.llm = AsyncLLM(engine, metrics=self.metrics, loop_cls=loop_cls)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        app = build_app(OpenAIServing(self.llm, model), self.metrics)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="exercise-13-server")
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            self.stop()
            raise AssertionError("the server did not start (see the log above)")

    def idle(self) -> tuple[int, int, int]:
        stats = self.llm.engine.stats()
        return self.llm.num_in_flight, stats.num_running + stats.num_waiting + stats.num_prefilling, \
            stats.num_used_blocks

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        self.llm.close()
        self.sock.close()


def _client(url: str):
    try:
        import openai
    except ImportError:
        return None
    return openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=WAIT_S)


def _stream(url: str, prompt: list[int], max_tokens: int, leave_after: int | None = None) -> tuple[str, int]:
    """A streamed completion of ``prompt`` (greedy, ``ignore_eos``): its text and its number of chunks;
    ``leave_after``: hang up after that many chunks."""
    body = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0)
    client, text, chunks = _client(url), "", 0
    if client is not None:
        stream = client.completions.create(**body, stream=True, extra_body={"ignore_eos": True})
        try:
            for chunk in stream:
                text += "".join(c.text for c in chunk.choices)
                chunks += 1
                if chunks == leave_after:
                    break
        finally:
            stream.close()
        return text, chunks
    import httpx
    import json
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True, "ignore_eos": True},
                      timeout=WAIT_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
                chunks += 1
                if chunks == leave_after:
                    break
    return text, chunks


def _check_live(cls) -> str:
    from minivllm.engine import LLM

    prompts = [[100 + 7 * i + j for j in range(5 + 3 * i)] for i in range(4)]
    lengths = [6, 9, 4, 7]
    if "llm" not in _live:  # the oracle: LLM.generate; the server then runs the same engine (one model load)
        llm = LLM(MODEL, **OPTIONS)
        _live["want"] = [out.outputs[0].text for out in llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False)]
        _live["llm"] = llm
    want, engine = _live["want"], _live["llm"].engine
    server = _Server(engine, cls)
    what = "your loop in the live server (tiny-random, the OpenAI client)"
    try:
        with ThreadPoolExecutor(6) as pool:
            streams = [pool.submit(_stream, server.url, p, n) for p, n in zip(prompts, lengths)]
            leaving = [pool.submit(_stream, server.url, [300 + i, 301, 302], 4000, 2) for i in range(2)]
            for i, future in enumerate(streams + leaving):
                try:
                    text, _ = future.result(WAIT_S)
                except Exception as e:
                    raise AssertionError(f"{what}: stream {i} failed or hung: {type(e).__name__}: {e} (an output "
                                         "never delivered, or a stream never closed)") from None
                if i < len(prompts) and text != want[i]:
                    raise AssertionError(f"{what}: stream {i} streamed {text!r}, LLM.generate gives {want[i]!r} "
                                         "(outputs delivered to the wrong stream, or dropped)")
        deadline = time.monotonic() + WAIT_S
        while (state := server.idle()) != (0, 0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        if state != (0, 0, 0):
            raise AssertionError(f"{what}: {WAIT_S:.0f} s after every client finished or left (two hung up after "
                                 f"2 chunks of 4,000), {state[0]} streams are still open, {state[1]} requests in the "
                                 f"engine and {state[2]} KV blocks in use (a client that leaves must abort its "
                                 "request, and a finished stream must be closed)")
        if not server.llm.is_alive:
            raise AssertionError(f"{what}: the engine loop died")
    finally:
        server.stop()
        if engine.has_unfinished_requests():  # a loop that left requests behind: the next check starts afresh
            _live.clear()
    return (f"{len(prompts)} concurrent streams equal to LLM.generate, {len(leaving)} clients that left after 2 "
            "chunks: 0 requests running, 0 KV blocks in use")


def check_engine_loop(cls, live: bool = True) -> None:
    """Check an ``EngineLoop`` subclass's ``take_inbox``, ``route`` and ``turn`` (chapter 13).

    Targeted turns on a scripted engine first: nothing to do (idle, never a
    step), a new request (taken before the step), outputs of several requests
    in one step in the engine's order (each to its own stream, every one, the
    finished ones closing their streams), a client that leaves (its abort before
    the next step, through ``self.abort``), an add and its abort in one inbox,
    an add the engine refuses (that request alone ends, with the error, and
    the rest of the inbox still joins the step), requests a handler puts in
    the inbox while the loop takes it (never lost); the first failure stops
    the check. Then, unless ``live=False``, the real server with the class as ``AsyncLLM``'s loop, on tiny-random,
    through the OpenAI client: four concurrent streams equal to
    ``LLM.generate``'s greedy text, two clients that hang up, and then no open
    stream, no request and no KV block left. An empty subclass is "not
    written yet".
    """
    if not (isinstance(cls, type) and issubclass(cls, EngineLoop)):
        raise AssertionError(f"check_engine_loop takes a subclass of EngineLoop, got {cls!r}")
    cls = own_part(cls, METHODS, MiniEngineLoop)
    for case in _CASES:
        case(cls)
    say("check_engine_loop: idle without a step, the inbox in order before the step, every output to its own "
          "stream and the finished ones closed, aborts through self.abort, a refused add ending alone (targeted "
          "turns), the rest of the inbox taken after it, and no request lost while the inbox is taken.")
    if not live:
        return
    summary = _check_live(cls)
    say(f"check_engine_loop: the live server with your loop: {summary}.")


# -- the second capstone: your engine, served through your loop ---------------------------------------------------

def your_loop(parts_dir: Path = PARTS_DIR) -> type:
    """The reader's ``MyEngineLoop`` from ``your_engine/engine_loop.py`` when it is written and passes the targeted
    turns; else minivllm's ``MiniEngineLoop``. Prints which, and why."""
    path = Path(parts_dir) / "engine_loop.py"
    cls = None
    if not path.exists():
        problem = "missing (run exercise 13 first)"
    else:
        cls = load_part("engine_loop", "MyEngineLoop", parts_dir)
        problem = NOT_WRITTEN if unwritten(cls, METHODS) else None
        try:
            for case in _CASES:
                if problem is None:
                    case(cls)
        except NotImplementedError:
            problem = NOT_WRITTEN
        except AssertionError as e:
            problem = f"fails: {str(e).splitlines()[0][:160]}"
    what = "the server's engine loop (AsyncLLM)"
    say(f"13 {what:40} " + ("yours" if problem is None else f"minivllm's: yours is {problem}"))
    return cls if problem is None else MiniEngineLoop


@contextmanager
def served(engine, loop_cls=MiniEngineLoop, model: str = "smollm2-135m"):
    """The OpenAI-compatible server over ``engine`` with ``AsyncLLM(loop_cls=...)``, in a thread of this process on
    127.0.0.1 at a free port; yields it (``.url``, ``.llm`` the AsyncLLM, ``.idle()``) and always stops it."""
    server = _Server(engine, loop_cls, model)
    try:
        yield server
    finally:
        server.stop()
