"""Chapter 19, structured outputs: the check of the reader's grammar masker (a ``GrammarMasker`` subclass with
``fill`` and ``apply``), on targeted cases over a tiny vocabulary with real xgrammar matchers, and then inside the
live engine (``grammar_masker_cls``): SmolLM2 answering in JSON, every answer valid, exactly minivllm's tokens.
"""

from __future__ import annotations

import contextlib
import json

import torch

from minivllm import sampler
from minivllm.config import SpeculativeConfig
from minivllm.engine import LLM
from minivllm.exercises._common import own_part
from minivllm.exercises.live import _reference, drive
from minivllm.models import load_tokenizer
from minivllm.sampler import MiniGrammarMasker, apply_token_bitmask
from minivllm.sampling_params import SamplingParams
from minivllm.structured_output import INSTALL, Grammar, StructuredOutputsParams, bitmask_words

__all__ = ["check_grammar_masker", "METHODS", "VOCAB"]

METHODS = ("fill", "apply")  # what exercise 19 writes

# A tiny vocabulary for the targeted cases (xgrammar takes any list of token strings): 80 tokens, three 32-bit
# words a row, the tokens the grammars use spread over all three so that a bit or word order shows.
VOCAB = ["<eos>", *"0123456789", "ok", " "] + [f"~{i}" for i in range(13, 32)] + ["no"] \
    + [f"~{i}" for i in range(33, 40)] + ["yes"] + [f"~{i}" for i in range(41, 64)] + [" please", "p"] \
    + [f"~{i}" for i in range(66, 80)]
EOS = 0
ANSWER = 'root ::= "ok " ("yes please" | "yes" | "no")'  # EBNF: complete after "ok yes", and may go on
DIGITS = "[0-9]{1,3}"  # a regex: complete after one digit, ended after three
_compiled: dict = {}


def _id(text: str) -> int:
    return VOCAB.index(text)


def _show(tokens) -> str:
    return "[" + ", ".join(f"{t} {VOCAB[t]!r}" if 0 <= t < len(VOCAB) else str(t) for t in tokens) + "]"


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise RuntimeError(f"exercise 19 needs the xgrammar package, which is not installed here: {INSTALL} "
                           "(--no-deps: its triton dependency is of no use on a CPU)") from None
    return xgrammar


def _grammar(kind: str, spec: str, prefix: list[str]) -> Grammar:
    """A fresh matcher of ``spec`` over :data:`VOCAB` (``kind`` "ebnf" or "regex"), ``prefix`` accepted."""
    xgr = _xgrammar()
    if (kind, spec) not in _compiled:
        if "info" not in _compiled:
            _compiled["info"] = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[EOS])
        compiler = xgr.GrammarCompiler(_compiled["info"], max_threads=1, cache_enabled=False)
        grammar = xgr.Grammar.from_ebnf(spec) if kind == "ebnf" else xgr.Grammar.from_regex(spec)
        _compiled[kind, spec] = compiler.compile_grammar(grammar)
    g = Grammar(xgr.GrammarMatcher(_compiled[kind, spec], max_rollback_tokens=16))
    for text in prefix:
        assert g.accept(_id(text)), text
    return g


def _words(tokens) -> list[int]:
    """A bitmask row in xgrammar's layout: token ``t`` is bit ``t % 32`` of word ``t // 32`` (int32)."""
    words = [0] * bitmask_words(len(VOCAB))
    for t in tokens:
        words[t // 32] |= 1 << (t % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def _allowed(row: torch.Tensor) -> set[int]:
    """The tokens a bitmask row allows."""
    bits = ((row.to(torch.int32)[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:len(VOCAB)]
    return set(bits.nonzero().flatten().tolist())


def _mask(grammar: Grammar) -> set[int]:
    """What ``grammar`` allows next (its state, seen without changing it)."""
    bitmask = torch.zeros(1, bitmask_words(len(VOCAB)), dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    return _allowed(bitmask[0])


class Delegated(AssertionError):
    """The reader's method called minivllm's own implementation of the part (or xgrammar's kernel)."""


def _theirs() -> list[tuple[str, object, str]]:
    """What a masker could hand its work to instead of writing it: ``(name, owner, attribute)``."""
    return [("MiniGrammarMasker.fill", MiniGrammarMasker, "fill"),
            ("MiniGrammarMasker.apply", MiniGrammarMasker, "apply"),
            ("minivllm.sampler.apply_token_bitmask", sampler, "apply_token_bitmask"),
            ("minivllm.sampler.mask_logits", sampler, "mask_logits"),
            ("xgrammar.apply_token_bitmask_inplace", _xgrammar(), "apply_token_bitmask_inplace")]


def _refuse(*args, _name: str = "minivllm's own", _error: type = AssertionError, **kwargs):
    """What minivllm's own fill and apply run while the check calls the reader's part (``_name``: which). It
    runs with their module's globals: it names nothing global."""
    raise _error(f"your part called {_name}: the check runs your part alone, so minivllm's own answer (and "
                 "xgrammar's kernel) is not there to call; write it yourself")


@contextlib.contextmanager
def _alone():
    """minivllm's own fill and apply (and xgrammar's bitmask kernel) raise :class:`Delegated` meanwhile, however
    the reader's code reaches them (the class, a name imported before the check): each one's code is swapped for
    :func:`_refuse`'s, and swapped back afterwards, whatever happens."""
    swapped = []
    try:
        for name, owner, attr in _theirs():
            fn = getattr(owner, attr)
            code = getattr(fn, "__code__", None)
            if code is None or code.co_freevars:  # not a plain Python function: left as it is
                continue
            swapped.append((fn, code, fn.__kwdefaults__))
            fn.__code__, fn.__kwdefaults__ = _refuse.__code__, {"_name": name, "_error": Delegated}
        yield
    finally:
        for fn, code, kwdefaults in swapped:
            fn.__code__, fn.__kwdefaults__ = code, kwdefaults


def _call(what: str, method, *args):
    """The reader's method called, on its own (:func:`_alone`); an exception becomes a failure that names the
    call."""
    try:
        with _alone():
            return method(*args)
    except Delegated as e:
        raise AssertionError(f"{what}: {e}") from None
    except Exception as e:
        raise AssertionError(f"{what}: {method.__name__} raised {type(e).__name__}: {e}") from e


# -- apply: the bitmask on the logits ------------------------------------------------------------------------------

APPLY_CASES = [  # (what, {bitmask row: allowed tokens}, index); the other rows every token allowed
    ("one constrained row, logits row 2, of four", {2: [0, 5, 31, 32, 40, 64, 79]}, [2]),
    ("two constrained rows, 1 and 3, with different masks", {1: [11, 12, 33, 63, 65], 3: [1, 2, 3, 40, 64]},
     [1, 3]),
]


def _reversed_bits(tokens) -> set[int]:
    return {t // 32 * 32 + 31 - t % 32 for t in tokens} & set(range(len(VOCAB)))


def _reversed_words(tokens) -> set[int]:
    n = bitmask_words(len(VOCAB))
    return {(n - 1 - t // 32) * 32 + t % 32 for t in tokens} & set(range(len(VOCAB)))


def _apply_hint(r: int, allowed: set[int], kept: set[int], rows: dict) -> str:
    """Why row ``r`` keeps the tokens ``kept`` (finite) instead of ``allowed``, if a classic slip explains it."""
    if kept == _reversed_bits(allowed):
        return ("the bit order is reversed: token t is bit t % 32 of word t // 32, counted from the least "
                "significant bit ((word >> (t % 32)) & 1), not bit 31 - t % 32")
    if kept == _reversed_words(allowed):
        return ("the words are in the wrong order: token t is in word t // 32 of the row, counting from word 0 "
                "(tokens 0 to 31), not from the last word")
    if kept == _reversed_bits(_reversed_words(allowed)):
        return "both the bit order and the word order are reversed: token t is bit t % 32 of word t // 32"
    other = [j for j, tokens in rows.items() if j != r and kept == set(tokens)]
    if other or kept == set(range(len(VOCAB))):
        source = f"bitmask row {other[0]}" if other else "a bitmask row that allows every token"
        return (f"row {r} got the mask of {source}: the bitmask has one row per logits row, and bitmask[r] masks "
                "logits[r] for each r in index (index names rows of both)")
    return "token t is allowed where bit t % 32 of word t // 32 of the row is set"


def _unchanged_by_any_row(masker, logits, bitmask, index) -> bool:
    """Whether apply leaves the logits as they were even when every bitmask row is the first of index's (so it is
    not that apply read another row, one that allows every token)."""
    probe, same = logits.clone(), bitmask[index[0]].expand_as(bitmask).clone()
    _call("apply", masker.apply, probe, same, list(index))
    return torch.equal(probe, logits)


def _check_apply(masker) -> None:
    words = bitmask_words(len(VOCAB))
    for what, rows, index in APPLY_CASES:
        g = torch.Generator().manual_seed(19)
        logits = torch.randn(4, len(VOCAB), generator=g) * 3
        logits[:, ::7] = 0.0  # a few logits exactly 0: masking by multiplying would leave them as they are
        bitmask = torch.full((4, words), -1, dtype=torch.int32)
        for r, tokens in rows.items():
            bitmask[r] = torch.tensor(_words(tokens), dtype=torch.int32)
        case = f"apply(logits [4, {len(VOCAB)}], bitmask, index={index}): {what}"
        got = logits.clone()
        returned = _call(case, masker.apply, got, bitmask.clone(), list(index))
        want = logits.clone()
        apply_token_bitmask(want, bitmask, index)
        if torch.equal(got, logits) and isinstance(returned, torch.Tensor):
            raise AssertionError(f"{case}: logits are unchanged and apply returned a tensor: mask logits in place "
                                 "(logits[r] = ..., masked_fill_): the runner samples from the tensor it passed")
        if torch.equal(got, logits) and _unchanged_by_any_row(masker, logits, bitmask, index):
            raise AssertionError(
                f"{case}: the logits are unchanged after apply, though the bitmask forbids tokens: mask them in "
                "place, in the tensor apply receives (logits[index] = logits[index].masked_fill(...)); a new "
                "tensor (logits = ..., or masked_fill_ on logits[index], which is a copy) is lost when apply "
                "returns, and the runner samples from the tensor it passed")
        if got.isnan().any():
            raise AssertionError(f"{case}: the logits hold NaN after apply: a forbidden logit is -inf, never "
                                 "inf - inf or 0 * inf (set it, don't multiply or add to it)")
        for r in range(4):
            if r not in index and not torch.equal(got[r], logits[r]):
                raise AssertionError(f"{case}: row {r} changed, but it is not in index (no grammar constrains it): "
                                     "mask only the rows of index, and leave every other row exactly as it is")
        for r in index:
            allowed = set(rows[r])
            kept = set(got[r].isfinite().nonzero().flatten().tolist())
            changed = [t for t in sorted(allowed & kept) if got[r, t] != logits[r, t]]
            if changed:
                t = changed[0]
                raise AssertionError(
                    f"{case}: row {r}: token {t} is allowed, but its logit changed from {logits[r, t]:.4f} to "
                    f"{got[r, t]:.4f}: leave the allowed logits exactly as they are. The mask goes on the raw "
                    "logits, before the sampler's temperature, top-k/top-p and softmax: scaling, renormalising "
                    "(log_softmax) or masking probabilities here changes the distribution the sampler draws from")
            if kept != allowed:
                zeroed = [t for t in sorted(set(range(len(VOCAB))) - allowed) if got[r, t] == 0 != logits[r, t]]
                finite = [t for t in sorted(kept - allowed) if got[r, t] != logits[r, t]]
                if zeroed:
                    t = zeroed[0]
                    raise AssertionError(
                        f"{case}: row {r}: token {t} is forbidden, but its logit is 0 (multiplied by the mask?): a "
                        "logit of 0 is a probability like any other after the softmax; set a forbidden token's "
                        "logit to -inf (masked_fill(~allowed, float('-inf')))")
                if finite:
                    t = finite[0]
                    raise AssertionError(
                        f"{case}: row {r}: token {t} is forbidden and its logit is {got[r, t]:.4g}, not -inf: a "
                        "large finite number still leaves the token a candidate (the sampler's logprobs list it, "
                        "and in float16 it rounds to a number the softmax can pick); use float('-inf')")
                hint = _apply_hint(r, allowed, kept, rows)
                refused, let = sorted(allowed - kept), sorted(kept - allowed)
                raise AssertionError(
                    f"{case}: row {r} keeps the tokens {sorted(kept)}, but its bitmask allows {sorted(allowed)} "
                    + (f"(refused: {refused}) " if refused else "") + (f"(kept but forbidden: {let}) " if let else "")
                    + f"; {hint}")
        if not torch.equal(got, want):  # the above covers every difference; a last guard
            raise AssertionError(f"{case}: the logits differ from the bitmask applied (sampler.apply_token_bitmask)")


# -- fill: each constrained position's row, the matcher left as it was ---------------------------------------------

def _state(grammar: Grammar) -> tuple:
    ended = grammar.is_terminated()  # a matcher that has ended has no mask to fill
    return grammar.num_accepted, ended, grammar.is_completed(), [] if ended else sorted(_mask(grammar))


def _make_rows(spec: list[tuple]) -> list[tuple]:
    """``(first, grammar, drafts)`` rows from ``(first, kind, grammar spec, prefix, drafts as text)``."""
    return [(first, _grammar(kind, g, prefix), [_id(d) for d in drafts]) for first, kind, g, prefix, drafts in spec]


FILL_CASES = [  # (what, logits rows, rows: (first, kind, grammar, tokens so far, drafts as text))
    ("two constrained samples at logits rows 1 and 3 of five; rows 0, 2 and 4 unconstrained", 5,
     [(1, "ebnf", ANSWER, ["ok", " "], []), (3, "regex", DIGITS, ["1"], [])]),
    ("a constrained sample at logits row 2 of three, the first two unconstrained", 3,
     [(2, "regex", DIGITS, [], [])]),
    ('the grammar is complete after "ok yes" (EOS may end it) but may go on with " please"; '
     'after "ok no" it is complete and only EOS may follow', 2,
     [(0, "ebnf", ANSWER, ["ok", " ", "yes"], []), (1, "ebnf", ANSWER, ["ok", " ", "no"], [])]),
    ('a drafted row at logits 1 to 3 (drafts "yes", " please"), between two unconstrained rows', 5,
     [(1, "ebnf", ANSWER, ["ok", " "], ["yes", " please"])]),
    ('a drafted row at logits 0 to 3 (drafts "yes", "no", " please": "no" is refused after "yes"), then a plain '
     "constrained row at 4", 5,
     [(0, "ebnf", ANSWER, ["ok", " "], ["yes", "no", " please"]), (4, "regex", DIGITS, ["4", "2"], [])]),
    ('a drafted row of digits at logits 1 to 3 (drafts "7", "7"): complete after one digit, ended after three', 4,
     [(1, "regex", DIGITS, ["7"], ["7", "7"])]),
    ('a sample whose grammar has ended: it accepted EOS after "ok no" (is_terminated()), at logits row 0, and a '
     "plain constrained row at 2", 3,
     [(0, "ebnf", ANSWER, ["ok", " ", "no", "<eos>"], []), (2, "regex", DIGITS, ["1"], [])]),
    ('a drafted row at logits 1 to 3 whose drafts close the answer and then propose EOS ("no", EOS): the position '
     "after EOS follows an ended grammar", 4, [(1, "ebnf", ANSWER, ["ok", " "], ["no", "<eos>"])]),
]


def _positions(first: int, grammar_spec: tuple, prefix: list[str], drafts: list[str]) -> list[tuple]:
    """``(logits row, mask there or None where the row stays whole, state's text)`` of one sample's positions."""
    kind, spec = grammar_spec
    g = _grammar(kind, spec, prefix)
    out, text = [], "".join(prefix)
    for i in range(len(drafts) + 1):
        out.append((first + i, None if g.is_terminated() else _mask(g), text))
        if i < len(drafts):
            if not g.accept(_id(drafts[i])):
                out.extend((first + j, "past", text) for j in range(i + 1, len(drafts) + 1))
                break
            text += drafts[i]
    return out


def _fill_hint(r: int, got: set[int], want: set[int], masks: dict[str, set[int]], i: int, drafts, text) -> str:
    """Why position ``i`` (logits row ``r``) got ``got``, where a classic slip explains it."""
    if got == set(range(len(VOCAB))):
        if i == len(drafts) and drafts:
            return (f"row {r} was left whole (every token allowed): it is the position after the last draft, where "
                    "the bonus token is chosen: fill it too (len(drafts) + 1 positions)")
        if masks.get("completed"):
            return (f"row {r} was left whole (every token allowed), but the grammar is only complete, not "
                    "terminated: is_completed() says EOS may come now, is_terminated() that EOS was accepted and "
                    "nothing more is; fill every row whose grammar is not terminated")
        return f"row {r} was left whole (every token allowed): fill it with grammar.fill_bitmask(bitmask, {r})"
    for name, tokens in masks.items():
        if name != "completed" and got == tokens and tokens != want:
            return name
    if EOS in want and EOS not in got:
        return (f"EOS refused where the grammar is complete ({text!r} is a whole answer): the matcher allows the "
                "stop tokens exactly where the grammar may end; keep its mask as it is, or the sample can never "
                "stop")
    if got == {EOS} and want != got:
        return (f"only EOS allowed, but after {text!r} the grammar may still go on ({_show(sorted(want - got))}): "
                "complete is not ended; the matcher's mask says what may follow")
    return f"fill row {r} from the matcher in its state after {text!r}: grammar.fill_bitmask(bitmask, {r})"


def _fill(case: str, masker, bitmask, rows, constrained: dict):
    """The reader's fill on ``rows``; where it raises on a grammar that has ended, the failure says so."""
    try:
        return _call(case, masker.fill, bitmask, rows)
    except AssertionError as e:
        ended = [(r, c[0], c[2]) for r, c in sorted(constrained.items()) if c[1] is None]
        if not ended or "terminated" not in str(e.__cause__):
            raise
        r, first, text = ended[0]
        raise AssertionError(
            f"{case}: fill raised {type(e.__cause__).__name__} (xgrammar: the matcher \"has terminated after "
            f"accepting the stop token\"). Logits row {r} follows EOS: the grammar of the sample at row {first} "
            f"has ended, its tokens so far {text!r} (grammar.is_terminated(): EOS accepted), and xgrammar refuses "
            "to fill the mask of a matcher that has ended; leave such a row whole (no fill_bitmask where "
            "grammar.is_terminated(): the sample ends there). In the engine, a draft of EOS right after the JSON "
            "closes ends the request with an error") from None


def _check_fill(masker) -> None:
    for what, num_rows, spec in FILL_CASES:
        rows = _make_rows(spec)
        before = [_state(g) for _, g, _ in rows]
        case = f"fill: {what}"
        bitmask = torch.full((num_rows, bitmask_words(len(VOCAB))), -1, dtype=torch.int32)
        constrained = {}
        for first, kind, g, prefix, drafts in spec:
            for r, want, text in _positions(first, (kind, g), prefix, drafts):
                constrained[r] = (first, want, text, prefix, drafts, (kind, g))
        index = _fill(case, masker, bitmask, rows, constrained)
        for r in range(num_rows):
            if r in constrained or _allowed(bitmask[r]) == set(range(len(VOCAB))):
                continue
            k = r if r < len(rows) else None  # the slip that fills the k-th sample's row k
            raise AssertionError(
                f"{case}: row {r} has no constraint (no sample's position is logits row {r}), but fill wrote into "
                "its bitmask row: a sample's positions are the logits rows first to first + len(drafts), from its "
                "(first, grammar, drafts)" + (f", not its place {k} in rows" if k is not None else ""))
        past = None  # a mask written after a refused draft: said once the matcher is known to be back
        for r in sorted(constrained):
            first, want, text, prefix, drafts, g = constrained[r]
            got = _allowed(bitmask[r])
            if want == "past" and got != set(range(len(VOCAB))) and past is None:
                refused = next(d for j, d in enumerate(drafts) if constrained[first + j + 1][1] == "past")
                past = (
                    f"{case}: row {r} (position {r - first} of the sample at row {first}) comes after the draft "
                    f"{refused!r}, which the grammar refuses (accept returned False), yet fill wrote a mask there: "
                    "stop at the first refused draft and leave the rows after it whole. The engine rejects that "
                    "draft and every one after it, so those positions are never sampled, and a later draft tried "
                    "from the state before the refused one is a state the sample never reaches")  # after the rollback
            if want in ("past", None):
                continue  # past a refused draft (that draft is rejected at its own row), or a terminated grammar
            if got != want:
                i = r - first
                masks = {"completed": _grammar(*g, prefix).is_completed() and not drafts}
                if i < len(drafts):
                    after = _grammar(*g, prefix)
                    if all(after.accept(_id(d)) for d in drafts[:i + 1]):
                        masks[f"row {r} holds the mask after draft {i} ({drafts[i]!r}) too: position i (logits "
                              f"row first + i) is where the model predicts drafts[i], after drafts[:i] only: fill "
                              "the row, then accept the draft"] = _mask(after)
                if i > 0:
                    masks[f"row {r} holds the sample's own mask (before any draft): position i follows drafts[:i], "
                          "so advance the matcher through each draft (grammar.accept) before filling the next "
                          "row"] = _mask(_grammar(*g, prefix))
                raise AssertionError(
                    f"{case}: row {r} (position {i} of the sample at row {first}, after {text!r}) allows "
                    f"{_show(sorted(got))}, expected {_show(sorted(want))}; "
                    + _fill_hint(r, got, want, masks, i, drafts, text))
        try:
            returned = [int(r) for r in index]
        except TypeError:
            raise AssertionError(f"{case}: fill returned {index!r}; return the list of rows it filled (apply masks "
                                 "those)") from None
        missing = [r for r in sorted(constrained) if r not in returned and constrained[r][1] not in (None, "past")]
        if missing:
            raise AssertionError(f"{case}: fill returned the rows {returned}, without row {missing[0]}, which it "
                                 "filled: return every constrained position's row (apply masks only those)")
        for (first, grammar, drafts), state in zip(rows, before):
            now = _state(grammar)
            if now != state:
                held, had = now[0], state[0]
                why = ("you advanced it through the drafts and did not roll it back (grammar.rollback(n), n the "
                       "drafts it accepted)" if held > had else
                       "you rolled back more than you advanced: accept returns False for a draft the grammar "
                       "refuses, and the matcher did not move, so count only the drafts it accepted" if held < had
                       else "its state changed")
                raise AssertionError(
                    f"{case}: after fill the matcher of the sample at row {first} holds {held} tokens, it held "
                    f"{had}: the matcher must be where it was, since only the tokens the scheduler appends advance "
                    f"it for good; {why}")
        if past:
            raise AssertionError(past)


def _check_round_trip(cls) -> None:
    """The whole step, the masker called as the runner calls it, against minivllm's own on twin matchers."""
    spec = FILL_CASES[4][2] + [(6, "ebnf", ANSWER, ["ok", " ", "yes"], [])]
    logits = torch.randn(8, len(VOCAB), generator=torch.Generator().manual_seed(7))
    got, want = logits.clone(), logits.clone()
    _call("the masker called as the runner calls it (fill, then apply)", cls(), got, _make_rows(spec))
    MiniGrammarMasker()(want, _make_rows(spec))
    if not torch.equal(got, want):
        r = next(r for r in range(8) if not torch.equal(got[r], want[r]))
        raise AssertionError(f"the masker called as the runner calls it (a drafted row at 0 to 3, plain ones at 4 "
                             f"and 6, rows 5 and 7 unconstrained): logits row {r} differs from minivllm's masker's: "
                             "fill's returned rows must be the rows apply masks")


# -- the live engine -----------------------------------------------------------------------------------------------

CITY_SCHEMA = {"type": "object", "required": ["city", "country", "population"], "additionalProperties": False,
               "properties": {"city": {"type": "string", "maxLength": 30},
                              "country": {"type": "string", "maxLength": 30},
                              "population": {"type": "integer", "minimum": 0}}}
PEOPLE_SCHEMA = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
                 "properties": {"name": {"type": "string", "maxLength": 30},
                                "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
TYPES = {"string": str, "integer": int}
SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)


def _chat(tok, text: str) -> list[int]:
    return tok(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"]


def _live_requests(tok) -> list[tuple]:
    """JSON answers (one whose prompt holds an example the answer copies: prompt lookup drafts it), a choice, and
    an unconstrained request beside them."""
    def json_params(schema):
        return SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(
            json=schema, disable_any_whitespace=True))
    example = '{"city": "Oslo", "country": "Norway", "population": 709000}'
    return [
        ("city", _chat(tok, f"Here is a city as JSON: {example}. Write Paris the same way."), json_params(CITY_SCHEMA)),
        ("person", _chat(tok, "Invent a sailor and describe them as JSON with a name and an age."),
         json_params(PEOPLE_SCHEMA)),
        ("choice", _chat(tok, "Is the sky blue? Answer yes or no."),
         SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
             choice=["yes", "no"]))),
        ("free", _chat(tok, "Tell me about the sea."), SamplingParams(temperature=0.0, max_tokens=12,
                                                                      ignore_eos=True)),
    ]


def _validate(rid: str, text: str, schema: dict) -> None:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise AssertionError(f"your masker in the live engine: request {rid}'s answer is not JSON ({e}): "
                             f"{text!r}") from None
    if not isinstance(value, dict):
        raise AssertionError(f"your masker in the live engine: request {rid}'s answer is not a JSON object: {text!r}")
    for key in schema["required"]:
        want = TYPES[schema["properties"][key]["type"]]
        if key not in value or not isinstance(value[key], want) or isinstance(value[key], bool):
            raise AssertionError(f"your masker in the live engine: request {rid}'s answer {text!r} lacks the key "
                                 f"{key!r} of type {want.__name__} its schema requires")


def _check_live(cls) -> str:
    tok = load_tokenizer("smollm2-135m")
    options = dict(block_size=16, num_blocks=128, max_num_seqs=4, dtype="float32", speculative_config=SPEC)
    requests = _live_requests(tok)
    expected, _, _ = _reference("smollm2-135m", options, requests)  # minivllm's own masker
    what = "your masker in the live engine"
    llm = LLM("smollm2-135m", **options, grammar_masker_cls=cls)
    outputs, _ = drive(llm, requests, what)
    for rid, want in expected.items():
        got = outputs[rid]
        if got != want:
            i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            show = lambda ids: repr(tok.decode(ids))  # noqa: E731
            raise AssertionError(f"{what}: request {rid} differs from minivllm's masker at output token {i}: "
                                 f"expected {show(want[i:i + 4])}, got {show(got[i:i + 4])} (the text before: "
                                 f"{show(want[:i])})")
    schemas = {"city": CITY_SCHEMA, "person": PEOPLE_SCHEMA}
    for rid, schema in schemas.items():
        _validate(rid, tok.decode(outputs[rid], skip_special_tokens=True), schema)
    answer = tok.decode(outputs["choice"], skip_special_tokens=True)
    assert answer in ("yes", "no"), answer
    s = llm.engine.stats()
    return (f"{len(schemas)} JSON answers valid, the choice {answer!r}, {s.spec_decode_num_accepted_tokens} of "
            f"{s.spec_decode_num_draft_tokens} drafts accepted")


def check_grammar_masker(cls, live: bool = True) -> None:
    """Check a ``GrammarMasker`` subclass's ``fill`` and ``apply`` (chapter 19).

    Targeted cases first, over an 80-token vocabulary (three bitmask words a
    row) with real xgrammar matchers: ``apply`` on hand-made bitmasks (xgrammar's bit and
    word order, -inf for a forbidden token, the allowed logits left exactly as
    they are, only the rows of ``index``); ``fill`` on plain and drafted rows
    beside unconstrained ones (each position's row after its drafts, a draft the
    grammar refuses, EOS where the grammar is complete, a grammar that has
    ended, a draft of EOS, the matcher rolled back to where it was); the
    masker called as the runner calls it. The reader's methods run alone:
    minivllm's own fill and apply (and xgrammar's bitmask kernel) raise
    meanwhile, so a method that delegates to them fails. The first failure stops
    the check. Then, unless ``live=False``, SmolLM2 in the live engine with the
    class as its ``grammar_masker_cls`` and speculation on: JSON answers to two
    schemas (each parsed and its keys and types checked), a choice and an
    unconstrained request beside them, greedy; every token must be exactly
    minivllm's masker's. An empty subclass is "not written yet".
    """
    cls = own_part(cls, METHODS, MiniGrammarMasker)
    _xgrammar()
    masker = cls()
    _check_apply(masker)
    _check_fill(masker)
    _check_round_trip(cls)
    print("check_grammar_masker: xgrammar's bit order, -inf for forbidden tokens, allowed logits untouched,\n"
          "  each position's row (drafts too), EOS at the grammar's end, the rollback: right (targeted cases).")
    if not live:
        return
    counts = _check_live(cls)
    print(f"check_grammar_masker: the live engine (smollm2-135m, speculation on), exactly the tokens of\n"
          f"  minivllm's masker: {counts}.")
