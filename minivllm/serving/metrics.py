"""The server's Prometheus metrics, with vLLM's names (chapter 13).

Gauges and counters follow the engine's ``stats()`` after every step; the
latency histograms (TTFT, inter-token latency, end-to-end) are fed from each
request's token times as its outputs go by. prometheus-client adds ``_total``
to counters, as it does for vLLM's. One registry per server, so several can
live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minivllm.outputs import EngineStats, RequestOutput

__all__ = ["ServerMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
# engine counter (EngineStats field) -> (metric name, help); the engine's are cumulative, Prometheus counts deltas
COUNTERS = {"prefix_cache_queries": ("vllm:prefix_cache_queries", "Prefix-cache lookups, in tokens."),
            "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens."),
            "num_preemptions": ("vllm:num_preemptions", "Preemptions of running sequences.")}
# with speculative decoding (chapter 17): vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py), and
# minivllm's count of decode rows and the tokens they emitted (accepted drafts plus the model's own)
SPEC_COUNTERS = {
    "spec_decode_num_drafts": ("vllm:spec_decode_num_drafts", "Decode rows verified with drafts."),
    "spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    "spec_decode_num_decode_steps": ("minivllm:spec_decode_num_decode_steps", "Decode rows, drafted or not."),
    "spec_decode_num_emitted_tokens": ("minivllm:spec_decode_num_emitted_tokens",
                                       "Tokens emitted by decode rows: accepted drafts and the model's own."),
}


class ServerMetrics:
    """vLLM's serving metrics for one model, plus minivllm's KV block counts."""

    def __init__(self, model_name: str, speculative: bool = False):
        self.registry = r = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": r}

        def gauge(name, doc):
            return Gauge(name, doc, **label).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, buckets=buckets, **label).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Sequences running (prefilling or decoding).")
        self.waiting = gauge("vllm:num_requests_waiting", "Sequences waiting to be admitted.")
        self.swapped = gauge("vllm:num_requests_swapped", "Sequences swapped out to the CPU pool.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent of the blocks.")
        self.used_blocks = gauge("minivllm:kv_cache_used_blocks", "KV blocks held by requests.")
        self.total_blocks = gauge("minivllm:kv_cache_total_blocks", "KV blocks in the pool.")
        counters = {**COUNTERS, **(SPEC_COUNTERS if speculative else {})}
        self.counters = {f: Counter(name, doc, **label).labels(model_name) for f, (name, doc) in counters.items()}
        self.spec_gauges = {
            "spec_decode_acceptance_rate": gauge("minivllm:spec_decode_acceptance_rate",
                                                 "Accepted draft tokens per draft token, since the start."),
            "spec_decode_mean_tokens_per_step": gauge("minivllm:spec_decode_mean_tokens_per_step",
                                                      "Tokens a decoding sequence gains per step, since the start."),
        } if speculative else {}
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", **label
                                     ).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", **label).labels(model_name)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self.aborted = Counter("minivllm:requests_aborted", "Requests aborted before they finished (a client "
                               "disconnected, or the server shut down).", **label).labels(model_name)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Gaps between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to the last token.", E2E_BUCKETS)
        self.model_name = model_name
        self._last: dict[str, int] = dict.fromkeys(counters, 0)
        self._seen: dict[str, int] = {}  # request id -> token times already observed

    def record(self, outputs: list[RequestOutput], stats: EngineStats | None) -> None:
        """After a step: this step's outputs into the histograms, the engine's stats (if any) into gauges and
        counters."""
        for out in outputs:
            self._observe(out)
        if stats is None:
            return
        self.running.set(stats.num_running + stats.num_prefilling)
        self.waiting.set(stats.num_waiting)
        self.swapped.set(stats.num_swapped)
        self.kv_usage.set(stats.kv_utilization)
        self.used_blocks.set(stats.num_used_blocks)
        self.total_blocks.set(stats.num_total_blocks)
        for field, counter in self.counters.items():
            value = getattr(stats, field)
            counter.inc(max(0, value - self._last[field]))
            self._last[field] = value
        for field, g in self.spec_gauges.items():
            g.set(getattr(stats, field))

    def _observe(self, out: RequestOutput) -> None:
        m = out.metrics
        seen = self._seen.get(out.request_id, 0)
        times = m.token_times
        if seen == 0 and times:
            self.ttft.observe(times[0] - m.arrival_time)
        for a, b in zip(times[max(0, seen - 1):], times[max(1, seen):]):
            self.itl.observe(b - a)
        self._seen[out.request_id] = len(times)
        self.generation_tokens.inc(sum(len(c.delta_token_ids) for c in out.outputs))
        if out.finished:
            del self._seen[out.request_id]
            if times:
                self.e2e.observe(times[-1] - m.arrival_time)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.success.labels(self.model_name, out.outputs[0].finish_reason).inc()

    def forget(self, request_id: str) -> None:
        """An aborted request: count it and drop its bookkeeping."""
        self._seen.pop(request_id, None)
        self.aborted.inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
