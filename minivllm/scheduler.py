"""Continuous batching: which tokens of which requests run in the next step (chapters 06, 09, 10).

Each step fills a token budget (``max_num_batched_tokens``) under a sequence
budget (``max_num_seqs``) and the free KV blocks, in this order:

1. running decodes, one token each (the decode reservation: streams never stall);
2. PREFILLING sequences, the next chunk of their prompt;
3. WAITING sequences, admitted in order while everything still fits.

With chunked prefill a prompt is split into chunks of at most
``max_prefill_chunk_size`` tokens and the budget left; without it, a prompt
runs whole or waits. When a running sequence needs a block and none is free,
the lowest-priority, latest-arrived running sequence is preempted (its blocks
freed, to be recomputed later). Pure Python: no tensors here.
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

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: set[int] = frozenset()):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # RUNNING and PREFILLING, in admission order
        self.num_preemptions = 0

    # -- queues --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def sequences(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting)

    def abort(self, seq: Sequence) -> None:
        """Remove ``seq`` from whatever state it is in and free every block it holds."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
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
                    continue
                out.chunks.append(ScheduledChunk(seq, seq.cached_token_count, n))
                scheduled.add(id(seq))
                budget -= n

        # No admissions in a step that had to preempt: the pool is full.
        while self.waiting and not out.preempted and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                hit = bm.match_prefix(seq)
                seq.cached_token_count = hit
                if seq.metrics.first_scheduled_time is None:
                    seq.metrics.num_cached_tokens = hit
            n = seq.num_uncomputed_tokens
            if cfg.enable_chunked_prefill:
                n = min(n, cfg.max_prefill_chunk_size, budget)
            if n > budget or not bm.allocate(seq, seq.cached_token_count + n):
                bm.free(seq)  # give back the prefix-cache hits; try again next step
                seq.cached_token_count = 0
                break
            self.waiting.popleft()
            seq.status = S.RUNNING if seq.cached_token_count + n == seq.num_tokens else S.PREFILLING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, seq.cached_token_count, n))
            scheduled.add(id(seq))
            budget -= n

        for c in out.chunks:  # a prefill whose chunk reaches the end will sample: it is RUNNING
            if c.end == c.seq.num_tokens:
                c.seq.status = S.RUNNING
        return out

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int, scheduled: set[int],
                             out: SchedulerOutput) -> bool:
        """Make room for ``seq``'s next chunk, preempting others (or ``seq`` itself) if blocks run out."""
        while not self.block_manager.allocate(seq, num_tokens):
            candidates = [s for s in self.running if id(s) not in scheduled]
            victim = max(candidates, key=lambda s: (s.priority, s.metrics.arrival_time))
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, keep the tokens, wait at the front of the queue."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.metrics.num_preemptions += 1
        seq.metrics.num_recomputed_tokens += seq.cached_token_count
        seq.cached_token_count = 0
        seq.status = S.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

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
