"""Speculative decoding with the n-gram drafter (chapter 17): the drafter, the acceptance rule, the rollback on the
block table, greedy outputs token-identical to plain decoding (alone and with chunked prefill, prefix caching,
both preemption modes, n > 1), stops inside an accepted run, streams, the config's refusals."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig, cdiv
from minivllm.exercises.live import chat_prompts
from minivllm.sequence import Sequence
from minivllm.simulator import make_scheduler
from minivllm.spec_decode import MAX_BACKOFF_STEPS, accept_greedy, backoff_steps, propose_ngram

from helpers import greedy, run_engine

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
MAX_NEW = 8
TYPO = ("Fix the typo in this sentence and write it out again: The quick brown fox jumsp over the lazy dog while the "
        "old cat sleeps in the warm sun.")  # the answer copies the prompt: prompt lookup drafts it


# -- the drafter and the acceptance rule --------------------------------------------------------------------------
def test_propose_ngram_takes_the_latest_longest_match():
    assert propose_ngram([1, 2, 3, 4, 2, 3], 4, 2, 3) == [4, 2, 3]  # [4,2,3] never occurred; [2,3] did
    assert propose_ngram([1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 2) == [7, 1]  # the latest occurrence of [1,2] wins
    assert propose_ngram([5, 1, 2, 3, 6, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [6, 2]  # n=3 ([1,2,3]) before n=2 ([2,3])
    assert propose_ngram([1, 2, 3, 4, 5], 3, 1, 2) == []  # no match, no draft
    assert propose_ngram([1, 2, 1, 2], 10, 2, 2) == [1, 2]  # fewer than k tokens follow
    assert propose_ngram([3, 3], 4, 2, 4) == []  # the suffix itself is no earlier occurrence
    assert propose_ngram([3, 3, 3], 4, 2, 4) == [3]


def test_accept_greedy_stops_at_the_first_mismatch_and_adds_the_bonus_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, and the bonus
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # not past the first mismatch, though 7 matches
    assert accept_greedy([5, 6, 7], [4, 6, 7, 8]) == [4]  # always at least one token
    assert accept_greedy([], [4]) == [4]


# -- the config -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 33}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "speculative_config"),
    ("ngram", "speculative_config"),
])
def test_bad_speculative_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.") + " must be"):
        EngineConfig(model="tiny-random", speculative_config=value)


def test_speculative_config_defaults_and_refusals():
    cfg = EngineConfig(model="tiny-random", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                "prompt_lookup_max": 4}).speculative_config
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 4, 4)  # as vLLM
    both = EngineConfig(model="tiny-random", speculative_config={"num_speculative_tokens": 3}).speculative_config
    assert (both.method, both.prompt_lookup_min, both.prompt_lookup_max) == ("ngram", 5, 5)
    with pytest.raises(ValueError, match="speculative_config must be None with tensor_parallel_size"):
        EngineConfig(model="tiny-random", tensor_parallel_size=2, device="cpu", speculative_config=SPEC)
    with pytest.raises(ValueError, match="speculative_config must be None with disaggregated"):
        EngineConfig(model="tiny-random", disaggregated=True, speculative_config=SPEC)
    assert EngineConfig(model="tiny-random").speculative_config is None


# -- the rollback on the block table --------------------------------------------------------------------------------
def test_rollback_frees_rejected_blocks_and_caches_only_accepted_tokens():
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 2}
    sched = make_scheduler(8, block_size=4, enable_prefix_caching=True, speculative_config=spec)
    bm = sched.block_manager
    seq = Sequence("r", [1, 2, 3, 4, 5, 1, 2, 3], greedy(10, ignore_eos=True))
    sched.add(seq)
    sched.update(sched.schedule(), [4])  # the prompt, then token 4: [..., 2, 3, 4]; [3, 4] occurred at 2
    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.spec_token_ids == [5, 1, 2, 3] and (chunk.start, chunk.num_tokens) == (8, 5)
    assert len(seq.block_table) == 4  # positions 8..12: a fourth block for the last draft
    fourth = seq.block_table[3]
    sched.update(out, [9], num_accepted=[1])  # draft 5 accepted, 1 rejected: the model's own token is 9
    assert seq.output_token_ids == [4, 5, 9] and seq.new_token_count == 2
    assert seq.cached_token_count == 10  # the last token and the accepted draft; 9 has no KV yet
    assert len(seq.block_table) == cdiv(10, 4) and fourth in bm.free_blocks  # rollback: the draft-only block
    bm.check_invariants(sched.sequences)
    out = sched.schedule()  # the next row rewrites the rejected slots (positions 10, 11) before block 2 fills
    assert out.chunks[0].start == 10
    sched.update(out, [7], num_accepted=[0])
    sched.update(sched.schedule(), [1])  # position 11 rewritten too: block 2 is full of accepted tokens now
    assert seq.cached_token_count == 12 and bm.blocks[seq.block_table[2]].tokens == (4, 5, 9, 7)
    for i, block in enumerate(seq.block_table):  # a cached block holds only computed (accepted) tokens
        record = bm.blocks[block]
        if record.hash is not None:
            assert (i + 1) * 4 <= seq.cached_token_count and record.tokens == tuple(seq.token_ids[4 * i:4 * i + 4])
    assert sum(bm.blocks[b].hash is not None for b in seq.block_table) == seq.cached_token_count // 4
    assert (sched.spec_stats.num_drafts, sched.spec_stats.num_accepted_tokens) == (1, 1)
    bm.check_invariants(sched.sequences)
    sched.abort(seq)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_sequence_whose_drafts_keep_failing_steps_aside_and_returns_on_an_accepted_draft():
    sched = make_scheduler(64, block_size=4, speculative_config=SPEC)
    seq = Sequence("r", [1, 2, 3] * 3, greedy(200, ignore_eos=True))  # 1, 2, 3, ...: a match at every step
    sched.add(seq)
    sched.update(sched.schedule(), [1])
    drafted = []
    for _ in range(40):  # the model rejects every draft (its own token goes on with the cycle)
        out = sched.schedule()
        drafted.append(bool(out.chunks[0].spec_token_ids))
        sched.update(out, [1 + seq.num_tokens % 3], num_accepted=[0])
    # after 1, 2, 3, 4, ... misses in a row it waits 1, 2, 4, 8 steps, then never more than MAX_BACKOFF_STEPS
    assert [i for i, d in enumerate(drafted) if d] == [0, 2, 5, 10, 19, 28, 37]
    assert MAX_BACKOFF_STEPS == 8 and [backoff_steps(m) for m in range(6)] == [0, 1, 2, 4, 8, 8]
    while not (out := sched.schedule()).chunks[0].spec_token_ids:
        sched.update(out, [1 + seq.num_tokens % 3], num_accepted=[0])
    drafts = out.chunks[0].spec_token_ids
    sched.update(out, [1 + (seq.num_tokens + len(drafts)) % 3], num_accepted=[len(drafts)])  # all accepted
    assert seq.draft_misses == 0
    assert sched.schedule().chunks[0].spec_token_ids  # drafted again at once
    sched.block_manager.check_invariants(sched.sequences)


@pytest.mark.parametrize("num_blocks, drafted", [(4, False), (5, True)])
def test_drafts_are_dropped_not_waited_for_when_the_pool_is_short(num_blocks, drafted):
    sched = make_scheduler(num_blocks, block_size=4, speculative_config=SPEC)
    seq = Sequence("r", [1, 2, 3, 4, 5, 6, 1, 2, 3], greedy(8, ignore_eos=True))  # 3 blocks, the last one 1/4 full
    other = Sequence("s", [20, 21, 22], greedy(2, ignore_eos=True))  # 1 block
    sched.add(seq)
    sched.add(other)
    sched.update(sched.schedule(), [4, 30])  # every block of 4 is taken; both decodes fit their last block
    out = sched.schedule()
    row = out.chunks[0]
    assert row.seq is seq and not out.preempted
    # drafts [5, 6, 1, 2] at positions 10..13 need a fifth block: taken if free, else dropped (nobody preempted)
    assert (row.spec_token_ids, row.num_tokens) == (([5, 6, 1, 2], 5) if drafted else ([], 1))
    sched.block_manager.check_invariants(sched.sequences)


def test_drafts_leave_one_token_of_budget_for_every_other_running_sequence():
    sched = make_scheduler(16, block_size=4, speculative_config=SPEC, max_num_seqs=2, max_num_batched_tokens=4,
                           enable_chunked_prefill=True)
    r, s = Sequence("r", [1, 2, 3, 1, 2, 3], greedy(8, ignore_eos=True)), Sequence("s", [9] * 6, greedy(8, ignore_eos=True))
    sched.add(r)
    sched.add(s)
    while not (r.output_token_ids and s.output_token_ids):
        out = sched.schedule()
        samples = [q for c in out.chunks for q in c.sample_seqs]  # r goes on 1, 2, 3, 1, ...: its drafts are long
        sched.update(out, [1 + q.num_tokens % 3 for q in samples], num_accepted=[0] * len(samples))
    out = sched.schedule()
    # r (first) could take the whole budget (1 + 3 drafts); it leaves s its one token
    assert [(c.seq.request_id, len(c.spec_token_ids)) for c in out.chunks] == [("r", 2), ("s", 0)]
    assert out.num_batched_tokens == 4


# -- greedy equivalence on the chat prompts --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat():
    """8 chat prompts (two of them several hundred tokens of notes) and smollm2's greedy outputs without
    speculation (the oracle)."""
    llm = LLM("smollm2-135m", num_blocks=1000, max_num_seqs=8, device="cpu")
    prompts = chat_prompts(llm.get_tokenizer(), 8)
    outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("options", [
    dict(),
    dict(enable_chunked_prefill=True, max_prefill_chunk_size=64, max_num_batched_tokens=96),
    dict(enable_prefix_caching=True, block_size=8),
    dict(num_blocks=60, block_size=8, preemption_mode="recompute"),
    dict(num_blocks=60, block_size=8, preemption_mode="swap", num_cpu_blocks=60),
], ids=["plain", "chunked", "prefix", "recompute", "swap"])
def test_greedy_outputs_are_token_identical(options, chat):
    prompts, expected = chat
    options = {"num_blocks": 1000, "max_num_seqs": 8, **options}
    llm = LLM("smollm2-135m", device="cpu", speculative_config=SPEC, **options)
    rounds = 2 if options.get("enable_prefix_caching") else 1  # the second round hits the prefix cache
    for _ in range(rounds):
        got = run_engine(llm, [(f"r{i}", p, greedy(MAX_NEW)) for i, p in enumerate(prompts)])  # invariants, leaks
        assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.spec_decode_mean_tokens_per_step > 1
    if "preemption_mode" in options:
        assert stats.num_preemptions > 0
    if options.get("enable_prefix_caching"):
        assert stats.prefix_cache_hit_rate > 0.3


def test_n_samples_are_each_identical(chat):
    prompts, expected = chat
    llm = LLM("smollm2-135m", device="cpu", num_blocks=400, max_num_seqs=8, speculative_config=SPEC)
    got = run_engine(llm, [(f"r{i}", p, greedy(MAX_NEW, n=3)) for i, p in enumerate(prompts[:6])], all_samples=True)
    assert [got[f"r{i}"] for i in range(6)] == [[e] * 3 for e in expected[:6]]


# -- a prompt that repeats, one that does not; stops inside an accepted run; streams -------------------------------
@pytest.fixture(scope="module")
def copy_llms():
    base = LLM("smollm2-135m", num_blocks=64, max_num_seqs=2, device="cpu")
    spec = LLM("smollm2-135m", num_blocks=64, max_num_seqs=2, device="cpu", speculative_config=SPEC)
    copy = base.get_tokenizer().apply_chat_template([{"role": "user", "content": TYPO}], add_generation_prompt=True,
                                                    tokenize=False)
    return base, spec, copy


def test_a_repeating_prompt_accepts_drafts(copy_llms):
    base, spec, copy = copy_llms
    before = spec.engine.stats()
    params = greedy(16, ignore_eos=True)
    want, got = (llm.generate(copy, params, use_tqdm=False)[0].outputs[0] for llm in (base, spec))
    assert got.token_ids == want.token_ids and got.text == want.text
    after = spec.engine.stats()
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    steps = after.spec_decode_num_decode_steps - before.spec_decode_num_decode_steps
    assert accepted >= 8  # "The quick brown fox ..." comes from the prompt
    assert steps + accepted == 15  # 15 tokens after the prefill's: one per decode step, plus the accepted drafts


def test_no_match_no_draft():
    llm = LLM("tiny-random", num_blocks=16, device="cpu", speculative_config=SPEC)
    prompt = list(range(100, 140))  # no bigram occurs twice
    out = llm.generate([prompt], greedy(2, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    plain = LLM("tiny-random", num_blocks=16, device="cpu").generate([prompt], greedy(2, ignore_eos=True),
                                                                     use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain.token_ids
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts == 0 and stats.spec_decode_num_decode_steps == 1  # one decode, undrafted


def _final(llm, prompt, params):
    o = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    return o.token_ids, o.text, o.finish_reason, o.stop_reason


def test_stops_end_the_request_at_the_right_token_inside_an_accepted_run(copy_llms):
    base, spec, copy = copy_llms
    full = base.generate(copy, greedy(16, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    cases = [greedy(m, ignore_eos=True) for m in (3, 6, 9)]
    cases += [greedy(16, stop_token_ids=[full.token_ids[i]]) for i in (4, 7)]
    words = full.text.split()
    cases += [greedy(16, stop=[words[2]]), greedy(16, stop=[words[4]], include_stop_str_in_output=True)]
    for params in cases:
        assert _final(spec, copy, params) == _final(base, copy, params), params


def test_a_stream_delivers_every_accepted_token_in_order(copy_llms):
    base, spec, copy = copy_llms
    params = greedy(16, ignore_eos=True)
    want = base.generate(copy, params, use_tqdm=False)[0].outputs[0]
    engine = spec.engine
    engine.add_request("s", copy, params)
    deltas, texts = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_token_ids)
            texts.append(out.outputs[0].delta_text)
    assert [t for d in deltas for t in d] == want.token_ids and "".join(texts) == want.text
    assert max(map(len, deltas)) > 1  # some steps delivered several tokens
    assert "".join(spec.stream(copy, params)) == want.text


def test_logprobs_rows_are_not_drafted_and_match():
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    base = LLM("tiny-random", num_blocks=16, device="cpu").generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = LLM("tiny-random", num_blocks=16, device="cpu", speculative_config=SPEC)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == base.token_ids and got.logprobs == base.logprobs
    assert llm.engine.stats().spec_decode_num_drafts == 0


def test_abort_from_every_state_frees_every_block():
    llm = LLM("tiny-random", block_size=4, num_blocks=24, max_num_seqs=2, device="cpu", speculative_config=SPEC,
              enable_chunked_prefill=True, max_prefill_chunk_size=4, max_num_batched_tokens=8)
    engine = llm.engine
    prompt = [7, 8, 9, 10] * 5
    for i in range(4):
        engine.add_request(f"r{i}", prompt, greedy(12, ignore_eos=True))
    for step in range(30):
        engine.step()
        engine.check_invariants()
        if step in (1, 4, 9, 15):  # prefilling, running (drafted), waiting
            engine.abort_request(f"r{[1, 0, 3, 2][(1, 4, 9, 15).index(step)]}")
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.num_blocks


# -- stats, /metrics and the serve flag ------------------------------------------------------------------------------
def test_stats_and_metrics_report_drafted_accepted_and_emitted_tokens():
    from minivllm.serving.metrics import ServerMetrics

    llm = LLM("tiny-random", num_blocks=32, device="cpu", speculative_config=SPEC)
    prompt = [7, 8, 9, 10] * 6
    out = llm.generate([prompt], greedy(12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    s = llm.engine.stats()
    assert s.spec_decode_num_draft_tokens >= s.spec_decode_num_accepted_tokens == sum(
        s.spec_decode_num_accepted_tokens_per_pos[:1]) + sum(s.spec_decode_num_accepted_tokens_per_pos[1:])
    assert s.spec_decode_num_emitted_tokens == len(out.token_ids) - 1  # every token but the prefill's
    assert s.spec_decode_num_emitted_tokens == s.spec_decode_num_decode_steps + s.spec_decode_num_accepted_tokens
    assert s.spec_decode_mean_tokens_per_step == s.spec_decode_num_emitted_tokens / s.spec_decode_num_decode_steps
    assert 0 <= s.spec_decode_acceptance_rate <= 1
    metrics = ServerMetrics("m", speculative=True)
    metrics.record([], s)
    text = metrics.render().decode()
    for name, value in [("vllm:spec_decode_num_drafts_total", s.spec_decode_num_drafts),
                        ("vllm:spec_decode_num_draft_tokens_total", s.spec_decode_num_draft_tokens),
                        ("vllm:spec_decode_num_accepted_tokens_total", s.spec_decode_num_accepted_tokens),
                        ("minivllm:spec_decode_num_emitted_tokens_total", s.spec_decode_num_emitted_tokens),
                        ("minivllm:spec_decode_mean_tokens_per_step", s.spec_decode_mean_tokens_per_step)]:
        assert f'{name}{{model_name="m"}} {float(value)}' in text, name
    assert "spec_decode" not in ServerMetrics("m").render().decode()  # off: no speculative metrics


def test_serve_speculative_config_flag_is_json_and_bad_values_are_usage_errors(capsys):
    import argparse
    import json

    from minivllm.serving.cli import add_serve_arguments, engine_config

    parser = argparse.ArgumentParser(prog="serve")
    add_serve_arguments(parser)
    config = engine_config(parser.parse_args(["--model", "tiny-random", "--speculative-config", json.dumps(SPEC)]),
                           parser)
    assert config.speculative_config.num_speculative_tokens == 4
    assert engine_config(parser.parse_args(["--model", "tiny-random"]), parser).speculative_config is None
    for value, allowed in [("{bad", "must be a JSON object"), ("[4]", "must be a JSON object"),
                           ('{"method": "eagle", "num_speculative_tokens": 2}', "speculative_config.method must be")]:
        with pytest.raises(SystemExit) as e:
            engine_config(parser.parse_args(["--model", "tiny-random", "--speculative-config", value]), parser)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --speculative-config" in err and allowed in err, err


def test_bench_workload_speculative_runs_on_tiny_random(capsys):
    from minivllm.__main__ import main

    assert main(["bench", "--workload", "speculative", "--model", "tiny-random", "--num-requests", "2",
                 "--output-len", "3", "4", "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["repetitive"], ["open"])]
    assert [(r[0], r[1], r[2]) for r in rows] == [(k, "2", s) for k in ("repetitive", "open") for s in ("off", "on")]
    assert "greedy outputs identical with speculation off and on: True" in out and "target at batch 2" in out
