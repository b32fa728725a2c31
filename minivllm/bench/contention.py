"""minivllm's throughput with the CPU to itself and beside a CPU-bound neighbour (issue 31, chapter 11).

``python -m minivllm.bench contention`` runs one offline workload alternately
quiet and under one busy loop per core that the benchmark starts itself
(:func:`busy_loops`, stopped by process id), and prints the medians and their
ratio with the thread settings in force (``torch.get_num_threads()``,
``OMP_*``, the spin count of :mod:`minivllm.cpu_threads`). ``--threads N`` sets
``torch.set_num_threads(N)`` first; OpenMP's own variables (``GOMP_SPINCOUNT``,
``OMP_WAIT_POLICY=passive``) must be in the environment before the process
starts: ``GOMP_SPINCOUNT=300000`` gives libgomp's own default back.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys

import torch

from minivllm.bench.cli import add_min_max, bench_parser, offline_env, positive_int, writable_file
from minivllm.bench.harness import run_engine
from minivllm.bench.workloads import make_workload
from minivllm.cpu_threads import spin_count_in_force
from minivllm.models import load_tokenizer

__all__ = ["busy_loops", "contention_main"]


@contextlib.contextmanager
def busy_loops(n: int, seconds: float = 600.0):
    """``n`` processes that spin on the CPU (each for at most ``seconds``), stopped by their ids on exit."""
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def contention_main(argv=None) -> int:
    """minivllm's offline throughput quiet and beside one busy loop per core, alternating; medians and the ratio."""
    offline_env()
    parser = bench_parser("contention", contention_main.__doc__)
    parser.add_argument("--num-requests", type=positive_int, default=8)
    add_min_max(parser, "--prompt-len", default=(16, 64))
    add_min_max(parser, "--output-len", default=(32, 32))
    parser.add_argument("--busy", type=positive_int, default=os.cpu_count() or 1, help="busy loops (default: a core each)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads(N) first")
    parser.add_argument("--json", type=writable_file, default=None, help="also write the figures to FILE as JSON")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    workload = make_workload("offline", load_tokenizer(args.model), seed=args.seed, num_requests=args.num_requests,
                             prompt_len=args.prompt_len, output_len=args.output_len)
    opts = dict(block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens, device="cpu",
                dtype="float32")
    omp = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "GOMP_"))}
    print(f"workload: {workload.description}; torch threads {torch.get_num_threads()}, OpenMP env {omp or 'none'}, "
          f"spin count {spin_count_in_force()}; "
          f"{args.busy} busy loops when loaded; {args.repeats} rounds, quiet then loaded", flush=True)
    figures = {"quiet": [], "loaded": []}
    for _ in range(args.repeats):
        figures["quiet"].append(run_engine(workload, args.model, **opts).throughput)
        with busy_loops(args.busy):
            figures["loaded"].append(run_engine(workload, args.model, **opts).throughput)
        print("  " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in figures.items()), flush=True)
    quiet, loaded = (statistics.median(figures[k]) for k in ("quiet", "loaded"))
    print(f"median quiet {quiet:.1f} tok/s, loaded {loaded:.1f} tok/s: loaded is {quiet / loaded:.2f}x slower")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spin_count": spin_count_in_force(), "threads": torch.get_num_threads(), "busy": args.busy,
                       "tok_s": figures, "median_quiet": quiet, "median_loaded": loaded,
                       "slowdown": quiet / loaded}, f, indent=2)
    return 0
