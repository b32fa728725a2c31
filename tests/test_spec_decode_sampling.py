"""Speculative decoding above temperature 0 keeps the sampling distribution (chapter 17): rejection sampling with
the draft as a point mass, first on made-up logits (each emitted token against its target distribution), then in
the engine (samples with speculation against samples without; smollm2, since the tiny random model never repeats
what prompt lookup drafts). Chi-square tests, each with a
false-alarm rate of 0.1% (p < 0.001 fails), on fixed seeds so CI is deterministic."""

from collections import Counter

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.sampler import apply_top_k_top_p, verify_drafts

ALPHA = 1e-3  # the false-alarm rate of every test here
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def chi2_pvalue(stat: float, df: int) -> float:
    """P(chi-square with ``df`` degrees of freedom >= ``stat``): the regularised upper incomplete gamma function."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def goodness_of_fit(counts: Counter, probs: torch.Tensor) -> float:
    n = sum(counts.values())
    support = [t for t in range(len(probs)) if probs[t] > 0]
    assert set(counts) <= set(support), "a token outside the target's support"
    stat = sum((counts[t] - n * float(probs[t])) ** 2 / (n * float(probs[t])) for t in support)
    return chi2_pvalue(stat, len(support) - 1)


def two_sample(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """Chi-square test that two samples share a distribution (a 2 x C table; rare categories pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    cells, rest = [], [0, 0]
    for k in keys:
        if (a[k] + b[k]) * min(na, nb) / (na + nb) >= min_expected:
            cells.append([a[k], b[k]])
        else:
            rest[0] += a[k]
            rest[1] += b[k]
    if sum(rest):
        cells.append(rest)
    stat = 0.0
    for ca, cb in cells:
        total = ca + cb
        for observed, n in ((ca, na), (cb, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return chi2_pvalue(stat, len(cells) - 1)


def test_chi2_pvalue_is_the_chi_square_tail():
    assert chi2_pvalue(3.841, 1) == pytest.approx(0.05, abs=1e-3)  # the textbook critical values
    assert chi2_pvalue(16.266, 3) == pytest.approx(0.001, abs=1e-4)


@pytest.mark.parametrize("top_k", [-1, 3])
def test_each_emitted_token_has_the_target_distribution(top_k):
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    draft = [int(logits[0].argsort(descending=True)[1]), int(logits[1].argmax())]  # a likely and an unlikely-ish one
    params = SamplingParams(temperature=0.8, top_k=top_k)
    target = apply_top_k_top_p(logits / 0.8, torch.full((3,), top_k), torch.ones(3)).softmax(-1)
    g = torch.Generator().manual_seed(1)
    runs = [verify_drafts(logits, draft, params, g) for _ in range(4000)]
    assert {len(r) for r in runs} == {1, 2, 3}  # rejected at the first, at the second, all accepted (+ bonus)
    assert goodness_of_fit(Counter(r[0] for r in runs), target[0]) > ALPHA
    after_first = [r for r in runs if r[0] == draft[0]]
    assert goodness_of_fit(Counter(r[1] for r in after_first), target[1]) > ALPHA
    after_both = [r for r in runs if r[:2] == draft]
    assert goodness_of_fit(Counter(r[2] for r in after_both), target[2]) > ALPHA
    rate = sum(r[0] == draft[0] for r in runs) / len(runs)
    assert abs(rate - float(target[0, draft[0]])) < 0.035  # accepted with probability p(x), within ~4 sigma


def test_seeded_requests_are_reproducible_with_speculation():
    llm = LLM("tiny-random", num_blocks=64, device="cpu", speculative_config=SPEC)
    prompt = [11, 12, 13, 14] * 4
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=8, ignore_eos=True) for s in (1, 2, 1)]
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * 3, params, use_tqdm=False)]
    assert outs[0] == outs[2] and outs[0] != outs[1]
    again = llm.generate([prompt], params[0], use_tqdm=False)[0].outputs[0].token_ids
    assert again == outs[0]


def test_sampling_with_speculation_matches_sampling_without():
    """smollm2 copying a sentence (its drafts are often right, sometimes not), top-k 3 at temperature 1: the first
    tokens of 240 seeded samples with speculation against 240 without (prefix caching shares the prompt)."""
    typo = ("Fix the typo in this sentence and write it out again: The quick brown fox jumsp over the lazy dog while "
            "the old cat sleeps in the warm sun.")
    n, tokens = 240, 4
    samples = {}
    for name, spec in (("off", None), ("on", SPEC)):
        llm = LLM("smollm2-135m", num_blocks=512, max_num_seqs=48, device="cpu", enable_prefix_caching=True,
                  speculative_config=spec)
        prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": typo}],
                                                         add_generation_prompt=True, tokenize=False)
        params = [SamplingParams(temperature=1.0, top_k=3, seed=1000 * (spec is not None) + i, max_tokens=tokens,
                                 ignore_eos=True) for i in range(n)]
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        samples[name] = [tuple(o.outputs[0].token_ids) for o in outs]
        if spec is not None:
            stats = llm.engine.stats()
            assert stats.spec_decode_num_accepted_tokens > n // 2  # drafts were accepted (and some rejected)
            assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    for position in range(1, tokens):  # every drafted position's marginal, and the whole sequences
        assert two_sample(Counter(s[position] for s in samples["off"]),
                          Counter(s[position] for s in samples["on"])) > ALPHA, position
    assert two_sample(Counter(samples["off"]), Counter(samples["on"])) > ALPHA
