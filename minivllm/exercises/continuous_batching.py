"""Chapter 06, continuous batching: the check of the reader's scheduling step (decodes first, then
waiting prompts in arrival order while tokens and seats last), against minivllm's scheduler.
"""

from __future__ import annotations

import random

from minivllm.block_manager import BlockManager
from minivllm.config import EngineConfig
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import Scheduler
from minivllm.sequence import Sequence, SequenceStatus

__all__ = ["check_schedule_step", "reference_schedule_step"]


def reference_schedule_step(running: list[str], waiting: list[tuple[str, int]], token_budget: int,
                            max_num_seqs: int) -> list[tuple[str, int]]:
    """One step of minivllm's own :class:`~minivllm.scheduler.Scheduler` on the exercise's simplified state.

    ``running`` are request ids that decode (one token each); ``waiting`` are
    ``(request id, prompt length)`` in arrival order. Plenty of KV blocks, no
    chunked prefill. Returns the step's batch as ``(request id, num_tokens)``.
    """
    config = EngineConfig(model="tiny-random", max_num_seqs=max_num_seqs, max_num_batched_tokens=token_budget)
    blocks = 2 * len(running) + sum(config.blocks_for(n) for _, n in waiting) + 1
    bm = BlockManager(blocks, config.block_size)
    scheduler = Scheduler(config, bm, max_model_len=10**6)
    params = SamplingParams(temperature=0.0, max_tokens=1000)
    for rid in running:  # a 4-token prompt and one generated token whose KV is not cached yet
        seq = Sequence(rid, [1, 2, 3, 4], params)
        seq.output_token_ids = [5]
        seq.cached_token_count = 4
        bm.allocate(seq, 5)
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
    for rid, n in waiting:
        scheduler.add(Sequence(rid, [1] * n, params))
    return [(c.seq.request_id, c.num_tokens) for c in scheduler.schedule().chunks]


_SCHEDULE_CASES = [  # (running, waiting, token_budget, max_num_seqs)
    (["a", "b"], [("c", 5), ("d", 3)], 16, 4),  # everything fits
    (["a", "b", "c"], [("d", 2), ("e", 2)], 64, 4),  # one seat left
    (["a", "b", "c"], [("d", 14)], 16, 8),  # the decodes use 3 of the 16 tokens: 14 do not fit
    (["a", "b"], [("c", 14)], 16, 8),  # exactly fills the budget: admitted
    ([], [("a", 10), ("b", 20), ("c", 2)], 24, 8),  # b does not fit: c may not overtake it
    ([], [("a", 8), ("b", 8), ("c", 1)], 16, 8),  # the budget is used up exactly
    (["a", "b"], [("c", 1)], 8, 2),  # no seat at all
    (["a", "b", "c"], [], 8, 4),  # nothing waiting
    ([], [], 8, 4),  # nothing at all
    ([], [("a", 3), ("b", 3), ("c", 3), ("d", 3)], 64, 3),  # seats run out before tokens
    (["x"], [("a", 7), ("b", 1)], 8, 4),  # a fills the budget to the last token, b waits
]


def _random_schedule_cases(num: int, seed: int = 0):
    rng = random.Random(seed)
    cases = []
    for _ in range(num):
        seqs = rng.randint(1, 6)
        budget = rng.randint(seqs, 40)
        running = [f"r{i}" for i in range(rng.randint(0, seqs))]
        waiting = [(f"w{i}", rng.randint(1, budget)) for i in range(rng.randint(0, 6))]
        cases.append((running, waiting, budget, seqs))
    return cases


def _schedule_hint(running, waiting, budget, seqs, expected, got) -> str:
    got_ids = [rid for rid, _ in got]
    tokens = sum(n for _, n in got)
    if tokens > budget:
        return f"the batch holds {tokens} tokens, over token_budget={budget} (decode tokens count too)"
    if len(got) > seqs:
        return f"the batch holds {len(got)} requests, over max_num_seqs={seqs} (running requests hold seats too)"
    if got_ids[:len(running)] != list(running) and set(running) <= set(got_ids):
        return "decodes come first: every running request gets its 1 token before any waiting request"
    if not set(running) <= set(got_ids):
        return "every running request decodes 1 token in every step (they always fit)"
    prompt = dict(waiting)
    if any(rid in prompt and n != prompt[rid] for rid, n in got):
        return "a waiting request is admitted whole: num_tokens is its prompt length"
    admitted = [rid for rid in got_ids if rid in prompt]
    order = [rid for rid, _ in waiting]
    if admitted != order[:len(admitted)]:
        return ("first come, first served: stop at the first waiting request that does not fit, "
                "never skip it for a later, smaller one")
    if len(admitted) < len(order) and [rid for rid, _ in expected] != got_ids:
        rid = order[len(admitted)]
        return (f"{rid!r} fits ({tokens} + {prompt[rid]} <= {budget} tokens, "
                f"{len(got)} < {seqs} requests) but was not admitted")
    return "compare the batches above"


def check_schedule_step(fn) -> None:
    """Check ``fn(running, waiting, token_budget, max_num_seqs) -> [(request id, num_tokens), ...]`` (chapter 06).

    Compared with one step of minivllm's own scheduler
    (:func:`reference_schedule_step`) on hand-made cases and 60 random ones.
    """
    cases = _SCHEDULE_CASES + _random_schedule_cases(60)
    for running, waiting, budget, seqs in cases:
        what = f"schedule_step(running={running}, waiting={waiting}, token_budget={budget}, max_num_seqs={seqs})"
        expected = reference_schedule_step(running, waiting, budget, seqs)
        got = fn(list(running), [tuple(w) for w in waiting], budget, seqs)
        try:
            got = [(str(rid), int(n)) for rid, n in got]
        except (TypeError, ValueError):
            raise AssertionError(f"{what}: expected a list of (request id, num_tokens) pairs, got {got!r}") from None
        if got != expected:
            raise AssertionError(f"{what}:\n  expected {expected}\n  got      {got}\n  "
                                 f"{_schedule_hint(running, waiting, budget, seqs, expected, got)}")
    print(f"check_schedule_step: all {len(cases)} cases match minivllm's scheduler.")
