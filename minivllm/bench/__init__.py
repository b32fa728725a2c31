"""Benchmarks: workloads, serving metrics, timing, baselines and the experiments of each chapter (chapter 11).

``minivllm.bench`` re-exports every module's ``__all__``, so chapters write
``from minivllm.bench import replay, percentile``. ``python -m minivllm.bench
[interference|shared-prefix|preemption|serving|kv-offload|disaggregation|speculative|structured|peers|margins|
contention]`` runs a chapter's experiment.
"""

import sys

from minivllm.bench import (baselines, contention, disaggregation, front_end, harness, interference, kv_offload,
                            metrics, online, peer_margins, peers, preemption, server_process, serving_sweep,
                            shared_prefix, speculative, structured, throughput, timing, trace, workloads)
from minivllm.bench.baselines import *  # noqa: F401,F403
from minivllm.bench.contention import *  # noqa: F401,F403
from minivllm.bench.disaggregation import *  # noqa: F401,F403
from minivllm.bench.front_end import *  # noqa: F401,F403
from minivllm.bench.cli import SUBCOMMANDS
from minivllm.bench.harness import *  # noqa: F401,F403
from minivllm.bench.interference import *  # noqa: F401,F403
from minivllm.bench.kv_offload import *  # noqa: F401,F403
from minivllm.bench.metrics import *  # noqa: F401,F403
from minivllm.bench.online import *  # noqa: F401,F403
from minivllm.bench.peer_margins import *  # noqa: F401,F403
from minivllm.bench.peers import *  # noqa: F401,F403
from minivllm.bench.preemption import *  # noqa: F401,F403
from minivllm.bench.server_process import *  # noqa: F401,F403
from minivllm.bench.serving_sweep import *  # noqa: F401,F403
from minivllm.bench.shared_prefix import *  # noqa: F401,F403
from minivllm.bench.speculative import *  # noqa: F401,F403
from minivllm.bench.structured import *  # noqa: F401,F403
from minivllm.bench.throughput import *  # noqa: F401,F403
from minivllm.bench.timing import *  # noqa: F401,F403
from minivllm.bench.trace import *  # noqa: F401,F403
from minivllm.bench.workloads import *  # noqa: F401,F403
from minivllm.simulator import SimTrace, sim_sequence, simulate_schedule  # chapter 10's simulator, from its old home

__all__ = [name for module in (timing, metrics, workloads, baselines, trace, harness, throughput, interference,
                               shared_prefix, preemption, online, server_process, serving_sweep, kv_offload,
                               disaggregation, speculative, structured, peers, peer_margins, contention, front_end)
           for name in module.__all__]
__all__ += ["SimTrace", "sim_sequence", "simulate_schedule", "SUBCOMMANDS", "main"]

_EXPERIMENTS = {"interference": interference.interference_main, "shared-prefix": shared_prefix.shared_prefix_main,
                "preemption": preemption.preemption_main, "serving": serving_sweep.serving_sweep_main,
                "kv-offload": kv_offload.kv_offload_main, "disaggregation": disaggregation.disaggregation_main,
                "speculative": speculative.speculative_main, "structured": structured.structured_main,
                "peers": peers.peers_main, "margins": peer_margins.margins_main,
                "contention": contention.contention_main}


def main(argv=None) -> int:
    """``python -m minivllm.bench [interference|shared-prefix|preemption|serving|kv-offload|disaggregation] ...``: the named chapter experiment,
    by default the throughput comparison with HF transformers."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in _EXPERIMENTS:
        return _EXPERIMENTS[argv[0]](argv[1:])
    return throughput.throughput_main(argv)
