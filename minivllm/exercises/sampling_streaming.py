"""Chapter 07, sampling and streaming: the checks of the reader's sampler (a ``Sampler`` subclass:
greedy, temperature, top-k, top-p, per-request seeded generators) and incremental detokenizer (an
``IncrementalDetokenizer`` subclass), on targeted cases and then inside the live engine, where the tokens
and the streamed text must be minivllm's.
"""

from __future__ import annotations

import dataclasses

import torch

from minivllm.detokenizer import MiniIncrementalDetokenizer
from minivllm.exercises._common import own_part, say
from minivllm.exercises.live import chat_prompts, check_live, greedy
from minivllm.models import load_tokenizer
from minivllm.sampler import MiniSampler, SamplerOutput, apply_top_k_top_p, sample
from minivllm.sampling_params import SamplingParams
from minivllm.simple_generation import chat_prompt_ids

__all__ = ["check_sampler", "check_detokenizer", "live_requests", "SAMPLER_METHODS", "DETOKENIZER_METHODS"]

SAMPLER_METHODS = ("__call__",)  # what exercise 07 writes: the sampler
DETOKENIZER_METHODS = ("add",)  # and the detokenizer

DRAWS = 400  # rows of one distribution: every kept token of a set case is drawn many times
RANKED = [0.16, 0.14, 0.13, 0.12, 0.11, 0.10, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01]  # probabilities by rank
NUCLEUS = [0.35, 0.25, 0.20, 0.10, 0.05, 0.03, 0.02]  # top_p=0.7 keeps 3 at temperature 1, 2 at temperature 0.5
_VOCAB_ORDER = [7, 2, 10, 0, 5, 11, 3, 8, 1, 9, 4, 6]  # where rank r sits in the vocabulary: never sorted


def _logits(ranked: list[float]) -> torch.Tensor:
    """A row whose softmax is ``ranked``, the ranks scattered over the vocabulary."""
    order = [i for i in _VOCAB_ORDER if i < len(ranked)]
    row = torch.empty(len(ranked))
    row[order] = torch.tensor(ranked).log()
    return row


def _ranks(row: torch.Tensor, tokens) -> list[int]:
    order = row.argsort(descending=True).tolist()
    return sorted({order.index(t) for t in tokens})


def _call(cls, logits, params, seeds, sampler_seed=0, calls=1) -> list[list[int]]:
    """The reader's sampler on fresh generators: ``calls`` calls' tokens."""
    sampler = cls("cpu", sampler_seed)
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    out = []
    for _ in range(calls):
        before = logits.clone()
        result = sampler(logits, params, gens)
        if not isinstance(result, SamplerOutput):
            raise AssertionError(f"__call__ must return a SamplerOutput(token_ids, ...), got {type(result).__name__}")
        if not torch.equal(logits, before):
            raise AssertionError("the logits were modified in place: work on a copy (the engine reads them again "
                                 "for logprobs)")
        tokens = [int(t) for t in result.token_ids]
        if len(tokens) != len(params):
            raise AssertionError(f"one token per row: {len(params)} rows, got {len(tokens)} tokens")
        out.append(tokens)
    return out


def _reference(logits, params, seeds, sampler_seed=0, calls=1, gens_of=None, default=None) -> list[list[int]]:
    """minivllm's ``sample`` on the same fresh generators (``gens_of`` may replace them: a variant)."""
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    gens = gens_of(gens) if gens_of else gens
    default = torch.Generator().manual_seed(sampler_seed) if default is None else default
    return [sample(logits, params, gens, default) for _ in range(calls)]


def _temperature_after_filter(logits, params, seeds, sampler_seed=0, calls=1) -> list[list[int]]:
    """What a sampler that filters the unscaled logits and divides by the temperature afterwards draws."""
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    default = torch.Generator().manual_seed(sampler_seed)
    out = []
    for _ in range(calls):
        tokens = []
        for row, p, g in zip(logits, params, gens):
            if p.greedy:
                tokens.append(int(row.argmax()))
                continue
            kept = apply_top_k_top_p(row[None], torch.tensor([p.top_k]), torch.tensor([p.top_p]))[0]
            tokens.append(int(torch.multinomial((kept / p.temperature).softmax(-1), 1, generator=g or default)))
        out.append(tokens)
    return out


def _variants(logits, params, seeds, calls) -> dict[str, list[list[int]]]:
    """The tokens characteristic mistakes draw on this case, by the hint that names them."""
    def with_params(**change):
        return [p if p.greedy else dataclasses.replace(p, **{k: f(p) for k, f in change.items()}) for p in params]

    out = {
        "the temperature was not applied: divide the logits by it before the filters":
            _reference(logits, with_params(temperature=lambda p: 1.0), seeds, calls=calls),
        "the logits were multiplied by the temperature: divide them":
            _reference(logits, with_params(temperature=lambda p: 1 / p.temperature), seeds, calls=calls),
        "the temperature was applied after the filter: divide the logits by the temperature first, then filter":
            _temperature_after_filter(logits, params, seeds, calls=calls),
        "the seeded rows drew from one shared generator: row i draws with generators[i] when it has one, "
        "self.generator only when it is None": _reference(logits, params, seeds, calls=calls,
                                                          gens_of=lambda gens: [None] * len(gens)),
    }
    if any(p.top_k > 0 for p in params):
        out["top-k off by one: it keeps k + 1 tokens"] = _reference(
            logits, with_params(top_k=lambda p: p.top_k + 1 if p.top_k > 0 else p.top_k), seeds, calls=calls)
    return out


def _check_set(cls, what, ranked, expected_ranks: int, hints: dict[int, str], variants=False, **params) -> None:
    """Draw ``DRAWS`` times from one row: exactly the ``expected_ranks`` most likely tokens may appear.

    A failure is named by ``hints`` (by the number of tokens kept) or, with
    ``variants``, by the mistake whose draws it repeats exactly.
    """
    row = _logits(ranked)
    logits = row[None].expand(DRAWS, -1).contiguous()
    p = SamplingParams(**params)
    try:
        tokens = _call(cls, logits, [p] * DRAWS, [None] * DRAWS)[0]
    except RuntimeError as e:
        raise AssertionError(f"{what}: the sampler raised RuntimeError: {str(e).splitlines()[0]}; "
                             f"{hints.get(0, 'the filters must leave a distribution to draw from')}") from None
    got = _ranks(row, tokens)
    if got == list(range(expected_ranks)):
        return
    named = {h: t[0] for h, t in _variants(logits, [p] * DRAWS, [None] * DRAWS, calls=1).items()} if variants else {}
    if len(set(tokens)) == 1 and expected_ranks > 1:
        hint = ("every draw gave the same token: rows without a seed draw from self.generator, whose state moves on "
                "with every draw (not a fresh generator each time)")
    elif any(t == tokens for t in named.values()):
        hint = next(h for h, t in named.items() if t == tokens)
    elif got == sorted(_ranks(row, range(expected_ranks))) and expected_ranks < len(ranked):
        hint = "this keeps the first tokens in vocabulary order: keep the most likely ones (sort by probability)"
    else:
        hint = hints.get(len(got), "") if got == list(range(len(got))) else "keep the most likely tokens"
    raise AssertionError(f"{what}: {DRAWS} draws gave the tokens of ranks {got} (0 = most likely), expected ranks "
                         f"0 to {expected_ranks - 1}; {hint}")


def _check_sets(cls) -> None:
    _check_set(cls, "top_k=4", RANKED, 4, {5: "top-k off by one: it keeps k + 1 tokens",
                                           3: "top-k off by one: it keeps k - 1 tokens",
                                           12: "top-k was not applied"}, top_k=4)
    top_p_hints = {2: "top-p dropped the token that crosses p: keep the smallest prefix of the sorted tokens whose "
                      "mass reaches p (keep a token while the mass strictly before it is < p)",
                   4: "top-p keeps one token too many: the top 3 already hold 0.80 >= 0.7",
                   7: "top-p was not applied"}
    _check_set(cls, "top_p=0.7 over probabilities 0.35, 0.25, 0.2, 0.1, ...", NUCLEUS, 3, top_p_hints, top_p=0.7)
    _check_set(cls, "top_p=0.5 when the top token alone holds 0.6", [0.6, 0.2, 0.1, 0.1], 1,
               {0: "nothing was kept: the most likely token always stays, even when it alone exceeds p",
                2: "the most likely token alone reaches p: keep only it"}, top_p=0.5)
    _check_set(cls, "top_k=3 then top_p=0.6 (top-p over the 3 survivors, renormalised: 0.37, 0.33, 0.30)", RANKED, 2,
               {3: "top-p must see the top-k survivors renormalised: apply top-k first, then top-p"},
               top_k=3, top_p=0.6)
    _check_set(cls, "temperature=0.5 then top_p=0.7 (at temperature 0.5 the top 2 hold 0.78)", NUCLEUS, 2,
               {3: "the temperature was applied after the filter: divide the logits by the temperature first, "
                   "then filter"}, variants=True, temperature=0.5, top_p=0.7)


_MIXED = [  # (params, seed or None): greedy, unseeded and seeded rows, every filter
    (SamplingParams(temperature=0.7), None),
    (SamplingParams(temperature=0.8, top_p=0.9), 42),
    (SamplingParams(temperature=0.0), None),
    (SamplingParams(temperature=1.3, top_k=5), 7),
    (SamplingParams(temperature=0.5, top_k=8, top_p=0.8), None),
    (SamplingParams(temperature=1.0, top_p=0.6), 3),
]


def _check_exact(cls, what, logits, rows, calls) -> None:
    params, seeds = [p for p, _ in rows], [s for _, s in rows]
    got = _call(cls, logits, params, seeds, calls=calls)
    expected = _reference(logits, params, seeds, calls=calls)
    if got == expected:
        return
    call, row = next((c, r) for c in range(calls) for r in range(len(rows)) if got[c][r] != expected[c][r])
    p = params[row]
    if p.greedy:
        hint = "a greedy row (params.greedy: temperature < 1e-5) takes the argmax and draws nothing"
    else:
        hint = next((h for h, tokens in _variants(logits, params, seeds, calls).items() if tokens == got),
                    "each non-greedy row draws once, in row order: torch.multinomial(probs, 1, generator=...) over "
                    "the whole vocabulary, with generators[i] or else self.generator")
    raise AssertionError(f"{what}: call {call}, row {row} ({p.temperature=}, {p.top_k=}, {p.top_p=}, seed "
                         f"{seeds[row]}) drew {got[call][row]}, minivllm's sampler {expected[call][row]}; {hint}")


def _check_seeded_alone(cls, logits) -> None:
    """The seeded row of the mixed batch draws the same tokens alone."""
    params, seeds = [p for p, _ in _MIXED], [s for _, s in _MIXED]
    row = seeds.index(42)
    in_batch = [tokens[row] for tokens in _call(cls, logits, params, seeds, calls=8)]
    alone = [tokens[0] for tokens in _call(cls, logits[row:row + 1], [params[row]], [42], calls=8)]
    if in_batch != alone:
        raise AssertionError(f"a seeded row (seed 42) drew {in_batch} in a batch of {len(params)} rows and {alone} "
                             f"alone: a seeded row must not depend on its batch; draw it with its own generator, "
                             f"generators[i] (only rows without one share self.generator)")


def check_sampler(cls, live: bool = True) -> None:
    """Check a ``Sampler`` subclass's ``__call__(logits, params, generators) -> SamplerOutput`` (chapter 07).

    Targeted cases: what top-k, top-p, both, and temperature then top-p keep
    (the set of tokens drawn from one row, many times); greedy, unseeded and
    seeded rows mixed, token for token as minivllm's sampler draws them; a
    seeded row alone and in a batch; the first failure stops the check. Then,
    unless ``live=False``, SmolLM2 in the live engine with seeded sampling rows
    and greedy rows: the same tokens and streamed text. An empty subclass is
    "not written yet".
    """
    cls = own_part(cls, SAMPLER_METHODS, MiniSampler)
    _check_sets(cls)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(_MIXED), 50, generator=g) * 2
    _check_exact(cls, "a mixed batch", logits, _MIXED, calls=6)
    _check_seeded_alone(cls, logits)
    say("check_sampler: top-k, top-p, their order, temperature, greedy rows and seeded generators are right.")
    if not live:
        return
    tok = load_tokenizer("smollm2-135m")
    check_live("your sampler", live_requests(tok), parts={"sampler": cls}, tokenizer=tok, same_text=True,
               **LIVE_OPTIONS)


# The detokenizer -----------------------------------------------------------------------------------------

_TEXTS = [  # (what, text, tokens per add)
    ("an emoji that spans several tokens", "Happy 🤗🎉 day!", 1),
    ("accents and CJK characters", "Café ☕, naïve 日本語.", 1),
    ("spaces, tabs and new lines", "  two  spaces,\ttab and\n\nnew lines   end", 1),
    ("three tokens per add", "Café ☕, naïve 日本語 🤗🎉 and  spaces", 3),
]


def _stream(cls, tok, prompt, ids, per_add):
    det = cls(tok, prompt)
    return det, [det.add(ids[i:i + per_add]) for i in range(0, len(ids), per_add)]


def _check_text(cls, tok, what, prompt, ids, per_add) -> None:
    _, want = _stream(MiniIncrementalDetokenizer, tok, prompt, ids, per_add)
    det, got = _stream(cls, tok, prompt, ids, per_add)
    full = tok.decode(ids, skip_special_tokens=True)
    what = f"{what} ({full!r}, {per_add} token{'s' * (per_add > 1)} per add)"
    if any(not isinstance(d, str) for d in got):
        raise AssertionError(f"{what}: add must return the new text, a str (possibly empty)")
    bad = next((i for i, d in enumerate(got) if "\ufffd" in d), None)
    if bad is not None:
        raise AssertionError(f"{what}: add #{bad} emitted {got[bad]!r}, half a UTF-8 character (U+FFFD): wait "
                             f"while the decoded window ends with U+FFFD; the next token completes the character")
    if "".join(got) != full:
        text = "".join(got)
        hint = ("the special tokens were not skipped: decode with self._decode (skip_special_tokens)"
                if "<|" in text else "add returns only the new text, not the text so far"
                if len(got) > 1 and got[1].startswith(got[0]) and got[0] and len(text) > len(full) else
                "text was lost: when the window still ends with U+FFFD, keep the offsets where they are and wait"
                if len(text) < len(full) else "the deltas must add up to the decoded text")
        raise AssertionError(f"{what}: the deltas add up to {text!r}, expected {full!r}; {hint}")
    if det.text != full:
        raise AssertionError(f"{what}: self.text is {det.text!r}: append each delta to self.text (the engine's "
                             f"stop strings and final text read it)")
    if got != want:
        i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        raise AssertionError(f"{what}: the text is right but add #{i} returned {got[i]!r} where minivllm's returns "
                             f"{want[i]!r}: emit the new text as soon as the window does not end with U+FFFD, no "
                             f"sooner and no later")


def check_detokenizer(cls, live: bool = True) -> None:
    """Check an ``IncrementalDetokenizer`` subclass's ``add(token_ids) -> str`` (chapter 07).

    SmolLM2's tokenizer on emoji, accents and CJK characters that span
    tokens, runs of spaces, tabs and new lines, several tokens per call and a
    special token: no delta may hold U+FFFD, the deltas must be minivllm's and
    add up to the decoded text, and ``self.text`` must follow; the first
    failure stops the check. Then, unless ``live=False``, the live engine
    streams SmolLM2's replies (emoji included) through it. An empty subclass
    is "not written yet".
    """
    cls = own_part(cls, DETOKENIZER_METHODS, MiniIncrementalDetokenizer)
    tok = load_tokenizer("smollm2-135m")
    prompt = chat_prompt_ids(tok, "Say something.")
    for what, text, per_add in _TEXTS:
        _check_text(cls, tok, what, prompt, tok(text, add_special_tokens=False)["input_ids"], per_add)
    ids = tok("Done!", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    _check_text(cls, tok, "an end-of-turn token", prompt, ids, 1)
    say(f"check_detokenizer: all {len(_TEXTS) + 1} streams match minivllm's deltas, with no broken character.")
    if not live:
        return
    check_live("your detokenizer", live_requests(tok), parts={"detokenizer": cls}, tokenizer=tok, same_text=True,
               **LIVE_OPTIONS)


LIVE_OPTIONS = dict(block_size=16, num_blocks=64, max_num_seqs=8)


def live_requests(tok) -> list[tuple]:
    """Chapter 07's live workload: greedy and seeded sampling rows (one unseeded), an emoji reply among them."""
    emoji = chat_prompt_ids(tok, "Reply with three emojis that describe happiness.")
    chats = chat_prompts(tok, 2)
    sampled = dict(max_tokens=10, ignore_eos=True)
    return [("emoji", emoji, greedy(12)),
            ("seeded", chats[0], SamplingParams(temperature=0.8, top_p=0.9, seed=1, **sampled)),
            ("top-k", chats[1], SamplingParams(temperature=1.0, top_k=20, seed=2, **sampled)),
            ("emoji, sampled", emoji, SamplingParams(temperature=0.7, seed=3, **sampled)),
            ("unseeded", chats[0], SamplingParams(temperature=0.9, top_k=50, **sampled)),
            ("greedy", chats[1], greedy(8))]
