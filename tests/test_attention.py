"""The chunked/dense reference pair of chapter 02."""

import pytest
import torch

from minivllm.attention import causal_chunk_mask, chunked_causal, dense_causal


def test_reference_check_seed_127():
    torch.manual_seed(127)
    q = torch.randn(1, 2, 7, 4)
    k = torch.randn(1, 2, 7, 4)
    v = torch.randn(1, 2, 7, 4)
    out, trace = chunked_causal(q, k, v, 3)
    assert trace == [(0, 3, (1, 2, 3, 4)), (3, 6, (1, 2, 6, 4)), (6, 7, (1, 2, 7, 4))]
    assert (out - dense_causal(q, k, v)).abs().max().item() < 1e-6


@pytest.mark.parametrize("n,chunk", [(1, 1), (7, 1), (7, 7), (7, 10), (16, 5), (33, 8)])
def test_chunked_equals_dense(n, chunk):
    g = torch.Generator().manual_seed(n * 100 + chunk)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for _ in range(3))
    out, trace = chunked_causal(q, k, v, chunk)
    assert torch.allclose(out, dense_causal(q, k, v), atol=1e-6)
    assert [(a, b) for a, b, _ in trace] == [(a, min(a + chunk, n)) for a in range(0, n, chunk)]


def test_chunk_mask():
    m = causal_chunk_mask(3, 6)
    assert m.shape == (3, 6)
    assert m.tolist() == [[j <= 3 + i for j in range(6)] for i in range(3)]
    assert torch.equal(causal_chunk_mask(0, 5), torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("a,b", [(-1, 3), (3, 3), (4, 2)])
def test_chunk_mask_rejects_empty_or_negative(a, b):
    with pytest.raises(ValueError, match="chunk"):
        causal_chunk_mask(a, b)
