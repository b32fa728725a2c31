"""Rank 0's model runner under tensor parallelism: broadcast the step, run its shard, sample (chapter 15).

:class:`TensorParallelRunner` is the :class:`~minivllm.model_runner.ModelRunner`
the engine uses when ``tensor_parallel_size > 1``. The scheduler and block
manager are unchanged and stay here: block tables are per request, not per
rank, so one block id names the same block in every rank's pool. Each step
rank 0 broadcasts the block copies (if any) and then the forward's inputs;
every rank makes the copies in its own pools and runs the same forward on its
shard; the logits of the sampled rows are gathered here, and only here are
tokens sampled.
"""

from __future__ import annotations

import torch

from minivllm.attention import MiniPagedKVCache
from minivllm.distributed import protocol
from minivllm.distributed.workers import Workers, memory_report
from minivllm.model_runner import ModelRunner, StepInputs, _noop_mark
from minivllm.sampler import MiniGrammarMasker
from minivllm.scheduler import SchedulerOutput

__all__ = ["TensorParallelRunner"]


class TensorParallelRunner(ModelRunner):
    """A ModelRunner whose every step is also run by the worker ranks (rank 0's side)."""

    def __init__(self, workers: Workers, model, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 kv_cache_cls=MiniPagedKVCache, sampler=None, grammar_masker_cls=MiniGrammarMasker,
                 overlap_grammar_fill: bool | None = False):
        super().__init__(model, num_blocks, block_size, num_cpu_blocks, kv_cache_cls, sampler,
                         grammar_masker_cls=grammar_masker_cls, overlap_grammar_fill=overlap_grammar_fill)
        self.workers = workers
        own = memory_report(self)
        self.rank_memory: list[dict] = workers.guard(lambda: workers.start_pools(num_blocks, num_cpu_blocks, own))

    @property
    def tp(self):
        return self.workers.tp

    def copy_blocks(self, out: SchedulerOutput) -> None:
        """The step's block copies, broadcast first so that every rank makes them in its own pools."""
        if out.copies or out.swap_out or out.swap_in:
            msg = protocol.StepMessage(protocol.STEP, None, list(out.copies), list(out.swap_out), list(out.swap_in))
            self.workers.guard(lambda: self.workers.send(msg))
        super().copy_blocks(out)

    def forward_inputs(self, inputs: StepInputs, mark=_noop_mark) -> torch.Tensor | None:
        """Broadcast the inputs, run rank 0's shard with the workers; full logits (gathered) of the
        sampled rows."""
        def step():
            self.workers.send(protocol.StepMessage(protocol.STEP, inputs))
            return ModelRunner.forward_inputs(self, inputs, mark)

        return self.workers.guard(step)

    def shutdown(self) -> None:
        self.workers.shutdown()
