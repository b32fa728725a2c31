"""What the server tests share: clients, reading /metrics, waiting (bounded), and a sampler that fails on purpose."""

import json
import time
from collections import defaultdict

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from minivllm.sampler import MiniSampler


def client(server, **kwargs) -> openai.OpenAI:
    """The official OpenAI client pointed at ``server``; no retries, so every error is seen as it is."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=120, **kwargs)


def async_client(server, **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=120, **kwargs)


def metrics(server) -> dict[str, float]:
    """``/metrics`` as {sample name: value}, labels summed over (one model per server); a sample not there yet
    (a labelled counter before its first event) reads 0."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] += sample.value
    return values


def wait_until(condition, timeout: float = 10.0, every: float = 0.05):
    """Poll ``condition()`` until it is truthy or ``timeout`` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    value = condition()
    while not value and time.monotonic() < deadline:
        time.sleep(every)
        value = condition()
    return value


def idle(server) -> bool:
    """Nothing running or waiting and no KV block held (the no-leak condition)."""
    m = metrics(server)
    return (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
            and m["minivllm:kv_cache_used_blocks"] == 0 and m["vllm:kv_cache_usage_perc"] == 0)


def sse_events(lines) -> list[dict | str]:
    """The ``data:`` payloads of a server-sent event stream, "[DONE]" as the string."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


class FussySampler(MiniSampler):
    """Fails any batch that holds a row with temperature 0.7, as a sampler broken for one request would.

    The server loads it by name: ``--sampler serving_helpers.FussySampler`` (tests/ on PYTHONPATH)."""

    def __call__(self, logits, params, generators):
        if any(p.temperature == 0.7 for p in params):
            raise RuntimeError("cannot sample at 0.7")
        return super().__call__(logits, params, generators)
