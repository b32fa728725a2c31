"""Chapter 10: a reader's preemption (choose_victim, preempt)."""

from minivllm.exercises import check_preemption
from minivllm.exercises.preemption import accounting_example
from minivllm.scheduler import Scheduler
from minivllm.sequence import SequenceStatus

from exercise_cases import Check


class MyScheduler(Scheduler):
    """The solution notebook's answer."""

    def choose_victim(self, requester):
        below = [s for s in self.running if s.rank > requester.rank]
        unprotected = [s for s in below if s.protected_until_step <= self.step_index]
        return max(unprotected or below, key=lambda s: s.rank, default=None)

    def preempt(self, seq, out):
        bm = self.block_manager
        out.drop(seq)
        self.running.remove(seq)
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        if self.config.preemption_mode == "swap" and bm.can_swap_out(seq):
            pairs = bm.swap_out(seq)
            out.swap_out.extend(pairs)
            self._count_swap(seq, len(pairs))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
        else:
            seq.metrics.num_recomputed_tokens += seq.cached_token_count
            self.num_recomputed_tokens += seq.cached_token_count
            self._recompute_later(seq)


def _victim(below, pick=max, protect=True):
    """A choose_victim whose candidates are ``below(self, requester)``, picked by ``pick`` over seq.rank."""
    def choose_victim(self, requester):
        cands = below(self, requester)
        free = [s for s in cands if s.protected_until_step <= self.step_index] if protect else []
        return pick(free or cands, key=lambda s: s.rank, default=None)
    return type("WrongScheduler", (MyScheduler,), {"choose_victim": choose_victim})


def _ranked_below(self, requester):
    return [s for s in self.running if s.rank > requester.rank]


def _arrived_after(self, requester):  # priority ignored
    return [s for s in self.running if s.metrics.arrival_time > requester.metrics.arrival_time]


def _anyone_else(self, requester):
    return [s for s in self.running if s is not requester]


class IgnoresPriority(MyScheduler):
    def choose_victim(self, requester):
        cands = _arrived_after(self, requester)
        return max(cands, key=lambda s: s.metrics.arrival_time, default=None)


def _preempt(drop=True, count=True, swap_fallback=True, reset=True, front=True, count_blocks=False):
    """A preempt with one of its steps changed."""
    def preempt(self, seq, out):
        bm = self.block_manager
        if drop:
            out.drop(seq)
        self.running.remove(seq)
        if count:
            seq.metrics.num_preemptions += 1
            self.num_preemptions += 1
        out.preempted.append(seq)
        if self.config.preemption_mode == "swap" and (bm.can_swap_out(seq) or not swap_fallback):
            pairs = bm.swap_out(seq)
            out.swap_out.extend(pairs)
            self._count_swap(seq, len(pairs))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        redo = len(seq.block_table) if count_blocks else seq.cached_token_count
        seq.metrics.num_recomputed_tokens += redo
        self.num_recomputed_tokens += redo
        bm.free(seq)
        if reset:
            seq.cached_token_count = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq, self.step_index, front=front)
    return type("WrongScheduler", (MyScheduler,), {"preempt": preempt})


def test_accounting_example_is_the_source_notes():
    cost = accounting_example()
    assert (cost.released_blocks, cost.recompute_tokens, round(cost.swap_roundtrip_ms, 3)) == (2, 7, 0.306)


CHECKS = [Check("10", check_preemption, [MyScheduler], {
    "the victim ignores priority": (IgnoresPriority, "ignores priority"),
    "the earliest arrival evicted": (_victim(_ranked_below, pick=min), "earliest arrival"),
    "protection ignored": (_victim(_ranked_below, protect=False), "protection ignored"),
    "a victim above the requester": (_victim(_anyone_else), "victim above the requester"),
    "the chunk not dropped": (_preempt(drop=False), r"out\.drop"),
    "the preemption not counted": (_preempt(count=False), "count the preemption"),
    "recompute without resetting cached tokens": (_preempt(reset=False), "without resetting the cached tokens"),
    "requeued at the back": (_preempt(front=False), "front of the waiting queue"),
    "accounting counts blocks": (_preempt(count_blocks=True), "blocks instead of tokens"),
    "swap without falling back": (_preempt(swap_fallback=False), "falling back|fall back"),
}, passes="the live engine")]
