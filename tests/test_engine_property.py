"""Random workloads on the tiny model (chapters 06-10): invariants after every step, no leaks (device or CPU
pool), outputs as if each request ran alone, every request finished within a bound of steps (liveness); random
interleavings of streams, generate calls and direct requests; random bad sampling parameters.

CI replays 120 derandomized examples of each (20 of the bad values', whose grid below tries every pair);
``--hypothesis-profile=long`` runs 2,000 (see conftest.py).
"""

import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from minivllm import LLM, SamplingParams

from helpers import greedy

_alone_cache: dict = {}
_reference_llm = []
_target_llm = []

PROPERTY = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference_llm() -> LLM:
    if not _reference_llm:
        _reference_llm.append(LLM("tiny-random", block_size=16, num_blocks=64, device="cpu"))
    return _reference_llm[0]


def run_alone(prompt, params):
    """The oracle: the same request (one sample) in an engine of its own, with room to spare."""
    key = (tuple(prompt), params.max_tokens, params.ignore_eos)
    if key not in _alone_cache:
        one = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
        _alone_cache[key] = reference_llm().generate([prompt], one, use_tqdm=False)[0].outputs[0].token_ids
    return _alone_cache[key]


def step_bound(requests, arrivals) -> int:
    """Liveness: the scheduler's head computes a token every step and is only displaced by a better-ranked
    admission, so each of the S sequences (every sample of every request) is recomputed at most S times; a
    generous envelope of that. Samples count: beyond ``max_num_seqs`` a fork waits, and recomputes its prompt."""
    total = sum(len(prompt) + params.n * params.max_tokens for _, prompt, params in requests)
    sequences = sum(params.n for _, _, params in requests)
    return max(arrivals) + sequences * total + sequences


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    n = draw(st.integers(1, 6))
    shared = draw(st.lists(st.integers(1, 49151), min_size=0, max_size=24))  # a common prefix, maybe empty
    requests = []
    for i in range(n):
        own = draw(st.lists(st.integers(1, 49151), min_size=1, max_size=30))
        prefix = shared if draw(st.booleans()) else []
        params = SamplingParams(n=draw(st.sampled_from([1, 1, 1, 2, 3])), temperature=0.0,
                                max_tokens=draw(st.integers(1, 8)), ignore_eos=draw(st.booleans()))
        requests.append((f"r{i}", prefix + own, params))
    biggest = max(-(-(len(p) + sp.max_tokens) // block_size) for _, p, sp in requests)
    max_num_seqs = draw(st.integers(1, 4))
    chunked = draw(st.booleans())
    # Without chunked prefill a prompt must fit the budget, but a preempted one recomputes prompt + output.
    smallest_budget = max_num_seqs if chunked else max(max_num_seqs, max(len(p) for _, p, _ in requests))
    return dict(
        block_size=block_size,
        num_blocks=draw(st.integers(biggest, biggest * 3)),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(smallest_budget, max(smallest_budget, 120))),
        enable_chunked_prefill=chunked,
        max_prefill_chunk_size=draw(st.integers(1, 40)),
        enable_prefix_caching=draw(st.booleans()),
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        num_cpu_blocks=draw(st.integers(0, 2 * biggest)),
        preemption_protection_steps=draw(st.integers(0, 4)),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        priority_aging_rate=draw(st.sampled_from([0.0, 0.5])),
        requests=requests,
        priorities=[draw(st.integers(0, 3)) for _ in range(n)],
        aborts=draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, n - 1)), max_size=2)),
        arrivals=[draw(st.integers(0, 6)) for _ in range(n)],
    )


@PROPERTY
@given(workloads())
def test_random_workloads(w):
    check_workload(w)


def check_workload(w):
    """Run workload ``w`` step by step: invariants each step, the liveness bound, no leak, outputs as if alone."""
    requests = w.pop("requests")
    aborts = {step: f"r{i}" for step, i in w.pop("aborts")}
    arrivals = w.pop("arrivals")
    priorities = w.pop("priorities")
    llm = LLM("tiny-random", device="cpu", **w)
    engine = llm.engine
    finished, aborted, step = {}, set(), 0
    bound = step_bound(requests, arrivals)
    pending = sorted(zip(arrivals, range(len(requests))))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:  # requests join mid-flight
            _, i = pending.pop(0)
            engine.add_request(*requests[i], priority=priorities[i])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [c.token_ids for c in out.outputs]
        if step in aborts and aborts[step] in engine.requests:
            engine.abort_request(aborts[step])
            aborted.add(aborts[step])
        engine.check_invariants()
        step += 1
        assert step <= bound, f"no progress: {step} steps, bound {bound}, {engine.stats()}"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    assert len(bm.free_cpu_blocks) == bm.num_cpu_blocks, "CPU blocks leaked"
    assert set(finished) | aborted == {rid for rid, _, _ in requests}
    for rid, prompt, params in requests:
        if rid in finished:
            assert finished[rid] == [run_alone(prompt, params)] * params.n, rid


@st.composite
def interleavings(draw):
    """Several requests, each consumed as a stream, by a generate call, or by direct engine steps; the order in
    which the streams are advanced and when the generate calls happen."""
    kinds = draw(st.lists(st.sampled_from(["stream", "generate", "direct"]), min_size=2, max_size=5))
    prompts = [draw(st.lists(st.integers(1, 49151), min_size=1, max_size=12)) for _ in kinds]
    lengths = [draw(st.integers(1, 10)) for _ in kinds]
    order = draw(st.lists(st.integers(0, len(kinds) - 1), min_size=len(kinds), max_size=40))
    return kinds, prompts, lengths, order


@PROPERTY
@given(interleavings())
def test_streams_generate_calls_and_direct_requests_each_keep_their_own_outputs(case):
    kinds, prompts, lengths, order = case
    llm = LLM("tiny-random", block_size=4, num_blocks=64, max_num_seqs=3, device="cpu")
    engine, tok = llm.engine, llm.get_tokenizer()
    params = [greedy(n, ignore_eos=True) for n in lengths]
    streams, texts, direct, done = {}, {}, {}, {}
    for i, kind in enumerate(kinds):
        if kind == "stream":
            streams[i], texts[i] = llm.stream(prompts[i], params[i]), ""
        elif kind == "direct":
            engine.add_request(f"d{i}", prompts[i], params[i])
            direct[f"d{i}"] = []
    for i in order + [i for i in range(len(kinds)) for _ in range(12)]:  # then drain everything
        if kinds[i] == "stream" and i in streams:
            try:
                texts[i] += next(streams[i])
            except StopIteration:
                del streams[i]
        elif kinds[i] == "generate" and i not in done:
            done[i] = llm.generate([prompts[i]], params[i], use_tqdm=False)[0].outputs[0].token_ids
        elif kinds[i] == "direct":
            for out in engine.step():
                direct[out.request_id] += out.outputs[0].delta_token_ids
    while engine.has_unfinished_requests():
        for out in engine.step():
            direct[out.request_id] += out.outputs[0].delta_token_ids
    for i, kind in enumerate(kinds):
        expected = run_alone(prompts[i], params[i])
        got = {"stream": lambda: texts[i], "generate": lambda: done[i], "direct": lambda: direct[f"d{i}"]}[kind]()
        want = tok.decode(expected, skip_special_tokens=True) if kind == "stream" else expected
        assert got == want, (kind, i)
    assert engine.block_manager.num_free_blocks == 64


BAD_VALUES = [5e-324, -5e-324, 1e308, -1e308, math.nan, math.inf, -math.inf, 2**64, -(2**64), 2**63, 10**400, True,
              "1", None, [1], {"a": 1}, 0.5, -1, 0]
FIELDS = ["n", "temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids",
          "include_stop_str_in_output", "ignore_eos", "logprobs"]


# 20 examples: every field and value is tried by test_every_bad_value_in_every_field below (209 cases); this one
# adds random prompts to a sample of them
@settings(PROPERTY, max_examples=20)
@given(st.sampled_from(FIELDS), st.sampled_from(BAD_VALUES), st.lists(st.integers(1, 49151), min_size=1, max_size=8))
def test_bad_sampling_params_never_poison_the_engine(field, value, prompt):
    """A value is refused with a ValueError naming the field, or runs; either way the next request is exact."""
    check_bad_value(field, value, prompt)


@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
@pytest.mark.parametrize("field", FIELDS)
def test_every_bad_value_in_every_field(field, value):
    """The same, for every field and value of the lists above (the property samples them with random prompts)."""
    check_bad_value(field, value, [5, 6, 7])


def check_bad_value(field, value, prompt):
    if not _target_llm:
        _target_llm.append(LLM("tiny-random", block_size=4, num_blocks=64, device="cpu"))
    llm = _target_llm[0]
    try:
        params = SamplingParams(**{field: value, "max_tokens": 4} if field != "max_tokens" else {field: value})
        llm.generate([prompt], params, use_tqdm=False)
    except ValueError as e:
        assert field in str(e)
    good = greedy(5, ignore_eos=True)
    assert llm.generate([prompt], good, use_tqdm=False)[0].outputs[0].token_ids == run_alone(prompt, good)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_forked_samples_beyond_max_num_seqs_finish_within_the_bound():
    """Found by hypothesis: n=3 samples with one sequence at a time; each waiting fork recomputes its prompt."""
    requests = [("r0", [1, 1, 1], SamplingParams(n=3, temperature=0.0, max_tokens=2))]
    llm = LLM("tiny-random", device="cpu", block_size=1, num_blocks=5, max_num_seqs=1, max_num_batched_tokens=1,
              enable_chunked_prefill=True, max_prefill_chunk_size=1, preemption_protection_steps=0)
    llm.engine.add_request(*requests[0])
    steps = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        steps += 1
        assert steps <= step_bound(requests, [0])
    assert steps == 12  # 3 prefill, 1 decode; each other sample waits, then recomputes prompt + token in 4 steps
