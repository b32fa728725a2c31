"""Latency against request rate through servers: ``python -m minivllm.bench serving`` (chapter 13).

One seeded online workload (the same prompt lengths, output lengths and
Poisson arrival pattern at every rate) is sent at each request rate to
minivllm's server and to ``transformers serve`` with continuous batching, the
same model files and the same client; the offline engine runs the top rate's
requests all at once. The prompt tokens are drawn afresh for every rate and
repeat (:func:`fresh_prompts`), the same for every system within one: a
server that caches prefixes (``transformers serve`` does) would otherwise
answer later rates from what earlier ones left in its cache. Both
servers stay up (an idle one costs no CPU) and take turns, rate by rate, so
figures that are compared were measured minutes apart; each setting is
repeated and reported as medians, with the machine's load average at the
time. ``--plot`` draws throughput and p99 TTFT against rate.

``--kernels`` and ``--quantization`` give minivllm's server and offline
engine another kernel table or the GGUF's weights as stored (chapter 18).

``--peers vllm,llamacpp`` (space or comma separated; default none) adds the
real engines' own OpenAI servers to the same round robin, each from its
virtual environment (:mod:`minivllm.bench.peers`; one not installed is skipped
with a line that says so): ``vllm`` is vLLM's
``vllm.entrypoints.openai.api_server`` compiled (``vllm-eager`` for
``--enforce-eager``; compiled was the faster offline, and it starts in about a
minute here), ``llamacpp`` is ``llama_cpp.server`` on the F32 GGUF, which
serves one request at a time: one lock around its model
(``get_llama_proxy`` in llama_cpp/server/app.py), so requests that overlap
queue. Each gets the settings its offline driver runs with
(:func:`~minivllm.bench.peers.peer_settings`, sized for the workload).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from minivllm.bench.cli import (add_chunked_prefill_flag, add_kernel_flags, kernel_options, add_min_max, bench_parser,
                                check_token_budget, chunked_prefill_options, offline_env, positive_finite_float,
                                positive_int, writable_file)
from minivllm.bench.harness import run_engine
from minivllm.bench.online import run_online, text_prompts
from minivllm.bench.peers import PeerMissing, peer_server
from minivllm.bench.server_process import ServerProcess, free_port
from minivllm.bench.workloads import Arrival, Workload, _exactly, make_workload, ordinary_token_ids
from minivllm.models import load_tokenizer, model_folder
from minivllm.timing import now

__all__ = ["fresh_prompts", "hf_serve_folder", "transformers_server", "warm", "served_workload", "offline_engine",
           "peer_list", "PEER_SYSTEMS", "peer_servers", "summarize_runs", "ratios", "serving_sweep_main"]

# --peers names: each peer's server as a system of the sweep, (its name in the table, the client backend)
PEER_SYSTEMS = {"vllm-compiled": ("vllm serve (compiled)", "vllm"), "vllm-eager": ("vllm serve (eager)", "vllm"),
                "llamacpp": ("llama_cpp.server", "llamacpp")}
PEER_ALIASES = {"vllm": "vllm-compiled"}  # compiled was faster offline; it starts in about a minute

FIGURES = ("output_throughput", "ttft_p50", "ttft_p99", "tpot_mean", "itl_p99", "e2e_p99", "goodput")


def hf_serve_folder(model: str) -> Path:
    """``model_folder(model)`` as ``transformers serve`` loads it: the same files (links), and a config.json
    naming the architecture (minivllm's converted SmolLM2 folder leaves it out; transformers serve needs it)."""
    source = model_folder(model)
    folder = Path(tempfile.mkdtemp(prefix="hf-serve-"))
    for f in source.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = config.get("architectures") or ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def transformers_server(folder: Path, flags: list[str]) -> ServerProcess:
    """``transformers serve FOLDER --continuous-batching`` on 127.0.0.1, float32 on the CPU like minivllm."""
    script = Path(sys.executable).parent / "transformers"
    command = [str(script)] if script.exists() else [shutil.which("transformers") or "transformers"]
    port = free_port()
    return ServerProcess(command + ["serve", str(folder), "--continuous-batching", "--host", "127.0.0.1", "--port",
                                    str(port), "--device", "cpu", "--dtype", "float32", "--log-level", "warning",
                                    *flags], port)


def warm(server: ServerProcess, tokenizer, backend: str) -> None:
    """Two short requests first: the first ones pay set-up costs (transformers builds its batching manager)."""
    w = make_workload("offline", tokenizer, num_requests=2, prompt_len=(16, 16), output_len=(4, 4), seed=999)
    run_online(server.url, w, tokenizer, backend=backend)


def peer_list(text: str) -> list[str]:
    """``--peers`` items, space or comma separated (``vllm,llamacpp``); ``vllm`` is vLLM compiled."""
    names = [n for n in text.split(",") if n]
    allowed = (*PEER_ALIASES, *PEER_SYSTEMS)
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"must be among {', '.join(allowed)}, got {text!r}")
    return [PEER_ALIASES.get(n, n) for n in names]


def served_workload(workload: Workload, tokenizer) -> Workload:
    """The same requests all at once, their prompts the text prompts tokenized again as a server does."""
    ids = [tokenizer(p)["input_ids"] for p in text_prompts(workload, tokenizer)]
    return Workload("offline", "the same requests, all at once",
                    [Arrival(a.request_id, p, _exactly(a.params.max_tokens)) for a, p in zip(workload.arrivals, ids)])


def offline_engine(workload: Workload, tokenizer, model: str, **engine_options):
    """The same requests (the text prompts tokenized as a server does) all at once through an in-process LLM."""
    return run_engine(served_workload(workload, tokenizer), model, name="offline engine", **engine_options)


def peer_servers(keys: list[str], plan: dict, tokenizer, model: str) -> dict:
    """Each named peer's server, not started, sized for the plan's longest workload as the server tokenizes it:
    {table name: (ServerProcess, client backend)}. One not installed is left out with a line that says so."""
    longest = max((served_workload(w, tokenizer) for w in plan.values()),
                  key=lambda w: (max(len(p) + n for p, n in zip(w.prompts, w.max_tokens)), sum(map(len, w.prompts))))
    servers = {}
    for key in keys:
        name, backend = PEER_SYSTEMS[key]
        try:
            servers[name] = (peer_server(key, longest, model), backend)
        except PeerMissing as e:
            print(e, flush=True)
    return servers


def _figures(metrics) -> dict:
    m = metrics
    return {"output_throughput": m.output_throughput, "ttft_p50": m.ttft.p50, "ttft_p99": m.ttft.p99,
            "tpot_mean": m.tpot.mean, "itl_p99": m.itl.p99, "e2e_p99": m.e2e.p99, "goodput": m.goodput,
            "completed": m.completed}


def summarize_runs(runs: list[tuple], slo: dict | None) -> dict:
    """Medians over repeats of each figure, plus every repeat's own figures and load average."""
    each = [{**_figures(run.metrics(slo)), "load": load, "failed": sum(e is not None for e in run.errors),
             "errors": sorted({e for e in run.errors if e})} for run, load in runs]
    med = {k: statistics.median(r[k] for r in each) if each[0][k] is not None else None for k in FIGURES}
    return {**med, "load": [r["load"] for r in each], "failed": sum(r["failed"] for r in each), "repeats": each}


def _print_table(results: dict, offline: dict) -> None:
    print(f"\n{'system':>22} {'rate/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT':>8} "
          f"{'ITL p99':>8} {'goodput':>8} {'load':>11} {'failed':>6}")
    for system, by_rate in results.items():
        for rate, s in by_rate.items():
            good = "-" if s["goodput"] is None else f"{s['goodput']:.2f}"
            load = "/".join(f"{x:.1f}" for x in s["load"])
            print(f"{system:>22} {rate:7g} {s['output_throughput']:10.1f} {1e3 * s['ttft_p50']:7.0f}ms "
                  f"{1e3 * s['ttft_p99']:7.0f}ms {1e3 * s['tpot_mean']:6.0f}ms {1e3 * s['itl_p99']:6.0f}ms {good:>8} "
                  f"{load:>11} {s['failed']:6d}")
    print(f"{'offline engine':>22} {'all':>7} {offline['output_throughput']:10.1f}   (same requests at once, "
          f"in process; loads {'/'.join(f'{x:.1f}' for x in offline['load'])})")


def ratios(results: dict, offline_runs: list) -> dict:
    """At the highest rate, per repeat (measured back to back): minivllm's output throughput over the others'."""
    top = max(next(iter(results.values())))
    ours = [r["output_throughput"] for r in results["minivllm serve"][top]["repeats"]]
    out = {"offline engine": [a / b for a, (b, _) in zip(ours, offline_runs)]}
    for name, by_rate in results.items():
        if name != "minivllm serve":
            out[name] = [a / r["output_throughput"] for a, r in zip(ours, by_rate[top]["repeats"])]
    return {name: {"per_repeat": v, "median": statistics.median(v)} for name, v in out.items()}


def plot_sweep(results: dict, offline: dict, path: str) -> None:
    """Output throughput and p99 TTFT against request rate, one line per server, the offline engine as a level."""
    import matplotlib  # optional and heavy: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for system, by_rate in results.items():
        rates = list(by_rate)
        axes[0].plot(rates, [s["output_throughput"] for s in by_rate.values()], "o-", label=system)
        axes[1].plot(rates, [s["ttft_p99"] for s in by_rate.values()], "o-", label=system)
    axes[0].axhline(offline["output_throughput"], color="gray", linestyle="--", label="offline engine (all at once)")
    axes[0].set_ylabel("output tokens / s")
    axes[1].set_ylabel("p99 TTFT (s)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request rate (requests / s)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("the same workload through each server (medians of repeats)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _start(servers: dict, stack, tok, timeout: float = 900.0) -> dict:
    """Launch every server at once (their loading overlaps), then wait for each and warm it; a peer's server that
    fails to start is skipped with a line saying why (minivllm's own failing is an error). The ones that run."""
    for server, _ in servers.values():
        stack.callback(server.stop)
        server.launch()
    began, running = now(), {}
    for name, (server, backend) in servers.items():
        try:
            server.wait_ready(timeout)
        except (RuntimeError, TimeoutError) as e:
            if backend in ("minivllm", "transformers"):
                raise
            print(f"{name}: skipped, its server did not start: {e}", flush=True)
            server.stop()
            continue
        print(f"{name}: ready within {now() - began:.0f} s of launch", flush=True)  # waited for in turn
        warm(server, tok, backend)
        running[name] = (server, backend)
    return running


def _parser():
    p = bench_parser("serving", serving_sweep_main.__doc__)
    p.add_argument("--rates", type=positive_finite_float, nargs="+", default=[0.5, 1.0, 2.0, 4.0, 8.0, 16.0])
    p.add_argument("--num-requests", type=positive_int, default=32)
    add_min_max(p, "--prompt-len", default=(16, 128))
    add_min_max(p, "--output-len", default=(16, 64))
    p.add_argument("--max-num-seqs", type=positive_int, default=32, help="minivllm's server and offline engine")
    p.add_argument("--num-blocks", type=positive_int, default=1024, help="minivllm's KV pool, in blocks")
    add_kernel_flags(p, "minivllm's server and offline engine: ")
    add_chunked_prefill_flag(p, "minivllm's server and offline engine (with a small --max-num-batched-tokens it "
                                "bounds how long a prefill stalls the decodes): ")
    p.add_argument("--transformers-flags", default="--cb-max-batch-tokens 2048",
                   help="extra flags for transformers serve, one string ('' for its defaults)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--peers", nargs="+", type=peer_list, default=[], metavar="PEER",
                   help="the real engines' servers too, space or comma separated: vllm (compiled), vllm-eager, "
                        "llamacpp; each needs python -m minivllm.bench peers setup (default: none)")
    p.add_argument("--slo-ttft", type=positive_finite_float, default=1000.0, metavar="MS")
    p.add_argument("--slo-tpot", type=positive_finite_float, default=200.0, metavar="MS")
    p.add_argument("--json", type=writable_file, default=None)
    p.add_argument("--plot", type=writable_file, default=None, metavar="PNG")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The sweep's flags; ``--peers`` flattened to peer keys, each once (``vllm llamacpp,vllm``: two)."""
    parser = _parser()
    args = parser.parse_args(argv)
    check_token_budget(parser, args.max_num_batched_tokens, args.max_num_seqs, "--max-num-seqs",
                       None if args.chunked_prefill else args.prompt_len[1], "--prompt-len's MAX")
    args.peers = list(dict.fromkeys(key for keys in args.peers for key in keys))
    return args


def fresh_prompts(workload: Workload, tokenizer, seed: int) -> Workload:
    """``workload`` with new random prompt tokens of the same lengths, drawn with ``seed`` (arrivals and
    output lengths unchanged)."""
    lengths = [len(a.prompt) for a in workload.arrivals]
    rng, (low, high) = random.Random(seed), ordinary_token_ids(tokenizer)
    arrivals = [replace(a, prompt=[rng.randrange(low, high) for _ in range(n)])
                for a, n in zip(workload.arrivals, lengths)]
    return replace(workload, arrivals=arrivals)


def _plan(args, workloads: dict, tok) -> dict:
    """The workload of every (repeat, rate): fresh prompt tokens for each, shared by every system in it."""
    return {(repeat, rate): fresh_prompts(w, tok, seed=args.seed + 1 + repeat * len(workloads) + i)
            for repeat in range(args.repeats) for i, (rate, w) in enumerate(workloads.items())}


def _repeats(args, servers: dict, plan: dict, tok) -> dict:
    """Every server stays up (idle, each costs no CPU); each repeat runs every rate on each server back to back,
    in alternating order: figures compared with each other were taken minutes apart at most, under about the
    same load of this shared machine."""
    rates = sorted({rate for _, rate in plan})
    runs: dict = {name: {rate: [] for rate in rates} for name in servers}
    for repeat in range(args.repeats):
        for rate in rates:
            w = plan[repeat, rate]
            for name in (list(servers) if repeat % 2 == 0 else list(servers)[::-1]):
                server, backend = servers[name]
                run = run_online(server.url, w, tok, backend=backend, label=f"{name} {rate:g}/s")
                runs[name][rate].append((run, os.getloadavg()[0]))
                print(f"  repeat {repeat + 1} {name} {rate:g}/s: {run.throughput:.1f} tok/s, load "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
    return runs


def _offline_repeats(args, plan: dict, tok) -> list:
    """The offline engine on the top rate's requests, once per repeat, after the servers are stopped (a server
    process left up still holds its threads, and transformers serve's batching loop keeps polling)."""
    runs = []
    top = max(rate for _, rate in plan)
    for repeat in range(args.repeats):
        result = offline_engine(plan[repeat, top], tok, args.model, block_size=args.block_size,
                                max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks,
                                max_num_batched_tokens=args.max_num_batched_tokens,
                                **({"device": args.device} if args.device else {}), **chunked_prefill_options(args.chunked_prefill),
                                **kernel_options(args))
        runs.append((result.throughput, os.getloadavg()[0]))
        print(f"  repeat {repeat + 1} offline engine: {result.throughput:.1f} tok/s", flush=True)
    return runs


def serving_sweep_main(argv=None) -> int:
    """minivllm's server against transformers serve (and with --peers, vLLM's and llama.cpp's servers) over a sweep
    of request rates, and the offline engine."""
    offline_env()
    args = parse_args(argv)
    tok = load_tokenizer(args.model)
    workloads = {rate: make_workload("online", tok, seed=args.seed, num_requests=args.num_requests, rate=rate,
                                     prompt_len=args.prompt_len, output_len=args.output_len) for rate in args.rates}
    first = next(iter(workloads.values()))
    plan = _plan(args, workloads, tok)
    engine = ["--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs), "--num-blocks",
              str(args.num_blocks), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    engine += ["--device", args.device] if args.device else []
    engine += [f"--{name.replace('_', '-')}={value}" for name, value in kernel_options(args).items()]
    if args.chunked_prefill:
        engine += ["--enable-chunked-prefill", "--max-prefill-chunk-size", str(args.chunked_prefill)]
    slo = {"ttft": args.slo_ttft / 1e3, "tpot": args.slo_tpot / 1e3}
    print(f"workload: {first.description.split(', Poisson')[0]}, Poisson arrivals at {args.rates} /s; greedy, exact "
          f"output lengths; {args.model}; {args.repeats} repeat(s), round robin; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    servers = {"minivllm serve": (ServerProcess.minivllm("--model", args.model, *engine), "minivllm")}
    if not args.skip_transformers:
        servers["transformers serve"] = (transformers_server(hf_serve_folder(args.model),
                                                             args.transformers_flags.split()), "transformers")
    servers.update(peer_servers(args.peers, plan, tok, args.model))
    commands = {name: {"argv": server.argv, "env": server.extra_env} for name, (server, _) in servers.items()}
    for name, c in commands.items():
        print(f"{name}: " + " ".join([*(f"{k}={v}" for k, v in c["env"].items()), shlex.join(c["argv"])]), flush=True)
    with contextlib.ExitStack() as stack:
        servers = _start(servers, stack, tok)
        runs = _repeats(args, servers, plan, tok)
    offline_runs = _offline_repeats(args, plan, tok)
    results = {name: {rate: summarize_runs(r, slo) for rate, r in by_rate.items()} for name, by_rate in runs.items()}
    offline = {"output_throughput": statistics.median(t for t, _ in offline_runs),
               "load": [load for _, load in offline_runs]}
    _print_table(results, offline)
    ratio = ratios(results, offline_runs)
    for name, r in ratio.items():
        print(f"minivllm serve / {name} at {max(args.rates):g}/s, output throughput per repeat: "
              f"{', '.join(f'{x:.2f}x' for x in r['per_repeat'])} (median {r['median']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "servers": commands,
                       "results": {n: {str(r): s for r, s in v.items()} for n, v in results.items()},
                       "offline": offline, "ratios_at_top_rate": ratio}, f, indent=2)
    if args.plot:
        plot_sweep(results, offline, args.plot)
        print(f"wrote {args.plot}")
    return 0
