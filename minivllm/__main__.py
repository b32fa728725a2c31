"""Command line: ``python -m minivllm generate "prompt"``, ``bench --workload NAME`` and ``serve``.

``generate`` streams a chat reply from the embedded model (chapter 07);
``bench`` runs one of chapter 11's workloads through minivllm, and on an
offline workload through HF transformers too, and prints vLLM-style metrics
(with ``--server URL``, through a running OpenAI-compatible server, chapter 13);
``serve`` runs the OpenAI-compatible server (chapter 13).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, replace

import torch

from minivllm import LLM, SamplingParams
from minivllm.bench import (WORKLOAD_PURPOSES, WORKLOADS, speculative_main, structured_main, check_workload_sizes, format_results,
                            make_workload, measure_machine,
                            roofline, run_contiguous, run_engine, run_hf_generate, run_hf_generate_batch, run_naive,
                            run_static, same_outputs, step_breakdown)
from minivllm.bench.cli import (add_chunked_prefill_flag, add_kernel_flags, kernel_options, add_min_max, block_size_int,
                                check_token_budget, chunked_prefill_options, device_name, nonneg_finite_float,
                                nonneg_int, positive_finite_float, positive_int, probability, server_url, top_k_int,
                                unicode_text, writable_file)
from minivllm.bench.online import BACKENDS, run_online, served_model
from minivllm.bench.peers import (ALIASES, COMPARE_PEERS, PeerMissing, batch1_tpot, peer_installed, peer_table,
                                  run_peer)
from minivllm.config import cdiv, default_device
from minivllm.cpu_malloc import keep_freed_memory, malloc_in_force
from minivllm.models import load_model, load_tokenizer, model_folder
from minivllm.models.linear import QUANTIZED_MAX_ROWS
from minivllm.serving.cli import add_serve_arguments, check_model, serve_main
from minivllm.serving.protocol import param_of
from minivllm.simple_generation import chat_prompt_ids


GENERATE_FLAGS = {"max_tokens": "--max-tokens", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
                  "temperature": "--temperature", "tensor_parallel_size": "--tensor-parallel-size", "prompt": "prompt"}


def _refuse(parser, error: ValueError) -> None:
    """An engine's ``ValueError`` as a usage error naming the flag of the field it names (``param_of``)."""
    parser.error(f"argument {GENERATE_FLAGS.get(param_of(str(error), {}), '--model')}: {error}")


def _generate(args, parser) -> int:
    """Check what needs no model (the sampling flags, the model's config), load it, check the rest, stream."""
    if args.raw and not args.prompt:
        parser.error("argument prompt: must not be empty with --raw (there is no chat template to fill it)")
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed)
    except ValueError as e:
        _refuse(parser, e)
    check_model(parser, args.model)
    try:
        llm = LLM(args.model, device=args.device, tensor_parallel_size=args.tensor_parallel_size)
    except ValueError as e:
        _refuse(parser, e)
    with llm:  # stops the tensor-parallel workers, if any (chapter 15)
        tokenizer = llm.get_tokenizer()
        prompt = args.prompt if args.raw else chat_prompt_ids(tokenizer, args.prompt, args.system)
        try:  # what only the model knows: --max-tokens against its context, --top-k against its vocabulary
            llm.engine.validate_request("generate", prompt, params)
        except ValueError as e:
            _refuse(parser, e)
        for text in llm.stream(prompt, params):
            print(text, end="", flush=True)
        print()
    return 0


COMPARISONS = ("hf-batch", "hf-static", "hf-single", "static", "contiguous", "naive")
PEER_COMPARISONS = ("vllm", "vllm-eager", "vllm-compiled", "llamacpp", "llamacpp-q4_1")  # the real engines (bench/peers)


def comparison_list(text: str) -> list[str]:
    """``--compare`` items, space or comma separated (``vllm,llamacpp``); ``vllm`` means both of its modes."""
    names = [n for n in text.split(",") if n]
    allowed = COMPARISONS + PEER_COMPARISONS + ("none",)
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"must be among {', '.join(allowed)}, got {text!r}")
    return [m for n in names for m in (ALIASES.get(n, (n,)))]


SIZE_FLAGS = ("num_requests", "prompt_len", "output_len", "rate")  # bench flags that override a workload's size


def _slo(args) -> dict | None:
    return {k: v / 1e3 for k, v in (("ttft", args.slo_ttft), ("tpot", args.slo_tpot)) if v is not None} or None


def _bench_server(args, workload, tokenizer, model: str) -> int:
    """The workload through a running server's OpenAI API (chapter 13)."""
    print(f"workload {workload.name}: {workload.description}; greedy, exact output lengths, seed {args.seed}")
    print(f"server {args.server} ({args.backend}, {model}), streaming /v1/completions", flush=True)
    run = run_online(args.server, workload, tokenizer, backend=args.backend, model=model, progress=not args.quiet)
    failed = [e for e in run.errors if e]
    metrics = run.metrics(_slo(args))
    print()
    print(metrics.table())
    if failed:
        print(f"\n{len(failed)} of {len(run.requests)} requests failed, e.g. {failed[0]}")
    if args.json:
        report = {"workload": {"name": workload.name, "description": workload.description, "seed": args.seed,
                               "num_requests": len(workload.arrivals)}, "server": args.server,
                  "backend": args.backend, "failed": len(failed), **metrics.as_dict()}
        write_json_atomically(args.json, report)
        print(f"wrote {args.json}")
    return 0 if not failed else 1


def _baselines(args, workload, device, compare: list[str], model, loaded: dict):
    """Each requested baseline run on the same workload, yielded as it finishes (the HF model loaded once into
    ``loaded``, only when one needs it)."""
    progress = not args.quiet
    for name in compare:
        if name in COMPARE_PEERS:
            continue  # the real engines run apart (_peers)
        print(f"running {name} ...", file=sys.stderr, flush=True)
        if name.startswith("hf") and "hf" not in loaded:
            from transformers import AutoModelForCausalLM  # optional and heavy: only the HF baselines need it
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            hf = AutoModelForCausalLM.from_pretrained(model_folder(args.model), dtype=getattr(torch, args.dtype))
            loaded["hf"] = hf.to(device).eval()
        hf = loaded.get("hf")
        yield {"hf-batch": lambda: run_hf_generate_batch(hf, workload, progress=progress),
               "hf-static": lambda: run_hf_generate(hf, workload, args.hf_batch_size, progress=progress),
               "hf-single": lambda: run_hf_generate(hf, workload, 1, progress=progress),
               "static": lambda: run_static(model, workload, args.hf_batch_size, progress=progress),
               "contiguous": lambda: run_contiguous(model, workload, progress=progress),
               "naive": lambda: run_naive(model, workload, progress=progress)}[name]()


def _peers(workload, keys: list[str], model: str, progress: bool = True):
    """Each named peer engine on the workload in its own environment, yielded as ``(key, PeerRun)`` when it
    finishes; one that is missing or fails is skipped with a line that says why."""
    for key in keys:
        print(f"running {key} in its own environment ...", file=sys.stderr, flush=True)
        try:
            yield key, run_peer(key, workload, model, progress=progress)
        except PeerMissing as e:
            print(e, flush=True)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"{key}: skipped, it failed: {e}", flush=True)


def _engine_options(args, device) -> dict:
    opts = dict(block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=args.prefix_caching, device=str(device), dtype=args.dtype)
    if args.max_num_seqs:
        opts["max_num_seqs"] = args.max_num_seqs
    opts.update(chunked_prefill_options(args.chunked_prefill))
    if args.tensor_parallel_size > 1:
        opts["tensor_parallel_size"] = args.tensor_parallel_size
    if args.kv_offload_blocks:
        opts["kv_offload_blocks"] = args.kv_offload_blocks
    if args.no_fused_decode:
        opts["fused_decode"] = False
    return opts | kernel_options(args)


def _batch1_tpot(model: str, opts: dict, workload) -> float:
    """minivllm's batch-1 TPOT on the workload's first prompt, with the engine options of its run."""
    return batch1_tpot(LLM(model, **opts), workload.prompts[0])


def _print_report(args, workload, results, slo, limits, bound) -> None:
    ours = results[0]
    print()
    print(format_results(results, ours, slo, bound["seconds"] if bound else None))
    print(f"\nminivllm, {workload.name}:")
    print(ours.metrics(slo).table())
    used = [s.kv_utilization for s in ours.steps]
    waste = [s.wasted_slots / max(1, s.used_blocks * s.block_size) for s in ours.steps if s.used_blocks]
    print(f"KV pool: {ours.steps[0].total_blocks} blocks of {args.block_size}; in use mean {sum(used) / len(used):.0%}, "
          f"peak {max(used):.0%}; slots in partly filled blocks {100 * sum(waste) / max(1, len(waste)):.1f}% of used; "
          f"preemptions {ours.stats.num_preemptions}; {len(ours.steps)} steps")
    print(f"attention: {ours.stats.attention_kernel}; kernels: {ours.stats.kernels}; decode: {ours.stats.decode_path}"
          + (f"; weights: {ours.stats.quantization} ({ours.stats.gguf_dot})" if ours.stats.quantization else ""))
    if limits:
        print(f"machine: {limits}")
        print(f"roofline for this workload: {bound['seconds']:.2f} s ({bound['prefill_s']:.2f} s prefill, "
              f"{bound['decode_s']:.2f} s decode) = {bound['throughput']:.1f} output tok/s; "
              f"minivllm reaches {bound['seconds'] / ours.seconds:.0%}")
    for r in results[1:]:
        print(f"minivllm / {r.name}: {ours.throughput / r.throughput:.2f}x "
              f"(greedy outputs identical for {same_outputs(ours, r)}/{len(r.token_ids)} requests)")


def _decode_breakdown(args, device) -> dict:
    """Phases of a decode step at batch sizes 1, 2, 4, ... up to ``--breakdown`` (chapter 12)."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= args.breakdown]
    llm = LLM(args.model, device=str(device), dtype=args.dtype, block_size=args.block_size, max_num_seqs=max(sizes),
              num_blocks=max(sizes) * cdiv(64 + 16, args.block_size) + 8)
    breakdown = step_breakdown(llm, sizes, prompt_len=64, steps=5)
    print("\none decode step, by phase (ms, medians of 5; prompts of 64 tokens):")
    print(f"{'B':>3} {'step':>8} {'per token':>9} {'forward':>8} {'sample':>7} {'python':>7} {'python %':>8}")
    for b, row in breakdown.items():
        print(f"{b:3d} {1e3 * row['total']:8.2f} {1e3 * row['total'] / b:9.2f} {1e3 * row['forward']:8.2f} "
              f"{1e3 * row['sample']:7.2f} {1e3 * row['python']:7.2f} {row['python'] / row['total']:8.1%}")
    return breakdown


def write_json_atomically(path: str, report: dict) -> None:
    """``report`` into ``path`` whole or not at all: a temporary file beside it, then renamed over it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(report, f, indent=2)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_json(args, workload, device, opts, results, slo, limits, bound, breakdown, ratios,
                complete: bool = True, quiet: bool = False) -> None:
    """The report in ``--json``: every system finished so far (each one's median run), and with ``complete``
    the roofline and the breakdown too. Written again as each system finishes, so a stopped run keeps them."""
    ours = results[0]
    report = {"complete": complete,
              "workload": {"name": workload.name, "description": workload.description, "seed": args.seed,
                           "num_requests": len(workload.arrivals)},
              "model": args.model, "device": str(device), "engine_options": opts,
              "results": [{"name": r.name, "seconds": r.seconds, "output_tokens": r.output_tokens,
                           "output_throughput": r.throughput, "ratio_minivllm": ours.throughput / r.throughput,
                           "same_outputs_as_minivllm": same_outputs(ours, r), **r.metrics(slo).as_dict()}
                          for r in results],
              "kv_utilization": [s.kv_utilization for s in ours.steps],
              "machine": None if not limits else {"flops": limits.flops, "bandwidth": limits.bandwidth},
              "roofline": bound, "step_breakdown": breakdown, "repeats": args.repeats,
              "ratio_minivllm_by_round": ratios}
    write_json_atomically(args.json, report)
    if not quiet:
        print(f"wrote {args.json}")


def _bench(args, parser) -> int:
    """``bench``: a workload through minivllm (or a server), the baselines, the roofline (chapters 11 and 12)."""
    device = torch.device(args.device) if args.device else default_device()
    sizes = {k: getattr(args, k) for k in SIZE_FLAGS if getattr(args, k) is not None}
    if args.server:  # before any work: is a server there?
        try:
            model = served_model(args.server)
        except ConnectionError as e:
            print(f"python -m minivllm bench: error: {e}", file=sys.stderr)
            return 1
    check_model(parser, args.model)
    tokenizer = load_tokenizer(args.model)
    workload = make_workload(args.workload, tokenizer, seed=args.seed, **sizes)
    if args.server:
        if args.repeats > 1:
            parser.error(f"argument --repeats: must be 1 with --server (one run through the server), got {args.repeats}")
        return _bench_server(args, workload, tokenizer, model)
    if args.kv_offload_blocks and not args.prefix_caching:
        parser.error("argument --kv-offload-blocks: needs --prefix-caching (the tier extends the prefix cache)")
    max_num_seqs = args.max_num_seqs or max(16, len(workload.arrivals))  # run_engine's default
    check_token_budget(parser, args.max_num_batched_tokens, max_num_seqs,
                       "--max-num-seqs, by default every request of the workload and at least 16",
                       None if args.chunked_prefill else max(map(len, workload.prompts)),
                       "the workload's longest prompt; or use --chunked-prefill")
    compare = COMPARISONS[:2] if args.compare is None and workload.is_offline else (args.compare or [])
    compare = [c for c in compare if c != "none"]
    if compare and not workload.is_offline:
        parser.error(f"argument --compare: needs an offline workload; {workload.name!r} has arrivals over time")
    model, _ = load_model(args.model, device, getattr(torch, args.dtype), **kernel_options(args))
    print(f"workload {workload.name}: {workload.description}; greedy, ignore_eos, seed {args.seed}")
    print(f"model {args.model} {args.dtype} on {device}" + (f" ({torch.get_num_threads()} CPU threads)"
                                                       if device.type == "cpu" else ""), flush=True)
    if device.type == "cpu":  # chapter 12: every engine of this process allocates so, the in-process baselines too
        keep_freed_memory()
        print(f"allocator: {malloc_in_force()}", flush=True)
    if model.lm_head.packed is not None:  # chapter 12: the layout rule (PLAIN_MATMUL_MAX_ROWS), never a timing
        print(f"matmuls: the row-major weights up to {model.plain_max_rows} rows, oneDNN's packed ones above",
              flush=True)
    print(f"kernels: {model.kernels}" + (f"; decode rows read the GGUF's blocks as stored (up to "
                                         f"{QUANTIZED_MAX_ROWS} rows), activations {model.gguf_dot}"
                                         if model.quantization else ""), flush=True)
    opts = _engine_options(args, device)
    peers = [c for c in compare if c in COMPARE_PEERS]
    installed = any(peer_installed(COMPARE_PEERS[key][0]) for key in peers)
    rounds, loaded, slo = [], {}, _slo(args)

    def finished() -> None:  # one more system done: the JSON so far, written whole
        if args.json:
            _write_json(args, workload, device, opts, median_runs(rounds)[0], slo, None, None, None,
                        round_ratios(rounds), complete=False, quiet=True)

    try:
        for _ in range(args.repeats):  # round robin: a drift in the machine's speed falls on every system alike
            rounds.append(r := Round([], None, {}))
            r.results.append(run_engine(workload, args.model, progress=not args.quiet, **opts))
            finished()
            for result in _baselines(args, workload, device, compare, model, loaded):
                r.results.append(result)
                finished()
            r.our_tpot = _batch1_tpot(args.model, opts, workload) if installed else None  # after ours, as the peers do
            for key, run in _peers(workload, peers, args.model, progress=not args.quiet):
                r.peer_runs[key] = run
                r.results.append(run.result)
                finished()
    except KeyboardInterrupt:
        return _stopped(args, rounds)
    results, our_tpot, peer_runs = median_runs(rounds)
    limits = measure_machine(model) if args.roofline else None
    bound = roofline(model, workload, limits) if limits else None
    _print_report(args, workload, results, slo, limits, bound)
    if peer_runs:
        print("\n" + peer_table(results[0], our_tpot, peer_runs))
    ratios = round_ratios(rounds)
    if args.repeats > 1:
        print(f"\nround by round ({args.repeats} rounds, each minivllm then every other system; the tables above "
              f"show each system's median run): minivllm's tok/s over the other's in the same round")
        for name, values in ratios.items():
            print(f"minivllm / {name}: " + ", ".join(f"{x:.2f}x" for x in values)
                  + f"; median {statistics.median(values):.2f}x")
    breakdown = _decode_breakdown(args, device) if args.breakdown else None
    if args.json:
        _write_json(args, workload, device, opts, results, slo, limits, bound, breakdown, ratios)
    return 0


def _stopped(args, rounds: list) -> int:
    """Ctrl-C during ``bench``'s runs: what finished (each system's median run so far), where it was written; 130."""
    rounds = [r for r in rounds if r.results]
    print("\nstopped (Ctrl-C)" + ("; nothing finished" if not rounds else "; what finished:"), file=sys.stderr)
    for r in median_runs(rounds)[0] if rounds else []:
        print(f"  {r.name[:60]}: {r.seconds:.2f} s, {r.throughput:.1f} output tok/s", file=sys.stderr)
    if rounds:
        if args.json:
            print(f"{args.json} holds these (\"complete\": false)", file=sys.stderr)
    sys.stderr.flush()
    return 130


@dataclass
class Round:
    """One round of ``bench --repeats``: minivllm's run first, then every other system's, and the batch-1 TPOTs."""

    results: list  # BenchResult, minivllm's first
    our_tpot: float | None
    peer_runs: dict  # key -> PeerRun


def median_runs(rounds: list[Round]) -> tuple[list, float | None, dict]:
    """Each system's run with the median output throughput over ``rounds`` (the lower middle of an even count),
    minivllm's first; minivllm's median batch-1 TPOT; each peer's median run, with its median batch-1 TPOT. A
    system missing from a round (a peer that failed there) is taken from the rounds it ran in."""
    def middle(runs, throughput_of):
        return sorted(runs, key=throughput_of)[(len(runs) - 1) // 2]

    by_name, by_peer = {}, {}
    for r in rounds:
        for result in r.results:
            by_name.setdefault(result.name, []).append(result)
        for key, run in r.peer_runs.items():
            by_peer.setdefault(key, []).append(run)
    results = [middle(runs, lambda x: x.throughput) for runs in by_name.values()]
    tpots = [r.our_tpot for r in rounds if r.our_tpot is not None]
    peers = {key: replace(middle(runs, lambda x: x.result.throughput),
                          batch1_tpot=statistics.median(run.batch1_tpot for run in runs)) for key, runs in by_peer.items()}
    return results, (statistics.median(tpots) if tpots else None), peers


def round_ratios(rounds: list[Round]) -> dict[str, list[float]]:
    """minivllm's output throughput over each other system's, round by round (the rounds that system ran in)."""
    ratios = {}
    for r in rounds:
        ours = r.results[0]
        for other in r.results[1:]:
            ratios.setdefault(other.name, []).append(ours.throughput / other.throughput)
    return ratios


def _experiment_argv(args) -> list[str]:
    """``bench --workload speculative`` (or ``structured``)'s flags for :func:`minivllm.bench.speculative_main` (or
    ``structured_main``): --num-requests sets one batch size, --output-len MIN MAX the output tokens (MAX)."""
    argv = ["--model", args.model, "--seed", str(args.seed), "--block-size", str(args.block_size),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    argv += ["--device", args.device] if args.device else []
    argv += ["--batch-sizes", str(args.num_requests)] if args.num_requests else []
    argv += ["--output-tokens", str(args.output_len[1])] if args.output_len else []
    return argv


def _workloads_help() -> str:
    """``bench --help``'s list of the workloads: what each measures, and its default sizes as the flags that change
    them (read from the workload's own signature)."""
    def flag(p) -> str:
        values = p.default if isinstance(p.default, tuple) else (p.default,)
        return f"--{p.name.replace('_', '-')} " + " ".join(f"{v:g}" for v in values)

    lines = ["workloads (--workload), with their default sizes: the flags below size a run down"]
    for name, make in WORKLOADS.items():
        sizes = ", ".join(flag(p) for p in inspect.signature(make).parameters.values() if p.name in SIZE_FLAGS)
        lines += [f"  {name:16} {WORKLOAD_PURPOSES[name]}",
                  f"  {'':16} {sizes or f'fixed sizes here (python -m minivllm.bench {name} --help)'}"]
    lines += [f"  {'speculative':16} prompt lookup off and on, on repetitive and open chat prompts (chapter 17)",
              f"  {'':16} --num-requests N (one batch size; default 1, 4 and 16), "
              "--output-len MIN MAX (MAX tokens; 64)",
              f"  {'structured':16} a JSON-schema constraint off and on (masks filled after or during the forward): "
              "validity, TPOT, fill, apply and forward apart, the grammar's share (chapter 19)",
              f"  {'':16} --num-requests N (one batch size; default 1 and 16), --output-len MIN MAX (MAX tokens; 64)",
              "A short run: --num-requests 4 --output-len 16 16 --compare none --no-roofline (no baselines, no "
              "measuring the machine)."]
    return "\n".join(lines)


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="python -m minivllm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a reply from the model", description=(
                       "Stream a chat reply to PROMPT from the model (the chat template is applied unless --raw)."))
    g.add_argument("prompt", type=unicode_text)
    g.add_argument("--model", default="smollm2-135m", help="smollm2-135m (embedded), tiny-random, an HF repo id or folder")
    g.add_argument("--system", type=unicode_text, default=None, help="a system message")
    g.add_argument("--raw", action="store_true", help="send the prompt as it is, without the chat template")
    g.add_argument("--max-tokens", type=positive_int, default=128)
    g.add_argument("--temperature", type=nonneg_finite_float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=probability, default=1.0)
    g.add_argument("--top-k", type=top_k_int, default=-1, help="-1 or 0 = off")
    g.add_argument("--seed", type=nonneg_int, default=None)
    g.add_argument("--device", type=device_name, default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="split the model over this many worker processes (chapter 15; default: 1)")

    b = sub.add_parser("bench", help="run a benchmark workload and print the metrics",
                       description="Run a workload through minivllm (and, offline, through HF transformers) and "
                                   "print throughput, TTFT/TPOT/ITL/E2E percentiles, KV use and the roofline.",
                       epilog=_workloads_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--workload", required=True, choices=sorted([*WORKLOADS, "speculative", "structured"]))
    b.add_argument("--json", metavar="FILE", type=writable_file,
                   help="also write every figure to FILE as JSON, written anew (whole: a temporary file renamed) "
                        "as each system finishes, so a run stopped by Ctrl-C keeps what finished "
                        "(\"complete\": false until the end)")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--device", type=device_name, default=None, help="cpu or cuda (default: cuda when available)")
    b.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights and KV of minivllm and of every baseline (default: %(default)s, where greedy "
                        "outputs match HF exactly; bfloat16 is far faster on a CPU with AMX)")
    b.add_argument("--seed", type=nonneg_int, default=0)
    b.add_argument("--num-requests", type=positive_int, default=None,
                   help="override the workload's number of requests")
    add_min_max(b, "--prompt-len", default=None)
    add_min_max(b, "--output-len", default=None)
    b.add_argument("--rate", "--request-rate", dest="rate", type=positive_finite_float, default=None,
                   help="requests per second (online, shared-prefix)")
    b.add_argument("--server", metavar="URL", type=server_url, default=None,
                   help="send the workload to this OpenAI-compatible server (streaming), e.g. http://127.0.0.1:8000")
    b.add_argument("--backend", choices=sorted(BACKENDS), default="minivllm",
                   help="with --server: how the server is asked for exact output lengths (default: minivllm)")
    b.add_argument("--compare", nargs="+", type=comparison_list, default=None,
                   help=f"baselines on the same workload, space or comma separated, among {', '.join(COMPARISONS)}; "
                        f"the real engines {', '.join(PEER_COMPARISONS)} (each in its own environment: python -m "
                        "minivllm.bench peers setup); none (offline only; default hf-batch hf-static)")
    b.add_argument("--hf-batch-size", type=positive_int, default=16,
                   help="static batch size of the hf-static/static baselines")
    b.add_argument("--block-size", type=block_size_int, default=16)
    b.add_argument("--max-num-seqs", type=positive_int, default=None, help="default: every request of the workload")
    b.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    add_chunked_prefill_flag(b)
    b.add_argument("--prefix-caching", action="store_true")
    b.add_argument("--kv-offload-blocks", type=nonneg_int, default=0, metavar="BLOCKS",
                   help="a CPU tier of this many blocks for the prefix cache (chapter 14; needs --prefix-caching)")
    b.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="run minivllm over this many worker processes (chapter 15; default: 1)")
    add_kernel_flags(b)
    b.add_argument("--no-fused-decode", action="store_true",
                   help="call every op of a few-row decode step from Python (EngineConfig.fused_decode=False; "
                        "default: the C++ table runs the step's layers in one native call, chapter 18)")
    b.add_argument("--slo-ttft", type=positive_finite_float, default=None, metavar="MS",
                   help="goodput: TTFT limit in ms")
    b.add_argument("--slo-tpot", type=positive_finite_float, default=None, metavar="MS",
                   help="goodput: TPOT limit in ms")
    b.add_argument("--no-roofline", dest="roofline", action="store_false", help="skip measuring the machine")
    b.add_argument("--breakdown", type=nonneg_int, default=0, metavar="MAX_B",
                   help="also time the phases of a decode step at batch sizes 1, 2, 4, ... up to MAX_B")
    b.add_argument("--repeats", type=positive_int, default=1,
                   help="run minivllm and every baseline this many times in turn (A B A B ...); the tables show "
                        "each system's median run, and the ratios are given round by round with their median")
    b.add_argument("--quiet", action="store_true",
                   help="no progress lines (on stderr: every system's tokens done, elapsed seconds)")
    s = sub.add_parser("serve", help="run the OpenAI-compatible server",
                       description="Serve the model over OpenAI's API (/v1/completions, /v1/chat/completions, "
                                   "/v1/models) plus /health, /tokenize, /detokenize and Prometheus /metrics.")
    add_serve_arguments(s)
    args = parser.parse_args(argv)
    if getattr(args, "compare", None) is not None:
        args.compare = [name for names in args.compare for name in names]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.command == "generate":
        return _generate(args, g)
    if args.command == "serve":
        return serve_main(args, s)
    if args.workload == "speculative":  # chapter 17's experiment (python -m minivllm.bench speculative) runs its own
        return speculative_main(_experiment_argv(args))
    if args.workload == "structured":  # chapter 19's experiment (python -m minivllm.bench structured) runs its own
        return structured_main(_experiment_argv(args))
    for size in SIZE_FLAGS:  # a size the workload does not have (argparse checked the ranges)
        if getattr(args, size) is not None:
            try:
                check_workload_sizes(args.workload, **{size: getattr(args, size)})
            except ValueError as e:
                b.error(f"argument --{size.replace('_', '-')}: {e}")
    if args.gguf_activations != "int8" and not args.quantization:
        b.error("argument --gguf-activations: only with --quantization gguf (it says what the GGUF's blocks multiply)")
    if args.server:
        if args.compare and args.compare != ["none"]:
            b.error("argument --compare: not with --server (the baselines run in this process)")
        if args.workload == "memory-pressure":
            b.error("argument --workload: memory-pressure squeezes the engine's own KV pool; a server has its own")
        if args.dtype != "float32":
            b.error("argument --dtype: not with --server (the server's own --dtype sets it)")
        if kernel_options(args) or args.no_fused_decode:
            b.error("argument --kernels/--quantization/--no-fused-decode: not with --server (the server's engine is "
                    "its own)")
    elif args.quantization and args.tensor_parallel_size > 1:
        b.error("argument --quantization: not with --tensor-parallel-size > 1 (the workers read float32 shards)")
    elif args.max_num_seqs:
        check_token_budget(b, args.max_num_batched_tokens, args.max_num_seqs, "--max-num-seqs")
    try:
        return _bench(args, b)
    except KeyboardInterrupt:  # before or after the runs (loading, the roofline): _bench handles the runs' own
        print("\nstopped (Ctrl-C)", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    code = main()
    # The interpreter's last collections would walk every object torch and transformers made (a second or more
    # on a loaded machine, after Ctrl-C too): frozen, they are left to the exit. atexit and finalizers still run.
    gc.freeze()
    raise SystemExit(code)
