"""Continuous batching: which tokens of which requests run in the next step (chapters 06, 09, 10).

Each step fills a token budget (``max_num_batched_tokens``) under a sequence
budget (``max_num_seqs``) and the free KV blocks, in this order:

1. running decodes, one token each (the decode reservation: streams never stall);
2. PREFILLING sequences, the next chunk of their prompt;
3. WAITING sequences, admitted in order while everything still fits.

With chunked prefill a prompt is split into chunks of at most
``max_prefill_chunk_size`` tokens and the budget left; without it, a prompt
runs whole or waits. Swapped-out sequences come back (step 2.5) before any
WAITING one is admitted.

When a running sequence needs a block and none is free, the lowest-priority,
latest-arrived running sequence is preempted (chapter 10): "recompute" frees
its blocks and puts it back at the front of the queue; "swap" copies its
blocks to the CPU pool (recompute if that is full). A sequence just resumed is
protected for ``preemption_protection_steps`` steps, so two requests cannot
evict each other on every step (thrashing). Pure Python: no tensors here; the
swap copies to make are listed in the ``SchedulerOutput`` for the engine.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from minivllm.block_manager import BlockManager
from minivllm.config import EngineConfig
from minivllm.model_runner import ScheduledChunk
from minivllm.sequence import Sequence, SequenceStatus

S = SequenceStatus


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block), copied first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block), copied next

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: set[int] = frozenset(), kv_bytes_per_block: int = 0):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.kv_bytes_per_block = kv_bytes_per_block
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # RUNNING and PREFILLING, in admission order
        self.swapped: deque[Sequence] = deque()
        self.step_index = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.num_swapped_bytes = 0

    # -- queues --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.enqueued_step = self.step_index
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def sequences(self) -> list[Sequence]:
        return list(self.running) + list(self.swapped) + list(self.waiting)

    def abort(self, seq: Sequence) -> None:
        """Remove ``seq`` from whatever state it is in and free every block it holds (device and CPU)."""
        for queue in (self.running, self.swapped, self.waiting):
            if seq in queue:
                queue.remove(seq)
        self.block_manager.free(seq)
        seq.status = S.FINISHED_ABORTED

    # -- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg, bm = self.config, self.block_manager
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        scheduled: set[int] = set()

        for phase in (S.RUNNING, S.PREFILLING):  # decodes first, then unfinished prefills
            for seq in [s for s in self.running if s.status == phase]:
                if seq.status != phase:  # preempted earlier in this loop
                    continue
                n = min(seq.num_uncomputed_tokens, budget)
                if phase == S.PREFILLING:
                    n = min(n, cfg.max_prefill_chunk_size)
                if n == 0:
                    break
                if not self._allocate_or_preempt(seq, seq.cached_token_count + n, scheduled, out):
                    continue  # it was preempted itself
                out.chunks.append(ScheduledChunk(seq, seq.cached_token_count, n))
                scheduled.add(id(seq))
                budget -= n

        # Swapped sequences come back first, then new ones; none in a step that had to preempt.
        while self.swapped and not out.preempted and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.swapped[0]
            n = self._chunk_size(seq, budget)
            if bm.blocks_needed(seq, seq.cached_token_count + n) > bm.num_free_blocks:  # its old blocks too
                break
            self.swapped.popleft()
            pairs = bm.swap_in(seq)
            out.swap_in.extend(pairs)
            seq.metrics.num_swapped_bytes += len(pairs) * self.kv_bytes_per_block
            self.num_swapped_bytes += len(pairs) * self.kv_bytes_per_block
            bm.allocate(seq, seq.cached_token_count + n)
            budget -= self._start(seq, n, out, scheduled)

        while self.waiting and not out.preempted and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self._next_waiting()
            if not seq.block_table:
                seq.cached_token_count = bm.match_prefix(seq)
            n = self._chunk_size(seq, budget)
            new_blocks = bm.blocks_needed(seq, seq.cached_token_count + n)
            # Admission control keeps headroom for the running requests, so it applies to new requests only
            # and only while some are running: an idle engine always admits (else a big request waits forever).
            watermark_ok = (seq.metrics.first_scheduled_time is not None or not self.running
                            or bm.num_free_blocks - new_blocks >= cfg.admission_watermark * bm.num_blocks)
            if n > budget or not watermark_ok or not bm.allocate(seq, seq.cached_token_count + n):
                bm.free(seq)  # give back the prefix-cache hits; try again next step
                seq.cached_token_count = 0
                break
            self.waiting.remove(seq)
            bm.record_prefix_lookup(seq, seq.cached_token_count)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
                seq.metrics.num_cached_tokens = seq.cached_token_count
            budget -= self._start(seq, n, out, scheduled)

        for c in out.chunks:  # a prefill whose chunk reaches the end will sample: it is RUNNING
            if c.end == c.seq.num_tokens:
                c.seq.status = S.RUNNING
        self.step_index += 1
        return out

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """Tokens to feed ``seq`` now: all it lacks, or one chunk when chunked prefill is on."""
        n = seq.num_uncomputed_tokens
        if self.config.enable_chunked_prefill:
            n = min(n, self.config.max_prefill_chunk_size, budget)
        return n

    def _start(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled: set[int]) -> int:
        """Move a sequence (new, resumed or swapped in) into the running batch with its first chunk."""
        seq.status = S.PREFILLING
        if seq.metrics.num_preemptions:  # just resumed: protect it from being evicted again at once
            seq.protected_until_step = self.step_index + self.config.preemption_protection_steps
        self.running.append(seq)
        out.chunks.append(ScheduledChunk(seq, seq.cached_token_count, n))
        scheduled.add(id(seq))
        return n

    def effective_priority(self, seq: Sequence) -> float:
        """Lower runs first; waiting improves it by ``priority_aging_rate`` per step (chapter 10)."""
        return seq.priority - self.config.priority_aging_rate * (self.step_index - seq.enqueued_step)

    def _next_waiting(self) -> Sequence:
        if self.config.scheduling_policy == "fcfs":
            return self.waiting[0]
        return min(self.waiting, key=lambda s: (self.effective_priority(s), s.metrics.arrival_time))

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int, scheduled: set[int],
                             out: SchedulerOutput) -> bool:
        """Make room for ``seq``'s next chunk, preempting others (or ``seq`` itself) if blocks run out."""
        while not self.block_manager.allocate(seq, num_tokens):
            victim = self.choose_victim(seq, scheduled)
            self.preempt(victim, out)
            if victim is seq:
                return False
        return True

    def choose_victim(self, requester: Sequence, scheduled: set[int]) -> Sequence:
        """The lowest-priority, latest-arrived running sequence not yet scheduled and not protected."""
        candidates = [s for s in self.running if id(s) not in scheduled
                      and (s is requester or s.protected_until_step <= self.step_index)]
        return max(candidates, key=lambda s: (s.priority, s.metrics.arrival_time))

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Release ``seq``'s device blocks: swap them to the CPU pool, or drop them to recompute later."""
        bm, m = self.block_manager, seq.metrics
        self.running.remove(seq)
        m.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        if self.config.preemption_mode == "swap" and bm.can_swap_out(seq):
            pairs = bm.swap_out(seq)
            out.swap_out.extend(pairs)
            m.num_swapped_bytes += len(pairs) * self.kv_bytes_per_block
            self.num_swapped_bytes += len(pairs) * self.kv_bytes_per_block
            seq.status = S.SWAPPED
            self.swapped.append(seq)
            return
        bm.free(seq)
        m.num_recomputed_tokens += seq.cached_token_count
        self.num_recomputed_tokens += seq.cached_token_count
        seq.cached_token_count = 0
        seq.status = S.WAITING
        seq.enqueued_step = self.step_index
        self.waiting.appendleft(seq)

    # -- after the forward ---------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[int]) -> list[Sequence]:
        """Record what the step computed and sampled; returns the sequences that got a token."""
        now = time.perf_counter()
        tokens = iter(sampled)
        produced = []
        for c in out.chunks:
            seq = c.seq
            seq.cached_token_count = c.end
            seq.metrics.num_prefilled_tokens = seq.prefilled_token_count
            self.block_manager.register_computed_blocks(seq)
            if not c.samples:
                continue
            token = next(tokens)
            seq.output_token_ids.append(token)
            m = seq.metrics
            m.num_output_tokens += 1
            m.token_times.append(now)
            if m.first_token_time is None:
                m.first_token_time = now
            self._check_stop(seq, token)
            if seq.is_finished:
                m.finish_time = now
                self.running.remove(seq)
                self.block_manager.free(seq)
            produced.append(seq)
        return produced

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in (p.stop_token_ids or ()):
            seq.status = S.FINISHED_STOPPED
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.status = S.FINISHED_LENGTH
