"""Tensor parallelism (chapter 15): outputs identical to one process, 1/tp of the memory per rank, refusals,
a dying worker, and no process left behind (checked after every test through /proc)."""

import datetime
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.attention import MiniPagedKVCache
from minivllm.bench.server_process import free_port
from minivllm.distributed import WorkerError, Workers
from minivllm.distributed.protocol import StepMessage, decode, encode
from minivllm.exercises.live import chat_prompts
from minivllm.model_runner import StepInputs
from minivllm.models import TensorParallelGroup, load_tokenizer

from helpers import process_alive

ROOT = Path(__file__).resolve().parent.parent


# -- processes ---------------------------------------------------------------------------------
def _children(pid: int) -> dict[int, str]:
    """Live (not zombie) children of ``pid`` and their command lines, from /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            out[int(entry.name)] = cmd
    return out


def _wait_gone(pids, seconds: float = 20.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if process_alive(p)]


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """After each test, this process has no child it did not have before (multiprocessing's resource
    tracker, started by the first spawn and kept for the life of the process, aside)."""
    before = set(_children(os.getpid()))
    yield
    gc.collect()  # an engine dropped without shutdown() stops its workers when it is collected
    new = {pid: cmd for pid, cmd in _children(os.getpid()).items() if pid not in before}
    leftover = [pid for pid, cmd in new.items() if "resource_tracker" not in cmd]
    assert not _wait_gone(leftover), f"processes left behind: {[new[p] for p in leftover]}"


def _worker_pids(llm) -> list[int]:
    return [p.pid for p in llm.engine.workers.processes.values()]


# -- workloads ---------------------------------------------------------------------------------
def _run(llm, requests) -> tuple[dict, dict]:
    """Drive the engine over ``(id, prompt ids, params)``; every sample's tokens, and what the steps did."""
    engine = llm.engine
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    outs, seen = {}, {"copies": 0, "swaps": 0}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = [c.token_ids for c in o.outputs]
        engine.check_invariants()
        seen["copies"] += len(engine.last_schedule.copies)
        seen["swaps"] += len(engine.last_schedule.swap_out) + len(engine.last_schedule.swap_in)
    stats = engine.stats()
    seen.update(preemptions=stats.num_preemptions, prefix_hits=stats.prefix_cache_hits)
    return outs, seen


def _tiny_workload():
    """Prompts of 6 to 51 tokens (two share a prefix), some with two samples (a fork's copy on write)."""
    prompts = [[(31 * i + j) % 40000 + 1 for j in range(6 + 9 * i)] for i in range(6)]
    prompts.append(prompts[4] + [5, 6, 7])
    return [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2 if i % 3 == 0 else 1))
            for i, p in enumerate(prompts)]


TINY_OPTIONS = dict(device="cpu", block_size=4, num_blocks=16, max_num_seqs=6, enable_prefix_caching=True,
                    enable_chunked_prefill=True, max_prefill_chunk_size=8, max_num_batched_tokens=16)


def _assert_memory_split(llm, reference, tp):
    """Every rank holds 1/tp of the split weights and of the KV pools, and the norms whole."""
    whole = {"sharded": reference["sharded"], "replicated": reference["replicated"], "kv": reference["kv"]}
    ranks = llm.engine.runner.rank_memory
    assert len(ranks) == tp
    for rank in ranks:
        assert rank["sharded"] * tp == whole["sharded"], (rank, whole)
        assert rank["replicated"] == whole["replicated"] > 0
        assert rank["kv"] * tp == whole["kv"], (rank, whole)


def _memory(llm) -> dict:
    from minivllm.distributed.workers import memory_report

    return memory_report(llm.engine.runner)


# -- exact outputs and memory ------------------------------------------------------------------
@pytest.mark.parametrize("model,tp,mode", [("tiny-random", 2, "recompute"), ("tiny-random-8h", 4, "swap")])
def test_tiny_models_are_token_identical_with_chunking_prefix_caching_and_preemption(model, tp, mode):
    options = dict(TINY_OPTIONS, preemption_mode=mode)
    single = LLM(model, **options)
    reference, seen_single = _run(single, _tiny_workload())
    with LLM(model, tensor_parallel_size=tp, **options) as llm:
        outputs, seen = _run(llm, _tiny_workload())
        _assert_memory_split(llm, _memory(single), tp)
    assert outputs == reference
    assert seen == seen_single  # the same schedule: the block manager does not know about ranks
    assert seen["preemptions"] > 0 and seen["copies"] > 0 and seen["prefix_hits"] > 0
    assert seen["swaps"] > 0 or mode == "recompute"


def test_smollm2_on_three_ranks_is_token_identical_on_chat_prompts():
    prompts = chat_prompts(load_tokenizer("smollm2-135m"), 8)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    options = dict(device="cpu", num_blocks=160, max_num_seqs=8)
    single = LLM("smollm2-135m", **options)
    reference = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    with LLM("smollm2-135m", tensor_parallel_size=3, **options) as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        _assert_memory_split(llm, _memory(single), 3)
        assert llm.engine.kv_bytes_per_block * 3 == single.engine.kv_bytes_per_block
    assert outputs == reference
    assert len({tuple(o) for o in outputs}) > 1  # real, varied replies


def test_step_messages_round_trip():
    inputs = StepInputs([5, 6, 7, 8], [0, 1, 2, 9], [40, 41, 42, 77], [[10, 11], [19, 3, 4]], [3, 10], [3, 1], [2, 3])
    msg = StepMessage(inputs=inputs, copies=[(1, 2)], swap_out=[(3, 0), (4, 1)], swap_in=[])
    assert decode(*encode(msg)) == msg
    copies_only = StepMessage(copies=[(7, 8)])
    assert decode(*encode(copies_only)) == copies_only


# -- refusals ----------------------------------------------------------------------------------
def test_sizes_that_do_not_divide_the_heads_are_refused_naming_the_valid_ones():
    before = set(_children(os.getpid()))
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be 1 or 3 for smollm2-135m .*9 query heads, "
                                         r"3 KV heads.*got 2"):
        LLM("smollm2-135m", tensor_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be 1 or 2 for tiny-random .*got 4"):
        LLM("tiny-random", tensor_parallel_size=4, device="cpu")
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be 1, 2 or 4 for tiny-random-8h .*got 3"):
        LLM("tiny-random-8h", tensor_parallel_size=3, device="cpu")
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
            EngineConfig(tensor_parallel_size=bad)
    assert set(_children(os.getpid())) == before  # refused before any worker started
    assert not torch.distributed.is_initialized()


def test_shard_weight_must_be_none_or_a_function():
    for bad in (3, "minivllm.no_such.fn", "minivllm.models.parallel.no_such_fn"):
        with pytest.raises(ValueError, match="shard_weight must be None, a function or an importable dotted name"):
            EngineConfig(shard_weight=bad)
    ref = "minivllm.exercises.tensor_parallel.reference_shard_weight"
    assert EngineConfig(shard_weight=ref).shard_weight == ref and EngineConfig().shard_weight is None


def test_a_shard_weight_function_gives_the_loaders_own_shards():
    """load_model_shard through shard_weight (the whole tensors, sliced by the function) = its own slicing."""
    from minivllm.exercises.tensor_parallel import reference_shard_weight
    from minivllm.models import TensorParallelGroup, load_config, load_model_shard

    calls = []

    def sharding(name, weight, rank, world, config):
        calls.append((name, tuple(weight.shape), rank, world))
        return reference_shard_weight(name, weight, rank, world, config)

    for rank in range(2):
        tp = TensorParallelGroup(rank, 2)
        own = load_model_shard("tiny-random-8h", tp, "cpu", pack_weights=False).state_dict()
        mine = load_model_shard("tiny-random-8h", tp, "cpu", pack_weights=False, shard_weight=sharding).state_dict()
        assert own.keys() == mine.keys() and all(torch.equal(own[k], mine[k]) for k in own)
    names = {c[0] for c in calls}
    assert "model.layers.0.self_attn.k_proj.weight" in names and {c[2:] for c in calls} == {(0, 2), (1, 2)}
    config = load_config("tiny-random-8h")
    k_rows = config.num_key_value_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    assert {shape for name, shape, _, _ in calls if name.endswith("k_proj.weight")} == {(k_rows, config.hidden_size)}


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be at most the 2 CUDA devices here .*got 3"):
        EngineConfig(device="cuda", tensor_parallel_size=3)
    assert EngineConfig(device="cuda", tensor_parallel_size=2).tensor_parallel_size == 2


def test_a_torchrun_world_of_another_size_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be torchrun's WORLD_SIZE \(4\).*got 2"):
        LLM("tiny-random", tensor_parallel_size=2, device="cpu")
    assert not torch.distributed.is_initialized()


# -- failure and shutdown ----------------------------------------------------------------------
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[(31 * i + j) % 40000 + 1 for j in range(6 + 9 * i)] for i in range(4)]


def test_a_killed_worker_makes_the_engine_raise_and_stop_the_others():
    llm = LLM("tiny-random-8h", tensor_parallel_size=4, device="cpu", block_size=4, num_blocks=64)
    pids = _worker_pids(llm)
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=rf"worker rank 2 \(pid {pids[1]}\) died \(killed by SIGKILL\); the engine "
                                          r"shut the other ranks down"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert time.monotonic() - start < 30  # no hang: the step fails at once
    assert not _wait_gone(pids, 0)  # every worker is gone already
    with pytest.raises(WorkerError, match="workers are shut down .*rank 2"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests  # the failed calls freed their blocks
    llm.shutdown()  # idempotent


def test_a_step_that_waited_out_the_collective_timeout_does_not_wait_for_a_rank_to_die(monkeypatch):
    """A peer that died fails the step at once and is waited for (to name it); a stopped one will not exit: a step
    that failed after the collective timeout fails at once (before: 10 s more, /health 200 meanwhile)."""
    waits = []
    for timeout, step_s in ((0.05, 0.1), (60.0, 0.0)):  # the collective timed out; a peer's socket closed
        workers = Workers(TensorParallelGroup(0, 2), None, torch.device("cpu"),
                          timeout=datetime.timedelta(seconds=timeout))
        monkeypatch.setattr(workers, "dead_ranks", lambda wait: waits.append(wait) or [])

        def step():
            time.sleep(step_s)
            raise RuntimeError("the collective failed")

        with pytest.raises(WorkerError, match=r"a tensor-parallel step failed on rank 0 \(RuntimeError: the"):
            workers.guard(step)
    assert waits == [0.0, 0.0, 0.0, 10.0]  # check_health's, then the failure's


class FailsOnRank1(MiniPagedKVCache):
    """A KV cache that raises on rank 1 once prompts are longer than 20 tokens: a worker failing mid-step."""

    def forward(self, layer, q, k, v, positions, batch):
        if torch.distributed.get_rank() == 1 and int(positions.max()) > 20:
            raise RuntimeError("rank 1 ran out of something")
        return super().forward(layer, q, k, v, positions, batch)


def test_a_worker_that_fails_mid_step_is_named_with_its_error():
    with LLM("tiny-random", tensor_parallel_size=2, device="cpu", block_size=4, num_blocks=64,
             attention_backend=FailsOnRank1) as llm:
        pids = _worker_pids(llm)
        llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)  # positions below 20: fine
        with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) died \(exit code 1, after RuntimeError: rank 1 "
                                              r"ran out of something\); the engine shut the other ranks down"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert not _wait_gone(pids, 0)


def test_a_dropped_engine_stops_its_workers():
    llm = LLM("tiny-random", tensor_parallel_size=2, device="cpu", block_size=4, num_blocks=64)
    pids = _worker_pids(llm)
    del llm
    gc.collect()
    assert not _wait_gone(pids, 0)
    assert not torch.distributed.is_initialized()


SCRIPT = """
import json, os, sys, time
from minivllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM("tiny-random", tensor_parallel_size=2, device="cpu", block_size=4, num_blocks=64)
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"workers": [p.pid for p in llm.engine.workers.processes.values()],
                      "tokens": out[0].outputs[0].token_ids}), flush=True)
    if sys.argv[1] == "hang":
        time.sleep(600)
"""


def _start_script(tmp_path, mode):
    script = tmp_path / "tp_script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True, env=env)


def test_workers_leave_when_rank_0_exits_or_is_killed(tmp_path):
    proc = _start_script(tmp_path, "exit")  # ends without shutdown(): the exit handlers stop the workers
    line = json.loads(proc.stdout.readline())
    assert proc.wait(timeout=60) == 0
    assert not _wait_gone(line["workers"], 20)
    proc = _start_script(tmp_path, "hang")  # killed outright: the workers see it and leave
    line = json.loads(proc.stdout.readline())
    proc.kill()
    proc.wait(timeout=30)
    proc.stdout.close()
    assert not _wait_gone(line["workers"], 20)


def test_torchrun_env_launch_gives_the_same_tokens(tmp_path):
    script = tmp_path / "tp_torchrun.py"
    script.write_text(textwrap.dedent("""
        import json, os
        from minivllm import LLM, SamplingParams
        with LLM("tiny-random", tensor_parallel_size=2, device="cpu", block_size=4, num_blocks=64) as llm:
            outs = llm.generate([[1, 2, 3, 4, 5], [7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        print("RANK", os.environ["RANK"], json.dumps([o.outputs[0].token_ids for o in outs]))
    """))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("RANK")]
    assert len(lines) == 1 and lines[0].startswith("RANK 0 ")  # rank 1 served the steps and left quietly
    reference = LLM("tiny-random", device="cpu", block_size=4, num_blocks=64).generate(
        [[1, 2, 3, 4, 5], [7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert json.loads(lines[0].split(" ", 2)[2]) == [o.outputs[0].token_ids for o in reference]


def test_import_minivllm_starts_nothing():
    code = ("import multiprocessing, torch.distributed as d, minivllm, minivllm.distributed; "
            "print(d.is_initialized(), multiprocessing.active_children())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False []"
