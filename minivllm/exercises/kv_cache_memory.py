"""Chapter 03, KV-cache memory: the checks of the reader's KV bytes per token and of the slots a paged
pool reserves but leaves empty, each naming the usual arithmetic slip when the answer is wrong.
"""

from __future__ import annotations

import torch

from minivllm.config import cdiv
from minivllm.exercises._common import _is_integer, say

__all__ = ["check_kv_bytes_per_token", "check_paged_waste"]


_KV_CONFIGS = [  # (name, layers, kv heads, head dim, bytes per element), from the published configs
    ("SmolLM2-135M, fp32", 30, 3, 64, 4),
    ("Llama-3-8B, bf16", 32, 8, 128, 2),
    ("Llama-2-7B (no GQA), fp16", 32, 32, 128, 2),
    ("Qwen2.5-7B, bf16", 28, 4, 128, 2),
    ("Llama-3-70B, fp8", 80, 8, 128, 1),
    ("one layer, one head, d=1, 1 byte", 1, 1, 1, 1),
]


def check_kv_bytes_per_token(fn, live: bool = True) -> None:
    """Check ``fn(num_layers, num_kv_heads, head_dim, dtype_bytes) -> int``, the KV bytes of one token (chapter 03).

    Compared with ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes``
    (K and V, every layer) on SmolLM2 and a few published model configs (no
    live run: ``live`` is accepted as every check's is).
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
    say(f"check_kv_bytes_per_token: all {len(_KV_CONFIGS)} model configs give the right bytes per token.")


_WASTE_CASES = [  # (lengths, block_size)
    ([5], 4), ([4], 4), ([1], 4), ([8, 9, 16, 17], 8), ([1, 1, 1], 1), ([100, 37, 64, 3, 250], 16),
    ([2047, 2048, 2049], 16), ([], 16),
]


def check_paged_waste(fn, live: bool = True) -> None:
    """Check ``fn(lengths, block_size) -> int``: KV slots a paged pool reserves but leaves empty (chapter 03).

    A sequence of ``n`` tokens holds ``ceil(n / block_size)`` blocks, so its
    last block has ``ceil(n / block_size) * block_size - n`` empty slots.
    """
    for lengths, bs in _WASTE_CASES:
        what = f"paged_waste({lengths}, block_size={bs})"
        expected = sum(cdiv(n, bs) * bs - n for n in lengths)
        got = fn(list(lengths), bs)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if not _is_integer(got):
            raise AssertionError(f"{what}: expected an int number of token slots, got {got!r} ({type(got).__name__})")
        if int(got) != expected:
            per_seq = [cdiv(n, bs) * bs - n for n in lengths]
            hint = ""
            if int(got) == sum((n // bs + 1) * bs - n for n in lengths):
                hint = "; a length that is a multiple of block_size fills its last block exactly (use a ceiling division)"
            elif int(got) < 0 or int(got) == sum((n // bs) * bs - n for n in lengths):
                hint = "; round the block count UP: a partial block is still a whole block"
            raise AssertionError(f"{what}: expected {expected} empty slots (per sequence {per_seq}), got {got}{hint}")
    say(f"check_paged_waste: all {len(_WASTE_CASES)} workloads give the right number of empty slots.")
