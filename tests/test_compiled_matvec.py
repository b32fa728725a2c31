"""One- and two-row matmuls through a compiled matrix-vector kernel (chapter 12, issue 31): the engine's tokens with
``compile_matvec`` on and off, what it reports, its checks, and the op breakdown that files its kernels as matmuls.
The model-level rule and fallbacks are in ``test_models.py``."""

import pytest

from minivllm import LLM, EngineConfig
from minivllm.models.llama import MATVEC_MAX_ROWS

from helpers import greedy, mixed_prompts, run_engine


def test_engine_tokens_are_the_same_with_compile_matvec_on_and_off():
    """Rows of one and two (the tail of a batch, and batch-1 decoding) through the compiled kernel, more rows
    through the layouts as before: the same greedy tokens, and stats say how many rows the kernel took."""
    from minivllm import load_tokenizer

    prompts = mixed_prompts(load_tokenizer("tiny-random"), n=4)
    requests = [(f"r{i}", p, greedy(6 + 5 * i, ignore_eos=True)) for i, p in enumerate(prompts)]
    tokens, stats = {}, {}
    for on in (False, True):  # lengths 6..21: the batch shrinks from four rows to one as requests finish
        llm = LLM("tiny-random", num_blocks=64, compile_matvec=on)
        tokens[on], stats[on] = run_engine(llm, requests), llm.engine.stats()
        assert (llm.engine.model.matvec is not None) == on
    assert tokens[True] == tokens[False]
    assert stats[False].matvec_rows == 0 and stats[False].matvec_compile_seconds == 0
    assert stats[True].matvec_rows == MATVEC_MAX_ROWS and stats[True].matvec_compile_seconds > 0


def test_compile_matvec_is_checked():
    with pytest.raises(ValueError, match="compile_matvec must be True or False"):
        EngineConfig(compile_matvec=1)
    with pytest.raises(ValueError, match="compile_matvec must be False with tensor_parallel_size > 1"):
        EngineConfig(compile_matvec=True, tensor_parallel_size=2)


@pytest.mark.parametrize("argv,words", [
    (["--server", "http://127.0.0.1:1", "--workload", "online"], "not with --server"),
    (["--workload", "offline", "--tensor-parallel-size", "2"], "not with --tensor-parallel-size > 1"),
])
def test_bench_refuses_compile_matvec_where_it_cannot_apply(capsys, argv, words):
    from minivllm.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--model", "tiny-random", *argv, "--compile-matvec"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --compile-matvec" in err and words in err


def test_decode_op_breakdown_files_the_compiled_matvec_under_matmuls():
    """At batch 1 every matmul runs the compiled kernel: the breakdown counts its time as matmuls, not as the
    compiled attention's (both are compiled graphs)."""
    from minivllm.bench import decode_op_breakdown

    llm = LLM("tiny-random", num_blocks=32, compile_matvec=True)
    row = decode_op_breakdown(llm, 1, prompt_len=8, steps=2)
    assert row["matmuls"] > 0 and row["attention"] < row["matmuls"]
    assert llm.engine.stats().num_running == 0  # the breakdown's requests are gone


def test_decode_only_steps_run_each_layer_whole_with_its_paged_attention():
    """compile_matvec: a decode-only step of one or two rows runs each layer as one compiled call, its paged
    attention (write_and_attend) inside, never the halves (those are for one- or two-row steps with a prefill,
    none here; test_models covers them). The tokens equal the eager engine's."""
    from minivllm import load_tokenizer

    prompts = mixed_prompts(load_tokenizer("tiny-random"), n=3)
    requests = [(f"r{i}", p, greedy(5 + 6 * i, ignore_eos=True)) for i, p in enumerate(prompts)]
    want = run_engine(LLM("tiny-random", num_blocks=64), requests)
    llm = LLM("tiny-random", num_blocks=64, compile_matvec=True)
    model = llm.engine.model
    compiled = model.compiled_layers
    assert compiled is not None and compiled.step is not None
    steps, halves = [], []
    real_step, real_before = compiled.step.fn, compiled.before.fn
    compiled.step.fn = lambda layer, x, *a: steps.append(x.shape[0]) or real_step(layer, x, *a)
    compiled.before.fn = lambda layer, x, *a: halves.append(x.shape[0]) or real_before(layer, x, *a)
    try:
        got = run_engine(llm, requests)
    finally:
        compiled.step.fn, compiled.before.fn = real_step, real_before
    assert got == want
    layers = len(model.model.layers)
    assert set(steps) == {1, 2} and len(steps) % layers == 0  # the batch shrinks from three rows to one
    assert halves == []  # the halves are for steps of one or two rows with a prefill: none here
    assert compiled.step.shapes == {(1, 16, True), (2, 16, True)}  # one compile per row count, any context


def test_a_readers_kv_cache_keeps_its_own_attention_under_compile_matvec():
    """A MiniPagedKVCache subclass with its own forward (exercise 05's backend) is never bypassed by the whole-layer
    step: its forward runs for every layer of every step, and the tokens are the eager engine's."""
    from minivllm import load_tokenizer
    from minivllm.attention import MiniPagedKVCache

    seen = []

    class ReadersCache(MiniPagedKVCache):
        def forward(self, layer, q, k, v, positions, batch):
            seen.append(q.shape[0])
            return super().forward(layer, q, k, v, positions, batch)

        forward.skips_padding_slots = True

    prompts = mixed_prompts(load_tokenizer("tiny-random"), n=2)
    requests = [(f"r{i}", p, greedy(6, ignore_eos=True)) for i, p in enumerate(prompts)]
    want = run_engine(LLM("tiny-random", num_blocks=64), requests)
    llm = LLM("tiny-random", num_blocks=64, compile_matvec=True, attention_backend=ReadersCache)
    assert llm.engine.model.compiled_layers.step is not None
    assert run_engine(llm, requests) == want
    assert 2 in seen and len(seen) % len(llm.engine.model.model.layers) == 0  # its decode steps too


def test_a_whole_layer_step_that_disagrees_is_dropped_for_the_halves(monkeypatch):
    """compile_matvec checks the whole-layer step against the eager one on a small pool; one that computes
    something else is dropped (step None) and the halves stay on every layer."""
    from minivllm.models import llama, load_model

    class WrongStep(llama.CompiledLayer):
        def __init__(self):
            super().__init__()
            self.step = llama.CountedCompile(lambda layer, x, *a: 2 * llama.DecoderLayer.decode_step(layer, x, *a),
                                             lambda args: (args[1].shape[0], args[-1]))

    monkeypatch.setattr(llama, "CompiledLayer", WrongStep)
    model, _ = load_model("tiny-random", "cpu", pack_weights=False)
    try:
        assert model.compile_matvec() == 2
        assert isinstance(model.compiled_layers, WrongStep) and model.compiled_layers.step is None
        assert all(layer.compiled is model.compiled_layers for layer in model.model.layers)
    finally:
        model.compile_matvec(max_rows=0)
