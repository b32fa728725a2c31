"""Helpers that the checks of several chapters share: reading the token ids a reader's function
returns, telling an int from a float or a bool, and the mark of a part still to write.
"""

from __future__ import annotations

import numbers

import torch

NOT_WRITTEN = "not written yet"  # an exercise's stub raises NotImplementedError("not written yet: Class.method")


def _as_id_list(value, what: str) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise AssertionError(f"{what}: expected a flat list of token ids, got a tensor of shape {tuple(value.shape)}")
        return [int(t) for t in value.tolist()]
    try:
        return [int(t) for t in value]
    except TypeError:
        raise AssertionError(f"{what}: expected a list of token ids, got {type(value).__name__}") from None


def _is_integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
