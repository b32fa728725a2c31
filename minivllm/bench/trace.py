"""Serving traces: drive an engine step by step as requests arrive, and record every step (chapters 08-11)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from minivllm.bench.workloads import Arrival, _exactly, random_workload
from minivllm.timing import now

__all__ = ["StepRecord", "ServingTrace", "warm_up", "replay"]


@dataclass
class StepRecord:
    """One engine step: when it ran and what it computed, ``(request id, start, num_tokens, kind)`` per chunk."""

    start: float
    end: float
    chunks: list[tuple[str, int, int, str]]  # kind: "prefill" (prompt tokens) or "decode"
    used_blocks: int = 0  # KV blocks held after the step (chapter 11's utilisation curve)
    total_blocks: int = 0
    kv_tokens: int = 0  # tokens whose KV those blocks hold; the rest of their slots is partly-filled waste
    block_size: int = 1
    phases: dict = field(default_factory=dict)  # seconds per phase: schedule, prepare, forward, sample, ...
    sampled: int = 0  # output tokens this step produced

    @property
    def kv_utilization(self) -> float:
        """Share of the pool's blocks in use."""
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def wasted_slots(self) -> int:
        """Token slots in used blocks that hold no KV: the partly filled last blocks."""
        return self.used_blocks * self.block_size - self.kv_tokens

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


def warm_up(llm, seed: int = 12345) -> None:
    """One short untimed request whose tokens share no block with any workload (first forwards pay set-up costs).

    40 prompt tokens, fewer when the KV pool is squeezed smaller than that (chapter 10's preemption runs).
    """
    engine = llm.engine
    room = engine.stats().num_total_blocks * engine.config.block_size - 2
    (prompt,), _ = random_workload(llm.get_tokenizer(), 1, (max(1, min(40, room)),) * 2, (1, 1), seed)
    llm.generate([prompt], _exactly(2), use_tqdm=False)


def _kv_tokens(seqs, block_size: int) -> int:
    """Tokens whose KV the sequences' blocks hold, each shared (prefix-cached) block counted once."""
    filled: dict[int, int] = {}
    for s in seqs:
        for i, block in enumerate(s.block_table):
            n = min(block_size, max(0, s.cached_token_count - i * block_size))
            filled[block] = max(filled.get(block, 0), n)
    return sum(filled.values())


def replay(engine, arrivals: list[Arrival], device=None, label: str = "", on_step=None) -> ServingTrace:
    """Drive ``engine`` step by step, adding each request when its :class:`Arrival` condition holds.

    Every step is timed (``now(device)`` before and after, so GPU work is
    finished) and recorded with its chunks, the KV blocks in use and the
    engine's phase times; the requests' own metrics (arrival, first token,
    each token's time) come from the engine. When only wall-clock arrivals
    are left and the engine is idle, it sleeps until the next one.
    ``on_step(record)`` is called after each step (a progress bar).
    """
    pending = list(arrivals)
    seen_first: set[str] = set()
    metrics, token_ids, steps = {}, {}, []
    bm = engine.block_manager
    step = 0
    start = now(device)

    def due(a: Arrival) -> bool:
        return (step >= a.at_step and (a.after_first_token_of is None or a.after_first_token_of in seen_first)
                and (a.at_time is None or now() - start >= a.at_time))

    while pending or engine.has_unfinished_requests():
        for a in [a for a in pending if due(a)]:
            pending.remove(a)
            arrival = None if a.at_time is None else start + a.at_time
            metrics[a.request_id] = engine.add_request(a.request_id, a.prompt, a.params, arrival_time=arrival).metrics
            token_ids[a.request_id] = []
        if not engine.has_unfinished_requests():
            timed = [a.at_time for a in pending if a.at_time is not None]
            if timed and all(a.at_time is not None for a in pending if a.at_step <= step):
                time.sleep(max(0.0, start + min(timed) - now()))  # idle until the next request is sent
                continue
            if not any(a.after_first_token_of is None or a.after_first_token_of in metrics for a in pending):
                raise ValueError("some arrivals wait for a request that never arrives: "
                                 + ", ".join(a.request_id for a in pending))
            step += 1  # nothing to run yet: let the clock of steps advance
            continue
        t0 = now(device)
        outs = engine.step()
        t1 = now(device)
        live = [s for s in engine.scheduler.running if s.block_table]
        record = StepRecord(t0, t1, [
            (c.seq.request_id, c.start, c.num_tokens, "prefill" if c.start < c.seq.num_prompt_tokens else "decode")
            for c in engine.last_schedule.chunks],
            used_blocks=bm.num_blocks - bm.num_free_blocks, total_blocks=bm.num_blocks,
            kv_tokens=_kv_tokens(live, bm.block_size), block_size=bm.block_size,
            phases=dict(engine.last_step_phases), sampled=len(outs))
        steps.append(record)
        for out in outs:
            token_ids[out.request_id] = list(out.outputs[0].token_ids)
            seen_first.add(out.request_id)
        if on_step is not None:
            on_step(record)
        step += 1
    return ServingTrace(label, steps, metrics, token_ids, start, now(device))