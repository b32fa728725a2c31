"""Chapter 09: a reader's num_new_tokens (chunked prefill in the scheduler)."""

from minivllm.exercises import check_chunked_prefill
from minivllm.scheduler import Scheduler
from minivllm.sequence import SequenceStatus

from exercise_cases import Check


class MyScheduler(Scheduler):
    """The solution notebook's answer."""

    def num_new_tokens(self, seq, cached, out):
        cfg = self.config
        budget = cfg.max_num_batched_tokens - out.num_batched_tokens
        n = seq.num_tokens - cached
        if cfg.enable_chunked_prefill:
            n = min(n, cfg.max_prefill_chunk_size)
        if n <= budget:
            return n
        running = seq.status in (SequenceStatus.RUNNING, SequenceStatus.PREFILLING)
        if cfg.enable_chunked_prefill or running or n > cfg.max_num_batched_tokens:
            return budget
        return 0


def _chunk(budget_left=True, chunk_size=True, cut_running=True, cut_too_long=True, cut_new=False, aligned=False):
    """A num_new_tokens with one of its rules changed."""
    def num_new_tokens(self, seq, cached, out):
        cfg = self.config
        budget = cfg.max_num_batched_tokens - (out.num_batched_tokens if budget_left else 0)
        n = seq.num_tokens - cached
        if cfg.enable_chunked_prefill and chunk_size:
            k = cfg.max_prefill_chunk_size
            n = min(n, k - cached % k if aligned else k)
        if n <= budget:
            return n
        running = seq.status in (SequenceStatus.RUNNING, SequenceStatus.PREFILLING)
        if cfg.enable_chunked_prefill or cut_new or (cut_running and running) or \
                (cut_too_long and n > cfg.max_num_batched_tokens):
            return budget
        return 0
    return type("WrongScheduler", (MyScheduler,), {"num_new_tokens": num_new_tokens})


class ChunkOrWait(MyScheduler):
    """With chunking on, a chunk that does not fit the budget left waits instead of being cut."""

    def num_new_tokens(self, seq, cached, out):
        n = super().num_new_tokens(seq, cached, out)
        whole = min(seq.num_tokens - cached, self.config.max_prefill_chunk_size)
        return n if n == whole or not self.config.enable_chunked_prefill else 0


CHECKS = [Check("09", check_chunked_prefill, [MyScheduler], {
    "the budget left ignored": (_chunk(budget_left=False), "budget left"),
    "the chunk size ignored": (_chunk(chunk_size=False), "at most max_prefill_chunk_size"),
    "a chunk that does not fit waits": (ChunkOrWait, "cut to the budget left"),
    "chunks aligned to multiples of the chunk size": (_chunk(aligned=True), "not aligned"),
    "a new prompt cut without chunking": (_chunk(cut_new=True), "runs whole or waits"),
    "a resumed sequence not cut without chunking": (_chunk(cut_too_long=False), "could never run whole"),
    "a running sequence not cut without chunking": (_chunk(cut_running=False), "never made to wait"),
}, passes="the live engine")]
