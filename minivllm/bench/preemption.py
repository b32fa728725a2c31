"""Recompute vs swap vs admission control on a squeezed KV pool, and what each costs on this machine:
``python -m minivllm.bench preemption`` (chapter 10)."""

from __future__ import annotations

import statistics

import torch

from minivllm import LLM
from minivllm.attention import ContiguousKVCache, MiniPagedKVCache, PagedKVCache
from minivllm.bench.cli import (add_min_max, bench_parser, check_token_budget, offline_env, positive_int, probability,
                                watermark_fraction)
from minivllm.bench.metrics import tpot
from minivllm.bench.trace import ServingTrace, replay, warm_up
from minivllm.bench.workloads import Arrival, _blocks_for, squeezed_arrivals
from minivllm.config import cdiv, default_device
from minivllm.models import load_model
from minivllm.preemption import preemption_accounting
from minivllm.timing import Timer, median_time

__all__ = ["measure_recompute_seconds_per_token", "measure_copy_gbps", "PREEMPTION_SETTINGS", "preemption_summary", "run_preemption_settings", "format_preemption_table",
           "measure_preemption_costs", "preemption_main"]


@torch.inference_mode()
def measure_recompute_seconds_per_token(model, num_tokens: int = 256, repeats: int = 3) -> float:
    """Median time to prefill ``num_tokens`` tokens again (into a fresh contiguous cache), per token."""
    device = model.lm_head.weight.device
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    ids, pos = ids.to(device), torch.arange(num_tokens, device=device)
    prefill = lambda: model.forward(ids, pos, ContiguousKVCache.for_model(model, num_tokens))  # noqa: E731
    return median_time(prefill, device, repeats=repeats, warmup=1) / num_tokens


def measure_copy_gbps(nbytes: int = 64 << 20, device=None, pinned: bool = True, repeats: int = 5) -> dict:
    """Bandwidth of copying KV-sized buffers between the device pool and host memory, both ways.

    On a GPU it uses CUDA events (the GPU's own clock, through ``Timer``) and
    pinned or pageable host memory; on the CPU the "device" is host memory too,
    so this is a memcpy and ``pinned`` has no meaning.
    """
    device = torch.device(device or default_device())
    n = nbytes // 4
    src = torch.randn(n, device=device)
    host = torch.empty(n, pin_memory=pinned and device.type == "cuda")
    result = {}
    for name, (dst, source) in {"to_cpu": (host, src), "to_device": (src, host)}.items():
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            with Timer(device) as timer:
                dst.copy_(source, non_blocking=True)
            times.append(timer.seconds)
        result[name] = nbytes / statistics.median(times[1:]) / 1e9
    return result


PREEMPTION_SETTINGS = {  # name -> engine options on the squeezed pool (the roomy run gets a pool that fits all)
    "recompute": dict(preemption_mode="recompute"),
    "swap": dict(preemption_mode="swap"),
    "admission": dict(preemption_mode="recompute", admission_watermark=0.25),
}


def preemption_summary(trace: ServingTrace, stats) -> dict:
    """One row of chapter 10's table: completion time, TTFT, TPOT and what preemption cost."""
    ttfts = [m.ttft for m in trace.metrics.values()]
    tpots = [x for x in (tpot(m) for m in trace.metrics.values()) if x is not None]
    return {"completion_s": trace.seconds, "mean_ttft_s": statistics.mean(ttfts), "max_ttft_s": max(ttfts),
            "mean_tpot_s": statistics.mean(tpots), "max_tpot_s": max(tpots), "steps": len(trace.steps),
            "preemptions": stats.num_preemptions, "recomputed_tokens": stats.num_recomputed_tokens,
            "swapped_bytes": stats.num_swapped_bytes}


def run_preemption_settings(model: str, arrivals: list[Arrival], squeezed_blocks: int, settings=None,
                            block_size: int = 4, device=None, max_num_seqs: int | None = None,
                            max_num_batched_tokens: int = 2048, dtype: str = "auto") -> tuple[dict, dict]:
    """Replay ``arrivals`` once with a roomy pool and once per setting on ``squeezed_blocks`` blocks.

    Returns ``(rows, traces)`` keyed by setting name (``"roomy"`` first); each row
    is :func:`preemption_summary` plus ``same_as_roomy`` (greedy outputs equal).
    """
    settings = PREEMPTION_SETTINGS if settings is None else settings
    device = str(device) if device is not None else None
    max_num_seqs = max_num_seqs or len(arrivals)
    rows, traces = {}, {}
    for name, opts in {"roomy": {}, **settings}.items():
        blocks = _blocks_for(arrivals, block_size) + 8 if name == "roomy" else squeezed_blocks
        llm = LLM(model, block_size=block_size, num_blocks=blocks, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, device=device, dtype=dtype, **opts)
        warm_up(llm)
        before = llm.engine.stats()
        trace = replay(llm.engine, arrivals, llm.engine.runner.device, label=name)
        after = llm.engine.stats()
        for f in ("num_preemptions", "num_recomputed_tokens", "num_swapped_bytes"):  # leave out the warm-up
            setattr(after, f, getattr(after, f) - getattr(before, f))
        traces[name] = trace
        rows[name] = {**preemption_summary(trace, after), "num_blocks": blocks,
                      "same_as_roomy": trace.token_ids == traces["roomy"].token_ids}
        del llm
    return rows, traces


def format_preemption_table(rows: dict) -> str:
    head = (f"{'setting':>10} {'blocks':>6} {'time s':>7} {'mean TTFT':>10} {'max TTFT':>9} {'mean TPOT':>10} "
            f"{'steps':>5} {'preempt':>7} {'recomputed':>10} {'swapped MB':>10} {'same':>5}")
    lines = [head]
    for name, r in rows.items():
        lines.append(f"{name:>10} {r['num_blocks']:6d} {r['completion_s']:7.2f} {r['mean_ttft_s']:9.3f}s "
                     f"{r['max_ttft_s']:8.3f}s {r['mean_tpot_s'] * 1e3:8.1f}ms {r['steps']:5d} {r['preemptions']:7d} "
                     f"{r['recomputed_tokens']:10d} {r['swapped_bytes'] / 1e6:10.2f} {str(r['same_as_roomy']):>5}")
    return "\n".join(lines)


def measure_preemption_costs(model, block_size: int = 16, num_blocks: int = 64, recompute_tokens: int = 256,
                             device=None) -> dict:
    """Measured price of each mode on this machine: recompute seconds per token, KV copy GB/s (chapter 10).

    On a GPU also the real engine swap path: ``num_blocks`` KV blocks out to the
    pinned CPU pool and back, timed with CUDA events, and pinned vs pageable
    bandwidth of a buffer of the same size.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    per_token = PagedKVCache.bytes_per_token(model)
    nbytes = per_token * block_size * num_blocks
    result = {"kv_bytes_per_token": per_token, "copy_bytes": nbytes,
              "recompute_s_per_token": measure_recompute_seconds_per_token(model, recompute_tokens)}
    if device.type == "cuda":
        result["pinned_gbps"] = measure_copy_gbps(nbytes, device, pinned=True)
        result["pageable_gbps"] = measure_copy_gbps(nbytes, device, pinned=False)
        cache = MiniPagedKVCache.for_model(model, num_blocks, block_size, num_cpu_blocks=num_blocks)
        pairs = [(i, i) for i in range(num_blocks)]
        times = []
        for _ in range(4):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            cache.swap(pairs, to_cpu=True)
            cache.swap(pairs, to_cpu=False)
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        result["engine_swap_roundtrip_s"] = sorted(times[1:])[1]
        del cache
    else:
        result["memcpy_gbps"] = measure_copy_gbps(nbytes, device, pinned=False)
    return result


def preemption_main(argv=None) -> int:
    """Recompute vs swap vs admission on a squeezed KV pool, and each mode's measured cost (chapter 10)."""
    offline_env()
    parser = bench_parser("preemption", preemption_main.__doc__)
    parser.set_defaults(block_size=4)
    parser.add_argument("--num-requests", type=positive_int, default=8)
    add_min_max(parser, "--prompt-len", default=(24, 48))
    parser.add_argument("--output-tokens", type=positive_int, default=32)
    parser.add_argument("--pool-fraction", type=probability, default=0.25, help="squeezed pool / total KV demand")
    parser.add_argument("--watermark", type=watermark_fraction, default=0.25,
                        help="admission_watermark of the admission run")
    parser.add_argument("--copy-blocks", type=positive_int, default=256, help="KV blocks per measured copy")
    args = parser.parse_args(argv)
    check_token_budget(parser, args.max_num_batched_tokens, args.num_requests, "--num-requests sequences",
                       args.prompt_len[1], "--prompt-len MAX")

    device = torch.device(args.device) if args.device else default_device()
    model, tokenizer = load_model(args.model, device, torch.float32)
    print(f"{args.model} float32 on {device} ({torch.get_num_threads()} CPU threads)")
    ref = preemption_accounting(7, 4, 512 * 1024, 24)
    print(f"reference accounting, 7 cached tokens, block 4, 512 KiB/token, 24 GB/s: {ref.released_blocks} blocks, "
          f"{ref.recompute_tokens} tokens to recompute, {ref.swap_bytes / 2**20:.1f} MiB, "
          f"{ref.swap_roundtrip_ms:.3f} ms round trip")

    costs = measure_preemption_costs(model, args.block_size, args.copy_blocks, device=device)
    per_token, nbytes = costs["kv_bytes_per_token"], costs["copy_bytes"]
    print(f"\nmeasured on this machine ({args.copy_blocks} blocks of {args.block_size} tokens = "
          f"{nbytes / 2**20:.1f} MiB of KV, {per_token} B/token):")
    print(f"  recompute: {costs['recompute_s_per_token'] * 1e3:.3f} ms per token (prefill of 256 tokens)")
    tokens = args.copy_blocks * args.block_size
    bw = {k: v for k, v in costs.items() if k.endswith("_gbps")}
    for name, gbps in bw.items():
        roundtrip_gbps = 2 / (1 / gbps["to_cpu"] + 1 / gbps["to_device"])
        f = preemption_accounting(tokens, args.block_size, per_token, roundtrip_gbps)
        print(f"  {name[:-5]:>9} copy: to CPU {gbps['to_cpu']:.2f} GB/s, back {gbps['to_device']:.2f} GB/s -> "
              f"formula round trip {f.swap_roundtrip_ms:.3f} ms vs recompute {tokens * costs['recompute_s_per_token'] * 1e3:.1f} ms")
    if "engine_swap_roundtrip_s" in costs:
        print(f"  engine PagedKVCache.swap out+in, CUDA events: {costs['engine_swap_roundtrip_s'] * 1e3:.3f} ms "
              f"({2 * nbytes / costs['engine_swap_roundtrip_s'] / 1e9:.2f} GB/s effective)")
    else:
        print("  (no GPU: 'device' and swap pool are both host memory, so this is a memcpy; pinned vs pageable "
              "and CUDA events need a GPU)")

    arrivals = squeezed_arrivals(tokenizer, args.num_requests, args.prompt_len, args.output_tokens, args.seed)
    demand = _blocks_for(arrivals, args.block_size)
    longest = max(cdiv(len(a.prompt) + a.params.max_tokens, args.block_size) for a in arrivals)
    squeezed = max(int(demand * args.pool_fraction), longest)
    settings = dict(PREEMPTION_SETTINGS)
    settings["admission"] = dict(settings["admission"], admission_watermark=args.watermark)
    del model
    print(f"\nworkload: {args.num_requests} requests at once, prompts {args.prompt_len[0]}-{args.prompt_len[1]} "
          f"tokens, {args.output_tokens} output tokens each (greedy); KV demand {demand} blocks of {args.block_size}, "
          f"squeezed pool {squeezed} blocks ({squeezed / demand:.0%}); admission = recompute + "
          f"admission_watermark={args.watermark}", flush=True)
    rows, _ = run_preemption_settings(args.model, arrivals, squeezed, settings, args.block_size, device,
                                      max_num_batched_tokens=args.max_num_batched_tokens)
    print(format_preemption_table(rows))
    same = all(r["same_as_roomy"] for r in rows.values())
    print(f"\ngreedy outputs identical to the roomy run in every setting: {same}")
    return 0 if same else 1
