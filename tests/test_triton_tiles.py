"""The Triton table's tiled attention program (chapter 18d) against the reference, under Triton's interpreter.

Where triton is installed the script runs in a subprocess with ``TRITON_INTERPRET=1`` (the variable is read when
the kernels are defined, so it must be set before ``triton_ops`` is imported), on tiny shapes. The
interpreter multiplies bfloat16 ``tl.dot`` operands as their raw 16-bit patterns (triton 3.9's
``InterpreterBuilder.create_dot``), so bfloat16 is checked on a GPU only (the first-use check); float32 and
float16 are checked here.
"""

import os
import subprocess
import sys

import pytest
import torch

from minivllm.kernels import selfcheck

SCRIPT = r"""
import itertools, math, torch
import triton.runtime.interpreter as interpreter
from minivllm.kernels import reference, selfcheck, triton_ops

def batch(seqs, heads, kv_heads, dim, block_size, seed, dtype):
    # seqs: (queries, length) per sequence; caches with a block table shuffled over the pool
    g = torch.Generator().manual_seed(seed)
    blocks = sum(math.ceil(n / block_size) for _, n in seqs) + 2
    k_cache = torch.randn(blocks * block_size + 1, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks * block_size + 1, kv_heads, dim, generator=g).to(dtype)
    order = iter(torch.randperm(blocks, generator=g).tolist())
    tables = [[next(order) for _ in range(math.ceil(n / block_size))] for _, n in seqs]
    width = max([1, *map(len, tables)])
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).view(-1, width)
    lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    starts = torch.tensor([0, *itertools.accumulate(q for q, _ in seqs)], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), heads, dim, generator=g).to(dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table, seq_lens=lens, query_start=starts,
                block_size=block_size)

dots = [0]
create_dot = interpreter.interpreter_builder.create_dot
def counting(*args, **kwargs):
    dots[0] += 1
    return create_dot(*args, **kwargs)
interpreter.interpreter_builder.create_dot = counting

def key_tiles(seqs, heads, kv_heads):
    # the key tiles the tiled program loads: each query tile up to its last query's position, every KV head
    block_q = triton_ops.tile_shape(heads, kv_heads)[1]
    total = 0
    for n, length in seqs:
        for first in range(0, n, block_q):
            last = length - n + min(first + block_q, n) - 1
            total += math.ceil((last + 1) / triton_ops.TILE) * kv_heads
    return total

CASES = [  # (queries, length) per sequence, block_size, (heads, kv_heads, dim)
    ([(1, 7), (3, 9), (2, 2)], 4, (4, 2, 16)),  # ragged: a decode row, a chunk after cached keys, a prompt
    ([(5, 5), (1, 1)], 1, (2, 1, 8)),  # block size 1, head_dim 8 (padded to the dot's 16)
    ([(2, 17), (0, 3)], 16, (6, 3, 32)),  # a sequence with no queries: its tile returns at once
    ([(11, 16), (10, 10), (6, 17), (16, 33)], 4, (9, 3, 16)),  # SmolLM2's group of 3: 5 tokens a tile; edges
    ([(20, 52), (1, 40)], 7, (4, 4, 16)),  # no GQA: 16 tokens a tile; 32 cached keys before a chunk
    ([(3, 21)], 16, (32, 1, 16)),  # a group of 32: 32 rows, one token a tile
]
for seed, (seqs, block_size, (h, kvh, d)) in enumerate(CASES):
    for dtype, atol in ((torch.float32, 1e-5), (torch.float16, 1e-2)):
        args = batch(seqs, h, kvh, d, block_size, seed, dtype)
        want = reference.paged_attention(**args)
        dots[0] = 0
        got = triton_ops.attention_tiles(**args)
        assert (got.float() - want.float()).abs().max() < atol, (seed, dtype, (got.float() - want.float()).abs().max())
        assert dots[0] == 2 * key_tiles(seqs, h, kvh), (seed, dots[0], 2 * key_tiles(seqs, h, kvh))
        if dtype == torch.float32:  # the other program on the same steps (one query a program: slower here)
            got = triton_ops.attention_per_query(**args)
            assert (got - want).abs().max() < atol, (seed, "per query")

# the rule: a step with a sequence of several query rows runs the tiles, a decode-only step one query a program
ran = []
for name in ("attention_tiles", "attention_per_query"):
    setattr(triton_ops, name, (lambda f, name: lambda *a: ran.append(name) or f(*a))(getattr(triton_ops, name), name))
for seqs in ([(1, 5), (1, 9)], [(1, 5), (2, 9)], [(0, 3), (1, 1)], [(1, 4), (0, 2), (1, 3)]):
    args = batch(seqs, 4, 2, 16, 4, 0, torch.float32)
    torch.testing.assert_close(triton_ops.paged_attention(**args), reference.paged_attention(**args))
assert ran == ["attention_per_query", "attention_tiles", "attention_per_query", "attention_per_query"], ran

# the first-use check's cases, each of its two attention programs among them
for dtype in (torch.float32, torch.float16):
    assert selfcheck.failing_ops(triton_ops, reference, "cpu", dtype) == {}, dtype
assert ran.count("attention_tiles") == 3 and ran.count("attention_per_query") == 5, ran
print("ok")
"""


def test_the_tiled_program_equals_the_reference_and_loads_no_key_tile_past_its_last_query():
    """Ragged lengths, causal edges at tile boundaries, chunks after cached keys, GQA of 1, 2, 3 and 32; the number
    of ``tl.dot`` calls the interpreter makes is exactly twice the key tiles the causal bound allows; the rule sends
    prompt rows to the tiles and decode-only steps to one query a program; the first-use check passes both."""
    pytest.importorskip("triton", reason="triton is not installed (the CUDA table's kernels; pip install triton)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_first_use_check_runs_each_triton_attention_program():
    """The Triton table picks its attention program by the step's shapes (more query rows than sequences: the
    tiles), so its first-use check has a case on each side of that rule."""
    cases = selfcheck.cases("cpu", torch.float32)
    sides = {name: cases[name]["q"].shape[0] > len(cases[name]["seq_lens"])
             for name in ("paged_attention", "paged_attention (decode rows)")}
    assert sides == {"paged_attention": True, "paged_attention (decode rows)": False}
