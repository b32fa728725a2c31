"""Chapter 19: a reader's grammar masker (fill, apply), plugged in as grammar_masker_cls."""

import builtins

import pytest
import torch

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.exercises import check_grammar_masker
from minivllm.sampler import GrammarMasker, MiniGrammarMasker, apply_token_bitmask
from minivllm.structured_output import INSTALL

from exercise_cases import Check

try:
    import xgrammar  # noqa: F401  the README's commands install it; without it the check says what to install
    HAVE_XGRAMMAR = True
except ImportError:
    HAVE_XGRAMMAR = False
needs_xgrammar = pytest.mark.skipif(not HAVE_XGRAMMAR, reason="xgrammar is not installed")


class MyGrammarMasker(GrammarMasker):
    """The solution notebook's answer."""

    def fill(self, bitmask, rows):
        index = []
        for first, grammar, drafts in rows:
            advanced = 0
            for i in range(len(drafts) + 1):
                if not grammar.is_terminated():
                    grammar.fill_bitmask(bitmask, first + i)
                index.append(first + i)
                if i == len(drafts) or not grammar.accept(drafts[i]):
                    break
                advanced += 1
            grammar.rollback(advanced)
        return index

    def apply(self, logits, bitmask, index):
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask[index].unsqueeze(-1) >> bits) & 1).flatten(1)[:, :logits.shape[-1]].bool()
        logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))


class OneRowAtATime(MyGrammarMasker):
    """Another right shape: a loop over the rows, the bits unpacked with a bool mask per row, every row of the
    bitmask applied (the rows no grammar wrote allow every token)."""

    def apply(self, logits, bitmask, index):
        vocab = logits.shape[-1]
        for r in range(logits.shape[0]):
            words = bitmask[r].tolist()
            allowed = torch.tensor([(words[t // 32] >> (t % 32)) & 1 == 1 for t in range(vocab)])
            logits[r][~allowed] = float("-inf")


# (a) the logits changed beyond the mask ---------------------------------------------------------------------------

class Renormalises(MyGrammarMasker):
    def apply(self, logits, bitmask, index):  # the chapter's "renormalised" odds, as log-probabilities
        super().apply(logits, bitmask, index)
        logits[index] = logits[index].log_softmax(-1)


class ScalesByTemperature(MyGrammarMasker):
    def apply(self, logits, bitmask, index):  # temperature applied here, before (or as if after) the mask
        logits[index] = logits[index] / 0.7
        super().apply(logits, bitmask, index)


class MultipliesByTheMask(MyGrammarMasker):
    def apply(self, logits, bitmask, index):
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask[index].unsqueeze(-1) >> bits) & 1).flatten(1)[:, :logits.shape[-1]]
        logits[index] = logits[index] * allowed


class MasksWithAFiniteNumber(MyGrammarMasker):
    def apply(self, logits, bitmask, index):
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask[index].unsqueeze(-1) >> bits) & 1).flatten(1)[:, :logits.shape[-1]].bool()
        logits[index] = logits[index].masked_fill(~allowed, -1e9)


class ReturnsACopy(MyGrammarMasker):
    def apply(self, logits, bitmask, index):
        out = logits.clone()
        super().apply(out, bitmask, index)
        return out


# (b) xgrammar's bit order ----------------------------------------------------------------------------------------

class ReversedBits(MyGrammarMasker):
    def apply(self, logits, bitmask, index):  # bit 31 - j for token j
        bits = 31 - torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask[index].unsqueeze(-1) >> bits) & 1).flatten(1)[:, :logits.shape[-1]].bool()
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


class ReversedWords(MyGrammarMasker):
    def apply(self, logits, bitmask, index):  # the last word first
        super().apply(logits, bitmask.flip(-1), index)


# (c) the wrong rows ----------------------------------------------------------------------------------------------

class MasksTheKthRow(MyGrammarMasker):
    def fill(self, bitmask, rows):  # the k-th constrained sample's mask on logits row k
        for k, (first, grammar, drafts) in enumerate(rows):
            grammar.fill_bitmask(bitmask, k)
        return list(range(len(rows)))


class DraftRowsFromZero(MyGrammarMasker):
    def fill(self, bitmask, rows):  # position i of every sample on row i, not first + i
        return super().fill(bitmask, [(0, grammar, drafts) for first, grammar, drafts in rows])


class CompactBitmask(MyGrammarMasker):
    def apply(self, logits, bitmask, index):  # bitmask row k for logits row index[k]
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask[:len(index)].unsqueeze(-1) >> bits) & 1).flatten(1)[:, :logits.shape[-1]].bool()
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


# (d) the matcher through the drafts ------------------------------------------------------------------------------

class NoRollback(MyGrammarMasker):
    def fill(self, bitmask, rows):
        index = []
        for first, grammar, drafts in rows:
            for i in range(len(drafts) + 1):
                grammar.fill_bitmask(bitmask, first + i)
                index.append(first + i)
                if i == len(drafts) or not grammar.accept(drafts[i]):
                    break
        return index


class CountsRefusedDrafts(MyGrammarMasker):
    def fill(self, bitmask, rows):  # every draft counted as advanced, refused or not
        index = []
        for first, grammar, drafts in rows:
            for i in range(len(drafts) + 1):
                grammar.fill_bitmask(bitmask, first + i)
                index.append(first + i)
                if i < len(drafts):
                    grammar.accept(drafts[i])
            grammar.rollback(len(drafts))
        return index


class NeverAdvances(MyGrammarMasker):
    def fill(self, bitmask, rows):  # every position filled from the sample's own state
        index = []
        for first, grammar, drafts in rows:
            for i in range(len(drafts) + 1):
                grammar.fill_bitmask(bitmask, first + i)
                index.append(first + i)
        return index


class AcceptsBeforeFilling(MyGrammarMasker):
    def fill(self, bitmask, rows):  # each row filled after its own draft
        index = []
        for first, grammar, drafts in rows:
            advanced = 0
            for i in range(len(drafts) + 1):
                if i < len(drafts) and grammar.accept(drafts[i]):
                    advanced += 1
                grammar.fill_bitmask(bitmask, first + i)
                index.append(first + i)
            grammar.rollback(advanced)
        return index


class SkipsTheBonusRow(MyGrammarMasker):
    def fill(self, bitmask, rows):  # one row per draft: the position after the last draft is left whole
        index = []
        for first, grammar, drafts in rows:
            if not drafts:
                grammar.fill_bitmask(bitmask, first)
                index.append(first)
                continue
            advanced = 0
            for i, draft in enumerate(drafts):
                grammar.fill_bitmask(bitmask, first + i)
                index.append(first + i)
                if not grammar.accept(draft):
                    break
                advanced += 1
            grammar.rollback(advanced)
        return index


# (e) EOS where the grammar is complete ---------------------------------------------------------------------------

class SkipsCompletedGrammars(MyGrammarMasker):
    def fill(self, bitmask, rows):  # is_completed taken for is_terminated: the row is left whole
        return super().fill(bitmask, [r for r in rows if not r[1].is_completed()])


class RefusesEos(MyGrammarMasker):
    def fill(self, bitmask, rows):  # EOS "only once the grammar is terminated"
        index = super().fill(bitmask, rows)
        for first, grammar, drafts in rows:
            if not grammar.is_terminated():
                for eos in grammar.matcher.stop_token_ids:
                    bitmask[first, eos // 32] &= ~(1 << (eos % 32))
        return index


class ForcesEos(MyGrammarMasker):
    def fill(self, bitmask, rows):  # "complete" taken for "over": only EOS
        index = super().fill(bitmask, rows)
        for first, grammar, drafts in rows:
            if grammar.is_completed() and not drafts:
                bitmask[first] = 0
                for eos in grammar.matcher.stop_token_ids:
                    bitmask[first, eos // 32] |= 1 << (eos % 32)
        return index


# (f) a grammar that has ended, a refused draft ----------------------------------------------------------------

class NoTerminatedGuard(MyGrammarMasker):
    def fill(self, bitmask, rows):  # every position filled, the grammar ended (EOS accepted) or not
        index = []
        for first, grammar, drafts in rows:
            advanced = 0
            for i in range(len(drafts) + 1):
                grammar.fill_bitmask(bitmask, first + i)
                index.append(first + i)
                if i == len(drafts) or not grammar.accept(drafts[i]):
                    break
                advanced += 1
            grammar.rollback(advanced)
        return index


class GuardsTheSampleOnly(MyGrammarMasker):
    def fill(self, bitmask, rows):  # a sample that has ended is skipped, but not a position after a drafted EOS
        index = []
        for first, grammar, drafts in rows:
            if grammar.is_terminated():
                index.append(first)
                continue
            advanced = 0
            for i in range(len(drafts) + 1):
                grammar.fill_bitmask(bitmask, first + i)
                index.append(first + i)
                if i == len(drafts) or not grammar.accept(drafts[i]):
                    break
                advanced += 1
            grammar.rollback(advanced)
        return index


class FillsPastARefusedDraft(MyGrammarMasker):
    def fill(self, bitmask, rows):  # after a draft the grammar refuses, the later drafts still tried and filled
        index = []
        for first, grammar, drafts in rows:
            advanced = 0
            for i in range(len(drafts) + 1):
                if not grammar.is_terminated():
                    grammar.fill_bitmask(bitmask, first + i)
                index.append(first + i)
                if i < len(drafts) and grammar.accept(drafts[i]):
                    advanced += 1
            grammar.rollback(advanced)
        return index


# (g) not in place ------------------------------------------------------------------------------------------------

class RebindsLogits(MyGrammarMasker):
    def apply(self, logits, bitmask, index):  # a new tensor, bound to the local name only
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :logits.shape[-1]].bool()
        logits = logits.masked_fill(~allowed, float("-inf"))


class MasksACopy(MyGrammarMasker):
    def apply(self, logits, bitmask, index):  # logits[index] is a copy (advanced indexing): masked, then lost
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask[index].unsqueeze(-1) >> bits) & 1).flatten(1)[:, :logits.shape[-1]].bool()
        logits[index].masked_fill_(~allowed, float("-inf"))


# (h) minivllm's own part, delegated to ---------------------------------------------------------------------------

class DelegatesToMinivllm(GrammarMasker):
    def fill(self, bitmask, rows):
        return MiniGrammarMasker.fill(self, bitmask, rows)

    def apply(self, logits, bitmask, index):
        MiniGrammarMasker.apply(self, logits, bitmask, index)


class AppliesWithMinivllmsFunction(MyGrammarMasker):
    def apply(self, logits, bitmask, index):  # the bit unpacking is the exercise: here, minivllm's
        apply_token_bitmask(logits, bitmask, index)


class AppliesWithXgrammar(MyGrammarMasker):
    def apply(self, logits, bitmask, index):
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=index)


class FillsWithMinivllmsMasker(MyGrammarMasker):
    def fill(self, bitmask, rows):
        return MiniGrammarMasker().fill(bitmask, rows)


CHECKS = [] if not HAVE_XGRAMMAR else [Check("19", check_grammar_masker, [MyGrammarMasker, OneRowAtATime], {
    "renormalises the allowed logits": (Renormalises, ("token 0 is allowed, but its logit changed",
                                                       "before the sampler's temperature")),
    "scales by a temperature": (ScalesByTemperature, "leave the allowed logits exactly as they are"),
    "multiplies by the mask": (MultipliesByTheMask, "its logit is 0 .multiplied by the mask"),
    "a finite number for -inf": (MasksWithAFiniteNumber, "not -inf"),
    "returns a copy": (ReturnsACopy, "in place"),
    "bit order reversed": (ReversedBits, "the bit order is reversed"),
    "word order reversed": (ReversedWords, "the words are in the wrong order"),
    "the k-th sample on row k": (MasksTheKthRow, ("row 0 has no constraint", "not its place 0 in rows")),
    "drafted positions from row 0": (DraftRowsFromZero, "row 0 has no constraint"),
    "bitmask rows compacted": (CompactBitmask, "one row per logits row"),
    "no rollback": (NoRollback, "did not roll it back"),
    "a refused draft counted": (CountsRefusedDrafts, "rolled back more than you advanced"),
    "never advanced through the drafts": (NeverAdvances, "holds the sample's own mask"),
    "accepts before filling": (AcceptsBeforeFilling, "fill the row, then accept the draft"),
    "the bonus row left whole": (SkipsTheBonusRow, "the bonus token"),
    "a completed grammar left whole": (SkipsCompletedGrammars, "only complete, not terminated"),
    "EOS refused at the grammar's end": (RefusesEos, "EOS refused where the grammar is complete"),
    "EOS forced at the grammar's end": (ForcesEos, "may still go on"),
    "no is_terminated() guard": (NoTerminatedGuard, ("follows EOS", r"is_terminated\(\): EOS accepted",
                                                     "leave such a row whole")),
    "a drafted EOS not guarded": (GuardsTheSampleOnly, ("propose EOS", "Logits row 3 follows EOS")),
    "later drafts tried after a refused one": (FillsPastARefusedDraft, ("comes after the draft 'no', which the "
                                                                        "grammar refuses", "stop at the first")),
    "a new tensor bound to the name logits": (RebindsLogits, ("logits are unchanged after apply", "in place")),
    "masked_fill_ on logits[index], a copy": (MasksACopy, ("logits are unchanged after apply", "is a copy")),
    "minivllm's own fill and apply called": (DelegatesToMinivllm, ("MiniGrammarMasker.apply",
                                                                   "the check runs your part alone")),
    "apply as minivllm's apply_token_bitmask": (AppliesWithMinivllmsFunction, (
        "called minivllm.sampler.apply_token_bitmask", "the check runs your part alone")),
    "apply as xgrammar's kernel": (AppliesWithXgrammar, "called xgrammar.apply_token_bitmask_inplace"),
    "fill as minivllm's masker's": (FillsWithMinivllmsMasker, "called MiniGrammarMasker.fill"),
}, passes="the live engine")]


def test_a_class_with_minivllms_methods_or_stubs_is_not_written_yet():
    class Inherits(MiniGrammarMasker):
        pass

    class Empty(GrammarMasker):
        pass

    with pytest.raises(NotImplementedError, match=r"minivllm's own MiniGrammarMasker.fill, inherited"):
        check_grammar_masker(Inherits, live=False)
    with pytest.raises(NotImplementedError, match=r"not written yet: Empty.fill, Empty.apply"):
        check_grammar_masker(Empty, live=False)
    with pytest.raises(ValueError, match="grammar_masker_cls"):
        LLM("tiny-random", device="cpu", num_blocks=16, grammar_masker_cls=GrammarMasker)


def test_without_xgrammar_the_check_says_what_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_xgrammar(name, *args, **kwargs):
        if name.split(".")[0] == "xgrammar":
            raise ImportError("No module named 'xgrammar'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    with pytest.raises(RuntimeError, match=INSTALL.replace(".", r"\.")):
        check_grammar_masker(MyGrammarMasker, live=False)


@needs_xgrammar
def test_the_engine_runs_the_readers_masker_for_constrained_rows_only():
    """grammar_masker_cls is what the runner calls, once a step with constrained rows and never without."""
    calls = []

    class Counted(MyGrammarMasker):
        def fill(self, bitmask, rows):
            calls.append([first for first, _, _ in rows])
            return super().fill(bitmask, rows)

    llm = LLM("tiny-random", device="cpu", num_blocks=64, grammar_masker_cls=Counted)
    assert isinstance(llm.engine.runner.grammar_masker, Counted)
    tok = llm.get_tokenizer()
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([tok("Hello")["input_ids"]], plain, use_tqdm=False)
    assert calls == []
    choice = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))
    llm.generate([{"prompt_token_ids": tok("Hi")["input_ids"]}], choice, use_tqdm=False)  # compiled, then cached
    assert calls and all(rows == [0] for rows in calls)
    calls.clear()  # the grammar is cached now: the constrained request is ready in the step it arrives, whatever
    # the compile's speed (a request still compiling waits, and the plain one could run alone meanwhile)
    outs = llm.generate([{"prompt_token_ids": tok("Hello")["input_ids"]}, {"prompt_token_ids": tok("Hi")["input_ids"]}],
                        [plain, choice], use_tqdm=False)
    assert calls and outs[1].outputs[0].text in ("yes", "no")
    assert calls[0] == [1]  # the first step: the second prompt's row, after the unconstrained one's
