"""Serving traces: drive an engine step by step as requests arrive, and record every step (chapters 08-11)."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench.timing import now
from minivllm.bench.workloads import Arrival


@dataclass
class StepRecord:
    """One engine step: when it ran and what it computed, ``(request id, start, num_tokens, kind)`` per chunk."""

    start: float
    end: float
    chunks: list[tuple[str, int, int, str]]  # kind: "prefill" (prompt tokens) or "decode"

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, _, n, kind in self.chunks if kind == "prefill")

    @property
    def num_decodes(self) -> int:
        return sum(kind == "decode" for *_, kind in self.chunks)


@dataclass
class ServingTrace:
    """Everything :func:`replay` saw: each step, and each request's metrics and output ids."""

    label: str
    steps: list[StepRecord]
    metrics: dict  # request id -> RequestMetrics
    token_ids: dict[str, list[int]]
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def output_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids.values())

    @property
    def throughput(self) -> float:
        """Output tokens per second of wall time, first arrival to last token."""
        return self.output_tokens / self.seconds

    def gaps(self, request_ids=None) -> list[float]:
        """Inter-token gaps (seconds between consecutive output tokens) of the given requests, pooled."""
        ids = self.metrics if request_ids is None else request_ids
        out = []
        for rid in ids:
            times = self.metrics[rid].token_times
            out.extend(b - a for a, b in zip(times, times[1:]))
        return out

    def ttft(self, request_id: str) -> float:
        """Time to first token: arrival (``add_request``) to the first output token."""
        return self.metrics[request_id].ttft

    @property
    def prefill_tokens_computed(self) -> int:
        """Prompt tokens the model actually ran: prompt length minus prefix-cache hits, summed."""
        return sum(m.num_prompt_tokens - m.num_cached_tokens for m in self.metrics.values())


def replay(engine, arrivals: list[Arrival], device=None, label: str = "") -> ServingTrace:
    """Drive ``engine`` step by step, adding each request when its :class:`Arrival` condition holds.

    Every step is timed (``now(device)`` before and after, so GPU work is
    finished) and its chunks are recorded; the requests' own metrics
    (arrival, first token, each token's time) come from the engine.
    """
    pending = list(arrivals)
    seen_first: set[str] = set()
    metrics, token_ids, steps = {}, {}, []
    step = 0
    start = now(device)
    while pending or engine.has_unfinished_requests():
        ready = [a for a in pending if step >= a.at_step
                 and (a.after_first_token_of is None or a.after_first_token_of in seen_first)]
        for a in ready:
            pending.remove(a)
            metrics[a.request_id] = engine.add_request(a.request_id, a.prompt, a.params).metrics
            token_ids[a.request_id] = []
        if not engine.has_unfinished_requests():
            if not any(a.after_first_token_of is None or a.after_first_token_of in metrics for a in pending):
                raise ValueError("some arrivals wait for a request that never arrives: "
                                 + ", ".join(a.request_id for a in pending))
            step += 1  # nothing to run yet: let the clock of steps advance
            continue
        t0 = now(device)
        outs = engine.step()
        t1 = now(device)
        steps.append(StepRecord(t0, t1, [
            (c.seq.request_id, c.start, c.num_tokens, "prefill" if c.start < c.seq.num_prompt_tokens else "decode")
            for c in engine.last_schedule.chunks]))
        for out in outs:
            token_ids[out.request_id] = list(out.outputs[0].token_ids)
            seen_first.add(out.request_id)
        step += 1
    return ServingTrace(label, steps, metrics, token_ids, start, now(device))
