"""Chapter 01, prefill and decode: the check of the reader's KV-cached decode loop,
``generate_cached(model, prompt_ids, max_new_tokens) -> list[int]``: targeted prompts on the seeded
``tiny-random`` model against :func:`minivllm.simple_generation.generate_cached`, with every forward's
positions and cache recorded, then SmolLM2 against Hugging Face transformers' greedy ``generate``.
"""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM

from minivllm.attention import ContiguousKVCache
from minivllm.exercises._common import _as_id_list, say
from minivllm.exercises.live import chat_prompts
from minivllm.models import load_model, model_folder
from minivllm.simple_generation import generate_cached

__all__ = ["check_generate_cached"]

_CASES = [  # (prompt ids, max_new_tokens): short, long, a one-token prompt, a single new token
    ([1, 9690, 198, 2683, 359, 253, 5356], 8),
    ([504, 3575, 282, 4649, 314, 2, 198, 1, 520, 9531, 198, 1780, 314, 260, 3575, 282, 4649, 47], 12),
    ([42], 6),
    ([17, 29, 301], 1),
]
LIVE_TOKENS = 6  # per prompt, against transformers on SmolLM2 (a CPU runs transformers' generate slowly)


@functools.lru_cache(maxsize=1)
def _tiny_model():
    return load_model("tiny-random", device="cpu")[0]


@functools.lru_cache(maxsize=1)
def _smollm2():
    """minivllm's SmolLM2 and the same weights in transformers (the oracle), on the CPU."""
    model, tok = load_model("smollm2-135m", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(model_folder("smollm2-135m"), dtype=torch.float32).eval()
    return model, tok, hf


def _hf_greedy(hf, prompt_ids: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate``: exactly ``n`` tokens (``eos_token_id=None``: EOS neither stops nor is masked)."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def _record_forwards(model, fn, *args):
    """Run ``fn(*args)`` and return its result and every forward's (positions, cache) as layer 0 saw them."""
    forwards = []

    def record(_module, args):
        forwards.append((args[2].tolist(), args[3]))  # DecoderLayer.forward(x, residual, positions, kv, batch)

    hook = model.model.layers[0].register_forward_pre_hook(record)
    try:
        return fn(*args), forwards
    finally:
        hook.remove()


def _run(fn, model, prompt, n, what):
    try:
        return _record_forwards(model, fn, model, list(prompt), n)
    except ValueError as e:
        if "KV cache holds" in str(e):
            raise AssertionError(f"{what}: {e}: the cache is too short; make it hold every token the model is fed "
                                 f"(the prompt and the generated tokens: len(prompt_ids) + max_new_tokens)") from None
        raise AssertionError(f"{what}: your function raised ValueError: {e}") from None


def _check_cache(forwards, what) -> None:
    caches = {id(kv) for _, kv in forwards}
    if not all(isinstance(kv, ContiguousKVCache) for _, kv in forwards):
        raise AssertionError(f"{what}: a forward ran without the KV cache (model.logits(ids) alone uses no cache): "
                             f"pass the ContiguousKVCache to every forward, prefill and decode")
    if len(caches) > 1:
        raise AssertionError(f"{what}: the forwards used {len(caches)} different caches: a fresh cache each step "
                             f"forgets the past; make one ContiguousKVCache before the prefill and keep it")


def _check_positions(forwards, prompt_len: int, what) -> None:
    fed = [p for positions, _ in forwards for p in positions]
    if fed == list(range(len(fed))):
        return
    i = next(i for i, p in enumerate(fed) if p != i)
    if i < prompt_len:
        raise AssertionError(f"{what}: the prefill feeds the prompt at positions {fed[:prompt_len]}: "
                             f"the prompt sits at positions 0 .. {prompt_len - 1}")
    step = i - prompt_len + 1  # the decode step that fed it (step 1 feeds the prefill's token)
    if fed[i] == 0 or fed[i] == step or fed[i] == step - 1:
        hint = ("positions restart at 0: a decode token's position is its index in the whole sequence, "
                "len(prompt_ids) + step - 1, not its index among the new tokens")
    elif fed[i] == i + 1:
        hint = ("off by one: the first generated token is token len(prompt_ids) of the sequence, so decode step "
                "1 feeds it at position len(prompt_ids), step s at len(prompt_ids) + s - 1")
    elif fed[i] == i - 1:
        hint = "off by one: this overwrites the previous token's cached keys; step s feeds position len(prompt_ids) + s - 1"
    else:
        hint = "the token fed at decode step s sits at position len(prompt_ids) + s - 1"
    raise AssertionError(f"{what}: decode step {step} fed its token at position {fed[i]}, expected {i}; {hint}")


def _check_case(fn, model, prompt, n) -> None:
    what = f"generate_cached(prompt of {len(prompt)} tokens {prompt}, max_new_tokens={n})"
    expected = generate_cached(model, prompt, n).token_ids
    got, forwards = _run(fn, model, prompt, n, what)
    got = _as_id_list(got, what)
    if got[: len(prompt)] == list(prompt) and len(got) == len(prompt) + n:
        raise AssertionError(f"{what}: return only the {n} generated ids, not the prompt followed by them")
    if len(got) != n:
        raise AssertionError(f"{what}: expected {n} generated ids, got {len(got)}: {got}")
    fed = sum(len(p) for p, _ in forwards)
    if fed > len(prompt) + n:
        raise AssertionError(f"{what}: {fed} tokens went through the model where a KV cache needs "
                             f"{len(prompt) + n - 1} (the prompt once, then only the newest token per step): "
                             f"this recomputes the sequence (re-feeds it) instead of reusing the cache")
    _check_cache(forwards, what)
    _check_positions(forwards, len(prompt), what)
    if got != expected:
        j = next(j for j, (e, g) in enumerate(zip(expected, got)) if e != g)
        hint = ("the first token is the argmax of the prefill's last row of logits" if j == 0 else
                "each token is the argmax of the last row of the logits of the forward before it")
        raise AssertionError(f"{what}: token {j} differs from minivllm's generate_cached: expected {expected[j]}, "
                             f"got {got[j]}; {hint}\n  expected {expected}\n  got      {got}")


def _check_live(fn, prompts: int = 2) -> None:
    model, tok, hf = _smollm2()
    for k, prompt in enumerate(chat_prompts(tok, prompts)):
        mine = _as_id_list(fn(model, list(prompt), LIVE_TOKENS), "generate_cached on SmolLM2")
        theirs = _hf_greedy(hf, prompt, LIVE_TOKENS)
        if mine != theirs:
            j = next((j for j, (a, b) in enumerate(zip(theirs, mine)) if a != b), min(len(mine), len(theirs)))
            raise AssertionError(f"SmolLM2, chat prompt {k}: your token {j} differs from transformers' greedy "
                                 f"generate: expected {theirs[j:j + 1]}, got {mine[j:j + 1]}")
    say(f"check_generate_cached: on SmolLM2 your loop gives transformers' greedy tokens, {LIVE_TOKENS} for each "
          f"of {prompts} chat prompts.")


def check_generate_cached(fn, model=None, live: bool = True) -> None:
    """Check ``fn(model, prompt_ids, max_new_tokens) -> list[int]``, the KV-cached decode loop (chapter 01).

    On the seeded ``tiny-random`` model (or ``model``), each targeted prompt
    must give :func:`~minivllm.simple_generation.generate_cached`'s tokens
    (exactly ``max_new_tokens``, the prompt not included) with one cache for
    every forward, the prompt fed once at positions ``0 .. P-1`` and one token
    per decode step at the next position; the first failure stops the check.
    Then, unless ``live=False``, SmolLM2 must give transformers' greedy tokens.
    """
    model = model if model is not None else _tiny_model()
    for prompt, n in _CASES:
        _check_case(fn, model, prompt, n)
    say(f"check_generate_cached: all {len(_CASES)} prompts give minivllm's tokens, one cache, each token fed once "
          f"at its position.")
    if live:
        _check_live(fn)
