"""The server under load and in trouble (chapter 13): many streams, disconnects, SIGTERM, a full queue, a
failing request. Each test runs a real ``python -m minivllm serve`` of the seeded tiny-random model in a
subprocess on 127.0.0.1 (fast enough for 64 streams on a CPU), driven by the official OpenAI client."""

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from minivllm import LLM, SamplingParams
from minivllm.bench import ServerProcess

from serving_helpers import async_client, client, idle, metrics, wait_until

MODEL = "tiny-random"
TINY = ("--model", MODEL, "--max-num-seqs", "64", "--num-blocks", "4096")
TESTS = str(Path(__file__).resolve().parent)
LONG = 3000  # tokens a request would need minutes for: it can only end by being aborted


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, max_num_seqs=64, num_blocks=4096, device="cpu")


def clean_exit(server) -> None:
    assert server.returncode == 0, server.log()[-3000:]
    assert "Traceback" not in server.log(), server.log()[-3000:]


def prompts(n: int) -> list[str]:
    return [f"Request {i}: tell me about the number {i * 7919 % 1000}." for i in range(n)]


def expected(offline, texts, lengths) -> list[str]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    return [o.outputs[0].text for o in offline.generate(texts, params, use_tqdm=False)]


async def stream(api, prompt, max_tokens, leave_after=None, started=None):
    """One streaming completion: (text, finish reasons), or None when it leaves after ``leave_after`` chunks."""
    s = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    text, reasons = [], []
    async for chunk in s:
        if started is not None:
            started.set()
        text.append(chunk.choices[0].text)
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
        if leave_after is not None and len(text) >= leave_after:
            await s.close()  # the client goes away mid-stream
            return None
    return "".join(text), reasons


def test_64_streams_with_a_quarter_disconnecting_leave_nothing_behind(offline):
    rng = random.Random(0)
    texts, leaving = prompts(64), set(rng.sample(range(64), 16))
    lengths = [LONG if i in leaving else rng.randint(16, 48) for i in range(64)]
    staying = [i for i in range(64) if i not in leaving]
    want = dict(zip(staying, expected(offline, [texts[i] for i in staying], [lengths[i] for i in staying])))
    with ServerProcess.minivllm(*TINY) as server:
        before = metrics(server)
        api = async_client(server)

        async def main():
            jobs = [stream(api, texts[i], lengths[i], rng.randint(1, 8) if i in leaving else None)
                    for i in range(64)]
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=60)

        start = time.perf_counter()
        results = asyncio.run(main())
        seconds = time.perf_counter() - start
        assert wait_until(lambda: idle(server), 15), metrics(server)  # no leak: nothing running, no block held
        after = metrics(server)
    clean_exit(server)
    assert all(results[i] is None for i in leaving)
    for i in staying:
        assert results[i] == (want[i], ["length"]), i  # token-identical to the offline engine, one finish_reason
    assert after["minivllm:requests_aborted_total"] - before["minivllm:requests_aborted_total"] == 16
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 48
    print(f"\n64 streams, 16 disconnected mid-stream, {sum(lengths[i] for i in staying)} tokens streamed to the "
          f"48 others in {seconds:.1f} s; leaked blocks: {after['minivllm:kv_cache_used_blocks']:.0f}")


def test_sigterm_mid_load_exits_0_within_the_grace_period(offline):
    grace = 3.0
    texts = prompts(16)
    short = {i: 24 for i in range(8)}  # finish well within the grace period
    want = dict(zip(short, expected(offline, texts[:8], [24] * 8)))
    with ServerProcess.minivllm(*TINY, "--shutdown-grace", str(grace)) as server:
        api = async_client(server)

        async def main():
            started = [asyncio.Event() for _ in texts]
            jobs = [asyncio.ensure_future(stream(api, t, short.get(i, LONG), started=started[i]))
                    for i, t in enumerate(texts)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=60)
            server.proc.send_signal(signal.SIGTERM)  # by process id
            sent = time.perf_counter()
            await asyncio.sleep(0.5)
            with pytest.raises((openai.APIConnectionError, openai.APIStatusError)) as late:
                await api.completions.create(model=MODEL, prompt="too late", max_tokens=2)
            results = await asyncio.gather(*jobs, return_exceptions=True)
            return results, sent, late.value

        results, sent, late = asyncio.run(main())
        code = server.proc.wait(timeout=grace + 20)
        exited = time.perf_counter() - sent
        server.stop()
    assert code == 0 and exited < grace + 5, (code, exited)
    assert isinstance(late, openai.APIConnectionError) or late.status_code == 503
    for i, r in enumerate(results):
        if i in short:
            assert r == (want[i], ["length"]), (i, r)  # a full answer
        else:  # a clean error: the server's error event, not a broken connection
            assert isinstance(r, openai.APIError) and not isinstance(r, openai.APIConnectionError), (i, r)
            assert r.code == "shutting_down", r
    clean_exit(server)


@pytest.fixture(scope="module")
def fussy():
    """Two running slots, one queued, and a sampler that fails requests at temperature 0.7."""
    env = {"PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    with ServerProcess.minivllm("--model", MODEL, "--max-num-seqs", "2", "--max-queue-size", "1", "--num-blocks",
                                "1024", "--sampler", "serving_helpers.FussySampler", env=env) as server:
        yield server
    clean_exit(server)


def test_a_full_queue_answers_429_at_once(fussy):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=fussy.url, timeout=60) as http:
        streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(3)]
        responses = [s.__enter__() for s in streams]  # two run, the third waits for a slot
        try:
            assert all(r.status_code == 200 for r in responses)
            assert wait_until(lambda: metrics(fussy)["vllm:num_requests_waiting"] == 1)
            full = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            # at once, not after a slot freed: the two streams still run and the third still waits
            gauges = metrics(fussy)
            assert gauges["vllm:num_requests_running"] == 2 and gauges["vllm:num_requests_waiting"] == 1, gauges
        finally:
            for s in streams:
                s.__exit__(None, None, None)
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full", full.text
        assert wait_until(lambda: idle(fussy), 10)
        assert http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2}).status_code == 200


def test_a_request_failing_in_the_engine_fails_alone(fussy, offline):
    api, aapi = client(fussy), async_client(fussy)
    want = expected(offline, ["Hello there"], [24])[0]

    async def main():
        good = asyncio.ensure_future(stream(aapi, "Hello there", 24))
        bad = asyncio.ensure_future(aapi.completions.create(model=MODEL, prompt="Hi", max_tokens=8, temperature=0.7))
        return await asyncio.gather(good, bad, return_exceptions=True)

    good, bad = asyncio.run(main())
    assert good == (want, ["length"])  # its neighbour's failure did not touch it
    assert isinstance(bad, openai.InternalServerError) and "cannot sample at 0.7" in bad.message
    with pytest.raises(openai.APIError, match="cannot sample at 0.7"):  # streaming: an error event, then the end
        list(api.completions.create(model=MODEL, prompt="Hi", max_tokens=8, temperature=0.7, stream=True))
    assert httpx.get(fussy.url + "/health").status_code == 200
    assert wait_until(lambda: idle(fussy), 10)
    again = api.completions.create(model=MODEL, prompt="Hello there", max_tokens=24, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert again.choices[0].text == want
