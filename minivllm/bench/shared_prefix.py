"""Prefix caching on requests that share a system prompt: ``python -m minivllm.bench shared-prefix`` (chapter 08)."""

from __future__ import annotations

import statistics

import torch

from minivllm.bench.cli import (_replay_settings, _same_outputs, add_min_max, bench_parser, check_token_budget,
                                offline_env, positive_int)
from minivllm.bench.metrics import percentile
from minivllm.bench.workloads import shared_prefix_arrivals
from minivllm.config import default_device
from minivllm.models import load_tokenizer

__all__ = ["shared_prefix_main"]


def shared_prefix_main(argv=None) -> int:
    """Requests sharing a system prompt, prefix caching off vs on: prefill tokens computed and TTFT (chapter 08)."""
    offline_env()
    parser = bench_parser("shared-prefix", shared_prefix_main.__doc__)
    parser.add_argument("--num-requests", type=positive_int, default=16)
    parser.add_argument("--prefix-len", type=positive_int, default=512)
    add_min_max(parser, "--suffix-len", default=(16, 48))
    parser.add_argument("--output-tokens", type=positive_int, default=16)
    args = parser.parse_args(argv)
    check_token_budget(parser, args.max_num_batched_tokens, args.num_requests, "--num-requests sequences",
                       args.prefix_len + args.suffix_len[1], "--prefix-len + --suffix-len MAX")

    device = torch.device(args.device) if args.device else default_device()
    arrivals = shared_prefix_arrivals(load_tokenizer(args.model), args.num_requests, args.prefix_len,
                                      args.suffix_len, args.output_tokens, args.seed)
    print(f"workload: {args.num_requests} requests = a shared {args.prefix_len}-token system prompt + their own "
          f"{args.suffix_len[0]}-{args.suffix_len[1]} tokens, {args.output_tokens} output tokens each; each arrives "
          f"when the previous one has its first token; greedy, ignore_eos; {args.model} float32 on {device} "
          f"({torch.get_num_threads()} CPU threads), {args.repeats} repeat(s)", flush=True)
    traces = _replay_settings(args, arrivals, device, max_num_seqs=args.num_requests, settings={
        caching: (f"prefix caching {caching}", dict(enable_prefix_caching=caching)) for caching in (False, True)})

    print(f"\n{'prefix caching':>15} {'prompt tokens':>14} {'computed':>9} {'mean TTFT':>10} {'p50 TTFT':>9} "
          f"{'max TTFT':>9} {'output tok/s':>13}")
    rows = {}
    for caching, runs in traces.items():
        t = runs[0]
        ttfts = [[r.ttft(rid) for rid in r.metrics] for r in runs]
        mean = statistics.median(statistics.mean(x) for x in ttfts)
        p50 = statistics.median(percentile(x, 50) for x in ttfts)
        worst = statistics.median(max(x) for x in ttfts)
        tput = statistics.median(r.throughput for r in runs)
        prompt = sum(m.num_prompt_tokens for m in t.metrics.values())
        rows[caching] = (t.prefill_tokens_computed, mean)
        print(f"{'on' if caching else 'off':>15} {prompt:14d} {t.prefill_tokens_computed:9d} {mean:9.3f}s "
              f"{p50:8.3f}s {worst:8.3f}s {tput:13.1f}")
    same = _same_outputs([runs[0] for runs in traces.values()])
    print(f"\ngreedy outputs identical with and without prefix caching: {same}")
    (off_tokens, off_ttft), (on_tokens, on_ttft) = rows[False], rows[True]
    fewer = 1 - on_tokens / off_tokens
    faster = off_ttft / on_ttft
    print(f"target: >= 80% fewer prefill tokens: {fewer:.1%} -> {'met' if fewer >= 0.8 else 'MISSED'}")
    print(f"target: >= 3x lower mean TTFT: {faster:.2f}x -> {'met' if faster >= 3 else 'MISSED'}")
    return 0 if same else 1
