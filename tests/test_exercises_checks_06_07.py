"""The exercise checks of chapters 06 and 07 accept the reference and reject plausible wrong answers."""

import pytest
import torch

from minivllm.exercises import (_SCHEDULE_CASES, _random_schedule_cases, check_schedule_step, check_top_p_filter,
                                reference_schedule_step, reference_top_p)
from minivllm.sampler import apply_top_k_top_p


# check_schedule_step ----------------------------------------------------------------------------------

def schedule_step(running, waiting, token_budget, max_num_seqs):
    """The solution notebook's answer."""
    batch = [(rid, 1) for rid in running]
    tokens_left, seats_left = token_budget - len(running), max_num_seqs - len(running)
    for rid, n in waiting:
        if seats_left == 0 or n > tokens_left:
            break
        batch.append((rid, n))
        tokens_left -= n
        seats_left -= 1
    return batch


def schedule_step_while(running, waiting, token_budget, max_num_seqs):
    """Another right answer: count what is in the batch as it grows; lists instead of tuples."""
    batch = [[rid, 1] for rid in running]
    queue = list(waiting)
    while queue and len(batch) < max_num_seqs and sum(n for _, n in batch) + queue[0][1] <= token_budget:
        batch.append(list(queue.pop(0)))
    return batch


def _variant(decodes_first=True, skip=False, count_running_seats=True, count_decode_tokens=True, strict=False):
    def fn(running, waiting, token_budget, max_num_seqs):
        tokens = token_budget - (len(running) if count_decode_tokens else 0)
        seats = max_num_seqs - (len(running) if count_running_seats else 0)
        admitted = []
        for rid, n in waiting:
            fits = seats > 0 and (n < tokens if strict else n <= tokens)
            if not fits:
                if skip:
                    continue
                break
            admitted.append((rid, n))
            tokens -= n
            seats -= 1
        decodes = [(rid, 1) for rid in running]
        return decodes + admitted if decodes_first else admitted + decodes
    return fn


SCHEDULE_WRONG = {
    "prefills before decodes": (_variant(decodes_first=False), "decodes come first"),
    "skips a request that does not fit": (_variant(skip=True), "first come, first served"),
    "running requests hold no seats": (_variant(count_running_seats=False), "max_num_seqs"),
    "decode tokens not in the budget": (_variant(count_decode_tokens=False), "over token_budget"),
    "a prompt may not fill the budget exactly": (_variant(strict=True), "fits"),
    "forgets the decodes": (lambda r, w, b, s: _variant()([], w, b - len(r), s - len(r)), "every running request"),
    "only the ids": (lambda r, w, b, s: [rid for rid, _ in _variant()(r, w, b, s)], "pairs"),
    "whole prompt plus one": (lambda r, w, b, s: [(rid, n + (rid not in r)) for rid, n in _variant()(r, w, b, s)],
                              "prompt length"),
}


def test_reference_is_the_engine_scheduler():
    for case in _SCHEDULE_CASES + _random_schedule_cases(200, seed=1):
        assert reference_schedule_step(*case) == schedule_step(*case), case


@pytest.mark.parametrize("fn", [schedule_step, schedule_step_while, reference_schedule_step])
def test_schedule_check_passes_right_answers(fn, capsys):
    check_schedule_step(fn)
    assert "check_schedule_step: all" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(SCHEDULE_WRONG))
def test_schedule_check_rejects_wrong_answers(name):
    fn, hint = SCHEDULE_WRONG[name]
    with pytest.raises(AssertionError, match=hint):
        check_schedule_step(fn)


def test_schedule_check_says_what_differs():
    with pytest.raises(AssertionError) as err:
        check_schedule_step(_variant(skip=True))
    message = str(err.value)
    assert "schedule_step(running=" in message and "expected [" in message and "got      [" in message


# check_top_p_filter -----------------------------------------------------------------------------------

def top_p_filter(probs, p):
    """The solution notebook's answer."""
    sorted_probs, order = probs.sort(descending=True)
    keep_sorted = sorted_probs.cumsum(0) - sorted_probs < p
    keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


def top_p_by_index(probs, p):
    """Another right answer: walk the sorted tokens in Python, float64 result."""
    order = probs.argsort(descending=True).tolist()
    out, mass = torch.zeros(probs.shape, dtype=torch.float64), 0.0
    for t in order:
        if mass >= p:
            break
        out[t] = float(probs[t])
        mass += float(probs[t])
    return out / out.sum()


def _sorted_filter(rule, renormalise=True, in_place=False):
    def fn(probs, p):
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(0)
        keep_sorted = rule(cum, sorted_probs, p)
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        target = probs if in_place else probs.clone()
        target[~keep] = 0
        return target / target.sum() if renormalise else target
    return fn


def unsorted(probs, p):
    """Keeps tokens in vocabulary order until the mass reaches p."""
    before = probs.cumsum(0) - probs
    kept = torch.where(before < p, probs, torch.zeros_like(probs))
    return kept / kept.sum()


TOP_P_WRONG = {
    "drops the token that reaches p": (_sorted_filter(lambda cum, s, p: (cum < p) | (cum == cum[0])), "dropped the token"),
    "cumsum <= p": (_sorted_filter(lambda cum, s, p: cum <= p), "nothing kept"),
    "one token too many": (_sorted_filter(lambda cum, s, p: torch.cat([torch.ones(1, dtype=torch.bool), cum[:-1] - s[:-1] < p])),
                           "one token too many"),
    "not renormalised": (_sorted_filter(lambda cum, s, p: cum - s < p, renormalise=False), "renormalise"),
    "modifies the input": (_sorted_filter(lambda cum, s, p: cum - s < p, in_place=True), "in place"),
    "does not sort": (unsorted, "sort by probability"),
    "returns the kept indices": (lambda probs, p: (top_p_filter(probs, p) > 0).nonzero().flatten(), "shape"),
    "returns a list": (lambda probs, p: top_p_filter(probs, p).tolist(), "torch.Tensor"),
    "keeps p, not 1 - p, of the tail": (lambda probs, p: top_p_filter(probs, 1 - p if p < 1 else 1.0), "keeps"),
}


def test_reference_top_p_is_the_sampler():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(200, generator=g) * 2
        for p in (0.2, 0.7, 0.93):
            expected = apply_top_k_top_p(logits[None], torch.tensor([-1]), torch.tensor([p]))[0].softmax(-1)
            got = reference_top_p(logits.softmax(-1), p)
            assert torch.equal(got > 0, expected > 0)
            assert torch.allclose(got.float(), expected, atol=1e-6)


@pytest.mark.parametrize("fn", [top_p_filter, top_p_by_index, lambda probs, p: reference_top_p(probs, p)])
def test_top_p_check_passes_right_answers(fn, capsys):
    check_top_p_filter(fn)
    assert "check_top_p_filter: all" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(TOP_P_WRONG))
def test_top_p_check_rejects_wrong_answers(name):
    fn, hint = TOP_P_WRONG[name]
    with pytest.raises(AssertionError, match=hint):
        check_top_p_filter(fn)
