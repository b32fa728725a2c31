"""Chapter 06, continuous batching: the check of the reader's scheduler passes ``schedule_running`` (decodes
first) and ``schedule_waiting`` (admission under the token, sequence and block budgets), a ``Scheduler``
subclass, on targeted steps and then inside the live engine, schedule for schedule.
"""

from __future__ import annotations

from minivllm.exercises._common import own_part, say
from minivllm.exercises.live import chat_prompts, check_live, greedy
from minivllm.models import load_tokenizer
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import MiniScheduler
from minivllm.sequence import Sequence
from minivllm.simulator import make_scheduler

__all__ = ["check_scheduler", "METHODS"]

METHODS = ("schedule_running", "schedule_waiting")  # what exercise 06 writes


def _seq(rid: str, n: int, first: int = 1, max_tokens: int = 50) -> Sequence:
    return Sequence(rid, list(range(first, first + n)), SamplingParams(temperature=0.0, max_tokens=max_tokens))


def _step(scheduler) -> list[tuple[str, int, int]]:
    """One step with a fake model that samples token 7: the chunks as (request id, start, num_tokens)."""
    out = scheduler.schedule()
    scheduler.update(out, [7] * sum(len(c.sample_seqs) for c in out.chunks))
    scheduler.block_manager.check_invariants(scheduler.sequences)
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


def _expect_step(scheduler, expected, what: str, hint: str) -> None:
    try:
        got = _step(scheduler)
    except Exception as e:  # a broken invariant, or the reader's code failing on this case
        if any(not s.block_table for s in scheduler.running):
            hint = ("a sequence was admitted without blocks for its tokens: claim them with "
                    "self.block_manager.allocate(...) first, and wait when it returns False")
        raise AssertionError(f"{what}: the step failed ({type(e).__name__}: {e}); {hint}") from None
    if got != expected:
        raise AssertionError(f"{what}:\n  expected the step {expected} (request, start, tokens)\n  got      {got}\n"
                             f"  {hint}")


def _decodes_first(cls) -> None:
    s = make_scheduler(64, 4, scheduler_cls=cls, max_num_batched_tokens=8, max_num_seqs=4, enable_chunked_prefill=True,
                       max_prefill_chunk_size=8)
    s.add(_seq("a", 2))
    _step(s)  # a's prompt: a now decodes
    s.add(_seq("b", 30, first=100))
    _step(s)  # a decodes, b starts its prompt: b is PREFILLING
    _expect_step(s, [("a", 3, 1), ("b", 7, 7)], "a decodes while b's 30-token prompt continues, budget 8",
                 "decodes first: every RUNNING sequence gets its one token before a PREFILLING one continues")


def _first_come_first_served(cls) -> None:
    s = make_scheduler(64, 4, scheduler_cls=cls, max_num_batched_tokens=10, max_num_seqs=4)
    s.add(_seq("a", 3))
    _step(s)
    s.add(_seq("big", 10, first=100)), s.add(_seq("small", 3, first=200))
    _expect_step(s, [("a", 3, 1)], "a decodes (1 token of 10); big (10 tokens) does not fit, small (3) would",
                 "first come, first served: stop at the first waiting request that does not fit; a smaller one "
                 "behind it may not overtake it")


def _seat_budget(cls) -> None:
    s = make_scheduler(64, 4, scheduler_cls=cls, max_num_batched_tokens=64, max_num_seqs=2)
    s.add(_seq("a", 3))
    _step(s)
    s.add(_seq("c", 2, first=100)), s.add(_seq("d", 2, first=200))
    _expect_step(s, [("a", 3, 1), ("c", 0, 2)], "a decodes, c and d wait, max_num_seqs=2",
                 "at most max_num_seqs sequences run at once: admit while len(self.running) < max_num_seqs")


def _token_budget(cls) -> None:
    s = make_scheduler(64, 4, scheduler_cls=cls, max_num_batched_tokens=12, max_num_seqs=8)
    for i in range(3):
        s.add(_seq(f"p{i}", 5, first=100 * i + 1))
    _expect_step(s, [("p0", 0, 5), ("p1", 0, 5)], "three 5-token prompts, max_num_batched_tokens=12",
                 "budget overrun: the step holds at most max_num_batched_tokens tokens, counting those already "
                 "scheduled (out.num_batched_tokens); self.num_new_tokens(seq, cached, out) says 0 when it does not fit")


def _block_budget(cls) -> None:
    s = make_scheduler(4, 4, scheduler_cls=cls, max_num_batched_tokens=64, max_num_seqs=4)
    s.add(_seq("a", 11))
    _step(s)  # a holds 3 of the 4 blocks
    s.add(_seq("b", 8, first=100))
    _expect_step(s, [("a", 11, 1)], "a decodes in 3 of 4 blocks; b's prompt needs 2 blocks",
                 "claim the blocks with self.block_manager.allocate(...) and wait when it returns False")
    if s.sequences[-1].block_table:
        raise AssertionError("b was refused but holds blocks: admit only after allocate succeeded")


def _prefix_hits(cls) -> None:
    s = make_scheduler(64, 4, scheduler_cls=cls, max_num_batched_tokens=64, max_num_seqs=4, enable_prefix_caching=True)
    s.add(_seq("first", 13, max_tokens=1))
    _step(s)  # first finishes; its 3 full blocks stay in the prefix cache
    s.add(_seq("again", 13, max_tokens=1))
    _expect_step(s, [("again", 12, 1)], "the same 13-token prompt again, prefix caching on",
                 "look the prompt up first (hits = self.block_manager.lookup_prefix(seq)), give the hits to allocate, "
                 "and start after them (seq.cached_token_count = len(hits) * block_size)")


def check_scheduler(cls, live: bool = True) -> None:
    """Check a ``Scheduler`` subclass's ``schedule_running`` and ``schedule_waiting`` (chapter 06).

    One targeted step per rule (decodes first, first come first served, the
    sequence, token and block budgets, prefix-cache hits), with a fake model,
    stopping at the first failure; then, unless ``live=False``, the live engine
    on SmolLM2, where every step must schedule exactly what minivllm's
    scheduler schedules. An empty subclass is "not written yet".
    """
    cls = own_part(cls, METHODS, MiniScheduler)
    for case in (_token_budget, _seat_budget, _first_come_first_served, _block_budget, _prefix_hits, _decodes_first):
        case(cls)
    say("check_scheduler: decodes first, first come first served, the sequence, token and block budgets and "
          "prefix-cache hits are right.")
    if not live:
        return
    tok = load_tokenizer("smollm2-135m")
    requests = [(f"r{i}", p, greedy(6)) for i, p in enumerate(chat_prompts(tok, 5))]
    check_live("your scheduler", requests, parts={"scheduler_cls": cls}, tokenizer=tok, same_schedule=True,
               block_size=16, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=512)
