"""The CPU offload tier of the prefix cache (chapter 14): exact outputs, real restores, LRU, atomicity, bad config."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.block_manager import MiniBlockManager
from minivllm.config import EngineConfig
from minivllm.exercises.live import chat_prompts
from minivllm.kv_tier import MiniOffloadTier
from minivllm.sequence import Sequence

from helpers import greedy, run_engine


def run_all(llm, requests):
    """Every sample's tokens by id (invariants after every step, no block leaked) and the engine's stats."""
    return run_engine(llm, requests, all_samples=True), llm.engine.stats()


def two_rounds(prompts, params, again=None):
    """Every prompt, then the first ``again`` (default all) once more: by then the pool has evicted most of them."""
    rounds = (prompts, prompts[:again] if again else prompts)
    return [(f"{r}-{i}", p, params) for r, ps in enumerate(rounds) for i, p in enumerate(ps)]


def computed_prefill(stats) -> int:
    return stats.prefix_cache_queries - stats.prefix_cache_hits


# SmolLM2 kept short on a 2-core CPU: 3 output tokens, and only the first 6 prompts (2 long ones) asked again.
@pytest.mark.parametrize("model,max_tokens,num_blocks,again", [("tiny-random", 8, 48, None), ("smollm2-135m", 3, 40, 6)])
def test_tier_on_off_token_identical_and_restores(model, max_tokens, num_blocks, again):
    kw = dict(block_size=16, num_blocks=num_blocks, enable_prefix_caching=True, max_num_seqs=4)
    off = LLM(model, **kw)
    prompts = chat_prompts(off.get_tokenizer(), 16)
    assert sum(map(len, prompts)) > 2 * num_blocks * 16, "each round must overflow the pool twice"
    requests = two_rounds(prompts, greedy(max_tokens, ignore_eos=True), again)
    outs_off, stats_off = run_all(off, requests)
    on = LLM(model, kv_offload_blocks=256, **kw)
    outs_on, stats_on = run_all(on, requests)
    assert outs_on == outs_off
    assert stats_on.num_offloaded_blocks > 0 and stats_on.num_restored_blocks > 0
    assert stats_on.num_restored_bytes == stats_on.num_restored_blocks * on.engine.kv_bytes_per_block
    assert stats_on.prefix_cache_tier_hits == stats_on.num_restored_blocks * 16
    assert stats_on.prefix_cache_device_hits + stats_on.prefix_cache_tier_hits == stats_on.prefix_cache_hits
    assert computed_prefill(stats_on) < computed_prefill(stats_off)
    assert stats_off.num_restored_blocks == 0 and stats_off.num_total_tier_blocks == 0


def test_restored_blocks_rejoin_the_device_cache():
    """A long prompt evicted, offloaded, then asked again: its blocks come back from the tier, not recomputed."""
    llm = LLM("tiny-random", block_size=16, num_blocks=24, enable_prefix_caching=True, kv_offload_blocks=64)
    long_prompt = list(range(100, 100 + 16 * 10 + 5))  # 10 full blocks, then 5 tokens
    filler = [list(range(2000 + 300 * i, 2000 + 300 * i + 16 * 20)) for i in range(2)]
    requests = [("a", long_prompt, greedy(2, ignore_eos=True))]
    requests += [(f"f{i}", p, greedy(2, ignore_eos=True)) for i, p in enumerate(filler)]
    run_all(llm, requests)
    stats = llm.engine.stats()
    assert stats.num_offloaded_blocks >= 10
    before = stats.num_restored_blocks
    outs, stats = run_all(llm, [("a2", long_prompt, greedy(2, ignore_eos=True))])
    assert stats.num_restored_blocks - before == 10  # every full block before the last token
    # Now it is on the device again: a third ask hits there, and the tier is not read.
    _, again = run_all(llm, [("a3", long_prompt, greedy(2, ignore_eos=True))])
    assert again.num_restored_blocks == stats.num_restored_blocks
    assert again.prefix_cache_hits - stats.prefix_cache_hits == 10 * 16


def test_tier_with_swap_preemption_and_forks_is_exact():
    kw = dict(block_size=16, num_blocks=40, enable_prefix_caching=True, max_num_seqs=6, preemption_mode="swap",
              num_cpu_blocks=64)
    off = LLM("tiny-random", **kw)
    prompts = chat_prompts(off.get_tokenizer(), 8)
    params = greedy(16, n=2, ignore_eos=True)  # forks share the prompt blocks (greedy: sampling is slow here)
    requests = two_rounds(prompts, params)
    outs_off, stats_off = run_all(off, requests)
    outs_on, stats_on = run_all(LLM("tiny-random", kv_offload_blocks=128, **kw), requests)
    assert stats_on.num_preemptions > 0, "the pool must be small enough to preempt"
    assert stats_on.num_restored_blocks > 0
    assert outs_on == outs_off


# -- the tier's own bookkeeping, without a model ---------------------------------------------------
def test_tier_lru_drop_and_pins():
    tier = MiniOffloadTier(2)
    a, b, c = (1,) * 4, (2,) * 4, (3,) * 4
    assert tier.put(10, a) == 0 and tier.put(20, b) == 1
    assert tier.put(10, a) is None  # already there: a touch, no copy
    assert tier.put(30, c) == 1  # full: the least recently used (20) is dropped, its slot reused
    assert tier.find(20, b) is None and tier.find(10, a) is not None and tier.num_dropped == 1
    assert tier.find(10, (9,) * 4) is None  # same hash, other tokens: never served
    tier.restore(10)
    tier.restore(30)  # both pinned for this step: nothing can be dropped for a newcomer
    assert tier.put(40, (4,) * 4) is None and tier.num_dropped == 2 and len(tier) == 2
    tier.unpin_all()
    assert tier.put(40, (4,) * 4) == 0  # 10 was the LRU entry
    tier.check_invariants()
    tier.discard_slots({0})
    assert tier.find(40, (4,) * 4) is None and len(tier.free_slots) == 1
    tier.check_invariants()


def seq(request_id, tokens):
    return Sequence(str(request_id), list(tokens), SamplingParams(max_tokens=1))


def finish(bm, s, n):
    """``s`` computed ``n`` tokens, registered its blocks, and is freed (its blocks stay cached)."""
    s.cached_token_count = n
    bm.register_computed_blocks(s)
    bm.free(s)


def test_block_manager_offloads_on_eviction_and_restores_atomically():
    bm = MiniBlockManager(4, 4, enable_prefix_caching=True, num_offload_blocks=8)
    a = seq(0, range(13))  # 3 full blocks + 1 token
    assert bm.allocate(a, 13)
    finish(bm, a, 13)
    b = seq(1, range(100, 116))  # needs all 4 blocks: evicts a's 3 cached blocks, tail first
    assert bm.allocate(b, 16)
    offloads, restores = bm.take_tier_copies()
    assert [d for d, _ in offloads] == [2, 1, 0] and not restores  # a's full blocks, freed tail first
    a2 = seq(2, range(13))
    assert bm.lookup_prefix(a2) == []
    hashes = bm.lookup_offloaded(a2, 0)
    assert len(hashes) == 3
    before = (list(bm.free_blocks), dict(bm.tier.entries), bm.tier.num_restored)
    assert not bm.allocate(a2, 13, [], False, hashes)  # b holds every block: nothing changes
    assert (list(bm.free_blocks), dict(bm.tier.entries), bm.tier.num_restored) == before
    assert bm.take_tier_copies() == ([], [])
    bm.free(b)  # b's blocks were never registered: plain free blocks
    assert bm.allocate(a2, 13, [], False, hashes)
    offloads, restores = bm.take_tier_copies()
    slots = {h: bm.tier.entries[h].slot for h in hashes}
    assert restores == [(slots[h], blk) for h, blk in zip(hashes, a2.block_table[:3])]
    bm.check_invariants([a2])


def test_interrupted_step_forgets_unwritten_offloads():
    bm = MiniBlockManager(3, 4, enable_prefix_caching=True, num_offload_blocks=4)
    a = seq(0, range(9))
    assert bm.allocate(a, 9)
    finish(bm, a, 8)
    b = seq(1, range(50, 62))
    assert bm.allocate(b, 12)
    offloads, _ = bm.take_tier_copies()
    assert len(offloads) == 2 and len(bm.tier) == 2
    bm.discard_offloads(offloads)  # the runner never made these copies
    assert len(bm.tier) == 0 and bm.lookup_offloaded(seq(2, range(9)), 0) == []
    bm.check_invariants([b])


class CountingTier(MiniOffloadTier):
    restores = 0

    def restore(self, h):
        type(self).restores += 1
        return super().restore(h)


def test_offload_tier_cls_plugs_in_a_subclass_by_class_or_name():
    """The tier is an extension point (exercise 14): the engine builds the class it is given, same tokens."""
    kw = dict(block_size=16, num_blocks=12, enable_prefix_caching=True, kv_offload_blocks=64, max_num_seqs=1)
    prompts = [list(range(1000 * k, 1000 * k + 16 * 5 + 3)) for k in range(1, 4)]  # the pool holds two of them
    requests = two_rounds(prompts, greedy(2, ignore_eos=True))
    reference, _ = run_all(LLM("tiny-random", **kw), requests)
    plugged = LLM("tiny-random", offload_tier_cls=CountingTier, **kw)
    assert type(plugged.engine.block_manager.tier) is CountingTier
    outs, stats = run_all(plugged, requests)
    assert outs == reference and CountingTier.restores == stats.num_restored_blocks > 0
    by_name = LLM("tiny-random", offload_tier_cls="minivllm.kv_tier.MiniOffloadTier", **kw)
    assert run_all(by_name, requests)[0] == reference
    with pytest.raises(ValueError, match="offload_tier_cls"):
        EngineConfig(model="tiny-random", offload_tier_cls="minivllm.kv_tier.NoSuchTier")


def test_bad_offload_config_is_refused():
    with pytest.raises(ValueError, match="kv_offload_blocks"):
        EngineConfig(model="tiny-random", kv_offload_blocks=-1)
    with pytest.raises(ValueError, match="kv_offload_blocks.*enable_prefix_caching"):
        EngineConfig(model="tiny-random", kv_offload_blocks=8)
    with pytest.raises(ValueError, match="kv_offload_blocks.*tensor_parallel_size"):
        EngineConfig(model="tiny-random", kv_offload_blocks=8, enable_prefix_caching=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_offload_blocks"):
        EngineConfig(model="tiny-random", kv_offload_blocks=2.5, enable_prefix_caching=True)
    EngineConfig(model="tiny-random", kv_offload_blocks=8, enable_prefix_caching=True)


def test_cli_refuses_offload_without_prefix_caching(capsys):
    from minivllm.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--workload", "offline", "--model", "tiny-random", "--kv-offload-blocks", "8"])
    assert exc.value.code == 2
    assert "--kv-offload-blocks" in capsys.readouterr().err


def test_eager_offload_copies_each_full_block_once_when_it_fills_and_lazy_only_on_eviction():
    """Chapter 14's comparison: vLLM's timing (EagerOffloadBlockManager) against minivllm's lazy offload, on a pool
    that never evicts (lazy copies nothing, eager every full block, each once) and on one that does (same tokens)."""
    from minivllm.bench import EagerOffloadBlockManager

    kw = dict(block_size=16, enable_prefix_caching=True, max_num_seqs=4, kv_offload_blocks=256)
    prompts = chat_prompts(LLM("tiny-random", num_blocks=8).get_tokenizer(), 8)
    requests = two_rounds(prompts, greedy(4, ignore_eos=True))
    full_blocks = {(tuple(p[:(i + 1) * 16])) for p in prompts for i in range((len(p) + 3) // 16)}
    results = {}
    for name, cls in (("lazy", MiniBlockManager), ("eager", EagerOffloadBlockManager)):
        for pool in (512, 40):
            llm = LLM("tiny-random", num_blocks=pool, block_manager_cls=cls, **kw)
            results[name, pool] = run_all(llm, requests)
            llm.engine.check_invariants()
    assert results["lazy", 512][1].num_offloaded_blocks == 0
    assert results["eager", 512][1].num_offloaded_blocks == len(full_blocks)  # every full block, once
    assert results["eager", 40][1].num_offloaded_blocks >= results["lazy", 40][1].num_offloaded_blocks > 0
    assert len({str(outs) for outs, _ in results.values()}) == 1  # when the copy is made changes no token
