"""Benchmarks: workloads, serving metrics, timing, baselines and the experiments of each chapter (chapter 11).

``minivllm.bench`` re-exports everything, so chapters write
``from minivllm.bench import replay, percentile``.
"""

from minivllm.bench.timing import *  # noqa: F401,F403
from minivllm.bench.metrics import *  # noqa: F401,F403
from minivllm.bench.workloads import *  # noqa: F401,F403
from minivllm.bench.baselines import *  # noqa: F401,F403
from minivllm.bench.trace import *  # noqa: F401,F403
from minivllm.bench.harness import *  # noqa: F401,F403
from minivllm.bench.experiments import *  # noqa: F401,F403
from minivllm.bench.experiments import SUBCOMMANDS, main  # noqa: F401
