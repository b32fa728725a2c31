"""The exercise checks of chapters 03-05 accept the reference and reject plausible wrong answers."""

import math

import pytest
import torch

from minivllm.attention import PagedBatch, attend
from minivllm.block_manager import BlockManager
from minivllm.exercises import (check_gather_kv, check_kv_bytes_per_token, check_paged_decode_attention,
                                check_paged_waste, check_slot_mapping)
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence


# check_kv_bytes_per_token -----------------------------------------------------------------------------

def kv_bytes(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_bytes_prod(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return math.prod([2, num_layers, num_kv_heads, head_dim, dtype_bytes])


def kv_bytes_tensor(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return torch.tensor(kv_bytes(num_layers, num_kv_heads, head_dim, dtype_bytes))


def kv_bytes_k_only(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_bytes_bits(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return 8 * kv_bytes(num_layers, num_kv_heads, head_dim, dtype_bytes)


def kv_bytes_no_dtype(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return 2 * num_layers * num_kv_heads * head_dim


def kv_bytes_one_layer(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return 2 * num_kv_heads * head_dim * dtype_bytes


def kv_bytes_float(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return float(kv_bytes(num_layers, num_kv_heads, head_dim, dtype_bytes))


def kv_bytes_query_heads(num_layers, num_kv_heads, head_dim, dtype_bytes):
    """Counts 3 query heads per KV head, as if there were no GQA."""
    return kv_bytes(num_layers, 3 * num_kv_heads, head_dim, dtype_bytes)


@pytest.mark.parametrize("fn", [kv_bytes, kv_bytes_prod, kv_bytes_tensor])
def test_kv_bytes_check_passes_right_answers(fn, capsys):
    check_kv_bytes_per_token(fn)
    assert "check_kv_bytes_per_token" in capsys.readouterr().out


@pytest.mark.parametrize("fn,match", [
    (kv_bytes_k_only, "46,080 bytes, got 23,040; half the answer"),
    (kv_bytes_bits, "count bytes, not bits"),
    (kv_bytes_no_dtype, "multiply by dtype_bytes"),
    (kv_bytes_one_layer, "every layer keeps its own"),
    (kv_bytes_float, "expected an int"),
    (kv_bytes_query_heads, "expected 46,080 bytes, got 138,240"),
])
def test_kv_bytes_check_fails_wrong_answers(fn, match):
    with pytest.raises(AssertionError, match=match):
        check_kv_bytes_per_token(fn)


# check_paged_waste ------------------------------------------------------------------------------------

def waste(lengths, block_size):
    return sum(math.ceil(n / block_size) * block_size - n for n in lengths)


def waste_by_block_manager(lengths, block_size):
    """What the engine does: allocate each sequence, count the slots of its blocks."""
    bm = BlockManager(sum(-(-n // block_size) for n in lengths) + 1, block_size)
    total = 0
    for i, n in enumerate(lengths):
        seq = Sequence(str(i), [0] * n, SamplingParams())
        assert bm.allocate(seq, n)
        total += len(seq.block_table) * block_size - n
    return total


def waste_always_extra_block(lengths, block_size):
    return sum((n // block_size + 1) * block_size - n for n in lengths)


def waste_floor(lengths, block_size):
    return sum((n // block_size) * block_size - n for n in lengths)


def waste_per_sequence_list(lengths, block_size):
    return [math.ceil(n / block_size) * block_size - n for n in lengths]


def waste_one_block_each(lengths, block_size):
    return block_size * len(lengths)


@pytest.mark.parametrize("fn", [waste, waste_by_block_manager])
def test_paged_waste_check_passes_right_answers(fn, capsys):
    check_paged_waste(fn)
    assert "check_paged_waste" in capsys.readouterr().out


@pytest.mark.parametrize("fn,match", [
    (waste_always_extra_block, "multiple of block_size"),
    (waste_floor, "round the block count UP"),
    (waste_per_sequence_list, "expected an int"),
    (waste_one_block_each, r"paged_waste\(\[5\], block_size=4\): expected 3 empty slots"),
])
def test_paged_waste_check_fails_wrong_answers(fn, match):
    with pytest.raises(AssertionError, match=match):
        check_paged_waste(fn)


# check_slot_mapping -----------------------------------------------------------------------------------

def slots(block_table, start, end, block_size):
    return [block_table[i // block_size] * block_size + i % block_size for i in range(start, end)]


def slots_paged_batch(block_table, start, end, block_size):
    return PagedBatch([block_table], [end], [end - start], block_size, "cpu").slot_mapping


def slots_logical(block_table, start, end, block_size):
    return list(range(start, end))


def slots_no_multiply(block_table, start, end, block_size):
    return [block_table[i // block_size] + i % block_size for i in range(start, end)]


def slots_no_offset(block_table, start, end, block_size):
    return [block_table[i // block_size] * block_size for i in range(start, end)]


def slots_from_zero(block_table, start, end, block_size):
    return slots(block_table, 0, end, block_size)


def slots_off_by_one(block_table, start, end, block_size):
    return slots(block_table, start, end + 1, block_size)[1:]


@pytest.mark.parametrize("fn", [slots, slots_paged_batch])
def test_slot_mapping_check_passes_right_answers(fn, capsys):
    check_slot_mapping(fn)
    assert "check_slot_mapping" in capsys.readouterr().out


@pytest.mark.parametrize("fn,match", [
    (slots_logical, "look it up in block_table"),
    (slots_no_multiply, "not multiplied by block_size"),
    (slots_no_offset, "offset inside the block"),
    (slots_from_zero, "not from token 0"),
    (slots_off_by_one, r"token 0 .* should be in slot 28, got 29"),
])
def test_slot_mapping_check_fails_wrong_answers(fn, match):
    with pytest.raises(AssertionError, match=match):
        check_slot_mapping(fn)


# check_gather_kv --------------------------------------------------------------------------------------

def gather(pool, block_table, context_len):
    return pool[block_table].reshape(-1, *pool.shape[2:])[:context_len]


def gather_by_slots(pool, block_table, context_len):
    bs = pool.shape[1]
    slot = torch.tensor([block_table[i // bs] * bs + i % bs for i in range(context_len)])
    return pool.flatten(0, 1)[slot]


def gather_loop(pool, block_table, context_len):
    bs = pool.shape[1]
    return torch.stack([pool[block_table[i // bs], i % bs] for i in range(context_len)])


def gather_ignores_table(pool, block_table, context_len):
    return pool.flatten(0, 1)[:context_len]


def gather_untrimmed(pool, block_table, context_len):
    return pool[block_table].flatten(0, 1)


def gather_sorted(pool, block_table, context_len):
    return gather(pool, sorted(block_table), context_len)


def gather_unflattened(pool, block_table, context_len):
    return pool[block_table]


def gather_heads_first(pool, block_table, context_len):
    return gather(pool, block_table, context_len).transpose(0, 1)


@pytest.mark.parametrize("fn", [gather, gather_by_slots, gather_loop])
def test_gather_kv_check_passes_right_answers(fn, capsys):
    check_gather_kv(fn)
    assert "check_gather_kv" in capsys.readouterr().out


@pytest.mark.parametrize("fn,match", [
    (gather_ignores_table, "reads blocks 0, 1, 2"),
    (gather_untrimmed, "keep the first context_len"),
    (gather_sorted, "keep the block table's order"),
    (gather_unflattened, "flatten the block and offset axes"),
    (gather_heads_first, r"token axis first"),
])
def test_gather_kv_check_fails_wrong_answers(fn, match):
    with pytest.raises(AssertionError, match=match):
        check_gather_kv(fn)


# check_paged_decode_attention -------------------------------------------------------------------------

def decode_attention(q, k_pool, v_pool, block_table, context_len):
    k = gather(k_pool, block_table, context_len)  # [ctx, kvh, d]
    v = gather(v_pool, block_table, context_len)
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [ctx, h, d]
    scores = torch.einsum("hd,thd->ht", q, k) / q.shape[1] ** 0.5
    return torch.einsum("ht,thd->hd", scores.softmax(-1), v)


def decode_attention_sdpa(q, k_pool, v_pool, block_table, context_len):
    k = gather(k_pool, block_table, context_len).transpose(0, 1)
    v = gather(v_pool, block_table, context_len).transpose(0, 1)
    return attend(q[:, None], k, v, torch.ones(1, context_len, dtype=torch.bool))[:, 0]


def _decode_variant(q, k_pool, v_pool, block_table, n_keys, scale, expand):
    k = gather(k_pool, block_table, n_keys)
    v = gather(v_pool, block_table, n_keys)
    k, v = expand(k, q.shape[0] // k.shape[1]), expand(v, q.shape[0] // v.shape[1])
    w = (torch.einsum("hd,thd->ht", q, k) * scale).softmax(-1)
    return torch.einsum("ht,thd->hd", w, v)


def decode_attention_tiled_heads(q, k_pool, v_pool, block_table, context_len):
    return _decode_variant(q, k_pool, v_pool, block_table, context_len, q.shape[1] ** -0.5,
                           lambda x, g: x.repeat(1, g, 1))


def decode_attention_unscaled(q, k_pool, v_pool, block_table, context_len):
    return _decode_variant(q, k_pool, v_pool, block_table, context_len, 1.0,
                           lambda x, g: x.repeat_interleave(g, dim=1))


def decode_attention_whole_blocks(q, k_pool, v_pool, block_table, context_len):
    n = len(block_table) * k_pool.shape[1]
    return _decode_variant(q, k_pool, v_pool, block_table, n, q.shape[1] ** -0.5,
                           lambda x, g: x.repeat_interleave(g, dim=1))


def decode_attention_kv_heads_out(q, k_pool, v_pool, block_table, context_len):
    return decode_attention(q, k_pool, v_pool, block_table, context_len)[: k_pool.shape[2]]


@pytest.mark.parametrize("fn", [decode_attention, decode_attention_sdpa])
def test_decode_attention_check_passes_right_answers(fn, capsys):
    check_paged_decode_attention(fn)
    assert "check_paged_decode_attention" in capsys.readouterr().out


@pytest.mark.parametrize("fn,match", [
    (decode_attention_tiled_heads, r"h // group \(repeat_interleave\)"),
    (decode_attention_unscaled, "1 / sqrt\\(head_dim\\) scale"),
    (decode_attention_whole_blocks, "empty slots after context_len"),
    (decode_attention_kv_heads_out, r"expected shape \(6, 8\)"),
])
def test_decode_attention_check_fails_wrong_answers(fn, match):
    with pytest.raises(AssertionError, match=match):
        check_paged_decode_attention(fn)
