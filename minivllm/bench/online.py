"""The online benchmark through a server's OpenAI API, as ``vllm bench serve`` runs it (chapter 13).

Each request of a workload is sent at its Poisson time as a streaming
``/v1/completions`` call, greedy, with its exact output length. The client
records when it sent the request and when each chunk of a token arrived
(``transformers serve`` ends a stream with one more chunk that holds only the
finish reason and no text: it is no token, and counting it would add a
near-zero gap to its ITL); the server's usage says how many tokens came. From
those, the same :func:`~minivllm.bench.metrics.serving_metrics` as in-process
runs: TTFT (send to first token's chunk), ITL (chunk gaps), TPOT, E2E,
throughput, goodput.

Prompts are sent as text (the workload's token ids decoded), which every
OpenAI-compatible server accepts; each server tokenizes it again, and the
usage it returns counts the tokens it saw. Servers differ in how to ask for an
exact output length (``BACKENDS``). A stream without usage (llama_cpp.server's)
counts its token chunks, or ``max_tokens`` when it finished for ``length``
(llama.cpp sends the tokens of a character split across tokens in one chunk).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from minivllm.bench.metrics import RequestTimes, ServingMetrics, serving_metrics
from minivllm.bench.progress import Progress
from minivllm.bench.workloads import Workload
from minivllm.timing import now

__all__ = ["BACKENDS", "request_extra", "OnlineRun", "text_prompts", "check_online_workload", "run_online",
           "run_online_async", "served_model"]


def _llamacpp(tokenizer) -> dict:
    """llama_cpp.server's request fields. It has no ignore_eos: it stops at any end-of-generation token
    (``llama_vocab_is_eog`` in llama_cpp/llama.py, SmolLM2's ``<|im_end|>`` and ``<|endoftext|>``), so a logit bias
    of -1e9 on every special token of the tokenizer keeps them from being sampled; ``repeat_penalty`` 1.0 makes
    temperature 0 plain greedy (its default, 1.1, rescales repeated tokens' logits). It serves one request at a
    time: every completion holds one lock around the model until its stream ends (``get_llama_proxy`` in
    llama_cpp/server/app.py), so requests that overlap wait in line; its stream carries no usage."""
    return {"logit_bias": {str(i): -1e9 for i in tokenizer.all_special_ids}, "repeat_penalty": 1.0}


# How each server is told to ignore EOS (so every request generates exactly max_tokens): a vLLM extension,
# transformers serve's per-request generation config (EOS -1 disables it in its continuous batching), or for
# llama_cpp.server a logit bias against the end tokens (a function of the tokenizer, ``_llamacpp``).
BACKENDS = {"minivllm": {"ignore_eos": True}, "vllm": {"ignore_eos": True},
            "transformers": {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})},
            "llamacpp": _llamacpp}


def request_extra(backend: str, tokenizer) -> dict:
    """The fields ``backend`` adds to every completion request (``BACKENDS``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    extra = BACKENDS[backend]
    return extra(tokenizer) if callable(extra) else extra


@dataclass
class OnlineRun:
    """One workload through one server: per request its times (None if it failed), text and error."""

    label: str
    duration: float
    requests: list[RequestTimes | None]
    texts: list[str]
    errors: list[str | None] = field(default_factory=list)

    @property
    def completed(self) -> list[RequestTimes]:
        return [r for r in self.requests if r is not None and r.token_times]

    @property
    def output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.completed)

    @property
    def throughput(self) -> float:
        """Output tokens per second, first send to last chunk."""
        return self.output_tokens / self.duration

    def metrics(self, slo: dict | None = None) -> ServingMetrics:
        return serving_metrics(self.completed, self.duration, slo)


def text_prompts(workload: Workload, tokenizer) -> list[str]:
    """The workload's prompts as text, what a client of a server sends."""
    return [tokenizer.decode(a.prompt) if not isinstance(a.prompt, str) else a.prompt for a in workload.arrivals]


def check_online_workload(workload: Workload) -> None:
    """A server replays open-loop workloads only: arrivals at set times, no step counts, its own KV pool."""
    if workload.pool_fraction is not None or any(a.at_step or a.after_first_token_of for a in workload.arrivals):
        raise ValueError(f"workload {workload.name!r} cannot run against a server: it needs arrivals at set "
                         f"times (offline, online, shared-prefix, interference), not engine steps or a KV pool")


def served_model(url: str, timeout: float = 10.0) -> str:
    """The model id a server serves (its first ``/v1/models`` entry); ``ConnectionError`` saying why in one line
    if nothing answers there or what answers is no OpenAI-compatible server."""
    import httpx  # optional: only a benchmark against a server needs an HTTP client

    try:
        return httpx.get(f"{url}/v1/models", timeout=timeout).json()["data"][0]["id"]
    except httpx.HTTPError as e:
        raise ConnectionError(f"cannot reach the server at {url}: {e}") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise ConnectionError(f"{url}/v1/models lists no model: is it an OpenAI-compatible server?") from None


async def _stream_one(client, url: str, body: dict, send_at: float) -> tuple[RequestTimes | None, str, str | None]:
    """Send one streaming completion at ``send_at`` (perf_counter time); its times, text and any error."""
    await asyncio.sleep(max(0.0, send_at - now()))
    sent, times, text, usage, finish = now(), [], [], None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return None, "", f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return None, "".join(text), str(data["error"])
            choice = (data.get("choices") or [None])[0]
            if choice is not None and (choice.get("text") or not choice.get("finish_reason")):  # a token's chunk
                times.append(now())
                text.append(choice.get("text") or "")
            finish = (choice or {}).get("finish_reason") or finish
            usage = data.get("usage") or usage
    n = usage["completion_tokens"] if usage else body["max_tokens"] if finish == "length" else len(times)
    return RequestTimes(sent, times, usage["prompt_tokens"] if usage else 0, n), "".join(text), None


async def _beat(tasks, bar: Progress) -> None:
    """Count the finished requests into ``bar`` twice a second, until cancelled."""
    while True:
        await asyncio.sleep(0.5)
        bar.done = sum(t.done() for t in tasks)
        bar.tick()


async def _run(url, model, prompts, workload, extra, timeout, bar: Progress | None = None) -> OnlineRun:
    import httpx  # optional: only a benchmark against a server needs an HTTP client

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as client:
        start = now()
        tasks = [asyncio.ensure_future(_stream_one(client, url, {
            "model": model, "prompt": p, "max_tokens": a.params.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}, start + (a.at_time or 0.0)))
            for p, a in zip(prompts, workload.arrivals)]
        beat = asyncio.ensure_future(_beat(tasks, bar)) if bar is not None else None
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            if beat is not None:
                beat.cancel()
                bar.done = sum(t.done() for t in tasks)
                bar.close(stopped=bar.done < len(tasks))
        end = now()
    out = [r if not isinstance(r, BaseException) else (None, "", f"{type(r).__name__}: {r}") for r in results]
    done = [r for r, _, _ in out if r is not None and r.token_times]
    last = max((r.token_times[-1] for r in done), default=end)
    return OnlineRun("", last - start, [r for r, _, _ in out], [t for _, t, _ in out], [e for _, _, e in out])


async def run_online_async(url: str, workload: Workload, tokenizer, backend: str = "minivllm",
                           model: str | None = None, label: str = "", timeout: float = 600.0,
                           progress: bool = False) -> OnlineRun:
    """Send ``workload`` to the server at ``url`` as its arrival times say; every request streams.

    ``backend`` names how to ask the server for exact output lengths (``BACKENDS``); ``timeout`` bounds
    each request in seconds; ``progress``: a line on stderr every few seconds, the requests finished. In a
    notebook, ``await`` this; elsewhere :func:`run_online` runs it.
    """
    check_online_workload(workload)
    extra = request_extra(backend, tokenizer)
    url = url.rstrip("/")
    model = model or served_model(url)
    label = label or f"{backend} at {url}"
    bar = Progress(label, len(workload.arrivals), unit="requests", enabled=progress)
    run = await _run(url, model, text_prompts(workload, tokenizer), workload, extra, timeout, bar=bar)
    run.label = label
    return run


def run_online(url: str, workload: Workload, tokenizer, **kwargs) -> OnlineRun:
    """:func:`run_online_async` from synchronous code (it starts its own event loop)."""
    return asyncio.run(run_online_async(url, workload, tokenizer, **kwargs))
