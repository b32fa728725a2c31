"""The exercise checks accept right answers and reject plausible wrong ones, with a hint naming the mistake.

Each chapter's section below writes right answers (the solution notebook's
and a few other shapes), the characteristic wrong answers, and the plain
tests that hold a check's reference equal to the engine. ``CHECKS`` at the
bottom is the table that two parametrized tests run: every right answer
passes its check, and every wrong answer makes it raise ``AssertionError``
whose message matches each of the mistake's hints (regular expressions,
searched as ``pytest.raises(match=...)`` does).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch

from minivllm.attention import ContiguousKVCache, PagedBatch, attend, causal_chunk_mask
from minivllm.bench import goodput as bench_goodput
from minivllm.block_manager import BlockManager
from minivllm.exercises import (check_block_hashes, check_cached_decode, check_cached_prefix_len, check_choose_victim,
                                check_chunk_mask, check_gather_kv, check_goodput, check_kv_bytes_per_token,
                                check_paged_decode_attention, check_paged_waste, check_plan_chunks,
                                check_request_latencies, check_schedule_step, check_slot_mapping, check_top_p_filter,
                                reference_block_hashes, reference_cached_prefix_len, reference_choose_victim,
                                reference_plan_chunks, reference_request_latencies, reference_schedule_step,
                                reference_top_p)
from minivllm.exercises.benchmarks import _latency_cases
from minivllm.exercises.chunked_prefill import _PLAN_CASES, _random_plan_cases
from minivllm.exercises.continuous_batching import _SCHEDULE_CASES, _random_schedule_cases
from minivllm.exercises.preemption import _victim_cases, _victim_seqs
from minivllm.exercises.prefix_caching import _block_hash_cases, _cached_prefix_cases
from minivllm.sampler import apply_top_k_top_p
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence
from minivllm.simple_generation import generate_cached, generate_naive


# 01 check_cached_decode -------------------------------------------------------------------------------

def cached_reference(model, prompt_ids, max_new_tokens):
    return generate_cached(model, prompt_ids, max_new_tokens).token_ids


def cached_by_hand(model, prompt_ids, max_new_tokens):
    """What a reader writes: prefill into a cache, then one token per step at its position."""
    cache = ContiguousKVCache.for_model(model, len(prompt_ids) + max_new_tokens)
    out = []
    logits = model.logits(prompt_ids, torch.arange(len(prompt_ids)), cache)
    for step in range(max_new_tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        logits = model.logits([token], torch.tensor([len(prompt_ids) + step]), cache)
    return out


def cached_as_tensor(model, prompt_ids, max_new_tokens):
    return torch.tensor(cached_reference(model, prompt_ids, max_new_tokens))


def _decode_with_positions(position_of_step):
    def fn(model, prompt_ids, max_new_tokens):
        cache = ContiguousKVCache.for_model(model, len(prompt_ids) + max_new_tokens + 1)
        logits = model.logits(prompt_ids, torch.arange(len(prompt_ids)), cache)
        out = []
        for step in range(max_new_tokens):
            token = int(logits[-1].argmax())
            out.append(token)
            pos = position_of_step(len(prompt_ids), step)
            logits = model.logits([token], torch.tensor([pos]), cache)
        return out
    return fn


def fresh_cache_each_step(model, prompt_ids, max_new_tokens):
    """Right positions, but each decode step gets an empty cache: the new token sees only itself."""
    logits = model.logits(prompt_ids)
    out = []
    for step in range(max_new_tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        cache = ContiguousKVCache.for_model(model, len(prompt_ids) + max_new_tokens)
        logits = model.logits([token], torch.tensor([len(prompt_ids) + step]), cache)
    return out


CACHED_DECODE_WRONG = {
    # every new token at position 0, what model.logits([token]) does by default
    "forgets positions": (_decode_with_positions(lambda n, step: 0), "differ"),
    "position off by one": (_decode_with_positions(lambda n, step: n + step + 1), "differ"),
    "fresh cache each step": (fresh_cache_each_step, "differ"),
    # right tokens, no cache: the check must notice that nothing is reused
    "naive recompute": (lambda m, p, n: generate_naive(m, p, n).token_ids, "recomputes"),
    "returns the prompt too": (lambda m, p, n: list(p) + cached_reference(m, p, n), "not the prompt"),
    "one token short": (lambda m, p, n: cached_reference(m, p, n)[:-1], "expected .* generated ids"),
}


def test_cached_decode_check_loads_its_own_model(capsys):
    check_cached_decode(cached_reference)
    assert "check_cached_decode" in capsys.readouterr().out


# 02 check_chunk_mask ----------------------------------------------------------------------------------

def mask_reference(a, b):
    return causal_chunk_mask(a, b)


def mask_by_hand(a, b):
    rows = torch.arange(a, b)[:, None]
    return torch.arange(b)[None, :] <= rows


def mask_ignores_prefix(a, b):
    """Causal within the chunk but blind to the cached keys [0, a)."""
    n = b - a
    return torch.cat([torch.zeros(n, a, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], dim=1)


CHUNK_MASK_WRONG = {
    "strict <": (lambda a, b: torch.arange(b)[None, :] < torch.arange(a, b)[:, None],
                 r"chunk_mask\(0, 1\): row 0 .* key 0"),
    "ignores the cached prefix": (mask_ignores_prefix, r"chunk_mask\(0, 2\)|chunk_mask\(1, 2\): row 0 .* key 0"),
    "chunk keys only, square": (lambda a, b: torch.ones(b - a, b - a, dtype=torch.bool).tril(), "shape"),
    "float mask": (lambda a, b: causal_chunk_mask(a, b).float(), "dtype"),
    "sees the future": (lambda a, b: torch.ones(b - a, b, dtype=torch.bool), "differs"),
    "returns a list": (lambda a, b: causal_chunk_mask(a, b).tolist(), "torch.Tensor"),
}


# 03 check_kv_bytes_per_token, check_paged_waste -------------------------------------------------------

def kv_bytes(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_bytes_prod(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return math.prod([2, num_layers, num_kv_heads, head_dim, dtype_bytes])


def kv_bytes_tensor(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return torch.tensor(kv_bytes(num_layers, num_kv_heads, head_dim, dtype_bytes))


KV_BYTES_WRONG = {
    "K only": (lambda layers, kvh, d, b: layers * kvh * d * b, "46,080 bytes, got 23,040; half the answer"),
    "bits": (lambda *args: 8 * kv_bytes(*args), "count bytes, not bits"),
    "no dtype_bytes": (lambda layers, kvh, d, b: 2 * layers * kvh * d, "multiply by dtype_bytes"),
    "one layer": (lambda layers, kvh, d, b: 2 * kvh * d * b, "every layer keeps its own"),
    "float": (lambda *args: float(kv_bytes(*args)), "expected an int"),
    # 3 query heads per KV head, as if there were no GQA
    "query heads": (lambda layers, kvh, d, b: kv_bytes(layers, 3 * kvh, d, b), "expected 46,080 bytes, got 138,240"),
}


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


PAGED_WASTE_WRONG = {
    "always an extra block": (lambda lengths, bs: sum((n // bs + 1) * bs - n for n in lengths),
                              "multiple of block_size"),
    "floor division": (lambda lengths, bs: sum((n // bs) * bs - n for n in lengths), "round the block count UP"),
    "per-sequence list": (lambda lengths, bs: [math.ceil(n / bs) * bs - n for n in lengths], "expected an int"),
    "one block each": (lambda lengths, bs: bs * len(lengths),
                       r"paged_waste\(\[5\], block_size=4\): expected 3 empty slots"),
}


# 04 check_slot_mapping --------------------------------------------------------------------------------

def slots(block_table, start, end, block_size):
    return [block_table[i // block_size] * block_size + i % block_size for i in range(start, end)]


def slots_paged_batch(block_table, start, end, block_size):
    return PagedBatch([block_table], [end], [end - start], block_size, "cpu").slot_mapping


SLOT_MAPPING_WRONG = {
    "logical block": (lambda table, start, end, bs: list(range(start, end)), "look it up in block_table"),
    "block id not multiplied": (lambda table, start, end, bs: [table[i // bs] + i % bs for i in range(start, end)],
                                "not multiplied by block_size"),
    "no offset": (lambda table, start, end, bs: [table[i // bs] * bs for i in range(start, end)],
                  "offset inside the block"),
    "from token 0": (lambda table, start, end, bs: slots(table, 0, end, bs), "not from token 0"),
    "off by one": (lambda table, start, end, bs: slots(table, start, end + 1, bs)[1:],
                   r"token 0 .* should be in slot 28, got 29"),
}


# 05 check_gather_kv, check_paged_decode_attention -----------------------------------------------------

def gather(pool, block_table, context_len):
    return pool[block_table].reshape(-1, *pool.shape[2:])[:context_len]


def gather_by_slots(pool, block_table, context_len):
    bs = pool.shape[1]
    slot = torch.tensor([block_table[i // bs] * bs + i % bs for i in range(context_len)])
    return pool.flatten(0, 1)[slot]


def gather_loop(pool, block_table, context_len):
    bs = pool.shape[1]
    return torch.stack([pool[block_table[i // bs], i % bs] for i in range(context_len)])


GATHER_KV_WRONG = {
    "ignores the block table": (lambda pool, table, ctx: pool.flatten(0, 1)[:ctx], "reads blocks 0, 1, 2"),
    "untrimmed": (lambda pool, table, ctx: pool[table].flatten(0, 1), "keep the first context_len"),
    "sorted blocks": (lambda pool, table, ctx: gather(pool, sorted(table), ctx), "keep the block table's order"),
    "unflattened": (lambda pool, table, ctx: pool[table], "flatten the block and offset axes"),
    "heads first": (lambda pool, table, ctx: gather(pool, table, ctx).transpose(0, 1), r"token axis first"),
}


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


def _decode_variant(n_keys=None, scale=None, tiled=False):
    """Decode attention over ``n_keys(table, block_size)`` keys (default: context_len), scaled by ``scale``
    (default 1 / sqrt(d)), query head h reading KV head h % kv_heads when ``tiled``."""
    def fn(q, k_pool, v_pool, block_table, context_len):
        n = context_len if n_keys is None else n_keys(block_table, k_pool.shape[1])
        k, v = gather(k_pool, block_table, n), gather(v_pool, block_table, n)
        group = q.shape[0] // k.shape[1]
        expand = (lambda x: x.repeat(1, group, 1)) if tiled else (lambda x: x.repeat_interleave(group, dim=1))
        w = (torch.einsum("hd,thd->ht", q, expand(k)) * (q.shape[1] ** -0.5 if scale is None else scale)).softmax(-1)
        return torch.einsum("ht,thd->hd", w, expand(v))
    return fn


DECODE_ATTENTION_WRONG = {
    "tiled heads": (_decode_variant(tiled=True), r"h // group \(repeat_interleave\)"),
    "unscaled": (_decode_variant(scale=1.0), "1 / sqrt\\(head_dim\\) scale"),
    "whole blocks": (_decode_variant(n_keys=lambda table, bs: len(table) * bs), "empty slots after context_len"),
    "one output per KV head": (lambda q, k_pool, *args: decode_attention(q, k_pool, *args)[: k_pool.shape[2]],
                               r"expected shape \(6, 8\)"),
}


# 06 check_schedule_step -------------------------------------------------------------------------------

def schedule_step(running, waiting, token_budget, max_num_seqs):
    """The solution notebook's answer."""
    batch = [(rid, 1) for rid in running]
    tokens_left, seats_left = token_budget - len(running), max_num_seqs - len(running)
    for rid, n in waiting:
        if seats_left == 0 or n > tokens_left:
            break
        batch.append((rid, n))
        tokens_left -= n
        seats_left -= 1
    return batch


def schedule_step_while(running, waiting, token_budget, max_num_seqs):
    """Another right answer: count what is in the batch as it grows; lists instead of tuples."""
    batch = [[rid, 1] for rid in running]
    queue = list(waiting)
    while queue and len(batch) < max_num_seqs and sum(n for _, n in batch) + queue[0][1] <= token_budget:
        batch.append(list(queue.pop(0)))
    return batch


def _variant(decodes_first=True, skip=False, count_running_seats=True, count_decode_tokens=True, strict=False):
    def fn(running, waiting, token_budget, max_num_seqs):
        tokens = token_budget - (len(running) if count_decode_tokens else 0)
        seats = max_num_seqs - (len(running) if count_running_seats else 0)
        admitted = []
        for rid, n in waiting:
            fits = seats > 0 and (n < tokens if strict else n <= tokens)
            if not fits:
                if skip:
                    continue
                break
            admitted.append((rid, n))
            tokens -= n
            seats -= 1
        decodes = [(rid, 1) for rid in running]
        return decodes + admitted if decodes_first else admitted + decodes
    return fn


SCHEDULE_WRONG = {
    "prefills before decodes": (_variant(decodes_first=False), "decodes come first"),
    # the hint, and the message says what differs
    "skips a request that does not fit": (_variant(skip=True), ("first come, first served", r"schedule_step\(running=",
                                                                r"expected \[", r"got      \[")),
    "running requests hold no seats": (_variant(count_running_seats=False), "max_num_seqs"),
    "decode tokens not in the budget": (_variant(count_decode_tokens=False), "over token_budget"),
    "a prompt may not fill the budget exactly": (_variant(strict=True), "fits"),
    "forgets the decodes": (lambda r, w, b, s: _variant()([], w, b - len(r), s - len(r)), "every running request"),
    "only the ids": (lambda r, w, b, s: [rid for rid, _ in _variant()(r, w, b, s)], "pairs"),
    "whole prompt plus one": (lambda r, w, b, s: [(rid, n + (rid not in r)) for rid, n in _variant()(r, w, b, s)],
                              "prompt length"),
}


def test_reference_is_the_engine_scheduler():
    for case in _SCHEDULE_CASES + _random_schedule_cases(200, seed=1):
        assert reference_schedule_step(*case) == schedule_step(*case), case


# 07 check_top_p_filter --------------------------------------------------------------------------------

def top_p_filter(probs, p):
    """The solution notebook's answer."""
    sorted_probs, order = probs.sort(descending=True)
    keep_sorted = sorted_probs.cumsum(0) - sorted_probs < p
    keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


def top_p_by_index(probs, p):
    """Another right answer: walk the sorted tokens in Python, float64 result."""
    order = probs.argsort(descending=True).tolist()
    out, mass = torch.zeros(probs.shape, dtype=torch.float64), 0.0
    for t in order:
        if mass >= p:
            break
        out[t] = float(probs[t])
        mass += float(probs[t])
    return out / out.sum()


def top_p_by_reference(probs, p):
    return reference_top_p(probs, p)


def _sorted_filter(rule, renormalise=True, in_place=False):
    def fn(probs, p):
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(0)
        keep_sorted = rule(cum, sorted_probs, p)
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        target = probs if in_place else probs.clone()
        target[~keep] = 0
        return target / target.sum() if renormalise else target
    return fn


def unsorted(probs, p):
    """Keeps tokens in vocabulary order until the mass reaches p."""
    before = probs.cumsum(0) - probs
    kept = torch.where(before < p, probs, torch.zeros_like(probs))
    return kept / kept.sum()


TOP_P_WRONG = {
    "drops the token that reaches p": (_sorted_filter(lambda cum, s, p: (cum < p) | (cum == cum[0])), "dropped the token"),
    "cumsum <= p": (_sorted_filter(lambda cum, s, p: cum <= p), "nothing kept"),
    "one token too many": (_sorted_filter(lambda cum, s, p: torch.cat([torch.ones(1, dtype=torch.bool), cum[:-1] - s[:-1] < p])),
                           "one token too many"),
    "not renormalised": (_sorted_filter(lambda cum, s, p: cum - s < p, renormalise=False), "renormalise"),
    "modifies the input": (_sorted_filter(lambda cum, s, p: cum - s < p, in_place=True), "in place"),
    "does not sort": (unsorted, "sort by probability"),
    "returns the kept indices": (lambda probs, p: (top_p_filter(probs, p) > 0).nonzero().flatten(), "shape"),
    "returns a list": (lambda probs, p: top_p_filter(probs, p).tolist(), "torch.Tensor"),
    "keeps p, not 1 - p, of the tail": (lambda probs, p: top_p_filter(probs, 1 - p if p < 1 else 1.0), "keeps"),
}


def test_reference_top_p_is_the_sampler():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(200, generator=g) * 2
        for p in (0.2, 0.7, 0.93):
            expected = apply_top_k_top_p(logits[None], torch.tensor([-1]), torch.tensor([p]))[0].softmax(-1)
            got = reference_top_p(logits.softmax(-1), p)
            assert torch.equal(got > 0, expected > 0)
            assert torch.allclose(got.float(), expected, atol=1e-6)


# 08 check_block_hashes, check_cached_prefix_len -------------------------------------------------------

H = BlockManager.chain_hash


def block_hashes(token_ids, block_size):
    """The solution notebook's answer."""
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = H(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes


def block_hashes_recursive(token_ids, block_size):
    """Another right answer: recursion from the end, a tuple result."""
    n = len(token_ids) // block_size
    if n == 0:
        return ()
    head = block_hashes_recursive(token_ids[:(n - 1) * block_size], block_size)
    return tuple(head) + (H(head[-1] if head else None, tuple(token_ids[(n - 1) * block_size:n * block_size])),)


def _blocks(tokens, bs, partial=False):
    n = -(-len(tokens) // bs) if partial else len(tokens) // bs
    return [tuple(tokens[i * bs:(i + 1) * bs]) for i in range(n)]


def hashes_with_partial(tokens, bs):
    out, parent = [], None
    for b in _blocks(tokens, bs, partial=True):
        parent = H(parent, b)
        out.append(parent)
    return out


BLOCK_HASH_WRONG = {
    "hashes the partial block too": (hashes_with_partial, "only full blocks"),
    "not chained": (lambda t, bs: [H(None, b) for b in _blocks(t, bs)], "chain the hashes"),
    "hashes lists": (lambda t, bs: [H(None, list(t[:bs]))] if len(t) >= bs else [], "tuple"),
    "plain hash of the block": (lambda t, bs: [hash(b) for b in _blocks(t, bs)], "chain_hash"),
    "hash of the whole prefix": (lambda t, bs: [hash(tuple(t[:(i + 1) * bs])) for i in range(len(t) // bs)],
                                 "chain_hash"),
    "one block short": (lambda t, bs: block_hashes(t, bs)[:-1], "one hash per full block"),
    "parent is the previous block's tokens": (
        lambda t, bs: [H(_blocks(t, bs)[i - 1] if i else None, b) for i, b in enumerate(_blocks(t, bs))], "expected"),
    "returns the blocks": (lambda t, bs: _blocks(t, bs), "int hashes"),
}


def test_reference_hashes_are_the_chain():
    for tokens, bs in _block_hash_cases():
        assert reference_block_hashes(tokens, bs) == block_hashes(tokens, bs)


def cached_prefix_len(token_ids, block_size, cached):
    """The solution notebook's answer."""
    hits = 0
    for h in block_hashes(token_ids, block_size)[:(len(token_ids) - 1) // block_size]:
        if h not in cached:
            break
        hits += block_size
    return hits


def cached_prefix_len_while(token_ids, block_size, cached):
    """Another right answer: a while loop that hashes as it walks."""
    i, parent = 0, None
    while (i + 1) * block_size < len(token_ids):
        parent = H(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        if parent not in cached:
            break
        i += 1
    return i * block_size


def _walk(tokens, bs, cached, limit=None, skip=False):
    hashes = block_hashes(tokens, bs)
    if limit is not None:
        hashes = hashes[:limit(tokens, bs)]
    n = 0
    for h in hashes:
        if h in cached:
            n += 1
        elif not skip:
            break
    return n


CACHED_WRONG = {
    "serves the last token too": (lambda t, bs, c: _walk(t, bs, c) * bs, "last prompt token"),
    "counts blocks": (lambda t, bs, c: _walk(t, bs, c, lambda t, bs: (len(t) - 1) // bs), "not of blocks"),
    "does not stop at a miss": (lambda t, bs, c: _walk(t, bs, c, lambda t, bs: (len(t) - 1) // bs, skip=True) * bs,
                                "first block that misses"),
    "len // bs - 1 blocks": (lambda t, bs, c: _walk(t, bs, c, lambda t, bs: max(len(t) // bs - 1, 0)) * bs,
                             "expected"),
    "counts the tail tokens": (lambda t, bs, c: min(len(t) - 1, cached_prefix_len(t, bs, c) + len(t) % bs)
                               if cached_prefix_len(t, bs, c) else 0, "whole blocks"),
    "returns a list": (lambda t, bs, c: [cached_prefix_len(t, bs, c)], "int"),
}


def test_reference_cached_prefix_len_is_match_prefix():
    """The set-of-hashes reference equals the block manager's match_prefix after real registrations."""
    rng = random.Random(5)
    for trial in range(30):
        bs = rng.choice([1, 2, 4, 8])
        base = [rng.randrange(1, 500) for _ in range(40)]
        bm = BlockManager(num_blocks=400, block_size=bs, enable_prefix_caching=True)
        for k in range(6):
            prompt = base[:rng.randint(0, 40)] + [rng.randrange(1, 500) for _ in range(rng.randint(0, 8))] or [1]
            expected = reference_cached_prefix_len(prompt, bs, set(bm.hash_to_block))
            seq = Sequence(f"s{trial}-{k}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
            assert bm.match_prefix(seq) == expected == cached_prefix_len(prompt, bs, set(bm.hash_to_block))
            bm.allocate(seq, len(prompt))
            seq.cached_token_count = len(prompt)
            bm.register_computed_blocks(seq)
            bm.free(seq)


def test_cached_prefix_cases_cover_the_traps():
    """The hand-made cases include a fully cached prompt, a missing middle block and a one-token prompt."""
    cases = _cached_prefix_cases()
    assert any(len(t) % bs == 0 and reference_cached_prefix_len(t, bs, c) == len(t) - bs for t, bs, c in cases)
    assert any(len(t) == 1 for t, _, _ in cases)
    assert any(cached_prefix_len(t, bs, c) != _walk(t, bs, c, skip=True) * bs for t, bs, c in cases)


# 09 check_plan_chunks ---------------------------------------------------------------------------------

def plan_chunks(prompt_len, num_cached, chunk_size):
    """The solution notebook's answer."""
    return [(start, min(start + chunk_size, prompt_len)) for start in range(num_cached, prompt_len, chunk_size)]


def plan_chunks_while(prompt_len, num_cached, chunk_size):
    """Another right answer: lists, a while loop."""
    out, start = [], num_cached
    while start < prompt_len:
        end = min(prompt_len, start + chunk_size)
        out.append([start, end])
        start = end
    return out


PLAN_WRONG = {
    # the hint, and the message says what differs
    "ignores the cache": (lambda n, c, k: plan_chunks(n, 0, k), ("start at num_cached", r"plan_chunks\(prompt_len=",
                                                                 r"expected \[", r"got      \[")),
    "last chunk overflows": (lambda n, c, k: [(s, s + k) for s in range(c, n, k)], "ends exactly"),
    "inclusive end": (lambda n, c, k: [(a, b - 1) for a, b in plan_chunks(n, c, k)], "exclusive"),
    "aligned to multiples": (lambda n, c, k: [(max(s, c), min(s + k, n)) for s in range(c - c % k, n, k)],
                             "not aligned"),
    "one token too many per chunk": (lambda n, c, k: plan_chunks(n, c, k + 1), "chunk_size"),
    "off by one at the end": (lambda n, c, k: plan_chunks(n - 1, c, k) if n - 1 > c else [], "expected"),
    "empty when it fits": (lambda n, c, k: plan_chunks(n, c, k) if n - c > k else [], "at least one chunk"),
    "returns lengths": (lambda n, c, k: [b - a for a, b in plan_chunks(n, c, k)], "pairs"),
}


def test_reference_plan_is_the_engine_schedule():
    for case in _PLAN_CASES + _random_plan_cases(200, seed=1):
        assert reference_plan_chunks(*case) == plan_chunks(*case), case
    assert reference_plan_chunks(7, 0, 3) == [(0, 3), (3, 6), (6, 7)]
    assert reference_plan_chunks(12000, 8000, 1000) == [(8000, 9000), (9000, 10000), (10000, 11000), (11000, 12000)]


# 10 check_choose_victim -------------------------------------------------------------------------------

def choose_victim(candidates):
    """The solution notebook's answer."""
    return max(candidates, key=lambda s: (s.priority, s.metrics.arrival_time))


def choose_victim_sorted(candidates):
    """Another right answer: sort a copy, take the last."""
    return sorted(candidates, key=lambda s: (s.priority, s.metrics.arrival_time))[-1]


def choose_victim_loop(candidates):
    """Another right answer: an explicit loop."""
    best = None
    for s in candidates:
        if best is None or s.priority > best.priority or (
                s.priority == best.priority and s.metrics.arrival_time > best.metrics.arrival_time):
            best = s
    return best


VICTIM_WRONG = {
    "highest priority (min value)": (lambda c: min(c, key=lambda s: (s.priority, -s.metrics.arrival_time)),
                                     "largest value"),
    "earliest arrival": (lambda c: max(c, key=lambda s: (s.priority, -s.metrics.arrival_time)), "latest arrival"),
    "ignores priority": (lambda c: max(c, key=lambda s: s.metrics.arrival_time), "largest value"),
    "ignores arrival": (lambda c: max(c, key=lambda s: s.priority), "latest arrival"),
    "last in the list": (lambda c: c[-1], "latest arrival"),
    "first in the list": (lambda c: c[0], "latest arrival"),
    "sorts the list in place": (lambda c: (c.sort(key=lambda s: (s.priority, s.metrics.arrival_time)), c[-1])[1],
                                "changed"),
    "returns an index": (lambda c: max(range(len(c)), key=lambda i: (c[i].priority, c[i].metrics.arrival_time)),
                         "one of the candidates"),
    "returns the request id": (lambda c: choose_victim(c).request_id, "one of the candidates"),
}


def test_reference_choose_victim_is_the_engine_rule():
    for case in _victim_cases(40, seed=1):
        seqs = _victim_seqs(case)
        assert reference_choose_victim(seqs) is choose_victim(seqs)


# 11 check_request_latencies, check_goodput ------------------------------------------------------------

def request_latencies(arrival_time, token_times):
    """The solution notebook's answer."""
    n = len(token_times)
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    return {"ttft": token_times[0] - arrival_time,
            "tpot": (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None,
            "itl": gaps,
            "e2e": token_times[-1] - arrival_time}


def request_latencies_numpy(arrival_time, token_times):
    """Another right answer: numpy, TPOT as the mean gap, ITL as an array turned into a list."""
    t = np.asarray(token_times)
    gaps = np.diff(t)
    return {"ttft": float(t[0] - arrival_time), "tpot": float(gaps.mean()) if len(gaps) else None,
            "itl": gaps.tolist(), "e2e": float(t[-1] - arrival_time)}


def _with(**changes):
    def fn(arrival_time, token_times):
        out = request_latencies(arrival_time, token_times)
        out.update({k: f(arrival_time, token_times, out) for k, f in changes.items()})
        return out
    return fn


LATENCIES_WRONG = {
    "TTFT without the arrival": (_with(ttft=lambda a, t, o: t[0]), "TTFT counts from the arrival"),
    "E2E from the first token": (_with(e2e=lambda a, t, o: t[-1] - t[0]), "E2E runs from the arrival"),
    "TPOT over n tokens": (_with(tpot=lambda a, t, o: (t[-1] - t[0]) / len(t)), "n - 1 gaps"),
    "TPOT includes TTFT": (_with(tpot=lambda a, t, o: (t[-1] - a) / len(t)), "leaves the first token out"),
    "one-token TPOT is 0": (_with(tpot=lambda a, t, o: o["tpot"] or 0.0), "TPOT is None"),
    "one-token TPOT divides by zero": (_with(tpot=lambda a, t, o: (t[-1] - t[0]) / (len(t) - 1)), "TPOT is None"),
    "ITL starts at the arrival": (_with(itl=lambda a, t, o: [y - x for x, y in zip([a] + t, t)]), "between"),
    "returns a tuple": (lambda a, t: tuple(request_latencies(a, t).values()), "a dict with keys"),
}


def test_latency_cases_cover_the_edges():
    cases = _latency_cases()
    assert any(len(t) == 1 for _, t in cases) and any(len(t) == 2 for _, t in cases)
    assert any(a > 100 for a, _ in cases)  # large clock values: TTFT must subtract the arrival


def goodput(requests, duration, ttft_limit=None, tpot_limit=None):
    """The solution notebook's answer, built on request_latencies."""
    good = 0
    for r in requests:
        if not r.token_times:
            continue
        m = request_latencies(r.arrival_time, r.token_times)
        if ttft_limit is not None and m["ttft"] > ttft_limit:
            continue
        if tpot_limit is not None and m["tpot"] is not None and m["tpot"] > tpot_limit:
            continue
        good += 1
    return good / duration


def _goodput_with(le=lambda x, lim: x <= lim, one_token_fails=False, skip_unfinished=True, rate=True):
    def fn(requests, duration, ttft_limit=None, tpot_limit=None):
        good = 0
        for r in requests:
            if skip_unfinished and not r.token_times:
                continue
            if not r.token_times:
                good += 1
                continue
            m = request_latencies(r.arrival_time, r.token_times)
            if ttft_limit is not None and not le(m["ttft"], ttft_limit):
                continue
            if tpot_limit is not None and (m["tpot"] is None and one_token_fails
                                           or m["tpot"] is not None and not le(m["tpot"], tpot_limit)):
                continue
            good += 1
        return good / duration if rate else good
    return fn


def _goodput_crashes_on_unfinished(requests, duration, ttft_limit=None, tpot_limit=None):
    return sum(request_latencies(r.arrival_time, r.token_times)["ttft"] <= (ttft_limit or 1e9)
               for r in requests) / duration


GOODPUT_WRONG = {
    "a count, not a rate": (_goodput_with(rate=False), "a rate"),
    "strict <": (_goodput_with(le=lambda x, lim: x < lim), "<="),
    "one-token request fails TPOT": (_goodput_with(one_token_fails=True), "no TPOT"),
    "counts unfinished requests": (_goodput_with(skip_unfinished=False), "has not finished"),
    "crashes on an unfinished request": (_goodput_crashes_on_unfinished, "has not finished"),
    "throughput, ignoring the limits": (lambda reqs, d, **kw: sum(bool(r.token_times) for r in reqs) / d,
                                        "every limit"),
}


# The table ---------------------------------------------------------------------------------------------

@dataclass
class Check:
    """One exercise check, the answers it must accept and the mistakes it must name."""

    chapter: str
    check: Callable
    right: list[Callable]
    wrong: dict[str, tuple[Callable, str | tuple[str, ...]]]  # mistake: (answer, hint pattern or patterns)
    passes: str = ""  # more of the success line than "check_x: all"
    model_fixture: str | None = None  # a conftest fixture whose model the check gets as second argument

    @property
    def name(self) -> str:
        return self.check.__name__.removeprefix("check_")

    def run(self, fn, request) -> None:
        extra = [request.getfixturevalue(self.model_fixture)[0]] if self.model_fixture else []
        self.check(fn, *extra)


CHECKS = [
    Check("01", check_cached_decode, [cached_reference, cached_by_hand, cached_as_tensor], CACHED_DECODE_WRONG,
          model_fixture="tiny"),
    Check("02", check_chunk_mask, [mask_reference, mask_by_hand], CHUNK_MASK_WRONG),
    Check("03", check_kv_bytes_per_token, [kv_bytes, kv_bytes_prod, kv_bytes_tensor], KV_BYTES_WRONG),
    Check("03", check_paged_waste, [waste, waste_by_block_manager], PAGED_WASTE_WRONG),
    Check("04", check_slot_mapping, [slots, slots_paged_batch], SLOT_MAPPING_WRONG),
    Check("05", check_gather_kv, [gather, gather_by_slots, gather_loop], GATHER_KV_WRONG),
    Check("05", check_paged_decode_attention, [decode_attention, decode_attention_sdpa], DECODE_ATTENTION_WRONG),
    Check("06", check_schedule_step, [schedule_step, schedule_step_while, reference_schedule_step], SCHEDULE_WRONG),
    Check("07", check_top_p_filter, [top_p_filter, top_p_by_index, top_p_by_reference], TOP_P_WRONG),
    Check("08", check_block_hashes, [block_hashes, block_hashes_recursive, reference_block_hashes], BLOCK_HASH_WRONG),
    Check("08", check_cached_prefix_len, [cached_prefix_len, cached_prefix_len_while, reference_cached_prefix_len],
          CACHED_WRONG),
    Check("09", check_plan_chunks, [plan_chunks, plan_chunks_while, reference_plan_chunks], PLAN_WRONG),
    Check("10", check_choose_victim, [choose_victim, choose_victim_sorted, choose_victim_loop], VICTIM_WRONG,
          passes="match minivllm's scheduler"),
    Check("11", check_request_latencies, [request_latencies, request_latencies_numpy, reference_request_latencies],
          LATENCIES_WRONG, passes="match minivllm.bench"),
    Check("11", check_goodput, [goodput, bench_goodput], GOODPUT_WRONG, passes="match minivllm.bench.goodput"),
]

RIGHT = [pytest.param(c, fn, id=f"{c.chapter}-{c.name}-{fn.__name__}") for c in CHECKS for fn in c.right]
WRONG = [pytest.param(c, fn, (hints,) if isinstance(hints, str) else hints, id=f"{c.chapter}-{c.name}-{mistake}")
         for c in CHECKS for mistake, (fn, hints) in c.wrong.items()]


@pytest.mark.parametrize("c,fn", RIGHT)
def test_check_accepts_right_answer(c, fn, request, capsys):
    c.run(fn, request)
    out = capsys.readouterr().out
    assert f"check_{c.name}: all " in out and c.passes in out, out


@pytest.mark.parametrize("c,fn,hints", WRONG)
def test_check_names_wrong_answer(c, fn, hints, request):
    with pytest.raises(AssertionError) as err:
        c.run(fn, request)
    for hint in hints:
        assert re.search(hint, str(err.value)), f"{hint!r} not in the message:\n{err.value}"
