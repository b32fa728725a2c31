"""Issue 27, the multi-process modes: nothing from the rendezvous store is unpickled or executed, every listener is
on loopback, what the store carries is signed; the disaggregated front never idles with an output undelivered and
gives a single engine's outputs for every SamplingParams it accepts (seeded sampling, stop strings, stop tokens)."""

import datetime
import os
import pickle
import random
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from minivllm import LLM, SamplingParams
from minivllm.distributed.rendezvous import BadSignature, Signer, loopback_store

pytestmark = pytest.mark.filterwarnings("ignore")


# -- what listens where ------------------------------------------------------------------------
def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _hex_ip(field: str) -> str:
    ip, port = field.split(":")
    if len(ip) == 8:
        return f"{socket.inet_ntop(socket.AF_INET, bytes.fromhex(ip)[::-1])}:{int(port, 16)}"
    raw = bytes.fromhex(ip)
    return f"[{socket.inet_ntop(socket.AF_INET6, b''.join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))}]:{int(port, 16)}"


def listening(pids) -> list[str]:
    """Every TCP socket in LISTEN state held by one of ``pids``, as "address:port"."""
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                out.append(_hex_ip(cols[1]))
    return out


def outside_address() -> str | None:
    """An address of this machine that is not loopback (None when it has none)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # a documentation address: nothing is sent, the kernel only picks a route
        ip = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if ip.startswith("127.") else ip


def assert_loopback_only(pids, port: int) -> None:
    addresses = listening(pids)
    assert addresses, "no listening socket found: the check would prove nothing"
    assert all(a.startswith("127.0.0.1:") or a.startswith("[::1]:") for a in addresses), addresses
    ip = outside_address()
    if ip is not None:
        with pytest.raises(OSError):
            socket.create_connection((ip, port), timeout=2).close()


def test_the_store_listens_on_loopback_only_and_is_not_reachable_from_outside():
    store = loopback_store(None, datetime.timedelta(seconds=10))
    assert_loopback_only([os.getpid()], store.port)
    client = dist.TCPStore("127.0.0.1", store.port, None, False)
    client.set("k", b"v")
    assert store.get("k") == b"v"


def test_a_plain_tcpstore_listens_everywhere_which_is_why_loopback_store_exists():
    """The premise: TCPStore('127.0.0.1', ...) as a server binds every interface (if this fails, torch changed)."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    mine = [a for a in listening([os.getpid()]) if a.endswith(f":{store.port}")]
    assert mine and not mine[0].startswith("127."), mine


# -- the signer ---------------------------------------------------------------------------------
def test_signed_values_round_trip_and_anything_else_is_refused():
    signer, other = Signer(), Signer()
    data = signer.pack("epoch0/xfer/0", {"request_id": "r", "prompt_ids": [1, 2]})
    assert signer.unpack("epoch0/xfer/0", data) == {"request_id": "r", "prompt_ids": [1, 2]}
    for key, value in [("epoch0/xfer/0", other.pack("epoch0/xfer/0", {"x": 1})),  # another launch's secret
                       ("epoch1/xfer/0", data),  # replayed in a later epoch
                       ("epoch0/xfer/1", data),  # under another key
                       ("epoch0/xfer/0", data.replace(b"[1,2]", b"[1,3]")),  # changed
                       ("epoch0/xfer/0", pickle.dumps({"x": 1})),  # a pickle
                       ("epoch0/xfer/0", b"")]:
        with pytest.raises(BadSignature):
            signer.unpack(key, value)


class Payload:
    """Unpickling this runs ``touch PATH``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# -- the disaggregated engine ----------------------------------------------------------------
@pytest.fixture(scope="module")
def pd():
    llm = LLM("tiny-random", disaggregated=True, num_blocks=256, kv_transfer_timeout=5.0)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def one():
    return LLM("tiny-random", num_blocks=256)


def test_disaggregated_listeners_are_on_loopback_only(pd):
    engine = pd.engine
    pids = [os.getpid(), *(p.pid for p in engine.procs.values())]
    assert_loopback_only(pids, engine.store.port)


def test_a_pickle_planted_in_the_store_never_runs_and_the_engine_recovers(pd, one):
    engine = pd.engine
    marker = Path(tempfile.mkdtemp()) / "pwned"
    refusals = engine.num_relinks
    client = dist.PrefixStore(f"epoch{engine.epoch}/", dist.TCPStore("127.0.0.1", engine.store.port, None, False))
    k = engine.worker_stats()["decode"]["transfers"]  # at least the next transfer the decode worker polls for
    for key in range(k + 1):
        client.set(f"xfer/{key}", pickle.dumps(Payload(marker)))  # where the link's headers go
    deadline = time.monotonic() + 60
    while engine.num_relinks == refusals and time.monotonic() < deadline:
        engine.step()
    assert engine.num_relinks > refusals, "the forged header was not refused"
    assert not marker.exists(), "the planted pickle ran"
    prompt = list(range(5, 30))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = pd.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == one.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert not marker.exists()


def test_an_output_pumped_in_by_stats_is_still_delivered(pd):
    """Before: stats() moved the last output into _ready and has_unfinished_requests() said False: the loop idled."""
    engine = pd.engine
    engine.add_request("pumped", list(range(5, 25)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    outs, deadline = [], time.monotonic() + 60
    while "pumped" in engine.requests and time.monotonic() < deadline:
        engine.worker_stats()  # pumps the workers' messages, as the server's stats refresh does
    assert "pumped" not in engine.requests
    assert engine.has_unfinished_requests(), "an output waits in the front: the loop must not go idle"
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs and outs[-1].request_id == "pumped" and outs[-1].finished


def test_n_and_logprobs_are_refused_at_validation_before_anything_is_queued(pd):
    for params, field in [(SamplingParams(n=2), "n"), (SamplingParams(logprobs=1), "logprobs")]:
        with pytest.raises(ValueError, match=field):
            pd.engine.validate_request("v", [1, 2, 3], params)
    assert not pd.engine.requests


def _workload(tokenizer, reference: LLM, rng: random.Random, size: int):
    """Random prompts and SamplingParams: seeded sampling, stop strings a reference run is known to produce
    (some at the first token), stop tokens, max_tokens 1."""
    prompts = [[rng.randrange(5, 200) for _ in range(rng.randint(3, 40))] for _ in range(size)]
    probe = reference.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                               use_tqdm=False)
    params = []
    for out in probe:
        text, ids = out.outputs[0].text, out.outputs[0].token_ids
        kind = rng.choice(["seeded", "seeded", "stop-first", "stop-later", "stop-token", "one", "greedy"])
        p = dict(temperature=0.0, max_tokens=rng.randint(2, 12), ignore_eos=True)
        if kind == "seeded":
            p.update(temperature=rng.choice([0.7, 1.0, 1.3]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([-1, 20]),
                     seed=rng.randrange(2**32))
        elif kind == "stop-first" and tokenizer.decode(ids[:1]).strip():
            p.update(stop=[tokenizer.decode(ids[:1]).strip()[:2]])
        elif kind == "stop-later" and len(text) > 4:
            p.update(stop=[text[2:4]], include_stop_str_in_output=rng.random() < 0.5)
        elif kind == "stop-token":
            p.update(stop_token_ids=[ids[rng.randrange(len(ids))]])
        elif kind == "one":
            p.update(max_tokens=1)
        params.append(SamplingParams(**p))
    return prompts, params


@pytest.mark.parametrize("seed", range(3))
def test_random_workloads_equal_a_single_engines_outputs(pd, one, seed):
    rng = random.Random(seed)
    prompts, params = _workload(pd.get_tokenizer(), one, rng, 12)
    got = pd.generate(prompts, params, use_tqdm=False)
    want = one.generate(prompts, params, use_tqdm=False)
    for p, g, w in zip(params, got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (w.token_ids, w.text, w.finish_reason,
                                                                         w.stop_reason), p
    stats = pd.engine.worker_stats()
    assert all(s["invariants"] == "ok" and s["engine"].num_used_blocks == 0 for s in stats.values()), stats


def test_seeded_sampling_is_reproducible_across_runs_and_equal_to_one_engine(pd, one):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    prompt = list(range(40, 70))
    runs = [pd.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1] == one.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_forged_values_written_under_the_links_keys_are_refused_and_the_server_serves_once_they_stop(capfd):
    """The worst case: a forger who knows the current epoch writes its keys (fingerprints, headers) without pause.
    Every refusal is one line in the log and the link is formed again; /health says 503 while it is down; a request
    decoding meanwhile (not on the link) finishes; once the writes stop the server serves again.
    Before: a refused fingerprint killed the worker with a traceback and the front's ValueError failed every
    request in the server's loop. The writes go on until two refusals and a 503 were seen, not for a fixed time.
    (The 30 s version of this, with timings, is in issue 52's report.)"""
    import httpx

    from minivllm.exercises.serving import served

    from minivllm.disaggregation import DisaggregatedEngine

    # its own engine: its workers' stderr (where the refusals are logged) is this test's
    engine = DisaggregatedEngine(model="tiny-random", disaggregated=True, num_blocks=256, kv_transfer_timeout=3.0)
    refusals = engine.num_relinks
    with served(engine, model="tiny-random") as server:
        def complete(max_tokens: int, prompt: list[int]) -> tuple[int, str | None]:
            r = httpx.post(server.url + "/v1/completions", timeout=120, json=dict(
                prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True))
            return r.status_code, r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else r.text

        results = {}
        # 400 tokens: about 9 were made when the writes had been refused (a run under load); checked below
        runs = {"decoding": (400, list(range(5, 25))), "during": (8, list(range(40, 60)))}
        threads = {name: threading.Thread(target=lambda n=name: results.__setitem__(n, complete(*runs[n])),
                                          daemon=True) for name in runs}
        threads["decoding"].start()
        deadline = time.monotonic() + 60
        while not any(r.stage == "decode" for r in engine.requests.values()):  # the decode worker owns it
            assert time.monotonic() < deadline, "the long request never reached the decode worker"
            time.sleep(0.02)
        store, stop, health = dist.TCPStore("127.0.0.1", engine.store.port, None, False), threading.Event(), []

        def forge():
            while not stop.is_set():
                here = dist.PrefixStore(f"epoch{engine.epoch}/", store)
                for key in ("fingerprint0", "fingerprint1", "xfer/0", "xfer/1", "xfer/2"):
                    here.set(key, b"0" * 64 + b'\n{"request_id": "forged"}')

        forger = threading.Thread(target=forge, daemon=True)
        forger.start()
        threads["during"].start()
        deadline = time.monotonic() + 60
        while engine.num_relinks < refusals + 2 or 503 not in health:  # the writes go on until they were refused
            assert time.monotonic() < deadline, (engine.num_relinks - refusals, health)
            health.append(httpx.get(server.url + "/health", timeout=10).status_code)
            time.sleep(0.1)
        assert "decoding" not in results, "the long request ended before the writes were refused: it shows nothing"
        stop.set()
        forger.join(10)
        deadline = time.monotonic() + 60
        while (got := complete(8, list(range(70, 90)))) != (200, "length"):  # served again (bounded)
            assert got[0] in (200, 503) and time.monotonic() < deadline, got
        for t in threads.values():
            t.join(120)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    engine.shutdown()
    assert results["decoding"] == (200, "length"), results  # not on the link: it finished
    assert results["during"][0] in (200, 503), results  # sent while the link was down: served, or retryable
    assert engine.num_relinks > refusals and 503 in health, (engine.num_relinks, health)
    assert not engine.restarts, f"a refusal restarted a worker: {engine.restarts}"
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "not signed by this launch" in line]
    assert len(lines) >= 1 and all("forming the KV link again" in line for line in lines), err[-3000:]
    print(f"{engine.num_relinks - refusals} links formed again, {len(lines)} refusals logged, /health "
          f"{health.count(503)} x 503 and {health.count(200)} x 200 during the writes; other stderr lines: "
          f"{[line for line in err.splitlines() if line not in lines][:5]}")


# -- tensor parallelism ------------------------------------------------------------------------
def test_tensor_parallel_listeners_are_on_loopback_only():
    llm = LLM("tiny-random", tensor_parallel_size=2, num_blocks=64)
    try:
        workers = llm.engine.workers
        pids = [os.getpid(), *(p.pid for p in workers.processes.values())]
        assert_loopback_only(pids, workers.store.port)
    finally:
        llm.shutdown()

