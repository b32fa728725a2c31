"""Chapter 07: a reader's sampler (a Sampler subclass) and incremental detokenizer (an IncrementalDetokenizer
subclass)."""

import torch

from minivllm.detokenizer import IncrementalDetokenizer
from minivllm.exercises import check_detokenizer, check_sampler
from minivllm.sampler import Sampler, SamplerOutput

from exercise_cases import Check

INF = float("-inf")


class MySampler(Sampler):
    """The solution notebook's answer."""

    def __call__(self, logits, params, generators):
        tokens = []
        for row, p, g in zip(logits, params, generators):
            if p.greedy:
                tokens.append(int(row.argmax()))
                continue
            tokens.append(int(torch.multinomial(self.probs(row, p), 1, generator=g or self.generator)))
        return SamplerOutput(tokens, self.logprobs(logits, tokens, params))

    def probs(self, row, p):
        sorted_row, order = (row / p.temperature).sort(descending=True)
        keep = torch.ones_like(sorted_row, dtype=torch.bool)
        if p.top_k > 0:
            keep[p.top_k:] = False
        probs = sorted_row.masked_fill(~keep, INF).softmax(-1)
        keep &= probs.cumsum(-1) - probs < p.top_p
        keep[0] = True
        return torch.full_like(row, INF).scatter(0, order, sorted_row.masked_fill(~keep, INF)).softmax(-1)


class BatchedSampler(Sampler):
    """Another right answer: the filters on the whole batch at once, by ranks, then one draw per row."""

    def __call__(self, logits, params, generators):
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
        scaled = logits / temps[:, None]
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1])
        k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[-1] for p in params])
        remove = ranks[None] >= k[:, None]
        probs = sorted_logits.masked_fill(remove, INF).softmax(-1)
        remove |= probs.cumsum(-1) - probs >= torch.tensor([p.top_p for p in params])[:, None]
        remove[:, 0] = False
        probs = torch.empty_like(scaled).scatter_(-1, order, sorted_logits.masked_fill(remove, INF)).softmax(-1)
        tokens = [int(logits[i].argmax()) if p.greedy else
                  int(torch.multinomial(probs[i], 1, generator=generators[i] or self.generator))
                  for i, p in enumerate(params)]
        return SamplerOutput(tokens, self.logprobs(logits, tokens, params))


def _sampler(probs=None, generator=None, greedy=None):
    """MySampler with one characteristic mistake in its filter, its generator or its greedy rows."""
    def call(self, logits, params, generators):
        tokens = []
        for row, p, g in zip(logits, params, generators):
            if p.greedy and greedy is None:
                tokens.append(int(row.argmax()))
                continue
            if p.greedy:
                row, p = greedy(row, p)
            gen = generator(self, generators, g) if generator else g or self.generator
            tokens.append(int(torch.multinomial((probs or MySampler.probs)(self, row, p), 1, generator=gen)))
        return SamplerOutput(tokens, [])
    return type("WrongSampler", (MySampler,), {"__call__": call})


def _filter(k_extra=0, top_p_rule=None, temperature=lambda row, p: row / p.temperature, after=False,
            top_p_first=False):
    def probs(self, row, p):
        scaled = row if after else temperature(row, p)
        sorted_row, order = scaled.sort(descending=True)
        keep = torch.ones_like(sorted_row, dtype=torch.bool)
        if p.top_k > 0 and not top_p_first:
            keep[p.top_k + k_extra:] = False
        probs = (sorted_row if top_p_first else sorted_row.masked_fill(~keep, INF)).softmax(-1)
        cum = probs.cumsum(-1)
        keep &= top_p_rule(cum, probs, p.top_p) if top_p_rule else cum - probs < p.top_p
        if not top_p_rule:
            keep[0] = True
        if p.top_k > 0 and top_p_first:
            keep[p.top_k:] = False
        kept = torch.full_like(row, INF).scatter(0, order, sorted_row.masked_fill(~keep, INF))
        return (kept / p.temperature if after else kept).softmax(-1)
    return probs


class MyDetokenizer(IncrementalDetokenizer):
    """The solution notebook's answer."""

    def add(self, token_ids):
        delta = ""
        for token in token_ids:
            self.tokens.append(token)
            before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            after = self._decode(self.tokens[self.prefix_offset:])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                delta += after[len(before):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta


class DecodesEachToken(IncrementalDetokenizer):
    def add(self, token_ids):
        delta = self._decode(list(token_ids))
        self.text += delta
        return delta


class DropsHalfCharacters(IncrementalDetokenizer):
    def add(self, token_ids):
        delta = "".join(self._decode([t]) for t in token_ids).replace("\ufffd", "")
        self.text += delta
        return delta


class ReturnsTheWholeText(MyDetokenizer):
    def add(self, token_ids):
        super().add(token_ids)
        return self.text


class KeepsSpecialTokens(MyDetokenizer):
    def _decode(self, ids):
        return self.tokenizer.decode(ids)


class ForgetsSelfText(MyDetokenizer):
    def add(self, token_ids):
        text = self.text
        delta = super().add(token_ids)
        self.text = text
        return delta


CHECKS = [
    Check("07", check_sampler, [MySampler, BatchedSampler], {
        "top-k off by one": (_sampler(_filter(k_extra=1)), "top-k off by one: it keeps k \\+ 1"),
        "top-p drops the crossing token": (_sampler(_filter(top_p_rule=lambda cum, probs, top_p: cum < top_p)),
                                           "dropped the token that crosses p"),
        "top-p drops the top token": (_sampler(_filter(top_p_rule=lambda cum, probs, top_p: cum <= top_p)),
                                      "crosses p|most likely token always stays"),
        "top-p one token too many": (
            _sampler(_filter(top_p_rule=lambda cum, probs, top_p: torch.cat([torch.ones(1, dtype=torch.bool),
                                                                              cum[:-1] - probs[:-1] < top_p]))),
            "one token too many"),
        "top-p before top-k": (_sampler(_filter(top_p_first=True)), "apply top-k first"),
        "temperature after the filter": (_sampler(_filter(after=True)), "temperature was applied after the filter"),
        "temperature ignored": (_sampler(_filter(temperature=lambda row, p: row)), "temperature was not applied"),
        "temperature multiplied": (_sampler(_filter(temperature=lambda row, p: row * p.temperature)),
                                   "multiplied by the temperature"),
        "one shared generator": (_sampler(generator=lambda self, gens, g: self.generator), "one shared generator"),
        "a fresh generator per call": (_sampler(generator=lambda self, gens, g: g or torch.Generator()),
                                       "self.generator"),
        "greedy rows sampled": (_sampler(greedy=lambda row, p: (row, type(p)(temperature=1.0))), "argmax"),
    }, passes="the live engine"),
    Check("07", check_detokenizer, [MyDetokenizer], {
        "decodes each token alone": (DecodesEachToken, "U\\+FFFD"),
        "drops half characters": (DropsHalfCharacters, "text was lost"),
        "returns the whole text": (ReturnsTheWholeText, "only the new text"),
        "keeps special tokens": (KeepsSpecialTokens, "special tokens"),
        "forgets self.text": (ForgetsSelfText, "self.text"),
    }, passes="the live engine"),
]
