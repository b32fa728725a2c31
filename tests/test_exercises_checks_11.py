"""The exercise checks of chapter 11 accept right answers and reject plausible wrong ones."""

import numpy as np
import pytest

from minivllm.bench import goodput as bench_goodput
from minivllm.exercises import (_latency_cases, check_goodput, check_request_latencies,
                                reference_request_latencies)


def request_latencies(arrival_time, token_times):
    """The solution notebook's answer."""
    n = len(token_times)
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    return {"ttft": token_times[0] - arrival_time,
            "tpot": (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None,
            "itl": gaps,
            "e2e": token_times[-1] - arrival_time}


def request_latencies_numpy(arrival_time, token_times):
    """Another right answer: numpy, TPOT as the mean gap, ITL as an array turned into a list."""
    t = np.asarray(token_times)
    gaps = np.diff(t)
    return {"ttft": float(t[0] - arrival_time), "tpot": float(gaps.mean()) if len(gaps) else None,
            "itl": gaps.tolist(), "e2e": float(t[-1] - arrival_time)}


def goodput(requests, duration, ttft_limit=None, tpot_limit=None):
    """The solution notebook's answer, built on request_latencies."""
    good = 0
    for r in requests:
        if not r.token_times:
            continue
        m = request_latencies(r.arrival_time, r.token_times)
        if ttft_limit is not None and m["ttft"] > ttft_limit:
            continue
        if tpot_limit is not None and m["tpot"] is not None and m["tpot"] > tpot_limit:
            continue
        good += 1
    return good / duration


def _with(**changes):
    def fn(arrival_time, token_times):
        out = request_latencies(arrival_time, token_times)
        out.update({k: f(arrival_time, token_times, out) for k, f in changes.items()})
        return out
    return fn


WRONG_LATENCIES = {
    "TTFT without the arrival": (_with(ttft=lambda a, t, o: t[0]), "TTFT counts from the arrival"),
    "E2E from the first token": (_with(e2e=lambda a, t, o: t[-1] - t[0]), "E2E runs from the arrival"),
    "TPOT over n tokens": (_with(tpot=lambda a, t, o: (t[-1] - t[0]) / len(t)), "n - 1 gaps"),
    "TPOT includes TTFT": (_with(tpot=lambda a, t, o: (t[-1] - a) / len(t)), "leaves the first token out"),
    "one-token TPOT is 0": (_with(tpot=lambda a, t, o: o["tpot"] or 0.0), "TPOT is None"),
    "one-token TPOT divides by zero": (_with(tpot=lambda a, t, o: (t[-1] - t[0]) / (len(t) - 1)), "TPOT is None"),
    "ITL starts at the arrival": (_with(itl=lambda a, t, o: [y - x for x, y in zip([a] + t, t)]), "between"),
    "returns a tuple": (lambda a, t: tuple(request_latencies(a, t).values()), "a dict with keys"),
}


def _goodput_with(le=lambda x, lim: x <= lim, one_token_fails=False, skip_unfinished=True, rate=True):
    def fn(requests, duration, ttft_limit=None, tpot_limit=None):
        good = 0
        for r in requests:
            if skip_unfinished and not r.token_times:
                continue
            if not r.token_times:
                good += 1
                continue
            m = request_latencies(r.arrival_time, r.token_times)
            if ttft_limit is not None and not le(m["ttft"], ttft_limit):
                continue
            if tpot_limit is not None and (m["tpot"] is None and one_token_fails
                                           or m["tpot"] is not None and not le(m["tpot"], tpot_limit)):
                continue
            good += 1
        return good / duration if rate else good
    return fn


def _goodput_crashes_on_unfinished(requests, duration, ttft_limit=None, tpot_limit=None):
    return sum(request_latencies(r.arrival_time, r.token_times)["ttft"] <= (ttft_limit or 1e9)
               for r in requests) / duration


WRONG_GOODPUTS = {
    "a count, not a rate": (_goodput_with(rate=False), "a rate"),
    "strict <": (_goodput_with(le=lambda x, lim: x < lim), "<="),
    "one-token request fails TPOT": (_goodput_with(one_token_fails=True), "no TPOT"),
    "counts unfinished requests": (_goodput_with(skip_unfinished=False), "has not finished"),
    "crashes on an unfinished request": (_goodput_crashes_on_unfinished, "has not finished"),
    "throughput, ignoring the limits": (lambda reqs, d, **kw: sum(bool(r.token_times) for r in reqs) / d,
                                        "every limit"),
}


@pytest.mark.parametrize("fn", [request_latencies, request_latencies_numpy, reference_request_latencies])
def test_right_latencies_pass(fn, capsys):
    check_request_latencies(fn)
    assert "match minivllm.bench" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(WRONG_LATENCIES))
def test_wrong_latencies_fail_with_a_hint(name):
    fn, hint = WRONG_LATENCIES[name]
    with pytest.raises(AssertionError, match=hint):
        check_request_latencies(fn)


@pytest.mark.parametrize("fn", [goodput, bench_goodput])
def test_right_goodput_passes(fn, capsys):
    check_goodput(fn)
    assert "match minivllm.bench.goodput" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(WRONG_GOODPUTS))
def test_wrong_goodput_fails_with_a_hint(name):
    fn, hint = WRONG_GOODPUTS[name]
    with pytest.raises(AssertionError, match=hint):
        check_goodput(fn)


def test_cases_cover_the_edges():
    cases = _latency_cases()
    assert any(len(t) == 1 for _, t in cases) and any(len(t) == 2 for _, t in cases)
    assert any(a > 100 for a, _ in cases)  # large clock values: TTFT must subtract the arrival
