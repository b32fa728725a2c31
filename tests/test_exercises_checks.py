"""The exercise checks accept the reference and reject plausible wrong answers."""

import pytest
import torch

from minivllm.attention import ContiguousKVCache, NoCache, causal_chunk_mask
from minivllm.exercises import check_cached_decode, check_chunk_mask
from minivllm.simple_generation import generate_cached, generate_naive


# check_cached_decode ----------------------------------------------------------------------------------

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


def forgets_positions(model, prompt_ids, max_new_tokens):
    """Decodes every new token at position 0 (what ``model.logits([token])`` does by default)."""
    return _decode_with_positions(lambda n, step: 0)(model, prompt_ids, max_new_tokens)


def position_off_by_one(model, prompt_ids, max_new_tokens):
    return _decode_with_positions(lambda n, step: n + step + 1)(model, prompt_ids, max_new_tokens)


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


def naive_recompute(model, prompt_ids, max_new_tokens):
    """Right tokens, no cache: the check must notice that nothing is reused."""
    return generate_naive(model, prompt_ids, max_new_tokens).token_ids


def returns_prompt_too(model, prompt_ids, max_new_tokens):
    return list(prompt_ids) + cached_reference(model, prompt_ids, max_new_tokens)


def one_token_short(model, prompt_ids, max_new_tokens):
    return cached_reference(model, prompt_ids, max_new_tokens)[:-1]


def as_tensor(model, prompt_ids, max_new_tokens):
    return torch.tensor(cached_reference(model, prompt_ids, max_new_tokens))


@pytest.mark.parametrize("fn", [cached_reference, cached_by_hand, as_tensor])
def test_cached_decode_check_passes_right_answers(fn, tiny, capsys):
    check_cached_decode(fn, tiny[0])
    assert "check_cached_decode" in capsys.readouterr().out


@pytest.mark.parametrize("fn,match", [
    (forgets_positions, "differ"),
    (position_off_by_one, "differ"),
    (fresh_cache_each_step, "differ"),
    (naive_recompute, "recomputes"),
    (returns_prompt_too, "not the prompt"),
    (one_token_short, "expected .* generated ids"),
])
def test_cached_decode_check_fails_wrong_answers(fn, match, tiny):
    with pytest.raises(AssertionError, match=match):
        check_cached_decode(fn, tiny[0])


def test_cached_decode_check_loads_its_own_model(capsys):
    check_cached_decode(cached_reference)
    assert "check_cached_decode" in capsys.readouterr().out


# check_chunk_mask -------------------------------------------------------------------------------------

def mask_reference(a, b):
    return causal_chunk_mask(a, b)


def mask_by_hand(a, b):
    rows = torch.arange(a, b)[:, None]
    return torch.arange(b)[None, :] <= rows


def mask_off_by_one(a, b):
    return torch.arange(b)[None, :] < torch.arange(a, b)[:, None]


def mask_ignores_prefix(a, b):
    """Causal within the chunk but blind to the cached keys [0, a)."""
    n = b - a
    return torch.cat([torch.zeros(n, a, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], dim=1)


def mask_chunk_only(a, b):
    """Forgets the cached keys altogether: square [n, n]."""
    return torch.ones(b - a, b - a, dtype=torch.bool).tril()


def mask_as_float(a, b):
    return causal_chunk_mask(a, b).float()


def mask_full_block(a, b):
    """Every query sees the whole chunk, future tokens included."""
    return torch.ones(b - a, b, dtype=torch.bool)


def mask_as_list(a, b):
    return causal_chunk_mask(a, b).tolist()


@pytest.mark.parametrize("fn", [mask_reference, mask_by_hand])
def test_chunk_mask_check_passes_right_answers(fn, capsys):
    check_chunk_mask(fn)
    assert "check_chunk_mask" in capsys.readouterr().out


@pytest.mark.parametrize("fn,match", [
    (mask_off_by_one, r"chunk_mask\(0, 1\): row 0 .* key 0"),
    (mask_ignores_prefix, r"chunk_mask\(0, 2\)|chunk_mask\(1, 2\): row 0 .* key 0"),
    (mask_chunk_only, "shape"),
    (mask_as_float, "dtype"),
    (mask_full_block, "differs"),
    (mask_as_list, "torch.Tensor"),
])
def test_chunk_mask_check_fails_wrong_answers(fn, match):
    with pytest.raises(AssertionError, match=match):
        check_chunk_mask(fn)
