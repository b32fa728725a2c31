"""Split-KV decode attention (chapter 18, csrc/split_kv.h): a decode step's few rows over long contexts cut their
keys into chunks over the threads and merge the partial softmaxes. Against the reference at lengths cut into
one, two and many chunks; the same bits every run for a thread count; the rule's values, and Python's mirror of
it agreeing with what the C++ did; a build of a reader's inner loops never split."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import kernels
from minivllm.kernels import build, reference
from minivllm.kernels.cpu import (SPLIT_MIN_KEYS, CpuKernels, split_kv_chunk_keys, split_kv_chunks,
                                  split_kv_plan)
from minivllm.tolerances import ATTENTION_ATOL
from helpers import readers_loops
from test_kernels import ragged_batch

cpu = kernels.cpu_table()
needs_cpu = pytest.mark.skipif(cpu is None, reason="the C++ kernels do not build here (no compiler)")


@contextlib.contextmanager
def threads(n: int):
    """torch's thread count (what the CPU table passes its ops) set to ``n`` for the block, then put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# (rows' lengths, (heads, kv heads, head_dim), block size, threads, chunks the longest row is cut into)
CASES = [
    ([600], (9, 3, 64), 16, 2, 2),  # SmolLM2's batch-1 decode on two threads: 3 items, each cut in two
    ([255], (9, 3, 64), 16, 2, 1),  # too short for two chunks of SPLIT_MIN_KEYS
    ([4096], (9, 3, 64), 16, 16, 16),  # 16 threads: 3 x 16 chunks, 3 a thread
    ([1000], (6, 1, 32), 16, 8, 7),  # one KV head: chunks of at least SPLIT_MIN_KEYS keys
    ([3000, 40], (4, 1, 40), 7, 4, 2),  # ragged rows: the short one stays one chunk; head_dim not a multiple of 8
    ([700, 1300, 129], (8, 4, 8), 1, 16, 4),  # 12 items on 16 threads, block size 1
    ([900, 17], (2, 2, 256), 256, 5, 5),  # MHA, the largest head_dim and block size
    ([2048], (64, 1, 16), 16, 3, 3),  # 64 query heads on one KV head (kMaxTile)
]


def test_the_rule_splits_only_where_threads_would_wait():
    """The values chapter 18 prints: rows x kv_heads items, threads / gcd(items, threads) chunks, none under
    SPLIT_MIN_KEYS keys, lengths a multiple of 16."""
    assert split_kv_chunk_keys(1, 3, 600, 2) == 304  # 3 items, 2 threads: 2 chunks each, 3 a thread
    assert split_kv_chunk_keys(1, 3, 4096, 16) == 256  # 16 chunks each: 48 items, 3 a thread
    assert split_kv_chunk_keys(1, 3, 1000, 16) == 144  # 16 wanted, 7 allowed (1000 // 128): 143 keys, to 144
    assert split_kv_chunk_keys(1, 3, 255, 2) == 255  # too short for two chunks
    assert split_kv_chunk_keys(2, 3, 4096, 2) == 4096  # 6 items: 3 a thread already
    assert split_kv_chunk_keys(1, 3, 4096, 3) == 4096  # one item a thread
    assert split_kv_chunk_keys(1, 3, 4096, 1) == 4096  # one thread
    assert split_kv_chunk_keys(4, 3, 4096, 4) == 4096  # 12 items: three a thread
    assert split_kv_chunk_keys(5, 3, 4096, 8) == 512  # 15 items on 8 threads: 8 chunks each, 15 a thread
    assert split_kv_chunk_keys(16, 3, 4096, 16) == 4096  # a full batch: many items a thread
    assert [split_kv_chunks(1, 3, n, 2) for n in (1, 255, 256, 1000, 100_000)] == [1, 1, 2, 2, 2]


@needs_cpu
def test_pythons_rule_is_the_one_the_kernel_follows():
    """split_kv_chunk_keys against the C++ rule over a grid, and the kernel's output with the rule's chunk length
    pinned equals its own choice bit for bit (and, where it splits, differs from the unsplit bits)."""
    for rows in (1, 2, 3, 5, 9):
        for kvh in (1, 2, 3, 4):
            for n in (1, 100, 256, 257, 1000, 4095, 65536):
                for t in (1, 2, 3, 4, 8, 16, 64):
                    assert cpu.lib.mv_split_kv_chunk_keys(rows, kvh, n, t) == split_kv_chunk_keys(rows, kvh, n, t)
    for lens, (h, kvh, d), block_size, t, chunks in CASES[:3]:
        q, kc, vc, table, seq_lens, starts = ragged_batch([(1, n) for n in lens], h, kvh, d, block_size, 1)
        with threads(t):
            got = cpu.paged_attention(q, kc, vc, table, seq_lens, starts, block_size)
            keys = split_kv_chunk_keys(len(lens), kvh, max(lens), t)
            pinned = cpu.paged_attention_chunked(q, kc, vc, table, seq_lens, starts, block_size, keys)
            whole = cpu.paged_attention_chunked(q, kc, vc, table, seq_lens, starts, block_size, max(lens))
        assert torch.equal(got, pinned)
        assert torch.equal(got, whole) == (chunks == 1)


@needs_cpu
@pytest.mark.parametrize("lens,heads,block_size,t,chunks", CASES)
def test_split_decode_equals_the_reference_and_the_same_bits_every_run(lens, heads, block_size, t, chunks):
    h, kvh, d = heads
    assert split_kv_chunks(len(lens), kvh, max(lens), t) == chunks
    q, kc, vc, table, seq_lens, starts = ragged_batch([(1, n) for n in lens], h, kvh, d, block_size, len(lens))
    want = reference.paged_attention(q, kc, vc, table, seq_lens, starts, block_size)
    with threads(t):
        runs = [cpu.paged_attention(q, kc, vc, table, seq_lens, starts, block_size) for _ in range(3)]
    torch.testing.assert_close(runs[0], want, rtol=0, atol=ATTENTION_ATOL)
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@needs_cpu
def test_every_chunk_length_equals_the_reference_with_rows_that_skip_and_poison_past_each_length():
    """Chunks of 16 keys to longer than the row, a sequence without queries in the step, NaN in every slot past a
    row's length (a chunk that read one key too many would turn NaN)."""
    lens, block_size = [(1, 517), (0, 40), (1, 33), (1, 300)], 16
    q, kc, vc, table, seq_lens, starts = ragged_batch(lens, 9, 3, 64, block_size, 7)
    for b, (_, n) in enumerate(lens):
        for p in range(n, -(-n // block_size) * block_size):
            slot = int(table[b, p // block_size]) * block_size + p % block_size
            kc[slot], vc[slot] = float("nan"), float("nan")
    want = reference.paged_attention(q, kc, vc, table, seq_lens, starts, block_size)
    with threads(3):
        for keys in (16, 48, 128, 500, 517, 10_000):
            got = cpu.paged_attention_chunked(q, kc, vc, table, seq_lens, starts, block_size, keys)
            torch.testing.assert_close(got, want, rtol=0, atol=ATTENTION_ATOL)


@needs_cpu
def test_a_step_with_a_longer_chunk_of_queries_is_not_split():
    """A prefill chunk (or drafts) in the step: every row attends whole, whatever chunk length is pinned."""
    q, kc, vc, table, seq_lens, starts = ragged_batch([(1, 700), (3, 400)], 9, 3, 64, 16, 3)
    with threads(4):
        pinned = cpu.paged_attention_chunked(q, kc, vc, table, seq_lens, starts, 16, 16)
        whole = cpu.paged_attention_chunked(q, kc, vc, table, seq_lens, starts, 16, 10_000)
    assert torch.equal(pinned, whole)


def test_the_plan_is_the_kernels_order_round_robin():
    plan = split_kv_plan([600], 3, 2)
    assert plan == [(0, 0, 0, 304, 0), (0, 0, 304, 600, 1), (0, 1, 0, 304, 0), (0, 1, 304, 600, 1),
                    (0, 2, 0, 304, 0), (0, 2, 304, 600, 1)]
    assert split_kv_plan([100], 3, 2) == [(0, g, 0, 100, g % 2) for g in range(3)]
    assert [item[:4] for item in split_kv_plan([40, 20], 1, 4, chunk_keys=16)] == [
        (0, 0, 0, 16), (0, 0, 16, 32), (0, 0, 32, 40), (1, 0, 0, 16), (1, 0, 16, 20)]
    assert SPLIT_MIN_KEYS == 128


@needs_cpu
def test_bad_chunk_lengths_and_tables_are_refused_before_a_split_reads_them():
    q, kc, vc, table, seq_lens, starts = ragged_batch([(1, 600)], 9, 3, 64, 16, 0)
    for bad in (-1, 1.5, True, "16"):
        with pytest.raises(ValueError, match="chunk_keys"):
            cpu.paged_attention_chunked(q, kc, vc, table, seq_lens, starts, 16, bad)
    assert cpu.lib.mv_paged_attention_chunked(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9, 3, 64, 16, 0, 1.0, 2, -5) == 1
    assert b"chunk_keys" in cpu.lib.mv_last_error()
    spoilt = table.clone()
    spoilt[0, 30] = 10**6  # a block far outside the pool, in a row the rule splits
    with threads(8), pytest.raises(ValueError, match="block_table"):
        cpu.paged_attention(q, kc, vc, spoilt, seq_lens, starts, 16)


@needs_cpu
def test_a_build_of_a_readers_loops_attends_unsplit(tmp_path):
    """Exercise 18's table runs the reader's attend_tile on every row: without MINIVLLM_OWN_INNER (here minivllm's
    loops with it taken back) the build does not split, whatever chunk length is asked for."""
    path = tmp_path / "inner_unsplit.cpp"
    path.write_text(readers_loops())
    yours = CpuKernels(build.load(build.build(path, quiet=True)), "cpu (yours)")
    assert cpu.split_kv and not yours.split_kv
    q, kc, vc, table, seq_lens, starts = ragged_batch([(1, 600)], 9, 3, 64, 16, 0)
    with threads(2):
        assert torch.equal(yours.paged_attention_chunked(q, kc, vc, table, seq_lens, starts, 16, 16),
                           cpu.paged_attention_chunked(q, kc, vc, table, seq_lens, starts, 16, 600))


@st.composite
def decode_steps(draw):
    """1 to 4 decode rows (and rows without queries) of 1 to 700 keys, a block size, a head layout, threads."""
    block_size = draw(st.sampled_from([1, 5, 16, 64]))
    lens = [(draw(st.sampled_from([1, 1, 0])), draw(st.integers(1, 700))) for _ in range(draw(st.integers(1, 4)))]
    heads = draw(st.sampled_from([(9, 3, 64), (4, 2, 16), (6, 1, 32), (2, 2, 40), (8, 4, 8)]))
    return lens, block_size, heads, draw(st.sampled_from([2, 3, 5, 8])), draw(st.sampled_from([0, 16, 37, 130]))


@needs_cpu
@settings(deadline=None, max_examples=40)
@given(decode_steps(), st.integers(0, 2**16))
def test_random_decode_steps_split_any_way_equal_the_reference(step, seed):
    lens, block_size, (h, kvh, d), t, keys = step
    q, kc, vc, table, seq_lens, starts = ragged_batch(lens, h, kvh, d, block_size, seed)
    want = reference.paged_attention(q, kc, vc, table, seq_lens, starts, block_size)
    with threads(t):
        got = cpu.paged_attention_chunked(q, kc, vc, table, seq_lens, starts, block_size, keys)
    torch.testing.assert_close(got, want, rtol=0, atol=ATTENTION_ATOL)


def test_an_avx2_build_splits_to_the_reference_too():
    """On an AVX-512 machine the AVX2 build's split path (8 lanes, not 16) is checked as well."""
    flags = build.cpu_key().split()
    if build.compiler() is None or "avx2" not in flags or "avx512f" not in flags:
        pytest.skip("needs a C++ compiler and a CPU with AVX-512 (the AVX2 build is the native one elsewhere)")
    avx2 = CpuKernels(build.load(build.build(quiet=True, isa=("-mavx2", "-mfma", "-mf16c"))), "cpu (avx2)")
    for lens, (h, kvh, d), block_size, t, _ in CASES:
        q, kc, vc, table, seq_lens, starts = ragged_batch([(1, n) for n in lens], h, kvh, d, block_size, 2)
        with threads(t):
            got = avx2.paged_attention(q, kc, vc, table, seq_lens, starts, block_size)
        torch.testing.assert_close(got, reference.paged_attention(q, kc, vc, table, seq_lens, starts, block_size),
                                   rtol=0, atol=ATTENTION_ATOL)
