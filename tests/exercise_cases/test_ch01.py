"""Chapter 01: a reader's KV-cached decode loop, generate_cached(model, prompt_ids, max_new_tokens)."""

import torch

from minivllm.attention import ContiguousKVCache, NoCache
from minivllm.exercises import check_generate_cached
from minivllm.simple_generation import generate_cached as minivllm_generate_cached
from minivllm.simple_generation import generate_naive

from exercise_cases import Check


def generate_cached(model, prompt_ids, max_new_tokens):
    """The solution notebook's answer."""
    n = len(prompt_ids)
    device = next(model.parameters()).device
    cache = ContiguousKVCache.for_model(model, n + max_new_tokens)
    logits = model.logits(prompt_ids, torch.arange(n, device=device), cache)
    out = [int(logits[-1].argmax())]
    for step in range(1, max_new_tokens):
        logits = model.logits(out[-1:], torch.tensor([n + step - 1], device=device), cache)
        out.append(int(logits[-1].argmax()))
    return out


def minivllms(model, prompt_ids, max_new_tokens):
    return minivllm_generate_cached(model, prompt_ids, max_new_tokens).token_ids


def chunked_prefill_feeds_last_too(model, prompt_ids, max_new_tokens):
    """Another right answer: the prompt in chunks of 4, and the last token fed too (wasted, not wrong)."""
    n = len(prompt_ids)
    cache = ContiguousKVCache.for_model(model, n + max_new_tokens)
    for a in range(0, n, 4):
        logits = model.logits(prompt_ids[a:a + 4], torch.arange(a, min(a + 4, n)), cache)
    out = []
    for step in range(max_new_tokens):
        out.append(int(logits[-1].argmax()))
        logits = model.logits(out[-1:], torch.tensor([n + step]), cache)
    return torch.tensor(out)


def _decode_at(position, cache_len=lambda n, new: n + new):
    """The solution with the decode token fed at ``position(n, step)`` and a cache of ``cache_len`` tokens."""
    def fn(model, prompt_ids, max_new_tokens):
        n = len(prompt_ids)
        cache = ContiguousKVCache.for_model(model, cache_len(n, max_new_tokens) + 2)
        logits = model.logits(prompt_ids, torch.arange(n), cache)
        out = [int(logits[-1].argmax())]
        for step in range(1, max_new_tokens):
            logits = model.logits(out[-1:], torch.tensor([position(n, step)]), cache)
            out.append(int(logits[-1].argmax()))
        return out
    return fn


def short_cache(model, prompt_ids, max_new_tokens):
    n = len(prompt_ids)
    cache = ContiguousKVCache.for_model(model, n)  # room for the prompt only
    logits = model.logits(prompt_ids, torch.arange(n), cache)
    out = [int(logits[-1].argmax())]
    for step in range(1, max_new_tokens):
        logits = model.logits(out[-1:], torch.tensor([n + step - 1]), cache)
        out.append(int(logits[-1].argmax()))
    return out


def fresh_cache_each_step(model, prompt_ids, max_new_tokens):
    n = len(prompt_ids)
    logits = model.logits(prompt_ids, torch.arange(n), ContiguousKVCache.for_model(model, n))
    out = [int(logits[-1].argmax())]
    for step in range(1, max_new_tokens):
        cache = ContiguousKVCache.for_model(model, n + max_new_tokens)
        logits = model.logits(out[-1:], torch.tensor([n + step - 1]), cache)
        out.append(int(logits[-1].argmax()))
    return out


def decode_without_cache(model, prompt_ids, max_new_tokens):
    n = len(prompt_ids)
    logits = model.logits(prompt_ids, torch.arange(n), ContiguousKVCache.for_model(model, n + max_new_tokens))
    out = [int(logits[-1].argmax())]
    for step in range(1, max_new_tokens):
        logits = model.logits(out[-1:], torch.tensor([n + step - 1]), NoCache())
        out.append(int(logits[-1].argmax()))
    return out


CHECKS = [Check("01", check_generate_cached, [generate_cached, minivllms, chunked_prefill_feeds_last_too], {
    "positions restart at 0": (_decode_at(lambda n, step: 0), "positions restart at 0"),
    "positions count the new tokens": (_decode_at(lambda n, step: step), "positions restart at 0"),
    "decode position off by one": (_decode_at(lambda n, step: n + step), "off by one"),
    "decode position one short": (_decode_at(lambda n, step: n + step - 2), "off by one"),
    "re-feeds the whole sequence": (lambda m, p, n: generate_naive(m, p, n).token_ids, "re-feeds"),
    "cache too short": (short_cache, "cache is too short"),
    "a fresh cache each step": (fresh_cache_each_step, "different caches"),
    "decodes without the cache": (decode_without_cache, "without the KV cache"),
    "returns the prompt too": (lambda m, p, n: list(p) + minivllms(m, p, n), "not the prompt"),
    "one token short": (lambda m, p, n: minivllms(m, p, n)[:-1], "expected .* generated ids"),
}, passes="transformers", model_fixture="tiny")]
