"""Serving metrics with vLLM's definitions (``vllm bench serve``): TTFT, TPOT, ITL, E2E, percentiles,
throughput and goodput (chapter 11).

Every function takes any object with ``arrival_time`` and ``token_times`` (seconds; when each output
token appeared, the first included): ``minivllm.sequence.RequestMetrics`` or a synthetic ``RequestTimes``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

__all__ = ["RequestTimes", "ttft", "e2e", "itl", "tpot", "percentile", "Summary", "summarize",
           "goodput", "ServingMetrics", "serving_metrics"]


@dataclass
class RequestTimes:
    """A request known only by its times, for tests and for baselines outside the engine.

    Through a server (chapter 13) ``token_times`` are the arrivals of the stream's chunks, and a chunk may
    carry several tokens: ``num_output_tokens`` is then the server's count (its usage), as ``vllm bench serve``
    counts them. None: one token per entry of ``token_times``."""

    arrival_time: float
    token_times: list[float]
    num_prompt_tokens: int = 0
    num_output_tokens: int | None = None


def _num_output_tokens(r) -> int:
    n = getattr(r, "num_output_tokens", None)
    return len(r.token_times) if n is None else n


def _tokens(r) -> list[float]:
    if not r.token_times:
        raise ValueError("request has no output tokens: TTFT and E2E are undefined")
    return r.token_times


def _finished(r) -> bool:
    """Has tokens and, for engine metrics, a finish time (the engine leaves it None while running)."""
    return bool(r.token_times) and getattr(r, "finish_time", 0.0) is not None


def ttft(r) -> float:
    """Time to first token: queueing plus prefill, what a user waits before anything appears."""
    return _tokens(r)[0] - r.arrival_time


def e2e(r) -> float:
    """End-to-end latency: arrival to the last token, which is when the request finishes."""
    return _tokens(r)[-1] - r.arrival_time


def itl(r) -> list[float]:
    """Inter-token latencies: the gaps between consecutive tokens, each stall shows up as one gap."""
    t = r.token_times
    return [b - a for a, b in zip(t, t[1:])]


def tpot(r) -> float | None:
    """Time per output token after the first, (E2E - TTFT) / (n - 1): TTFT already counts the prefill.

    None with fewer than two tokens or while the engine has not finished the request."""
    t = r.token_times
    n = _num_output_tokens(r)
    if getattr(r, "finish_time", 0.0) is None or len(t) < 2 or n < 2:
        return None
    return (t[-1] - t[0]) / (n - 1)


def percentile(values, q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation, as ``numpy.percentile``."""
    return float(np.percentile(np.asarray(values, dtype=float), q))


@dataclass
class Summary:
    """Mean, percentiles and max of one metric over a run; NaN everywhere when there is no sample."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    count: int

    def scaled(self, k: float) -> Summary:
        """The same summary in other units, e.g. ``s.scaled(1e3)`` for milliseconds."""
        return Summary(*(k * v for v in (self.mean, self.p50, self.p90, self.p99, self.max)), self.count)


def summarize(values) -> Summary:
    """Summarise samples (seconds) the way vLLM reports them; an empty list gives NaNs, not an error."""
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        return Summary(math.nan, math.nan, math.nan, math.nan, math.nan, 0)
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return Summary(float(v.mean()), float(p50), float(p90), float(p99), float(v.max()), int(v.size))


def _check_duration(duration: float) -> None:
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")


def goodput(requests, duration: float, ttft_limit: float | None = None, tpot_limit: float | None = None,
            e2e_limit: float | None = None) -> float:
    """Finished requests per second that meet every given limit (seconds), vLLM's goodput.

    Throughput counts work done, goodput only work done in time; a one-token request has no TPOT and passes it."""
    _check_duration(duration)

    def good(r) -> bool:
        t = tpot(r)
        return ((ttft_limit is None or ttft(r) <= ttft_limit)
                and (tpot_limit is None or t is None or t <= tpot_limit)
                and (e2e_limit is None or e2e(r) <= e2e_limit))

    return sum(good(r) for r in requests if _finished(r)) / duration


@dataclass
class ServingMetrics:
    """What ``vllm bench serve`` reports for one run: counts, throughputs, latency summaries (seconds), goodput."""

    completed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2e: Summary
    goodput: float | None = None
    slo: dict | None = field(default=None, repr=False)

    _LATENCIES = ("ttft", "tpot", "itl", "e2e")

    def table(self) -> str:
        """A text table laid out like vLLM's summary, latencies in milliseconds."""
        rows = [("Successful requests:", self.completed), ("Benchmark duration (s):", self.duration),
                ("Total input tokens:", self.total_input_tokens),
                ("Total generated tokens:", self.total_output_tokens),
                ("Request throughput (req/s):", self.request_throughput)]
        if self.goodput is not None:
            rows.append(("Request goodput (req/s):", self.goodput))
        rows += [("Output token throughput (tok/s):", self.output_throughput),
                 ("Total token throughput (tok/s):", self.total_token_throughput)]
        for name in self._LATENCIES:
            s, n = getattr(self, name).scaled(1e3), name.upper()
            rows += [None, (f"Mean {n} (ms):", s.mean), (f"Median {n} (ms):", s.p50),
                     (f"P90 {n} (ms):", s.p90), (f"P99 {n} (ms):", s.p99)]
        return "\n".join("-" * 50 if row is None else
                         f"{row[0]:<40}{row[1]:>10}" if isinstance(row[1], int) else f"{row[0]:<40}{row[1]:>10.2f}"
                         for row in rows)

    __str__ = table

    def as_dict(self) -> dict:
        """Flat, JSON-safe dict with vLLM's key names (``mean_ttft_ms`` ...); NaN becomes None."""
        d = {k: v for k, v in asdict(self).items() if k not in self._LATENCIES}
        for name in self._LATENCIES:
            s = getattr(self, name).scaled(1e3)
            for stat, v in (("mean", s.mean), ("median", s.p50), ("p90", s.p90), ("p99", s.p99), ("max", s.max)):
                d[f"{stat}_{name}_ms"] = None if math.isnan(v) else v
        return d


def serving_metrics(requests, duration: float, slo: dict | None = None) -> ServingMetrics:
    """vLLM's benchmark numbers for ``requests`` served in ``duration`` seconds; unfinished ones are left out.

    ITL pools every gap of every request (each token weighs the same), TPOT is one value per request
    (each request weighs the same), so a single long stall moves them differently.
    ``slo``: limits in seconds under keys "ttft", "tpot", "e2e"; None reports no goodput."""
    _check_duration(duration)
    if slo is not None and not set(slo) <= {"ttft", "tpot", "e2e"}:
        raise ValueError(f"slo keys must be among 'ttft', 'tpot', 'e2e', got {sorted(slo)}")
    done = [r for r in requests if _finished(r)]
    n_in = sum(getattr(r, "num_prompt_tokens", 0) for r in done)
    n_out = sum(map(_num_output_tokens, done))
    return ServingMetrics(
        completed=len(done), duration=duration, total_input_tokens=n_in, total_output_tokens=n_out,
        request_throughput=len(done) / duration, output_throughput=n_out / duration,
        total_token_throughput=(n_in + n_out) / duration,
        ttft=summarize(ttft(r) for r in done),
        tpot=summarize(t for t in map(tpot, done) if t is not None),
        itl=summarize(g for r in done for g in itl(r)),
        e2e=summarize(e2e(r) for r in done),
        goodput=None if slo is None else goodput(done, duration, **{f"{k}_limit": v for k, v in slo.items()}),
        slo=None if slo is None else dict(slo))
