"""The chunked/dense reference pair of chapter 02."""

import pytest
import torch

from minivllm.attention import causal_chunk_mask, chunked_causal, dense_causal


def test_reference_check_seed_127():
    torch.manual_seed(127)
    q = torch.randn(1, 2, 7, 4)
    k = torch.randn(1, 2, 7, 4)
    v = torch.randn(1, 2, 7, 4)
    out, trace = chunked_causal(q, k, v, 3)
    assert trace == [(0, 3, (1, 2, 3, 4)), (3, 6, (1, 2, 6, 4)), (6, 7, (1, 2, 7, 4))]
    assert (out - dense_causal(q, k, v)).abs().max().item() < 1e-6


@pytest.mark.parametrize("n,chunk", [(1, 1), (7, 1), (7, 7), (7, 10), (16, 5), (33, 8)])
def test_chunked_equals_dense(n, chunk):
    g = torch.Generator().manual_seed(n * 100 + chunk)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for _ in range(3))
    out, trace = chunked_causal(q, k, v, chunk)
    assert torch.allclose(out, dense_causal(q, k, v), atol=1e-6)
    assert [(a, b) for a, b, _ in trace] == [(a, min(a + chunk, n)) for a in range(0, n, chunk)]


def test_chunk_mask():
    m = causal_chunk_mask(3, 6)
    assert m.shape == (3, 6)
    assert m.tolist() == [[j <= 3 + i for j in range(6)] for i in range(3)]
    assert torch.equal(causal_chunk_mask(0, 5), torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("a,b", [(-1, 3), (3, 3), (4, 2)])
def test_chunk_mask_rejects_empty_or_negative(a, b):
    with pytest.raises(ValueError, match="chunk"):
        causal_chunk_mask(a, b)


def test_split_by_padding_keeps_small_batches_whole_and_cuts_spread_ones():
    from minivllm.attention import split_by_padding

    assert split_by_padding([0, 1], [16, 32], [1, 1]) == [[0, 1]]  # a few short decodes: one group
    widths = sorted([16 * (1 + i % 20) for i in range(32)])
    parts = split_by_padding(list(range(32)), widths, [1] * 32)
    assert 2 <= len(parts) <= 4 and sum(parts, []) == list(range(32))
    assert split_by_padding([], [], []) == []


def test_the_groups_are_built_only_for_the_pytorch_path():
    """A paged kernel reads the ragged metadata (every row to its own length); the padded groups of the PyTorch
    path are built when first asked for, once per step."""
    from minivllm.attention import PagedBatch

    lens = [16 * (1 + i % 20) for i in range(32)] + [40]  # 32 spread decode rows, then a 40-token prefill
    tables = [list(range(n // 16 + 1)) for n in lens]
    batch = PagedBatch(tables, lens, [1] * 32 + [40], 16, "cpu", 3)
    assert "groups" not in batch.__dict__
    assert batch.cu_seq_q.tolist() == list(range(33)) + [72] and batch.context_lens.tolist() == lens
    assert batch.block_table.shape == (33, 21) and batch.block_table.dtype == torch.int32
    groups = batch.groups
    assert len(groups) >= 3 and batch.groups is groups  # the gather cuts the decodes; the prefill is its own


def _paged_step(ctx: list[int], qlen: list[int], seed: int = 0, cache_cls=None):
    """One paged-attention step over random KV: (output, per-sequence reference output, the batch)."""
    import random

    from minivllm.attention import PagedBatch, MiniPagedKVCache, attend, causal_chunk_mask

    rng = random.Random(seed)
    torch.manual_seed(seed)
    heads, kv_heads, d, bs = 6, 2, 16, 4
    free = list(range(1, 400))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctx]
    cache = (cache_cls or MiniPagedKVCache)(1, 400, bs, kv_heads, d)
    full_k = [torch.randn(c, kv_heads, d) for c in ctx]
    full_v = [torch.randn(c, kv_heads, d) for c in ctx]
    for t, k, v, c, n in zip(tables, full_k, full_v, ctx, qlen):  # the cached part, before this step
        for p in range(c - n):
            cache.k[0, t[p // bs], p % bs], cache.v[0, t[p // bs], p % bs] = k[p], v[p]
    batch = PagedBatch(tables, ctx, qlen, bs, "cpu", num_queries_per_kv=heads // kv_heads)
    q = [torch.randn(n, heads, d) for n in qlen]
    out = cache.forward(0, torch.cat(q), torch.cat([k[c - n:] for k, c, n in zip(full_k, ctx, qlen)]),
                        torch.cat([v[c - n:] for v, c, n in zip(full_v, ctx, qlen)]), None, batch)
    expected = [attend(qi.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                       causal_chunk_mask(c - n, c)).transpose(0, 1)
                for qi, k, v, c, n in zip(q, full_k, full_v, ctx, qlen)]
    return out, torch.cat(expected), batch


def test_paged_attention_with_many_groups_equals_per_sequence_attention():
    """Decodes with spread contexts and prefill chunks over cached prefixes: within 1e-5 of attending one by one."""
    import random

    rng = random.Random(0)
    ctx = [rng.randint(2, 90) for _ in range(24)] + [40, 70, 33]
    qlen = [1] * 24 + [12, 70, 5]
    out, expected, batch = _paged_step(ctx, qlen)
    assert len(batch.groups) > 2 and not any(g.every_token for g in batch.groups)
    assert (out - expected).abs().max().item() < 1e-5


def test_a_decode_only_step_is_one_group_in_token_order():
    """Rows keep the step's token order (not sorted by length), so queries and outputs need no gather or scatter."""
    ctx = [30, 5, 41, 17, 9, 36, 22, 12]  # block tables of different lengths, not in order
    out, expected, batch = _paged_step(ctx, [1] * len(ctx), seed=1)
    (g,) = batch.groups
    assert g.every_token and g.query_index.flatten().tolist() == list(range(len(ctx)))
    assert (out - expected).abs().max().item() < 1e-5
    mask = g.additive_mask(torch.float32)  # SDPA's form of the mask, built once and shared by every layer
    assert g.additive_mask(torch.float32) is mask and ((mask == 0) == g.folded_mask).all()


def test_write_slots_send_padding_rows_to_the_scratch_slot_once_per_step():
    from minivllm.attention import PagedBatch

    batch = PagedBatch.for_decode(torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 1]), torch.tensor([6, -1]), 4)
    slots = batch.write_slots(99)
    assert slots.tolist() == [6, 99] and batch.write_slots(99) is slots


def test_fresh_prompts_attend_causally_without_a_mask_and_equal_per_sequence_attention(monkeypatch):
    """A group of whole prompts (no cached keys before them) takes SDPA's causal rule: no additive mask is built,
    each prompt is attended alone from the step's keys (nothing gathered, no padding row), and the output is
    attention one sequence at a time; a group with a cached prefix keeps the mask. A cache that attends its own
    way (``_attend_group``, exercise 05) is still given every group."""
    import minivllm.attention as attention

    ctx, qlen = [5, 17, 30, 64, 9, 40, 23], [5, 17, 30, 64, 1, 1, 1]  # four fresh prompts of spread lengths, decodes
    given = []

    class OwnAttention(attention.MiniPagedKVCache):
        def _attend_group(self, g, *args):
            given.append(g.fresh)
            return super()._attend_group(g, *args)

    out, expected, batch = _paged_step(ctx, qlen, seed=2, cache_cls=OwnAttention)
    assert sorted(given) == sorted(g.fresh for g in batch.groups) and any(given)
    assert (out - expected).abs().max().item() < 1e-5

    attend_group, given = attention.MiniPagedKVCache._attend_group, []
    monkeypatch.setattr(attention.MiniPagedKVCache, "_attend_group",
                        lambda self, g, *args: given.append(g.fresh) or attend_group(self, g, *args))
    out, expected, batch = _paged_step(ctx, qlen, seed=2)
    fresh = [g for g in batch.groups if g.fresh]
    assert fresh and sorted(sum((g.out_index.tolist() for g in fresh), [])) == list(range(116))
    assert sorted(n for g in fresh for _, n in g.spans) == [5, 17, 30, 64]
    assert all(g.valid.sum() < g.valid.numel() for g in fresh[:1])  # the longest prompt would pad the others' rows
    assert given and not any(given)  # only the decode rows went through the gather: each prompt alone, unpadded
    assert not any(torch.float32 in g.built for g in fresh)  # the causal path: no mask built
    assert (out - expected).abs().max().item() < 1e-5
    cache = attention.MiniPagedKVCache(1, 8, 4, 2, 16)
    assert cache._attends_prompts_alone(torch.device("cpu"))
    assert not cache._attends_prompts_alone(torch.device("cuda"))  # a GPU: one padded call a group, not one a prompt
    monkeypatch.undo()

    out, expected, batch = _paged_step([12, 40], [12, 9], seed=3)  # a chunk after 31 cached keys shares the group
    assert not any(g.fresh for g in batch.groups) and all(torch.float32 in g.built for g in batch.groups)
    assert (out - expected).abs().max().item() < 1e-5

    monkeypatch.setattr(attention, "causal_gqa_supported", lambda: False)  # a torch without enable_gqa
    out, expected, batch = _paged_step(ctx, qlen, seed=2)
    assert all(torch.float32 in g.built for g in batch.groups if g.fresh)
    assert (out - expected).abs().max().item() < 1e-5
