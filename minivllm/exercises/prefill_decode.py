"""Chapter 01, prefill and decode: the check of the reader's KV-cached greedy decoding, which must
generate naive greedy generation's tokens on the seeded ``tiny-random`` model while feeding each
token through the model only once.
"""

from __future__ import annotations

import functools

from minivllm.exercises._common import _as_id_list
from minivllm.models import load_model
from minivllm.simple_generation import generate_naive

__all__ = ["check_cached_decode"]


@functools.lru_cache(maxsize=1)
def _tiny_model():
    return load_model("tiny-random", device="cpu")[0]


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
