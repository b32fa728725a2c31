"""Chapter 09, chunked prefill: the check of the reader's plan of a prompt's prefill chunks, against
the chunks minivllm's scheduler runs for one request.
"""

from __future__ import annotations

import random

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence
from minivllm.simulator import make_scheduler

__all__ = ["check_plan_chunks", "reference_plan_chunks"]


def reference_plan_chunks(prompt_len: int, num_cached: int, chunk_size: int) -> list[tuple[int, int]]:
    """The prefill chunks ``(start, end)`` minivllm's :class:`~minivllm.scheduler.Scheduler` runs (chapter 09).

    One request, its first ``num_cached`` prompt tokens in the prefix cache
    (left there by an earlier request; blocks of one token, so any count can
    hit), a token budget that never binds: the scheduler is stepped until the
    prompt is prefilled and the chunks it scheduled are returned.
    """
    scheduler = make_scheduler(num_blocks=prompt_len + num_cached + 2, block_size=1, max_num_seqs=1,
                               max_num_batched_tokens=chunk_size, enable_chunked_prefill=True,
                               max_prefill_chunk_size=chunk_size, enable_prefix_caching=True)
    prompt = list(range(1, prompt_len + 1))
    earlier = Sequence("earlier", prompt[:num_cached] + [0], SamplingParams(temperature=0.0, max_tokens=1))
    seq = Sequence("reference", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    if num_cached:
        _run_alone(scheduler, earlier)
    return _run_alone(scheduler, seq)


def _run_alone(scheduler, seq: Sequence) -> list[tuple[int, int]]:
    """Step ``scheduler`` with only ``seq`` in it until it finishes; its chunks ``(start, end)``."""
    scheduler.add(seq)
    chunks = []
    while not seq.is_finished:
        out = scheduler.schedule()
        chunks += [(c.start, c.end) for c in out.chunks]
        scheduler.update(out, [0] * sum(c.samples for c in out.chunks))
    return chunks


_PLAN_CASES = [  # (prompt_len, num_cached, chunk_size)
    (7, 0, 3), (12000, 8000, 1000), (10, 0, 10), (10, 0, 11), (1, 0, 4), (17, 16, 4), (33, 16, 16),
    (20, 6, 8), (5, 0, 1), (100, 37, 25), (64, 0, 16), (9, 8, 100),
]


def _random_plan_cases(num: int, seed: int = 0):
    rng = random.Random(seed)
    cases = []
    for _ in range(num):
        n = rng.randint(1, 300)
        cases.append((n, rng.choice([0, rng.randint(0, n - 1)]), rng.randint(1, 64)))
    return cases


def _plan_hint(n, cached, chunk, expected, got) -> str:
    if not got:
        return "every prompt needs at least one chunk: the one that ends at the last token"
    if got[0][0] != cached:
        return (f"start at num_cached={cached}: the cached prefix is not computed again"
                if got[0][0] == 0 else f"the first chunk starts at num_cached={cached}")
    if any(b - a > chunk for a, b in got):
        return f"no chunk may hold more than chunk_size={chunk} tokens"
    if [(a, b + 1) for a, b in got] == expected:
        return "end is exclusive: a chunk (start, end) holds tokens start, ..., end - 1"
    if any(a != b for (_, a), (b, _) in zip(got, got[1:])):
        return "each chunk starts where the previous one ended"
    if got[-1][1] != n:
        return f"the last chunk ends exactly at prompt_len={n}"
    if len(got) > len(expected):
        return "chunks are counted from num_cached, full chunk_size each, not aligned to multiples of chunk_size"
    return "compare the lists above"


def check_plan_chunks(fn) -> None:
    """Check ``fn(prompt_len, num_cached, chunk_size) -> [(start, end), ...]``, a prompt's prefill chunks (chapter 09).

    Compared with the chunks minivllm's scheduler actually runs for one
    request (:func:`reference_plan_chunks`) on hand-made cases and 60 random ones.
    """
    cases = _PLAN_CASES + _random_plan_cases(60)
    for n, cached, chunk in cases:
        what = f"plan_chunks(prompt_len={n}, num_cached={cached}, chunk_size={chunk})"
        got = fn(n, cached, chunk)
        try:
            got = [(int(a), int(b)) for a, b in got]
        except (TypeError, ValueError):
            raise AssertionError(f"{what}: expected a list of (start, end) pairs, got {got!r}") from None
        expected = reference_plan_chunks(n, cached, chunk)
        if got != expected:
            show = lambda x: str(x) if len(x) <= 8 else f"{x[:4]} ... {x[-2:]} ({len(x)} chunks)"  # noqa: E731
            raise AssertionError(f"{what}:\n  expected {show(expected)}\n  got      {show(got)}\n  "
                                 f"{_plan_hint(n, cached, chunk, expected, got)}")
    print(f"check_plan_chunks: all {len(cases)} cases match minivllm's scheduler.")
