"""Chapter 17, speculative decoding: the check of the reader's acceptance rule and rollback (a ``SpecAcceptor``
subclass with ``accept``, ``commit``, ``rollback`` and ``cut_at_stop``), on targeted cases through the real
scheduler and block manager, and then inside the live engine (``spec_acceptor_cls``) against plain decoding.
"""

from __future__ import annotations

from minivllm.config import cdiv
from minivllm.engine import LLM
from minivllm.exercises._common import own_part, say
from minivllm.exercises.live import _reference, chat_prompts, drive
from minivllm.models import load_tokenizer
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import SchedulerOutput
from minivllm.sequence import Sequence
from minivllm.simulator import make_scheduler
from minivllm.spec_decode import MiniSpecAcceptor, accept_greedy

__all__ = ["check_spec_acceptor", "METHODS"]

METHODS = ("accept", "commit", "rollback", "cut_at_stop")  # what exercise 17 writes

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
BLOCK = 4  # the targeted cases' block size
STOP = 77  # a stop token id inside a run


def _call(what: str, method, *args):
    """The reader's method called; an exception becomes a failure that names the call."""
    try:
        return method(*args)
    except Exception as e:
        raise AssertionError(f"{what}: {method.__name__} raised {type(e).__name__}: {e}") from e


# -- accept: the greedy rule ---------------------------------------------------------------------------------------

ACCEPT_CASES = [  # (what, draft, target)
    ("every draft matches", [5, 6, 7], [5, 6, 7, 8]),
    ("the second draft differs (the third matches again)", [5, 6, 7], [5, 9, 7, 8]),
    ("the first draft differs", [5, 6, 7], [4, 6, 7, 8]),
    ("the first two match, the third differs", [5, 6, 7, 2], [5, 6, 3, 1, 8]),
]


def _check_accept(acceptor) -> None:
    for what, draft, target in ACCEPT_CASES:
        case = f"accept(draft={draft}, target={target}): {what}"
        got = _call(case, acceptor.accept, list(draft), list(target))
        want = accept_greedy(draft, target)
        try:
            got = [int(t) for t in got]
        except TypeError:
            raise AssertionError(f"{case}: expected a list of token ids, got {got!r}") from None
        if got == want:
            continue
        n = len(want) - 1  # drafts accepted
        if got == draft[:n] or (len(got) == len(draft) and got == draft and n == len(draft)):
            hint = (f"you forgot the bonus token: after the {n} accepted drafts, append target[{n}] = {target[n]}, "
                    "the model's own choice at that position (every step yields at least one token, "
                    "and all drafts accepted yields len(draft) + 1)")
        elif len(got) > len(want) and got[:n] == draft[:n]:
            hint = (f"you accepted past the first mismatch: draft[{n}] = {draft[n]} is not target[{n}] = "
                    f"{target[n]}, so the drafts after it were guessed after a token the model did not choose; "
                    f"stop there and append target[{n}]")
        elif got[:n] == draft[:n] and len(got) == len(want):
            hint = (f"the token after the {n} accepted drafts must be target[{n}] = {target[n]} (the model's argmax "
                    f"after the sequence and draft[:{n}]), not {got[-1]}")
        else:
            hint = "keep the drafts while they equal the target's token, then append the target's token there"
        raise AssertionError(f"{case}: returned {got}, expected {want}; {hint}")


# -- commit and rollback: one verified row through the real scheduler ---------------------------------------------

def _decode_row(cls, prompt_len: int, draft: list[int], params: SamplingParams):
    """A scheduler (block size 4, prefix caching) whose one sequence has prefilled its prompt, sampled a token and is
    scheduled for a decode row with ``draft``; the row's chunk is in the returned SchedulerOutput."""
    sched = make_scheduler(16, BLOCK, enable_prefix_caching=True, speculative_config=SPEC, spec_acceptor_cls=cls)
    seq = Sequence("r", list(range(10, 10 + prompt_len)), params)
    sched.add(seq)
    sched.update(sched.schedule(), [40])
    assert sched.block_manager.allocate(seq, seq.cached_token_count + 1 + len(draft))
    out = SchedulerOutput()
    out.add(sched.chunk(seq, 1, draft))
    return sched, seq, out


def _state(sched, seq) -> dict:
    bm = sched.block_manager
    return {"output": list(seq.output_token_ids), "finished": seq.is_finished, "status": seq.status.name,
            "cached": seq.cached_token_count, "blocks": len(seq.block_table),
            "registered": [i for i, b in enumerate(seq.block_table) if bm.blocks[b].hash is not None],
            "cached tokens": {i: bm.blocks[b].tokens for i, b in enumerate(seq.block_table)
                              if bm.blocks[b].hash is not None},  # what a later prompt finds each block under
            "tokens": list(seq.token_ids), "free": bm.num_free_blocks, "new": seq.new_token_count}


COMMIT_CASES = [  # (what, prompt length, draft, accepted, bonus, params); 7 tokens before the drafts
    ("7 tokens (6 prompt, 1 generated), then 4 drafts, none accepted: the bonus token lands on the last slot of "
     "block 1", 6, [50, 51, 52, 53], 0, 60, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
    ("7 tokens, then 4 drafts, 1 accepted: block 2 holds only rejected drafts", 6, [50, 51, 52, 53], 1, 60,
     SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
    ("7 tokens, then 4 drafts, 2 accepted: block 2 holds an accepted draft and rejected ones", 6, [50, 51, 52, 53],
     2, 60, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
    ("7 tokens, then 4 drafts, all accepted, and the bonus token", 6, [50, 51, 52, 53], 4, 60,
     SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
    ("4 drafts all accepted with max_tokens=3 (1 token generated before: 2 more may come)", 6, [50, 51, 52, 53], 4,
     60, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)),
    (f"4 drafts all accepted, the second of them the stop token {STOP}", 6, [50, STOP, 52, 53], 4, 60,
     SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[STOP])),
    ("3 drafts all accepted with max_tokens=5: the bonus token is the last one allowed", 6, [50, 51, 52], 3, 60,
     SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)),
]


def _commit_case(cls, case):
    """The reader's commit and minivllm's on the same row: both states, the reader's scheduler, and the exception
    the reader's commit raised (None if none)."""
    what, prompt_len, draft, accepted, bonus, params = case
    ref_sched, ref_seq, ref_out = _decode_row(MiniSpecAcceptor, prompt_len, draft, params)
    ref_sched.update(ref_out, [bonus], None, [accepted])
    sched, seq, out = _decode_row(cls, prompt_len, draft, params)
    try:
        sched.update(out, [bonus], None, [accepted])
        error = None
    except Exception as e:
        error = e
    return _state(sched, seq), _state(ref_sched, ref_seq), sched, error


def _check_cached_tokens(mine: dict, where: str, raised: str) -> None:
    """Each block in the prefix cache holds, under its hash, the sequence's own tokens at its positions."""
    for i, cached in mine["cached tokens"].items():
        actual = tuple(mine["tokens"][i * BLOCK:(i + 1) * BLOCK])
        if cached != actual:
            raise AssertionError(
                f"{where}: registering computed blocks before appending the tokens: block {i} (positions "
                f"{i * BLOCK}..{i * BLOCK + BLOCK - 1}) is in the prefix cache under the tokens {list(cached)}, but "
                f"the sequence's tokens there are {list(actual)}; when it was registered, the accepted drafts were "
                "not appended yet, so a later prompt that repeats this one and its output never finds the block. "
                "Append each token first (append(token)), then count it in seq.cached_token_count and register"
                + raised)


def _check_commit(cls) -> None:
    for case in COMMIT_CASES:
        what, prompt_len, draft, accepted, bonus, params = case
        mine, ref, sched, error = _commit_case(cls, case)
        tokens = draft[:accepted] + [bonus]
        where = f"commit of {tokens} ({what})"
        raised = f" (and then it raised {type(error).__name__}: {error})" if error is not None else ""
        if mine["output"] != ref["output"]:
            if len(mine["output"]) > len(ref["output"]) and ref["finished"]:
                limit = f"the stop token {STOP}" if params.stop_token_ids else f"max_tokens={params.max_tokens}"
                raise AssertionError(
                    f"{where}: the output is {mine['output']}, expected {ref['output']}: overshooting "
                    f"{'max_tokens' if not params.stop_token_ids else 'the stop token'}: append(token) returned "
                    f"True at {limit} (the request ended there and its blocks are free): stop at once{raised}")
        if error is not None:
            raise AssertionError(f"{where}: commit raised {type(error).__name__}: {error}") from error
        if mine["output"] != ref["output"]:
            raise AssertionError(f"{where}: the output is {mine['output']}, expected {ref['output']}; append each "
                                 "of tokens, in order, with append(token)")
        if mine["finished"] != ref["finished"]:
            raise AssertionError(f"{where}: the request is {mine['status']}, expected {ref['status']}: append every "
                                 "token through append(token), which ends the request at max_tokens or a stop token")
        if ref["finished"]:
            continue  # its blocks are free: nothing to roll back
        valid = ref["cached"]  # positions whose KV is an accepted token's
        bad = [i for i in mine["registered"] if (i + 1) * BLOCK > valid]
        if bad:
            i = bad[0]
            raise AssertionError(
                f"{where}: caching a block with rejected tokens: block {i} (positions {i * BLOCK}..{i * BLOCK + 3}) "
                f"is in the prefix cache, but only positions 0..{valid - 1} hold an accepted token's KV (position "
                f"{valid} is the bonus token, whose KV is computed next step; its slot still holds a rejected "
                "draft's); count only the accepted drafts in seq.cached_token_count before registering")
        _check_cached_tokens(mine, where, raised)
        if mine["cached"] != valid:
            more = mine["cached"] > valid
            raise AssertionError(
                f"{where}: seq.cached_token_count is {mine['cached']}, expected {valid}: " +
                ("only the accepted drafts' KV is written; the bonus token's is computed next step" if more else
                 "each accepted draft's KV was written by the verification: count it (cached_token_count + 1 per "
                 "accepted draft), or the next step computes it again"))
        if mine["registered"] != ref["registered"]:
            raise AssertionError(f"{where}: the blocks in the prefix cache are {mine['registered']}, expected "
                                 f"{ref['registered']}: register each accepted draft's full block "
                                 "(self.block_manager.register_computed_blocks(seq))")
        keep = cdiv(valid, BLOCK)
        if mine["blocks"] > keep and mine["free"] >= ref["free"]:
            raise AssertionError(
                f"{where}: the blocks past the {valid} computed tokens went back to the pool ({mine['free']} blocks "
                f"free, as expected) but are still in seq.block_table ({mine['blocks']} blocks, expected {keep}): "
                "cut them from the table too (del seq.block_table[keep:]); a table that names freed blocks has the "
                "next step write its KV into blocks another sequence may hold by then")
        if mine["blocks"] > keep:
            raise AssertionError(
                f"{where}: leaving rejected slots claimed: the sequence still holds {mine['blocks']} blocks, but "
                f"its {valid} computed tokens need {keep}; the blocks past them hold only rejected drafts' KV: "
                f"return them to the pool (rollback(seq, seq.cached_token_count); {mine['free']} blocks free, "
                f"expected {ref['free']})")
        if mine["blocks"] < keep:
            raise AssertionError(f"{where}: the sequence holds {mine['blocks']} blocks, but its {valid} computed "
                                 f"tokens need {keep} (cdiv): you released a block that still holds accepted tokens")
        try:
            sched.block_manager.check_invariants(sched.sequences)
        except AssertionError as e:
            raise AssertionError(f"{where}: the block pool is inconsistent afterwards ({e})") from None


def _check_cut_at_stop(acceptor) -> None:
    for new, i in (([31, 32, 33], 0), ([31, 32, 33], 1), ([31, 32, 33, 34], 2)):
        seqs = []
        for _ in range(2):
            s = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=20))
            s.output_token_ids = [30, *new]
            s.metrics.token_times = [0.0] * len(s.output_token_ids)
            s.metrics.num_output_tokens = len(s.output_token_ids)
            s.new_token_count = len(new)
            seqs.append(s)
        mine, ref = seqs
        what = (f"cut_at_stop(seq, new_tokens={new}, i={i}): a stop string ended at new_tokens[{i}] = {new[i]} "
                f"(seq's output {mine.output_token_ids})")
        got = _call(what, acceptor.cut_at_stop, mine, list(new), i)
        want = MiniSpecAcceptor(None).cut_at_stop(ref, list(new), i)
        if mine.output_token_ids != ref.output_token_ids:
            kept = len(mine.output_token_ids) > len(ref.output_token_ids)
            raise AssertionError(
                f"{what}: the output is {mine.output_token_ids}, expected {ref.output_token_ids}: " +
                ("a stop string inside the accepted run: plain decoding stops at the token that completes it, so "
                 "the tokens after it never happened: forget them (seq.drop_last_tokens)" if kept else
                 f"the token that completes the stop string, {new[i]}, stays (plain decoding emitted it)"))
        if list(got or []) != want:
            raise AssertionError(f"{what}: returned {got!r}, expected {want}: the new tokens the request keeps "
                                 "(the stream delivers these)")
        if mine.new_token_count != ref.new_token_count:
            raise AssertionError(f"{what}: seq.new_token_count is {mine.new_token_count}, expected "
                                 f"{ref.new_token_count}")


# -- the live engine -----------------------------------------------------------------------------------------------

def _repeat_prompts(tok) -> list[list[int]]:
    """Chat prompts whose answers copy spans of the prompt (prompt lookup drafts them)."""
    bodies = ["Repeat this sentence exactly: The old lighthouse keeper climbs the stairs every night to light "
              "the lamp.",
              "Write this list out again: apples, pears, plums, cherries, apples, pears, plums, cherries."]
    return [tok(tok.apply_chat_template([{"role": "user", "content": b}], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False)["input_ids"] for b in bodies]


def _live_requests(tok):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = chat_prompts(tok, 6, note_words=(40, 60)) + _repeat_prompts(tok)
    requests = [(f"r{i}", p, greedy) for i, p in enumerate(prompts)]
    stops = [SamplingParams(temperature=0.0, max_tokens=24, stop=["climbs"]),
             SamplingParams(temperature=0.0, max_tokens=24, stop=["pears"], include_stop_str_in_output=True)]
    return requests + [(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(_repeat_prompts(tok), stops))]


def _check_live(cls, requests, options: dict) -> str:
    expected, _, _ = _reference("smollm2-135m", options, requests)  # the oracle: speculation off
    cuts = []

    class Counted(cls):  # counts the stops inside accepted runs, to be sure the run has one
        def cut_at_stop(self, seq, new_tokens, i):
            cuts.append(seq.request_id)
            return super().cut_at_stop(seq, new_tokens, i)

    what = "your acceptor in the live engine"
    llm = LLM("smollm2-135m", **options, speculative_config=SPEC, spec_acceptor_cls=Counted)
    outputs, _ = drive(llm, requests, what)
    for rid, want in expected.items():
        got = outputs[rid]
        if got != want:
            i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            raise AssertionError(f"{what}: request {rid} differs from plain decoding (speculation off) at output "
                                 f"token {i}: expected {want[i:i + 4]}, got {got[i:i + 4]}")
    s = llm.engine.stats()
    assert s.spec_decode_num_accepted_tokens > 0 and s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
    assert cuts, "the live workload must end a request at a stop string inside an accepted run"
    return (f"{s.spec_decode_num_draft_tokens} drafted, {s.spec_decode_num_accepted_tokens} accepted, "
            f"{s.spec_decode_mean_tokens_per_step:.2f} tokens per step, {len(cuts)} stop string(s) inside a run")


def check_spec_acceptor(cls, live: bool = True) -> None:
    """Check a ``SpecAcceptor`` subclass's ``accept``, ``commit``, ``rollback`` and ``cut_at_stop`` (chapter 17).

    Targeted cases first: the greedy rule (the first mismatch, the bonus
    token), one verified decode row through minivllm's scheduler and block
    manager (block size 4, prefix caching) per case (nothing, some, all
    accepted; a stop token and max_tokens inside the run; the blocks in the
    prefix cache and the tokens they are cached under), and a stop string
    inside the run; the first failure stops the check. Then, unless
    ``live=False``, the live engine on SmolLM2 with the class as its
    acceptor: chat prompts and prompts that repeat themselves (two ending at a
    stop string), greedy, with prefix caching and chunked prefill; every
    output must be exactly plain decoding's, the block invariants must hold
    after every step and no block may leak. An empty subclass is "not written
    yet".
    """
    cls = own_part(cls, METHODS, MiniSpecAcceptor)
    acceptor = cls(None)
    _check_accept(acceptor)
    _check_commit(cls)
    _check_cut_at_stop(acceptor)
    say("check_spec_acceptor: the first mismatch, the bonus token, the rollback of rejected slots, the prefix "
          "cache, max_tokens and stops inside the run are right (targeted cases).")
    if not live:
        return
    tok = load_tokenizer("smollm2-135m")
    options = dict(block_size=8, num_blocks=400, max_num_seqs=4, enable_prefix_caching=True,
                   enable_chunked_prefill=True, max_prefill_chunk_size=128, max_num_batched_tokens=160,
                   dtype="float32")
    requests = _live_requests(tok)
    counts = _check_live(cls, requests, options)
    say(f"check_spec_acceptor: the live engine (smollm2-135m, {len(requests)} requests: {counts}) gave exactly "
          "the tokens of plain decoding; the block invariants held after every step and no block leaked.")
