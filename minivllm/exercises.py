"""Checks for the exercise notebooks: the reader's function against the reference, one check per exercise.

Each check runs the reader's function on several small inputs, compares it
with minivllm's own implementation, and raises ``AssertionError`` naming the
input and the first place where the two differ; it prints one line when all pass.
"""

from __future__ import annotations

import functools

import torch

from minivllm.attention import causal_chunk_mask

__all__ = ["check_cached_decode", "check_chunk_mask"]


@functools.lru_cache(maxsize=1)
def _tiny_model():
    from minivllm.models import load_model

    return load_model("tiny-random", device="cpu")[0]


def _as_id_list(value, what: str) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise AssertionError(f"{what}: expected a flat list of token ids, got a tensor of shape {tuple(value.shape)}")
        return [int(t) for t in value.tolist()]
    try:
        return [int(t) for t in value]
    except TypeError:
        raise AssertionError(f"{what}: expected a list of token ids, got {type(value).__name__}") from None


# Chapter 01 ------------------------------------------------------------------------------------------

_DECODE_CASES = [  # (prompt ids, max_new_tokens): short, long, one-token prompt, a single new token
    ([1, 9690, 198, 2683, 359, 253, 5356], 8),
    ([504, 3575, 282, 4649, 314, 2, 198, 1, 520, 9531, 198, 1780, 314, 260, 3575, 282, 4649, 47], 12),
    ([42], 6),
    ([17, 29, 301], 1),
]


def check_cached_decode(fn, model=None) -> None:
    """Check ``fn(model, prompt_ids, max_new_tokens) -> list[int]``, KV-cached greedy decoding (chapter 01).

    The generated ids (prompt excluded, exactly ``max_new_tokens`` of them, no
    early stop) must equal :func:`~minivllm.simple_generation.generate_naive`
    on the seeded ``tiny-random`` model, and the function must feed each token
    through the model only once: the prompt at prefill, then one token per step.
    """
    from minivllm.simple_generation import generate_naive

    model = model if model is not None else _tiny_model()
    for i, (prompt, n) in enumerate(_DECODE_CASES):
        what = f"prompt #{i} ({len(prompt)} tokens: {prompt}), max_new_tokens={n}"
        expected = generate_naive(model, prompt, n).token_ids
        fed = [0]

        def count(_module, args):
            fed[0] += args[0].numel()

        hook = model.model.embed_tokens.register_forward_pre_hook(count)
        try:
            got = _as_id_list(fn(model, list(prompt), n), what)
        finally:
            hook.remove()
        if got[: len(prompt)] == prompt and len(got) == len(prompt) + n:
            raise AssertionError(f"{what}: return only the {n} generated ids, not the prompt followed by them")
        if len(got) != n:
            raise AssertionError(f"{what}: expected {n} generated ids, got {len(got)}: {got}")
        if got != expected:
            j = next(j for j, (e, g) in enumerate(zip(expected, got)) if e != g)
            hint = " (the first token comes from the prefill alone)" if j == 0 else (
                " (decode steps go wrong: is each new token fed at its own position, len(prompt) + step - 1,"
                " with the same cache the prefill filled?)")
            raise AssertionError(
                f"{what}: generated ids differ from naive greedy generation at token {j}: "
                f"expected {expected[j]}, got {got[j]}{hint}\n  expected {expected}\n  got      {got}")
        needed = len(prompt) + n - 1
        if fed[0] > len(prompt) + n:
            raise AssertionError(
                f"{what}: the tokens are right, but {fed[0]} tokens went through the model where a KV cache "
                f"needs {needed} (the prompt once, then only the newest token per step): "
                f"this recomputes the sequence instead of reusing the cache")
    print(f"check_cached_decode: all {len(_DECODE_CASES)} prompts give the naive greedy tokens, "
          f"each token through the model once.")


# Chapter 02 ------------------------------------------------------------------------------------------

def _mask_rows(m: torch.Tensor) -> str:
    return "\n".join("    " + "".join("1" if x else "." for x in row) for row in m.tolist())


def check_chunk_mask(fn) -> None:
    """Check ``fn(a, b) -> bool tensor [b - a, b]``, the causal mask of chunk ``[a, b)`` (chapter 02).

    Compared with :func:`minivllm.attention.causal_chunk_mask` for every
    ``0 <= a < b <= 12`` and a few larger chunks: type, dtype, shape, values.
    """
    cases = [(a, b) for b in range(1, 13) for a in range(b)] + [(0, 64), (100, 101), (37, 80)]
    for a, b in cases:
        what = f"chunk_mask({a}, {b})"
        expected = causal_chunk_mask(a, b)
        got = fn(a, b)
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
        if got.dtype != torch.bool:
            raise AssertionError(f"{what}: expected dtype torch.bool (True = may attend), got {got.dtype}")
        if tuple(got.shape) != tuple(expected.shape):
            raise AssertionError(
                f"{what}: expected shape {tuple(expected.shape)} (one row per query in the chunk, "
                f"one column per key in [0, {b})), got {tuple(got.shape)}")
        got = got.cpu()
        if not torch.equal(got, expected):
            i = int((got != expected).any(dim=1).nonzero()[0])
            j = int((got[i] != expected[i]).nonzero()[0])
            picture = f"\n  expected:\n{_mask_rows(expected)}\n  got:\n{_mask_rows(got)}" if b <= 16 else ""
            raise AssertionError(
                f"{what}: row {i} (the query at position {a + i}) differs first at key {j}: expected "
                f"{bool(expected[i, j])}, got {bool(got[i, j])}; the query at position p sees keys 0..p{picture}")
    print(f"check_chunk_mask: all {len(cases)} chunks [a, b) match causal_chunk_mask.")


# Chapter 03 ------------------------------------------------------------------------------------------

_KV_CONFIGS = [  # (name, layers, kv heads, head dim, bytes per element), from the published configs
    ("SmolLM2-135M, fp32", 30, 3, 64, 4),
    ("Llama-3-8B, bf16", 32, 8, 128, 2),
    ("Llama-2-7B (no GQA), fp16", 32, 32, 128, 2),
    ("Qwen2.5-7B, bf16", 28, 4, 128, 2),
    ("Llama-3-70B, fp8", 80, 8, 128, 1),
    ("one layer, one head, d=1, 1 byte", 1, 1, 1, 1),
]


def _is_integer(x) -> bool:
    import numbers

    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_kv_bytes_per_token(fn) -> None:
    """Check ``fn(num_layers, num_kv_heads, head_dim, dtype_bytes) -> int``, the KV bytes of one token (chapter 03).

    Compared with ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes``
    (K and V, every layer) on SmolLM2 and a few published model configs.
    """
    for name, layers, kvh, d, nbytes in _KV_CONFIGS:
        what = f"kv_bytes_per_token({layers}, {kvh}, {d}, {nbytes}) [{name}]"
        expected = 2 * layers * kvh * d * nbytes
        got = fn(layers, kvh, d, nbytes)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if not _is_integer(got):
            raise AssertionError(f"{what}: expected an int number of bytes, got {got!r} ({type(got).__name__})")
        got = int(got)
        if got == expected:
            continue
        hints = {expected // 2: "half the answer: a token stores a key AND a value in every layer",
                 expected * 8: "8 times the answer: count bytes, not bits",
                 expected // nbytes: "the element size is missing: multiply by dtype_bytes",
                 expected // layers: "one layer's worth: every layer keeps its own K and V",
                 expected // kvh: "one KV head's worth: multiply by num_kv_heads"}
        hint = hints.get(got, "it is 2 (K and V) x layers x KV heads x head dim x bytes per element")
        raise AssertionError(f"{what}: expected {expected:,} bytes, got {got:,}; {hint}")
    print(f"check_kv_bytes_per_token: all {len(_KV_CONFIGS)} model configs give the right bytes per token.")


_WASTE_CASES = [  # (lengths, block_size)
    ([5], 4), ([4], 4), ([1], 4), ([8, 9, 16, 17], 8), ([1, 1, 1], 1), ([100, 37, 64, 3, 250], 16),
    ([2047, 2048, 2049], 16), ([], 16),
]


def check_paged_waste(fn) -> None:
    """Check ``fn(lengths, block_size) -> int``: KV slots a paged pool reserves but leaves empty (chapter 03).

    A sequence of ``n`` tokens holds ``ceil(n / block_size)`` blocks, so its
    last block has ``ceil(n / block_size) * block_size - n`` empty slots.
    """
    for lengths, bs in _WASTE_CASES:
        what = f"paged_waste({lengths}, block_size={bs})"
        expected = sum(-(-n // bs) * bs - n for n in lengths)
        got = fn(list(lengths), bs)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if not _is_integer(got):
            raise AssertionError(f"{what}: expected an int number of token slots, got {got!r} ({type(got).__name__})")
        if int(got) != expected:
            per_seq = [-(-n // bs) * bs - n for n in lengths]
            hint = ""
            if int(got) == sum((n // bs + 1) * bs - n for n in lengths):
                hint = "; a length that is a multiple of block_size fills its last block exactly (use a ceiling division)"
            elif int(got) < 0 or int(got) == sum((n // bs) * bs - n for n in lengths):
                hint = "; round the block count UP: a partial block is still a whole block"
            raise AssertionError(f"{what}: expected {expected} empty slots (per sequence {per_seq}), got {got}{hint}")
    print(f"check_paged_waste: all {len(_WASTE_CASES)} workloads give the right number of empty slots.")


# Chapter 04 ------------------------------------------------------------------------------------------

_SLOT_CASES = [  # (block_table, start, end, block_size)
    ([7, 2, 9], 0, 10, 4),    # a whole prompt: three blocks, the last one half full
    ([7, 2, 9], 9, 10, 4),    # one decode token in the third block
    ([7, 2, 9], 3, 9, 4),     # a chunk that crosses two block boundaries
    ([3, 0, 5, 1], 4, 8, 4),  # exactly the second block
    ([5, 1, 4], 0, 3, 1),     # block_size 1: the table is the slot mapping
    ([11, 4], 16, 17, 16),    # first token of a fresh block
    ([0, 1, 2], 0, 12, 4),    # identity table: slot = token index
]


def check_slot_mapping(fn) -> None:
    """Check ``fn(block_table, start, end, block_size) -> list[int]``: KV slots of tokens ``[start, end)`` (chapter 04).

    Token ``i`` lives in physical block ``block_table[i // block_size]`` at
    offset ``i % block_size``: slot ``block * block_size + offset``. Compared
    with the slot mapping :class:`minivllm.attention.PagedBatch` builds.
    """
    from minivllm.attention import PagedBatch

    for table, start, end, bs in _SLOT_CASES:
        what = f"slot_mapping({table}, start={start}, end={end}, block_size={bs})"
        expected = PagedBatch([table], [end], [end - start], bs, "cpu").slot_mapping.tolist()
        got = _as_id_list(fn(list(table), start, end, bs), what)
        if got == expected:
            continue
        tokens = list(range(start, end))
        if len(got) != len(expected):
            hint = (f"; one slot per token in [{start}, {end})" + (" (not from token 0)" if len(got) == end else ""))
            raise AssertionError(f"{what}: expected {len(expected)} slot{'s' * (len(expected) != 1)}, "
                                 f"got {len(got)}: {got}{hint}")
        j = next(j for j, (e, g) in enumerate(zip(expected, got)) if e != g)
        i = tokens[j]
        candidates = {
            "the logical block i // block_size was used as the physical block: look it up in block_table":
                [t // bs * bs + t % bs for t in tokens],
            "a slot is block * block_size + offset: the block id was not multiplied by block_size":
                [table[t // bs] + t % bs for t in tokens],
            "the offset inside the block is i % block_size":
                [table[t // bs] * bs for t in tokens],
        }
        hint = next((h for h, c in candidates.items() if c == got and c != expected), "")
        raise AssertionError(
            f"{what}: token {i} (block_table[{i // bs}] = {table[i // bs]}, offset {i % bs}) should be in slot "
            f"{expected[j]}, got {got[j]}" + (f"; {hint}" if hint else "") +
            f"\n  expected {expected}\n  got      {got}")
    print(f"check_slot_mapping: all {len(_SLOT_CASES)} cases match PagedBatch's slot mapping.")


# Chapter 05 ------------------------------------------------------------------------------------------

_GATHER_CASES = [  # (num_blocks, block_size, kv_heads, head_dim, block_table, context_len)
    (8, 4, 2, 3, [5, 1, 6], 10),
    (8, 4, 2, 3, [3], 1),
    (8, 4, 1, 2, [7, 0], 8),       # context fills its blocks exactly
    (16, 2, 3, 4, [9, 2, 14, 0, 5], 9),
    (6, 1, 2, 2, [4, 1, 3], 3),    # block_size 1
]


def _gather_reference(pool, table, context_len):
    return pool[torch.tensor(table, dtype=torch.long)].flatten(0, 1)[:context_len]


def _pool(num_blocks, bs, kvh, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, bs, kvh, d, generator=g)


def check_gather_kv(fn) -> None:
    """Check ``fn(pool, block_table, context_len) -> [context_len, kv_heads, head_dim]`` (chapter 05).

    ``pool`` is one layer's K (or V) pool ``[num_blocks, block_size, kv_heads,
    head_dim]``; the result lists the sequence's keys in token order, read
    through its block table. A pure copy, so it must match exactly.
    """
    for n, (nb, bs, kvh, d, table, ctx) in enumerate(_GATHER_CASES):
        pool = _pool(nb, bs, kvh, d, seed=n)
        what = f"gather_kv(pool {list(pool.shape)}, block_table={table}, context_len={ctx})"
        expected = _gather_reference(pool, table, ctx)
        got = fn(pool.clone(), list(table), ctx)
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
        if tuple(got.shape) != tuple(expected.shape):
            hint = ""
            if got.dim() == 3 and got.shape[0] == len(table) * bs and ctx != len(table) * bs:
                hint = f" (the last block holds only {ctx - (len(table) - 1) * bs} real tokens: keep the first context_len)"
            elif got.dim() == 4:
                hint = " (flatten the block and offset axes into one token axis)"
            elif tuple(got.shape) == (kvh, ctx, d):
                hint = " (token axis first: [context_len, kv_heads, head_dim])"
            raise AssertionError(f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}{hint}")
        if torch.equal(got.cpu(), expected):
            continue
        tok = int((got.cpu() != expected).flatten(1).any(1).nonzero()[0])
        hint = ""
        if torch.equal(got.cpu(), pool.flatten(0, 1)[:ctx]):
            hint = "; it reads blocks 0, 1, 2... in order: the block table says which physical block holds each logical block"
        elif torch.equal(got.cpu(), _gather_reference(pool, sorted(table), ctx)):
            hint = "; the blocks come out sorted: keep the block table's order (it is token order)"
        raise AssertionError(
            f"{what}: token {tok} (logical block {tok // bs} = physical block {table[tok // bs]}, offset {tok % bs}) "
            f"differs{hint}")
    print(f"check_gather_kv: all {len(_GATHER_CASES)} block tables gather exactly the right keys.")


_DECODE_ATTN_CASES = [  # (num_blocks, block_size, heads, kv_heads, head_dim, block_table, context_len)
    (8, 4, 6, 2, 8, [5, 1, 6], 10),   # GQA: 3 query heads per KV head, last block partly filled
    (8, 4, 4, 4, 8, [2, 7], 8),       # plain multi-head attention, blocks full
    (8, 4, 9, 3, 16, [3], 1),         # the first decode token: one key
    (32, 16, 9, 3, 64, [30, 4, 17, 8], 50),  # SmolLM2's head layout
]


def _decode_attn_reference(q, k_pool, v_pool, table, ctx):
    from minivllm.attention import attend

    k = _gather_reference(k_pool, table, ctx).transpose(0, 1)  # [kv_heads, ctx, d]
    v = _gather_reference(v_pool, table, ctx).transpose(0, 1)
    mask = torch.ones(1, ctx, dtype=torch.bool)
    return attend(q[:, None, :], k, v, mask)[:, 0, :]


def _decode_attn_variants(q, k_pool, v_pool, table, ctx):
    """Plausible wrong answers, to name the mistake when a reader's result equals one of them."""
    h, d = q.shape
    kvh = k_pool.shape[2]
    group = h // kvh
    k = _gather_reference(k_pool, table, ctx)  # [ctx, kvh, d]
    v = _gather_reference(v_pool, table, ctx)

    def softmax_attn(keys, values, scale):  # keys/values [ctx, h, d]
        w = torch.softmax(torch.einsum("hd,thd->ht", q, keys) * scale, dim=-1)
        return torch.einsum("ht,thd->hd", w, values)

    out = {}
    if group > 1:
        out["query head h reads KV head h // group (repeat_interleave), not h % num_kv_heads (repeat)"] = \
            softmax_attn(k.repeat(1, group, 1), v.repeat(1, group, 1), d ** -0.5)
    rep = lambda x: x.repeat_interleave(group, dim=1)  # noqa: E731
    out["the scores need the 1 / sqrt(head_dim) scale"] = softmax_attn(rep(k), rep(v), 1.0)
    full = len(table) * k_pool.shape[1]
    if full != ctx:
        kf = _gather_reference(k_pool, table, full)
        vf = _gather_reference(v_pool, table, full)
        out["the empty slots after context_len in the last block were attended to"] = \
            softmax_attn(rep(kf), rep(vf), d ** -0.5)
    return out


def check_paged_decode_attention(fn) -> None:
    """Check ``fn(q [heads, d], k_pool, v_pool, block_table, context_len) -> [heads, d]`` (chapter 05).

    One decode token attends to its sequence's ``context_len`` keys, read
    through the block table, with grouped-query heads. Compared with the
    contiguous reference within 1e-5.
    """
    for n, (nb, bs, h, kvh, d, table, ctx) in enumerate(_DECODE_ATTN_CASES):
        g = torch.Generator().manual_seed(100 + n)
        q = torch.randn(h, d, generator=g)
        k_pool, v_pool = torch.randn(2, nb, bs, kvh, d, generator=g)
        what = (f"paged_decode_attention(q [{h}, {d}], pools [{nb}, {bs}, {kvh}, {d}], "
                f"block_table={table}, context_len={ctx})")
        expected = _decode_attn_reference(q, k_pool, v_pool, table, ctx)
        got = fn(q.clone(), k_pool.clone(), v_pool.clone(), list(table), ctx)
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
        if tuple(got.shape) != tuple(expected.shape):
            raise AssertionError(f"{what}: expected shape {tuple(expected.shape)} (one output per query head), "
                                 f"got {tuple(got.shape)}")
        got = got.detach().cpu().float()
        err = (got - expected).abs().max().item()
        if err <= 1e-5:
            continue
        hint = next((f"; {name}" for name, wrong in _decode_attn_variants(q, k_pool, v_pool, table, ctx).items()
                     if torch.allclose(got, wrong, atol=1e-5)), "")
        raise AssertionError(f"{what}: differs from the reference by up to {err:.3g} (tolerance 1e-5){hint}")
    print(f"check_paged_decode_attention: all {len(_DECODE_ATTN_CASES)} cases match contiguous attention within 1e-5.")


__all__ += ["check_kv_bytes_per_token", "check_paged_waste", "check_slot_mapping", "check_gather_kv",
            "check_paged_decode_attention"]


# Chapter 06 ------------------------------------------------------------------------------------------

def reference_schedule_step(running: list[str], waiting: list[tuple[str, int]], token_budget: int,
                            max_num_seqs: int) -> list[tuple[str, int]]:
    """One step of minivllm's own :class:`~minivllm.scheduler.Scheduler` on the exercise's simplified state.

    ``running`` are request ids that decode (one token each); ``waiting`` are
    ``(request id, prompt length)`` in arrival order. Plenty of KV blocks, no
    chunked prefill. Returns the step's batch as ``(request id, num_tokens)``.
    """
    from minivllm.block_manager import BlockManager
    from minivllm.config import EngineConfig
    from minivllm.sampling_params import SamplingParams
    from minivllm.scheduler import Scheduler
    from minivllm.sequence import Sequence, SequenceStatus

    config = EngineConfig(model="tiny-random", max_num_seqs=max_num_seqs, max_num_batched_tokens=token_budget)
    blocks = 2 * len(running) + sum(config.blocks_for(n) for _, n in waiting) + 1
    bm = BlockManager(blocks, config.block_size)
    scheduler = Scheduler(config, bm, max_model_len=10**6)
    params = SamplingParams(temperature=0.0, max_tokens=1000)
    for rid in running:  # a 4-token prompt and one generated token whose KV is not cached yet
        seq = Sequence(rid, [1, 2, 3, 4], params)
        seq.output_token_ids = [5]
        seq.cached_token_count = 4
        bm.allocate(seq, 5)
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
    for rid, n in waiting:
        scheduler.add(Sequence(rid, [1] * n, params))
    return [(c.seq.request_id, c.num_tokens) for c in scheduler.schedule().chunks]


_SCHEDULE_CASES = [  # (running, waiting, token_budget, max_num_seqs)
    (["a", "b"], [("c", 5), ("d", 3)], 16, 4),  # everything fits
    (["a", "b", "c"], [("d", 2), ("e", 2)], 64, 4),  # one seat left
    (["a", "b", "c"], [("d", 14)], 16, 8),  # the decodes use 3 of the 16 tokens: 14 do not fit
    (["a", "b"], [("c", 14)], 16, 8),  # exactly fills the budget: admitted
    ([], [("a", 10), ("b", 20), ("c", 2)], 24, 8),  # b does not fit: c may not overtake it
    ([], [("a", 8), ("b", 8), ("c", 1)], 16, 8),  # the budget is used up exactly
    (["a", "b"], [("c", 1)], 8, 2),  # no seat at all
    (["a", "b", "c"], [], 8, 4),  # nothing waiting
    ([], [], 8, 4),  # nothing at all
    ([], [("a", 3), ("b", 3), ("c", 3), ("d", 3)], 64, 3),  # seats run out before tokens
    (["x"], [("a", 7), ("b", 1)], 8, 4),  # a fills the budget to the last token, b waits
]


def _random_schedule_cases(num: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(num):
        seqs = rng.randint(1, 6)
        budget = rng.randint(seqs, 40)
        running = [f"r{i}" for i in range(rng.randint(0, seqs))]
        waiting = [(f"w{i}", rng.randint(1, budget)) for i in range(rng.randint(0, 6))]
        cases.append((running, waiting, budget, seqs))
    return cases


def _schedule_hint(running, waiting, budget, seqs, expected, got) -> str:
    got_ids = [rid for rid, _ in got]
    tokens = sum(n for _, n in got)
    if tokens > budget:
        return f"the batch holds {tokens} tokens, over token_budget={budget} (decode tokens count too)"
    if len(got) > seqs:
        return f"the batch holds {len(got)} requests, over max_num_seqs={seqs} (running requests hold seats too)"
    if got_ids[:len(running)] != list(running) and set(running) <= set(got_ids):
        return "decodes come first: every running request gets its 1 token before any waiting request"
    if not set(running) <= set(got_ids):
        return "every running request decodes 1 token in every step (they always fit)"
    prompt = dict(waiting)
    if any(rid in prompt and n != prompt[rid] for rid, n in got):
        return "a waiting request is admitted whole: num_tokens is its prompt length"
    admitted = [rid for rid in got_ids if rid in prompt]
    order = [rid for rid, _ in waiting]
    if admitted != order[:len(admitted)]:
        return ("first come, first served: stop at the first waiting request that does not fit, "
                "never skip it for a later, smaller one")
    if len(admitted) < len(order) and [rid for rid, _ in expected] != got_ids:
        rid = order[len(admitted)]
        return (f"{rid!r} fits ({tokens} + {prompt[rid]} <= {budget} tokens, "
                f"{len(got)} < {seqs} requests) but was not admitted")
    return "compare the batches above"


def check_schedule_step(fn) -> None:
    """Check ``fn(running, waiting, token_budget, max_num_seqs) -> [(request id, num_tokens), ...]`` (chapter 06).

    Compared with one step of minivllm's own scheduler
    (:func:`reference_schedule_step`) on hand-made cases and 60 random ones.
    """
    cases = _SCHEDULE_CASES + _random_schedule_cases(60)
    for running, waiting, budget, seqs in cases:
        what = f"schedule_step(running={running}, waiting={waiting}, token_budget={budget}, max_num_seqs={seqs})"
        expected = reference_schedule_step(running, waiting, budget, seqs)
        got = fn(list(running), [tuple(w) for w in waiting], budget, seqs)
        try:
            got = [(str(rid), int(n)) for rid, n in got]
        except (TypeError, ValueError):
            raise AssertionError(f"{what}: expected a list of (request id, num_tokens) pairs, got {got!r}") from None
        if got != expected:
            raise AssertionError(f"{what}:\n  expected {expected}\n  got      {got}\n  "
                                 f"{_schedule_hint(running, waiting, budget, seqs, expected, got)}")
    print(f"check_schedule_step: all {len(cases)} cases match minivllm's scheduler.")


# Chapter 07 ------------------------------------------------------------------------------------------

def reference_top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """minivllm's top-p on a probability vector: :func:`~minivllm.sampler.apply_top_k_top_p` on its logs, in float64."""
    from minivllm.sampler import apply_top_k_top_p

    logits = probs.double().log()[None]
    filtered = apply_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([p], dtype=torch.float64))
    return filtered.softmax(dim=-1)[0]


def _top_p_cases():
    g = torch.Generator().manual_seed(0)
    hand = torch.tensor([0.05, 0.5, 0.1, 0.2, 0.15])  # deliberately not sorted
    cases = [(hand, p) for p in (0.3, 0.6, 0.76, 0.9, 0.99, 1.0)]
    for n, sharp in ((8, 1.0), (50, 3.0), (1000, 2.0)):
        probs = (torch.randn(n, generator=g) * sharp).softmax(dim=-1)
        cases += [(probs, p) for p in (0.05, 0.5, 0.9, 0.95)]
    return cases


def check_top_p_filter(fn) -> None:
    """Check ``fn(probs, p) -> probs``, nucleus (top-p) filtering of a 1-D probability vector (chapter 07).

    The result must keep the smallest set of most likely tokens whose mass
    reaches ``p`` (so the most likely token always stays), zero the others,
    renormalise to sum 1, keep the input's shape and leave the input unchanged.
    Compared with minivllm's :func:`~minivllm.sampler.apply_top_k_top_p`.
    """
    cases = _top_p_cases()
    for probs, p in cases:
        what = f"top_p_filter(probs of {probs.numel()} tokens, p={p})"
        if probs.numel() <= 8:
            what = f"top_p_filter({[round(x, 4) for x in probs.tolist()]}, p={p})"
        before = probs.clone()
        got = fn(probs, p)
        if not torch.equal(probs, before):
            raise AssertionError(f"{what}: the input tensor was modified in place; return a new tensor")
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
        if tuple(got.shape) != tuple(probs.shape):
            raise AssertionError(f"{what}: expected shape {tuple(probs.shape)}, got {tuple(got.shape)}")
        got = got.detach().double().cpu()
        expected = reference_top_p(probs, p)
        keep, kept = expected > 0, got > 0
        if not torch.equal(keep, kept):
            order = probs.argsort(descending=True)
            rank = {int(t): r for r, t in enumerate(order)}
            want = sorted(rank[int(t)] for t in keep.nonzero().flatten())
            have = sorted(rank[int(t)] for t in kept.nonzero().flatten())
            cum = probs.double()[order].cumsum(0)
            hint = ""
            if not have:
                hint = "; nothing kept: the most likely token always survives"
            elif have != list(range(len(have))):
                hint = "; keep the most likely tokens: sort by probability first"
            elif len(have) == len(want) - 1:
                hint = (f"; you dropped the token that makes the mass reach p: the top {len(have)} hold only "
                        f"{cum[len(have) - 1]:.4f} < p, so the next most likely token is needed too")
            elif len(have) == len(want) + 1:
                hint = f"; one token too many: the top {len(want)} already hold {cum[len(want) - 1]:.4f} >= p"
            n = len(have)
            raise AssertionError(f"{what}: keeps {n} token{'s' * (n != 1)}, expected the top {len(want)} "
                                 f"(ranks kept, 0 = most likely: {have[:12]}{'...' if n > 12 else ''}){hint}")
        if abs(float(got.sum()) - 1) > 1e-5:
            raise AssertionError(f"{what}: the kept tokens are right but sum to {float(got.sum()):.6f}; "
                                 f"renormalise so the result is a distribution (sum 1)")
        if not torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
            i = int((got - expected).abs().argmax())
            raise AssertionError(f"{what}: token {i} has probability {float(got[i]):.6f}, expected "
                                 f"{float(expected[i]):.6f} (its original probability divided by the kept mass)")
    print(f"check_top_p_filter: all {len(cases)} cases match minivllm's top-p filter.")


__all__ += ["check_schedule_step", "reference_schedule_step", "check_top_p_filter", "reference_top_p"]


# Chapter 08 ------------------------------------------------------------------------------------------

def reference_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chain hashes minivllm's :class:`~minivllm.block_manager.BlockManager` registers for a computed prompt.

    A real block manager allocates the prompt, marks its KV as written and
    registers its full blocks; the hashes are read back in block order.
    """
    from minivllm.block_manager import BlockManager
    from minivllm.sampling_params import SamplingParams
    from minivllm.sequence import Sequence

    tokens = list(token_ids)
    full = len(tokens) // block_size
    if not tokens:
        return []
    bm = BlockManager(-(-len(tokens) // block_size), block_size, enable_prefix_caching=True)
    seq = Sequence("reference", tokens, SamplingParams(temperature=0.0, max_tokens=1))
    bm.allocate(seq, len(tokens))
    seq.cached_token_count = len(tokens)  # as if the model had written the prompt's KV
    bm.register_computed_blocks(seq)
    return [bm.block_hash[block] for block in seq.block_table[:full]]


def reference_cached_prefix_len(token_ids: list[int], block_size: int, cached: set[int]) -> int:
    """Prompt tokens served from a prefix cache holding the chain hashes ``cached`` (chapter 08).

    Walk the full blocks in order and stop at the first whose hash is not
    cached; never count the block holding the last prompt token, whose logits
    the first output token needs. (The engine also confirms each hit by the
    block's tokens and parent; with no hash collisions that changes nothing.)
    """
    hashes = reference_block_hashes(token_ids, block_size)[: (len(token_ids) - 1) // block_size]
    hits = 0
    for h in hashes:
        if h not in cached:
            break
        hits += 1
    return hits * block_size


def _call(fn, what, *args):
    try:
        return fn(*args)
    except TypeError as e:
        if "unhashable" in str(e):
            raise AssertionError(f"{what}: {e}: pass a block's tokens as a tuple, "
                                 f"BlockManager.chain_hash(parent_hash, tuple(block_tokens))") from None
        raise


def _random_ids(rng, n: int) -> list[int]:
    return [rng.randrange(1, 49152) for _ in range(n)]


def _block_hash_cases():
    import random

    rng = random.Random(8)
    shared = _random_ids(rng, 8)
    cases = [(list(range(100, 110)), 4), (list(range(100, 112)), 4), ([], 4), ([5, 6, 7], 4), ([9] * 12, 4),
             ([3, 1, 4, 1, 5], 1), (shared + [1, 2, 3], 4), (shared + [7, 7, 7, 7, 8], 4), (_random_ids(rng, 40), 16)]
    cases += [(_random_ids(rng, rng.randint(0, 30)), rng.choice([2, 3, 4, 8])) for _ in range(20)]
    return cases


def _hash_hint(tokens, bs, expected, got) -> str:
    from minivllm.block_manager import BlockManager

    h = BlockManager.chain_hash
    blocks = [tuple(tokens[i * bs:(i + 1) * bs]) for i in range(-(-len(tokens) // bs))]
    if len(got) == len(blocks) and len(blocks) > len(expected):
        return "only full blocks get a hash: the last, partial block is still being filled"
    if len(got) != len(expected):
        return f"one hash per full block: {len(tokens)} tokens in blocks of {bs} make {len(expected)} full blocks"
    if got == [h(None, b) for b in blocks[: len(expected)]]:
        return "chain the hashes: each block's parent is the previous block's hash (None for the first block)"
    if got == [hash(b) for b in blocks[: len(expected)]] or got == [hash(tuple(tokens[:(i + 1) * bs]))
                                                                  for i in range(len(expected))]:
        return "use BlockManager.chain_hash(parent_hash, block_tokens), as the block manager does"
    return "compare the lists above"


def check_block_hashes(fn) -> None:
    """Check ``fn(token_ids, block_size) -> list[int]``, the prefix cache's chain hashes (chapter 08).

    One hash per full block, in order, ``BlockManager.chain_hash(parent, tokens)``
    with the previous block's hash as parent; compared with what minivllm's
    block manager registers for the same prompt.
    """
    cases = _block_hash_cases()
    for tokens, bs in cases:
        what = f"block_hashes({tokens if len(tokens) <= 16 else f'<{len(tokens)} tokens>'}, block_size={bs})"
        got = _call(fn, what, list(tokens), bs)
        try:
            got = [int(x) for x in got]
        except (TypeError, ValueError):
            raise AssertionError(f"{what}: expected a list of int hashes, got {got!r}") from None
        expected = reference_block_hashes(tokens, bs)
        if got != expected:
            raise AssertionError(f"{what}:\n  expected {expected}\n  got      {got}\n  "
                                 f"{_hash_hint(tokens, bs, expected, got)}")
    print(f"check_block_hashes: all {len(cases)} cases match minivllm's block manager.")


def _cached_prefix_cases():
    import random

    rng = random.Random(9)
    bs = 4
    first = _random_ids(rng, 12)  # exactly 3 blocks
    second = first[:6] + _random_ids(rng, 9)  # shares block 0, diverges inside block 1
    cached = set(reference_block_hashes(first, bs)) | set(reference_block_hashes(second, bs))
    h0, _, h2 = reference_block_hashes(first, bs)
    cases = [
        (first, bs, cached),  # the whole prompt is cached: its last block is computed anyway
        (first + [5], bs, cached),  # one more token: all 3 blocks hit
        (first + _random_ids(rng, 6), bs, cached),
        (first[:9], bs, cached),
        (first[:8], bs, cached),  # exactly 2 blocks: only 1 may hit
        (first[:4] + [1, 2, 3, 4, 5], bs, cached),  # diverges at block 1
        (second, bs, cached),
        (_random_ids(rng, 10), bs, cached),  # unrelated
        (first + [5], bs, set()),  # empty cache
        ([first[0]], bs, cached),  # a one-token prompt
        (first[:5], bs, cached),  # block 0 and one more token
        (first + [5], bs, {h0, h2}),  # block 1 missing: block 2 may not hit, though its hash is there
        (first + [5], 1, set(reference_block_hashes(first, 1))),
    ]
    for _ in range(20):
        n = rng.randint(1, 24)
        base = first + second
        prompt = base[:rng.randint(0, n)] + _random_ids(rng, rng.randint(0, 6)) or [7]
        cases.append((prompt, bs, cached))
    return cases


def check_cached_prefix_len(fn) -> None:
    """Check ``fn(token_ids, block_size, cached) -> int``, the prompt tokens a prefix cache serves (chapter 08).

    ``cached`` is the set of chain hashes in the cache. Compared with
    :func:`reference_cached_prefix_len`, which the tests hold equal to the
    block manager's own ``match_prefix``.
    """
    cases = _cached_prefix_cases()
    for tokens, bs, cached in cases:
        what = (f"cached_prefix_len({tokens if len(tokens) <= 16 else f'<{len(tokens)} tokens>'}, block_size={bs}, "
                f"cached=<{len(cached)} hashes>)")
        got = _call(fn, what, list(tokens), bs, set(cached))
        if not _is_integer(got):
            raise AssertionError(f"{what}: expected an int number of tokens, got {got!r}")
        expected = reference_cached_prefix_len(tokens, bs, cached)
        if got == expected:
            continue
        hashes = reference_block_hashes(tokens, bs)
        walk = 0
        while walk < len(hashes) and hashes[walk] in cached:
            walk += 1
        anywhere = sum(h in cached for h in hashes)
        if got == expected // bs and expected:
            hint = "return a number of tokens, not of blocks"
        elif got == walk * bs and walk * bs > expected:
            hint = (f"the last prompt token is never served from the cache (the first output token needs its "
                    f"logits): only the full blocks before it, (len - 1) // block_size = {(len(tokens) - 1) // bs}, "
                    f"may hit")
        elif got % bs:
            hint = f"only whole blocks are cached: the answer is a multiple of block_size={bs}"
        elif got >= anywhere * bs > walk * bs or got > walk * bs:
            hint = "stop at the first block that misses: later blocks cannot be used without the ones before"
        else:
            hint = f"{walk} leading block(s) of {bs} tokens are in the cache"
        raise AssertionError(f"{what}: expected {expected}, got {got}; {hint}")
    print(f"check_cached_prefix_len: all {len(cases)} cases match minivllm's prefix cache.")


# Chapter 09 ------------------------------------------------------------------------------------------

def reference_plan_chunks(prompt_len: int, num_cached: int, chunk_size: int) -> list[tuple[int, int]]:
    """The prefill chunks ``(start, end)`` minivllm's :class:`~minivllm.scheduler.Scheduler` runs (chapter 09).

    One request alone, ``num_cached`` prompt tokens already in the cache, a
    token budget that never binds: the scheduler is stepped until the prompt
    is prefilled and the chunks it scheduled are returned.
    """
    from minivllm.block_manager import BlockManager
    from minivllm.config import EngineConfig
    from minivllm.sampling_params import SamplingParams
    from minivllm.scheduler import Scheduler
    from minivllm.sequence import Sequence

    config = EngineConfig(model="tiny-random", max_num_seqs=1, max_num_batched_tokens=chunk_size,
                          enable_chunked_prefill=True, max_prefill_chunk_size=chunk_size)
    bm = BlockManager(config.blocks_for(prompt_len) + 1, config.block_size)
    scheduler = Scheduler(config, bm, max_model_len=prompt_len + 1)
    seq = Sequence("reference", [1] * prompt_len, SamplingParams(temperature=0.0, max_tokens=1))
    if num_cached:  # as a prefix-cache hit leaves it: blocks in the table, KV written
        bm.allocate(seq, num_cached)
        seq.cached_token_count = num_cached
    scheduler.add(seq)
    chunks = []
    while not seq.is_finished:
        out = scheduler.schedule()
        chunks += [(c.start, c.end) for c in out.chunks]
        scheduler.update(out, [0] * sum(c.samples for c in out.chunks))
    return chunks


_PLAN_CASES = [  # (prompt_len, num_cached, chunk_size)
    (7, 0, 3), (12000, 8000, 1000), (10, 0, 10), (10, 0, 11), (1, 0, 4), (17, 16, 4), (33, 16, 16),
    (20, 6, 8), (5, 0, 1), (100, 37, 25), (64, 0, 16), (9, 8, 100),
]


def _random_plan_cases(num: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(num):
        n = rng.randint(1, 300)
        cases.append((n, rng.choice([0, rng.randint(0, n - 1)]), rng.randint(1, 64)))
    return cases


def _plan_hint(n, cached, chunk, expected, got) -> str:
    if not got:
        return "every prompt needs at least one chunk: the one that ends at the last token"
    if got[0][0] != cached:
        return (f"start at num_cached={cached}: the cached prefix is not computed again"
                if got[0][0] == 0 else f"the first chunk starts at num_cached={cached}")
    if any(b - a > chunk for a, b in got):
        return f"no chunk may hold more than chunk_size={chunk} tokens"
    if [(a, b + 1) for a, b in got] == expected:
        return "end is exclusive: a chunk (start, end) holds tokens start, ..., end - 1"
    if any(a != b for (_, a), (b, _) in zip(got, got[1:])):
        return "each chunk starts where the previous one ended"
    if got[-1][1] != n:
        return f"the last chunk ends exactly at prompt_len={n}"
    if len(got) > len(expected):
        return "chunks are counted from num_cached, full chunk_size each, not aligned to multiples of chunk_size"
    return "compare the lists above"


def check_plan_chunks(fn) -> None:
    """Check ``fn(prompt_len, num_cached, chunk_size) -> [(start, end), ...]``, a prompt's prefill chunks (chapter 09).

    Compared with the chunks minivllm's scheduler actually runs for one
    request (:func:`reference_plan_chunks`) on hand-made cases and 60 random ones.
    """
    cases = _PLAN_CASES + _random_plan_cases(60)
    for n, cached, chunk in cases:
        what = f"plan_chunks(prompt_len={n}, num_cached={cached}, chunk_size={chunk})"
        got = fn(n, cached, chunk)
        try:
            got = [(int(a), int(b)) for a, b in got]
        except (TypeError, ValueError):
            raise AssertionError(f"{what}: expected a list of (start, end) pairs, got {got!r}") from None
        expected = reference_plan_chunks(n, cached, chunk)
        if got != expected:
            show = lambda x: str(x) if len(x) <= 8 else f"{x[:4]} ... {x[-2:]} ({len(x)} chunks)"  # noqa: E731
            raise AssertionError(f"{what}:\n  expected {show(expected)}\n  got      {show(got)}\n  "
                                 f"{_plan_hint(n, cached, chunk, expected, got)}")
    print(f"check_plan_chunks: all {len(cases)} cases match minivllm's scheduler.")


__all__ += ["check_block_hashes", "reference_block_hashes", "check_cached_prefix_len", "reference_cached_prefix_len",
            "check_plan_chunks", "reference_plan_chunks"]
# -- end of the chapters 08-09 section --


# Chapter 10 ------------------------------------------------------------------------------------------

def _victim_cases(num: int = 80, seed: int = 0):
    """Lists of candidate sequences: (priority, arrival) pairs, list order shuffled so it is not arrival order."""
    import random

    hand = [
        [(0, 1.0), (0, 2.0), (0, 3.0)],  # FCFS: the newest goes
        [(0, 3.0), (0, 1.0), (0, 2.0)],  # the newest is not the last in the list
        [(1, 1.0), (0, 2.0), (0, 3.0)],  # the worst priority goes even though it came first
        [(0, 1.0), (5, 0.5), (2, 9.0)],
        [(0, 4.0)],  # a lone candidate: the requester preempts itself
        [(3, 1.0), (3, 2.0), (0, 5.0), (1, 6.0)],
    ]
    rng = random.Random(seed)
    cases = list(hand)
    for _ in range(num):
        n = rng.randint(1, 7)
        arrivals = rng.sample(range(1, 100), n)
        cases.append([(rng.randint(0, 3), float(a)) for a in arrivals])
    return cases


def _victim_seqs(case):
    from minivllm.sampling_params import SamplingParams
    from minivllm.sequence import Sequence

    return [Sequence(f"s{i}", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4), priority=p, arrival_time=a)
            for i, (p, a) in enumerate(case)]


def reference_choose_victim(candidates):
    """The victim minivllm's :meth:`Scheduler.choose_victim <minivllm.scheduler.Scheduler.choose_victim>` picks
    among ``candidates`` (every one of them allowed: unprotected, not yet scheduled this step)."""
    from minivllm.block_manager import BlockManager
    from minivllm.config import EngineConfig
    from minivllm.scheduler import Scheduler

    sched = Scheduler(EngineConfig(model="tiny-random", num_blocks=1), BlockManager(1, 16), max_model_len=100)
    sched.running = list(candidates)
    return sched.choose_victim(candidates[0], scheduled=set())


def _victims_in_simulation(fn):
    """Per step, the request ids preempted when the scheduler asks ``fn`` (None: the engine's own choice)."""
    from minivllm.bench import sim_sequence, simulate_schedule
    from minivllm.scheduler import Scheduler

    class PluggedScheduler(Scheduler):
        def choose_victim(self, requester, scheduled):
            allowed = [s for s in self.running if id(s) not in scheduled
                       and (s is requester or s.protected_until_step <= self.step_index)]
            return fn(list(allowed))

    runs = []
    for protection, policy in ((0, "fcfs"), (4, "fcfs"), (2, "priority")):
        seqs = [sim_sequence(f"r{i}", p, m, priority=(i * 7) % 3 if policy == "priority" else 0,
                             arrival=float(i), first_token=100 * i + 1)
                for i, (p, m) in enumerate([(3, 29), (3, 12), (12, 28), (1, 20), (5, 9)])]
        trace = simulate_schedule(seqs, num_blocks=26, block_size=2, max_steps=2000, max_num_seqs=5,
                                  preemption_protection_steps=protection, scheduling_policy=policy,
                                  scheduler_cls=None if fn is None else PluggedScheduler)
        runs.append(trace.preempted)
    return runs


def check_choose_victim(fn) -> None:
    """Check ``fn(candidates) -> Sequence``, the preemption victim among running sequences (chapter 10).

    The victim is the lowest-priority one (the largest ``priority`` value: lower
    runs first) and, among those, the latest arrival (``metrics.arrival_time``).
    Compared with minivllm's scheduler on hand-made and random candidate lists,
    then plugged into the real scheduler on a squeezed pool: the same requests
    must be preempted in the same steps.
    """
    cases = _victim_cases()
    for case in cases:
        seqs = _victim_seqs(case)
        given = list(seqs)
        what = "choose_victim([" + ", ".join(f"(priority={p}, arrival={a:g})" for p, a in case) + "])"
        got = fn(given)
        if given != seqs:
            raise AssertionError(f"{what}: the list was changed; pick a victim without reordering or removing "
                                 f"anything (the scheduler's running list keeps admission order)")
        expected = reference_choose_victim(seqs)
        if not any(got is s for s in seqs):
            raise AssertionError(f"{what}: expected one of the candidates (a Sequence), got {got!r}")
        if got is not expected:
            show = lambda s: f"(priority={s.priority}, arrival={s.metrics.arrival_time:g})"  # noqa: E731
            worst = max(s.priority for s in seqs)
            if got.priority < worst:
                hint = (f"lower priority values run first, so the victim has the largest value ({worst}); "
                        f"you picked priority {got.priority}")
            elif got.metrics.arrival_time < expected.metrics.arrival_time:
                hint = "among equal priorities evict the latest arrival: it has waited least and lost least"
            else:
                hint = "compare by (priority, arrival_time), both largest first"
            raise AssertionError(f"{what}:\n  expected {show(expected)}\n  got      {show(got)}\n  {hint}")
    if _victims_in_simulation(fn) != _victims_in_simulation(None):
        raise AssertionError("plugged into the scheduler, your choose_victim preempts different requests in "
                             "different steps than minivllm's")
    print(f"check_choose_victim: all {len(cases)} cases and 3 scheduler runs match minivllm's scheduler.")


__all__ += ["check_choose_victim", "reference_choose_victim"]
# -- end of the chapter 10 section --


# Chapter 11 ------------------------------------------------------------------------------------------

def reference_request_latencies(arrival_time: float, token_times: list[float]) -> dict:
    """One request's TTFT, TPOT, ITL and E2E (seconds), as :mod:`minivllm.bench.metrics` defines them (vLLM's)."""
    from minivllm.bench import RequestTimes, e2e, itl, tpot, ttft

    r = RequestTimes(arrival_time, list(token_times))
    return {"ttft": ttft(r), "tpot": tpot(r), "itl": itl(r), "e2e": e2e(r)}


def _latency_cases(num: int = 40, seed: int = 0) -> list[tuple[float, list[float]]]:
    """(arrival time, token times): even and uneven gaps, one and two tokens, equal stamps, large clock values."""
    import random

    hand = [
        (0.0, [0.25, 0.5, 0.75, 1.0]),
        (1.0, [1.5, 1.625, 2.5, 2.625]),  # one long stall in the middle
        (2.0, [2.5]),  # a single token: no gap, no TPOT
        (0.0, [0.125, 0.375]),
        (0.25, [0.5, 0.5, 0.75]),  # a static batch stamps rows at the same moment: a zero gap is fine
        (1000.0, [1000.5, 1001.0, 1001.25, 1002.0, 1002.125]),  # perf_counter times are large numbers
    ]
    rng = random.Random(seed)
    cases = list(hand)
    for _ in range(num):
        arrival = rng.uniform(0, 50)
        t = arrival + rng.expovariate(5.0)
        times = []
        for _ in range(rng.randint(1, 12)):
            times.append(t)
            t += rng.expovariate(20.0)
        cases.append((arrival, times))
    return cases


def _close(a, b) -> bool:
    import math

    if a is None or b is None:
        return a is None and b is None
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    except (TypeError, ValueError):
        return False


def _wrong_latencies(a: float, t: list[float]) -> dict:
    """Plausible mistakes, keyed by field, each with the hint that names it."""
    n = len(t)
    return {
        "ttft": [(t[0], "TTFT counts from the arrival: token_times[0] - arrival_time")],
        "e2e": [(t[-1] - t[0], "E2E runs from the arrival to the last token (TTFT included)"),
                (t[-1], "E2E counts from the arrival: token_times[-1] - arrival_time")],
        "tpot": [((t[-1] - t[0]) / n, "TPOT divides the time after the first token by the n - 1 gaps, not by n tokens"),
                 ((t[-1] - a) / n, "TPOT leaves the first token out (TTFT already counts the prefill): "
                                   "(t_n - t_1) / (n - 1)"),
                 ((t[-1] - a) / max(n - 1, 1), "TPOT leaves the wait for the first token out: (t_n - t_1) / (n - 1)"),
                 (0.0, "with one token there is no gap: TPOT is None (vLLM leaves such a request out of TPOT)")],
        "itl": [([b - x for x, b in zip([a] + t, t)], "ITL are the gaps *between* output tokens, n - 1 of them; "
                                                     "the wait for the first token is TTFT, not an ITL")],
    }


def check_request_latencies(fn) -> None:
    """Check ``fn(arrival_time, token_times) -> dict`` with keys ``ttft``, ``tpot``, ``itl``, ``e2e`` (chapter 11).

    ``token_times`` are the moments (seconds) the request's output tokens
    appeared, the first included; TPOT is None for a one-token request, ITL a
    list of ``n - 1`` gaps. Compared with :mod:`minivllm.bench.metrics` (vLLM's
    definitions) on hand-made and random requests.
    """
    cases = _latency_cases()
    for arrival, times in cases:
        what = f"request_latencies(arrival_time={arrival:g}, token_times=[{', '.join(f'{x:g}' for x in times)}])"
        expected = reference_request_latencies(arrival, times)
        try:
            got = fn(arrival, list(times))
        except ZeroDivisionError:
            raise AssertionError(f"{what}: ZeroDivisionError; with one token there is no gap, so TPOT is None") from None
        if not isinstance(got, dict) or not set(expected) <= set(got):
            raise AssertionError(f"{what}: expected a dict with keys {sorted(expected)}, got {got!r}")
        for key in ("ttft", "e2e", "tpot", "itl"):
            want, have = expected[key], got[key]
            if key == "itl":
                ok = isinstance(have, (list, tuple)) and len(have) == len(want) and all(map(_close, have, want))
            else:
                ok = _close(have, want)
            if ok:
                continue
            hint = "see the definitions at the top of the notebook"
            wrongs = _wrong_latencies(arrival, times)[key]
            if key == "tpot" and want is None:
                wrongs = wrongs[-1:]  # one token: whatever came back, the answer is None
                hint = wrongs[0][1]
            for value, h in wrongs:
                same = (isinstance(have, (list, tuple)) and len(have) == len(value) and all(map(_close, have, value))
                        if key == "itl" else _close(have, value))
                if same:
                    hint = h
                    break
            raise AssertionError(f"{what}: {key}\n  expected {want!r}\n  got      {have!r}\n  {hint}")
    print(f"check_request_latencies: all {len(cases)} requests match minivllm.bench (vLLM's definitions).")


def _goodput_requests():
    """Requests with known TTFT and TPOT (exact binary fractions, so limits can sit exactly on them)."""
    from minivllm.bench import RequestTimes

    return [
        RequestTimes(0.0, [0.25, 0.5, 0.75]),  # TTFT 0.25, TPOT 0.25
        RequestTimes(0.0, [0.5, 0.625, 0.75]),  # TTFT 0.5, TPOT 0.125
        RequestTimes(0.0, [0.125]),  # one token: TTFT 0.125, no TPOT
        RequestTimes(0.25, []),  # still waiting: not finished, never counts
        RequestTimes(0.5, [0.75, 1.75]),  # TTFT 0.25, TPOT 1.0
        RequestTimes(0.0, [1.0, 1.25]),  # TTFT 1.0, TPOT 0.25
    ]


_GOODPUT_LIMITS = [(None, None), (0.25, None), (None, 0.5), (None, 0.25), (0.25, 0.25), (0.5, 0.125), (0.0, None),
                   (None, 0.0)]  # in an order where each mistake first shows up alone


def _goodput_cases(num: int = 30, seed: int = 0):
    """(requests, duration, ttft_limit, tpot_limit): limits on, off, exactly at a request's value, and random runs."""
    import random

    from minivllm.bench import RequestTimes

    hand = _goodput_requests()
    cases = [(hand, 2.0, ttft_l, tpot_l) for ttft_l, tpot_l in _GOODPUT_LIMITS]
    rng = random.Random(seed)
    for _ in range(num):
        reqs = []
        for _ in range(rng.randint(1, 10)):
            a = rng.uniform(0, 5)
            times = sorted(a + rng.uniform(0.01, 1.0) + rng.uniform(0, 2) * i / 10 for i in range(rng.randint(0, 8)))
            reqs.append(RequestTimes(a, times))
        cases.append((reqs, rng.uniform(5, 20), rng.choice([None, 0.3, 0.6]), rng.choice([None, 0.05, 0.1])))
    return cases


def _wrong_goodputs(requests, duration, ttft_limit, tpot_limit):
    """What plausible mistakes return, each with the hint that names it."""
    import operator

    from minivllm.bench import goodput, tpot, ttft

    done = [r for r in requests if r.token_times]

    def count(le, one_token_fails=False, none_is_zero=False, keep_unfinished=False):
        tl = 0.0 if none_is_zero and ttft_limit is None else ttft_limit
        pl = 0.0 if none_is_zero and tpot_limit is None else tpot_limit
        n = 0
        for r in done:
            t = tpot(r)
            ok = (tl is None or le(ttft(r), tl)) and (pl is None or (t is None and not one_token_fails)
                                                        or (t is not None and le(t, pl)))
            n += ok
        return n + (len(requests) - len(done) if keep_unfinished else 0)

    right = goodput(requests, duration, ttft_limit, tpot_limit)
    return [
        (right * duration, "goodput is a rate: the requests on time divided by the duration (per second)"),
        (count(operator.lt) / duration, "a request exactly at the limit is on time: compare with <="),
        (count(operator.le, one_token_fails=True) / duration,
         "a one-token request has no TPOT, so it cannot miss a TPOT limit"),
        (count(operator.le, keep_unfinished=True) / duration,
         "a request with no tokens has not finished: leave it out"),
        (count(operator.le, none_is_zero=True) / duration, "a limit of None means no limit on that metric"),
        (len(done) / duration, "check every limit: a request counts only if it meets all of them"),
    ]


def check_goodput(fn) -> None:
    """Check ``fn(requests, duration, ttft_limit=None, tpot_limit=None) -> float``, vLLM's goodput (chapter 11).

    The finished requests (at least one token) per second of ``duration``
    whose TTFT is at most ``ttft_limit`` and whose TPOT is at most
    ``tpot_limit`` (None: no limit; a one-token request has no TPOT and passes
    it). ``requests`` have ``arrival_time`` and ``token_times``. Compared with
    :func:`minivllm.bench.goodput`.
    """
    from minivllm.bench import goodput

    cases = _goodput_cases()
    for k, (requests, duration, ttft_limit, tpot_limit) in enumerate(cases):
        what = (f"case {k}: {len(requests)} requests, duration {duration:g} s, ttft_limit={ttft_limit}, "
                f"tpot_limit={tpot_limit}")
        if k < len(_GOODPUT_LIMITS):
            what += " (requests: " + "; ".join(f"arrival {r.arrival_time:g}, tokens at {r.token_times}"
                                                for r in requests) + ")"
        expected = goodput(requests, duration, ttft_limit, tpot_limit)
        try:
            got = fn(list(requests), duration, ttft_limit=ttft_limit, tpot_limit=tpot_limit)
        except (IndexError, ValueError, ZeroDivisionError) as e:
            raise AssertionError(f"{what}: {type(e).__name__}: {e}\n  a request with no tokens has not finished: "
                                 f"leave it out before computing its TTFT (and a one-token request has no TPOT)") from None
        if _close(got, expected):
            continue
        hint = next((h for value, h in _wrong_goodputs(requests, duration, ttft_limit, tpot_limit)
                     if _close(got, value)), "count the finished requests that meet every limit, per second")
        raise AssertionError(f"{what}:\n  expected {expected!r} requests/s\n  got      {got!r}\n  {hint}")
    print(f"check_goodput: all {len(cases)} cases match minivllm.bench.goodput.")


__all__ += ["check_request_latencies", "reference_request_latencies", "check_goodput"]
# -- end of the chapter 11 section --
