"""Prefill/decode disaggregation (chapter 16): token-identical outputs, the bytes sent, ownership of the blocks,
the handshake, workers killed mid-transfer; both workers' invariants and zero leaked blocks after every test,
and no process left behind."""

import gc
import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest

from minivllm import LLM, EngineConfig, LLMEngine, SamplingParams
from minivllm.bench import ServerProcess
from minivllm.disaggregation import DisaggregatedEngine
from minivllm.disaggregation.front import HEARTBEAT_S, STEP_MARGIN_S
from minivllm.exercises.live import chat_prompts
from minivllm.kv_transfer import kv_bytes

from helpers import process_alive

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _children(pid: int) -> set[int]:
    """Live (not zombie) children of ``pid``, from /proc."""
    out = set()
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"resource_tracker" not in (entry / "cmdline").read_bytes():
            out.add(int(entry.name))
    return out


def _wait_gone(pids, seconds: float = 20.0) -> set[int]:
    deadline = time.monotonic() + seconds
    while (left := pids & _children(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def worker_pids(llm) -> set[int]:
    return {p.pid for p in llm.engine.procs.values()}


@pytest.fixture(scope="module")
def tiny():
    """One disaggregated tiny-random engine for the module (the front restarts what a test kills)."""
    before = _children(os.getpid())
    llm = LLM("tiny-random", disaggregated=True, num_blocks=256, kv_transfer_timeout=3.0)
    yield llm
    llm.shutdown()
    assert not _wait_gone(_children(os.getpid()) - before), "worker processes left behind"


@pytest.fixture(scope="module")
def reference():
    return LLM("tiny-random", num_blocks=256)


@pytest.fixture(autouse=True)
def no_process_left_behind(request):
    """After each test: no new process but the shared engine's two current workers."""
    before = _children(os.getpid())
    yield
    gc.collect()
    keep = worker_pids(request.getfixturevalue("tiny")) if "tiny" in request.fixturenames else set()
    assert not _wait_gone(_children(os.getpid()) - before - keep), "processes left behind"


def assert_clean(llm) -> dict:
    """Both workers: block invariants hold, no held or unfinished request, every block free."""
    stats = llm.engine.worker_stats()
    for name, s in stats.items():
        assert s["invariants"] == "ok", (name, s["invariants"])
        assert s["held"] == 0 and s["unfinished"] == 0, (name, s)
        assert s["engine"].num_used_blocks == 0, f"{name} worker leaked {s['engine'].num_used_blocks} blocks"
    llm.engine.check_invariants()
    return stats


def drive(engine, rid, prompt, params, until, timeout=60.0):
    """Add ``rid`` and step the engine until ``until(outputs so far)``; returns the outputs."""
    engine.add_request(rid, prompt, params)
    outs, deadline = [], time.monotonic() + timeout
    while not until(outs):
        assert time.monotonic() < deadline, f"{rid}: no progress within {timeout} s: {outs}"
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def finished(outs) -> bool:
    return bool(outs) and outs[-1].finished


def test_token_identical_to_one_engine_and_bytes_formula_equals_bytes_sent(tiny, reference):
    prompts = chat_prompts(tiny.get_tokenizer(), 16)
    before = tiny.engine.worker_stats()
    outs = tiny.generate(prompts, GREEDY, use_tqdm=False)
    want = reference.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in want]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    after = assert_clean(tiny)
    info = tiny.engine.info[0]
    formula = sum(kv_bytes(info["fingerprint"], len(p), info["element_size"]) for p in prompts)
    sent = after["prefill"]["bytes_sent"] - before["prefill"]["bytes_sent"]
    received = after["decode"]["bytes_received"] - before["decode"]["bytes_received"]
    assert formula == sent == received
    assert after["prefill"]["transfers"] - before["prefill"]["transfers"] == 16
    assert {i["handoff"] for i in tiny.engine.info.values()} == {"KVHandoff"}  # minivllm's rule, by default


def test_stream_and_stepwise_outputs_are_one_stream(tiny, reference):
    prompt = chat_prompts(tiny.get_tokenizer(), 3)[2]
    want = reference.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    assert "".join(tiny.stream(prompt, GREEDY)) == want.text
    outs = drive(tiny.engine, "one-stream", prompt, GREEDY, finished)
    assert sum(len(o.outputs[0].delta_token_ids) for o in outs) == MAX_TOKENS
    assert outs[0].outputs[0].token_ids == want.token_ids[:1] and not outs[0].finished  # the prefill's token
    m = outs[-1].metrics
    assert len(m.token_times) == MAX_TOKENS and m.token_times[0] == m.first_token_time > m.arrival_time
    assert_clean(tiny)


def test_a_request_that_ends_at_its_first_token_is_never_transferred(tiny, reference):
    prompt = chat_prompts(tiny.get_tokenizer(), 1)[0]
    before = tiny.engine.worker_stats()["prefill"]["transfers"]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    out = tiny.generate([prompt], one, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference.generate([prompt], one, use_tqdm=False)[0].outputs[0].token_ids
    assert assert_clean(tiny)["prefill"]["transfers"] == before


def test_no_ack_within_the_timeout_frees_the_prefill_blocks_and_fails_the_request(tiny, reference):
    restarts = tiny.engine.restarts["decode"]
    tiny.engine.inject_fault("decode", "decode:before_ack", 6.0)  # longer than kv_transfer_timeout (3 s)
    outs = drive(tiny.engine, "slow-ack", [5, 6, 7, 8, 9] * 7, GREEDY, finished)
    last = outs[-1]
    assert last.outputs[0].finish_reason == "error" and "waiting for the ack" in last.error
    assert "freed the request's blocks" in last.error
    assert tiny.engine.restarts["decode"] == restarts + 1  # the silent decode worker was replaced
    prompts = chat_prompts(tiny.get_tokenizer(), 4)  # the front keeps serving
    assert [o.outputs[0].token_ids for o in tiny.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY, use_tqdm=False)]
    assert_clean(tiny)


def test_a_stopped_worker_is_restarted_only_after_the_stall_limit(tiny, reference):
    """A heartbeat unanswered past two link timeouts and a step (the longest a transfer blocks a worker) is a stall."""
    engine, restarts = tiny.engine, tiny.engine.restarts["decode"]
    limit = engine.stall_limit()
    assert limit == 2 * 3.0 + STEP_MARGIN_S
    old = engine.procs[1].pid
    os.kill(old, signal.SIGSTOP)
    start = time.monotonic()
    try:
        while engine.restarts["decode"] == restarts:
            assert time.monotonic() - start < limit + 30, "a stopped decode worker was never restarted"
            engine.step()
        took = time.monotonic() - start
    finally:
        try:
            os.kill(old, signal.SIGCONT)
        except ProcessLookupError:  # the front killed it when it gave up on it
            pass
    assert took > limit - HEARTBEAT_S, f"restarted after {took:.1f} s: a worker inside one transfer is not stalled"
    prompts = chat_prompts(tiny.get_tokenizer(), 2)
    assert [o.outputs[0].token_ids for o in tiny.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY, use_tqdm=False)]
    assert_clean(tiny)


def test_an_abort_before_the_transfer_releases_the_prefill_blocks(tiny):
    before = tiny.engine.worker_stats()["prefill"]
    tiny.engine.inject_fault("prefill", "prefill:before_send", 1.5)
    drive(tiny.engine, "early-abort", [3] * 40, GREEDY, lambda outs: bool(outs))  # prefilled, blocks held
    tiny.engine.abort_request("early-abort")
    tiny.engine.inject_fault("prefill", "prefill:before_send", 0.0)
    after = assert_clean(tiny)["prefill"]  # answered after the prefill worker woke, saw the abort, freed
    assert after["transfers"] == before["transfers"] and after["bytes_sent"] == before["bytes_sent"]


def test_an_abort_during_the_transfer_gets_an_empty_ack_and_frees_the_prefill_blocks(tiny):
    engine = tiny.engine
    before = engine.worker_stats()
    engine.inject_fault("prefill", "prefill:mid_send", 1.0)  # the header is posted, the KV follows a second later
    drive(engine, "mid-abort", [4] * 40, GREEDY, lambda outs: engine.requests["mid-abort"].sending)
    engine.abort_request("mid-abort")  # reaches the decode worker before the KV does
    engine.inject_fault("prefill", "prefill:mid_send", 0.0)
    deadline = time.monotonic() + 30
    while any((after := engine.worker_stats())[w]["empty_acks"] == before[w]["empty_acks"] for w in before):
        assert time.monotonic() < deadline, "no empty ack"  # (the two workers answer at different moments)
    assert after["decode"]["empty_acks"] == before["decode"]["empty_acks"] + 1
    assert after["prefill"]["empty_acks"] == before["prefill"]["empty_acks"] + 1
    assert after["prefill"]["transfers"] == before["prefill"]["transfers"] + 1
    assert_clean(tiny)


@pytest.mark.parametrize("point,worker", [("decode:before_ack", "decode"), ("prefill:mid_send", "prefill")])
def test_a_worker_killed_mid_transfer_fails_its_request_cleanly_and_the_front_restarts_it(tiny, reference, point,
                                                                                          worker):
    engine = tiny.engine
    restarts, old = engine.restarts[worker], engine.procs[0 if worker == "prefill" else 1].pid
    engine.inject_fault(worker, point)  # SIGKILL there
    outs = drive(engine, f"killed-{worker}", [6] * 50, GREEDY, finished)
    last = outs[-1]
    assert last.outputs[0].finish_reason == "error" and last.error
    assert worker in last.error or "KV transfer" in last.error
    assert engine.restarts[worker] == restarts + 1 and old not in worker_pids(tiny)
    prompts = chat_prompts(tiny.get_tokenizer(), 4)  # served again after the restart
    assert [o.outputs[0].token_ids for o in tiny.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY, use_tqdm=False)]
    assert_clean(tiny)


def test_a_decode_worker_killed_while_decoding_fails_its_requests_and_keeps_no_block(tiny):
    engine = tiny.engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    outs = drive(engine, "long-decode", [7] * 20, params, lambda outs: len(outs) >= 3)
    os.kill(engine.procs[1].pid, 9)
    outs += drive(engine, "after-kill", [8] * 20, GREEDY, finished)
    assert engine.requests == {} or "long-decode" not in engine.requests
    assert_clean(tiny)


class FrontPipe:
    """The prefill worker's pipe to the front, in this process: what it sent, and what the front sends next."""

    def __init__(self):
        self.sent, self.coming, self.on_send = [], [], None

    def send(self, msg):
        self.sent.append(msg)
        if self.on_send is not None:
            self.on_send(msg)

    def poll(self, timeout=0):
        return bool(self.coming)

    def recv(self):
        return self.coming.pop(0)


class AckingLink:
    """A KV link whose decode worker acknowledges every transfer at once (owned)."""

    epoch = 0

    def send_kv(self, header, kv, posted):
        posted()
        return 1  # ACK_OWNED


def test_a_request_aborted_after_it_finished_in_the_same_step_is_dropped_by_the_prefill_worker(monkeypatch):
    """Two prompts finish prefilling in one step; while the worker hands the first to the decode worker, the front's
    abort of the second comes in (it is drained there). Before: the abort popped the second's params, then the
    worker's own pop of them raised KeyError, the worker died and every request in prefill failed with it."""
    from minivllm.disaggregation import worker as workers

    monkeypatch.setattr(workers.Worker, "join", lambda self, epoch: None)  # no peer, no store: the link is faked
    pipe = FrontPipe()
    worker = workers.PrefillWorker(EngineConfig(model="tiny-random", num_blocks=64), pipe, 0, 0, 3.0, b"secret")
    worker.link = AckingLink()
    for rid, prompt in (("a", [5] * 20), ("b", [6] * 20)):
        worker.handle(("add", rid, prompt, GREEDY, 0, time.perf_counter()))
    first = []

    def abort_the_other(msg):  # the front's abort of the other request arrives while this one is handed over
        if msg[0] == "first" and not first:
            first.append(msg[1].request_id)
            pipe.coming.append(("abort", "b" if first[0] == "a" else "a"))

    pipe.on_send = abort_the_other
    worker.work()  # one step: both prompts finish in it
    kept, dropped = first[0], "b" if first[0] == "a" else "a"
    assert [(m[0], m[1] if isinstance(m[1], str) else m[1].request_id) for m in pipe.sent] == \
        [("first", kept), ("sending", kept), ("sent", kept)]  # the aborted one: nothing sent, nothing transferred
    assert worker.params == {} and not worker.engine.has_unfinished_requests()
    assert worker.engine.scheduler.held == {} and worker.engine.stats().num_used_blocks == 0, "blocks leaked"
    worker.engine.check_invariants()
    assert dropped not in worker.engine.requests


class ForgedPeerLink:
    """A KV link whose peer's fingerprint in the store was forged the first ``forged`` times it is read."""

    def __init__(self, forged: int):
        self.forged = forged

    def handshake(self, fingerprint, timeout, check):
        from minivllm.distributed.rendezvous import BadSignature

        if self.forged:
            self.forged -= 1
            raise BadSignature("the value under 'epoch0/fingerprint1' is not signed by this launch: refused")


def test_a_forged_fingerprint_is_refused_in_one_line_and_the_worker_waits_to_join_again(monkeypatch, capfd):
    """Before: the handshake's BadSignature killed the worker with a traceback, and the front raised its "refused"
    out of step(): the server's loop failed every request in flight."""
    from minivllm.disaggregation import worker as workers

    link = ForgedPeerLink(forged=1)
    monkeypatch.setattr(workers.Worker, "meet", lambda self, epoch: epoch)  # the peer is there at once
    monkeypatch.setattr(workers, "open_link", lambda port, role, epoch, *rest: link)
    pipe = FrontPipe()
    worker = workers.DecodeWorker(EngineConfig(model="tiny-random", num_blocks=64), pipe, 0, 0, 3.0, b"secret")
    assert worker.link is None and [(m[0], m[2]) for m in pipe.sent] == [("relink", 0)]
    assert "not signed by this launch" in pipe.sent[0][1]
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not signed by this launch" in err[0] and "forming the KV link again" in err[0], err
    worker.handle(("join", 1))  # the front's answer: a new epoch, and this time the value is the peer's own
    assert worker.link is link and pipe.sent[-1][:2] == ("ready", 1)
    assert "Traceback" not in capfd.readouterr().err


def test_a_forged_transfer_header_is_refused_and_the_link_formed_again_keeping_every_request(tiny, reference):
    """A header the decode worker refuses re-forms the link under a new epoch: no worker restarts, and a request
    decoding meanwhile finishes with the tokens of one engine (before: the front restarted the prefill worker)."""
    import torch.distributed as dist

    engine = tiny.engine
    pids, restarts, epoch, refusals = worker_pids(tiny), dict(engine.restarts), engine.epoch, engine.num_relinks
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    outs = drive(engine, "decoding", [9] * 20, params, lambda outs: len(outs) >= 3)  # the decode worker owns it
    store = dist.PrefixStore(f"epoch{epoch}/", dist.TCPStore("127.0.0.1", engine.store.port, None, False))
    for k in range(engine.worker_stats()["decode"]["transfers"] + 1):  # this epoch's next header among them
        store.set(f"xfer/{k}", b"0" * 64 + b'\n{"request_id": "forged"}')
    deadline = time.monotonic() + 60
    while not outs[-1].finished:
        assert time.monotonic() < deadline, "the request decoding did not finish"
        outs += [o for o in engine.step() if o.request_id == "decoding"]
    assert engine.num_relinks == refusals + 1 and engine.epoch > epoch
    assert worker_pids(tiny) == pids and dict(engine.restarts) == restarts, "a worker was restarted"
    want = reference.generate([[9] * 20], params, use_tqdm=False)[0].outputs[0]
    assert (outs[-1].outputs[0].token_ids, outs[-1].outputs[0].finish_reason) == (want.token_ids, "length")
    while not engine.is_ready():
        engine.step()
    prompts = chat_prompts(tiny.get_tokenizer(), 2)  # the new link carries transfers
    assert [o.outputs[0].token_ids for o in tiny.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY, use_tqdm=False)]
    assert_clean(tiny)


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM("tiny-random", disaggregated=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_transfer_timeout"):
        EngineConfig(model="tiny-random", disaggregated=True, kv_transfer_timeout=0)
    with pytest.raises(ValueError, match="^disaggregated .*make_engine"):  # one process cannot be both workers
        LLMEngine(model="tiny-random", disaggregated=True)
    for bad in (3, "minivllm.disaggregation.handoff.NoSuchHandoff"):
        with pytest.raises(ValueError, match="^kv_handoff_cls must be None, a function or an importable dotted name"):
            EngineConfig(model="tiny-random", disaggregated=True, kv_handoff_cls=bad)


def test_sampling_options_it_cannot_split_are_refused_before_anything_changes(tiny):
    with pytest.raises(ValueError, match="^n "):
        tiny.engine.add_request("two", [1, 2, 3], SamplingParams(n=2))
    with pytest.raises(ValueError, match="logprobs"):
        tiny.engine.add_request("lp", [1, 2, 3], SamplingParams(logprobs=2))
    assert tiny.engine.requests == {}


def test_a_handshake_mismatch_is_refused_naming_the_field():
    config = EngineConfig(model="tiny-random", disaggregated=True, num_blocks=64)
    before = _children(os.getpid())
    with pytest.raises(ValueError, match="block_size must be the same on the prefill and decode workers"):
        DisaggregatedEngine(config, decode_config=replace(config, disaggregated=False, block_size=8))
    assert not _wait_gone(_children(os.getpid()) - before)


def test_smollm2_is_token_identical_to_one_engine():
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM("smollm2-135m", disaggregated=True, num_blocks=512) as llm:
        prompts = chat_prompts(llm.get_tokenizer(), 6)  # two of them several hundred tokens long
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_clean(llm)
    want = [o.outputs[0].token_ids for o in LLM("smollm2-135m", num_blocks=512).generate(prompts, params,
                                                                                           use_tqdm=False)]
    assert got == want


def test_serve_disaggregated_answers_like_one_engine_and_stops_its_workers(reference):
    import httpx

    server = ServerProcess.minivllm("--model", "tiny-random", "--disaggregated", "--num-blocks", "256",
                                    env={**os.environ, "HF_HUB_OFFLINE": "1"})
    with server:
        workers = _children(server.pid)
        assert len(workers) >= 2, "a prefill and a decode worker under the server"
        prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
        body = dict(model="tiny-random", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        got = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        want = reference.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].text
        assert got == streamed == want
    assert server.returncode == 0 and "Traceback" not in server.log(), server.log()[-3000:]
    deadline = time.monotonic() + 20
    while (alive := {p for p in workers if process_alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"worker processes {alive} outlived the server"

