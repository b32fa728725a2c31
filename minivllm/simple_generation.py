"""Greedy generation for one sequence: naive recompute vs a KV cache (chapter 01), chunked prefill (chapter 02).

These helpers are the baseline the engine is measured against: no batching, no
scheduler, one prompt, greedy decoding. :func:`generate_naive` runs the whole
sequence through the model at every step; :func:`generate_cached` prefills the
prompt once (whole, or in chunks) into a :class:`~minivllm.attention.ContiguousKVCache`
and then feeds one token per decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from minivllm.attention import ContiguousKVCache, NoCache
from minivllm.timing import now

__all__ = ["GenerationResult", "chat_prompt_ids", "generate_naive", "generate_cached", "prefill_chunked"]


@dataclass
class GenerationResult:
    """Generated ids and the timings that define TTFT and TPOT (chapter 01).

    ``ttft_s`` runs from the call to the first generated token (the prefill);
    ``step_times_s[i]`` is the time of the decode step that produced token ``i + 1``;
    ``e2e_s`` is the whole call.
    """

    token_ids: list[int]
    ttft_s: float
    step_times_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first, vLLM's definition: ``(E2E - TTFT) / (tokens - 1)``; nan below 2 tokens."""
        n = len(self.token_ids)
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else math.nan


def chat_prompt_ids(tokenizer, message, system: str | None = None, *, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
    """Token ids of a chat prompt ending where the assistant's reply starts (chapter 01; ``LLM.chat``, chapter 07).

    ``message`` is one user message (after ``system``, if given) or a whole conversation, a list of
    ``{"role": ..., "content": ...}`` dicts. Renders the chat template to text and tokenizes it, which gives the
    same ids on transformers 4 (where ``apply_chat_template`` returns a list) and 5 (a dict).
    """
    turns = list(message) if isinstance(message, (list, tuple)) else [{"role": "user", "content": message}]
    messages = ([{"role": "system", "content": system}] if system else []) + turns
    options = {"chat_template": chat_template} if chat_template is not None else {}
    if continue_final_message:  # vLLM's option: the last (assistant) message goes on instead of a new one starting
        options["continue_final_message"] = True
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **options)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _prompt_tensor(model, prompt_ids, max_new_tokens: int) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=next(model.parameters()).device).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("prompt_ids must hold at least 1 token, got 0")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return ids


def _greedy(model, hidden: torch.Tensor) -> int:
    """The argmax token of the last row (ties go to the lowest id, as in transformers)."""
    return int(model.compute_logits(hidden[-1:]).argmax(dim=-1))


@torch.inference_mode()
def generate_naive(
    model, prompt_ids, max_new_tokens: int, eos_token_id: int | None = None
) -> GenerationResult:
    """Greedy generation that recomputes the whole sequence at every step (no KV cache, chapter 01).

    Step ``i`` runs ``len(prompt) + i`` tokens through the model to get one new
    token, so the cost of a step grows with the sequence. Stops after
    ``max_new_tokens`` tokens or right after emitting ``eos_token_id`` (kept in the output).
    """
    ids = _prompt_tensor(model, prompt_ids, max_new_tokens)
    device = ids.device
    out, steps = [], []
    start = t_prev = now(device)
    ttft = 0.0
    for step in range(max_new_tokens):
        positions = torch.arange(len(ids), device=device)
        token = _greedy(model, model.forward(ids, positions, NoCache()))
        t = now(device)
        if step == 0:
            ttft = t - start
        else:
            steps.append(t - t_prev)
        t_prev = t
        out.append(token)
        if token == eos_token_id:
            break
        ids = torch.cat([ids, ids.new_tensor([token])])
    return GenerationResult(out, ttft, steps, t_prev - start)


@torch.inference_mode()
def prefill_chunked(
    model, ids, chunk_size: int, cache: ContiguousKVCache, start: int | None = None
) -> torch.Tensor:
    """Run ``ids`` through the model ``chunk_size`` tokens at a time into ``cache`` (chapter 02).

    The tokens sit at positions ``start + i`` (by default right after what the
    cache already holds); chunk ``[a, b)`` writes its keys and values there and
    attends to everything cached before it. Returns the last token's logits ``[vocab]``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    device = next(model.parameters()).device
    ids = torch.as_tensor(ids, dtype=torch.long, device=device).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("ids must hold at least 1 token, got 0")
    start = cache.length if start is None else start
    for a in range(0, len(ids), chunk_size):
        b = min(a + chunk_size, len(ids))
        hidden = model.forward(ids[a:b], torch.arange(start + a, start + b, device=device), cache)
    return model.compute_logits(hidden[-1:])[0]


@torch.inference_mode()
def generate_cached(
    model,
    prompt_ids,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    prefill_chunk_size: int | None = None,
    cache_cls=ContiguousKVCache,
) -> GenerationResult:
    """Greedy generation with a contiguous KV cache (chapter 01; chunked prefill, chapter 02).

    Prefill runs the prompt once (whole, or ``prefill_chunk_size`` tokens at a
    time) and caches every layer's keys and values; each decode step then feeds
    only the newest token at its position and attends to the cache. Same tokens
    as :func:`generate_naive`, with a per-step cost that barely grows.
    ``cache_cls`` (a :class:`ContiguousKVCache` subclass) lets chapter 02's
    exercise run the reader's chunked attention inside the model.
    """
    ids = _prompt_tensor(model, prompt_ids, max_new_tokens)
    device, n = ids.device, len(ids)
    cache = cache_cls.for_model(model, n + max_new_tokens)
    start = now(device)
    logits = prefill_chunked(model, ids, prefill_chunk_size or n, cache, start=0)
    token = int(logits.argmax())
    t_prev = now(device)
    ttft, out, steps = t_prev - start, [token], []
    for step in range(1, max_new_tokens):
        if token == eos_token_id:
            break
        position = n + step - 1  # the token being fed was generated at this index of the sequence
        hidden = model.forward(ids.new_tensor([token]), ids.new_tensor([position]), cache)
        token = _greedy(model, hidden)
        t = now(device)
        steps.append(t - t_prev)
        t_prev = t
        out.append(token)
    return GenerationResult(out, ttft, steps, t_prev - start)
