"""Tensor parallelism over ``torch.distributed``: worker processes, the step broadcast, shutdown (chapter 15).

Importing this package starts nothing: processes and process groups exist
only while an engine with ``tensor_parallel_size > 1`` runs.
"""

from minivllm.distributed.runner import TensorParallelRunner
from minivllm.distributed.workers import (WorkerError, Workers, check_tensor_parallel_size, run_on_ranks,
                                          start_workers)

__all__ = ["TensorParallelRunner", "WorkerError", "Workers", "check_tensor_parallel_size", "run_on_ranks",
           "start_workers"]
