"""The front end and the engine in one process: what they cost each other (chapter 13).

vLLM V1 runs its engine core in a process of its own, away from the API
server's Python (HTTP, JSON, tokenizing, detokenizing). minivllm's ``AsyncLLM``
keeps both in one process, so these helpers measure what that costs:
:func:`python_work` spins in Python as a front end does (a request body through
JSON), in a thread of this process (sharing its GIL) or in a process of its own
(sharing only the cores); :func:`decode_steps_beside` times an engine's decode
steps beside each; :func:`event_loop_lag` measures how late the running asyncio
event loop wakes a coroutine, which is what every handler on it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time

from minivllm.sampling_params import SamplingParams

__all__ = ["python_work", "decode_steps_beside", "event_loop_lag"]

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello " * 200}], "max_tokens": 64}
_SPIN = ("import json, time\nbody = {body!r}\nend = time.time() + {seconds}\n"
         "while time.time() < end:\n    json.loads(json.dumps(body))\n")


@contextlib.contextmanager
def python_work(where: str, seconds: float = 120.0):
    """A front end's Python (a request body through ``json``, again and again) for at most ``seconds``, in a
    ``"thread"`` of this process or a ``"process"`` of its own; stopped on exit (the process by its id)."""
    if where == "thread":
        stop = threading.Event()

        def spin():
            end = time.monotonic() + seconds
            while not stop.is_set() and time.monotonic() < end:
                json.loads(json.dumps(BODY))

        thread = threading.Thread(target=spin, name="front-end-work", daemon=True)
        thread.start()
        try:
            yield thread
        finally:
            stop.set()
            thread.join()
    elif where == "process":
        proc = subprocess.Popen([sys.executable, "-c", _SPIN.format(body=BODY, seconds=seconds)])
        try:
            yield proc
        finally:
            proc.kill()
            proc.wait()
    else:
        raise ValueError(f"where must be 'thread' or 'process', not {where!r}")


def decode_steps_beside(llm, neighbours: dict, batch: int = 2, steps: int = 6, prompt_len: int = 16,
                        rounds: int = 1) -> dict[str, float]:
    """Median seconds of a decode step of ``batch`` requests beside each neighbour (``name: None`` for none,
    else a context-manager factory such as ``lambda: python_work("thread")``), the neighbours taken in turn
    ``rounds`` times so that each sees the same machine."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in neighbours}
    serial = 0
    for _ in range(rounds):
        for name, neighbour in neighbours.items():
            for _ in range(batch):
                serial += 1
                engine.add_request(f"beside-{serial}", list(range(100, 100 + prompt_len)), params)
            engine.step()  # the prefill
            with neighbour() if neighbour else contextlib.nullcontext():
                for _ in range(steps):
                    start = time.perf_counter()
                    engine.step()
                    times[name].append(time.perf_counter() - start)
            while engine.has_unfinished_requests():
                engine.step()
    return {name: statistics.median(t) for name, t in times.items()}


async def event_loop_lag(until, period: float = 1e-3) -> list[float]:
    """Seconds by which the running event loop wakes a coroutine late, sleeping ``period`` at a time until
    ``until()`` is true (at least once): the delay any handler on this loop would see."""
    lags = []
    while True:
        start = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(max(0.0, time.perf_counter() - start - period))
        if until():
            return lags
