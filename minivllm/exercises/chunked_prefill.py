"""Chapter 09, chunked prefill: the check of the reader's ``num_new_tokens`` (a ``Scheduler`` subclass), the
size of every chunk, on targeted schedules and then inside the live engine, schedule for schedule.
"""

from __future__ import annotations

from minivllm.exercises._common import own_part, say
from minivllm.exercises.live import chat_prompts, check_live, greedy
from minivllm.models import load_tokenizer
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import MiniScheduler
from minivllm.sequence import Sequence
from minivllm.simulator import make_scheduler

__all__ = ["check_chunked_prefill", "long_chat", "METHODS"]

METHODS = ("num_new_tokens",)  # what exercise 09 writes


def _seq(rid: str, n: int, max_tokens: int = 2, first: int = 1, outputs: int = 0) -> Sequence:
    """``n`` prompt tokens; with ``outputs``, a sequence preempted by recompute after that many output tokens."""
    seq = Sequence(rid, list(range(first, first + n)), SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                      ignore_eos=True))
    seq.output_token_ids = list(range(9000, 9000 + outputs))
    return seq


def _run(cls, arrivals: dict[int, list[Sequence]], steps: int, what: str, **config) -> list[list[tuple]]:
    """Step a scheduler (fake model, token 7) ``steps`` times, adding ``arrivals[t]`` before step ``t``.

    Returns each step's chunks ``(request id, start, end)``; checks the token budget and the block invariants.
    """
    sched = make_scheduler(config.pop("num_blocks", 1024), config.pop("block_size", 4), scheduler_cls=cls, **config)
    schedule = []
    for t in range(steps):
        for seq in arrivals.get(t, []):
            sched.add(seq)
        try:
            out = sched.schedule()
            sched.update(out, [7] * sum(len(c.sample_seqs) for c in out.chunks))
            sched.block_manager.check_invariants(sched.sequences)
        except Exception as e:  # the reader's code failing on this case, or a broken pool
            raise AssertionError(f"{what}: step {t} failed ({type(e).__name__}: {e})") from None
        schedule.append([(c.seq.request_id, c.start, c.end) for c in out.chunks])
        if out.num_batched_tokens > sched.config.max_num_batched_tokens:
            raise AssertionError(f"{what}: step {t} runs {out.num_batched_tokens} tokens, over the budget of "
                                 f"{sched.config.max_num_batched_tokens}: {schedule[-1]} (request, start, end)\n  "
                                 f"the chunk gets the budget left after what the step already holds: "
                                 f"max_num_batched_tokens - out.num_batched_tokens (the decodes took theirs first)")
    return schedule


def _chunks_of(schedule, rid: str, below: int | None = None) -> list[tuple[int, int]]:
    return [(s, e) for step in schedule for r, s, e in step if r == rid and (below is None or s < below)]


def _expect(got, expected, what: str, hint: str) -> None:
    if got != expected:
        raise AssertionError(f"{what}:\n  expected {expected}\n  got      {got}\n  {hint}")


_CHUNKED = dict(enable_chunked_prefill=True, max_num_seqs=8)


def _seven_in_threes(cls) -> None:
    schedule = _run(cls, {0: [_seq("r", 7)]}, 4, "a 7-token prompt alone, chunks of 3", max_num_batched_tokens=64,
                    max_prefill_chunk_size=3, **_CHUNKED)
    _expect(_chunks_of(schedule, "r", below=7), [(0, 3), (3, 6), (6, 7)],
            "a 7-token prompt alone, max_prefill_chunk_size=3: its prefill chunks (start, end)",
            "with chunked prefill a chunk holds at most max_prefill_chunk_size tokens: "
            "min(what the prompt still lacks, the chunk size, the budget left)")


def _twelve_thousand(cls) -> None:
    prefix = _seq("prefix", 8000, max_tokens=1)
    long = _seq("12k", 12000, max_tokens=1)
    schedule = _run(cls, {0: [prefix], 8: [long]}, 12, "the source notes' 12,000-token prompt",
                    block_size=16, num_blocks=1300, max_num_batched_tokens=2048, max_prefill_chunk_size=1000,
                    enable_prefix_caching=True, **_CHUNKED)
    _expect(_chunks_of(schedule, "12k"), [(8000, 9000), (9000, 10000), (10000, 11000), (11000, 12000)],
            "a 12,000-token prompt whose first 8,000 tokens are cached (an 8,000-token prompt ran first), "
            "chunks of 1,000", "four chunks, counted from the 8,000 cached tokens (the argument `cached`)")


def _decodes_take_theirs_first(cls) -> None:
    arrivals = {0: [_seq(f"s{i}", 2, max_tokens=12, first=100 * i + 1) for i in range(4)], 1: [_seq("L", 40)]}
    schedule = _run(cls, arrivals, 5, "four requests decoding while a 40-token prompt arrives, budget 16, chunks of 32",
                    max_num_batched_tokens=16, max_prefill_chunk_size=32, **_CHUNKED)
    got = _chunks_of(schedule, "L", below=40)
    hint = ("with chunked prefill a chunk that does not fit is cut to the budget left, never refused: the prompt "
            "should run 12 tokens a step beside the decodes" if not got else
            "the decodes take their 4 tokens first; the chunk gets the budget left, 16 - 4 = 12 "
            "(max_num_batched_tokens - out.num_batched_tokens)")
    _expect(got, [(0, 12), (12, 24), (24, 36), (36, 40)],
            "four requests decoding while a 40-token prompt arrives, max_num_batched_tokens=16, chunks of 32", hint)


def _prefilling_before_waiting(cls) -> None:
    arrivals = {0: [_seq("L1", 20, first=100), _seq("L2", 20, first=200)], 1: [_seq("L3", 20, first=300)]}
    schedule = _run(cls, arrivals, 3, "two 20-token prompts, budget 16, chunks of 12, a third arriving at step 1",
                    max_num_batched_tokens=16, max_prefill_chunk_size=12, **_CHUNKED)
    _expect(schedule[:2], [[("L1", 0, 12), ("L2", 0, 4)], [("L1", 12, 20), ("L2", 4, 12)]],
            "L1 and L2 (20 tokens each) arrive, max_num_batched_tokens=16, chunks of 12; L3 arrives at step 1. "
            "The first two steps", "L2 starts in the 4 tokens L1 leaves; next step both continue (PREFILLING goes "
            "before WAITING) and L3 waits: a PREFILLING sequence's chunk is cut to the budget left, never refused")


def _chunk_not_dividing_the_block(cls) -> None:
    first = _seq("first", 9, max_tokens=1)  # leaves its first 2 blocks (8 tokens) in the prefix cache
    again = _seq("again", 21, max_tokens=1)  # the same first 8 tokens, then 13 more
    schedule = _run(cls, {0: [first], 3: [again]}, 7, "blocks of 4, chunks of 6, a prompt with 8 cached tokens",
                    block_size=4, max_num_batched_tokens=64, max_prefill_chunk_size=6, enable_prefix_caching=True,
                    **_CHUNKED)
    _expect(_chunks_of(schedule, "first"), [(0, 6), (6, 9)], "a 9-token prompt, blocks of 4, chunks of 6",
            "a chunk may end inside a block: chunks of 6 tokens, the last one what is left")
    got = _chunks_of(schedule, "again")
    hint = ("count the chunks from the cached tokens: each is min(remaining, chunk size, budget left); they are "
            "not aligned to multiples of the chunk size" if got[:1] == [(8, 12)] else
            "start after the 8 cached tokens, chunks of 6")
    _expect(got, [(8, 14), (14, 20), (20, 21)], "a 21-token prompt whose first 8 tokens are cached (blocks of 4), "
            "chunks of 6", hint)


_WHOLE = dict(enable_chunked_prefill=False, max_num_seqs=8, max_num_batched_tokens=16)


def _whole_or_wait(cls) -> None:
    arrivals = {0: [_seq("d", 2, max_tokens=4)], 1: [_seq("w", 16, first=100)]}
    schedule = _run(cls, arrivals, 5, "without chunked prefill, budget 16, one request decoding, a 16-token prompt",
                    **_WHOLE)
    _expect(_chunks_of(schedule, "w", below=16), [(0, 16)],
            "without chunked prefill, max_num_batched_tokens=16: d decodes while a 16-token prompt w waits. w's "
            "prefill chunks", "without chunked prefill a new prompt runs whole or waits: return 0 when it does not "
            "fit the budget left (15 while d decodes); it runs whole once d is done")


def _resumed_without_chunking(cls) -> None:
    resumed = _seq("resumed", 12, max_tokens=10, outputs=8)  # preempted by recompute: 12 + 8 = 20 tokens to compute
    schedule = _run(cls, {0: [resumed]}, 3, "without chunked prefill, budget 16, a sequence preempted after 8 "
                    "output tokens (12 + 8 = 20 tokens to recompute)", **_WHOLE)
    _expect(_chunks_of(schedule, "resumed", below=20), [(0, 16), (16, 20)],
            "without chunked prefill, max_num_batched_tokens=16: a sequence that must recompute its 12-token prompt "
            "and 8 output tokens", "a sequence that could never run whole (20 tokens > max_num_batched_tokens: one "
            "preempted by recompute) is cut to the budget even without chunked prefill, or it waits forever")


def _running_is_cut(cls) -> None:
    arrivals = {0: [_seq("d", 2, max_tokens=8)], 1: [_seq("resumed", 19, max_tokens=14, outputs=12)]}
    schedule = _run(cls, arrivals, 4, "without chunked prefill, budget 16, d decoding and a sequence resumed with 31 "
                    "tokens to recompute", **_WHOLE)
    _expect(_chunks_of(schedule, "resumed", below=31), [(0, 15), (15, 30), (30, 31)],
            "without chunked prefill, max_num_batched_tokens=16: d decodes, and a sequence resumed after a preemption "
            "recomputes 31 tokens. Its chunks", "once it runs (PREFILLING) it is cut to the budget left (15 beside "
            "d's decode), never made to wait: it holds blocks, and the best-ranked running sequence must compute a "
            "token every step (the scheduler's liveness argument)")


_CASES = (_seven_in_threes, _chunk_not_dividing_the_block, _decodes_take_theirs_first, _prefilling_before_waiting,
          _twelve_thousand, _whole_or_wait, _resumed_without_chunking, _running_is_cut)


def long_chat(tokenizer, words: int = 30) -> list[int]:
    """A chat prompt with a paragraph of notes to summarise (chapter 09's long prompt among short ones)."""
    notes = " ".join(("the engine", "schedules", "one chunk", "per step", "beside", "the decodes")[i % 6]
                     for i in range(words))
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"Summarise my notes: {notes}."}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_chunked_prefill(cls, live: bool = True) -> None:
    """Check a ``Scheduler`` subclass's ``num_new_tokens``, the size of every chunk (chapter 09).

    Targeted schedules with a fake model (a 7-token prompt in chunks of 3,
    decodes first and the chunk in the budget left, PREFILLING before
    WAITING, a chunk size that does not divide the block size with a cached
    prefix, the source notes' 12,000 tokens with 8,000 cached; without
    chunking: whole or wait, and the liveness cuts), stopping at the first
    failure; then, unless ``live=False``, the live engine on SmolLM2 with
    chunks of 6 over blocks of 4, step for step. An empty subclass is "not
    written yet".
    """
    cls = own_part(cls, METHODS, MiniScheduler)
    for case in _CASES:
        case(cls)
    say("check_chunked_prefill: the chunk size, the budget left, PREFILLING first, cached prefixes, and the cuts "
          "without chunking are right.")
    if not live:
        return
    tok = load_tokenizer("smollm2-135m")
    prompts = chat_prompts(tok, 2) + [long_chat(tok)] + chat_prompts(tok, 4)[3:]
    requests = [(f"r{i}", p, greedy(3)) for i, p in enumerate(prompts)]
    check_live("your chunked prefill", requests, parts={"scheduler_cls": cls}, tokenizer=tok, same_schedule=True,
               enable_chunked_prefill=True, max_prefill_chunk_size=6, max_num_batched_tokens=10, block_size=4,
               num_blocks=128, max_num_seqs=4)
