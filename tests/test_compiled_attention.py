"""Decode attention read in place and compiled (chapter 12, issue 15): the same output as the gather path,
batch buckets, the choice and its fallbacks, and the engine's tokens with it on and forced off."""

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from minivllm import LLM, EngineConfig
from minivllm import attention
from minivllm.attention import COMPILED, GATHER, PagedBatch, MiniPagedKVCache, choose_attention_kernel
from minivllm.compiled_attention import CompiledDecodeAttention, batch_bucket, pad_to_bucket, paged_decode_attention

from helpers import greedy, mixed_prompts, run_engine

KV_HEADS, GROUP, DIM, BS = 3, 3, 16, 4


def compiled_entries() -> int:
    """How many compiled versions of the in-place decode this process holds (one per shape it has seen)."""
    return len(_debug_get_cache_entry_list(paged_decode_attention.__code__))


def decode_case(lens, seed=0):
    """A pool with random KV, a decode batch of one query per row at ``lens`` (scattered, shared-free blocks)."""
    g = torch.Generator().manual_seed(seed)
    per_row = [n // BS + 1 for n in lens]
    cache = MiniPagedKVCache(1, sum(per_row) + 2, BS, KV_HEADS, DIM, attention_kernel=GATHER, num_queries_per_kv=GROUP)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    order = torch.randperm(sum(per_row), generator=g).tolist()
    tables, start = [], 0
    for n in per_row:
        tables.append(order[start:start + n])
        start += n
    batch = PagedBatch(tables, lens, [1] * len(lens), BS, "cpu", GROUP)
    q = torch.randn(len(lens), KV_HEADS * GROUP, DIM, generator=g)
    kv = [torch.randn(len(lens), KV_HEADS, DIM, generator=g) for _ in range(2)]
    return cache, batch, q, kv


def test_the_in_place_definition_equals_the_gather_path_eagerly():
    cache, batch, q, (k, v) = decode_case([5, 17, 1, 30, 12])
    expected = cache.forward(0, q, k, v, None, batch)  # writes the new keys, then gathers and attends
    group = batch.groups[0]
    assert group.every_token and group.context_lens.tolist() == [5, 17, 1, 30, 12]
    got = paged_decode_attention(q, cache.k[0], cache.v[0], group.block_tables, group.context_lens)
    assert torch.allclose(got, expected, atol=1e-5)


def test_batch_buckets_are_powers_of_two_and_padding_rows_read_block_zero():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 17, 32, 33)] == [1, 2, 4, 4, 8, 32, 32, 64]
    with pytest.raises(ValueError, match="at least 1 row"):
        batch_bucket(0)
    tables, lens = pad_to_bucket(torch.tensor([[3, 1, 4], [5, 9, 2], [6, 0, 0]]), torch.tensor([9, 12, 2]))
    assert tables.tolist() == [[3, 1, 4], [5, 9, 2], [6, 0, 0], [0, 0, 0]] and lens.tolist() == [9, 12, 2, 1]
    tables, lens = pad_to_bucket(torch.tensor([[7]]), torch.tensor([3]))  # width 1 is padded to 2 (kept dynamic)
    assert tables.tolist() == [[7, 0]] and lens.tolist() == [3]
    full = torch.tensor([[1, 2], [3, 4]])
    assert pad_to_bucket(full, torch.tensor([5, 6]))[0] is full  # already a bucket: no copy


def test_compiled_equals_the_gather_path_across_buckets_and_widths_counting_compiles():
    compiled = CompiledDecodeAttention()
    for lens in ([5, 17, 1], [9, 2, 30, 3], [40, 33, 7, 1, 60]):  # buckets 4, 4, 8; widths 5, 8, 16
        cache, batch, q, (k, v) = decode_case(lens)
        expected = cache.forward(0, q, k, v, None, batch)
        got = compiled(q, cache.k[0], cache.v[0], *batch.groups[0].bucketed())
        assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5)
    assert compiled.bucket_sizes == (4, 8) and len(compiled.buckets) == 3  # a new width does not recompile (a
    assert len({key[2] for key in compiled.buckets}) == 3  # new pool size does: each case has its own pool)
    assert compiled.compile_seconds > 0


def test_the_kernel_is_chosen_by_a_probe_and_falls_back_to_the_gather(monkeypatch):
    assert choose_attention_kernel("cpu", torch.float32, 3) == GATHER  # not asked for
    assert choose_attention_kernel("cpu", torch.float32, 3, CompiledDecodeAttention()) == COMPILED
    monkeypatch.setattr(attention, "_agrees", lambda *a: 1 / 0)  # no compiler here: the probe raises
    assert choose_attention_kernel("cpu", torch.float32, 3, CompiledDecodeAttention()) == GATHER
    monkeypatch.setattr(attention, "_agrees", lambda *a: False)  # compiled, but disagreeing
    assert choose_attention_kernel("cpu", torch.float32, 3, CompiledDecodeAttention()) == GATHER


def test_a_bucket_that_fails_to_compile_falls_back_to_the_gather_for_good(monkeypatch):
    cache, batch, q, (k, v) = decode_case([5, 17, 1, 30, 12])
    expected = cache.forward(0, q, k, v, None, batch)
    cache.attention_kernel, cache.compiled = COMPILED, CompiledDecodeAttention()
    monkeypatch.setattr(CompiledDecodeAttention, "__call__", lambda *a: 1 / 0)
    assert torch.allclose(cache.forward(0, q, k, v, None, batch), expected)
    assert cache.attention_kernel == GATHER and cache.compiled is None


def test_engine_tokens_are_the_same_with_compiled_attention_on_and_forced_off(smollm2, monkeypatch):
    from minivllm import load_tokenizer, model_runner

    decode_groups = []  # per decode-only step: how many groups its rows were attended in

    class Recorded(model_runner.PagedBatch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.max_q == 1:
                decode_groups[-1].append(len(self.groups))

    monkeypatch.setattr(model_runner, "PagedBatch", Recorded)
    prompts = mixed_prompts(load_tokenizer("smollm2-135m"), n=6)
    requests = [(f"r{i}", p, greedy(12 + 3 * i, ignore_eos=True)) for i, p in enumerate(prompts)]
    tokens, stats = {}, {}
    for on in (False, True):  # chunked prefill: prefill chunks and decodes share steps (a mixed group)
        decode_groups.append([])
        llm = LLM("smollm2-135m", num_blocks=256, compile_attention=on, enable_chunked_prefill=True,
                  max_prefill_chunk_size=64, max_num_batched_tokens=96)
        entries = compiled_entries()  # after the load's agreement probe (its own shapes, not a bucket's)
        tokens[on], stats[on] = run_engine(llm, requests), llm.engine.stats()
        assert compiled_entries() - entries <= len(stats[on].attention_compiled_buckets)  # no hidden recompiles
    assert tokens[True] == tokens[False]
    gathered, compiled = decode_groups
    assert max(gathered) > 1, "the workload's decode rows are spread enough for the gather to cut them"
    assert set(compiled) == {1}, "the compiled in-place decode takes a step's decode rows in one call"
    assert stats[False].attention_kernel == GATHER and stats[False].attention_compile_seconds == 0
    assert stats[True].attention_kernel == COMPILED and stats[True].attention_compile_seconds > 0
    assert stats[True].attention_compiled_buckets and all(
        b & (b - 1) == 0 for b in stats[True].attention_compiled_buckets)


def test_engine_without_a_working_compiler_keeps_the_gather_and_says_so(monkeypatch):
    monkeypatch.setattr(attention, "_agrees", lambda *a: 1 / 0)
    llm = LLM("tiny-random", num_blocks=32, compile_attention=True)
    out = llm.generate([[1, 2, 3, 4]], greedy(4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    stats = llm.engine.stats()
    assert stats.attention_kernel == GATHER and stats.attention_compiled_buckets == ()


def test_compile_attention_is_checked():
    with pytest.raises(ValueError, match="compile_attention must be True or False"):
        EngineConfig(compile_attention="yes")
    with pytest.raises(ValueError, match="compile_attention must be False with tensor_parallel_size > 1"):
        EngineConfig(compile_attention=True, tensor_parallel_size=3)


def test_warm_up_compiles_every_bucket_before_anything_is_timed():
    cache = MiniPagedKVCache(1, 8, BS, KV_HEADS, DIM, attention_kernel=COMPILED, num_queries_per_kv=GROUP)
    seconds = cache.warm_up(5)
    assert cache.compiled.bucket_sizes == (1, 2, 4, 8) and seconds > 0
    assert MiniPagedKVCache(1, 8, BS, KV_HEADS, DIM, attention_kernel=GATHER).warm_up(5) == 0.0  # nothing to compile


def test_a_servers_engine_compiles_every_bucket_before_it_takes_requests():
    from minivllm.engine import LLMEngine
    from minivllm.serving.cli import warm_up

    engine = warm_up(LLMEngine(model="tiny-random", device="cpu", compile_attention=True, max_num_seqs=4))
    before = engine.stats()
    assert before.attention_kernel == COMPILED and before.attention_compiled_buckets == (1, 2, 4)
    for i in range(3):  # three rows decode together: bucket 4, compiled at warm-up
        engine.add_request(str(i), list(range(100 + i, 110 + 2 * i)), greedy(6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().attention_compile_seconds == before.attention_compile_seconds  # no request waited
    assert LLMEngine(model="tiny-random", device="cpu", max_num_seqs=4).compile_decode_buckets() == 0.0


def test_bench_reports_the_compiled_kernel_and_its_compile_time(capfd):
    from minivllm.__main__ import main

    entries = compiled_entries()
    main(["bench", "--workload", "offline", "--model", "tiny-random", "--num-requests", "3", "--prompt-len", "8", "12",
          "--output-len", "4", "4", "--compare", "none", "--no-roofline", "--quiet", "--compile-attention"])
    out = capfd.readouterr().out
    assert "attention: compiled in-place decode; compiled in" in out and "before timing (batch buckets (1, 2, 4, 8, 16))" in out
    assert compiled_entries() - entries <= 6  # 5 buckets and the probe: the timed run compiled nothing new
