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

import importlib
import math
import re
from pathlib import Path

import pytest
import torch
from exercise_cases import Check

from minivllm.block_manager import MiniBlockManager
from minivllm.exercises import check_kv_bytes_per_token, check_paged_waste
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence


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
    bm = MiniBlockManager(sum(-(-n // block_size) for n in lengths) + 1, block_size)
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


# The table: the checks above, and every chapter module's in exercise_cases/ ----------------------------

CHECKS = [
    Check("03", check_kv_bytes_per_token, [kv_bytes, kv_bytes_prod, kv_bytes_tensor], KV_BYTES_WRONG),
    Check("03", check_paged_waste, [waste, waste_by_block_manager], PAGED_WASTE_WRONG),
]

CHECKS += [c for module in sorted(Path(__file__).parent.glob("exercise_cases/test_ch*.py"))
           for c in importlib.import_module(f"exercise_cases.{module.stem}").CHECKS]
RIGHT = [pytest.param(c, fn, id=f"{c.chapter}-{c.name}-{fn.__name__}") for c in CHECKS for fn in c.right]
WRONG = [pytest.param(c, fn, (hints,) if isinstance(hints, str) else hints, id=f"{c.chapter}-{c.name}-{mistake}")
         for c in CHECKS for mistake, (fn, hints) in c.wrong.items()]


@pytest.mark.parametrize("c,fn", RIGHT)
def test_check_accepts_right_answer(c, fn, request, capsys):
    c.run(fn, request)
    out = capsys.readouterr().out
    assert f"check_{c.name}: " in out and c.passes in " ".join(out.split()), out  # said in lines of 100


@pytest.mark.parametrize("c,fn,hints", WRONG)
def test_check_names_wrong_answer(c, fn, hints, request):
    with pytest.raises(AssertionError) as err:
        c.run(fn, request)
    for hint in hints:
        assert re.search(hint, str(err.value)), f"{hint!r} not in the message:\n{err.value}"
