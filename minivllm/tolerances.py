"""How far two float32 computations of the same thing may differ, and why (chapters 02, 05, 08, 12, 17).

Chunked prefill, paged attention, the prefix cache and speculative
verification compute exactly what the plain forward computes; in float32 they
still differ in the last bits. The kernel that multiplies a row follows the
number of rows in the step (chapter 12: the row-major weight for up to three
rows, oneDNN's packed one above, the compiled matvec, the native kernels), and
each kernel sums its products in its own order. The chapters and tests compare
two paths with these bounds, and assert the exact claim beside them: the same
greedy token, where the top two logits are further apart than twice the bound.
"""

from __future__ import annotations

import torch

MODEL_ATOL = 1e-2
"""Keys, values and logits of the real model (SmolLM2, float32) for the same tokens through two exact paths.

Each dot product sums 576 to 1,536 products in the order its kernel picks;
rounding of about 1e-7 of each sum grows through 30 layers to about 1e-4 of
values that reach the tens. Across the engine's kernels and CPUs the largest
differences measured were 5e-5 to 6e-5 (Intel Xeons with AVX-512 and AMX) and
2.8e-3 (an Intel AVX-512 Xeon, oneDNN at one row): the bound holds over all of
them, and stays a hundred times below what a wrong mask, position or block
gives (differences of whole units).
"""

ATTENTION_ATOL = 1e-5
"""One attention over unit-scale random queries, keys and values, summed in two orders (chapters 02, 05, 12).

Softmax weights sum to one, so an output is an average of values of size
about one: the difference of two summation orders over a few hundred keys is
of order 1e-7, far inside the bound.
"""


def top2_margin(logits: torch.Tensor) -> float:
    """The smallest gap between the largest and second-largest logit over the rows of ``logits [..., vocab]``: two
    paths within ``atol`` of each other pick the same greedy token wherever this exceeds ``2 * atol``."""
    top = logits.float().topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())
