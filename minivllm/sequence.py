"""A request's life inside the engine: the ``Sequence`` state machine (chapters 06 and 09).

::

    WAITING -> PREFILLING -> RUNNING -> FINISHED_*      (a prompt, in one chunk or several)
    RUNNING/PREFILLING -> WAITING                       (preempted: recompute)
    RUNNING/PREFILLING -> SWAPPED -> PREFILLING         (preempted: swap, then back)
    any state -> FINISHED_ABORTED                       (aborted)
    any state -> FINISHED_ERROR                         (this request failed; the others go on)

A request with ``n > 1`` samples runs one sequence through its prompt; at its
first sample the others (``forks``) are born from it, sharing its blocks.

Token bookkeeping, with ``tokens = prompt + generated``:

- ``cached_token_count``: tokens whose KV is written in the cache (prefix-cache
  hits included). The next forward feeds ``tokens[cached_token_count:]``.
- ``prefilled_token_count``: the prompt tokens among those.
- ``num_cached_tokens``: prompt tokens served from the prefix cache.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from minivllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # its constraint compiling, outside the scheduler (chapter 19)
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        return {"FINISHED_STOPPED": "stop", "FINISHED_LENGTH": "length", "FINISHED_ABORTED": "abort",
                "FINISHED_ERROR": "error"}.get(self.name)


@dataclass
class RequestMetrics:
    """Per-request times (``time.perf_counter`` seconds) and token counts (chapter 11's metrics)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token appeared
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    num_prefilled_tokens: int = 0  # prompt tokens whose KV is written (progress of a chunked prefill)
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_swapped_bytes: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


_seq_ids = itertools.count()


class Sequence:
    """One request (or one of its ``n`` samples): its tokens, its place in the state machine and its KV blocks."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, arrival_time: float | None = None, prompt: str | None = None, index: int = 0):
        self.request_id = request_id
        self.seq_id = next(_seq_ids)  # unique, even among the samples of one request
        self.index = index  # which of the request's n samples
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.priority = priority
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []  # physical KV block ids, in token order
        self.cpu_block_table: list[int] = []  # while SWAPPED: where its KV waits in the CPU pool
        self.enqueued_step = 0  # scheduler step at which it last joined the waiting queue (aging)
        self.protected_until_step = -1  # not chosen as a preemption victim before this step
        self.cached_token_count = 0
        self.metrics = RequestMetrics(arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
                                      num_prompt_tokens=len(self.prompt_token_ids))
        self.generator = None  # per-request torch.Generator when params.seed is set
        self.forks: list[Sequence] = []  # the request's other samples, born at this one's first sample
        self.output_logprobs: list[dict] = []  # per output token, when params.logprobs is set
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.error: str | None = None  # why it finished with FINISHED_ERROR
        self.new_token_count = 1  # output tokens the latest step appended (up to k + 1 with drafts, chapter 17)
        self.draft_misses = 0  # drafts in a row with no token accepted (chapter 17's backoff)
        self.draft_resume_step = 0  # the first scheduler step at which it may be drafted again
        # Its constraint's matcher (chapter 19), advanced by each appended token; kept when it is preempted (by
        # recompute or swap: its output tokens are kept, so the grammar's state after them still holds).
        self.grammar = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prefilled_token_count(self) -> int:
        return min(self.cached_token_count, self.num_prompt_tokens)

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.cached_token_count

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def rank(self) -> tuple:
        """Who goes first when blocks run short: lower priority value, then earlier arrival (chapter 10)."""
        return (self.priority, self.metrics.arrival_time, self.seq_id)

    def drop_last_tokens(self, count: int) -> None:
        """Forget the last ``count`` output tokens (after a stop string inside a run of accepted drafts, chapter 17)."""
        if count:
            if self.grammar is not None:  # the matcher forgets them too (chapter 19)
                self.grammar.rollback(count)
            del self.output_token_ids[-count:], self.metrics.token_times[-count:]
            self.metrics.num_output_tokens -= count
            self.new_token_count -= count

    def token_slice(self, start: int, stop: int) -> list[int]:
        p = self.num_prompt_tokens
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        return (self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - p):stop - p]) if start < p \
            else self.output_token_ids[start - p:stop - p]

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"cached={self.cached_token_count}, blocks={self.block_table})")
