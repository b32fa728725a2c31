"""The benchmark harness (chapter 11): workloads, timed replay, baselines, roofline, step phases, the CLI."""

import json
import os
import time

import pytest
import torch

from minivllm import LLM
from minivllm.bench import (MachineLimits, PhaseClock, ReservingBlockManager, Timer, WORKLOADS, make_workload,
                            poisson_times, roofline,
                            run_contiguous, run_engine, run_hf_generate, run_hf_generate_batch, run_naive,
                            run_static, same_outputs, step_breakdown)

SMALL = {"offline": dict(num_requests=4, prompt_len=(8, 30), output_len=(3, 7)),
         "online": dict(num_requests=4, prompt_len=(8, 30), output_len=(3, 5), rate=40.0),
         "shared-prefix": dict(num_requests=4, prefix_len=24, output_len=(3, 3), rate=40.0),
         "interference": dict(num_streams=2, stream_tokens=12, num_long=1, long_prompt_len=120, long_every=0.05),
         "memory-pressure": dict(num_requests=5, prompt_len=(20, 30), output_len=(16, 16))}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_is_seeded_and_runs_to_completion(name, tiny):
    _, tok = tiny
    a, b = make_workload(name, tok, seed=3, **SMALL[name]), make_workload(name, tok, seed=3, **SMALL[name])
    assert a.prompts == b.prompts and a.max_tokens == b.max_tokens
    assert [x.at_time for x in a.arrivals] == [x.at_time for x in b.arrivals]
    result = run_engine(a, "tiny-random", block_size=4)
    assert [len(ids) for ids in result.token_ids] == a.max_tokens
    for r in result.requests:
        assert r.token_times[0] >= r.arrival_time and r.token_times == sorted(r.token_times)


def test_unknown_workload_and_bad_rate_are_refused(tiny):
    _, tok = tiny
    with pytest.raises(ValueError, match="workload must be one of"):
        make_workload("nope", tok)
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_times(3, 0.0)


def test_poisson_gaps_average_one_over_the_rate():
    times = poisson_times(4000, rate=5.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert abs(times[-1] / (len(times) - 1) - 0.2) < 0.02


def test_timed_arrivals_are_not_added_early_and_count_from_their_send_time(tiny):
    _, tok = tiny
    w = make_workload("online", tok, num_requests=4, prompt_len=(8, 12), output_len=(2, 2), rate=10.0, seed=2)
    result = run_engine(w, "tiny-random", block_size=4)
    start = min(r.arrival_time for r in result.requests)  # the first request is sent at t=0
    for a, r in zip(w.arrivals, result.requests):
        assert r.arrival_time == pytest.approx(start + a.at_time, abs=1e-6)
        assert r.first_scheduled_time >= r.arrival_time


def test_memory_pressure_preempts_and_changes_no_output(tiny):
    _, tok = tiny
    w = make_workload("memory-pressure", tok, **SMALL["memory-pressure"])
    squeezed = run_engine(w, "tiny-random", block_size=4)
    roomy = run_engine(w, "tiny-random", block_size=4, num_blocks=w.kv_blocks_needed(4) + 4)
    assert squeezed.stats.num_preemptions > 0 and roomy.stats.num_preemptions == 0
    assert squeezed.steps[0].total_blocks == w.num_blocks(4) < roomy.steps[0].total_blocks
    assert squeezed.token_ids == roomy.token_ids


def test_kv_records_count_used_blocks_and_partly_filled_slots(tiny):
    _, tok = tiny
    w = make_workload("shared-prefix", tok, **SMALL["shared-prefix"])
    for caching in (False, True):
        result = run_engine(w, "tiny-random", block_size=4, enable_prefix_caching=caching)
        assert any(s.used_blocks for s in result.steps)
        for s in result.steps:
            assert 0 <= s.used_blocks <= s.total_blocks and 0 <= s.kv_utilization <= 1
            if s.used_blocks:  # every held block belongs to a sequence with some KV; shared blocks count once
                assert 0 <= s.wasted_slots < s.used_blocks * s.block_size
        assert result.steps[-1].used_blocks == 0  # everything given back at the end


def test_every_rung_and_baseline_gives_the_engines_greedy_tokens(tiny, hf_models):
    model, tok = tiny
    w = make_workload("offline", tok, **SMALL["offline"])
    ours = run_engine(w, "tiny-random", block_size=4)
    hf = hf_models("tiny-random")
    others = [run_naive(model, w), run_contiguous(model, w), run_static(model, w, batch_size=3),
              run_hf_generate(hf, w, 1), run_hf_generate(hf, w, 3), run_hf_generate_batch(hf, w)]
    for r in others:
        assert same_outputs(ours, r) == len(w.arrivals), r.name
        assert [len(r_.token_times) for r_ in r.requests] == w.max_tokens, r.name
        m = r.metrics()
        assert m.completed == len(w.arrivals) and m.total_output_tokens == sum(w.max_tokens)
        assert m.ttft.p50 > 0 and r.seconds >= m.e2e.max - 1e-6


def test_reservation_fits_fewer_requests_than_paging_at_the_same_budget(tiny):
    """Reserving prompt + max_tokens per request (a contiguous cache's rule, in blocks) against paging."""
    _, tok = tiny
    w = make_workload("offline", tok, num_requests=8, prompt_len=(8, 16), output_len=(24, 24))
    budget = w.kv_blocks_needed(4) // 2
    reserved = run_engine(w, "tiny-random", block_size=4, num_blocks=budget, max_num_seqs=8,
                          block_manager_cls=ReservingBlockManager)
    paged = run_engine(w, "tiny-random", block_size=4, num_blocks=budget, max_num_seqs=8)
    assert same_outputs(reserved, paged) == len(w.arrivals)
    peak = lambda r: max(len(s.chunks) for s in r.steps)  # noqa: E731
    assert peak(reserved) < peak(paged)
    assert len(reserved.steps) > len(paged.steps)


def test_baselines_refuse_workloads_with_arrivals_over_time(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="offline workloads only"):
        run_static(model, make_workload("online", tok, **SMALL["online"]))


def test_roofline_by_hand(tiny):
    """One request, prompt 3, 3 outputs: prefill FLOPs at peak, then 2 decode steps, each max(FLOPs, bytes)."""
    model, tok = tiny
    w = make_workload("offline", tok, num_requests=1, prompt_len=(3, 3), output_len=(3, 3))
    c = model.config
    weights = sum(m.weight.numel() for m in model.model.layers.modules() if hasattr(m, "in_features"))
    vocab = model.lm_head.weight.numel()
    attn = 4 * c.num_hidden_layers * c.num_attention_heads * model.head_dim
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * model.head_dim * 4
    flops = lambda pos: 2 * weights + attn * (pos + 1)  # noqa: E731
    limits = MachineLimits(flops=1e9, bandwidth=1e6)
    r = roofline(model, w, limits)
    assert r["prefill_s"] == pytest.approx((flops(0) + flops(1) + flops(2) + 2 * vocab) / 1e9)
    expected_decode = sum(max((flops(2 + s) + 2 * vocab) / 1e9, ((weights + vocab) * 4 + (3 + s) * kv) / 1e6)
                          for s in (1, 2))
    assert r["decode_s"] == pytest.approx(expected_decode)
    assert r["throughput"] == pytest.approx(3 / r["seconds"])


def test_step_breakdown_times_each_phase_and_leaves_the_engine_empty():
    llm = LLM("tiny-random", block_size=4)
    rows = step_breakdown(llm, batch_sizes=(1, 3), prompt_len=8, steps=2)
    assert set(rows) == {1, 3}
    for row in rows.values():
        assert {"schedule", "prepare", "forward", "sample", "update", "detokenize", "total", "python"} <= set(row)
        assert row["total"] >= row["forward"] > 0 and row["python"] >= 0
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_total_blocks
    assert llm.engine.sync_phase_timing is False


def test_decode_op_breakdown_sorts_op_time_into_kinds_and_leaves_the_engine_empty():
    from minivllm.bench import OP_KINDS, decode_op_breakdown

    rows = {}
    for table in ("reference", "auto"):
        llm = LLM("tiny-random", block_size=4, kernels=table)
        rows[llm.engine.stats().kernels] = row = decode_op_breakdown(llm, 3, prompt_len=8, steps=2)
        assert set(row) == set(OP_KINDS.values()) | {"other ops", "total", "calls"}
        assert row["matmuls"] > 0 and row["attention"] > 0 and row["other ops"] > 0 and row["calls"] > 0
        assert row["total"] == pytest.approx(sum(v for k, v in row.items() if k not in ("total", "calls")))
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_total_blocks
    assert rows["reference"]["KV gather"] > 0  # PyTorch's path gathers each row's blocks
    if "cpu" in rows:  # the kernel table's paged attention reads the pool in place, in fewer calls
        assert rows["cpu"]["KV gather"] < rows["reference"]["KV gather"] and rows["cpu"]["calls"] < rows["reference"]["calls"]


def test_profiling_through_minivllm_writes_nothing_on_the_processes_stderr(capfd):
    """decode_op_breakdown profiles through quiet_profile: nothing on file descriptor 2, where torch 2.13's profiler
    writes "USDT: ... profiler_start" and "profiler_stop" from C++ (a notebook shows them under the cell); the
    profiled block keeps its stderr, and the profile its events."""
    from torch.profiler import ProfilerActivity

    from minivllm.bench import decode_op_breakdown
    from minivllm.timing import quiet_profile

    llm = LLM("tiny-random", block_size=4, kernels="reference")
    capfd.readouterr()
    assert decode_op_breakdown(llm, 2, prompt_len=8, steps=1)["calls"] > 0
    with quiet_profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(3).add_(1)
        os.write(2, b"the block's own\n")
    assert any("add_" in e.name for e in prof.events())
    out, err = capfd.readouterr()
    assert err == "the block's own\n"


def test_timer_and_phase_clock_measure_wall_time_on_the_cpu():
    with Timer("cpu") as t:
        time.sleep(0.02)
    assert 0.02 <= t.seconds < 60  # at least the sleep; the upper bound only catches a wrong unit
    clock = PhaseClock("cpu")
    time.sleep(0.01)
    clock.mark("a")
    clock.mark("b")
    assert clock.phases["a"] >= 0.01 and 0 <= clock.phases["b"] < clock.phases["a"]


def test_cli_bench_writes_json_and_generate_streams(tmp_path, capsys):
    from minivllm.__main__ import main

    out = tmp_path / "r.json"
    assert main(["bench", "--workload", "offline", "--model", "tiny-random", "--num-requests", "3",
                 "--prompt-len", "8", "16", "--output-len", "4", "4", "--compare", "static", "--no-roofline",
                 "--quiet", "--breakdown", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["step_breakdown"]) == {"1", "2"} and report["step_breakdown"]["2"]["forward"] > 0
    assert [r["same_outputs_as_minivllm"] for r in report["results"]] == [3, 3]
    assert report["results"][0]["completed"] == 3 and report["results"][0]["mean_ttft_ms"] > 0
    printed = capsys.readouterr().out
    assert "Mean TTFT (ms)" in printed and "minivllm / static batches of 16" in printed
    assert "one decode step, by phase" in printed
    assert main(["generate", "Hi", "--model", "tiny-random", "--max-tokens", "5", "--raw"]) == 0
    assert capsys.readouterr().out.strip()


def test_cli_bench_runs_the_engine_and_the_baselines_in_the_dtype_asked(tmp_path, capsys, monkeypatch):
    """--dtype bfloat16: the engine and the static baseline both run bf16 weights (same tokens: one forward code)."""
    import minivllm.__main__ as cli
    from minivllm.__main__ import main

    dtypes = []
    real_load = cli.load_model
    monkeypatch.setattr(cli, "load_model",
                        lambda name, device, dtype, **kw: dtypes.append(dtype) or real_load(name, device, dtype, **kw))
    out = tmp_path / "r.json"
    assert main(["bench", "--workload", "offline", "--model", "tiny-random", "--num-requests", "3", "--dtype",
                 "bfloat16", "--prompt-len", "8", "16", "--output-len", "4", "4", "--compare", "static",
                 "--no-roofline", "--quiet", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["engine_options"]["dtype"] == "bfloat16"
    assert dtypes == [torch.bfloat16]  # the model the static baseline runs
    assert [r["same_outputs_as_minivllm"] for r in report["results"]] == [3, 3]
    assert "tiny-random bfloat16 on" in capsys.readouterr().out


def test_cli_help_documents_both_commands(capsys):
    from minivllm.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "generate" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "--workload" in text and "--json" in text and "offline" in text


def test_bench_exports_its_own_names_only_and_still_the_chapter_10_simulator():
    import minivllm.simulator

    names = {}
    exec("from minivllm.bench import *", names)
    assert not {"torch", "dataclass", "field", "time", "annotations", "harness", "experiments"} & set(names)
    assert names["simulate_schedule"] is minivllm.simulator.simulate_schedule
    assert names["sim_sequence"] is minivllm.simulator.sim_sequence


def test_the_sweep_draws_fresh_prompts_of_the_same_lengths_for_every_rate_and_repeat(tiny):
    """No server may answer a later rate from a prefix cache filled by an earlier one (transformers serve shares
    prefixes): every (repeat, rate) gets its own prompt tokens, the same lengths, arrivals and output lengths."""
    from argparse import Namespace

    from minivllm.bench.serving_sweep import _plan, fresh_prompts
    from minivllm.bench.workloads import ordinary_token_ids

    _, tok = tiny
    w = make_workload("online", tok, **SMALL["online"])
    again = fresh_prompts(w, tok, seed=5)
    assert again == fresh_prompts(w, tok, seed=5) and again != fresh_prompts(w, tok, seed=6)
    low, high = ordinary_token_ids(tok)
    for a, b in zip(w.arrivals, again.arrivals):
        assert len(a.prompt) == len(b.prompt) and a.prompt != b.prompt and all(low <= t < high for t in b.prompt)
        assert (a.at_time, a.params.max_tokens, a.request_id) == (b.at_time, b.params.max_tokens, b.request_id)
    workloads = {rate: make_workload("online", tok, **{**SMALL["online"], "rate": rate}) for rate in (1.0, 4.0)}
    plan = _plan(Namespace(seed=0, repeats=2), workloads, tok)
    prompts = [tuple(map(tuple, w.prompts)) for w in plan.values()]
    assert len(plan) == 4 and len(set(prompts)) == 4


def test_hf_continuous_batching_gets_its_page_size_under_the_name_its_transformers_takes():
    """transformers 5.17's ContinuousBatchingConfig names the page ``block_size``, later ones ``page_size``: a GPU
    run of check_gpu's benchmark on 5.17 stopped with a TypeError before the page size took this name."""
    from minivllm.bench.baselines import continuous_batching_options

    new = continuous_batching_options({}, {"page_size": None, "block_size": None, "num_blocks": None})
    old = continuous_batching_options({"page_size": 32}, {"block_size": None, "num_blocks": None})
    assert new == {"page_size": 64, "max_batch_tokens": 512, "allow_block_sharing": False}
    assert old == {"block_size": 32, "max_batch_tokens": 512, "allow_block_sharing": False}
