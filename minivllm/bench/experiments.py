"""The benchmarks of issues 3-5 as command lines: throughput against HF, chunked prefill, prefix caching,
preemption (chapters 06, 08, 09, 10). ``python -m minivllm.bench [interference|shared-prefix|preemption]``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.bench.baselines import first_difference, hf_generate_one_at_a_time, hf_generate_static_batches
from minivllm.bench.metrics import percentile, tpot
from minivllm.bench.timing import now
from minivllm.bench.trace import ServingTrace, replay, warm_up
from minivllm.bench.workloads import (Arrival, _blocks_for, interference_arrivals, random_workload,
                                      shared_prefix_arrivals, squeezed_arrivals)


def main(argv=None) -> int:
    """Output tokens/s of minivllm against HF transformers ``generate``, measured in one run."""
    import argparse
    import os
    import statistics
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:  # python -m minivllm.bench interference | shared-prefix (issue 4)
        return SUBCOMMANDS[argv[0]](argv[1:])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="python -m minivllm.bench", description=main.__doc__,
                                     epilog="other benchmarks: " + ", ".join(
                                         f"python -m minivllm.bench {name} --help" for name in SUBCOMMANDS))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--skip-hf", action="store_true", help="time minivllm only (for sweeping engine settings)")
    parser.add_argument("--repeats", type=int, default=1, help="time minivllm and the HF static batches this many "
                        "times and report medians (HF one at a time runs once: it is the slow reference)")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from minivllm import LLM, SamplingParams
    from minivllm.config import default_device
    from minivllm.models import model_folder

    device = torch.device(args.device) if args.device else default_device()
    engine_opts = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       block_size=args.block_size, device=str(device), dtype="float32")
    llm = LLM(args.model, **engine_opts)
    prompts, outs = random_workload(llm.get_tokenizer(), args.num_requests, tuple(args.prompt_len),
                                    tuple(args.output_len), args.seed)
    total_out = sum(outs)
    print(f"workload: {len(prompts)} requests, prompt {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
          f"({sum(map(len, prompts))} in all), output {min(outs)}-{max(outs)} tokens ({total_out} in all), "
          f"seed {args.seed}; greedy, ignore_eos; {args.model} float32 on {device} "
          f"({torch.get_num_threads()} CPU threads)")
    rows = []

    def timed(name, fn, repeats=1):
        """Median seconds over ``repeats`` runs after an untimed warm-up."""
        fn(prompts[:1], [2])
        times = []
        for _ in range(repeats):
            start = now(device)
            result = fn(prompts, outs)
            times.append(now(device) - start)
        seconds = statistics.median(times)
        short = [i for i, (r, n) in enumerate(zip(result, outs)) if len(r) != n]
        if short:
            print(f"  warning: {name} returned a wrong number of tokens for requests {short}")
        got = sum(min(len(r), n) for r, n in zip(result, outs))
        rows.append((name, seconds, got / seconds))
        spread = f"  (median of {repeats}: {min(times):.2f}-{max(times):.2f} s)" if repeats > 1 else ""
        print(f"  {name:<60} {seconds:8.2f} s {got / seconds:10.1f} output tok/s{spread}", flush=True)
        return result

    def minivllm_generate(ps, ns):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in ns]
        return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]

    opts = ", ".join(f"{k}={v}" for k, v in engine_opts.items() if k not in ("device", "dtype"))
    ours = timed(f"minivllm LLM.generate ({opts})", minivllm_generate, args.repeats)
    if args.skip_hf:
        return 0

    hf = AutoModelForCausalLM.from_pretrained(model_folder(args.model), dtype=torch.float32).to(device).eval()

    def compare(name, a, b):
        diffs = [(i, first_difference(x, y)) for i, (x, y) in enumerate(zip(a, b)) if x != y]
        print(f"  {name}: {len(a) - len(diffs)}/{len(a)} requests token-identical" +
              ("" if not diffs else "; differ at (request, first token): " +
               ", ".join(f"({i}, {j})" for i, j in diffs)), flush=True)
        return diffs

    single = timed("HF generate, one request at a time", lambda ps, ns: hf_generate_one_at_a_time(hf, ps, ns))
    mismatches = compare("greedy check, minivllm vs HF one at a time", ours, single)
    for i, j in mismatches:  # a greedy divergence is a bug unless the two choices were (numerically) tied
        if j is not None and j < min(len(ours[i]), len(single[i])):
            with torch.inference_mode():
                ids = torch.tensor([list(prompts[i]) + single[i][:j]], device=device)
                logits = hf(ids).logits[0, -1].float()
            gap = abs(float(logits[single[i][j]] - logits[ours[i][j]]))
            print(f"    request {i}, token {j}: HF picks {single[i][j]}, minivllm {ours[i][j]}; HF's own logits "
                  f"for the two differ by {gap:.1e} ({'a near-tie: fp32 rounding' if gap < 1e-3 else 'NOT a tie'})")
    bs = args.hf_batch_size
    batched = timed(f"HF generate, static batches of {bs} (left-padded)",
                    lambda ps, ns: hf_generate_static_batches(hf, ps, ns, bs), args.repeats)
    compare(f"for reference, HF batches of {bs} vs HF one at a time", batched, single)

    mini_tps = rows[0][2]
    print(f"\nminivllm / HF one at a time:        {mini_tps / rows[1][2]:6.2f}x")
    print(f"minivllm / HF static batches of {bs}: {mini_tps / rows[2][2]:6.2f}x")
    return 1 if mismatches else 0


def interference_summary(trace: ServingTrace) -> dict[str, float]:
    """What chunked prefill changes: the streams' longest and p99 gaps, the long prompt's TTFT, throughput."""
    streams = [rid for rid in trace.metrics if rid.startswith("stream-")]
    gaps = trace.gaps(streams)
    return {"max_gap": max(gaps), "p99_gap": percentile(gaps, 99), "median_gap": percentile(gaps, 50),
            "long_ttft": trace.ttft("long"), "throughput": trace.throughput}


def _bench_parser(prog: str, description: str):
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m minivllm.bench {prog}", description=description)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=1, help="run every setting this many times, round robin; "
                                                                "report the median of each figure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    return parser


def _replay_settings(args, arrivals, device, settings: dict, max_num_seqs: int) -> dict:
    """``{key: (label, engine options)}`` -> ``{key: [ServingTrace per repeat]}``: a fresh, warmed-up engine per run,
    the settings taken round robin ``args.repeats`` times, all on a pool that holds every request."""
    from minivllm import LLM

    num_blocks = _blocks_for(arrivals, args.block_size) + 8
    traces: dict = {key: [] for key in settings}
    for _ in range(args.repeats):
        for key, (label, opts) in settings.items():
            llm = LLM(args.model, block_size=args.block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, device=str(device), dtype="float32",
                      **opts)
            warm_up(llm)
            traces[key].append(replay(llm.engine, arrivals, device, label=label))
            del llm
    return traces


def _same_outputs(traces) -> bool:
    first = traces[0].token_ids
    return all(t.token_ids == first for t in traces[1:])


def interference_main(argv=None) -> int:
    """Streams stall while a long prompt prefills; chunked prefill bounds the stall (chapter 09, issue 4)."""
    import os
    import statistics

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = _bench_parser("interference", interference_main.__doc__)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[0, 64, 128, 256, 512, 1024],
                        help="max_prefill_chunk_size values; 0 = chunked prefill off")
    parser.add_argument("--num-streams", type=int, default=8)
    parser.add_argument("--stream-prompt-len", type=int, default=16)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--long-prompt-len", type=int, default=1500)
    parser.add_argument("--long-tokens", type=int, default=16)
    parser.add_argument("--arrive-at-step", type=int, default=4)
    args = parser.parse_args(argv)

    from minivllm.config import default_device
    from minivllm.models import load_tokenizer

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


def shared_prefix_main(argv=None) -> int:
    """Requests sharing a system prompt, prefix caching off vs on: prefill tokens computed and TTFT (chapter 08, issue 4)."""
    import os
    import statistics

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = _bench_parser("shared-prefix", shared_prefix_main.__doc__)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, nargs=2, default=(16, 48), metavar=("MIN", "MAX"))
    parser.add_argument("--output-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    from minivllm.config import default_device
    from minivllm.models import load_tokenizer

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


PREEMPTION_SETTINGS = {  # name -> engine options on the squeezed pool (the roomy run gets a pool that fits all)
    "recompute": dict(preemption_mode="recompute"),
    "swap": dict(preemption_mode="swap"),
    "admission": dict(preemption_mode="recompute", admission_watermark=0.25),
}


def preemption_summary(trace: ServingTrace, stats) -> dict:
    """One row of chapter 10's table: completion time, TTFT, TPOT and what preemption cost."""
    import statistics

    ttfts = [m.ttft for m in trace.metrics.values()]
    tpots = [x for x in (tpot(m) for m in trace.metrics.values()) if x is not None]
    return {"completion_s": trace.seconds, "mean_ttft_s": statistics.mean(ttfts), "max_ttft_s": max(ttfts),
            "mean_tpot_s": statistics.mean(tpots), "max_tpot_s": max(tpots), "steps": len(trace.steps),
            "preemptions": stats.num_preemptions, "recomputed_tokens": stats.num_recomputed_tokens,
            "swapped_bytes": stats.num_swapped_bytes}


def run_preemption_settings(model: str, arrivals: list[Arrival], squeezed_blocks: int, settings=None,
                            block_size: int = 4, device=None, max_num_seqs: int | None = None,
                            max_num_batched_tokens: int = 2048) -> tuple[dict, dict]:
    """Replay ``arrivals`` once with a roomy pool and once per setting on ``squeezed_blocks`` blocks.

    Returns ``(rows, traces)`` keyed by setting name (``"roomy"`` first); each row
    is :func:`preemption_summary` plus ``same_as_roomy`` (greedy outputs equal).
    """
    from minivllm import LLM

    settings = PREEMPTION_SETTINGS if settings is None else settings
    device = str(device) if device is not None else None
    max_num_seqs = max_num_seqs or len(arrivals)
    rows, traces = {}, {}
    for name, opts in {"roomy": {}, **settings}.items():
        blocks = _blocks_for(arrivals, block_size) + 8 if name == "roomy" else squeezed_blocks
        llm = LLM(model, block_size=block_size, num_blocks=blocks, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, device=device, **opts)
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


@dataclass
class SimTrace:
    """What :func:`simulate_schedule` saw: per step the chunks ``(request id, start, n)`` and the preempted ids."""

    steps: list[list[tuple[str, int, int]]]
    preempted: list[list[str]]
    seqs: dict  # request id -> Sequence
    finished_step: dict[str, int]  # request id -> step in which it got its last token
    scheduler: object

    def num_preemptions(self, request_id: str) -> int:
        return self.seqs[request_id].metrics.num_preemptions

    def timeline(self) -> list[list[tuple[str, str]]]:
        """Per step ``(request id, kind)`` for :func:`minivllm.viz.plot_batch_timeline`; kind "recompute" for KV
        computed again after a preemption (prompt and earlier outputs), "preempted" the step it was evicted."""
        out = []
        for chunks, pre in zip(self.steps, self.preempted):
            row = []
            for rid, start, n in chunks:
                s = self.seqs[rid]
                kind = "decode" if n == 1 and start >= s.num_prompt_tokens else "prefill"
                if s.metrics.num_preemptions and kind == "prefill" and rid in self._evicted_before(len(out)):
                    kind = "recompute"
                row.append((rid, kind))
            row += [(rid, "preempted") for rid in pre if rid not in {r for r, _ in row}]
            out.append(row)
        return out

    def _evicted_before(self, t: int) -> set[str]:
        return {rid for pre in self.preempted[:t] for rid in pre}


def sim_sequence(request_id: str, prompt_len: int, max_tokens: int, priority: int = 0, arrival: float = 0.0,
                 first_token: int = 1):
    """A request for :func:`simulate_schedule`: ``prompt_len`` distinct token ids, exactly ``max_tokens`` outputs."""
    from minivllm.sampling_params import SamplingParams
    from minivllm.sequence import Sequence

    return Sequence(request_id, list(range(first_token, first_token + prompt_len)),
                    SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                    priority=priority, arrival_time=arrival)


def simulate_schedule(arrivals, num_blocks: int, block_size: int = 4, max_steps: int = 10_000, token: int = 5,
                      stop=None, scheduler_cls=None, **config) -> SimTrace:
    """Drive the real :class:`~minivllm.scheduler.Scheduler` and ``BlockManager`` with a fake model (chapter 10).

    ``arrivals`` is a list of sequences (all arrive at step 0) or a function
    ``step -> list of sequences`` arriving before that step is scheduled. Every
    sampling chunk "samples" ``token``. Runs until nothing is left (or
    ``stop(trace)`` is true, or ``max_steps``); checks the block invariants each step.
    Pure Python, no tensors: thousands of steps per second.
    """
    from minivllm.block_manager import BlockManager
    from minivllm.config import EngineConfig
    from minivllm.scheduler import Scheduler

    cfg = EngineConfig(model="tiny-random", block_size=block_size, num_blocks=num_blocks, **config)
    cpu = (num_blocks if cfg.num_cpu_blocks is None else cfg.num_cpu_blocks) if cfg.preemption_mode == "swap" else 0
    bm = BlockManager(num_blocks, block_size, cfg.enable_prefix_caching, cpu)
    sched = (scheduler_cls or Scheduler)(cfg, bm, max_model_len=1_000_000)
    arrive = arrivals if callable(arrivals) else (lambda t, first=list(arrivals): first if t == 0 else [])
    trace = SimTrace([], [], {}, {}, sched)
    for t in range(max_steps):
        for s in arrive(t):
            trace.seqs[s.request_id] = s
            sched.add(s)
        if not sched.has_unfinished() and not callable(arrivals):
            break
        out = sched.schedule()
        sched.update(out, [token] * sum(c.samples for c in out.chunks))
        bm.check_invariants(sched.sequences)
        trace.steps.append([(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks])
        trace.preempted.append([s.request_id for s in out.preempted])
        for c in out.chunks:
            if c.seq.is_finished and c.seq.request_id not in trace.finished_step:
                trace.finished_step[c.seq.request_id] = t
        if stop is not None and stop(trace):
            break
    return trace


def measure_preemption_costs(model, block_size: int = 16, num_blocks: int = 64, recompute_tokens: int = 256,
                             device=None) -> dict:
    """Measured price of each mode on this machine: recompute seconds per token, KV copy GB/s (chapter 10).

    On a GPU also the real engine swap path: ``num_blocks`` KV blocks out to the
    pinned CPU pool and back, timed with CUDA events, and pinned vs pageable
    bandwidth of a buffer of the same size.
    """
    from minivllm.attention import PagedKVCache
    from minivllm.preemption import measure_copy_gbps, measure_recompute_seconds_per_token

    device = torch.device(device) if device is not None else next(model.parameters()).device
    per_token = PagedKVCache.bytes_per_token(model)
    nbytes = per_token * block_size * num_blocks
    result = {"kv_bytes_per_token": per_token, "copy_bytes": nbytes,
              "recompute_s_per_token": measure_recompute_seconds_per_token(model, recompute_tokens)}
    if device.type == "cuda":
        result["pinned_gbps"] = measure_copy_gbps(nbytes, device, pinned=True)
        result["pageable_gbps"] = measure_copy_gbps(nbytes, device, pinned=False)
        cache = PagedKVCache.for_model(model, num_blocks, block_size, num_cpu_blocks=num_blocks)
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
    """Recompute vs swap vs admission on a squeezed KV pool, and each mode's measured cost (chapter 10, issue 5)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = _bench_parser("preemption", preemption_main.__doc__)
    parser.set_defaults(block_size=4)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(24, 48), metavar=("MIN", "MAX"))
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="squeezed pool / total KV demand")
    parser.add_argument("--watermark", type=float, default=0.25, help="admission_watermark of the admission run")
    parser.add_argument("--copy-blocks", type=int, default=256, help="KV blocks per measured copy")
    args = parser.parse_args(argv)

    from minivllm.config import default_device
    from minivllm.models import load_model
    from minivllm.preemption import preemption_accounting

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
    longest = max(-(-(len(a.prompt) + a.params.max_tokens) // args.block_size) for a in arrivals)
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


SUBCOMMANDS = {"interference": interference_main, "shared-prefix": shared_prefix_main, "preemption": preemption_main}
