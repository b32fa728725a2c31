"""The kernel layer (chapter 18): every C++ op against its PyTorch reference, bad input refused before memory is
touched, the build cached per machine, and the reference as the fallback where nothing builds."""

import hashlib
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import kernels
from minivllm.config import KERNEL_OPS
from minivllm.kernels import build, reference
from minivllm.models.loader import gguf_path, read_gguf_tensors
from minivllm.tolerances import ATTENTION_ATOL

cpu = kernels.cpu_table()
needs_cpu = pytest.mark.skipif(cpu is None, reason="the C++ kernels do not build here (no compiler)")


def ragged_batch(draw_lens, heads, kv_heads, dim, block_size, seed):
    """A step of sequences ``(queries, length)``: random caches, block tables shuffled over the pool."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(math.ceil(n / block_size) for _, n in draw_lens) + 2
    k_cache = torch.randn(blocks * block_size + 1, kv_heads, dim, generator=g)  # + the scratch slot
    v_cache = torch.randn(blocks * block_size + 1, kv_heads, dim, generator=g)
    order = iter(torch.randperm(blocks, generator=g).tolist())
    tables = [[next(order) for _ in range(math.ceil(n / block_size))] for _, n in draw_lens]
    width = max([1, *map(len, tables)])
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).view(-1, width)
    lens = torch.tensor([n for _, n in draw_lens], dtype=torch.int32)
    starts = torch.tensor([0, *itertools.accumulate(q for q, _ in draw_lens)], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), heads, dim, generator=g)
    return q, k_cache, v_cache, table, lens, starts


@st.composite
def sequences(draw):
    """0 to 6 sequences, each a decode row, a chunk after cached keys, a whole prompt or no queries at all (an
    empty step: no sequence, or none with queries); lengths 0 to 5 blocks (length 0: no queries)."""
    block_size = draw(st.sampled_from([1, 4, 7, 16]))
    out = []
    for _ in range(draw(st.integers(0, 6))):
        length = draw(st.integers(0, 5 * block_size + 3))
        queries = draw(st.sampled_from([1, length, draw(st.integers(0, length))])) if length else 0
        out.append((queries, length))
    return out, block_size


@needs_cpu
# 40 examples found each of these mutations of inner.cpp (tried, 5 seeds): the running max not rescaled, a chunk's
# rows all masked at its last row's position
@settings(deadline=None, max_examples=40)
@given(sequences(), st.sampled_from([(9, 3, 64), (4, 2, 16), (8, 4, 8), (2, 2, 40), (6, 1, 32)]),
       st.integers(0, 2**16))
def test_paged_attention_equals_its_reference_on_random_ragged_batches(seqs, heads, seed):
    """Decode rows, chunks after cached keys and whole prompts in one call, each row to its own length: GQA, block
    sizes 1-16, lengths across block boundaries, rows with no queries, steps with no query tokens or sequences."""
    lens, block_size = seqs
    h, kvh, d = heads
    q, kc, vc, table, seq_lens, starts = ragged_batch(lens, h, kvh, d, block_size, seed)
    want = reference.paged_attention(q, kc, vc, table, seq_lens, starts, block_size)
    got = cpu.paged_attention(q, kc, vc, table, seq_lens, starts, block_size)
    torch.testing.assert_close(got, want, rtol=0, atol=ATTENTION_ATOL)


@needs_cpu
def test_paged_attention_reads_a_strided_query_and_nothing_past_a_rows_length():
    """q as a view of a fused q/k/v buffer (rows strided), and poison in every slot past each sequence's length:
    a row that read one key too many would turn NaN."""
    lens, block_size = [(1, 37), (5, 21), (3, 3)], 16
    q, kc, vc, table, seq_lens, starts = ragged_batch(lens, 9, 3, 64, block_size, 0)
    for b, (_, n) in enumerate(lens):
        for p in range(n, math.ceil(n / block_size) * block_size):
            slot = int(table[b, p // block_size]) * block_size + p % block_size
            kc[slot], vc[slot] = float("nan"), float("nan")
    fused = torch.cat([q, torch.randn(q.shape[0], 6, 64)], dim=1)  # [T, 9 + 3 + 3, 64]
    view = fused[:, :9]
    got = cpu.paged_attention(view, kc, vc, table, seq_lens, starts, block_size)
    assert not got.isnan().any()
    torch.testing.assert_close(got, reference.paged_attention(q, kc, vc, table, seq_lens, starts, block_size),
                               rtol=0, atol=ATTENTION_ATOL)


@needs_cpu
def test_write_kv_stores_each_token_in_its_slot_and_slot_minus_one_nowhere():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(6, 3, 64, generator=g), torch.randn(6, 3, 64, generator=g)
    slots = torch.tensor([3, -1, 7, 32, 0, -1])
    caches = [torch.zeros(33, 3, 64) for _ in range(4)]
    reference.write_kv(k, v, caches[0], caches[1], slots)
    cpu.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[2].count_nonzero() == 4 * 3 * 64 and torch.equal(caches[2][32], k[3])


@needs_cpu
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_the_norms_rotary_and_activation_equal_their_references(rows):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=g), torch.randn(576, generator=g)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
    x1, r1 = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g)
    x2, r2 = x1.clone(), r1.clone()
    reference.fused_add_rms_norm(x1, r1, w, 1e-5)
    cpu.fused_add_rms_norm(x2, r2, w, 1e-5)
    torch.testing.assert_close(x2, x1)
    assert torch.equal(r2, r1)  # the residual add is one float add per element
    qkv = torch.randn(rows, 15, 64, generator=g)
    positions = torch.randint(0, 1000, (rows,), generator=g)
    freqs = torch.arange(1024).float()[:, None] / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    cos, sin = freqs.cos(), freqs.sin()
    a, b = qkv.clone(), qkv.clone()
    reference.rotary(a[:, :9], a[:, 9:12], positions, cos, sin)
    cpu.rotary(b[:, :9], b[:, 9:12], positions, cos, sin)  # views of one buffer, as the model hands them
    torch.testing.assert_close(b, a)
    assert torch.equal(b[:, 12:], qkv[:, 12:])  # the values are not turned
    gate_up = torch.randn(rows, 2 * 1536, generator=g) * 4
    torch.testing.assert_close(cpu.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))


@pytest.fixture(scope="module")
def gguf_tensors():
    tensors = read_gguf_tensors(gguf_path())
    return {name: torch.from_numpy(tensors[name].data.copy()) for name in
            ("blk.0.ffn_down.weight", "blk.3.attn_q.weight", "token_embd.weight")}


# the embedding table's first rows as a Q8_0 matvec's weights: each output feature is its own sum (the other layers'
# are 576 rows), and the float64 oracles over all 49,152 rows took most of this file's time
EMBEDDING_ROWS = 4096


@needs_cpu
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_the_matvecs_equal_their_references_on_the_embedded_models_weights(rows, gguf_tensors):
    """The float32 streaming matvec, and Q4_1 and Q8_0 read as the GGUF stores them (fp16 scale and min, nibbles
    low then high), with and without a bias: float32 sums of 576 to 1,536 products in another order."""
    g = torch.Generator().manual_seed(rows)
    for name, in_features, op in (("blk.0.ffn_down.weight", 1536, "q4_1_linear"),
                                  ("blk.3.attn_q.weight", 576, "q4_1_linear"),
                                  ("token_embd.weight", 576, "q8_0_linear")):
        qweight = gguf_tensors[name][:EMBEDDING_ROWS]
        x = torch.randn(rows, in_features, generator=g)
        bias = torch.randn(qweight.shape[0], generator=g)
        for b in (None, bias):
            want = getattr(reference, op)(x, qweight, b)
            torch.testing.assert_close(getattr(cpu, op)(x, qweight, b), want, rtol=1e-5, atol=1e-4)
        dense = (reference.dequantize_q4_1 if op == "q4_1_linear" else reference.dequantize_q8_0)(qweight, in_features)
        torch.testing.assert_close(cpu.linear(x, dense, bias), torch.nn.functional.linear(x, dense, bias),
                                   rtol=1e-5, atol=1e-4)
    ids = torch.tensor([0, 7, 49151])
    assert torch.equal(cpu.q8_0_embedding(ids, gguf_tensors["token_embd.weight"], 576),
                       reference.q8_0_embedding(ids, gguf_tensors["token_embd.weight"], 576))


def _attention_args():
    q, kc, vc, table, lens, starts = ragged_batch([(1, 20), (4, 9)], 9, 3, 64, 16, 0)
    return dict(q=q, k_cache=kc, v_cache=vc, block_table=table, seq_lens=lens, query_start=starts, block_size=16)


BAD_ATTENTION = [
    ("a block id past the pool", lambda a: a["block_table"].__setitem__((0, 1), 99), "block_table"),
    ("a negative block id", lambda a: a["block_table"].__setitem__((1, 0), -1), "block_table"),
    ("a length past the table", lambda a: a["seq_lens"].__setitem__(0, 40), "seq_lens"),
    ("fewer keys than queries", lambda a: a["seq_lens"].__setitem__(1, 2), "seq_lens"),
    ("query starts that decrease", lambda a: a["query_start"].__setitem__(1, 9), "query_start"),
    ("query starts that miss the tokens", lambda a: a["query_start"].__setitem__(2, 4), "query_start"),
    ("a float block table", lambda a: a.__setitem__("block_table", a["block_table"].float()), "block_table"),
    ("int64 lengths", lambda a: a.__setitem__("seq_lens", a["seq_lens"].long()), "seq_lens"),
    ("a float64 query", lambda a: a.__setitem__("q", a["q"].double()), "q"),
    ("a transposed cache", lambda a: a.__setitem__("k_cache", a["k_cache"].transpose(0, 1)), "k_cache"),
    ("a missing sequence", lambda a: a.__setitem__("seq_lens", a["seq_lens"][:1]), "seq_lens"),
    ("a zero block size", lambda a: a.__setitem__("block_size", 0), "block_size"),
]


@needs_cpu
@pytest.mark.parametrize("what,spoil,name", BAD_ATTENTION, ids=[b[0] for b in BAD_ATTENTION])
def test_paged_attention_refuses_bad_tables_with_a_value_error_naming_the_argument(what, spoil, name):
    args = _attention_args()
    spoil(args)
    with pytest.raises(ValueError, match=name):
        cpu.paged_attention(**args)


@needs_cpu
def test_the_other_ops_refuse_bad_indices_and_shapes_before_writing():
    k, v = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    caches = torch.zeros(8, 3, 64), torch.zeros(8, 3, 64)
    for slots in ([0, 8], [0, -2]):
        with pytest.raises(ValueError, match="slot_mapping"):
            cpu.write_kv(k, v, *caches, torch.tensor(slots))
        assert caches[0].count_nonzero() == 0  # the good first slot was not written either
    with pytest.raises(ValueError, match="slot_mapping"):
        cpu.write_kv(k, v, *caches, torch.tensor([0]))
    q = torch.randn(2, 9, 64)
    cos = sin = torch.zeros(10, 32)
    with pytest.raises(ValueError, match="positions"):
        cpu.rotary(q, k, torch.tensor([3, 10]), cos, sin)
    with pytest.raises(ValueError, match="positions"):
        cpu.rotary(q, k, torch.tensor([-1, 0]), cos, sin)
    with pytest.raises(ValueError, match="ids"):
        cpu.q8_0_embedding(torch.tensor([5, 40]), torch.zeros(40, 18 * 34, dtype=torch.uint8), 576)
    with pytest.raises(ValueError, match="rows"):
        cpu.q4_1_linear(torch.randn(9, 64), torch.zeros(4, 40, dtype=torch.uint8))
    with pytest.raises(ValueError, match="qweight"):
        cpu.q4_1_linear(torch.randn(1, 64), torch.zeros(4, 41, dtype=torch.uint8))
    with pytest.raises(ValueError, match="x"):
        cpu.linear(torch.randn(1, 32), torch.randn(4, 64))
    with pytest.raises(ValueError, match="residual"):
        cpu.fused_add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-5)


def _good_args():
    """One small valid call of every op: the arguments the hostile cases below spoil one at a time."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "write_kv": dict(k=r(2, 2, 8), v=r(2, 2, 8), k_cache=torch.zeros(8, 2, 8), v_cache=torch.zeros(8, 2, 8),
                         slot_mapping=torch.tensor([0, 3])),
        "paged_attention": _attention_args(),
        "prefill_attention": _attention_args(),
        "rms_norm": dict(x=r(2, 8), weight=r(8), eps=1e-5),
        "fused_add_rms_norm": dict(x=r(2, 8), residual=r(2, 8), weight=r(8), eps=1e-5),
        "rotary": dict(q=r(2, 4, 8), k=r(2, 2, 8), positions=torch.tensor([0, 3]), cos=r(4, 4), sin=r(4, 4)),
        "silu_and_mul": dict(x=r(2, 16)),
        "linear": dict(x=r(1, 16), weight=r(4, 16), bias=r(4)),
        "q4_1_linear": dict(x=r(1, 32), qweight=torch.zeros(4, 20, dtype=torch.uint8), bias=r(4)),
        "q8_0_linear": dict(x=r(1, 32), qweight=torch.zeros(4, 34, dtype=torch.uint8), bias=r(4)),
        "q8_0_embedding": dict(ids=torch.tensor([0, 3]), table=torch.zeros(4, 34, dtype=torch.uint8), width=32),
    }


def _hostile_cases():
    """(op, argument, what, spoil): a tensor argument as a list, a NumPy array, a string, None (bias: None is fine)
    and a negative view (its memory holds the values un-negated); a number as a string, a float where an int is
    asked, NaN, a negative. One case per argument and per kind of bad value, not every pair: on each op every
    argument is spoilt once and every kind of bad value tried once (the checks are cpu.py's shared helpers, applied
    to each argument: a forgotten argument, or a helper that lets a kind through, fails a case)."""
    tensor = {"a list": lambda t: t.tolist(), "a numpy array": lambda t: t.numpy(), "a string": lambda t: "tensor",
              "a negative view": torch._neg_view, "None": lambda t: None}
    optional = {k: v for k, v in tensor.items() if k != "None"}
    eps = {"a string": lambda e: "1e-5", "a tensor": torch.tensor, "NaN": lambda e: math.nan,
           "negative": lambda e: -1.0, "None": lambda e: None}
    count = {"a float": float, "a string": str, "zero": lambda n: 0, "None": lambda n: None}  # width, block_size
    cases = []
    for op, args in _good_args().items():
        groups = {}  # the spoils of a kind of argument -> the op's arguments of that kind
        for name, value in args.items():
            kind = (optional if name == "bias" else tensor) if isinstance(value, torch.Tensor) else \
                eps if name == "eps" else count
            groups.setdefault(id(kind), (kind, []))[1].append(name)
        for spoils, names in groups.values():
            spoils = list(spoils.items())
            for i in range(max(len(names), len(spoils))):
                cases.append((op, names[i % len(names)], *spoils[i % len(spoils)]))
    return cases


HOSTILE = _hostile_cases()


@needs_cpu
@pytest.mark.parametrize("op,name,what,spoil", HOSTILE, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in HOSTILE])
def test_every_op_refuses_a_hostile_argument_with_a_value_error_naming_it(op, name, what, spoil):
    """A NumPy block table, a list x, a string eps, a float width, a negative view... each a ValueError naming the
    argument before memory is touched (not AttributeError, ctypes.ArgumentError, TypeError, or a wrong answer)."""
    args = _good_args()[op]
    getattr(cpu, op)(**args)  # the unspoilt call runs
    args[name] = spoil(args[name])
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        getattr(cpu, op)(**args)


@st.composite
def zero_sized(draw):
    """An op and its arguments with any of their sizes 0 to 3: tokens, heads, KV heads, head_dim, features."""
    op = draw(st.sampled_from(["write_kv", "paged_attention", "rms_norm", "fused_add_rms_norm", "rotary",
                               "silu_and_mul", "q8_0_embedding"]))
    T, H, KVH, D = (draw(st.integers(0, 3)) for _ in range(4))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if op == "write_kv":
        slots = torch.randperm(8, generator=g)[:T]
        return op, dict(k=r(T, KVH, D), v=r(T, KVH, D), k_cache=torch.zeros(8, KVH, D),
                        v_cache=torch.zeros(8, KVH, D), slot_mapping=slots), {"k": KVH * D == 0}
    if op == "paged_attention":
        H, D = H * max(KVH, 1), 2 * D  # heads a multiple of the KV heads
        q, kc, vc, table, lens, starts = ragged_batch([(T, T + 2)] if T else [], max(H, 1), max(KVH, 1), max(D, 1),
                                                      4, 0)
        q = r(T, H, D)
        kc, vc = r(kc.shape[0], KVH, D), r(kc.shape[0], KVH, D)
        return op, dict(q=q, k_cache=kc, v_cache=vc, block_table=table, seq_lens=lens, query_start=starts,
                        block_size=4), {"q": H * D == 0, "k_cache": KVH == 0}
    if op in ("rms_norm", "fused_add_rms_norm"):
        args = dict(x=r(T, D), weight=r(D), eps=1e-5)
        if op == "fused_add_rms_norm":
            args["residual"] = r(T, D)
        return op, args, {"x": D == 0}
    if op == "rotary":
        positions = torch.randint(0, 5, (T,), generator=g)
        return op, dict(q=r(T, H, 2 * D), k=r(T, KVH, 2 * D), positions=positions, cos=r(5, D), sin=r(5, D)), \
            {"q": H * D == 0, "k": KVH == 0}
    if op == "silu_and_mul":
        return op, dict(x=r(T, 2 * D)), {"x": D == 0}
    ids = torch.randint(0, 4, (T,), generator=g)
    return op, dict(ids=ids, table=torch.zeros(4, D * Q8_0, dtype=torch.uint8), width=32 * D), {"width": D == 0}


Q8_0 = 34  # bytes of a Q8_0 block


@needs_cpu
@settings(deadline=None)
@given(zero_sized())
def test_zero_sizes_give_the_references_empty_result_or_a_value_error_naming_the_argument(case):
    """No tokens (an empty step) is an empty result, as the reference gives; no heads, no KV heads, a head_dim or a
    row width of 0 is a ValueError naming the argument (never a crash: 0 query heads divided by zero in C++)."""
    op, args, refused = case
    bad = [name for name, zero in refused.items() if zero]
    if bad:
        with pytest.raises(ValueError, match=rf"\b({'|'.join(bad)})\b"):
            getattr(cpu, op)(**args)
        return
    mine = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    want, got = getattr(reference, op)(**args), getattr(cpu, op)(**mine)
    for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (want, got))):
        assert a is None and b is None or a.shape == b.shape
        torch.testing.assert_close(b, a) if a is not None else None
    for name, value in args.items():  # what the in-place ops wrote
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            torch.testing.assert_close(mine[name], value)


ZERO_HEADS = """
import torch
from minivllm import kernels
cpu = kernels.cpu_table()
q, cache = torch.randn(1, 0, 8), torch.randn(8, 1, 8)
table, lens, starts = (torch.tensor(v, dtype=torch.int32) for v in ([[0, 1]], [3], [0, 1]))
for what, call in [
        ("0 query heads", lambda: cpu.paged_attention(q, cache, cache, table, lens, starts, 4)),
        ("head_dim 0", lambda: cpu.paged_attention(torch.randn(1, 2, 0), torch.randn(8, 1, 0), torch.randn(8, 1, 0),
                                                   table, lens, starts, 4))]:
    try:
        call()
    except ValueError as e:
        print(what, "ValueError", e)
out = torch.empty(1, 0, 8)
status = cpu.lib.mv_paged_attention(out.data_ptr(), q.data_ptr(), 0, cache.data_ptr(), cache.data_ptr(),
                                    table.data_ptr(), 2, lens.data_ptr(), starts.data_ptr(), 1, 1, 0, 1, 8, 4, 2,
                                    1.0, 1)
print("ops.cpp with H = 0:", status, cpu.lib.mv_last_error().decode())
"""


@needs_cpu
def test_zero_query_heads_is_a_value_error_in_python_and_in_cpp_not_a_crash():
    """0 query heads passed ``H % KVH == 0`` and divided by zero in ops.cpp (SIGFPE: the process died), and a
    head_dim of 0 raised ZeroDivisionError: run in a child process, both refused, and ops.cpp's own check too."""
    out = subprocess.run([sys.executable, "-c", ZERO_HEADS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    lines = out.stdout.splitlines()
    assert lines[0].startswith("0 query heads ValueError q ") and lines[1].startswith("head_dim 0 ValueError q ")
    assert lines[2] == "ops.cpp with H = 0: 1 query heads (0) must be a positive multiple of KV heads (1)"


SILU_EXTREMES = [-math.inf, -3e38, -104.0, -100.0, -88.8, -88.72, -88.5, -88.0, -87.5, -87.3, -50.0, -1.0, -0.0, 0.0,
                 1e-45, 1.0, 50.0, 88.5, 100.0, 3e38, math.inf, math.nan]


@needs_cpu
@pytest.mark.parametrize("up", [1e38, -1e38, 1.0, 0.0, math.inf])
def test_silu_and_mul_equals_its_reference_at_the_extremes_on_both_paths(up):
    """The vector path capped exp at 88: a gate of -100 times an up of 1e38 gave -60.5 where the reference gives -0,
    and a gate of -inf gave inf, not NaN. Every extreme gate sits in the vector lanes and in the scalar tail."""
    gates = torch.tensor(SILU_EXTREMES * 3 + SILU_EXTREMES[:5])  # 71 gates: 64 or 56 in vectors, the rest a tail
    for shift in range(3):
        gate = gates.roll(shift)
        x = torch.cat([gate, torch.full_like(gate, up)])[None].repeat(2, 1)
        torch.testing.assert_close(cpu.silu_and_mul(x), reference.silu_and_mul(x), equal_nan=True)


def test_the_build_is_keyed_by_the_sources_and_this_cpu(tmp_path, monkeypatch):
    """A cached build is reused (the compiler not run again); another CPU's instruction sets, or an edit of the inner
    loops, builds anew. A build is three runs: ops.cpp compiled to an object, the inner unit with the inner loops,
    the link; an edit of the inner loops reuses ops.cpp's object (verified: spoilt, it is compiled again). The
    compiler's runs are recorded, not made (each writes its command as its output): the keys are what is tested
    here, the real builds are the other tests'."""
    if build.compiler() is None:
        pytest.skip("no C++ compiler here")
    runs, run = [], build._run

    def compile_(command):
        if "-o" not in command:  # the compiler's version, part of the key
            return run(command)
        Path(command[command.index("-o") + 1]).write_text(" ".join(command))
        runs.append(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(build, "_run", compile_)
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    first = build.build(quiet=True)
    assert first.exists() and build.build(quiet=True) == first and len(runs) == 3
    assert str(build.CSRC / "ops.cpp") in runs[0] and str(build.INNER_UNIT) in runs[1] and "-shared" in runs[2]
    with monkeypatch.context() as m:
        m.setattr(build, "cpu_key", lambda: "x86_64 AVX2 avx avx2 fma")
        assert build.build(quiet=True) != first and len(runs) == 6
    assert build.build(quiet=True) == first and len(runs) == 6
    edited = tmp_path / "inner.cpp"
    edited.write_text(build.INNER.read_text() + "\n// an edit\n")
    assert build.build(edited, quiet=True) != first and len(runs) == 8  # the inner unit and the link only
    assert f'-DMINIVLLM_INNER="{edited.resolve()}"' in runs[-2] and runs[-1][-4] == runs[2][-4]  # the same ops.o
    rest = Path(runs[2][-4])
    rest.write_text("spoilt")
    edited.write_text(build.INNER.read_text() + "\n// another edit\n")
    assert build.build(edited, quiet=True) != first and len(runs) == 11 and str(build.CSRC / "ops.cpp") in runs[-3]
    assert build.verified(rest)


FIRST_USE = """
import json, warnings, torch
from minivllm import kernels
from minivllm.kernels import reference
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ops = kernels.cpu_table()
    name = kernels.choose("auto", "cpu", torch.float32)[0]
x = torch.randn(3, 64)
right = ops is not None and torch.equal(ops.silu_and_mul(x), ops.silu_and_mul(x.clone())) and \\
    torch.allclose(ops.rms_norm(x, torch.ones(64), 1e-5), reference.rms_norm(x, torch.ones(64), 1e-5))
print(json.dumps([name, bool(right), [str(w.message) for w in caught if "kernels" in str(w.message)]]))
"""


def _first_use(cache, **env):
    """A fresh process's first use of the CPU kernels with ``cache`` as $MINIVLLM_CACHE: (the table ``auto``
    picks, its ops right, the kernels' warnings, whether it built, the finished process)."""
    out = subprocess.run([sys.executable, "-c", FIRST_USE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MINIVLLM_CACHE": str(cache), **env})
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])  # -7: SIGBUS, a truncated library mapped
    name, right, warned = json.loads(out.stdout.splitlines()[-1])
    return name, right, warned, "building the CPU kernels" in out.stdout


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """A cache holding one build of the kernels, made by a first process (each case below spoils a copy)."""
    if build.compiler() is None:
        pytest.skip("no C++ compiler here")
    cache = tmp_path_factory.mktemp("built")
    assert _first_use(cache) == ("cpu", True, [], True)
    return cache


def _symbolless_library(path):
    """A valid shared library with none of the ops (what a stale or foreign .so in the cache would be)."""
    source = path.with_suffix(".cpp")
    source.write_text('extern "C" int unrelated() { return 0; }\n')
    subprocess.run([build.compiler(), "-shared", "-fPIC", str(source), "-o", str(path)], check=True, timeout=300)


SPOILS = {
    "truncated": lambda lib, _: lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2]),
    "emptied": lambda lib, _: lib.write_bytes(b""),
    "garbled": lambda lib, _: lib.write_bytes(random.Random(0).randbytes(lib.stat().st_size)),
    "a library without the ops": lambda lib, _: _symbolless_library(lib),
    "without the ops, its digest forged": lambda lib, record: (
        _symbolless_library(lib), record.write_text(hashlib.sha256(lib.read_bytes()).hexdigest())),
}


def test_every_spoilt_cached_library_fails_its_sha256_check_but_the_forged_one(built_cache, tmp_path):
    """Truncated, emptied, garbled or replaced, a cached library's bytes no longer match the SHA-256 recorded at
    build; a forger who rewrites the record too passes this check (load's check of the ops catches it, below)."""
    for spoil, how in SPOILS.items():
        cache = tmp_path / spoil
        shutil.copytree(built_cache, cache)
        (lib,) = cache.glob("kernels/*/libminivllm_kernels.so")
        assert build.verified(lib)
        how(lib, build.digest_path(lib))
        assert build.verified(lib) == (spoil == "without the ops, its digest forged"), spoil


# one process rebuilding for each way a cached library is refused: its SHA-256 (truncated: it crashed every later
# process with SIGBUS), and its ops (a forged digest); emptied, garbled or replaced fail the same SHA-256 check
# (above), and each rebuild is a full build of the kernels
@pytest.mark.parametrize("spoil", ["truncated", "without the ops, its digest forged"])
def test_a_spoilt_cached_library_is_built_again_by_the_next_process(spoil, built_cache, tmp_path):
    """The cached library was trusted as found: truncated it crashed every later process (SIGBUS), emptied or
    garbled they all fell back to the reference, without its ops cpu_table() raised AttributeError. Now its bytes
    are checked against the SHA-256 recorded at build (and a library that passes yet lacks the ops is built again
    too): the next process builds it again and runs the C++ ops, no warning."""
    cache = tmp_path / "cache"
    shutil.copytree(built_cache, cache)
    (lib,) = cache.glob("kernels/*/libminivllm_kernels.so")
    SPOILS[spoil](lib, lib.with_name(lib.name + ".sha256"))  # the SHA-256 recorded beside it
    assert _first_use(cache) == ("cpu", True, [], True)
    assert build.verified(lib)
    assert _first_use(cache) == ("cpu", True, [], False)  # and the process after it loads it as it is


HANGING_CXX = """#!/bin/sh
# A C++ compiler that answers --version and then never finishes a build (its child never ends).
if [ "$1" = "--version" ]; then echo "hanging-c++ 1.0"; exit 0; fi
sleep 100000 &
echo $! > "$0.child"
wait
"""


def test_a_compiler_that_hangs_is_stopped_at_the_time_limit_and_the_reference_runs(tmp_path):
    """A compiler that never finishes hung the first use of the kernels forever: now it runs under a time limit
    (2 s here, $MINIVLLM_BUILD_TIMEOUT), is stopped with its children, and the reference runs, with one warning
    naming the limit."""
    cxx = tmp_path / "hanging-c++"
    cxx.write_text(HANGING_CXX)
    cxx.chmod(0o755)
    name, right, warned, _ = _first_use(tmp_path / "cache", CXX=str(cxx), MINIVLLM_BUILD_TIMEOUT="2")
    assert (name, right, len(warned)) == ("reference", False, 1)
    assert "did not finish within 2 s" in warned[0] and "MINIVLLM_BUILD_TIMEOUT" in warned[0]
    child = int((tmp_path / "hanging-c++.child").read_text())
    for _ in range(100):  # SIGKILL was sent before the build returned; the process table may lag a moment
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state in ("Z", "X"):
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError(f"the hanging compiler's child {child} was left running")


def test_exercise_18s_compiler_line_does_not_hang_on_a_compiler_that_never_answers(tmp_path, monkeypatch):
    """Exercise 18's first cell asks the compiler its version: one that never answers is stopped at the limit."""
    from minivllm.exercises.kernels import compiler_status

    cxx = tmp_path / "mute-c++"
    cxx.write_text("#!/bin/sh\nexec sleep 100000\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("MINIVLLM_BUILD_TIMEOUT", "1")
    assert "did not finish within 1 s" in compiler_status()


def test_a_bad_build_time_limit_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("MINIVLLM_BUILD_TIMEOUT", "soon")
    with pytest.raises(build.BuildError, match="MINIVLLM_BUILD_TIMEOUT"):
        build.build_timeout()
    monkeypatch.setenv("MINIVLLM_BUILD_TIMEOUT", "2.5")
    assert build.build_timeout() == 2.5
    monkeypatch.delenv("MINIVLLM_BUILD_TIMEOUT")
    assert build.build_timeout() == build.BUILD_TIMEOUT_S


def test_without_a_compiler_the_reference_runs_with_one_warning_and_stats_say_so():
    code = ("import warnings\n"
            "import minivllm.kernels.build as b\n"
            "b.compiler = lambda: None  # as on a machine without g++\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    from minivllm import LLM, SamplingParams\n"
            "    llm = LLM('tiny-random', num_blocks=16)\n"
            "    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)\n"
            "    LLM('tiny-random', num_blocks=16)\n"
            "mine = [str(w.message) for w in caught if 'kernels' in str(w.message)]\n"
            "print(len(mine), llm.engine.stats().kernels, len(out[0].outputs[0].token_ids), mine[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    count, table, tokens, message = out.stdout.split(maxsplit=3)
    assert (count, table, tokens) == ("1", "reference", "3") and "no C++ compiler" in message


def test_choose_follows_the_rule_and_refuses_what_cannot_run():
    assert kernels.choose("reference", "cpu", torch.float32) == ("reference", reference)
    assert kernels.choose("auto", "cpu", torch.bfloat16)[0] == "reference"  # the C++ kernels are float32
    with pytest.raises(ValueError, match="kernels='cpu' cannot run here"):
        kernels.choose("cpu", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="kernels must be one of"):
        kernels.choose("fast", "cpu", torch.float32)
    if cpu is not None:
        assert kernels.choose("auto", "cpu", torch.float32) == ("cpu", cpu)


def _table_with(**ops):
    """A module-like kernel table: the reference's ops, some replaced."""
    table = types.ModuleType("minivllm.kernels.triton_ops")
    for op in KERNEL_OPS:
        setattr(table, op, ops.get(op, getattr(reference, op)))
    return table


def _raises(*args, **kwargs):
    raise RuntimeError("triton.compiler.errors.CompilationError: at 12:4: unsupported on this GPU")


BROKEN = {
    "a wrong answer": ("rms_norm", lambda x, weight, eps: reference.rms_norm(x, weight, eps) * 1.01),
    "an exception": ("paged_attention", _raises),
    "an in-place write left out": ("write_kv", lambda *args: None),
    "a NaN": ("silu_and_mul", lambda x: reference.silu_and_mul(x) * math.nan),
}


def test_the_first_use_check_covers_every_op_and_passes_the_reference_and_the_cpu_kernels():
    from minivllm.kernels import selfcheck

    assert sorted({case.split(" (")[0] for case in selfcheck.cases("cpu", torch.float32)}) == sorted(KERNEL_OPS)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert selfcheck.failing_ops(reference, reference, "cpu", dtype) == {}
    if cpu is not None:  # another implementation of every op, in float32
        assert selfcheck.failing_ops(cpu, reference) == {}


@pytest.mark.parametrize("broken", BROKEN, ids=list(BROKEN))
def test_the_first_use_check_names_the_op_that_fails(broken):
    from minivllm.kernels import selfcheck

    op, fn = BROKEN[broken]
    failing = selfcheck.failing_ops(_table_with(**{op: fn}), reference)
    assert list(failing) == [op], failing


@pytest.fixture
def fake_cuda(monkeypatch):
    """choose() as on a CUDA machine with triton: the table is whatever module the test puts in triton_ops' place,
    checked on the CPU (there is no GPU here)."""
    from minivllm.kernels import selfcheck

    check = selfcheck.failing_ops
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(selfcheck, "failing_ops", lambda table, oracle, device, dtype: check(table, oracle))
    kernels.triton_table.cache_clear()

    def use(table):
        monkeypatch.setitem(sys.modules, "minivllm.kernels.triton_ops", table)
        monkeypatch.setattr(kernels, "triton_ops", table, raising=False)
    yield use
    kernels.triton_table.cache_clear()


def test_choose_falls_back_to_the_reference_with_one_warning_when_a_triton_op_fails_its_check(fake_cuda):
    """A Triton kernel never run on this GPU cannot take a reader's runtime down: ``auto`` checks the table at
    first use, and one failing op sends the reference, with one warning naming it (not once per model)."""
    fake_cuda(_table_with(paged_attention=_raises))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernels.choose("auto", "cuda", torch.bfloat16) == ("reference", reference)
        assert kernels.choose("auto", "cuda", torch.bfloat16) == ("reference", reference)
        with pytest.raises(ValueError, match="kernels='triton' cannot run here"):
            kernels.choose("triton", "cuda", torch.bfloat16)
    assert len(caught) == 1 and "paged_attention: RuntimeError" in str(caught[0].message)


def test_choose_picks_a_triton_table_that_passes_its_check(fake_cuda):
    good = _table_with()
    fake_cuda(good)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.choose("auto", "cuda", torch.bfloat16) == ("triton", good)


TRITON_SCRIPT = """
import itertools, math, torch
from minivllm.kernels import reference, triton_ops
from tests_kernels_cases import ragged_batch
for seed, (lens, block_size, (h, kvh, d)) in enumerate([
        ([(1, 7), (3, 9), (2, 2)], 4, (4, 2, 16)), ([(5, 5), (1, 1)], 1, (2, 1, 8)), ([(2, 17), (0, 3)], 16, (6, 3, 32))]):
    q, kc, vc, table, lens_t, starts = ragged_batch(lens, h, kvh, d, block_size, seed)
    got = triton_ops.paged_attention(q, kc, vc, table, lens_t, starts, block_size)
    want = reference.paged_attention(q, kc, vc, table, lens_t, starts, block_size)
    assert (got - want).abs().max() < 1e-5, (seed, (got - want).abs().max())
    k, v = torch.randn(3, kvh, d), torch.randn(3, kvh, d)
    caches = [torch.zeros(kc.shape[0], kvh, d) for _ in range(4)]
    slots = torch.tensor([2, -1, kc.shape[0] - 1])
    triton_ops.write_kv(k, v, caches[0], caches[1], slots)
    reference.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    table[0, 0] = 10 ** 6
    try:
        triton_ops.paged_attention(q, kc, vc, table, lens_t, starts, block_size)
    except ValueError as e:
        assert "block_table" in str(e)
    else:
        raise AssertionError("a block id outside the pool was not refused")
one = [torch.tensor(v, dtype=torch.int32) for v in ([[0, 1]], [3], [0, 1])]
for q_shape, kv_shape in [((1, 0, 16), (8, 1, 16)), ((1, 2, 16), (8, 0, 16)), ((1, 2, 0), (8, 1, 0))]:
    try:  # no heads, no KV heads (once a ZeroDivisionError), head_dim 0
        triton_ops.paged_attention(torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape), *one, 4)
    except ValueError as e:
        assert "heads" in str(e), e
    else:
        raise AssertionError(f"q {q_shape} over a cache {kv_shape} was not refused")
print("ok")
"""


def test_the_triton_kernels_equal_the_reference_under_the_interpreter(tmp_path):
    """The CUDA table's attention ops, run by Triton's interpreter on the CPU (tiny shapes: about a second a call)."""
    pytest.importorskip("triton", reason="triton is not installed (the CUDA table's kernels; pip install triton)")
    (tmp_path / "tests_kernels_cases.py").write_text(
        "import itertools, math, torch\n" + __import__("inspect").getsource(ragged_batch))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_an_avx2_build_agrees_with_the_reference_too(gguf_tensors):
    """The kernels are vectorised for the CPU they are built on (16 lanes with AVX-512, 8 with AVX2): on a machine
    with AVX-512, an AVX2 build of the same sources is checked as well, so both vector widths' sums are."""
    from minivllm.kernels.cpu import CpuKernels

    flags = build.cpu_key().split()
    if build.compiler() is None or "avx2" not in flags or "avx512f" not in flags:
        pytest.skip("needs a C++ compiler and a CPU with AVX-512 (the AVX2 build is the native one elsewhere)")
    avx2 = CpuKernels(build.load(build.build(quiet=True, isa=("-mavx2", "-mfma", "-mf16c"))), "cpu (avx2)")
    for seed, (lens, block_size, (h, kvh, d)) in enumerate([([(1, 37), (5, 21), (3, 3)], 16, (9, 3, 64)),
                                                            ([(1, 9), (7, 7)], 4, (8, 4, 8)),
                                                            ([(2, 40), (1, 5)], 7, (4, 1, 40))]):
        q, kc, vc, table, seq_lens, starts = ragged_batch(lens, h, kvh, d, block_size, seed)
        want = reference.paged_attention(q, kc, vc, table, seq_lens, starts, block_size)
        torch.testing.assert_close(avx2.paged_attention(q, kc, vc, table, seq_lens, starts, block_size), want,
                                   rtol=0, atol=ATTENTION_ATOL)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 576, generator=g), torch.randn(1536, 576, generator=g)
    torch.testing.assert_close(avx2.linear(x, w), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-4)
    gate_up = torch.randn(4, 2 * 1536, generator=g) * 4
    torch.testing.assert_close(avx2.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    qweight = gguf_tensors["blk.0.ffn_down.weight"]
    x = torch.randn(2, 1536, generator=g)
    torch.testing.assert_close(avx2.q4_1_linear(x, qweight), reference.q4_1_linear(x, qweight), rtol=1e-5, atol=1e-4)


# -- 8-bit activations: llama.cpp's integer dot products (csrc/int8_dot.h) ------------------------------------------

INT8_OPS = {"q4_1": ("q4_1_q8_1_linear", reference.Q4_1_BYTES), "q8_0": ("q8_0_q8_0_linear", reference.Q8_0_BYTES)}


def random_blocks(kind: str, n: int, blocks: int, g, scale: float = 0.01) -> torch.Tensor:
    """``n`` rows of random Q4_1 or Q8_0 blocks (every quant byte random, -128 included) with fp16 scales in
    [0, scale) (and minima in (-scale, scale))."""
    per = INT8_OPS[kind][1]
    qweight = torch.randint(0, 256, (n, blocks * per), dtype=torch.uint8, generator=g)
    if blocks == 0:
        return qweight
    view = qweight.view(n, blocks, per)
    view[..., 0:2] = (torch.rand(n, blocks, 1, generator=g) * scale).half().view(torch.uint8)
    if kind == "q4_1":
        view[..., 2:4] = ((torch.rand(n, blocks, 1, generator=g) * 2 - 1) * scale).half().view(torch.uint8)
    return qweight


@st.composite
def int8_cases(draw):
    """Rows 1-8, 0-48 blocks of 32 inputs, 1-40 outputs; activations of any scale (whole blocks of zeros, and blocks
    small enough that d is an fp16 subnormal), with and without a bias."""
    rows, blocks, n = draw(st.integers(1, 8)), draw(st.integers(1, 48)), draw(st.integers(1, 40))
    scale = draw(st.sampled_from([0.0, 1e-4, 0.03, 1.0, 300.0]))
    return rows, blocks, n, scale, draw(st.sampled_from(["q4_1", "q8_0"])), draw(st.booleans())


@needs_cpu
@settings(deadline=None, max_examples=60)
@given(int8_cases(), st.integers(0, 2**16))
def test_the_int8_matvecs_equal_their_references_within_the_stated_bound(case, seed):
    """Q8_1 rounding bit for bit, and each output within reference.int8_dot_bound of the reference: the integer sums
    are exact, only the float32 order of the block terms differs."""
    rows, blocks, n, scale, kind, with_bias = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks * 32, generator=g) * scale
    if blocks > 1:
        x[0, 32:64] = 0.0  # a block of zeros: d = 0, q = 0
    qweight = random_blocks(kind, n, blocks, g)
    bias = torch.randn(n, generator=g) if with_bias else None
    assert torch.equal(cpu.quantize_q8_1(x), reference.quantize_q8_1(x))
    op = INT8_OPS[kind][0]
    got, want = getattr(cpu, op)(x, qweight, bias), getattr(reference, op)(x, qweight, bias)
    bound = reference.int8_dot_bound(x, qweight, kind, bias)
    assert ((got.double() - want.double()).abs() <= bound).all()


@needs_cpu
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_the_int8_matvecs_on_the_embedded_models_weights(rows, gguf_tensors):
    """The GGUF's own Q4_1 and Q8_0 blocks: within int8_dot_bound of the reference, and within the 8-bit rounding's
    bound (reference.int8_rounding_bound) of the float32-activation kernel, which is exact to the float32 weights."""
    g = torch.Generator().manual_seed(rows)
    for name, in_features, kind in (("blk.0.ffn_down.weight", 1536, "q4_1"), ("blk.3.attn_q.weight", 576, "q4_1"),
                                    ("token_embd.weight", 576, "q8_0")):
        qweight = gguf_tensors[name][:EMBEDDING_ROWS]
        x = torch.randn(rows, in_features, generator=g)
        op = INT8_OPS[kind][0]
        got = getattr(cpu, op)(x, qweight)
        want = getattr(reference, op)(x, qweight)
        assert ((got.double() - want.double()).abs() <= reference.int8_dot_bound(x, qweight, kind)).all()
        dense = (reference.dequantize_q4_1 if kind == "q4_1" else reference.dequantize_q8_0)(qweight, in_features)
        exact = x.double() @ dense.double().T
        slack = (in_features // 32 + 8) * 2.0 ** -24 * (x.double().abs() @ dense.double().abs().T)  # float32 sums
        moved = (got.double() - exact).abs()
        assert (moved <= reference.int8_rounding_bound(x, dense) + slack).all()
        assert moved.max() > 1e-3  # ... and the 8-bit rounding does move them: this is not the float32 kernel


@needs_cpu
def test_every_cpu_path_gives_the_int8_matvecs_same_bits(gguf_tensors):
    """The same sums in the same order on every instruction set: a scalar build (no AVX2; software fp16) and, on an
    AVX-512 machine, an AVX2 one give the native build's bits exactly, and each names its dot product."""
    from minivllm.kernels.cpu import CpuKernels

    flags = build.cpu_key().split()
    if build.compiler() is None or not flags or flags[0] != "x86_64":
        pytest.skip("needs a C++ compiler on x86-64 (the scalar build targets -march=x86-64)")
    builds = {"scalar": ("-march=x86-64",)}
    if "avx512f" in flags and "avx2" in flags:
        builds["avx2-maddubs"] = ("-mavx2", "-mfma", "-mf16c")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1536, generator=g)
    x[1, :32] *= 1e-5  # an fp16-subnormal d: the software conversion's branch
    cases = [("q4_1", gguf_tensors["blk.0.ffn_down.weight"], x), ("q8_0", gguf_tensors["token_embd.weight"][:4000],
                                                                  x[:, :576].contiguous())]
    for kind, flags_ in builds.items():
        other = CpuKernels(build.load(build.build(quiet=True, isa=flags_)), f"cpu ({kind})")
        assert other.int8_dot_kind == kind
        assert torch.equal(other.quantize_q8_1(x), cpu.quantize_q8_1(x))
        for weights, qweight, rows in cases:
            op = INT8_OPS[weights][0]
            bias = torch.randn(qweight.shape[0], generator=g)
            assert torch.equal(getattr(other, op)(rows, qweight, bias), getattr(cpu, op)(rows, qweight, bias))
    assert cpu.int8_dot_kind in ("avx512-vnni", "avx-vnni", "avx2-maddubs", "scalar")


BAD_INT8 = [
    ("nine rows", lambda a: a.__setitem__("x", torch.randn(9, 64)), "rows"),
    ("no rows", lambda a: a.__setitem__("x", torch.randn(0, 64)), "rows"),
    ("float64 x", lambda a: a.__setitem__("x", a["x"].double()), "x"),
    ("a transposed x", lambda a: a.__setitem__("x", torch.randn(64, 2).T), "x"),
    ("a list for x", lambda a: a.__setitem__("x", [[0.0] * 64]), "x"),
    ("x of 1-d", lambda a: a.__setitem__("x", torch.randn(64)), "x"),
    ("inputs not whole blocks", lambda a: a.__setitem__("x", torch.randn(2, 48)), "qweight"),
    ("a block too few", lambda a: a.__setitem__("qweight", a["qweight"][:, :-4].contiguous()), "qweight"),
    ("int8 weights", lambda a: a.__setitem__("qweight", a["qweight"].view(torch.int8)), "qweight"),
    ("strided weights", lambda a: a.__setitem__("qweight", a["qweight"].repeat(1, 2)[:, ::2]), "qweight"),
    ("a short bias", lambda a: a.__setitem__("bias", torch.zeros(3)), "bias"),
    ("a float64 bias", lambda a: a.__setitem__("bias", torch.zeros(4, dtype=torch.float64)), "bias"),
]


@needs_cpu
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("what,spoil,name", BAD_INT8, ids=[b[0] for b in BAD_INT8])
def test_the_int8_ops_refuse_bad_input_with_a_value_error_naming_the_argument(kind, what, spoil, name):
    op, per = INT8_OPS[kind]
    args = dict(x=torch.randn(2, 64), qweight=torch.zeros(4, 2 * per, dtype=torch.uint8), bias=None)
    spoil(args)
    with pytest.raises(ValueError, match=name):
        getattr(cpu, op)(**args)


@needs_cpu
def test_quantize_q8_1_refuses_what_is_not_rows_of_whole_blocks():
    for bad in (torch.randn(2, 40), torch.randn(64), torch.randn(2, 64).double(), torch.randn(64, 2).T, "x"):
        with pytest.raises(ValueError, match="x"):
            cpu.quantize_q8_1(bad)


@pytest.mark.parametrize("march,kind", [("icelake-server", b"avx512-vnni"), ("alderlake", b"avx-vnni")])
def test_the_vnni_paths_compile_for_the_cpus_that_have_them(march, kind):
    """This machine may lack VNNI, so its dot products are only compiled here: for an AVX-512 VNNI Xeon and for an
    AVX-VNNI client CPU the build picks dpbusd (the library names its kind; a refused build would fall back to this
    CPU's and name another). That they give the other paths' bits: test_every_cpu_path_gives_the_int8_matvecs_same_bits
    on such a machine."""
    flags = build.cpu_key().split()
    if build.compiler() is None or not flags or flags[0] != "x86_64":
        pytest.skip("needs a C++ compiler on x86-64")
    library = build.build(quiet=True, isa=(f"-march={march}",))
    assert kind + b"\0" in library.read_bytes()


def test_the_triton_table_names_every_op_of_a_kernel_table():
    """triton_ops (read as source: importing it needs triton, which the CPU has not) defines or takes from the
    reference every op of KERNEL_OPS: a missing one would fail its first-use check on every GPU, and the
    reference would run instead."""
    import ast

    tree = ast.parse((Path(kernels.__file__).parent / "triton_ops.py").read_text())
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    names |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert [op for op in KERNEL_OPS if op not in names] == []
