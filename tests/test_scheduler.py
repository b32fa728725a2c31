"""The scheduling policy, driven with a fake model runner (no tensors)."""

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceStatus as S
from minivllm.simulator import make_scheduler


def make(num_blocks=64, block_size=4, **kw):
    return make_scheduler(num_blocks, block_size, max_model_len=100_000, eos_token_ids={0}, **kw)


def seq(rid, n, max_tokens=4, start=1, priority=0, arrival=None):
    return Sequence(rid, list(range(start, start + n)), SamplingParams(temperature=0, max_tokens=max_tokens),
                    priority=priority, arrival_time=arrival)


def step(sched, token=7):
    """schedule + fake forward (every sampling chunk gets ``token``) + update."""
    out = sched.schedule()
    sampled = [token for c in out.chunks if c.samples]
    sched.update(out, sampled)
    sched.block_manager.check_invariants(sched.sequences)
    return out


def test_chunk_schedule_prompt_7_chunk_3():
    sched = make(enable_chunked_prefill=True, max_prefill_chunk_size=3)
    s = seq("a", 7)
    sched.add(s)
    spans, states = [], []
    for _ in range(3):
        out = step(sched)
        spans += [(c.start, c.end) for c in out.chunks]
        states.append(s.status)
        assert s.metrics.num_prefilled_tokens == spans[-1][1]
    assert spans == [(0, 3), (3, 6), (6, 7)]
    assert states == [S.PREFILLING, S.PREFILLING, S.RUNNING]
    assert len(s.output_token_ids) == 1  # only the last chunk sampled


def test_one_chunk_covering_the_prompt_goes_straight_to_running():
    sched = make(enable_chunked_prefill=True, max_prefill_chunk_size=8)
    s = seq("a", 8)
    sched.add(s)
    step(sched)
    assert s.status == S.RUNNING and len(s.output_token_ids) == 1


def test_long_prompt_with_cached_prefix_runs_in_four_chunks():
    """12,000-token prompt, 8,000 tokens cached, chunk size 1,000: four chunks."""
    sched = make(num_blocks=2000, block_size=16, enable_chunked_prefill=True, max_prefill_chunk_size=1000,
                 enable_prefix_caching=True, max_num_batched_tokens=4096)
    first = seq("first", 8001, max_tokens=1)
    sched.add(first)
    while sched.has_unfinished():
        step(sched)
    long = Sequence("long", first.prompt_token_ids[:8000] + list(range(50_000, 54_000)),
                    SamplingParams(temperature=0, max_tokens=1))
    sched.add(long)
    spans = []
    while sched.has_unfinished():
        spans += [(c.start, c.end) for c in step(sched).chunks]
    assert long.num_cached_tokens == 8000
    assert spans == [(8000, 9000), (9000, 10000), (10000, 11000), (11000, 12000)]


def test_decodes_first_then_prefilling_then_waiting_within_the_budget():
    sched = make(enable_chunked_prefill=True, max_prefill_chunk_size=6, max_num_batched_tokens=8, max_num_seqs=4)
    a, b = seq("a", 2, max_tokens=10), seq("b", 20, max_tokens=10, start=100)
    sched.add(a)
    step(sched)  # a prefilled whole, now decoding
    sched.add(b)
    out = step(sched)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 6)]
    c = seq("c", 5, start=300)
    sched.add(c)
    out = step(sched)  # a decodes, b continues (6), c gets the 1 token left
    assert [(x.seq.request_id, x.num_tokens) for x in out.chunks] == [("a", 1), ("b", 6), ("c", 1)]
    assert out.num_batched_tokens <= 8


def test_without_chunking_a_prompt_runs_whole_or_waits():
    sched = make(max_num_batched_tokens=16, max_num_seqs=4)
    a, b = seq("a", 10), seq("b", 10, start=50)
    sched.add(a), sched.add(b)
    out = step(sched)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 10)]  # b does not fit beside it
    out = step(sched)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 10)]


def test_sequence_budget_limits_admission():
    sched = make(max_num_seqs=2)
    for i in range(4):
        sched.add(seq(f"r{i}", 3, start=10 * i + 1))
    out = step(sched)
    assert len(out.chunks) == 2 and len(sched.waiting) == 2


def test_preemption_picks_lowest_priority_latest_arrival_and_recomputes():
    sched = make(num_blocks=6, block_size=2, max_num_seqs=3)
    old = seq("old", 4, max_tokens=8, arrival=1.0)
    new = seq("new", 4, max_tokens=8, start=20, arrival=2.0)
    vip = seq("vip", 3, max_tokens=8, start=40, priority=-1, arrival=3.0)
    for s in (old, new, vip):
        sched.add(s)
    step(sched)  # 2 + 2 + 2 blocks: the pool is full
    out = step(sched)  # old and new need a third block each
    assert [s.request_id for s in out.preempted] == ["new"]
    assert new.status == S.WAITING and new.block_table == [] and new.cached_token_count == 0
    assert new.metrics.num_preemptions == 1 and new.metrics.num_recomputed_tokens == 4
    assert sched.waiting.peek() is new
    while sched.has_unfinished():
        step(sched)
    assert all(len(s.output_token_ids) == 8 for s in (old, new, vip))
    assert sched.block_manager.num_free_blocks == 6


def test_abort_from_every_state_frees_blocks():
    sched = make(enable_chunked_prefill=True, max_prefill_chunk_size=4, max_num_seqs=2)
    run, pre, wait = seq("run", 3, max_tokens=50), seq("pre", 30, start=100), seq("wait", 5, start=200)
    for s in (run, pre, wait):
        sched.add(s)
    step(sched)
    step(sched)
    assert (run.status, pre.status, wait.status) == (S.RUNNING, S.PREFILLING, S.WAITING)
    for s in (run, pre, wait):
        sched.abort(s)
        assert s.status == S.FINISHED_ABORTED and s.block_table == []
        sched.block_manager.check_invariants(sched.sequences)
    assert sched.block_manager.num_free_blocks == 64 and not sched.has_unfinished()


def test_stop_conditions():
    sched = make()
    eos = seq("eos", 3, max_tokens=10)
    stop = Sequence("stop", [1, 2], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[7]))
    ign = Sequence("ign", [1, 2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for s in (eos, stop, ign):
        sched.add(s)
    out = sched.schedule()
    sched.update(out, [0, 7, 0])
    assert eos.status == S.FINISHED_STOPPED and stop.status == S.FINISHED_STOPPED
    assert ign.status == S.RUNNING
    step(sched, token=0), step(sched, token=0)
    assert ign.status == S.FINISHED_LENGTH and ign.output_token_ids == [0, 0, 0]
