"""The GPU path, as far as a CPU can check it (chapter 12, issue 17): dtype choice, attention kernel choice,
swap copies on a side stream (with stand-in streams), decode through the CUDA-graph runner's static buffers
(its eager replay), and ``python -m minivllm.check_gpu`` without a GPU."""

import json
import subprocess
import sys

import pytest
import torch

from minivllm import LLM
from minivllm import attention
from minivllm.attention import GATHER, PAGED_KERNEL, VARLEN, MiniPagedKVCache, PagedBatch, choose_attention_kernel
from minivllm.config import EngineConfig, resolve_dtype
from minivllm.copy_stream import BlockCopier
from minivllm.cuda_graphs import MiniDecodeGraphRunner, bucket_for, capture_sizes
from minivllm.model_runner import StepInputs

from helpers import greedy, run_engine


# -- dtype and graphs by device -------------------------------------------------------------------------

def test_auto_dtype_is_float32_on_cpu_and_explicit_dtypes_are_kept():
    assert EngineConfig().dtype == "auto" and EngineConfig().torch_dtype == torch.float32
    assert EngineConfig(dtype="bfloat16").torch_dtype == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of \\('auto'"):
        EngineConfig(dtype="int8")


@pytest.mark.parametrize("bf16, expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_dtype_on_cuda_is_bf16_or_fp16_where_bf16_is_missing(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_dtype("auto", torch.device("cuda")) == expected
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32  # fp32 on request


def test_cuda_graphs_default_on_cuda_off_with_enforce_eager_and_never_on_cpu(monkeypatch):
    assert not EngineConfig().use_cuda_graphs
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        EngineConfig(enforce_eager=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig(device="cuda").use_cuda_graphs
    assert not EngineConfig(device="cuda", enforce_eager=True).use_cuda_graphs
    assert not EngineConfig(device="cpu").use_cuda_graphs


# -- attention kernel choice ----------------------------------------------------------------------------

def test_cpu_engine_reports_its_attention_kernel_and_no_graphs():
    """The kernel table's paged attention where the C++ kernels build, PyTorch's gather with the reference."""
    stats = LLM("tiny-random", num_blocks=32, device="cpu").engine.stats()
    assert stats.attention_kernel == (GATHER if stats.kernels == "reference" else PAGED_KERNEL)
    assert stats.cuda_graph_sizes == ()
    stats = LLM("tiny-random", num_blocks=32, device="cpu", kernels="reference").engine.stats()
    assert (stats.kernels, stats.attention_kernel) == ("reference", GATHER)


def test_kernel_choice_on_cuda_needs_ampere_half_precision_and_a_passing_probe(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(attention, "_agrees", lambda *a: True)
    assert choose_attention_kernel(cuda, torch.bfloat16) == VARLEN
    assert choose_attention_kernel(cuda, torch.float32) == GATHER  # FlashAttention has no fp32
    assert choose_attention_kernel("cpu", torch.bfloat16) == GATHER
    monkeypatch.setattr(attention, "_agrees", lambda *a: False)  # the probe disagrees: never trust it
    assert choose_attention_kernel(cuda, torch.bfloat16) == GATHER
    monkeypatch.setattr(attention, "_agrees", lambda *a: 1 / 0)  # the kernel refuses the probe
    assert choose_attention_kernel(cuda, torch.bfloat16) == GATHER
    monkeypatch.setattr(attention, "_agrees", lambda *a: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))  # a T4
    assert choose_attention_kernel(cuda, torch.float16) == GATHER


def test_varlen_metadata_of_a_step():
    batch = PagedBatch([[3, 1], [5], [7]], [6, 2, 3], [6, 1, 1], 4, "cpu")
    assert batch.cu_seq_q.tolist() == [0, 6, 7, 8] and batch.context_lens.tolist() == [6, 2, 3]
    assert batch.block_table.tolist() == [[3, 1], [5, 0], [7, 0]] and batch.block_table.dtype == torch.int32
    assert (batch.max_q, batch.max_k) == (6, 6)


# -- swap copies on a side stream ------------------------------------------------------------------------

class FakeEvent:
    def __init__(self, n):
        self.name = f"event{n}"


class FakeStream:
    """Records the ordering calls a CUDA stream would get."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append((self.name, "wait_stream", other.name))

    def record_event(self):
        event = FakeEvent(len(self.log))
        self.log.append((self.name, "record", event.name))
        return event

    def wait_event(self, event):
        self.log.append((self.name, "wait_event", event.name))


def test_side_stream_swap_copies_and_orders_with_events():
    log = []
    copier = BlockCopier(torch.device("cpu"), FakeStream("side", log), FakeStream("compute", log))
    dev, cpu = torch.randn(3, 6, 4), torch.zeros(3, 2, 4)
    copier.swap([(dev, cpu)], [(4, 1), (2, 0)], to_cpu=True)
    assert torch.equal(cpu[:, 1], dev[:, 4]) and torch.equal(cpu[:, 0], dev[:, 2])
    back = torch.zeros_like(dev)
    copier.swap([(back, cpu)], [(1, 5)], to_cpu=False)
    assert torch.equal(back[:, 5], dev[:, 4])
    # each swap: the side stream waits for compute, records an event, and compute waits for that event
    assert [entry[:2] for entry in log] == [("side", "wait_stream"), ("side", "record"), ("compute", "wait_event")] * 2
    assert log[2][2] == log[1][2] and copier.last_event.name == log[4][2]


def test_engine_swaps_through_the_side_stream_path_with_the_same_tokens():
    work = [(f"r{i}", [(37 * i + j) % 49000 + 1 for j in range(20 + 3 * i)], greedy(30, ignore_eos=True))
            for i in range(8)]
    roomy = run_engine(LLM("tiny-random", block_size=4, num_blocks=400, max_num_seqs=8, device="cpu"), work)
    llm = LLM("tiny-random", block_size=4, num_blocks=50, max_num_seqs=8, preemption_mode="swap", device="cpu")
    log = []
    llm.engine.runner.kv_cache.copier = BlockCopier(torch.device("cpu"), FakeStream("side", log),
                                                    FakeStream("compute", log))
    assert run_engine(llm, work) == roomy
    assert llm.engine.stats().num_swapped_bytes > 0 and ("compute", "wait_event") in [e[:2] for e in log]


# -- CUDA graphs: buckets, padding, slots, and the eager replay -------------------------------------------

def test_capture_sizes_and_buckets():
    assert capture_sizes(16) == [1, 2, 4, 8, 16] and capture_sizes(12) == [1, 2, 4, 8, 12] and capture_sizes(1) == [1]
    sizes = capture_sizes(12)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]
    for bad in (0, 13):
        with pytest.raises(ValueError, match="decode batch must have 1 to 12 rows"):
            bucket_for(bad, sizes)


def test_padding_rows_with_slot_minus_one_write_nothing():
    cache = MiniPagedKVCache(2, 8, 4, 2, 8)
    before_k, before_v = cache.k.clone(), cache.v.clone()
    tables = torch.tensor([[2, 3], [0, 0], [0, 0]])
    batch = PagedBatch.for_decode(tables, torch.tensor([6, 1, 1]), torch.tensor([13, -1, -1]), 4, 2)
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    out = cache.forward(1, q, k, k, None, batch)
    changed = (cache.k != before_k).flatten(2).any(-1)  # [layer, block] pairs that changed
    assert changed.nonzero().tolist() == [[1, 3]] and torch.equal(cache.k[1, 3, 1], k[0])  # slot 13 only
    assert torch.equal(cache.v[0], before_v[0]) and torch.isfinite(out).all()


def _engine_pair(max_num_seqs=8):
    kw = dict(block_size=4, num_blocks=200, max_num_seqs=max_num_seqs, device="cpu")
    return LLM("tiny-random", **kw), LLM("tiny-random", **kw)


def _varying_batches(n=7):
    """Requests that finish one by one, so the decode batch takes every size from n down to 1."""
    return [(f"r{i}", [(11 * i + j) % 4000 + 5 for j in range(3 + 5 * i)], greedy(4 + 3 * i, ignore_eos=True))
            for i in range(n)]


def test_graph_runner_replay_gives_the_unpadded_engines_tokens():
    plain, padded = _engine_pair()
    runner = padded.engine.runner
    assert runner.enable_decode_graphs(8, padded.engine.max_model_len, capture=False)
    graphs = runner.graph_runner
    seen = []
    load = graphs.load
    graphs.load = lambda inputs: seen.append((len(inputs.query_lens), load(inputs))) or seen[-1][1]
    assert run_engine(padded, _varying_batches()) == run_engine(plain, _varying_batches())
    assert {n for n, _ in seen} == set(range(1, 8))  # every decode batch size 1..7 went through the static buffers
    assert {(n, b) for n, b in seen} >= {(3, 4), (5, 8), (7, 8)}  # padded to the captured sizes
    assert graphs.num_eager == len(seen) and graphs.num_replays == 0


class CountingGraphRunner(MiniDecodeGraphRunner):
    loads = 0

    def load(self, inputs):
        type(self).loads += 1
        return super().load(inputs)


def test_graph_runner_cls_plugs_in_a_subclass_by_class_or_name():
    """The graph runner is an extension point (exercise 12): enable_decode_graphs builds the class it is given."""
    plain, _ = _engine_pair()
    reference = run_engine(plain, _varying_batches(4))
    kw = dict(block_size=4, num_blocks=200, max_num_seqs=8, device="cpu")
    for cls, built in ((CountingGraphRunner, CountingGraphRunner),
                       ("minivllm.cuda_graphs.MiniDecodeGraphRunner", MiniDecodeGraphRunner)):
        llm = LLM("tiny-random", graph_runner_cls=cls, **kw)
        assert llm.engine.runner.enable_decode_graphs(8, llm.engine.max_model_len, capture=False)
        assert type(llm.engine.runner.graph_runner) is built
        assert run_engine(llm, _varying_batches(4)) == reference
    assert CountingGraphRunner.loads > 0
    with pytest.raises(ValueError, match="graph_runner_cls"):
        LLM("tiny-random", graph_runner_cls="minivllm.cuda_graphs.NoSuchRunner", **kw)


def test_padded_rows_are_never_sampled_and_buffers_stay_in_place():
    _, llm = _engine_pair()
    runner = llm.engine.runner
    runner.enable_decode_graphs(8, llm.engine.max_model_len, capture=False)
    graphs = runner.graph_runner
    ptrs = [t.data_ptr() for t in (graphs.input_ids, graphs.positions, graphs.slot_mapping, graphs.context_lens,
                                   graphs.block_tables)]
    sampled = []
    sampler = runner.sampler
    runner.sampler = lambda logits, params, gens: sampled.append((logits.shape[0], len(params))) or sampler(
        logits, params, gens)
    run_engine(llm, _varying_batches(5))
    assert sampled and all(rows == seqs for rows, seqs in sampled)  # one logits row per real sequence, no padding
    assert [t.data_ptr() for t in (graphs.input_ids, graphs.positions, graphs.slot_mapping, graphs.context_lens,
                                   graphs.block_tables)] == ptrs


def test_a_replay_never_writes_a_slot_left_from_an_earlier_step(tiny):
    """The rule against freeing blocks out of step with graph slots: every replay rewrites all its rows' slots."""
    model, _ = tiny
    cache = MiniPagedKVCache.for_model(model, 16, 4)
    graphs = MiniDecodeGraphRunner(model, cache, 4, 4, 64, 2)

    def step(n, first_slot):
        return StepInputs([7] * n, [5] * n, [first_slot + 4 * i for i in range(n)], [[1 + i, 5 + i] for i in range(n)],
                          [6] * n, [1] * n, list(range(n)))

    graphs.run(step(4, 21))  # rows write slots 21, 25, 29, 33 (blocks 5..8)
    before = cache.k_slots.clone()
    graphs.run(step(3, 41))  # row 3 is padding now: its old slot 33 (a block since freed) must stay untouched
    assert graphs.slot_mapping[:4].tolist() == [41, 45, 49, -1]
    assert torch.equal(cache.k_slots[:, 33], before[:, 33])
    assert not torch.equal(cache.k_slots[:, 41], before[:, 41])


def test_graphs_refused_for_a_backend_that_does_not_skip_padding_slots():
    class ReadersCache(MiniPagedKVCache):
        def forward(self, layer, q, k, v, positions, batch):
            return super().forward(layer, q, k, v, positions, batch)

    llm = LLM("tiny-random", num_blocks=32, device="cpu", attention_backend=ReadersCache)
    assert not llm.engine.runner.enable_decode_graphs(4, 64, capture=False)
    assert llm.engine.runner.graph_runner is None


# -- the check command ----------------------------------------------------------------------------------

def test_check_gpu_without_a_gpu_says_so_and_exits_0(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "minivllm.check_gpu", "--out", str(out)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU" in proc.stdout
    report = json.loads(out.read_text())  # the report says so too, never left missing (or stale from a GPU run)
    assert report["gpu"] is None and report["parts"] == {} and "no CUDA GPU" in report["skipped"]


def test_check_gpu_parts_are_isolated_and_summarised():
    from minivllm import check_gpu

    failed = check_gpu.run_part("notebooks", lambda: 1 / 0)
    assert failed["ok"] is False and failed["error"].startswith("ZeroDivisionError")
    fine = check_gpu.run_part("notebooks", lambda: {"ok": True, "passed": 3, "failed": 0, "failed_notebooks": []})
    table = check_gpu.summary_table({"parts": {"notebooks": failed, "hf_fp32": fine | {"identical": 16, "prompts": 16,
                                                                                         "dtype": "fp32", "differences": []}}})
    assert "FAILED" in table and "ZeroDivisionError" in table and "16/16 identical" in table
    with pytest.raises(SystemExit):
        check_gpu.main(["--parts", "hf_fp32,nope"])


def test_check_gpu_counts_notebook_cells_that_pass_and_fail(tmp_path):
    import nbformat

    from minivllm import check_gpu

    for name, code in (("good", "assert 1 + 1 == 2"), ("bad", "assert 1 + 1 == 3")):
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell(code)])
        nbformat.write(nb, tmp_path / f"{name}.ipynb")
    result = check_gpu.run_notebooks(timeout_s=300, book=tmp_path)
    assert (result["passed"], result["failed"], result["ok"]) == (3, 1, False), result
    assert result["failed_notebooks"] == [str(tmp_path / "bad.ipynb")] or result["failed_notebooks"][0].endswith("bad.ipynb")


def test_check_gpus_padding_part_passes_the_real_runner_and_catches_a_stale_padding_slot(monkeypatch):
    """The ``padding`` part, run as the eager replay: the real runner writes only its rows' slots; a runner whose
    padding row keeps the slot of the step before (the bug the part is there to catch) fails it."""
    from minivllm import check_gpu

    good = check_gpu.check_padding("tiny-random", device="cpu")
    assert good["ok"] and set(good["slots_written"]) - {good["scratch_slot"]} == {41, 45, 49}, good
    stale = {}
    load = MiniDecodeGraphRunner.load

    def keeps_old_slots(self, inputs):  # padding rows keep the previous step's slots instead of -1
        b, n = load(self, inputs), len(inputs.query_lens)
        if "slots" in stale:
            self.slot_mapping[n:b] = torch.tensor(stale["slots"][n:b])
        stale["slots"] = self.slot_mapping[:b].tolist()
        return b

    monkeypatch.setattr(MiniDecodeGraphRunner, "load", keeps_old_slots)
    bad = check_gpu.check_padding("tiny-random", device="cpu")
    assert not bad["ok"] and 33 in bad["slots_written"], bad


def test_a_backend_that_cannot_be_captured_decodes_eagerly_with_a_warning_naming_it(monkeypatch):
    """A reader's backend that indexes with a boolean mask cannot be captured into a CUDA graph (exercise 05's first
    solution could not, on an H200): the runner keeps no graph, warns with the backend's name, and decodes eagerly."""
    reference = run_engine(_engine_pair()[0], _varying_batches(4))
    stream = object()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
    restored = []
    monkeypatch.setattr(torch.cuda, "set_stream", restored.append)

    def fails(self):
        self.graphs[8] = "half-recorded"
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(MiniDecodeGraphRunner, "_record_graphs", fails)
    llm = LLM("tiny-random", block_size=4, num_blocks=200, max_num_seqs=8, device="cpu")
    with pytest.warns(RuntimeWarning, match="capture failed with the attention backend MiniPagedKVCache .*"
                                            "operation not permitted when stream is capturing.*run eagerly"):
        assert llm.engine.runner.enable_decode_graphs(8, llm.engine.max_model_len, capture=True)
    graphs = llm.engine.runner.graph_runner
    assert graphs.graphs == {} and restored == [stream] and llm.engine.stats().cuda_graph_sizes == ()
    assert run_engine(llm, _varying_batches(4)) == reference and graphs.num_replays == 0 and graphs.num_eager > 0
