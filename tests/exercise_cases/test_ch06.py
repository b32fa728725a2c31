"""Chapter 06: a reader's scheduler passes (decodes first, admission under three budgets)."""

from minivllm.exercises import check_scheduler
from minivllm.scheduler import Scheduler
from minivllm.sequence import SequenceStatus

from exercise_cases import Check


class MyScheduler(Scheduler):
    """The solution notebook's answer."""

    def schedule_running(self, out):
        for seq in sorted(self.running, key=lambda s: (s.status is not SequenceStatus.RUNNING, s.rank)):
            if seq not in self.running:
                continue
            n = self.num_new_tokens(seq, seq.cached_token_count, out)
            if n and self.reserve_blocks(seq, seq.cached_token_count + n, out):
                out.add(self.chunk(seq, n))

    def schedule_waiting(self, out):
        bm = self.block_manager
        while len(self.waiting) and self.has_room(out):
            seq = self.waiting.peek()
            hits = bm.lookup_prefix(seq)
            cached = len(hits) * bm.block_size
            n = self.num_new_tokens(seq, cached, out)
            watermark = seq.metrics.first_scheduled_time is None and bool(self.running)
            if not n or not bm.allocate(seq, cached + n, hits, watermark):
                break
            self.waiting.pop()
            seq.cached_token_count = cached
            bm.record_prefix_lookup(seq, cached)
            self.start(seq, n, out)


class PrefillsFirst(MyScheduler):
    def schedule_running(self, out):
        for seq in sorted(self.running, key=lambda s: (s.status is SequenceStatus.RUNNING, s.rank)):
            if seq in self.running and (n := self.num_new_tokens(seq, seq.cached_token_count, out)):
                if self.reserve_blocks(seq, seq.cached_token_count + n, out):
                    out.add(self.chunk(seq, n))


def _admit(skip_unfitting=False, budget=True, seats=True, blocks=True, lookup=True):
    """A schedule_waiting with one of its rules left out."""
    def schedule_waiting(self, out):
        bm = self.block_manager
        for seq in list(self.waiting):
            if out.num_batched_tokens >= self.config.max_num_batched_tokens or \
                    (seats and len(self.running) >= self.config.max_num_seqs):
                break
            hits = bm.lookup_prefix(seq) if lookup else []
            cached = len(hits) * bm.block_size
            n = self.num_new_tokens(seq, cached, out) if budget else seq.num_tokens - cached
            if not n or (blocks and not bm.allocate(seq, cached + n, hits)):
                if skip_unfitting:
                    continue
                break
            self.waiting.remove(seq)
            seq.cached_token_count = cached
            self.start(seq, n, out)
    return type("WrongScheduler", (MyScheduler,), {"schedule_waiting": schedule_waiting})


CHECKS = [Check("06", check_scheduler, [MyScheduler], {
    "prefills before decodes": (PrefillsFirst, "decodes first"),
    "a small request overtakes": (_admit(skip_unfitting=True), "first come, first served"),
    "budget overrun": (_admit(budget=False), "budget overrun"),
    "too many sequences": (_admit(seats=False), "max_num_seqs"),
    "no blocks claimed": (_admit(blocks=False), "self.block_manager.allocate"),
    "no prefix lookup": (_admit(lookup=False), "lookup_prefix"),
}, passes="the live engine")]
