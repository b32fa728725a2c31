"""The native prefill attention (chapter 18, issue 69 item 5): the C++ table's prefill_attention against the
reference, and the rule that sends a step's prompt rows to it."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import attention
from minivllm.kernels import build, reference
from minivllm.kernels.cpu import CpuKernels
from minivllm.tolerances import ATTENTION_ATOL

from test_kernels import BAD_ATTENTION, _attention_args, cpu, needs_cpu, ragged_batch, sequences

pytestmark = needs_cpu
# unit-scale random queries, keys and values: float32 sums in another order, the softmax's exp to 2 ulp
TOL = dict(rtol=0, atol=ATTENTION_ATOL)
LAYOUTS = [(9, 3, 64), (4, 2, 16), (8, 4, 8), (2, 2, 40), (6, 1, 32), (64, 1, 16), (3, 3, 5), (2, 1, 256)]


def both(lens, heads, block_size, seed=0, poison=False):
    """prefill_attention and the reference on one ragged step; with ``poison``, NaN in every slot of a sequence's
    blocks past its length (a kernel that read one key too many would turn NaN)."""
    h, kvh, d = heads
    q, kc, vc, table, seq_lens, starts = ragged_batch(lens, h, kvh, d, block_size, seed)
    if poison:
        for b, (_, n) in enumerate(lens):
            for p in range(n, -(-n // block_size) * block_size):
                slot = int(table[b, p // block_size]) * block_size + p % block_size
                kc[slot], vc[slot] = float("nan"), float("nan")
    args = (q, kc, vc, table, seq_lens, starts, block_size)
    return cpu.prefill_attention(*args), reference.prefill_attention(*args)


@settings(deadline=None, max_examples=25)
@given(sequences(), st.sampled_from(LAYOUTS), st.integers(0, 2**16))
def test_prefill_attention_equals_its_reference_on_random_ragged_batches(seqs, heads, seed):
    """Whole prompts, chunks after cached keys and decode rows in one call, GQA, block sizes 1-16, lengths across
    block and key-tile boundaries (up to 83 keys: two tiles of 48), rows with no queries, steps with none."""
    lens, block_size = seqs
    got, want = both(lens, heads, block_size, seed)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("heads", LAYOUTS, ids=[f"{h}q-{k}kv-d{d}" for h, k, d in LAYOUTS])
def test_prompts_and_chunks_after_cached_keys_read_nothing_past_their_length(heads):
    """Long rows over many query tiles (32 rows of 3 heads) and key tiles (48 keys): a 200-token prompt, a chunk of
    37 after 100 cached keys (its first row in the middle of a key tile), one of 5 after 43, a 1-token prompt and a
    decode row; lengths that are multiples of nothing; every slot past a length NaN."""
    lens = [(200, 200), (37, 137), (5, 48), (1, 1), (1, 70)]
    got, want = both(lens, heads, 16, poison=True)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("first", [0, 1, 47, 48, 49, 95, 96])
def test_the_causal_edge_at_every_key_tile_boundary(first):
    """A chunk of 40 queries after ``first`` cached keys, at and around the key tiles' edges (48 keys), block size
    1: row i sees exactly the keys 0 .. first + i."""
    got, want = both([(40, first + 40)], (9, 3, 64), 1, seed=first)
    torch.testing.assert_close(got, want, **TOL)


def test_a_strided_query_view_is_read_as_the_reference_reads_it():
    """q as a view of a fused q/k/v buffer, its rows strided."""
    q, kc, vc, table, lens, starts = ragged_batch([(70, 70), (9, 30)], 9, 3, 64, 16, 0)
    fused = torch.cat([q, torch.randn(q.shape[0], 6, 64)], dim=1)
    got = cpu.prefill_attention(fused[:, :9], kc, vc, table, lens, starts, 16)
    torch.testing.assert_close(got, reference.prefill_attention(q, kc, vc, table, lens, starts, 16), **TOL)


def test_the_same_bits_for_any_thread_count_and_alone_or_in_a_batch():
    """A query's sums follow its position and the key tiles only: 1, 2 and 3 threads give the same bits, and so does
    each sequence attended alone."""
    lens = [(150, 150), (33, 90), (1, 20), (64, 64)]
    q, kc, vc, table, seq_lens, starts = ragged_batch(lens, 9, 3, 64, 16, 3)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu.prefill_attention(q, kc, vc, table, seq_lens, starts, 16))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    for b in range(len(lens)):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        alone = cpu.prefill_attention(q[rows], kc, vc, table[b:b + 1].contiguous(), seq_lens[b:b + 1],
                                      torch.tensor([0, rows.stop - rows.start], dtype=torch.int32), 16)
        assert torch.equal(alone, outs[0][rows])


def test_every_vector_width_gives_the_same_bits_and_a_build_without_fma_agrees():
    """Each lane's sums run in one order whatever the lanes: on an AVX-512 machine an AVX2 build gives the native
    build's bits; a build for the x86-64 baseline (SSE, no FMA: other roundings) agrees with the reference."""
    flags = build.cpu_key().split()
    if build.compiler() is None or not flags or flags[0] != "x86_64":
        pytest.skip("needs a C++ compiler on x86-64")
    q, kc, vc, table, lens, starts = ragged_batch([(70, 70), (37, 137), (1, 20)], 9, 3, 64, 16, 5)
    args = (q, kc, vc, table, lens, starts, 16)
    plain = CpuKernels(build.load(build.build(quiet=True, isa=("-march=x86-64",))), "cpu (x86-64)")
    torch.testing.assert_close(plain.prefill_attention(*args), reference.prefill_attention(*args), **TOL)
    if "avx512f" in flags:
        avx2 = CpuKernels(build.load(build.build(quiet=True, isa=("-mavx2", "-mfma", "-mf16c"))), "cpu (avx2)")
        assert torch.equal(avx2.prefill_attention(*args), cpu.prefill_attention(*args))


@pytest.mark.parametrize("what,spoil,name", BAD_ATTENTION, ids=[b[0] for b in BAD_ATTENTION])
def test_prefill_attention_refuses_bad_tables_with_a_value_error_naming_the_argument(what, spoil, name):
    args = _attention_args()
    spoil(args)
    with pytest.raises(ValueError, match=name):
        cpu.prefill_attention(**args)


def test_an_empty_step_is_empty_and_zero_heads_a_value_error():
    q, kc, vc, table, lens, starts = ragged_batch([], 9, 3, 64, 16, 0)
    assert cpu.prefill_attention(q, kc, vc, table, lens, starts, 16).shape == (0, 9, 64)
    with pytest.raises(ValueError, match=r"\bq\b"):
        cpu.prefill_attention(torch.zeros(0, 0, 64), kc, vc, table, lens, starts, 16)
    with pytest.raises(ValueError, match="query heads"):  # C++'s own check, before any pointer is read
        cpu._check(cpu.lib.mv_prefill_attention(None, None, 0, None, None, None, 1, None, None, 0, 0, 2, 3, 64, 16,
                                                1, 1.0, 1))


class Counting:
    """A kernel table that counts the calls of its two attention ops, then runs the C++ table's."""

    def __init__(self, table, tiled_prefill=True):
        self.table, self.tiled_prefill, self.calls = table, tiled_prefill, []

    def __getattr__(self, name):
        return getattr(self.table, name)

    def paged_attention(self, q, *args):
        self.calls.append(("paged", q.shape[0]))
        return self.table.paged_attention(q, *args)

    def prefill_attention(self, q, *args):
        self.calls.append(("prefill", q.shape[0]))
        return self.table.prefill_attention(q, *args)


def _step(ops, seqs, order_seed=0):
    """One layer of a step through a paged cache attended by ``ops`` and through the PyTorch path: sequences
    ``(queries, context)`` in their step order; returns (the table's output, the PyTorch path's)."""
    bs, kvh, d, h = 4, 3, 16, 9
    tables, nxt = [], 1
    for _, ctx in seqs:
        n = -(-ctx // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    g = torch.Generator().manual_seed(order_seed)
    batch = attention.PagedBatch(tables, [c for _, c in seqs], [n for n, _ in seqs], bs, "cpu", h // kvh)
    fast = attention.MiniPagedKVCache(1, nxt + 1, bs, kvh, d, ops=ops)
    slow = attention.MiniPagedKVCache(1, nxt + 1, bs, kvh, d)
    pools = torch.randn(2, *fast.k.shape, generator=g)
    for cache in (fast, slow):
        cache.k.copy_(pools[0])
        cache.v.copy_(pools[1])
    q, k, v = (torch.randn(batch.num_tokens, heads, d, generator=g) for heads in (h, kvh, kvh))
    return fast.forward(0, q, k, v, None, batch), slow.forward(0, q, k, v, None, batch)


@pytest.mark.parametrize("seqs,calls", [
    ([(1, 9), (1, 30), (12, 40), (20, 20)], [("paged", 2), ("prefill", 32)]),  # the scheduler's order: decodes first
    ([(12, 40), (1, 9), (20, 20), (1, 30)], [("paged", 2), ("prefill", 32)]),  # interleaved: tokens by index
    ([(2, 2), (5, 17), (0, 6)], [("prefill", 7)]),                              # prompts only (and an empty row)
    ([(1, 9), (1, 30)], [("paged", 2)]),                                       # decodes only
], ids=["decodes-then-prompts", "interleaved", "prompts-only", "decodes-only"])
def test_the_rule_sends_prompt_rows_to_the_prefill_kernel_and_decode_rows_to_paged_attention(seqs, calls):
    """PREFILL_MIN_QUERIES (2): a sequence with two queries or more goes to prefill_attention, a decode row to
    paged_attention, each part with its own tables; the step's output is the PyTorch path's."""
    ops = Counting(cpu)
    got, want = _step(ops, seqs)
    assert ops.calls == calls
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_readers_table_attends_every_row_with_its_own_kernel():
    """Exercise 18's table (another name) keeps paged_attention for prompts too: the reader's inner loops run."""
    assert cpu.tiled_prefill and not CpuKernels(cpu.lib, "yours").tiled_prefill
    ops = Counting(cpu, tiled_prefill=False)
    got, want = _step(ops, [(1, 9), (12, 40)])
    assert ops.calls == [("paged", 13)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
