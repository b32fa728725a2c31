"""The prefix cache's CPU offload tier, off vs on: ``python -m minivllm.bench kv-offload`` (chapter 14).

The workload is the one LRU handles worst: ``num_prompts`` distinct system
prompts taken in turn, ``rounds`` times over, on a device pool that holds
only ``pool_prompts`` of them. Requests run one after the other (each arrives
when the previous one is done), so with the tier off every prompt has been
evicted before it comes back and is computed again; with the tier on its
blocks come back from host memory.
"""

from __future__ import annotations

import statistics
import time

import torch

from minivllm import LLM, SamplingParams
from minivllm.attention import MiniPagedKVCache
from minivllm.bench.cli import bench_parser, offline_env, positive_int
from minivllm.bench.trace import warm_up
from minivllm.bench.workloads import random_workload
from minivllm.block_manager import MiniBlockManager
from minivllm.config import cdiv, default_device
from minivllm.models import load_tokenizer
from minivllm.timing import median_time

__all__ = ["cycling_prompts", "run_cycling", "restore_seconds_per_block", "EagerOffloadBlockManager", "kv_offload_main"]


class EagerOffloadBlockManager(MiniBlockManager):
    """Offload when a block is full, not when it is evicted: vLLM's offloading connector stores every block that
    fills in a step (``_get_reqs_to_store``), whether or not the pool will ever evict it. minivllm's own block
    manager offloads lazily, at the eviction; this one is for measuring the two against each other (chapter 14).
    A block already in the tier is not copied again when it is evicted (the tier keeps it)."""

    def register_computed_blocks(self, seq) -> None:
        start = len(self.seq_links.get(seq.seq_id, []))
        super().register_computed_blocks(seq)
        if self.tier is None:
            return
        for i, (_, link) in enumerate(self.seq_links.get(seq.seq_id, [])[start:], start):
            if link is not None and link[0] == seq.block_table[i]:  # this sequence's block, cached now
                self._offload(link[0])


def cycling_prompts(tokenizer, num_prompts: int = 16, prefix_len: int = 512, rounds: int = 4,
                    suffix_len: tuple[int, int] = (8, 24), seed: int = 0) -> list[list[int]]:
    """``num_prompts`` system prompts of ``prefix_len`` random tokens, in turn ``rounds`` times, each with its own suffix."""
    systems, _ = random_workload(tokenizer, num_prompts, (prefix_len, prefix_len), (1, 1), seed)
    suffixes, _ = random_workload(tokenizer, num_prompts * rounds, suffix_len, (1, 1), seed + 1)
    return [systems[i % num_prompts] + s for i, s in enumerate(suffixes)]


def run_cycling(prompts: list[list[int]], model: str, num_blocks: int, kv_offload_blocks: int,
                output_tokens: int = 4, device=None, block_size: int = 16, block_manager_cls=None) -> dict:
    """One fresh engine runs the prompts one at a time: TTFTs, outputs, prefill tokens computed, final stats, and
    the seconds its steps spent in their copy phase (``swap``: offloads and restores; on a GPU the copies run on a
    side stream, so this is the time to launch them)."""
    extra = {"block_manager_cls": block_manager_cls} if block_manager_cls else {}
    llm = LLM(model, block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=True, max_num_seqs=1,
              kv_offload_blocks=kv_offload_blocks, device=str(device or default_device()), dtype="float32", **extra)
    warm_up(llm)
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    before = engine.stats()
    ttfts, outputs, copy_seconds = [], [], 0.0
    for i, prompt in enumerate(prompts):
        start, first = time.perf_counter(), None
        engine.add_request(f"r{i}", prompt, params)
        while engine.has_unfinished_requests():
            step_outputs = engine.step()
            copy_seconds += engine.last_step_phases.get("swap", 0.0)
            for out in step_outputs:
                first = first or time.perf_counter()
                if out.finished:
                    outputs.append(out.outputs[0].token_ids)
        ttfts.append(first - start)
    stats = engine.stats()
    computed = (stats.prefix_cache_queries - before.prefix_cache_queries) - \
        (stats.prefix_cache_hits - before.prefix_cache_hits)
    return {"ttfts": ttfts, "outputs": outputs, "computed": computed, "stats": stats, "copy_seconds": copy_seconds,
            "kv_bytes_per_block": engine.kv_bytes_per_block, "llm": llm}


def restore_seconds_per_block(llm: LLM, num_blocks: int = 32, repeats: int = 5) -> float:
    """Median time to copy ``num_blocks`` blocks from the host tier into the device pool, per block (a spare pool)."""
    model, bs = llm.engine.model, llm.engine.config.block_size
    cache = MiniPagedKVCache.for_model(model, num_blocks, bs, 0, num_offload_blocks=num_blocks)
    pairs = [(i, i) for i in range(num_blocks)]
    device = llm.engine.runner.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return median_time(lambda: (cache.restore(pairs), sync()), repeats=repeats) / num_blocks


def kv_offload_main(argv=None) -> int:
    """A CPU offload tier for the prefix cache, off vs on: prefill tokens computed, TTFT, restore vs recompute."""
    offline_env()
    parser = bench_parser("kv-offload", kv_offload_main.__doc__)
    parser.add_argument("--num-prompts", type=positive_int, default=16)
    parser.add_argument("--prefix-len", type=positive_int, default=512)
    parser.add_argument("--rounds", type=positive_int, default=4)
    parser.add_argument("--pool-prompts", type=positive_int, default=4, help="the device pool holds this many prompts")
    parser.add_argument("--output-tokens", type=positive_int, default=4)
    args = parser.parse_args(argv)
    bs, device = args.block_size, torch.device(args.device) if args.device else default_device()
    prompts = cycling_prompts(load_tokenizer(args.model), args.num_prompts, args.prefix_len, args.rounds, seed=args.seed)
    per_request = cdiv(max(map(len, prompts)) + args.output_tokens, bs)
    num_blocks, tier = args.pool_prompts * per_request, args.num_prompts * per_request
    print(f"workload: {args.num_prompts} system prompts of {args.prefix_len} tokens + 8-24 own tokens, in turn "
          f"{args.rounds} times ({len(prompts)} requests, one at a time), {args.output_tokens} output tokens, greedy; "
          f"device pool {num_blocks} blocks of {bs} (~{args.pool_prompts} prompts), tier {tier} blocks; "
          f"{args.model} float32 on {device} ({torch.get_num_threads()} CPU threads)", flush=True)
    runs = {name: run_cycling(prompts, args.model, num_blocks, blocks, args.output_tokens, device, bs)
            for name, blocks in (("off", 0), ("on", tier))}
    report(runs, restore_seconds_per_block(runs["on"]["llm"]), bs)
    return 0 if runs["on"]["outputs"] == runs["off"]["outputs"] else 1


def report(runs: dict, restore_s: float, block_size: int) -> None:
    """The table, the restore/recompute comparison and the acceptance targets."""
    print(f"\n{'tier':>5} {'computed':>9} {'mean TTFT':>10} {'p50 TTFT':>9} {'hit rate':>9} {'device hits':>12} "
          f"{'tier hits':>10} {'offloaded':>10} {'restored':>9} {'dropped':>8}")
    for name, r in runs.items():
        s = r["stats"]
        print(f"{name:>5} {r['computed']:9d} {statistics.mean(r['ttfts']):9.3f}s {statistics.median(r['ttfts']):8.3f}s "
              f"{s.prefix_cache_hit_rate:9.1%} {s.prefix_cache_device_hits:12d} {s.prefix_cache_tier_hits:10d} "
              f"{s.num_offloaded_blocks:10d} {s.num_restored_blocks:9d} {s.num_dropped_blocks:8d}")
    off, on = runs["off"], runs["on"]
    recompute_s = statistics.median(off["ttfts"]) / (off["computed"] / len(off["ttfts"]) / block_size)
    print(f"\nper block of {block_size} tokens: restore {1e3 * restore_s:.3f} ms (measured copy, median of 5), "
          f"recompute {1e3 * recompute_s:.3f} ms (median TTFT with the tier off / blocks computed per request): "
          f"restoring is {recompute_s / restore_s:.0f}x cheaper")
    print(f"greedy outputs identical with the tier off and on: {on['outputs'] == off['outputs']}")
    fewer = off["computed"] / on["computed"]
    faster = statistics.mean(off["ttfts"]) / statistics.mean(on["ttfts"])
    print(f"target: >= 3x fewer prefill tokens computed: {fewer:.2f}x -> {'met' if fewer >= 3 else 'MISSED'}")
    print(f"target: >= 2x lower mean TTFT: {faster:.2f}x -> {'met' if faster >= 2 else 'MISSED'}")
