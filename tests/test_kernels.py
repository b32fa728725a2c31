"""The kernel layer (chapter 18): every C++ op against its PyTorch reference, bad input refused before memory is
touched, the build cached per machine, and the reference as the fallback where nothing builds."""

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import kernels
from minivllm.kernels import build, reference
from minivllm.models.loader import gguf_path
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
    width = max(1, max(map(len, tables)))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor([n for _, n in draw_lens], dtype=torch.int32)
    starts = torch.tensor([0, *itertools.accumulate(q for q, _ in draw_lens)], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), heads, dim, generator=g)
    return q, k_cache, v_cache, table, lens, starts


@st.composite
def sequences(draw):
    """1 to 6 sequences, each a decode row, a chunk after cached keys, or a whole prompt; lengths 1 to 5 blocks."""
    block_size = draw(st.sampled_from([1, 4, 7, 16]))
    out = []
    for _ in range(draw(st.integers(1, 6))):
        length = draw(st.integers(1, 5 * block_size + 3))
        queries = draw(st.sampled_from([1, length, draw(st.integers(0, length))]))
        out.append((queries, length))
    return out, block_size


@needs_cpu
@settings(deadline=None)
@given(sequences(), st.sampled_from([(9, 3, 64), (4, 2, 16), (8, 4, 8), (2, 2, 40), (6, 1, 32)]),
       st.integers(0, 2**16))
def test_paged_attention_equals_its_reference_on_random_ragged_batches(seqs, heads, seed):
    """Decode rows, chunks after cached keys and whole prompts in one call, each row to its own length: GQA, block
    sizes 1-16, lengths across block boundaries, rows with no queries."""
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
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(gguf_path()).tensors}
    return {name: torch.from_numpy(tensors[name].data.copy()) for name in
            ("blk.0.ffn_down.weight", "blk.3.attn_q.weight", "token_embd.weight")}


@needs_cpu
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_the_matvecs_equal_their_references_on_the_embedded_models_weights(rows, gguf_tensors):
    """The float32 streaming matvec, and Q4_1 and Q8_0 read as the GGUF stores them (fp16 scale and min, nibbles
    low then high), with and without a bias: float32 sums of 576 to 1,536 products in another order."""
    g = torch.Generator().manual_seed(rows)
    for name, in_features, op in (("blk.0.ffn_down.weight", 1536, "q4_1_linear"),
                                  ("blk.3.attn_q.weight", 576, "q4_1_linear"),
                                  ("token_embd.weight", 576, "q8_0_linear")):
        qweight = gguf_tensors[name]
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


def test_the_build_is_keyed_by_the_sources_and_this_cpu(tmp_path, monkeypatch):
    """A cached build is reused; another CPU's instruction sets, or an edit of the inner loops, builds anew."""
    if build.compiler() is None:
        pytest.skip("no C++ compiler here")
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    first = build.build(quiet=True)
    assert first.exists() and build.build(quiet=True) == first
    monkeypatch.setattr(build, "cpu_key", lambda: "x86_64 AVX2 avx avx2 fma")
    assert build.build(quiet=True) != first
    edited = tmp_path / "inner.cpp"
    edited.write_text(build.INNER.read_text() + "\n// an edit\n")
    monkeypatch.undo()
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    assert build.build(edited, quiet=True) not in (first,)


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
    rows, blocks, n = draw(st.integers(1, 8)), draw(st.integers(0, 48)), draw(st.integers(1, 40))
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
        qweight = gguf_tensors[name]
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
