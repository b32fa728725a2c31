"""What a user would pick instead of minivllm: static padded batches, HF transformers (chapters 06 and 11)."""

from __future__ import annotations

import copy
import inspect
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from minivllm.attention import attend, causal_chunk_mask
from minivllm.config import cdiv

__all__ = ["PaddedBatchKVCache", "StaticBatchOutput", "static_batch_generate", "hf_generate_one_at_a_time",
           "hf_generate_static_batches", "first_difference", "hf_generate_batch"]


class PaddedBatchKVCache:
    """A contiguous KV cache for a static batch of ``B`` left-padded rows (chapter 06's baseline).

    Keys and values live in ``[layers, B, kv_heads, max_len, head_dim]``; every
    row advances in lockstep, one column per decode step. Row ``r`` starts with
    ``pad_lens[r]`` padding columns that no query may read, so left padding
    changes no real token's attention. A forward feeds ``B * L`` flat tokens,
    ``L`` per row, row after row (the layout :class:`~minivllm.models.llama.LlamaForCausalLM` expects).
    """

    def __init__(self, model, pad_lens: list[int], max_len: int):
        c, p = model.config, next(model.parameters())
        self.batch_size = len(pad_lens)
        shape = (c.num_hidden_layers, self.batch_size, c.num_key_value_heads, max_len, model.head_dim)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        pad = torch.tensor(pad_lens, device=p.device)
        self.key_valid = torch.arange(max_len, device=p.device)[None, :] >= pad[:, None]  # [B, max_len]
        self.max_len = max_len
        self.length = 0  # columns written

    def forward(self, layer: int, q, k, v, positions, batch=None):
        B = self.batch_size
        L = q.shape[0] // B
        a, b = self.length, self.length + L
        if b > self.max_len:
            raise ValueError(f"padded KV cache holds {self.max_len} columns, a forward needs {b}")
        q = q.view(B, L, *q.shape[1:]).transpose(1, 2)  # [B, heads, L, D]
        self.k[layer, :, :, a:b] = k.view(B, L, *k.shape[1:]).transpose(1, 2)
        self.v[layer, :, :, a:b] = v.view(B, L, *v.shape[1:]).transpose(1, 2)
        causal = causal_chunk_mask(a, b, q.device)  # [L, b]
        mask = causal[None] & self.key_valid[:, None, :b]  # [B, L, b]: causal, and never a padding key
        mask |= torch.arange(b, device=q.device)[None, None, :] == torch.arange(a, b, device=q.device)[None, :, None]
        # ^ a padding query sees itself, so its softmax stays finite; its output is never read
        out = attend(q, self.k[layer, :, :, :b], self.v[layer, :, :, :b], mask)
        if layer == self.k.shape[0] - 1:
            self.length = b
        heads, d = out.shape[1], out.shape[3]
        return out.transpose(1, 2).reshape(B * L, heads, d)


@dataclass
class StaticBatchOutput:
    """What :func:`static_batch_generate` produced and what it cost."""

    token_ids: list[list[int]]  # each request's generated ids, in input order
    num_forwards: int = 0  # model forwards (one prefill + decode steps per batch)
    token_slots: int = 0  # token positions computed, padding and finished rows included
    useful_tokens: int = 0  # prompt tokens + requested output tokens
    batch_steps: list[int] = field(default_factory=list)  # decode steps of each batch (= its longest output)
    token_times: list[list[float]] = field(default_factory=list)  # perf_counter time of each request's tokens

    @property
    def waste(self) -> float:
        """Fraction of the computed token positions that were padding or finished rows."""
        return 1 - self.useful_tokens / self.token_slots if self.token_slots else 0.0


@torch.inference_mode()
def static_batch_generate(model, prompts_ids: list[list[int]], max_tokens_list: list[int],
                          batch_size: int, on_step=None) -> StaticBatchOutput:
    """Greedy generation in static batches, the way ``generate`` on padded batches works (chapter
    06).

    Requests are cut into batches of ``batch_size`` in order. A batch is
    left-padded to its longest prompt, prefilled in one forward, then decoded
    in lockstep until its longest request has all its tokens: a request that
    finishes early keeps its row (computing tokens nobody reads), and no
    waiting request may take it. Runs minivllm's own model, so against the
    engine the only difference is the batching policy. EOS is ignored: each
    request gets exactly its ``max_tokens``. ``on_step(tokens, finished)``, if given, is called
    after each step with the requested tokens it produced and the requests it finished (progress).
    """
    if len(prompts_ids) != len(max_tokens_list):
        raise ValueError(
            f"max_tokens_list needs one entry per prompt ({len(prompts_ids)}), got "
            f"{len(max_tokens_list)}"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = model.lm_head.weight.device
    result = StaticBatchOutput(token_ids=[])
    for lo in range(0, len(prompts_ids), batch_size):
        prompts = [list(p) for p in prompts_ids[lo:lo + batch_size]]
        wants = list(max_tokens_list[lo:lo + batch_size])
        B, P, steps = len(prompts), max(map(len, prompts)), max(wants)
        pad = [P - len(p) for p in prompts]
        cache = PaddedBatchKVCache(model, pad, P + steps)
        ids = torch.tensor([[0] * n + p for n, p in zip(pad, prompts)], device=device)  # [B, P]
        pos = (
            torch.arange(P, device=device)[None, :] - torch.tensor(pad, device=device)[:, None]
        ).clamp(min=0)
        hidden = model.forward(ids.flatten(), pos.flatten(), cache).view(B, P, -1)
        out = [[] for _ in range(B)]
        times = [[] for _ in range(B)]
        next_ids = model.compute_logits(hidden[:, -1]).argmax(dim=-1)  # [B]
        result.num_forwards += 1
        for step in range(steps):
            new = next_ids.tolist()
            t = time.perf_counter()
            for r in range(B):
                out[r].append(new[r])
                times[r].append(t)
            if on_step is not None:
                on_step(sum(w > step for w in wants), sum(w == step + 1 for w in wants))
            if step == steps - 1:
                break
            pos = torch.tensor([P + step - n for n in pad], device=device)
            hidden = model.forward(next_ids, pos, cache)
            next_ids = model.compute_logits(hidden).argmax(dim=-1)
            result.num_forwards += 1
        result.token_ids.extend(o[:w] for o, w in zip(out, wants))
        result.token_times.extend(t[:w] for t, w in zip(times, wants))
        result.token_slots += B * P + B * (steps - 1)
        result.useful_tokens += sum(map(len, prompts)) + sum(wants) - B
        result.batch_steps.append(steps)
    return result


def _hf_generation_config(hf_model, max_new_tokens: int):
    """Greedy, exactly ``max_new_tokens`` tokens: EOS switched off, as minivllm's ``ignore_eos``."""
    gc = copy.deepcopy(hf_model.generation_config)
    # eos_token_id=None would fall back to the model's EOS; an empty list means "no EOS". (min_new_tokens
    # would not do: it masks EOS out, changing the argmax wherever EOS is the greedy choice.)
    gc.update(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=None, eos_token_id=[],
              temperature=None, top_k=None, top_p=None)
    if gc.pad_token_id is None:
        gc.pad_token_id = 0
    return gc


@torch.inference_mode()
def hf_generate_one_at_a_time(hf_model, prompts_ids: list[list[int]], max_tokens_list: list[int]) -> list[list[int]]:
    """HF transformers ``generate``, one request after another (greedy, no EOS stop)."""
    device = hf_model.device
    out = []
    for prompt, n in zip(prompts_ids, max_tokens_list):
        ids = torch.tensor([prompt], device=device)
        gen = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                generation_config=_hf_generation_config(hf_model, n))
        out.append(gen[0, len(prompt):].tolist())
    return out


@torch.inference_mode()
def hf_generate_static_batches(hf_model, prompts_ids: list[list[int]], max_tokens_list: list[int],
                               batch_size: int) -> list[list[int]]:
    """HF ``generate`` on static batches: left padding, an attention mask, the batch's longest output."""
    device = hf_model.device
    pad_id = _hf_generation_config(hf_model, 1).pad_token_id
    out = []
    for lo in range(0, len(prompts_ids), batch_size):
        prompts, wants = prompts_ids[lo:lo + batch_size], max_tokens_list[lo:lo + batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        gen = hf_model.generate(input_ids=ids, attention_mask=mask,
                                generation_config=_hf_generation_config(hf_model, max(wants)))
        out.extend(gen[r, width:width + n].tolist() for r, n in enumerate(wants))
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _tokens_in_flight(manager) -> int:
    """Output tokens of the requests HF's continuous batching is still running, read from its scheduler (a
    peek at its internals for progress only: 0 where this transformers keeps them elsewhere)."""
    try:
        states = list(manager.batch_processor.scheduler.active_requests.values())
        return sum(len(state.generated_tokens) for state in states)
    except (AttributeError, RuntimeError, TypeError):  # RuntimeError: changed by its thread while copied
        return 0


def continuous_batching_options(options: dict, accepted) -> dict:
    """``options`` with this module's defaults, the page size under the name this transformers takes
    (``accepted``: ``ContinuousBatchingConfig``'s parameters): ``page_size``, or ``block_size`` before 5.2x."""
    options = {"page_size": 64, "max_batch_tokens": 512, "allow_block_sharing": False, **options}
    if "page_size" not in accepted:
        options["block_size"] = options.pop("page_size")
    return options


def hf_generate_batch(hf_model, prompts_ids: list[list[int]], max_tokens_list: list[int], timestamps: bool = False,
                      on_progress=None, **options):
    """HF transformers continuous batching (what ``generate_batch`` runs), greedy, exactly ``max_tokens_list[i]`` each.

    ``generate_batch`` takes one ``max_new_tokens`` for all prompts, so this
    drives its manager directly, which takes one per request; all requests are
    queued before it starts, so its first step sees them all. ``eos_token_id=-1``
    switches EOS off. ``options`` go to ``ContinuousBatchingConfig`` (defaults:
    pages of 64 tokens, 512 tokens per step, a KV cache sized for every request
    at once rather than most of the machine's memory, no prefix sharing).
    Returns the token ids in input order, and with ``timestamps`` also each
    token's ``time.perf_counter()``. ``on_progress(tokens, requests)``, if
    given, is called as each request finishes and about once a second
    meanwhile, with the output tokens so far (those of the requests still
    running read from its scheduler, where this transformers has them) and the
    requests finished.

    Stopped (Ctrl-C, or an error here), its background thread is stopped at
    once (``hard_stop``), not left to finish every queued request first, which
    is what a plain ``stop()`` waits for.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig  # optional and heavy: HF baselines only

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    options = continuous_batching_options(options, inspect.signature(ContinuousBatchingConfig).parameters)
    page = options.get("page_size", options.get("block_size"))
    need = sum(cdiv(len(p) + m, page) + 1 for p, m in zip(prompts_ids, max_tokens_list))
    options.setdefault("num_blocks", math.ceil(need / 0.8))  # its scheduler keeps 15% of the blocks free
    config = GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens_list), eos_token_id=-1)
    manager = hf_model.init_continuous_batching(config, ContinuousBatchingConfig(**options))
    ids = [manager.add_request(list(p), request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1,
                               record_timestamps=timestamps)
           for i, (p, m) in enumerate(zip(prompts_ids, max_tokens_list))]
    results = {}
    with torch.inference_mode():  # its background thread inherits the caller's inference mode
        manager.start()
        finished, done = False, 0
        try:
            while len(results) < len(ids):
                out = manager.get_result(timeout=0.2)  # short: Ctrl-C may wake another thread, not this one
                if out is not None and out.is_finished():
                    results[out.request_id] = out
                    done += len(out.generated_tokens)
                elif out is None and not manager.is_running():
                    raise RuntimeError(f"HF continuous batching stopped: {manager.background_thread_status.fatal_error!r}")
                if on_progress is not None:
                    on_progress(done + _tokens_in_flight(manager), len(results))
            finished = True
        finally:
            # a plain stop() flushes: it waits until every queued request is done (minutes into a long run)
            hard = not finished and "hard_stop" in inspect.signature(manager.stop).parameters
            manager.stop(block=True, **({"hard_stop": True} if hard else {}))
            manager.destroy()
    outs = [results[i] for i in ids]
    bad = [(o.request_id, o.error, len(o.generated_tokens)) for o, m in zip(outs, max_tokens_list)
           if o.error is not None or len(o.generated_tokens) != m]
    if bad:
        raise RuntimeError(f"HF continuous batching failed for (request, error, tokens) {bad}")
    token_ids = [list(o.generated_tokens) for o in outs]
    return (token_ids, [list(o.timestamps) for o in outs]) if timestamps else token_ids
