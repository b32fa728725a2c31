"""Chapter 11, measuring an engine: the checks of the reader's per-request latencies (TTFT, TPOT, ITL, E2E)
from a request's own timestamps (``RequestOutput.metrics``) and of goodput, against :mod:`minivllm.bench.metrics`
(vLLM's definitions): targeted requests first, then an online workload replayed through the engine, every
request compared at every step.
"""

from __future__ import annotations

import copy
import math
import operator
import random

from minivllm.bench import e2e, goodput, itl, make_workload, replay, tpot, ttft
from minivllm.bench.workloads import Arrival
from minivllm.engine import LLM
from minivllm.exercises._common import say
from minivllm.exercises.live import greedy
from minivllm.models import load_tokenizer
from minivllm.sequence import RequestMetrics

__all__ = ["check_request_latencies", "reference_request_latencies", "check_goodput", "request_metrics",
           "online_run"]

_NONE = {"ttft": None, "tpot": None, "itl": [], "e2e": None}


def request_metrics(arrival_time: float, token_times: list[float], finished: bool = True,
                    scheduled_after: float | None = None) -> RequestMetrics:
    """A request's ``RequestMetrics`` as the engine fills them: the first token's time, every token's time, the
    finish time a moment after the last token (None while it runs), the time it was first scheduled."""
    t = list(token_times)
    first = t[0] if t else None
    scheduled = None if first is None else arrival_time + (first - arrival_time) / 2 if scheduled_after is None \
        else arrival_time + scheduled_after
    return RequestMetrics(arrival_time=arrival_time, first_scheduled_time=scheduled, first_token_time=first,
                          finish_time=t[-1] + 0.0625 if finished and t else None, token_times=t,
                          num_output_tokens=len(t))


def reference_request_latencies(metrics) -> dict:
    """One request's TTFT, TPOT, ITL and E2E (seconds) from its metrics, as :mod:`minivllm.bench.metrics`
    defines them (vLLM's). A request without a token has none of them (ITL empty); TPOT and E2E wait for its end.
    """
    if not metrics.token_times:
        return dict(_NONE)
    done = metrics.finish_time is not None
    return {"ttft": ttft(metrics), "tpot": tpot(metrics), "itl": itl(metrics), "e2e": e2e(metrics) if done else None}


def _latency_cases(num: int = 40, seed: int = 0) -> list[RequestMetrics]:
    """Even and uneven gaps, one and two tokens, equal stamps, large clock values, unfinished and waiting ones."""
    hand = [
        request_metrics(0.0, [0.25, 0.5, 0.75, 1.0]),
        request_metrics(1.0, [1.5, 1.625, 2.5, 2.625]),  # one long stall in the middle
        request_metrics(2.0, [2.5]),  # a single token: no gap, no TPOT
        request_metrics(0.0, [0.125, 0.375]),
        request_metrics(0.25, [0.5, 0.5, 0.75]),  # rows sampled in one step get the same stamp: a zero gap is fine
        request_metrics(1000.0, [1000.5, 1001.0, 1001.25, 1002.0, 1002.125]),  # perf_counter times are large
        request_metrics(3.0, [3.25, 3.5, 4.0], finished=False),  # still generating
        request_metrics(5.0, [5.5], finished=False),
        request_metrics(4.0, [], finished=False),  # still waiting for its first token
    ]
    rng = random.Random(seed)
    cases = list(hand)
    for _ in range(num):
        arrival = rng.uniform(0, 50)
        t = arrival + rng.expovariate(5.0)
        times = []
        for _ in range(rng.randint(0 if rng.random() < 0.1 else 1, 12)):
            times.append(t)
            t += rng.expovariate(20.0)
        cases.append(request_metrics(arrival, times, finished=rng.random() < 0.8))
    return cases


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    except (TypeError, ValueError):
        return False


def _same(key: str, a, b) -> bool:
    if key == "itl":
        return isinstance(a, (list, tuple)) and len(a) == len(b) and all(map(_close, a, b))
    return _close(a, b)


def _wrong_latencies(m) -> dict:
    """Plausible mistakes, keyed by field, each with the hint that names it."""
    a, t, n = m.arrival_time, m.token_times, len(m.token_times)
    done = m.finish_time is not None
    if not t:
        return {}
    return {
        "ttft": [(t[0], "TTFT counts from the arrival: token_times[0] - arrival_time"),
                 (t[0] - m.first_scheduled_time, "TTFT counts from the arrival, the wait in the queue included, "
                                                 "not from first_scheduled_time")],
        "e2e": [(t[-1] - a, "an unfinished request (finish_time is None) has no E2E yet: None") if not done else
                (t[-1] - t[0], "E2E runs from the arrival to the last token (TTFT included)"),
                (t[-1], "E2E counts from the arrival: token_times[-1] - arrival_time"),
                ((m.finish_time or 0) - a, "E2E runs to the last token, token_times[-1] - arrival_time; finish_time "
                                           "is when the engine freed the request, a moment later")],
        "tpot": [((t[-1] - t[0]) / n, "TPOT divides the time after the first token by the n - 1 gaps, not by n tokens"),
                 ((t[-1] - a) / n, "TPOT leaves the first token out (TTFT already counts the prefill): "
                                   "(t_n - t_1) / (n - 1)"),
                 ((t[-1] - a) / max(n - 1, 1), "TPOT leaves the wait for the first token out: (t_n - t_1) / (n - 1)"),
                 ((t[-1] - t[0]) / max(n - 1, 1) if n > 1 else 0.0,
                  "TPOT is None until the request has finished (finish_time is None): its pace is not known yet"
                  if not done else "with one token there is no gap: TPOT is None (vLLM leaves such a request out "
                                   "of TPOT)")],
        "itl": [([b - x for x, b in zip([a] + t, t)], "ITL are the gaps *between* output tokens, n - 1 of them; "
                                                     "the wait for the first token is TTFT, not an ITL")],
    }


def _describe(m) -> str:
    times = ", ".join(f"{x:g}" for x in m.token_times)
    end = "finished" if m.finish_time is not None else "not finished (finish_time None)"
    return f"request_latencies(metrics: arrival_time={m.arrival_time:g}, token_times=[{times}], {end})"


def _compare(fn, m, what: str) -> None:
    """The reader's latencies of ``m`` against the reference; raises AssertionError naming the field and mistake."""
    expected = reference_request_latencies(m)
    try:
        got = fn(copy.deepcopy(m))
    except (IndexError, ZeroDivisionError, TypeError, ValueError) as e:
        hint = ("a request still waiting has no token yet: TTFT, TPOT and E2E are None and ITL is empty"
                if not m.token_times else "with one token there is no gap, so TPOT is None"
                if len(m.token_times) == 1 else "see the traceback")
        raise AssertionError(f"{what}: {type(e).__name__}: {e}\n  {hint}") from None
    if not isinstance(got, dict) or not set(expected) <= set(got):
        raise AssertionError(f"{what}: expected a dict with keys {sorted(expected)}, got {got!r}")
    for key in ("ttft", "e2e", "tpot", "itl"):
        want, have = expected[key], got[key]
        if _same(key, have, want):
            continue
        wrongs = _wrong_latencies(m).get(key, [])
        if want is None and key == "tpot" and wrongs:  # one token, or not finished: whatever came back, it is None
            wrongs = wrongs[-1:]
        hint = next((h for value, h in wrongs if _same(key, have, value)), None)
        if hint is None and want is None and key == "tpot":
            hint = wrongs[-1][1] if wrongs else "no token yet: None"
        if hint is None and not m.token_times:
            hint = "a request still waiting has no token yet: TTFT, TPOT and E2E are None and ITL is empty"
        raise AssertionError(f"{what}: {key}\n  expected {want!r}\n  got      {have!r}\n  "
                             f"{hint or 'see the definitions at the top of the notebook'}")


_runs: dict = {}  # the online run, replayed once a session


def online_run(model: str = "smollm2-135m", num_requests: int = 6, rate: float = 8.0) -> dict:
    """An online workload (Poisson arrivals, one one-token request) replayed through the engine (chapter 11).

    Returns the trace and, for every step, a snapshot of every unfinished request's metrics, so that
    latencies can also be compared while requests are waiting and running.
    """
    key = (model, num_requests, rate)
    if key not in _runs:
        tok = load_tokenizer(model)
        workload = make_workload("online", tok, num_requests=num_requests, prompt_len=(16, 48), output_len=(2, 8),
                                 rate=rate)
        arrivals = list(workload.arrivals)
        one = arrivals[1]
        arrivals[1] = Arrival(one.request_id, one.prompt, greedy(1), at_time=one.at_time)  # no TPOT
        engine = LLM(model, block_size=16, num_blocks=64, max_num_seqs=4).engine
        snapshots = []
        trace = replay(engine, arrivals, label="online",
                       on_step=lambda record: snapshots.append(
                           [(s.request_id, copy.deepcopy(s.metrics)) for s in engine.scheduler.sequences]))
        _runs[key] = {"trace": trace, "snapshots": snapshots}
    return _runs[key]


def _check_live_latencies(fn) -> int:
    run = online_run()
    compared = 0
    for step, snapshot in enumerate(run["snapshots"]):
        for rid, m in snapshot:
            _compare(fn, m, f"the live engine, request {rid} after step {step} ({_describe(m)})")
            compared += 1
    for rid, m in run["trace"].metrics.items():
        _compare(fn, m, f"the live engine, request {rid} at the end ({_describe(m)})")
        compared += 1
    return compared


def check_request_latencies(fn, live: bool = True) -> None:
    """Check ``fn(metrics) -> dict`` with keys ``ttft``, ``tpot``, ``itl``, ``e2e`` (chapter 11).

    ``metrics`` is a request's ``RequestMetrics`` (``RequestOutput.metrics``):
    ``arrival_time``, ``first_token_time``, ``token_times`` (when each output
    token appeared) and ``finish_time`` (None while it runs). TTFT is
    ``t_1 - arrival``, ITL the ``n - 1`` gaps, TPOT ``(t_n - t_1) / (n - 1)``,
    E2E ``t_n - arrival``; a request with no token has none of them, TPOT and
    E2E are None until it finishes, and TPOT with one token. Compared with
    :mod:`minivllm.bench.metrics` on hand-made and random requests (the first
    failure stops the check), then, unless ``live=False``, on every request
    of an online run of the engine, after every step.
    """
    cases = _latency_cases()
    for m in cases:
        _compare(fn, m, _describe(m))
    say(f"check_request_latencies: all {len(cases)} requests match minivllm.bench (vLLM's definitions).")
    if not live:
        return
    compared = _check_live_latencies(fn)
    say(f"check_request_latencies: the live engine's online run ({len(online_run()['trace'].metrics)} requests, "
          f"{compared} snapshots while waiting, running and finished) matches minivllm.bench too.")


def _goodput_requests() -> list[RequestMetrics]:
    """Requests with known TTFT and TPOT (exact binary fractions, so limits can sit exactly on them)."""
    return [
        request_metrics(0.0, [0.25, 0.5, 0.75]),  # TTFT 0.25, TPOT 0.25
        request_metrics(0.0, [0.5, 0.625, 0.75]),  # TTFT 0.5, TPOT 0.125
        request_metrics(0.0, [0.125]),  # one token: TTFT 0.125, no TPOT
        request_metrics(0.25, [], finished=False),  # still waiting: not finished, never counts
        request_metrics(0.5, [], finished=False),
        request_metrics(0.5, [0.75, 1.75]),  # TTFT 0.25, TPOT 1.0
        request_metrics(0.0, [1.0, 1.25]),  # TTFT 1.0, TPOT 0.25
        request_metrics(0.0, [0.25, 0.5], finished=False),  # still running: on time so far, but not finished
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
            reqs.append(request_metrics(a, times, finished=rng.random() < 0.85))
        cases.append((reqs, rng.uniform(5, 20), rng.choice([None, 0.3, 0.6]), rng.choice([None, 0.05, 0.1])))
    return cases


def _wrong_goodputs(requests, duration, ttft_limit, tpot_limit):
    """What plausible mistakes return, each with the hint that names it."""
    with_tokens = [r for r in requests if r.token_times]
    done = [r for r in with_tokens if r.finish_time is not None]

    def count(le, one_token_fails=False, none_is_zero=False, keep=done, waiting=0):
        tl = 0.0 if none_is_zero and ttft_limit is None else ttft_limit
        pl = 0.0 if none_is_zero and tpot_limit is None else tpot_limit
        n = 0
        for r in keep:
            t = (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) if len(r.token_times) > 1 else None
            ok = (tl is None or le(ttft(r), tl)) and (pl is None or (t is None and not one_token_fails)
                                                        or (t is not None and le(t, pl)))
            n += ok
        return n + waiting

    right = goodput(requests, duration, ttft_limit, tpot_limit)
    return [
        (right * duration, "goodput is a rate: the requests on time divided by the duration (per second)"),
        (len(done) / duration, "check every limit: a request counts only if it meets all of them"),
        (count(operator.lt) / duration, "a request exactly at the limit is on time: compare with <="),
        (count(operator.le, one_token_fails=True) / duration,
         "a one-token request has no TPOT, so it cannot miss a TPOT limit"),
        (count(operator.le, keep=with_tokens) / duration,
         "a request still running (finish_time is None) has not finished: leave it out"),
        (count(operator.le, waiting=len(requests) - len(with_tokens)) / duration,
         "a request with no tokens has not finished: leave it out"),
        (count(operator.le, none_is_zero=True) / duration, "a limit of None means no limit on that metric"),
    ]


def _check_goodput_case(fn, requests, duration, ttft_limit, tpot_limit, what: str) -> None:
    expected = goodput(requests, duration, ttft_limit, tpot_limit)
    try:
        got = fn(copy.deepcopy(list(requests)), duration, ttft_limit=ttft_limit, tpot_limit=tpot_limit)
    except (IndexError, ValueError, ZeroDivisionError, TypeError) as e:
        raise AssertionError(f"{what}: {type(e).__name__}: {e}\n  a request with no tokens has not finished: "
                             f"leave it out before computing its TTFT (and a one-token request has no TPOT)") from None
    if _close(got, expected):
        return
    hint = next((h for value, h in _wrong_goodputs(requests, duration, ttft_limit, tpot_limit)
                 if _close(got, value)), "count the finished requests that meet every limit, per second")
    raise AssertionError(f"{what}:\n  expected {expected!r} requests/s\n  got      {got!r}\n  {hint}")


def check_goodput(fn, live: bool = True) -> None:
    """Check ``fn(requests, duration, ttft_limit=None, tpot_limit=None) -> float``, vLLM's goodput (chapter 11).

    ``requests`` are requests' metrics (``RequestOutput.metrics``). Goodput is
    the finished requests (``finish_time`` set) per second of ``duration``
    whose TTFT is at most ``ttft_limit`` and whose TPOT is at most
    ``tpot_limit`` (None: no limit; a one-token request has no TPOT and passes
    it). Compared with :func:`minivllm.bench.goodput` on hand-made and random
    cases (the first failure stops the check), then, unless ``live=False``, on
    the engine's online run with limits exactly at a request's values.
    """
    cases = _goodput_cases()
    for k, (requests, duration, ttft_limit, tpot_limit) in enumerate(cases):
        what = (f"case {k}: {len(requests)} requests, duration {duration:g} s, ttft_limit={ttft_limit}, "
                f"tpot_limit={tpot_limit}")
        if k < len(_GOODPUT_LIMITS):
            what += " (requests: " + "; ".join(
                f"arrival {r.arrival_time:g}, tokens at {r.token_times}"
                + ("" if r.finish_time is not None else ", not finished") for r in requests) + ")"
        _check_goodput_case(fn, requests, duration, ttft_limit, tpot_limit, what)
    say(f"check_goodput: all {len(cases)} cases match minivllm.bench.goodput.")
    if not live:
        return
    trace = online_run()["trace"]
    requests = list(trace.metrics.values())
    ttfts = sorted(ttft(r) for r in requests)
    tpots = sorted(t for t in map(tpot, requests) if t is not None)
    for ttft_limit, tpot_limit in ((ttfts[len(ttfts) // 2], None), (None, tpots[len(tpots) // 2]),
                                   (ttfts[len(ttfts) // 2], tpots[len(tpots) // 2]), (None, None)):
        _check_goodput_case(fn, requests, trace.seconds, ttft_limit, tpot_limit,
                            f"the live engine's online run ({len(requests)} requests in {trace.seconds:.2f} s), "
                            f"ttft_limit={ttft_limit}, tpot_limit={tpot_limit} (each a request's own value)")
    say("check_goodput: the live engine's online run, limits exactly at a request's TTFT and TPOT, matches too.")
