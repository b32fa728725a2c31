"""AsyncLLM in process (chapter 13): one loop thread steps the engine, each request reads its own queue.

The server tests (test_serving.py) check the same behaviour over HTTP; these
check it directly, with no network: routing, abort on close, validation
before queueing, backpressure, the shutdown deadline.
"""

import asyncio
import threading
import time

import pytest

from minivllm import LLM, LLMEngine, SamplingParams
from minivllm.serving import AsyncLLM, MiniEngineLoop, QueueFull, ServerShuttingDown

from helpers import greedy

OPTIONS = dict(block_size=4, num_blocks=1024, max_num_seqs=4, device="cpu")
LONG = greedy(4000, ignore_eos=True)  # cannot finish within these tests: 4,000 steps
PROMPTS = [[10 + i, 20, 30 + i, 40] for i in range(6)]


@pytest.fixture(scope="module")
def offline():
    return LLM("tiny-random", **OPTIONS)


@pytest.fixture
def async_llm():
    llm = AsyncLLM(LLMEngine(model="tiny-random", **OPTIONS))
    yield llm
    llm.close()


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def idle(llm: AsyncLLM) -> bool:
    stats = llm.engine.stats()
    return llm.num_in_flight == 0 and not llm.engine.has_unfinished_requests() and stats.num_used_blocks == 0


async def collect(llm: AsyncLLM, prompt, params):
    outs = [out async for out in llm.generate(prompt, params)]
    return outs


def test_each_request_gets_exactly_its_own_outputs(async_llm, offline):
    params = [greedy(5 + i, ignore_eos=True) for i in range(len(PROMPTS))]  # 6 requests, 4 run at once

    async def main():
        return await asyncio.gather(*(collect(async_llm, p, sp) for p, sp in zip(PROMPTS, params)))

    results = asyncio.run(main())
    expected = offline.generate(PROMPTS, params, use_tqdm=False)
    for outs, want in zip(results, expected):
        assert len({o.request_id for o in outs}) == 1  # one request's queue holds only its own outputs
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert sum((o.outputs[0].delta_token_ids for o in outs), []) == want.outputs[0].token_ids
        assert outs[-1].outputs[0].text == want.outputs[0].text
    assert wait_until(lambda: idle(async_llm))


def test_leaving_a_stream_early_aborts_the_request_and_frees_its_blocks(async_llm):
    async def main():
        agen = async_llm.generate(PROMPTS[0], LONG)
        seen = [await agen.__anext__() for _ in range(3)]
        assert async_llm.engine.stats().num_used_blocks > 0
        await agen.aclose()
        return seen

    seen = asyncio.run(main())
    assert len(seen) == 3 and not seen[-1].finished
    assert wait_until(lambda: idle(async_llm), 5.0), async_llm.engine.stats()


def test_bad_input_raises_before_anything_is_queued(async_llm):
    async def main():
        with pytest.raises(ValueError, match="max_tokens"):
            async_llm.add_request(PROMPTS[0], greedy(10**6))  # more than the context
        with pytest.raises(ValueError, match="prompt"):
            async_llm.add_request("", greedy(4))

    asyncio.run(main())
    assert async_llm.num_in_flight == 0 and not async_llm.engine.has_unfinished_requests()


def test_a_full_queue_is_refused_at_once():
    llm = AsyncLLM(LLMEngine(model="tiny-random", **{**OPTIONS, "max_num_seqs": 1}), max_queue_size=1)

    async def main():
        running = [llm.add_request(p, LONG) for p in PROMPTS[:2]]  # 1 runs, 1 waits
        with pytest.raises(QueueFull, match="max_queue_size 1"):  # raised by the call itself: nothing awaited
            llm.add_request(PROMPTS[2], greedy(4))
        assert llm.num_in_flight == 2  # refused while the slot was still taken, not after it freed
        for stream in running:
            stream.abort()

    try:
        asyncio.run(main())
        assert wait_until(lambda: idle(llm))
    finally:
        llm.close()


def test_shutdown_refuses_new_requests_and_aborts_what_is_left_at_the_deadline(async_llm, offline):
    async def main():
        short = asyncio.ensure_future(collect(async_llm, PROMPTS[1], greedy(3, ignore_eos=True)))
        long = async_llm.add_request(PROMPTS[0], LONG)
        await asyncio.sleep(0.05)
        async_llm.shutdown(0.5)
        with pytest.raises(ServerShuttingDown):
            async_llm.add_request(PROMPTS[2], greedy(4))
        start = time.perf_counter()
        with pytest.raises(ServerShuttingDown, match="aborted"):
            async for _ in long:
                pass
        return await short, time.perf_counter() - start

    short, waited = asyncio.run(main())
    assert waited < 0.5 + 2.0  # the deadline plus at most a step and the loop's idle wait
    assert short[-1].outputs[0].token_ids == offline.generate([PROMPTS[1]], greedy(3, ignore_eos=True),
                                                              use_tqdm=False)[0].outputs[0].token_ids
    assert wait_until(lambda: idle(async_llm))


def test_the_loop_thread_is_the_only_one_that_steps():
    engine = LLMEngine(model="tiny-random", **OPTIONS)
    stepped_by = set()
    step = engine.step

    def recording_step():
        stepped_by.add(threading.current_thread().name)
        return step()

    engine.step = recording_step
    llm = AsyncLLM(engine)
    try:
        asyncio.run(collect(llm, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4)))
    finally:
        llm.close()
    assert stepped_by == {"minivllm-engine-loop"}


def test_given_a_builder_the_loop_thread_builds_the_engine_and_its_error_reaches_the_caller():
    built_by = []

    def build():
        built_by.append(threading.current_thread().name)
        return LLMEngine(model="tiny-random", **OPTIONS)

    llm = AsyncLLM(build)
    try:
        assert built_by == ["minivllm-engine-loop"]
        outs = asyncio.run(collect(llm, PROMPTS[0], greedy(3, ignore_eos=True)))
        assert len(outs[-1].outputs[0].token_ids) == 3 and outs[-1].finished
    finally:
        llm.close()
    with pytest.raises(ValueError, match="block_size"):
        AsyncLLM(lambda: LLMEngine(model="tiny-random", **{**OPTIONS, "block_size": 0}))


def test_a_busy_loop_refreshes_the_gauges_and_an_idle_one_makes_them_exact():
    from minivllm.serving.metrics import ServerMetrics

    metrics = ServerMetrics("tiny-random")
    llm = AsyncLLM(LLMEngine(model="tiny-random", **OPTIONS), metrics=metrics)

    def gauges():
        return metrics.running._value.get(), metrics.used_blocks._value.get()

    async def main():  # a request that cannot finish: the loop stays busy until it is aborted
        stream = llm.add_request(PROMPTS[0], LONG)
        outputs = aiter(stream)  # kept: a dropped iterator closes, and closing a stream aborts its request
        await anext(outputs)
        busy = await asyncio.to_thread(wait_until, lambda: gauges()[0] == 1 and gauges()[1] > 0)
        stream.abort()
        return busy

    try:
        assert asyncio.run(main()), f"the gauges were not refreshed while the loop was busy: {gauges()}"
        assert wait_until(lambda: gauges() == (0, 0)), f"the idle loop left the gauges at {gauges()}"
    finally:
        llm.close()


class CountingLoop(MiniEngineLoop):
    """A reader's engine loop (exercise 13): minivllm's, counting its turns that stepped."""

    steps = 0

    def turn(self):
        outputs = super().turn()
        type(self).steps += outputs is not None
        return outputs


def test_loop_cls_plugs_in_an_engine_loop_subclass(offline):
    llm = AsyncLLM(LLMEngine(model="tiny-random", **OPTIONS), loop_cls=CountingLoop)
    try:
        assert type(llm.loop) is CountingLoop
        outs = asyncio.run(collect(llm, PROMPTS[0], greedy(4, ignore_eos=True)))
        want = offline.generate([PROMPTS[0]], greedy(4, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert outs[-1].outputs[0].token_ids == want.token_ids and CountingLoop.steps >= 4
        assert wait_until(lambda: idle(llm))
    finally:
        llm.close()
    by_name = AsyncLLM(LLMEngine(model="tiny-random", **OPTIONS),
                       loop_cls="minivllm.serving.engine_loop.MiniEngineLoop")
    by_name.close()
    for bad in ("minivllm.serving.NoSuchLoop", LLMEngine):  # refused before the engine is built
        with pytest.raises(ValueError, match="loop_cls"):
            AsyncLLM(lambda: pytest.fail("built the engine"), loop_cls=bad)
