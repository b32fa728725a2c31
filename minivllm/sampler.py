"""Turning logits into tokens, a batch at a time (chapter 07, sampling and streaming).

Greedy rows take the argmax. The others are scaled by temperature, filtered
by top-k and top-p, and drawn with the request's own generator when it has a
seed, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from minivllm.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p remove, row by row; ``top_k <= 0`` and ``top_p == 1`` keep all."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)
    remove = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each token
    remove |= before >= top_p[:, None]  # keep the smallest prefix whose mass reaches top_p
    remove[:, 0] = False  # the most likely token always survives
    filtered = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, filtered)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator | None = None) -> list[int]:
    """One token per row of ``logits [N, vocab]``."""
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        temp = torch.tensor([params[i].temperature for i in rows], device=logits.device, dtype=logits.dtype)
        top_k = torch.tensor([params[i].top_k for i in rows], device=logits.device)
        top_p = torch.tensor([params[i].top_p for i in rows], device=logits.device, dtype=logits.dtype)
        probs = apply_top_k_top_p(logits[idx] / temp[:, None], top_k, top_p).softmax(dim=-1)
        for j, i in enumerate(rows):
            g = generators[i] or default_generator
            out[i] = torch.multinomial(probs[j], 1, generator=g)[0]
    return out.tolist()
