"""Chapter 13's measurements of a front end beside the engine in one process (minivllm.bench.front_end)."""

import asyncio
import os
import threading

import pytest

from minivllm import LLM
from minivllm.bench import decode_steps_beside, event_loop_lag, python_work


def test_python_work_runs_where_it_is_asked_and_is_stopped_on_exit():
    with python_work("thread") as thread:
        assert thread.is_alive() and thread in threading.enumerate()
    assert not thread.is_alive()
    with python_work("process") as proc:
        assert proc.poll() is None and proc.pid != os.getpid()
    assert proc.poll() is not None  # killed and reaped by its id
    with pytest.raises(ValueError, match="where must be 'thread' or 'process'"):
        with python_work("elsewhere"):
            pass


def test_decode_steps_beside_times_every_neighbour_and_leaves_nothing_running():
    llm = LLM("tiny-random", device="cpu", num_blocks=64, max_num_seqs=4)
    seen = []

    def neighbour():
        seen.append(llm.engine.has_unfinished_requests())  # entered while the requests decode
        return python_work("thread")

    times = decode_steps_beside(llm, {"alone": None, "thread": neighbour}, batch=2, steps=3, rounds=2)
    assert set(times) == {"alone", "thread"} and all(t > 0 for t in times.values())
    assert seen == [True, True] and not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_total_blocks


def test_event_loop_lag_probes_until_told_and_never_reports_a_negative_lag():
    async def probe():
        done = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, done.set_result, None)
        return await event_loop_lag(done.done, period=1e-3)

    lags = asyncio.run(probe())
    assert len(lags) >= 2 and min(lags) >= 0
    assert len(asyncio.run(event_loop_lag_once())) == 1


async def event_loop_lag_once():
    return await event_loop_lag(lambda: True)
