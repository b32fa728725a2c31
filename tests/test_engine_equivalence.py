"""Greedy output of the paged engine equals HF transformers generate, token for token."""

import pytest

from minivllm import LLM

from helpers import greedy, hf_greedy, mixed_prompts

MAX_NEW = {"smollm2-135m": 12, "tiny-random": 24}


@pytest.fixture(scope="module")
def references(hf_models):
    """Per model: the 16 mixed-length prompts and HF's one-at-a-time greedy outputs."""
    from minivllm import load_tokenizer

    cache = {}

    def get(name):
        if name not in cache:
            tok = load_tokenizer(name)
            prompts = mixed_prompts(tok)
            hf = hf_models(name)
            cache[name] = (prompts, [hf_greedy(hf, p, MAX_NEW[name], tok.eos_token_id) for p in prompts])
        return cache[name]

    return get


# Every block size on the tiny model; SmolLM2 at a block of one token and at the engine's default of 16 (its 32
# would run the same paging code as the tiny model's on the same prompts, 5 s more).
@pytest.mark.parametrize("block_size, name", [(b, n) for b in (1, 16, 32) for n in ("tiny-random", "smollm2-135m")
                                              if (b, n) != (32, "smollm2-135m")])
def test_generate_matches_transformers(name, block_size, references):
    prompts, expected = references(name)
    assert max(len(p) for p in prompts) > 300 and min(len(p) for p in prompts) < 60
    llm = LLM(name, block_size=block_size, num_blocks=-(-12000 // block_size), max_num_seqs=5,
              max_num_batched_tokens=1024, device="cpu")
    outs = llm.generate(prompts, greedy(MAX_NEW[name]), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens)"
    assert llm.engine.stats().num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("options", [
    dict(enable_chunked_prefill=True, max_prefill_chunk_size=100, block_size=16),
    dict(enable_chunked_prefill=True, max_prefill_chunk_size=7, block_size=4),
    dict(enable_prefix_caching=True, block_size=16),
    dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_prefill_chunk_size=33, block_size=8),
])
def test_optimisations_keep_smollm2_output(options, references):
    """Chunked prefill and prefix caching, alone and together, leave greedy output unchanged."""
    prompts, expected = references("smollm2-135m")
    llm = LLM("smollm2-135m", num_blocks=1000, max_num_seqs=6, max_num_batched_tokens=768, device="cpu", **options)
    # with prefix caching twice: the second pass hits the prefix cache (without, it would repeat the first)
    for _ in range(2 if options.get("enable_prefix_caching") else 1):
        outs = llm.generate(prompts[:8], greedy(MAX_NEW["smollm2-135m"]), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected[:8]
    if options.get("enable_prefix_caching"):
        assert llm.engine.stats().prefix_cache_hit_rate > 0.4


@pytest.mark.parametrize("options", [
    dict(enable_chunked_prefill=True, max_prefill_chunk_size=33, block_size=16, enable_prefix_caching=True),
    dict(num_blocks=110, block_size=4, preemption_mode="swap"),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                             "prompt_lookup_max": 4}),
], ids=["chunked+prefix", "swap", "speculative"])
def test_gguf_weights_keep_smollm2_output(options, references):
    """quantization='gguf' with float32 activations (the GGUF's 4-bit blocks read as stored by the C++ kernels for
    rows of up to eight tokens: decode and verified drafts) gives HF's greedy tokens, with chunked prefill and prefix
    caching, preemption and speculation. The float32 kernels: the tests above (kernels='auto'). The default 8-bit
    activations are not HF-exact: tests/test_int8_activations.py."""
    from minivllm import kernels

    if kernels.cpu_table() is None:
        pytest.skip("quantization='gguf' runs the C++ kernels, which do not build here")
    prompts, expected = references("smollm2-135m")
    options = {"num_blocks": 1000, **options}
    llm = LLM("smollm2-135m", max_num_seqs=6, max_num_batched_tokens=768, device="cpu", quantization="gguf",
              gguf_activations="float32", **options)
    outs = llm.generate(prompts[:6], greedy(MAX_NEW["smollm2-135m"]), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[:6]
    stats = llm.engine.stats()
    assert (stats.kernels, stats.quantization, stats.gguf_dot) == ("cpu", "gguf", "float32")
    if options["num_blocks"] == 110:
        assert stats.num_preemptions > 0
