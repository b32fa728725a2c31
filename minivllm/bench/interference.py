"""Chunked prefill against a long prompt's stall: ``python -m minivllm.bench interference`` (chapter 09)."""

from __future__ import annotations

import statistics

import torch

from minivllm.bench.cli import (_replay_settings, _same_outputs, bench_parser, check_token_budget, nonneg_int,
                                offline_env, positive_int)
from minivllm.bench.metrics import percentile
from minivllm.bench.trace import ServingTrace
from minivllm.bench.workloads import interference_arrivals
from minivllm.config import default_device
from minivllm.models import load_tokenizer

__all__ = ["interference_summary", "interference_main"]


def interference_summary(trace: ServingTrace) -> dict[str, float]:
    """What chunked prefill changes: the streams' longest and p99 gaps, the long prompt's TTFT, throughput."""
    streams = [rid for rid in trace.metrics if rid.startswith("stream-")]
    gaps = trace.gaps(streams)
    return {"max_gap": max(gaps), "p99_gap": percentile(gaps, 99), "median_gap": percentile(gaps, 50),
            "long_ttft": trace.ttft("long"), "throughput": trace.throughput}


def interference_main(argv=None) -> int:
    """Streams stall while a long prompt prefills; chunked prefill bounds the stall (chapter 09)."""
    offline_env()
    parser = bench_parser("interference", interference_main.__doc__)
    parser.add_argument("--chunk-sizes", type=nonneg_int, nargs="+", default=[0, 64, 128, 256, 512, 1024],
                        help="max_prefill_chunk_size values; 0 = chunked prefill off")
    parser.add_argument("--num-streams", type=positive_int, default=8)
    parser.add_argument("--stream-prompt-len", type=positive_int, default=16)
    parser.add_argument("--stream-tokens", type=positive_int, default=64)
    parser.add_argument("--long-prompt-len", type=positive_int, default=1500)
    parser.add_argument("--long-tokens", type=positive_int, default=16)
    parser.add_argument("--arrive-at-step", type=nonneg_int, default=4)
    args = parser.parse_args(argv)
    check_token_budget(parser, args.max_num_batched_tokens, args.num_streams + 1, "--num-streams + 1 sequences",
                       max(args.long_prompt_len, args.stream_prompt_len) if 0 in args.chunk_sizes else None,
                       "the longest prompt, for --chunk-sizes 0")

    device = torch.device(args.device) if args.device else default_device()
    arrivals = interference_arrivals(load_tokenizer(args.model), args.num_streams, args.stream_prompt_len,
                                     args.stream_tokens, args.long_prompt_len, args.long_tokens,
                                     args.arrive_at_step, args.seed)
    print(f"workload: {args.num_streams} streams ({args.stream_prompt_len}-token prompts, {args.stream_tokens} "
          f"output tokens each), then a {args.long_prompt_len}-token prompt ({args.long_tokens} output tokens) "
          f"at step {args.arrive_at_step}; greedy, ignore_eos; {args.model} float32 on {device} "
          f"({torch.get_num_threads()} CPU threads), max_num_batched_tokens={args.max_num_batched_tokens}, "
          f"{args.repeats} repeat(s)", flush=True)
    traces = _replay_settings(args, arrivals, device, max_num_seqs=args.num_streams + 1, settings={
        chunk: (f"chunk {chunk or 'off'}", dict(enable_chunked_prefill=chunk > 0, max_prefill_chunk_size=max(chunk, 1)))
        for chunk in args.chunk_sizes})

    print(f"\n{'chunked prefill':>16} {'max gap':>9} {'p99 gap':>9} {'median gap':>11} {'long TTFT':>10} "
          f"{'output tok/s':>13} {'steps':>6}")
    summary = {}
    for chunk, runs in traces.items():
        s = {k: statistics.median(interference_summary(t)[k] for t in runs) for k in interference_summary(runs[0])}
        summary[chunk] = s
        name = "off" if chunk == 0 else f"chunk {chunk}"
        print(f"{name:>16} {s['max_gap']:8.3f}s {s['p99_gap']:8.3f}s {s['median_gap']:10.3f}s "
              f"{s['long_ttft']:9.3f}s {s['throughput']:13.1f} {len(runs[0].steps):6d}")

    print("\nwhere the time goes (first repeat): steps that carried prompt tokens vs decode-only steps")
    for chunk, runs in traces.items():
        t = runs[0]
        pre = [st.seconds for st in t.steps if st.prefill_tokens]
        dec = [st.seconds for st in t.steps if not st.prefill_tokens]
        print(f"  {'off' if chunk == 0 else f'chunk {chunk}':>10}: {sum(pre):6.2f} s in {len(pre):3d} prefill steps "
              f"(longest {max(pre, default=0):.3f} s), {sum(dec):6.2f} s in {len(dec):3d} decode-only steps "
              f"(median {statistics.median(dec) if dec else 0:.3f} s), total {t.seconds:.2f} s")

    same = _same_outputs([runs[0] for runs in traces.values()])
    print(f"\ngreedy outputs identical across settings: {same}")
    if 0 in summary and 256 in summary:
        off, c256 = summary[0], summary[256]
        cut = off["max_gap"] / c256["max_gap"]
        tput = c256["throughput"] / off["throughput"]
        print(f"target: chunk 256 cuts the longest gap >= 4x: {cut:.2f}x -> {'met' if cut >= 4 else 'MISSED'}")
        print(f"target: throughput within 10% of no chunking: {tput:.3f} -> "
              f"{'met' if abs(tput - 1) <= 0.10 else 'MISSED'}")
    return 0 if same else 1
