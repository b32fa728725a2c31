"""Preemption (recompute, swap), admission, priority aging and the anti-thrashing guard (chapter 10)."""

import pytest

from minivllm import LLM
from minivllm.preemption import preemption_accounting

from helpers import greedy, run_engine
from test_scheduler import make, seq, step


def test_reference_accounting():
    cost = preemption_accounting(cached_tokens=7, block_size=4, kv_bytes_per_token=512 * 1024, cpu_bandwidth_gbps=24)
    assert cost.released_blocks == 2 and cost.recompute_tokens == 7
    assert cost.swap_roundtrip_ms == pytest.approx(0.306, abs=5e-4)
    assert cost["released_blocks"] == 2  # readable as a mapping too
    with pytest.raises(ValueError):
        preemption_accounting(7, 0, 1, 24)


def _workload(n=8):
    return [(f"r{i}", [(37 * i + j) % 49000 + 1 for j in range(20 + 3 * i)], greedy(30, ignore_eos=True))
            for i in range(n)]


@pytest.fixture(scope="module")
def roomy_outputs():
    llm = LLM("tiny-random", block_size=4, num_blocks=400, max_num_seqs=8, device="cpu")
    return run_engine(llm, _workload())


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("prefix", [False, True])
def test_quarter_pool_finishes_everything_with_the_same_output(mode, chunked, prefix, roomy_outputs):
    demand = sum(-(-(len(p) + sp.max_tokens) // 4) for _, p, sp in _workload())
    llm = LLM("tiny-random", block_size=4, num_blocks=demand // 4, max_num_seqs=8, preemption_mode=mode,
              enable_chunked_prefill=chunked, max_prefill_chunk_size=8, enable_prefix_caching=prefix, device="cpu")
    assert llm.engine.num_blocks >= max(-(-(len(p) + sp.max_tokens) // 4) for _, p, sp in _workload())
    assert run_engine(llm, _workload()) == roomy_outputs  # run_engine also checks invariants and leaks
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_bytes > 0 and stats.num_free_cpu_blocks == stats.num_total_cpu_blocks
    else:
        assert stats.num_recomputed_tokens > 0 and stats.num_swapped_bytes == 0


def test_full_cpu_pool_falls_back_to_recompute(roomy_outputs):
    llm = LLM("tiny-random", block_size=4, num_blocks=40, num_cpu_blocks=12, max_num_seqs=8,
              preemption_mode="swap", device="cpu")
    assert run_engine(llm, _workload()) == roomy_outputs
    stats = llm.engine.stats()
    assert stats.num_swapped_bytes > 0 and stats.num_recomputed_tokens > 0


def test_abort_a_swapped_request_frees_its_cpu_blocks():
    sched = make(num_blocks=6, block_size=2, max_num_seqs=3, preemption_mode="swap", num_cpu_blocks=8)
    a, b = seq("a", 4, max_tokens=8, arrival=1.0), seq("b", 4, max_tokens=8, start=20, arrival=2.0)
    sched.add(a), sched.add(b)
    for _ in range(10):
        step(sched)
        if b.status.name == "SWAPPED":
            break
    assert b.cpu_block_table and len(sched.block_manager.free_cpu_blocks) < 8
    sched.abort(b)
    assert b.cpu_block_table == [] and len(sched.block_manager.free_cpu_blocks) == 8
    sched.block_manager.check_invariants(sched.sequences)


def test_admission_watermark_holds_back_new_requests_only():
    sched = make(num_blocks=10, block_size=2, max_num_seqs=4, admission_watermark=0.5)
    a, b = seq("a", 6, max_tokens=3), seq("b", 6, max_tokens=3, start=30)
    sched.add(a), sched.add(b)
    out = step(sched)  # a takes 3 blocks (7 free >= 5); b would leave 4 < 5 free: it waits
    assert [c.seq.request_id for c in out.chunks] == ["a"] and b.status.name == "WAITING"
    while a.status.name != "FINISHED_LENGTH":
        step(sched)
    step(sched)
    assert b.status.name != "WAITING"


def test_an_idle_engine_admits_a_request_bigger_than_the_pool_minus_the_watermark():
    """10 of 10 blocks with half held back: nothing runs, so there is no headroom to keep and it must start."""
    sched = make(num_blocks=10, block_size=2, max_num_seqs=4, admission_watermark=0.5)
    big = seq("big", 18, max_tokens=2)  # 18 + 2 tokens = all 10 blocks
    sched.add(big)
    for _ in range(5):
        step(sched)
        sched.block_manager.check_invariants(sched.sequences)
    assert big.status.name == "FINISHED_LENGTH"


def _starvation(aging_rate, steps=300):
    """A low-priority request against a high-priority arrival every step; returns when it finished."""
    sched = make(num_blocks=64, block_size=4, max_num_seqs=1, scheduling_policy="priority",
                 priority_aging_rate=aging_rate)
    low = seq("low", 3, max_tokens=2, priority=10, arrival=0.0)
    sched.add(low)
    for t in range(steps):
        sched.add(seq(f"hi{t}", 3, max_tokens=2, start=10 + t, priority=0, arrival=t + 0.5))
        step(sched)
        if low.is_finished:
            return t
    return None


def test_aging_ends_starvation():
    assert _starvation(aging_rate=0.0) is None  # starves while high-priority work keeps arriving
    finished = _starvation(aging_rate=0.5)
    # after 10 / 0.5 = 20 steps it outranks every newcomer; it waits only for the ~20 that came before
    assert finished is not None and finished <= 2 * (10 / 0.5) + 10


def _thrash(protection):
    sched = make(num_blocks=26, block_size=2, max_num_seqs=4, preemption_protection_steps=protection)
    seqs = [seq(f"r{i}", p, max_tokens=m, start=100 * i + 1, arrival=float(i))
            for i, (p, m) in enumerate([(3, 29), (3, 12), (12, 28), (1, 20)])]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished():
        step(sched, token=5)
    return [s.metrics.num_preemptions for s in seqs], sum(s.metrics.num_recomputed_tokens for s in seqs)


def test_protection_after_resume_stops_thrashing():
    unguarded, recomputed_unguarded = _thrash(protection=0)
    guarded, recomputed_guarded = _thrash(protection=4)
    assert max(unguarded) >= 3  # without the guard one request is evicted again and again
    assert max(guarded) <= 1 and recomputed_guarded < recomputed_unguarded
