"""A few-row decode step's layers in one native call equal the op-by-op path bit for bit (issue 69 item 3, chapter 18).

``mv_decode_step`` (csrc/layer.h) calls the kernels the op table calls one by
one from Python, with the same arguments: so the hidden states it returns, and
the keys and values it writes, are the same bits, for float32 weights and the
GGUF's with 8-bit or float32 activations, at 1, 3 and 8 rows over ragged
context lengths and scattered blocks; whole greedy generations are the same
with it on and off; bad input is a ValueError before any memory is written.
"""

import pytest
import torch

from minivllm import LLM, SamplingParams, kernels
from minivllm.attention import MiniPagedKVCache, PagedBatch
from minivllm.config import EngineConfig
from minivllm.kernels.fused import DecodeStep
from minivllm.models import load_model

WEIGHTS = {"float32": {}, "gguf int8": {"quantization": "gguf", "gguf_activations": "int8"},
           "gguf float32": {"quantization": "gguf", "gguf_activations": "float32"}}
BLOCK = 16


@pytest.fixture(autouse=True)
def cpu_table():
    if kernels.cpu_table() is None:
        pytest.skip("no C++ kernels here (no compiler): the op-by-op reference path is the only one")


def ragged_step(model, rows: int, seed: int):
    """A decode step of ``rows`` sequences of ragged lengths whose blocks are scattered over the pool, pools of
    random keys and values, and the step's token ids."""
    g = torch.Generator().manual_seed(seed)
    lens = [int(n) for n in torch.randint(1, 70, (rows,), generator=g)]
    if rows > 1:
        lens[-1] = 1  # a sequence's first token: it sees its own key only
    order = torch.randperm(64, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        blocks = -(-n // BLOCK)
        tables.append(order[used:used + blocks])
        used += blocks
    kv = MiniPagedKVCache.for_model(model, 64, BLOCK)
    kv.k_slots.copy_(torch.randn(kv.k_slots.shape, generator=g))
    kv.v_slots.copy_(torch.randn(kv.v_slots.shape, generator=g))
    batch = PagedBatch(tables, lens, [1] * rows, BLOCK, "cpu", model.config.num_attention_heads
                       // model.config.num_key_value_heads)
    ids = torch.randint(0, model.config.vocab_size, (rows,), generator=g)
    return kv, batch, ids, torch.tensor([n - 1 for n in lens])


def run(model, kv, batch, ids, positions, fused: bool):
    """The step's final hidden states and what the pools hold after it, with the fused path on or off, and the
    profiler's names of the native ops it called."""
    kv.fused_decode = fused
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        hidden = model.forward(ids, positions, kv, batch)
    names = {e.name for e in prof.events() if e.name.startswith("minivllm::")}
    return hidden, kv.k_slots.clone(), kv.v_slots.clone(), names


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_the_fused_step_equals_the_op_by_op_path_bit_for_bit(weights, rows):
    model, _ = load_model("smollm2-135m", "cpu", kernels="cpu", **WEIGHTS[weights])
    plan = model.decode_step_plan()
    assert isinstance(plan, DecodeStep) and plan.max_rows == 8
    step = ragged_step(model, rows, seed=rows)
    fused = run(model, *step, fused=True)
    step = ragged_step(model, rows, seed=rows)  # the same pools and step afresh
    op_by_op = run(model, *step, fused=False)
    assert fused[3] == {"minivllm::decode_step"}, fused[3]  # one native call, under one name
    assert "minivllm::decode_step" not in op_by_op[3] and "minivllm::paged_attention" in op_by_op[3]
    for got, want, what in zip(fused[:3], op_by_op[:3], ("hidden states", "keys", "values")):
        assert torch.equal(got, want), f"{weights}, {rows} rows: the fused step's {what} differ"


def test_steps_the_fused_call_does_not_take_run_op_by_op():
    """Nine rows (past the rule's eight), a prefill, the reference table: the op-by-op path."""
    model, _ = load_model("smollm2-135m", "cpu", kernels="cpu")
    kv, batch, ids, positions = ragged_step(model, 8, seed=0)
    assert run(model, kv, batch, ids, positions, fused=True)[3] == {"minivllm::decode_step"}
    nine = PagedBatch([[i] for i in range(9)], [3] * 9, [1] * 9, BLOCK, "cpu", 3)
    assert "minivllm::decode_step" not in run(model, kv, nine, torch.arange(9), torch.full((9,), 2), True)[3]
    prefill = PagedBatch([[0]], [4], [4], BLOCK, "cpu", 3)
    assert "minivllm::decode_step" not in run(model, kv, prefill, torch.arange(4), torch.arange(4), True)[3]
    reference, _ = load_model("smollm2-135m", "cpu", kernels="reference")
    assert reference.decode_step_plan() is False
    kv = MiniPagedKVCache.for_model(reference, 8, BLOCK)
    assert not reference.fused_decode_path(kv)


def test_bad_input_is_a_value_error_naming_it_before_anything_is_written():
    model, _ = load_model("smollm2-135m", "cpu", kernels="cpu")
    plan = model.decode_step_plan()
    kv, batch, ids, positions = ragged_step(model, 3, seed=5)
    x = model.model.embed_tokens(ids)
    args = dict(x=x, positions=positions, slot_mapping=batch.slot_mapping, block_table=batch.block_table,
                context_lens=batch.context_lens, cu_seq_q=batch.cu_seq_q, k_slots=kv.k_slots, v_slots=kv.v_slots,
                block_size=BLOCK)
    snapshot = [t.clone() for t in (x, kv.k_slots, kv.v_slots)]
    far = kv.k_slots.shape[1]
    hostile = {
        "positions": ("positions", positions + 10**6),
        "slot_mapping": ("slot_mapping", torch.tensor([0, far, 1])),
        "block_table": ("block_table", batch.block_table.masked_fill(batch.block_table >= 0, 10**6)),
        "context_lens": ("seq_lens", torch.tensor([1, 10**6, 2], dtype=torch.int32)),
        "cu_seq_q": ("query_start", torch.tensor([0, 2, 2, 3], dtype=torch.int32)),
        "x": ("x", torch.zeros(3, 5)),
        "k_slots": ("k_slots", kv.k_slots[:, :, :1]),
        "block_size": ("block_size", 0),
    }
    for name, (message, value) in hostile.items():
        with pytest.raises(ValueError, match=message):
            plan(**(args | {name: value}))
        assert all(torch.equal(a, b) for a, b in zip(snapshot, (x, kv.k_slots, kv.v_slots))), name
    with pytest.raises(ValueError, match="max_rows"):
        DecodeStep(model.ops, [{}], model.model.norm.weight, model.model.rotary.cos, model.model.rotary.sin, 1e-5,
                   9, 3, 64, 1536, max_rows=9)
    with pytest.raises(ValueError, match="fused_decode"):
        EngineConfig(model="tiny-random", fused_decode="yes")


@pytest.mark.parametrize("weights", ["float32", "gguf int8"])
def test_whole_greedy_generations_are_the_same_with_the_fused_path_on_and_off(weights, monkeypatch):
    calls = []
    step = DecodeStep.__call__
    monkeypatch.setattr(DecodeStep, "__call__", lambda self, *a, **k: calls.append(a[0].shape[0]) or step(self, *a, **k))
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for fused in (True, False):
        llm = LLM("smollm2-135m", kernels="cpu", fused_decode=fused, num_blocks=64, **WEIGHTS[weights])
        assert llm.engine.stats().decode_path == ("fused-step" if fused else "op-by-op")
        tokens[fused] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if fused:
            assert 3 in calls and len(calls) >= 11  # the decode steps of three rows went through it
            calls.clear()
    assert not calls
    assert tokens[True] == tokens[False]
