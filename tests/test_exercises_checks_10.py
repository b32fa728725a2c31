"""The exercise check of chapter 10 accepts right answers and rejects plausible wrong ones."""

import pytest

from minivllm.exercises import _victim_cases, _victim_seqs, check_choose_victim, reference_choose_victim


def choose_victim(candidates):
    """The solution notebook's answer."""
    return max(candidates, key=lambda s: (s.priority, s.metrics.arrival_time))


def choose_victim_sorted(candidates):
    """Another right answer: sort a copy, take the last."""
    return sorted(candidates, key=lambda s: (s.priority, s.metrics.arrival_time))[-1]


def choose_victim_loop(candidates):
    """Another right answer: an explicit loop."""
    best = None
    for s in candidates:
        if best is None or s.priority > best.priority or (
                s.priority == best.priority and s.metrics.arrival_time > best.metrics.arrival_time):
            best = s
    return best


WRONG = {
    "highest priority (min value)": lambda c: min(c, key=lambda s: (s.priority, -s.metrics.arrival_time)),
    "earliest arrival": lambda c: max(c, key=lambda s: (s.priority, -s.metrics.arrival_time)),
    "ignores priority": lambda c: max(c, key=lambda s: s.metrics.arrival_time),
    "ignores arrival": lambda c: max(c, key=lambda s: s.priority),
    "last in the list": lambda c: c[-1],
    "first in the list": lambda c: c[0],
    "sorts the list in place": lambda c: (c.sort(key=lambda s: (s.priority, s.metrics.arrival_time)), c[-1])[1],
    "returns an index": lambda c: max(range(len(c)), key=lambda i: (c[i].priority, c[i].metrics.arrival_time)),
    "returns the request id": lambda c: choose_victim(c).request_id,
}


@pytest.mark.parametrize("fn", [choose_victim, choose_victim_sorted, choose_victim_loop])
def test_right_answers_pass(fn, capsys):
    check_choose_victim(fn)
    assert "match minivllm's scheduler" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(WRONG))
def test_wrong_answers_fail(name):
    with pytest.raises(AssertionError):
        check_choose_victim(WRONG[name])


def test_reference_is_the_engine_rule():
    for case in _victim_cases(40, seed=1):
        seqs = _victim_seqs(case)
        assert reference_choose_victim(seqs) is choose_victim(seqs)


def test_hints_name_the_mistake():
    with pytest.raises(AssertionError, match="largest value"):
        check_choose_victim(WRONG["highest priority (min value)"])
    with pytest.raises(AssertionError, match="latest arrival"):
        check_choose_victim(WRONG["earliest arrival"])
    with pytest.raises(AssertionError, match="changed"):
        check_choose_victim(WRONG["sorts the list in place"])
