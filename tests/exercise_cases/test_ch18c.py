"""Chapter 18c: a reader's merge_partials(partials) -> out, the merge of split-KV's partial softmaxes."""

import math

import pytest
import torch

from minivllm.exercises import check_merge_partials
from minivllm.exercises.split_kv import partials_of

from exercise_cases import Check


def merge_partials(partials):
    """The solution notebook's answer."""
    top = torch.stack([m for m, _, _ in partials]).max(dim=0).values  # M, each head's largest m_i
    total, out = 0, 0
    for m, l, acc in partials:
        w = torch.exp(m - top)  # at most 1; 0 for an empty chunk (m = -inf)
        total = total + l * w
        out = out + acc * w[:, None]
    return out / total[:, None]


def merge_stacked(partials):
    """Another right answer: the chunks stacked, weights by a softmax of the maxima (l = 0 for empty chunks)."""
    m = torch.stack([p[0] for p in partials])
    l, acc = torch.stack([p[1] for p in partials]), torch.stack([p[2] for p in partials])
    w = torch.exp(m - m.max(dim=0).values) * l
    return (w[..., None] * acc / torch.where(l > 0, l, 1)[..., None]).sum(0) / w.sum(0)[:, None]


def merge_running(partials):
    """Another right answer: chunk by chunk, as an online softmax over partials (chapter 18's rescale)."""
    m, l, acc = partials[0]
    m, l, acc = m.clone(), l.clone(), acc.clone()
    for mi, li, ai in partials[1:]:
        new = torch.maximum(m, mi)
        a = torch.where(m == -math.inf, torch.zeros_like(m), torch.exp(m - new))
        b = torch.where(mi == -math.inf, torch.zeros_like(mi), torch.exp(mi - new))
        l, acc, m = l * a + li * b, acc * a[:, None] + ai * b[:, None], new
    return acc / l[:, None]


def _no_rescale(partials):
    return sum(a for _, _, a in partials) / sum(l for _, l, _ in partials)[:, None]


def _sum_outputs(partials):
    return sum(torch.nan_to_num(a / l[:, None]) for _, l, a in partials)


def _mean_outputs(partials):
    return sum(torch.nan_to_num(a / l[:, None]) for _, l, a in partials) / len(partials)


def _first_max(partials):
    top = partials[0][0]
    w = [torch.exp(m - top) for m, _, _ in partials]
    return (sum(a * wi[:, None] for (_, _, a), wi in zip(partials, w))
            / sum(l * wi for (_, l, _), wi in zip(partials, w))[:, None])


def _divide_first(partials):
    """Each chunk's output, then weights l_i exp(m_i - M): right, but 0 / 0 at an empty chunk."""
    top = torch.stack([m for m, _, _ in partials]).max(dim=0).values
    w = [torch.exp(m - top) * l for m, l, _ in partials]
    return sum((a / l[:, None]) * wi[:, None] for (_, l, a), wi in zip(partials, w)) / sum(w)[:, None]


def _divide_first_max_weights(partials):
    top = torch.stack([m for m, _, _ in partials]).max(dim=0).values
    w = [torch.where(l > 0, torch.exp(m - top), torch.zeros_like(m)) for m, l, _ in partials]
    outs = [torch.nan_to_num(a / l[:, None]) for _, l, a in partials]
    return sum(o * wi[:, None] for o, wi in zip(outs, w)) / sum(w)[:, None]


def _acc_not_rescaled(partials):
    top = torch.stack([m for m, _, _ in partials]).max(dim=0).values
    return sum(a for _, _, a in partials) / sum(l * torch.exp(m - top) for m, l, _ in partials)[:, None]


def _flipped(partials):
    top = torch.stack([m for m, _, _ in partials]).max(dim=0).values
    w = [torch.nan_to_num(torch.exp(top - m), posinf=0.0) for m, _, _ in partials]
    return (sum(a * wi[:, None] for (_, _, a), wi in zip(partials, w))
            / sum(l * wi for (_, l, _), wi in zip(partials, w))[:, None])


def _last_chunk_only(partials):
    m, l, a = partials[-1]
    return a / l[:, None]


def _in_place(partials):
    top = torch.stack([m for m, _, _ in partials]).max(dim=0).values
    for m, l, acc in partials:
        w = torch.exp(m - top)
        l.mul_(w)
        acc.mul_(w[:, None])
    return sum(a for _, _, a in partials) / sum(l for _, l, _ in partials)[:, None]


def _float(partials):
    return float(merge_partials(partials).sum())


MERGE_WRONG = {
    "no rescale": (_no_rescale, (r"\[two equal chunks", r"bring each to the common maximum M first")),
    "sum of outputs": (_sum_outputs, "without their weights"),
    "mean of outputs": (_mean_outputs, r"without their weights: a chunk's share"),
    "first chunk's max": (_first_max, (r"float32, a later chunk's scores 100", "exp overflowed",
                                       "the first chunk's maximum")),
    "divided before merging": (_divide_first, (r"an empty chunk in the middle", r"0 / 0 = NaN")),
    "divided, weights exp only": (_divide_first_max_weights, r"weighted the outputs by exp\(m_i - M\)\s+alone"),
    "acc not rescaled": (_acc_not_rescaled, "but not the weighted values acc_i"),
    "rescale flipped": (_flipped, r"not exp\(M - m_i\)"),
    "last chunk only": (_last_chunk_only, (r"\[two equal chunks", r"M = max_i m_i, L = sum_i")),
    "changes its input": (_in_place, "changed the partials it was given"),
    "a float": (_float, "expected a tensor"),
}

CHECKS = [Check("18c", check_merge_partials, [merge_partials, merge_stacked, merge_running], MERGE_WRONG,
                passes="cases equal the softmax over every key")]


def test_the_partials_merged_as_the_kernel_cuts_them_equal_the_c_kernel():
    """The live part of the check: a right merge of the plan's chunks equals minivllm's split kernel (and the
    plan's chunks are those the kernel merges: a merge of other chunks would differ in the last bits only, so
    this holds the merge, not the plan; tests/test_split_kv.py holds the plan)."""
    check_merge_partials(merge_partials, live=True)


def test_an_unwritten_merge_is_not_written_yet():
    def merge_partials(partials):
        raise NotImplementedError("not written yet: merge_partials")

    with pytest.raises(NotImplementedError, match="not written yet: merge_partials"):
        check_merge_partials(merge_partials)
    with pytest.raises(AssertionError, match="minivllm's own"):
        check_merge_partials(partials_of)
