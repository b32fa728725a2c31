"""Continuous batching: which tokens of which requests run in the next step (chapters 06, 09 and 10).

The rule, once. Every sequence has ``num_tokens`` (prompt plus generated) and
``cached_token_count`` (tokens whose KV is written); a step lets the second
catch up with the first under three budgets: tokens
(``max_num_batched_tokens``), sequences (``max_num_seqs``) and free KV
blocks. Running sequences go first, decodes (one token each) before prefills
(their next chunk), each kind best rank first (priority, then arrival); then
swapped-out sequences come back; then waiting ones are admitted in queue
order while everything still fits. With chunked prefill a chunk is at most
``max_prefill_chunk_size`` tokens and the budget left. Without it a new
prompt runs whole or waits; only a sequence that could never run whole (one
preempted by recompute, whose prompt plus output exceeds the budget) and one
already running are cut to the budget.

When a running sequence needs a block and none is free, it preempts the
lowest-ranked running sequence that ranks below it, sparing those resumed
within ``preemption_protection_steps`` steps while another is left (the guard
against thrashing), or itself if none ranks below it. "recompute" drops the
victim's blocks and puts it back at the front of the queue; "swap" copies them
to the CPU pool (or recomputes if that is full).

Liveness. Call the best-ranked running sequence the head. (1) Nobody preempts
the head: victims rank below the sequence that needs the block. (2) The head
never preempts itself: everything else running ranks below it and goes first,
and a sequence alone always fits the pool (requests are validated against
it); protection is only a preference among victims. (3) The head computes at
least one token every step: it is first of its kind, decodes beside it take at
most ``max_num_seqs - 1 < max_num_batched_tokens`` tokens, and a running
sequence is cut to the budget, never made to wait. (4) When nothing runs, the
first swapped or waiting sequence is admitted: every block is free and an
idle engine ignores the watermark. So each step computes a token of the head,
or of a newly admitted sequence, and only sequences ranked below the head
lose computed tokens: listed by rank, the computed-token counts grow
lexicographically every step and are bounded, so every request finishes.

Speculative decoding (chapter 17, ``EngineConfig.speculative_config``): a
running decode row may carry drafts (:func:`minivllm.spec_decode.propose_ngram`)
that cost a token of the budget and a KV slot each. They only use what is
left: the budget beyond one token for every running sequence still to be
scheduled (so the liveness argument above is untouched) and blocks that are
free without preempting anyone; short of either, the row runs without them.
After verification, ``update`` appends the accepted tokens one by one (a stop
ends the run at its token) and rolls back the rest: the computed count
returns to the accepted length and blocks past it go back to the pool
(``BlockManager.truncate``), so only blocks of accepted tokens are ever
registered in the prefix cache.

Pure Python: no tensors here; the block copies to make (a fork's copy on
write, swaps, the CPU offload tier's offloads and restores, chapter 14) are
listed in the ``SchedulerOutput`` for the model runner.

:class:`Scheduler` is the interface and the shared helpers (what exercises
06, 09 and 10 subclass: the methods they write only raise there);
:class:`MiniScheduler` is minivllm's own, the engine's default.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

from minivllm.block_manager import BlockManager
from minivllm.config import EngineConfig, resolve
from minivllm.sequence import Sequence, SequenceStatus
from minivllm.spec_decode import SpecDecodingStats, backoff_steps, propose_ngram

__all__ = ["ScheduledChunk", "SchedulerOutput", "FCFSQueue", "PriorityQueue", "Scheduler", "MiniScheduler"]

S = SequenceStatus


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at position ``start`` (= its cached_token_count), and the KV
    ``slots`` they are written to (from the block manager's slot mapping).

    A decode row with drafts (chapter 17) feeds the sequence's last token and
    then ``spec_token_ids``, which are not (yet) the sequence's tokens:
    ``num_tokens`` counts them too.
    """

    seq: Sequence
    start: int
    num_tokens: int
    slots: list[int]
    spec_token_ids: list[int] = field(default_factory=list)
    samples: bool = field(init=False)  # only a chunk that reaches the sequence's last token samples
    sample_seqs: list[Sequence] = field(init=False)  # who gets a token from its logits: seq, and forks at birth

    def __post_init__(self):
        self.samples = self.end - len(self.spec_token_ids) == self.seq.num_tokens
        self.sample_seqs = [self.seq, *self.seq.forks] if self.samples else []

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    """One step's plan: the chunks to run, and the block copies to make before them."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) device blocks, first
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block), next
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block), last
    offload: list[tuple[int, int]] = field(default_factory=list)  # (device block, tier slot), before everything
    restore: list[tuple[int, int]] = field(default_factory=list)  # (tier slot, device block), before swap_in
    copied_into: list[Sequence] = field(default_factory=list)  # sequences whose KV these copies write
    num_batched_tokens: int = 0

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self.num_batched_tokens += chunk.num_tokens

    def drop(self, seq: Sequence) -> None:
        """Unschedule ``seq`` (it was preempted after getting its chunk)."""
        for chunk in self.chunks:
            if chunk.seq is seq:
                self.chunks.remove(chunk)
                self.num_batched_tokens -= chunk.num_tokens
                return


class FCFSQueue:
    """Waiting sequences in arrival order; a preempted one goes back to the front."""

    def __init__(self):
        self._items: deque[Sequence] = deque()

    def push(self, seq: Sequence, step: int, front: bool = False) -> None:
        seq.enqueued_step = step
        self._items.appendleft(seq) if front else self._items.append(seq)

    def peek(self) -> Sequence:
        return self._items[0]

    def pop(self) -> Sequence:
        return self._items.popleft()

    def remove(self, seq: Sequence) -> None:
        self._items.remove(seq)

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class PriorityQueue:
    """Waiting sequences by effective priority, lower first, then arrival (chapter 10).

    A sequence's effective priority is ``priority - aging_rate x steps
    waited``. Aging lowers every waiting sequence by the same amount each step,
    so the order is fixed when a sequence joins, by ``priority + aging_rate x
    (step it joined)``: a heap keeps it, in O(log n) per push and pop.
    """

    def __init__(self, aging_rate: float = 0.0):
        self.aging_rate = aging_rate
        self._heap: list[tuple] = []

    def push(self, seq: Sequence, step: int, front: bool = False) -> None:
        seq.enqueued_step = step  # a preempted sequence starts aging again
        key = seq.priority + self.aging_rate * step
        heapq.heappush(self._heap, (key, seq.metrics.arrival_time, seq.seq_id, seq))

    def effective_priority(self, seq: Sequence, step: int) -> float:
        return seq.priority - self.aging_rate * (step - seq.enqueued_step)

    def peek(self) -> Sequence:
        return self._heap[0][-1]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[-1]

    def remove(self, seq: Sequence) -> None:
        self._heap = [entry for entry in self._heap if entry[-1] is not seq]
        heapq.heapify(self._heap)

    def __iter__(self):
        return (entry[-1] for entry in sorted(self._heap))

    def __len__(self) -> int:
        return len(self._heap)


class Scheduler:
    """Decides every step's chunks: the scheduler's interface and shared helpers (an extension point:
    ``EngineConfig(scheduler_cls=...)``).

    Exercises 06, 09 and 10 subclass it and write :meth:`schedule_running`,
    :meth:`schedule_waiting` (06), :meth:`num_new_tokens` (09),
    :meth:`choose_victim` and :meth:`preempt` (10); here they only say what
    they do. minivllm's own are :class:`MiniScheduler`'s, the engine's default.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: set[int] = frozenset(), kv_bytes_per_block: int = 0):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.kv_bytes_per_block = kv_bytes_per_block
        self.waiting = FCFSQueue() if config.scheduling_policy == "fcfs" else PriorityQueue(config.priority_aging_rate)
        self.running: list[Sequence] = []  # RUNNING and PREFILLING, in admission order
        self.swapped: deque[Sequence] = deque()
        self.step_index = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.num_swapped_bytes = 0
        self._copies: list[tuple[int, int]] = []  # a fork's copies, made at the start of the next step
        self._copied_into: list[Sequence] = []
        self.spec = config.speculative_config  # chapter 17: None, or how to draft
        self.spec_stats = SpecDecodingStats(self.spec.num_speculative_tokens) if self.spec else None
        self.acceptor = resolve(config.spec_acceptor_cls, "spec_acceptor_cls")(block_manager) if self.spec else None

    # -- queues --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.push(seq, self.step_index)

    def has_unfinished(self) -> bool:
        return bool(len(self.waiting) or self.running or self.swapped)

    @property
    def sequences(self) -> list[Sequence]:
        return list(self.running) + list(self.swapped) + list(self.waiting)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End ``seq`` in any state: out of its queue, every block it holds (device and CPU) freed."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        seq.metrics.finish_time = time.perf_counter()

    def abort(self, seq: Sequence) -> None:
        self.finish(seq, S.FINISHED_ABORTED)

    # -- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(copies=self._copies, copied_into=self._copied_into)
        self._copies, self._copied_into = [], []
        self.schedule_running(out)
        if not out.preempted:  # memory is short in a step that had to preempt: admit nothing
            self.schedule_swapped(out)
            self.schedule_waiting(out)
        if self.config.kv_offload_blocks:
            out.offload, out.restore = self.block_manager.take_tier_copies()
        self.step_index += 1
        return out

    # -- what exercises 06, 09 and 10 write (minivllm's own: MiniScheduler) ----------------------
    def schedule_running(self, out: SchedulerOutput) -> None:
        """Decodes, then running prefills, each best rank first, each growing its blocks by
        :meth:`reserve_blocks` (which preempts lower ranks). Exercise 06."""
        raise NotImplementedError("not written yet: Scheduler.schedule_running")

    def schedule_waiting(self, out: SchedulerOutput) -> None:
        """Admit waiting sequences in queue order while they fit (the token, sequence and block budgets): each
        one's prefix-cache hits and new blocks claimed in one ``allocate``, then :meth:`start`. Exercise 06."""
        raise NotImplementedError("not written yet: Scheduler.schedule_waiting")

    def num_new_tokens(self, seq: Sequence, cached: int, out: SchedulerOutput) -> int:
        """How many of ``seq``'s uncomputed tokens (after its first ``cached``) run now, within the budget ``out``
        leaves (0: it waits). Exercise 09."""
        raise NotImplementedError("not written yet: Scheduler.num_new_tokens")

    def choose_victim(self, requester: Sequence) -> Sequence | None:
        """The lowest-ranked running sequence below ``requester``, unprotected ones first; None if none is below.
        Exercise 10."""
        raise NotImplementedError("not written yet: Scheduler.choose_victim")

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Release ``seq``'s device blocks: swap them to the CPU pool, or drop them to recompute later; counted.
        Exercise 10."""
        raise NotImplementedError("not written yet: Scheduler.preempt")

    def propose(self, seq: Sequence, n: int, out: SchedulerOutput, others: int) -> list[int]:
        """Drafts for a running decode row (chapter 17), within the budget left after one token for each of the
        ``others`` still to schedule, and within what the request may still emit (the bonus token included).

        Rows that ask for logprobs are not drafted (their logprobs come from plain decode steps), nor rows whose
        recent drafts were all rejected, until their backoff ends (:func:`minivllm.spec_decode.backoff_steps`).
        A constrained row's drafts are cut where its grammar refuses one (chapter 19)."""
        if n != 1 or seq.status is not S.RUNNING or seq.params.logprobs is not None:
            return []
        if self.step_index < seq.draft_resume_step:
            return []
        budget = self.config.max_num_batched_tokens - out.num_batched_tokens - 1 - others
        room = min(self.spec.num_speculative_tokens, budget, seq.params.max_tokens - len(seq.output_token_ids) - 1,
                   self.max_model_len - seq.num_tokens - 1)
        if room <= 0:
            return []
        drafts = propose_ngram(seq.token_ids, room, self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
        if drafts and seq.grammar is not None:  # drafts its grammar refuses would be rejected: not worth a slot
            drafts = seq.grammar.valid_prefix(drafts)
        return drafts

    def schedule_swapped(self, out: SchedulerOutput) -> None:
        """Bring swapped-out sequences back, oldest first, while their blocks and their chunk fit."""
        while self.swapped and self.has_room(out):
            seq = self.swapped[0]
            n = self.num_new_tokens(seq, seq.cached_token_count, out)
            pairs = self.block_manager.swap_in(seq, seq.cached_token_count + n) if n else None
            if pairs is None:
                break
            self.swapped.popleft()
            out.swap_in.extend(pairs)
            out.copied_into.append(seq)
            self._count_swap(seq, len(pairs))
            self.start(seq, n, out)

    def has_room(self, out: SchedulerOutput) -> bool:
        """Whether the step has a token and a seat left for one more sequence."""
        return out.num_batched_tokens < self.config.max_num_batched_tokens and \
            len(self.running) < self.config.max_num_seqs

    def start(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        """Move a sequence (new, resumed or swapped in) into the running batch with its first chunk."""
        m = seq.metrics
        if m.first_scheduled_time is None:
            m.first_scheduled_time, m.num_cached_tokens = time.perf_counter(), seq.cached_token_count
        if m.num_preemptions:  # just resumed: protect it from being evicted again at once
            seq.protected_until_step = self.step_index + self.config.preemption_protection_steps
        seq.status = S.PREFILLING
        self.running.append(seq)
        out.add(self.chunk(seq, n))

    def chunk(self, seq: Sequence, n: int, drafts: list[int] = ()) -> ScheduledChunk:
        """The next ``n`` uncomputed tokens of ``seq``, then its ``drafts`` (its blocks already cover them all)."""
        start, end = seq.cached_token_count, seq.cached_token_count + n + len(drafts)
        return ScheduledChunk(seq, start, end - start, self.block_manager.slot_mapping(seq, start, end), list(drafts))

    # -- preemption (chapter 10) ---------------------------------------------------------------
    def reserve_blocks(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Grow ``seq``'s blocks to ``num_tokens``, preempting lower ranks; False if ``seq`` had to
        yield."""
        while not self.block_manager.allocate(seq, num_tokens):
            victim = self.choose_victim(seq)
            self.preempt(victim or seq, out)
            if victim is None:
                return False
        return True

    def _recompute_later(self, seq: Sequence) -> None:
        """Forget ``seq``'s KV (device and CPU blocks) and queue it, first, to compute everything again."""
        self.block_manager.free(seq)
        seq.cached_token_count = 0
        seq.status = S.WAITING
        self.waiting.push(seq, self.step_index, front=True)

    def _count_swap(self, seq: Sequence, num_blocks: int) -> None:
        seq.metrics.num_swapped_bytes += num_blocks * self.kv_bytes_per_block
        self.num_swapped_bytes += num_blocks * self.kv_bytes_per_block

    def discard_copies(self, out: SchedulerOutput) -> None:
        """After a step was interrupted before its block copies completed: recompute whatever they held."""
        if out.offload:  # the tier entries those copies were to fill hold nothing (chapter 14)
            self.block_manager.discard_offloads(out.offload)
        for seq in out.copied_into + [s for s in out.preempted if s.status is S.SWAPPED]:
            if seq.status in (S.RUNNING, S.PREFILLING):
                self.running.remove(seq)
            elif seq.status is S.SWAPPED:
                self.swapped.remove(seq)
            else:
                continue
            self._recompute_later(seq)

    # -- after the forward ---------------------------------------------------------------------
    def update(self, out: SchedulerOutput, token_ids: list[int], logprobs: list | None = None,
               num_accepted: list[int] | None = None) -> list[Sequence]:
        """Record what the step computed and sampled; returns the sequences that got a token.

        With drafts (chapter 17), ``token_ids`` holds each row's last token (the
        bonus) and ``num_accepted`` how many of its drafts came before it."""
        now = time.perf_counter()
        samples = iter(zip(token_ids, logprobs or [None] * len(token_ids), num_accepted or [0] * len(token_ids)))
        produced = []
        for c in out.chunks:
            seq = c.seq
            decode = seq.status is S.RUNNING
            seq.cached_token_count = c.end - len(c.spec_token_ids)
            seq.metrics.num_prefilled_tokens = seq.prefilled_token_count
            self.block_manager.register_computed_blocks(seq)
            if not c.samples:
                continue
            seq.status = S.RUNNING
            for child in c.sample_seqs[1:]:  # before seq may finish and free the blocks they share
                self._fork(seq, child)
            seq.forks = []
            for s in c.sample_seqs:
                token, lp, accepted = next(samples)
                if c.spec_token_ids:
                    s.draft_misses = 0 if accepted else s.draft_misses + 1
                    s.draft_resume_step = self.step_index + backoff_steps(s.draft_misses)
                    self._append_verified(s, c.spec_token_ids, accepted, token, now)
                else:
                    self._append_token(s, token, lp, now)
                    s.new_token_count = 1
                if self.spec and decode:
                    self.spec_stats.observe_decode(s.new_token_count)
                produced.append(s)
        return produced

    def _append_verified(self, seq: Sequence, drafts: list[int], accepted: int, bonus: int, now: float) -> None:
        """Append ``drafts[:accepted]`` and the bonus token, stopping where a stop condition ends the request;
        then roll back: blocks past the accepted tokens (rejected drafts' KV only) go back to the pool (chapter 17).
        The acceptor does both (``SpecAcceptor.commit``, an extension point); ``append`` is one token."""
        self.spec_stats.observe_draft(len(drafts), accepted)
        seq.new_token_count = 0

        def append(token: int) -> bool:
            self._append_token(seq, token, None, now)
            seq.new_token_count += 1
            return seq.is_finished  # its blocks are free already

        self.acceptor.commit(seq, drafts[:accepted] + [bonus], append)

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (another sample of ``parent``'s request) starts from ``parent``'s prompt blocks."""
        m, pm = child.metrics, parent.metrics
        m.first_scheduled_time, m.num_cached_tokens = pm.first_scheduled_time, pm.num_cached_tokens
        copies = self.block_manager.fork(parent, child) if len(self.running) < self.config.max_num_seqs else None
        if copies is None:  # no room beside it: it queues, and computes its prompt again
            child.status = S.WAITING
            self.waiting.push(child, self.step_index, front=True)
            return
        child.status = S.RUNNING
        self.running.append(child)
        self._copies.extend(copies)
        self._copied_into.append(child)

    def _append_token(self, seq: Sequence, token: int, logprobs, now: float) -> None:
        """Append one sampled token, advance the sample's grammar by it (chapter 19), apply the stop rules."""
        if seq.grammar is not None and not seq.grammar.accept(token):  # a sampler that ignored the mask
            seq.error = f"token {token} is not allowed by the request's structured_outputs constraint here"
            self.finish(seq, S.FINISHED_ERROR)
            return
        seq.output_token_ids.append(token)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        m = seq.metrics
        m.num_output_tokens += 1
        m.token_times.append(now)
        if m.first_token_time is None:
            m.first_token_time = now
        status = self._stop_status(seq, token)
        if status is not None:
            self.finish(seq, status)

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        p = seq.params
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return S.FINISHED_STOPPED
        if token in self.eos_token_ids and not p.ignore_eos:
            return S.FINISHED_STOPPED
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return S.FINISHED_LENGTH
        if seq.grammar is not None and seq.grammar.is_terminated():  # its grammar ended (EOS, even with ignore_eos)
            return S.FINISHED_STOPPED
        return None


class MiniScheduler(Scheduler):
    """minivllm's own scheduler (the engine's default ``scheduler_cls``): exercise 06's passes, 09's chunk size and
    10's preemption, and the drafts of chapter 17 in ``schedule_running``."""

    def schedule_running(self, out: SchedulerOutput) -> None:
        order = sorted(self.running, key=lambda s: (s.status is not S.RUNNING, s.rank))
        for i, seq in enumerate(order):
            if seq not in self.running:  # preempted by a sequence before it in this loop
                continue
            n = self.num_new_tokens(seq, seq.cached_token_count, out)
            drafts = self.propose(seq, n, out, len(order) - i - 1) if self.spec else []
            if drafts and self.block_manager.allocate(
                seq, seq.cached_token_count + n + len(drafts)
            ):
                # the drafts' slots were free: nobody is preempted for them
                out.add(self.chunk(seq, n, drafts))
            elif n and self.reserve_blocks(seq, seq.cached_token_count + n, out):
                out.add(self.chunk(seq, n))

    def schedule_waiting(self, out: SchedulerOutput) -> None:
        bm = self.block_manager
        while len(self.waiting) and self.has_room(out):
            seq = self.waiting.peek()
            hits = bm.lookup_prefix(seq)
            restored = bm.lookup_offloaded(seq, len(hits)) if self.config.kv_offload_blocks else []
            cached = (len(hits) + len(restored)) * bm.block_size
            n = self.num_new_tokens(seq, cached, out)
            # The watermark keeps headroom for running sequences (new ones only; none running,
            # nothing to keep).
            watermark = seq.metrics.first_scheduled_time is None and bool(self.running)
            if not n or not bm.allocate(
                seq, cached + n, hits, watermark, *([restored] if restored else [])
            ):
                break  # first come, first served: nobody overtakes a request that does not fit
            if restored:  # its KV arrives by this step's restore copies (chapter 14)
                out.copied_into.append(seq)
            self.waiting.pop()
            seq.cached_token_count = cached
            bm.record_prefix_lookup(seq, cached)
            self.start(seq, n, out)

    def num_new_tokens(self, seq: Sequence, cached: int, out: SchedulerOutput) -> int:
        cfg = self.config
        budget = cfg.max_num_batched_tokens - out.num_batched_tokens
        n = seq.num_tokens - cached
        if cfg.enable_chunked_prefill:
            n = min(n, cfg.max_prefill_chunk_size)
        if n <= budget:
            return n
        running = seq.status in (S.RUNNING, S.PREFILLING)
        cut = cfg.enable_chunked_prefill or running or n > cfg.max_num_batched_tokens
        return budget if cut else 0

    def choose_victim(self, requester: Sequence) -> Sequence | None:
        below = [s for s in self.running if s.rank > requester.rank]
        unprotected = [s for s in below if s.protected_until_step <= self.step_index]
        return max(unprotected or below, key=lambda s: s.rank, default=None)

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
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
            seq.status = S.SWAPPED
            self.swapped.append(seq)
        else:
            seq.metrics.num_recomputed_tokens += seq.cached_token_count
            self.num_recomputed_tokens += seq.cached_token_count
            self._recompute_later(seq)
