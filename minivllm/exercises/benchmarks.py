"""Chapter 11, measuring an engine: the checks of the reader's per-request latencies (TTFT, TPOT,
ITL, E2E) and goodput, against :mod:`minivllm.bench.metrics` (vLLM's definitions).
"""

from __future__ import annotations

import math
import operator
import random

from minivllm.bench import RequestTimes, e2e, goodput, itl, tpot, ttft

__all__ = ["check_request_latencies", "reference_request_latencies", "check_goodput"]


def reference_request_latencies(arrival_time: float, token_times: list[float]) -> dict:
    """One request's TTFT, TPOT, ITL and E2E (seconds), as :mod:`minivllm.bench.metrics` defines them (vLLM's)."""
    r = RequestTimes(arrival_time, list(token_times))
    return {"ttft": ttft(r), "tpot": tpot(r), "itl": itl(r), "e2e": e2e(r)}


def _latency_cases(num: int = 40, seed: int = 0) -> list[tuple[float, list[float]]]:
    """(arrival time, token times): even and uneven gaps, one and two tokens, equal stamps, large clock values."""
    hand = [
        (0.0, [0.25, 0.5, 0.75, 1.0]),
        (1.0, [1.5, 1.625, 2.5, 2.625]),  # one long stall in the middle
        (2.0, [2.5]),  # a single token: no gap, no TPOT
        (0.0, [0.125, 0.375]),
        (0.25, [0.5, 0.5, 0.75]),  # a static batch stamps rows at the same moment: a zero gap is fine
        (1000.0, [1000.5, 1001.0, 1001.25, 1002.0, 1002.125]),  # perf_counter times are large numbers
    ]
    rng = random.Random(seed)
    cases = list(hand)
    for _ in range(num):
        arrival = rng.uniform(0, 50)
        t = arrival + rng.expovariate(5.0)
        times = []
        for _ in range(rng.randint(1, 12)):
            times.append(t)
            t += rng.expovariate(20.0)
        cases.append((arrival, times))
    return cases


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    except (TypeError, ValueError):
        return False


def _wrong_latencies(a: float, t: list[float]) -> dict:
    """Plausible mistakes, keyed by field, each with the hint that names it."""
    n = len(t)
    return {
        "ttft": [(t[0], "TTFT counts from the arrival: token_times[0] - arrival_time")],
        "e2e": [(t[-1] - t[0], "E2E runs from the arrival to the last token (TTFT included)"),
                (t[-1], "E2E counts from the arrival: token_times[-1] - arrival_time")],
        "tpot": [((t[-1] - t[0]) / n, "TPOT divides the time after the first token by the n - 1 gaps, not by n tokens"),
                 ((t[-1] - a) / n, "TPOT leaves the first token out (TTFT already counts the prefill): "
                                   "(t_n - t_1) / (n - 1)"),
                 ((t[-1] - a) / max(n - 1, 1), "TPOT leaves the wait for the first token out: (t_n - t_1) / (n - 1)"),
                 (0.0, "with one token there is no gap: TPOT is None (vLLM leaves such a request out of TPOT)")],
        "itl": [([b - x for x, b in zip([a] + t, t)], "ITL are the gaps *between* output tokens, n - 1 of them; "
                                                     "the wait for the first token is TTFT, not an ITL")],
    }


def check_request_latencies(fn) -> None:
    """Check ``fn(arrival_time, token_times) -> dict`` with keys ``ttft``, ``tpot``, ``itl``, ``e2e`` (chapter 11).

    ``token_times`` are the moments (seconds) the request's output tokens
    appeared, the first included; TPOT is None for a one-token request, ITL a
    list of ``n - 1`` gaps. Compared with :mod:`minivllm.bench.metrics` (vLLM's
    definitions) on hand-made and random requests.
    """
    cases = _latency_cases()
    for arrival, times in cases:
        what = f"request_latencies(arrival_time={arrival:g}, token_times=[{', '.join(f'{x:g}' for x in times)}])"
        expected = reference_request_latencies(arrival, times)
        try:
            got = fn(arrival, list(times))
        except ZeroDivisionError:
            raise AssertionError(f"{what}: ZeroDivisionError; with one token there is no gap, so TPOT is None") from None
        if not isinstance(got, dict) or not set(expected) <= set(got):
            raise AssertionError(f"{what}: expected a dict with keys {sorted(expected)}, got {got!r}")
        for key in ("ttft", "e2e", "tpot", "itl"):
            want, have = expected[key], got[key]
            if key == "itl":
                ok = isinstance(have, (list, tuple)) and len(have) == len(want) and all(map(_close, have, want))
            else:
                ok = _close(have, want)
            if ok:
                continue
            hint = "see the definitions at the top of the notebook"
            wrongs = _wrong_latencies(arrival, times)[key]
            if key == "tpot" and want is None:
                wrongs = wrongs[-1:]  # one token: whatever came back, the answer is None
                hint = wrongs[0][1]
            for value, h in wrongs:
                same = (isinstance(have, (list, tuple)) and len(have) == len(value) and all(map(_close, have, value))
                        if key == "itl" else _close(have, value))
                if same:
                    hint = h
                    break
            raise AssertionError(f"{what}: {key}\n  expected {want!r}\n  got      {have!r}\n  {hint}")
    print(f"check_request_latencies: all {len(cases)} requests match minivllm.bench (vLLM's definitions).")


def _goodput_requests():
    """Requests with known TTFT and TPOT (exact binary fractions, so limits can sit exactly on them)."""
    return [
        RequestTimes(0.0, [0.25, 0.5, 0.75]),  # TTFT 0.25, TPOT 0.25
        RequestTimes(0.0, [0.5, 0.625, 0.75]),  # TTFT 0.5, TPOT 0.125
        RequestTimes(0.0, [0.125]),  # one token: TTFT 0.125, no TPOT
        RequestTimes(0.25, []),  # still waiting: not finished, never counts
        RequestTimes(0.5, [0.75, 1.75]),  # TTFT 0.25, TPOT 1.0
        RequestTimes(0.0, [1.0, 1.25]),  # TTFT 1.0, TPOT 0.25
    ]


_GOODPUT_LIMITS = [(None, None), (0.25, None), (None, 0.5), (None, 0.25), (0.25, 0.25), (0.5, 0.125), (0.0, None),
                   (None, 0.0)]  # in an order where each mistake first shows up alone


def _goodput_cases(num: int = 30, seed: int = 0):
    """(requests, duration, ttft_limit, tpot_limit): limits on, off, exactly at a request's value, and random runs."""
    hand = _goodput_requests()
    cases = [(hand, 2.0, ttft_l, tpot_l) for ttft_l, tpot_l in _GOODPUT_LIMITS]
    rng = random.Random(seed)
    for _ in range(num):
        reqs = []
        for _ in range(rng.randint(1, 10)):
            a = rng.uniform(0, 5)
            times = sorted(a + rng.uniform(0.01, 1.0) + rng.uniform(0, 2) * i / 10 for i in range(rng.randint(0, 8)))
            reqs.append(RequestTimes(a, times))
        cases.append((reqs, rng.uniform(5, 20), rng.choice([None, 0.3, 0.6]), rng.choice([None, 0.05, 0.1])))
    return cases


def _wrong_goodputs(requests, duration, ttft_limit, tpot_limit):
    """What plausible mistakes return, each with the hint that names it."""
    done = [r for r in requests if r.token_times]

    def count(le, one_token_fails=False, none_is_zero=False, keep_unfinished=False):
        tl = 0.0 if none_is_zero and ttft_limit is None else ttft_limit
        pl = 0.0 if none_is_zero and tpot_limit is None else tpot_limit
        n = 0
        for r in done:
            t = tpot(r)
            ok = (tl is None or le(ttft(r), tl)) and (pl is None or (t is None and not one_token_fails)
                                                        or (t is not None and le(t, pl)))
            n += ok
        return n + (len(requests) - len(done) if keep_unfinished else 0)

    right = goodput(requests, duration, ttft_limit, tpot_limit)
    return [
        (right * duration, "goodput is a rate: the requests on time divided by the duration (per second)"),
        (count(operator.lt) / duration, "a request exactly at the limit is on time: compare with <="),
        (count(operator.le, one_token_fails=True) / duration,
         "a one-token request has no TPOT, so it cannot miss a TPOT limit"),
        (count(operator.le, keep_unfinished=True) / duration,
         "a request with no tokens has not finished: leave it out"),
        (count(operator.le, none_is_zero=True) / duration, "a limit of None means no limit on that metric"),
        (len(done) / duration, "check every limit: a request counts only if it meets all of them"),
    ]


def check_goodput(fn) -> None:
    """Check ``fn(requests, duration, ttft_limit=None, tpot_limit=None) -> float``, vLLM's goodput (chapter 11).

    The finished requests (at least one token) per second of ``duration``
    whose TTFT is at most ``ttft_limit`` and whose TPOT is at most
    ``tpot_limit`` (None: no limit; a one-token request has no TPOT and passes
    it). ``requests`` have ``arrival_time`` and ``token_times``. Compared with
    :func:`minivllm.bench.goodput`.
    """
    cases = _goodput_cases()
    for k, (requests, duration, ttft_limit, tpot_limit) in enumerate(cases):
        what = (f"case {k}: {len(requests)} requests, duration {duration:g} s, ttft_limit={ttft_limit}, "
                f"tpot_limit={tpot_limit}")
        if k < len(_GOODPUT_LIMITS):
            what += " (requests: " + "; ".join(f"arrival {r.arrival_time:g}, tokens at {r.token_times}"
                                                for r in requests) + ")"
        expected = goodput(requests, duration, ttft_limit, tpot_limit)
        try:
            got = fn(list(requests), duration, ttft_limit=ttft_limit, tpot_limit=tpot_limit)
        except (IndexError, ValueError, ZeroDivisionError) as e:
            raise AssertionError(f"{what}: {type(e).__name__}: {e}\n  a request with no tokens has not finished: "
                                 f"leave it out before computing its TTFT (and a one-token request has no TPOT)") from None
        if _close(got, expected):
            continue
        hint = next((h for value, h in _wrong_goodputs(requests, duration, ttft_limit, tpot_limit)
                     if _close(got, value)), "count the finished requests that meet every limit, per second")
        raise AssertionError(f"{what}:\n  expected {expected!r} requests/s\n  got      {got!r}\n  {hint}")
    print(f"check_goodput: all {len(cases)} cases match minivllm.bench.goodput.")
