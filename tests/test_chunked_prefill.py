"""Chunked prefill and prefix caching leave greedy output unchanged (tiny model; SmolLM2 in test_engine_equivalence)."""

import random

import pytest
import torch

from minivllm import LLM

from helpers import greedy


def prompts_around(chunk, block_size, seed=0):
    """Shorter than a chunk, equal to it, one over, several chunks, and boundaries inside blocks."""
    rng = random.Random(seed)
    lengths = [max(1, chunk - 1), chunk, chunk + 1, 3 * chunk + 5, block_size + 3, 2 * block_size]
    return [[rng.randrange(1, 49152) for _ in range(n)] for n in lengths]


def outputs(prompts, **options):
    llm = LLM("tiny-random", num_blocks=512, max_num_seqs=3, max_num_batched_tokens=512, device="cpu", **options)
    out = llm.generate(prompts, greedy(10), use_tqdm=False)
    return [o.outputs[0].token_ids for o in out], llm


@pytest.mark.parametrize("chunk,block_size", [(16, 16), (100, 16), (7, 16), (5, 4), (33, 8), (1, 4)])
def test_chunked_equals_whole_prefill(chunk, block_size):
    prompts = prompts_around(chunk, block_size)
    whole, _ = outputs(prompts, block_size=block_size)
    chunked, llm = outputs(prompts, block_size=block_size, enable_chunked_prefill=True, max_prefill_chunk_size=chunk)
    assert chunked == whole
    assert llm.engine.num_steps > len(whole[0])  # it really ran in more steps


def test_run_prefill_chunk_is_the_batched_path():
    """ModelRunner.run_prefill_chunk over chunks [0,3), [3,6), [6,7) gives the full prefill's first token."""
    llm = LLM("tiny-random", block_size=4, num_blocks=32, device="cpu")
    engine = llm.engine
    prompt = [11, 22, 33, 44, 55, 66, 77]
    seq = engine.add_request("r", prompt, greedy(1))
    engine.scheduler.waiting.remove(seq)  # drive the runner by hand
    engine.block_manager.allocate(seq, len(prompt))
    results = []
    for a, b in [(0, 3), (3, 6), (6, 7)]:
        results.append(engine.runner.run_prefill_chunk(seq, prompt[a:b], a))
        seq.cached_token_count = b
    assert results[:2] == [None, None]
    full = engine.model.logits(prompt)[-1].argmax().item()
    assert results[2] == full
    with pytest.raises(ValueError, match="chunk_token_ids"):
        engine.runner.run_prefill_chunk(seq, [1, 2], 0)
    engine.block_manager.free(seq)
    del engine.requests["r"]


def test_prefix_caching_equals_no_caching_with_shared_prefixes():
    rng = random.Random(1)
    system = [rng.randrange(1, 49152) for _ in range(45)]
    prompts = [system + [rng.randrange(1, 49152) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    prompts += [system[:16], system[:17], system]  # exactly on and around block boundaries
    plain, _ = outputs(prompts, block_size=8)
    for chunking in (False, True):
        cached, llm = outputs(prompts, block_size=8, enable_prefix_caching=True,
                              enable_chunked_prefill=chunking, max_prefill_chunk_size=12)
        assert cached == plain
        assert llm.engine.stats().prefix_cache_hit_rate > 0.3
        again = llm.generate(prompts, greedy(10), use_tqdm=False)  # now everything but the last token is cached
        assert [o.outputs[0].token_ids for o in again] == plain
        assert all(o.metrics.num_cached_tokens >= (len(p) - 1) // 8 * 8 for o, p in zip(again, prompts))


def test_same_new_prefix_in_one_step_does_not_corrupt():
    prompt = list(range(100, 140))
    alone, _ = outputs([prompt], block_size=4)
    both, llm = outputs([prompt, prompt, prompt + [7]], block_size=4, enable_prefix_caching=True)
    assert both[0] == both[1] == alone[0]
    llm.engine.check_invariants()


def test_prefix_cache_metrics_and_aborting_a_prefilling_request():
    llm = LLM("tiny-random", block_size=4, num_blocks=64, enable_chunked_prefill=True, max_prefill_chunk_size=4,
              enable_prefix_caching=True, device="cpu")
    e = llm.engine
    e.add_request("a", list(range(1, 30)), greedy(2))
    e.step()
    assert e.requests["a"].seqs[0].status.name == "PREFILLING" and e.requests["a"].seqs[0].metrics.num_prefilled_tokens == 4
    e.abort_request("a")
    e.check_invariants()
    assert e.block_manager.num_free_blocks == 64
    assert torch.is_tensor(e.runner.kv_cache.k)
