"""Chapter 02, chunked prefill is exact: the check of the reader's ``chunked_causal(q, k, v, chunk_size)
-> (out, trace)``, against :func:`minivllm.attention.dense_causal` and the source notes' reference listing,
then inside SmolLM2: a :class:`~minivllm.attention.ContiguousKVCache` whose attention is the reader's
function drives a chunked prefill, which must generate the tokens of a whole prefill.
"""

from __future__ import annotations

import functools
import math

import torch

from minivllm.attention import ContiguousKVCache, dense_causal
from minivllm.exercises._common import NOT_WRITTEN, say
from minivllm.exercises.live import chat_prompts
from minivllm.models import load_model
from minivllm.simple_generation import generate_cached

__all__ = ["check_chunked_causal", "reader_attention_cache"]

_CASES = [  # (shape of q, k and v, chunk_size, seed)
    ((1, 2, 7, 4), 3, 127),  # the source notes' reference listing
    ((2, 5, 4), 1, 1),       # every chunk one token: a string of decode steps
    ((3, 6, 8), 2, 2),       # chunks that divide the sequence
    ((2, 10, 8), 4, 3),      # a short last chunk
    ((1, 4, 9, 16), 20, 4),  # one chunk holds it all
    ((9, 1, 8), 3, 5),       # a one-token sequence
]
LIVE_CHUNK = 7  # does not divide the live prompt (36 tokens): the prefill ends with a one-token chunk
LIVE_TOKENS = 6


def _inputs(shape, seed):
    """q, then k, then v, drawn as the source notes' listing draws them after ``torch.manual_seed(seed)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _strict_mask_attention(q, k, v):
    """Causal attention with the diagonal masked too: what a flipped comparison (key < query) computes
    (the first query sees no key: its row is NaN)."""
    n = q.shape[-2]
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(
        torch.ones(n, n, dtype=torch.bool).triu(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _expected_trace(shape, chunk_size):
    n = shape[-2]
    return [(a, min(a + chunk_size, n), (*shape[:-2], min(a + chunk_size, n), shape[-1]))
            for a in range(0, n, chunk_size)]


def _trace_hint(got, expected) -> str:
    if len(got) != len(expected):
        return f"one entry per chunk: {len(expected)} chunks, got {len(got)} entries"
    for (a, b, shape), (ea, eb, eshape) in zip(got, expected):
        if (a, b) != (ea, eb):
            if b > eb:
                return (f"chunk ({a}, {b}) runs past the sequence's end {eb}: clip the last chunk, "
                        f"b = min(a + chunk_size, n)")
            return f"chunk ({a}, {b}) should be ({ea}, {eb}): chunks [a, b) of chunk_size tokens from 0"
        if shape != eshape:
            if len(shape) == len(eshape) and a > 0 and shape[-2] == b - a:
                return (f"chunk ({a}, {b}) recorded keys of shape {shape}, the shape of the chunk's own keys (or of "
                        f"its queries): record the keys it attends to, all the keys [0, b), the cached ones and its "
                        f"own: {eshape}")
            return (f"chunk ({a}, {b}): the keys seen should have shape {eshape}, k's shape with keys [0, {b}), "
                    f"got {shape}")
    return "the trace differs"


def _run(fn, q, k, v, chunk_size, what) -> tuple[torch.Tensor, list]:
    """The reader's ``(out, trace)``, its form checked, the trace's shapes as tuples of ints."""
    try:
        result = fn(q.clone(), k.clone(), v.clone(), chunk_size)
    except RuntimeError as e:
        if NOT_WRITTEN in str(e):  # the stub (NotImplementedError is a RuntimeError): its message, no hint
            raise
        hint = (" (does the last chunk, shorter than chunk_size, get a mask of its own size? b = min(a + chunk_size, n))"
                if q.shape[-2] % chunk_size else "")
        raise AssertionError(f"{what} raised RuntimeError: {str(e).splitlines()[0]}{hint}") from None
    if not (isinstance(result, tuple) and len(result) == 2):
        raise AssertionError(f"{what}: return a pair (out, trace), got {type(result).__name__}")
    out, trace = result
    if not isinstance(out, torch.Tensor) or out.shape != q.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise AssertionError(f"{what}: out must be a tensor of q's shape {tuple(q.shape)}, got {got}")
    try:
        return out, [(int(a), int(b), tuple(int(x) for x in s)) for a, b, s in trace]
    except (TypeError, ValueError):
        raise AssertionError(f"{what}: trace must list (a, b, shape of the keys seen) per chunk, got {trace!r}") from None


def _output_hint(out, q, k, v, chunk_size) -> str:
    """The characteristic mistake whose output ``out`` is, if any."""
    if q.shape[-2] > 1 and torch.allclose(out[..., 1:, :], _strict_mask_attention(q, k, v)[..., 1:, :], atol=1e-5):
        return "the mask is flipped (key < query): the query at position p also sees its own key p"
    if torch.allclose(out, _no_mask(q, k, v, chunk_size), atol=1e-5):
        return ("no causal mask inside the chunk: the chunk's own keys are seen causally, key j only by the "
                "queries at positions >= j")
    if torch.allclose(out, _chunk_keys_only(q, k, v, chunk_size), atol=1e-5):
        return "each chunk saw only its own keys [a, b); it must also see every cached key [0, a)"
    return "each chunk [a, b) attends to every key [0, b) with the mask key <= query position"


def _check_case(fn, shape, chunk_size, seed) -> float:
    """One targeted case: the trace exact, the output dense attention's within 1e-5; returns the largest difference."""
    q, k, v = _inputs(shape, seed)
    what = f"chunked_causal(q, k, v of shape {shape}, chunk_size={chunk_size})"
    out, trace = _run(fn, q, k, v, chunk_size, what)
    want = _expected_trace(shape, chunk_size)
    if trace != want:
        raise AssertionError(f"{what}: trace {trace}\n  expected {want}\n  {_trace_hint(trace, want)}")
    if torch.isnan(out).any():
        row = int(torch.isnan(out).flatten(0, -3).any(0).any(-1).nonzero()[0])
        raise AssertionError(f"{what}: out is NaN at position {row}: that query sees no key; the mask is flipped: "
                             f"the query at position p sees every key j <= p, itself included (mask out key > query)")
    expected = dense_causal(q, k, v)
    err = (out - expected).abs().max().item()
    if err > 1e-5:
        i = int(((out - expected).abs() > 1e-5).flatten(0, -3).any(0).any(-1).nonzero()[0])
        raise AssertionError(f"{what}: out differs from dense_causal by up to {err:.3g} (tolerance 1e-5), first at "
                             f"position {i} (chunk {i // chunk_size}); {_output_hint(out, q, k, v, chunk_size)}")
    return err


def _no_mask(q, k, v, chunk_size):
    n, outs = q.shape[-2], []
    for a in range(0, n, chunk_size):
        b = min(a + chunk_size, n)
        outs.append(torch.softmax(q[..., a:b, :] @ k[..., :b, :].transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
                    @ v[..., :b, :])
    return torch.cat(outs, dim=-2)


def _chunk_keys_only(q, k, v, chunk_size):
    n, outs = q.shape[-2], []
    for a in range(0, n, chunk_size):
        b = min(a + chunk_size, n)
        outs.append(dense_causal(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :]))
    return torch.cat(outs, dim=-2)


def reader_attention_cache(chunked):
    """A :class:`ContiguousKVCache` whose attention is the reader's ``chunked_causal`` (chapter 02).

    A forward over positions ``[a, b)`` writes its keys and values as the
    engine's cache does, then calls ``chunked(q, K, V, chunk_size)`` on every
    key ``[0, b)`` (KV heads repeated for the query heads), with the chunk's
    queries at rows ``[a, b)`` (rows before ``a`` are zeros, their outputs
    unused) and the chunk size ``a`` (``b`` for the first forward), which
    makes ``[a, b)`` its last chunk; its last trace entry must say so.
    """
    class ReaderAttentionCache(ContiguousKVCache):
        def forward(self, layer, q, k, v, positions, batch=None):
            super().forward(layer, q, k, v, positions, batch)  # writes the keys and values at [a, b)
            a = int(positions[0])
            b = a + q.shape[0]
            size = b if a == 0 else a  # chunks [0, a) and [a, b): b <= 2a for a prefill chunked evenly, or a decode
            if b > 2 * a > 0:
                raise ValueError(f"a forward over [{a}, {b}) cannot be the last of equal chunks: chunk evenly")
            group = q.shape[1] // k.shape[1]
            keys = self.k[layer, :, :b].repeat_interleave(group, dim=0)  # [heads, b, head_dim]
            values = self.v[layer, :, :b].repeat_interleave(group, dim=0)
            queries = torch.zeros_like(keys)
            queries[:, a:b] = q.transpose(0, 1)
            out, trace = chunked(queries, keys, values, size)
            last = tuple(trace[-1][:2]), tuple(trace[-1][2])
            if last != ((a, b), tuple(keys.shape)):
                raise AssertionError(f"inside SmolLM2, the forward over [{a}, {b}) (chunk_size {size}) got the last "
                                     f"trace entry {trace[-1]}, expected ({a}, {b}, {tuple(keys.shape)})")
            return out[:, a:b].transpose(0, 1)

    return ReaderAttentionCache


@functools.lru_cache(maxsize=1)
def _smollm2():
    return load_model("smollm2-135m", device="cpu")


def _check_live(fn) -> None:
    model, tok = _smollm2()
    cache_cls = reader_attention_cache(fn)
    prompt = chat_prompts(tok, 1)[0]
    whole = generate_cached(model, prompt, LIVE_TOKENS).token_ids  # minivllm's cache, the prompt in one forward
    mine = generate_cached(model, prompt, LIVE_TOKENS, prefill_chunk_size=LIVE_CHUNK, cache_cls=cache_cls).token_ids
    if mine != whole:
        j = next(j for j, (a, b) in enumerate(zip(whole, mine)) if a != b)
        raise AssertionError(f"SmolLM2 with your chunked_causal as its attention, prefill chunks of {LIVE_CHUNK}: "
                             f"token {j} differs from a whole prefill: expected {whole[j]} "
                             f"{tok.decode([whole[j]])!r}, got {mine[j]} {tok.decode([mine[j]])!r}")
    say(f"check_chunked_causal: SmolLM2 with your chunked_causal in all 30 layers, a {len(prompt)}-token prompt "
          f"prefilled in chunks of {LIVE_CHUNK}, generates the {LIVE_TOKENS} tokens of a whole prefill.")


def check_chunked_causal(fn, live: bool = True) -> None:
    """Check ``fn(q, k, v, chunk_size) -> (out, trace)``, causal attention chunk by chunk (chapter 02).

    Shapes ``(..., seq, dim)``. Chunk ``[a, b)`` attends to the keys
    ``[0, b)`` with the mask ``key <= a + row``; ``trace`` lists ``(a, b,
    shape of the keys seen)``. ``out`` must equal :func:`dense_causal` within
    1e-5 and the trace must be exact, on targeted cases that start with the
    source notes' listing (seed 127); the first failure stops the check.
    Then, unless ``live=False``, SmolLM2's chunked prefill runs on ``fn``
    (:func:`reader_attention_cache`) and must generate the tokens of a whole
    prefill.
    """
    errors = [_check_case(fn, shape, chunk, seed) for shape, chunk, seed in _CASES]
    say(f"check_chunked_causal: all {len(_CASES)} cases match dense_causal (the source notes' case within "
          f"{errors[0]:.1e}) with the exact trace.")
    if live:
        _check_live(fn)
