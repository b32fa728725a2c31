"""Chapter 11: a reader's serving metrics from a request's own timestamps (request_latencies, goodput)."""

import numpy as np

from minivllm.bench import goodput as bench_goodput
from minivllm.exercises import check_goodput, check_request_latencies, reference_request_latencies
from minivllm.exercises.benchmarks import _latency_cases

from exercise_cases import Check


def request_latencies(metrics):
    """The solution notebook's answer."""
    t = metrics.token_times
    if not t:
        return {"ttft": None, "tpot": None, "itl": [], "e2e": None}
    done = metrics.finish_time is not None
    return {"ttft": t[0] - metrics.arrival_time,
            "tpot": (t[-1] - t[0]) / (len(t) - 1) if done and len(t) > 1 else None,
            "itl": [b - a for a, b in zip(t, t[1:])],
            "e2e": t[-1] - metrics.arrival_time if done else None}


def request_latencies_numpy(metrics):
    """Another right answer: numpy, TTFT from first_token_time, TPOT as the mean gap."""
    t = np.asarray(metrics.token_times)
    gaps = np.diff(t)
    done = metrics.finish_time is not None and len(t) > 0
    return {"ttft": None if metrics.first_token_time is None else metrics.first_token_time - metrics.arrival_time,
            "tpot": float(gaps.mean()) if done and len(gaps) else None, "itl": gaps.tolist(),
            "e2e": float(t[-1] - metrics.arrival_time) if done else None}


def _with(**changes):
    def fn(metrics):
        out = request_latencies(metrics)
        if metrics.token_times:
            out.update({k: f(metrics, out) for k, f in changes.items()})
        return out
    return fn


def _crashes_when_waiting(metrics):
    t = metrics.token_times
    return {"ttft": t[0] - metrics.arrival_time, **{k: v for k, v in request_latencies(metrics).items() if k != "ttft"}}


def _tpot_by_hand(metrics, out):
    t = metrics.token_times
    return (t[-1] - t[0]) / (len(t) - 1)


LATENCIES_WRONG = {
    "TTFT without the arrival": (_with(ttft=lambda m, o: m.token_times[0]), "TTFT counts from the arrival"),
    "TTFT from the first schedule": (_with(ttft=lambda m, o: m.token_times[0] - m.first_scheduled_time),
                                     "not from first_scheduled_time"),
    "E2E from the first token": (_with(e2e=lambda m, o: o["e2e"] and m.token_times[-1] - m.token_times[0]),
                                 "E2E runs from the arrival"),
    "E2E to finish_time": (_with(e2e=lambda m, o: o["e2e"] and m.finish_time - m.arrival_time),
                           "finish_time is when the engine freed"),
    "E2E before the end": (_with(e2e=lambda m, o: m.token_times[-1] - m.arrival_time), "has no E2E yet"),
    "TPOT over n tokens": (_with(tpot=lambda m, o: o["tpot"] and (m.token_times[-1] - m.token_times[0])
                                 / len(m.token_times)), "n - 1 gaps"),
    "TPOT includes TTFT": (_with(tpot=lambda m, o: o["tpot"] and (m.token_times[-1] - m.arrival_time)
                                 / len(m.token_times)), "leaves the first token out"),
    "one-token TPOT is 0": (_with(tpot=lambda m, o: o["tpot"] or 0.0), "TPOT is None"),
    "one-token TPOT divides by zero": (_with(tpot=_tpot_by_hand), "TPOT is None"),
    "TPOT before the end": (_with(tpot=lambda m, o: o["tpot"] if len(m.token_times) < 2 else _tpot_by_hand(m, o)),
                            "until the request has finished"),
    "ITL starts at the arrival": (_with(itl=lambda m, o: [y - x for x, y in zip([m.arrival_time] + m.token_times,
                                                                                m.token_times)]), "between"),
    "crashes on a waiting request": (_crashes_when_waiting, "still waiting has no token"),
    "returns a tuple": (lambda m: tuple(request_latencies(m).values()), "a dict with keys"),
}


def test_latency_cases_cover_the_edges():
    cases = _latency_cases()
    assert any(len(m.token_times) == 1 and m.finish_time is not None for m in cases)
    assert any(m.token_times and m.finish_time is None for m in cases) and any(not m.token_times for m in cases)
    assert any(m.arrival_time > 100 for m in cases)  # large clock values: TTFT must subtract the arrival
    assert all(reference_request_latencies(m) == request_latencies(m) for m in cases)


def goodput(requests, duration, ttft_limit=None, tpot_limit=None):
    """The solution notebook's answer, built on request_latencies."""
    good = 0
    for metrics in requests:
        m = request_latencies(metrics)
        if m["e2e"] is None:  # not finished
            continue
        if ttft_limit is not None and m["ttft"] > ttft_limit:
            continue
        if tpot_limit is not None and m["tpot"] is not None and m["tpot"] > tpot_limit:
            continue
        good += 1
    return good / duration


def _goodput_with(le=lambda x, lim: x <= lim, one_token_fails=False, finished=True, with_tokens=True, rate=True):
    def fn(requests, duration, ttft_limit=None, tpot_limit=None):
        good = 0
        for r in requests:
            t = r.token_times
            if (finished and r.finish_time is None and t) or (with_tokens and not t):
                continue
            if not t:
                good += 1
                continue
            ttft = t[0] - r.arrival_time
            tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None
            if ttft_limit is not None and not le(ttft, ttft_limit):
                continue
            if tpot_limit is not None and (tpot is None and one_token_fails or tpot is not None
                                           and not le(tpot, tpot_limit)):
                continue
            good += 1
        return good / duration if rate else good
    return fn


def _goodput_crashes_on_waiting(requests, duration, ttft_limit=None, tpot_limit=None):
    return sum(r.token_times[0] - r.arrival_time <= (ttft_limit or 1e9) for r in requests) / duration


GOODPUT_WRONG = {
    "a count, not a rate": (_goodput_with(rate=False), "a rate"),
    "strict <": (_goodput_with(le=lambda x, lim: x < lim), "<="),
    "one-token request fails TPOT": (_goodput_with(one_token_fails=True), "no TPOT"),
    "counts running requests": (_goodput_with(finished=False), "still running"),
    "counts waiting requests": (_goodput_with(with_tokens=False), "has not finished"),
    "crashes on a waiting request": (_goodput_crashes_on_waiting, "has not finished"),
    "throughput, ignoring the limits": (lambda reqs, d, **kw: sum(r.finish_time is not None for r in reqs) / d,
                                        "every limit"),
}

CHECKS = [
    Check("11", check_request_latencies, [request_latencies, request_latencies_numpy, reference_request_latencies],
          LATENCIES_WRONG, passes="matches minivllm.bench too"),
    Check("11", check_goodput, [goodput, bench_goodput], GOODPUT_WRONG, passes="matches too"),
]
