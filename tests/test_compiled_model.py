"""The whole forward as one compiled graph (compile_model, chapter 12): the eager engine's tokens with chunked
prefill, prefix caching, batches of one and many and speculative decoding; attention and the packed matmuls called
as opaque ops; one graph per token-count kind; the eager fallback; the config's refusals."""

import pytest
import torch

from minivllm import LLM, EngineConfig
from minivllm.attention import OpaqueAttention, attention_op, forward_context
from minivllm.compiled_model import CompiledModel
from minivllm.models import llama

from helpers import greedy, run_engine

OPTIONS = dict(num_blocks=48, block_size=4, enable_chunked_prefill=True, max_prefill_chunk_size=7,
               max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)
PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 30, 1, 12)] + [list(range(5, 25))]  # the last shares a prefix


def requests():
    return [(f"r{i}", p, greedy(6 + i, ignore_eos=True)) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def compiled():
    return LLM("tiny-random", compile_model=True, **OPTIONS)


def test_compiled_forward_gives_the_eager_tokens_and_reports_its_graphs(compiled):
    eager = run_engine(LLM("tiny-random", **OPTIONS), requests())
    got = run_engine(compiled, requests())  # chunks of up to 7 tokens, decode batches of 1 to 4 rows, prefix hits
    assert got == eager
    stats = compiled.engine.stats()
    assert stats.model_compiled and stats.model_compile_seconds > 0
    assert compiled.engine.runner.compiled_model.shapes == {"1 token", "2+ tokens"}
    assert stats.prefix_cache_hits > 0


def test_a_lone_decode_row_runs_the_one_token_graph(compiled):
    """Batch 1: a single sequence's decode steps have one token (the graph Dynamo specialises for size 1)."""
    eager = LLM("tiny-random", **OPTIONS).generate([PROMPTS[1]], greedy(9, ignore_eos=True), use_tqdm=False)
    got = compiled.generate([PROMPTS[1]], greedy(9, ignore_eos=True), use_tqdm=False)
    assert got[0].outputs[0].token_ids == eager[0].outputs[0].token_ids


def test_attention_and_packed_matmuls_are_opaque_ops_of_the_graph(compiled):
    """Each forward of the compiled graph calls minivllm::attention once per layer and minivllm::packed_matmul for
    each packed projection of each layer (q/k/v fused, o, gate/up fused, down): the eager code runs inside them."""
    from torch.profiler import profile

    model = compiled.engine.runner.model
    assert model.lm_head.packed is not None, "tiny-random is packed on this CPU"
    layers = len(model.model.layers)
    with profile() as prof:
        compiled.generate([list(range(200, 230))], greedy(3, ignore_eos=True), use_tqdm=False)  # no cached prefix
    counts = {e.key: e.count for e in prof.key_averages()}
    forwards = 5 + 2  # 30 prompt tokens in chunks of 7, then two decode steps (the third token comes from the last chunk)
    assert counts.get("minivllm::attention") == forwards * layers
    assert counts.get("minivllm::packed_matmul") == forwards * layers * 4


def test_the_attention_op_reads_the_forward_context():
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)

    class Recorder:
        def forward(self, layer, q_, k_, v_, positions, batch):
            self.seen = (layer, positions.tolist(), batch)
            return (2 * q_.transpose(0, 1)).transpose(0, 1)  # a strided result: the op hands back a contiguous one

    kv = Recorder()
    with forward_context(kv, "the batch"):
        out = OpaqueAttention().forward(5, q, k, v, torch.tensor([7, 8, 9]))
    assert kv.seen == (5, [7, 8, 9], "the batch") and torch.equal(out, 2 * q) and out.is_contiguous()
    with pytest.raises(TypeError):  # outside a compiled step's context there is nothing to attend with
        attention_op(q, k, v, torch.tensor([0, 1, 2]), 0)


def test_a_failed_compile_falls_back_to_the_eager_forward(tiny, monkeypatch):
    model, _ = tiny
    wrapped = CompiledModel(model)

    def broken(*args):
        raise RuntimeError("no C++ compiler here\nmore lines")

    monkeypatch.setattr(wrapped, "fn", broken)
    ids, positions = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    from minivllm.attention import NoCache

    with torch.inference_mode():
        got = wrapped(ids, positions, NoCache())
        expected = model.forward(ids, positions, NoCache())
    assert torch.equal(got, expected)
    assert not wrapped.active and wrapped.error == "RuntimeError: no C++ compiler here"
    assert wrapped.compile_seconds == 0.0 and wrapped.shapes == set()


def test_speculative_verification_runs_through_the_compiled_graph(compiled):
    """Chapter 17: a drafted row is a chunk of 1 + d tokens, which the 2+ token graph takes as it takes a prefill."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    prompt = [3] * 10  # tiny-random's 12th token repeats its 9th: prompt lookup drafts from there
    eager = LLM("tiny-random", num_blocks=48, block_size=4).generate([prompt], greedy(20, ignore_eos=True),
                                                                     use_tqdm=False)
    fast = LLM("tiny-random", num_blocks=48, block_size=4, compile_model=True, speculative_config=spec)
    got = fast.generate([prompt], greedy(20, ignore_eos=True), use_tqdm=False)
    assert got[0].outputs[0].token_ids == eager[0].outputs[0].token_ids
    assert fast.engine.stats().spec_decode_num_drafts > 0 and fast.engine.stats().model_compiled


@pytest.mark.parametrize("options, match", [
    (dict(compile_model="yes"), "compile_model.*True or False"),
    (dict(compile_model=True, tensor_parallel_size=3), "compile_model.*tensor_parallel_size > 1"),
    (dict(compile_model=True, device="cuda"), "compile_model.*False on cuda"),
])
def test_config_refuses_what_compile_model_cannot_run(options, match, monkeypatch):
    monkeypatch.setattr("minivllm.config.available_devices", lambda: ("cpu", "cuda"))  # as on a GPU machine
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="tiny-random", **options)


def test_packed_linears_are_registered_for_the_op(tiny):
    model, _ = tiny
    layer = model.model.layers[0]
    for m in (layer.self_attn.fused_qkv, layer.self_attn.o_proj, layer.mlp.fused_gate_up, layer.mlp.down_proj,
              model.lm_head):
        assert llama._PACKED_MATMULS[m.key] is m
    x = torch.randn(5, layer.self_attn.o_proj.in_features)
    assert torch.equal(llama.packed_matmul(x, layer.self_attn.o_proj.key), layer.self_attn.o_proj.eager(x))
