"""Serving metrics on hand-computed synthetic timestamps (minivllm.bench.metrics, chapter 11)."""

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minivllm.bench.metrics import (RequestTimes, Summary, e2e, goodput, itl, percentile, serving_metrics,
                                    summarize, tpot, ttft)
from minivllm.sequence import RequestMetrics

A = RequestTimes(0.0, [0.5, 0.6, 0.8, 1.1], num_prompt_tokens=10)  # TTFT 0.5, E2E 1.1, TPOT 0.2
B = RequestTimes(0.2, [0.4, 1.4], num_prompt_tokens=20)  # TTFT 0.2, E2E 1.2, ITL [1.0], TPOT 1.0
C = RequestTimes(1.0, [1.5], num_prompt_tokens=5)  # TTFT 0.5, E2E 0.5, one token: no ITL, no TPOT


def test_single_request_ttft_e2e_itl_tpot_by_hand():
    assert ttft(A) == pytest.approx(0.5)
    assert e2e(A) == pytest.approx(1.1)
    assert itl(A) == pytest.approx([0.1, 0.2, 0.3])
    assert tpot(A) == pytest.approx(0.2)


def test_one_token_request_has_no_itl_and_no_tpot():
    assert itl(C) == [] and tpot(C) is None
    assert ttft(C) == e2e(C) == pytest.approx(0.5)


def test_request_without_tokens_raises_value_error():
    empty = RequestTimes(0.0, [])
    with pytest.raises(ValueError, match="no output tokens"):
        ttft(empty)
    with pytest.raises(ValueError, match="no output tokens"):
        e2e(empty)
    assert tpot(empty) is None and itl(empty) == []


def test_tpot_on_request_metrics_matches_synthetic_definition():
    times = [0.5, 0.6, 0.8, 1.1]
    m = RequestMetrics(arrival_time=0.0, first_token_time=times[0], finish_time=times[-1], token_times=list(times),
                       num_prompt_tokens=10, num_output_tokens=len(times))
    assert tpot(m) == pytest.approx(tpot(RequestTimes(0.0, times)))
    assert tpot(m) == pytest.approx((m.e2e - m.ttft) / (m.num_output_tokens - 1))
    assert ttft(m) == pytest.approx(m.ttft) and e2e(m) == pytest.approx(m.e2e)


def test_tpot_is_none_for_unfinished_request_metrics():
    m = RequestMetrics(arrival_time=0.0, first_token_time=0.5, token_times=[0.5, 0.6], num_output_tokens=2)
    assert tpot(m) is None


def test_percentiles_of_1_to_100_by_hand():
    v = list(range(1, 101))
    assert percentile(v, 50) == pytest.approx(50.5)
    assert percentile(v, 90) == pytest.approx(90.1)
    assert percentile(v, 99) == pytest.approx(99.01)


def test_percentiles_of_two_values_interpolate_linearly():
    assert percentile([1.0, 3.0], 50) == pytest.approx(2.0)
    assert percentile([1.0, 3.0], 90) == pytest.approx(2.8)
    assert percentile([1.0, 3.0], 99) == pytest.approx(2.98)


def test_summarize_agrees_with_numpy():
    v = np.random.default_rng(0).exponential(size=37)
    s = summarize(v)
    assert s.count == 37 and s.mean == pytest.approx(v.mean()) and s.max == v.max()
    assert [s.p50, s.p90, s.p99] == pytest.approx(list(np.percentile(v, [50, 90, 99])))
    assert percentile(v, 75) == pytest.approx(np.percentile(v, 75))


def test_summarize_empty_gives_nan_and_count_zero():
    s = summarize([])
    assert s.count == 0
    assert all(math.isnan(x) for x in (s.mean, s.p50, s.p90, s.p99, s.max))


def test_summary_scaled_converts_units_and_keeps_count():
    assert Summary(0.1, 0.2, 0.3, 0.4, 0.5, 7).scaled(1e3) == Summary(
        pytest.approx(100), pytest.approx(200), pytest.approx(300), pytest.approx(400), pytest.approx(500), 7)


def test_goodput_without_limits_counts_every_request():
    assert goodput([A, B, C], 2.0) == pytest.approx(1.5)


def test_goodput_with_ttft_limit_only():
    assert goodput([A, B, C], 2.0, ttft_limit=0.3) == pytest.approx(0.5)  # only B starts within 0.3 s


def test_goodput_with_tpot_limit_only_passes_one_token_request():
    assert goodput([A, B, C], 2.0, tpot_limit=0.5) == pytest.approx(1.0)  # A and C (no TPOT); B's is 1.0
    assert goodput([C], 1.0, tpot_limit=1e-9) == pytest.approx(1.0)


def test_goodput_with_ttft_and_tpot_limits_needs_both():
    assert goodput([A, B, C], 2.0, ttft_limit=0.3, tpot_limit=0.5) == 0.0  # B fails TPOT, A and C fail TTFT
    assert goodput([A, B, C], 2.0, ttft_limit=0.5, tpot_limit=0.5) == pytest.approx(1.0)


def test_goodput_with_e2e_limit():
    assert goodput([A, B, C], 2.0, e2e_limit=1.15) == pytest.approx(1.0)  # A (1.1) and C (0.5)


def test_goodput_rejects_non_positive_duration():
    for d in (0.0, -1.0):
        with pytest.raises(ValueError, match="duration"):
            goodput([A], d)
        with pytest.raises(ValueError, match="duration"):
            serving_metrics([A], d)


def test_serving_metrics_throughputs_of_three_requests_by_hand():
    m = serving_metrics([A, B, C], 2.0)
    assert (m.completed, m.total_input_tokens, m.total_output_tokens) == (3, 35, 7)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(21.0)
    assert m.ttft.mean == pytest.approx(0.4) and m.e2e.mean == pytest.approx(2.8 / 3)
    assert (m.ttft.count, m.tpot.count, m.itl.count, m.e2e.count) == (3, 2, 4, 3)
    assert m.goodput is None


def test_serving_metrics_skips_unfinished_and_counts_zero_input_without_attribute():
    running = RequestMetrics(arrival_time=0.0, first_token_time=0.1, token_times=[0.1], num_prompt_tokens=99)
    m = serving_metrics([RequestTimes(0.0, [0.1, 0.2]), RequestTimes(0.0, []), running], 1.0)
    assert (m.completed, m.total_input_tokens, m.total_output_tokens) == (1, 0, 2)


def test_itl_pools_gaps_while_tpot_averages_per_request():
    m = serving_metrics([A, B], 2.0)
    assert m.itl.mean == pytest.approx((0.1 + 0.2 + 0.3 + 1.0) / 4)  # 0.4: every gap weighs the same
    assert m.tpot.mean == pytest.approx((0.2 + 1.0) / 2)  # 0.6: every request weighs the same
    assert m.itl.mean != pytest.approx(m.tpot.mean)


def test_serving_metrics_goodput_under_slo():
    m = serving_metrics([A, B, C], 2.0, slo={"ttft": 0.5, "tpot": 0.5})
    assert m.goodput == pytest.approx(goodput([A, B, C], 2.0, ttft_limit=0.5, tpot_limit=0.5)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="slo"):
        serving_metrics([A], 1.0, slo={"latency": 1.0})


def test_table_in_milliseconds_and_as_dict_is_json():
    m = serving_metrics([A, B, C], 2.0, slo={"ttft": 0.3})
    lines = dict(line.rsplit(None, 1) for line in str(m).splitlines() if not line.startswith("-"))
    assert float(lines["Mean TTFT (ms):"]) == pytest.approx(400.0)
    assert float(lines["P99 TPOT (ms):"]) == pytest.approx(992.0)
    assert float(lines["Request goodput (req/s):"]) == pytest.approx(0.5)
    d = json.loads(json.dumps(m.as_dict(), allow_nan=False))
    assert d["mean_ttft_ms"] == pytest.approx(400.0) and d["completed"] == 3 and d["goodput"] == pytest.approx(0.5)
    assert json.dumps(serving_metrics([], 1.0).as_dict(), allow_nan=False)  # no NaN when nothing finished


times = st.lists(st.floats(0.0, 1e3, allow_nan=False), min_size=2, max_size=50).map(sorted)


@given(arrival=st.floats(-10.0, 0.0), token_times=times)
def test_itl_sums_to_decode_time_and_tpot_lies_between_min_and_max_gap(arrival, token_times):
    r = RequestTimes(arrival, token_times)
    gaps, t = itl(r), tpot(r)
    eps = 1e-9 * (1 + token_times[-1])
    assert sum(gaps) == pytest.approx(e2e(r) - ttft(r), abs=len(gaps) * eps)
    assert min(gaps) - eps <= t <= max(gaps) + eps


def test_the_online_client_times_token_chunks_only():
    """A stream's chunks: a token with empty text (a skipped special token) counts; a last chunk that holds only
    the finish reason (as transformers serve sends it) does not."""
    import asyncio

    import httpx

    from minivllm.bench.online import _stream_one

    chunks = [{"choices": [{"index": 0, "text": ""}]}, {"choices": [{"index": 0, "text": "Hi"}]},
              {"choices": [{"index": 0, "text": " there", "finish_reason": None}]},
              {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}]},
              {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    async def main():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await _stream_one(client, "http://test", {}, 0.0)

    times, text, error = asyncio.run(main())
    assert error is None and text == "Hi there!"
    assert len(times.token_times) == 4 and times.num_output_tokens == 4 and times.num_prompt_tokens == 5
