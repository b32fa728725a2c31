"""Chapter 02: a reader's chunked_causal(q, k, v, chunk_size) -> (out, trace), the chunk mask over cached keys."""

import math

import torch

from minivllm.attention import chunked_causal as minivllms
from minivllm.exercises import check_chunked_causal
from minivllm.exercises.chunked_prefill_exact import _expected_trace, _inputs

from exercise_cases import Check


def chunked_causal(q, k, v, chunk_size):
    """The solution notebook's answer."""
    n = q.shape[-2]
    outs, trace = [], []
    for a in range(0, n, chunk_size):
        b = min(a + chunk_size, n)
        scores = q[..., a:b, :] @ k[..., :b, :].transpose(-1, -2) / math.sqrt(q.shape[-1])
        mask = torch.arange(b)[None, :] <= torch.arange(a, b)[:, None]
        outs.append(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v[..., :b, :])
        trace.append((a, b, tuple(k[..., :b, :].shape)))
    return torch.cat(outs, dim=-2), trace


def growing_cache(q, k, v, chunk_size):
    """Another right answer, the source notes' shape: a K/V cache grown by concatenation, the mask as -inf."""
    outputs, trace, k_cache, v_cache = [], [], k[..., :0, :], v[..., :0, :]
    for start in range(0, q.shape[-2], chunk_size):
        end = min(start + chunk_size, q.shape[-2])
        k_cache = torch.cat((k_cache, k[..., start:end, :]), -2)
        v_cache = torch.cat((v_cache, v[..., start:end, :]), -2)
        scores = q[..., start:end, :] @ k_cache.transpose(-2, -1) / math.sqrt(q.shape[-1])
        future = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
        outputs.append(torch.softmax(scores.masked_fill(future, -torch.inf), -1) @ v_cache)
        trace.append((start, end, tuple(k_cache.shape)))
    return torch.cat(outputs, -2), trace


def _variant(mask=lambda a, b: torch.arange(b)[None, :] <= torch.arange(a, b)[:, None], keys_from=lambda a: 0,
             clip=True, trace_shape=None, fill=float("-inf")):
    """The solution with one characteristic mistake."""
    def fn(q, k, v, chunk_size):
        n = q.shape[-2]
        outs, trace = [], []
        for a in range(0, n, chunk_size):
            b = min(a + chunk_size, n) if clip else a + chunk_size
            lo = keys_from(a)
            scores = q[..., a:b, :] @ k[..., lo:b, :].transpose(-1, -2) / math.sqrt(q.shape[-1])
            m = mask(a, b)[:, lo:]
            outs.append(torch.softmax(scores.masked_fill(~m, fill), dim=-1) @ v[..., lo:b, :])
            seen = k[..., lo:b, :]
            trace.append((a, b, tuple(trace_shape(q, a, b) if trace_shape else seen.shape)))
        return torch.cat(outs, dim=-2), trace
    return fn


def _chunk_keys_only(q, k, v, chunk_size):
    """Attends within the chunk only, but records the trace a right answer would."""
    out, _ = _variant(keys_from=lambda a: a)(q, k, v, chunk_size)
    return out, minivllms(q, k, v, chunk_size)[1]


def _clipped_mask_unclipped_trace(q, k, v, chunk_size):
    out, trace = chunked_causal(q, k, v, chunk_size)
    return out, [(a, a + chunk_size, s) for a, b, s in trace]


def _strict(a, b):
    return torch.arange(b)[None, :] < torch.arange(a, b)[:, None]


CHECKS = [Check("02", check_chunked_causal, [chunked_causal, growing_cache, minivllms], {
    "mask flipped (strictly less)": (_variant(mask=_strict), "flipped"),
    "mask flipped, filled with -1e9": (_variant(mask=_strict, fill=-1e9), "flipped"),
    "no mask inside the chunk": (_variant(mask=lambda a, b: torch.ones(b - a, b, dtype=torch.bool)),
                                 "no causal mask inside the chunk"),
    "keys of the chunk only": (_variant(keys_from=lambda a: a), r"chunk's own keys"),
    "keys of the chunk only, right trace": (_chunk_keys_only, r"only its own keys"),
    "trace of the queries": (_variant(trace_shape=lambda q, a, b: q[..., a:b, :].shape), r"keys \[0, b\)"),
    "trace without the leading dims": (_variant(trace_shape=lambda q, a, b: (b, q.shape[-1])), r"should have shape"),
    "last chunk not clipped": (_variant(clip=False), "clip|min\\(a \\+ chunk_size, n\\)"),
    "trace of the last chunk not clipped": (_clipped_mask_unclipped_trace, "clip the last chunk"),
}, passes="whole prefill")]


def test_the_first_case_is_the_source_notes_listing():
    """Seed 127 drawn as the notes draw it (global seed; q, k, v), and the notes' trace."""
    torch.manual_seed(127)
    q = torch.randn(1, 2, 7, 4)
    k, v = torch.randn_like(q), torch.randn_like(q)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), _inputs((1, 2, 7, 4), 127)))
    assert _expected_trace((1, 2, 7, 4), 3) == [(0, 3, (1, 2, 3, 4)), (3, 6, (1, 2, 6, 4)), (6, 7, (1, 2, 7, 4))]
