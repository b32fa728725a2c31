"""Prefill/decode disaggregation against prefill interference: ``python -m minivllm.bench disaggregation`` (chapter 16).

Streams decode while long prompts arrive (wall-clock arrivals, not steps:
the disaggregated engine's two workers run at once). Three engines on the
same two cores: colocated without chunking, colocated with chunked prefill
(one process, both cores, two threads), and disaggregated (the prefill
worker pinned to core 0, the decode worker to core 1, one thread each). The
figures: the streams' inter-token latency (median and p99) and TTFT, the
long prompts' TTFT. DistServe's claim is that the third keeps decode's tail
ITL low under prefill interference; the table shows whether it holds here.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import replace

import torch

from minivllm.bench.cli import bench_parser, nonneg_int, offline_env, positive_int
from minivllm.bench.metrics import percentile
from minivllm.config import EngineConfig
from minivllm.disaggregation import DisaggregatedEngine
from minivllm.engine import LLMEngine
from minivllm.sampling_params import SamplingParams

__all__ = ["disaggregation_workload", "drive_wall_clock", "latency_summary", "run_disaggregation_setting",
           "DISAGGREGATION_SETTINGS", "disaggregation_main"]

DISAGGREGATION_SETTINGS = {
    "colocated": dict(enable_chunked_prefill=False),
    "colocated, chunked": dict(enable_chunked_prefill=True, max_prefill_chunk_size=64),
    "disaggregated": dict(disaggregated=True),
}


def disaggregation_workload(num_streams=4, stream_prompt_len=16, stream_tokens=40, num_long=3, long_prompt_len=384,
                            long_tokens=4, first_long_at=0.3, long_every=0.6, vocab=1000, seed=0) -> list[tuple]:
    """``(seconds after start, request id, prompt ids, params)``: streams at 0, long prompts every ``long_every`` s."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    streams = [(0.0, f"stream-{i}", ids(stream_prompt_len),
                SamplingParams(temperature=0.0, max_tokens=stream_tokens, ignore_eos=True)) for i in range(num_streams)]
    longs = [(first_long_at + i * long_every, f"long-{i}", ids(long_prompt_len),
              SamplingParams(temperature=0.0, max_tokens=long_tokens, ignore_eos=True)) for i in range(num_long)]
    return streams + longs


def drive_wall_clock(engine: LLMEngine, workload: list[tuple], timeout: float = 600.0) -> dict:
    """Add each request when its time comes, step until all finish; the final RequestOutput of each."""
    pending, done = sorted(workload, key=lambda w: w[0]), {}
    start = time.perf_counter()
    while len(done) < len(workload):
        now = time.perf_counter()
        if now - start > timeout:
            raise TimeoutError(f"the workload did not finish within {timeout} s")
        while pending and pending[0][0] <= now - start:
            at, rid, ids, params = pending.pop(0)
            engine.add_request(rid, ids, params, arrival_time=start + at)
        if not engine.has_unfinished_requests():
            time.sleep(min(0.005, max(0.0, pending[0][0] - (now - start))) if pending else 0.0)
            continue
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def latency_summary(outputs: dict) -> dict[str, float]:
    """Streams' inter-token gaps (median, p99, max) and TTFT; long prompts' TTFT (mean)."""
    streams = [o for rid, o in outputs.items() if rid.startswith("stream-")]
    longs = [o for rid, o in outputs.items() if rid.startswith("long-")]
    gaps = [b - a for o in streams for a, b in zip(o.metrics.token_times, o.metrics.token_times[1:])]
    return {"itl_median": percentile(gaps, 50), "itl_p99": percentile(gaps, 99), "itl_max": max(gaps),
            "stream_ttft": statistics.median(o.metrics.ttft for o in streams),
            "long_ttft": statistics.mean(o.metrics.ttft for o in longs),
            "failed": sum(o.outputs[0].finish_reason == "error" for o in outputs.values())}


def _engine(config: EngineConfig, cores: tuple[int, int]) -> LLMEngine:
    if config.disaggregated:
        return DisaggregatedEngine(config, cores=cores)
    return LLMEngine(config)


def run_disaggregation_setting(config: EngineConfig, workload: list[tuple], cores: tuple[int, int] = (0, 1)) -> dict:
    """One engine on ``cores`` (colocated: this process, both cores; disaggregated: a worker per core), warmed up."""
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    if not config.disaggregated:
        os.sched_setaffinity(0, set(cores))
        torch.set_num_threads(len(cores))
    engine = _engine(config, cores)
    try:
        drive_wall_clock(engine, [(0.0, "warm-up", w[2], replace(w[3], max_tokens=2)) for w in workload[-1:]])
        outputs = drive_wall_clock(engine, workload)
        tokens = {rid: o.outputs[0].token_ids for rid, o in outputs.items()}
        return {**latency_summary(outputs), "tokens": tokens}
    finally:
        engine.shutdown()
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def disaggregation_main(argv=None) -> int:
    """Decode ITL and TTFT under prefill interference: colocated, colocated with chunking, disaggregated (chapter 16)."""
    offline_env()
    parser = bench_parser("disaggregation", disaggregation_main.__doc__)
    parser.add_argument("--num-streams", type=positive_int, default=4)
    parser.add_argument("--stream-tokens", type=positive_int, default=40)
    parser.add_argument("--num-long", type=positive_int, default=3)
    parser.add_argument("--long-prompt-len", type=positive_int, default=384)
    parser.add_argument("--chunk-size", type=positive_int, default=64)
    parser.add_argument("--cores", type=nonneg_int, nargs=2, default=[0, 1])
    args = parser.parse_args(argv)
    workload = disaggregation_workload(args.num_streams, 16, args.stream_tokens, args.num_long, args.long_prompt_len,
                                       seed=args.seed)
    base = EngineConfig(model=args.model, block_size=args.block_size, num_blocks=512, device=args.device,
                        max_num_batched_tokens=max(args.max_num_batched_tokens, args.long_prompt_len))
    print(f"workload: {args.num_streams} streams x {args.stream_tokens} tokens, {args.num_long} prompts of "
          f"{args.long_prompt_len} tokens arriving while they decode; {args.model}, cores {args.cores}; "
          f"load average {os.getloadavg()[0]:.2f} (figures are under load); {args.repeats} repeat(s)", flush=True)
    runs = {name: [] for name in DISAGGREGATION_SETTINGS}
    for _ in range(args.repeats):
        for name, opts in DISAGGREGATION_SETTINGS.items():
            opts = {**opts, "max_prefill_chunk_size": args.chunk_size} if opts.get("enable_chunked_prefill") else opts
            runs[name].append(run_disaggregation_setting(replace(base, **opts), workload, tuple(args.cores)))
    print(f"\n{'setting':>20} {'ITL median':>11} {'ITL p99':>9} {'ITL max':>9} {'stream TTFT':>12} "
          f"{'long TTFT':>10} {'failed':>7}")
    for name, rs in runs.items():
        s = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "tokens"}
        print(f"{name:>20} {s['itl_median']:10.3f}s {s['itl_p99']:8.3f}s {s['itl_max']:8.3f}s "
              f"{s['stream_ttft']:11.3f}s {s['long_ttft']:9.3f}s {s['failed']:7.0f}")
    same = len({str(sorted(r["tokens"].items())) for rs in runs.values() for r in rs}) == 1
    print(f"\ngreedy outputs identical across settings: {same}; load average now {os.getloadavg()[0]:.2f}")
    return 0 if same else 1
