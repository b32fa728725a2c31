"""Random workloads on the tiny model, tight pools, both preemption modes: invariants after every step,
no leaks (device or CPU pool), outputs as if each request ran alone."""

from hypothesis import HealthCheck, given, settings, strategies as st

from minivllm import LLM

from helpers import greedy

_alone_cache: dict = {}
_reference_llm = []


def run_alone(prompt, params):
    """The oracle: the same request in an engine of its own, with room to spare."""
    key = (tuple(prompt), params.max_tokens, params.ignore_eos)
    if key not in _alone_cache:
        if not _reference_llm:
            _reference_llm.append(LLM("tiny-random", block_size=16, num_blocks=64, device="cpu"))
        out = _reference_llm[0].generate([prompt], params, use_tqdm=False)
        _alone_cache[key] = out[0].outputs[0].token_ids
    return _alone_cache[key]


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    n = draw(st.integers(1, 6))
    shared = draw(st.lists(st.integers(1, 49151), min_size=0, max_size=24))  # a common prefix, maybe empty
    requests = []
    for i in range(n):
        own = draw(st.lists(st.integers(1, 49151), min_size=1, max_size=30))
        prefix = shared if draw(st.booleans()) else []
        requests.append((f"r{i}", prefix + own, greedy(draw(st.integers(1, 8)), ignore_eos=draw(st.booleans()))))
    biggest = max(-(-(len(p) + sp.max_tokens) // block_size) for _, p, sp in requests)
    return dict(
        block_size=block_size,
        num_blocks=draw(st.integers(biggest, biggest * 3)),
        max_num_seqs=draw(st.integers(1, 4)),
        max_num_batched_tokens=draw(st.integers(60, 120)),
        enable_chunked_prefill=draw(st.booleans()),
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


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads(w):
    requests = w.pop("requests")
    aborts = {step: f"r{i}" for step, i in w.pop("aborts")}
    arrivals = w.pop("arrivals")
    priorities = w.pop("priorities")
    llm = LLM("tiny-random", device="cpu", **w)
    engine = llm.engine
    finished, aborted, step = {}, set(), 0
    pending = sorted(zip(arrivals, range(len(requests))))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:  # requests join mid-flight
            _, i = pending.pop(0)
            engine.add_request(*requests[i], priority=priorities[i])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if step in aborts and aborts[step] in engine.requests:
            engine.abort_request(aborts[step])
            aborted.add(aborts[step])
        engine.check_invariants()
        step += 1
        assert step < 2000, "the engine stopped making progress"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    assert len(bm.free_cpu_blocks) == bm.num_cpu_blocks, "CPU blocks leaked"
    assert set(finished) | aborted == {rid for rid, _, _ in requests}
    for rid, prompt, params in requests:
        if rid in finished:
            assert finished[rid] == run_alone(prompt, params), rid
