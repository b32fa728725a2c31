"""The op table's C++ kernels for the CPU (chapter 18): ``csrc/`` built for this machine, called through ctypes.

:class:`CpuKernels` over a built library is a kernel table: each method has its
reference's signature (:mod:`minivllm.kernels.reference`). Python checks what
only it can see (dtype, device, layout, shapes) and the C++ checks every
index (slots, block ids, lengths, positions, token ids) before it touches
memory: bad input is a ``ValueError`` naming the argument, never a crash. A
call holds no Python lock while it runs (ctypes releases the GIL). Each table
is its own library, so a reader's build of the inner loops (exercise 18) runs
beside minivllm's.
"""

from __future__ import annotations

import ctypes
import functools
import math
import numbers
import operator

import torch

from minivllm.config import cdiv
from minivllm.kernels.reference import Q4_1_BYTES, Q8_0_BYTES, Q8_1_BYTES, QBLOCK

MAX_ROWS = 8  # rows the few-rows matmuls take at once (csrc kMaxRows)
NOT_WRITTEN = 2  # an op's status when its inner loop is exercise 18's stub (csrc kNotWritten): NotImplementedError
SPLIT_MIN_KEYS = 128  # split-KV: no chunk shorter (csrc/split_kv.h kSplitMinKeys)
SPLIT_GRANULE = 16  # split-KV: chunk lengths are multiples of this many keys (kSplitGranule)


def split_kv_chunk_keys(rows: int, kv_heads: int, max_len: int, threads: int) -> int:
    """Split-KV's rule (chapter 18c; csrc/split_kv.h's ``split_kv_rule``, which it mirrors): the keys per chunk of a
    decode step of ``rows`` rows (one query each), the longest ``max_len`` keys, over ``threads`` threads;
    ``max_len`` itself where the step is not split. Its work items are rows x kv_heads: split only where threads
    would wait (fewer than two items a thread, and not a multiple of the threads), into the fewest chunks that give
    every thread as many equal chunks, ``threads / gcd(items, threads)``, none under :data:`SPLIT_MIN_KEYS`."""
    items = rows * kv_heads
    if threads < 2 or items < 1 or max_len < 1 or items >= 2 * threads or items % threads == 0:
        return max_len
    chunks = min(threads // math.gcd(items, threads), max_len // SPLIT_MIN_KEYS)
    if chunks < 2:
        return max_len
    return cdiv(cdiv(max_len, chunks), SPLIT_GRANULE) * SPLIT_GRANULE


def split_kv_chunks(rows: int, kv_heads: int, max_len: int, threads: int) -> int:
    """How many chunks split-KV cuts the longest row's keys into (1: not split), by :func:`split_kv_chunk_keys`."""
    return cdiv(max_len, split_kv_chunk_keys(rows, kv_heads, max_len, threads)) if max_len > 0 else 1


def split_kv_plan(seq_lens: list[int], kv_heads: int, threads: int, chunk_keys: int | None = None) -> list[tuple]:
    """A decode step's work items as the C++ makes them (chapter 18c): ``(row, kv_head, first_key, end_key,
    thread)`` in its order (row, KV head, chunk), item ``i`` on thread ``i % threads`` (``schedule(static, 1)``).
    ``chunk_keys`` pins a chunk length (``CpuKernels.paged_attention_chunked``); None takes the rule's."""
    max_len = max(seq_lens, default=0)
    keys = chunk_keys or split_kv_chunk_keys(len(seq_lens), kv_heads, max_len, threads)
    keys = keys if keys < max_len else max(max_len, 1)
    items = [(b, g, k0, min(k0 + keys, n)) for b, n in enumerate(seq_lens) for g in range(kv_heads)
             for k0 in range(0, n, keys)]
    return [(*item, i % threads) for i, item in enumerate(items)]


def _named(fn):
    """``fn`` under the profiler's ``record_function("minivllm::<op>")`` while a profile runs (a ctypes call is no
    torch op, so the profiler would not see it otherwise); as it is, at no cost, when none runs."""
    name = f"minivllm::{fn.__name__}"

    @functools.wraps(fn)
    def op(*args, **kwargs):
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return op


def _plain(t, name: str) -> None:
    """Refuse what is no torch tensor, and a negative or conjugate view (``torch._neg_view``, ``.conj()``): its
    memory does not hold its values, and C++ reads the memory."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.is_neg() or t.is_conj():
        raise ValueError(f"{name} is a negative or conjugate view, whose memory does not hold its values: pass "
                         f"{name}.resolve_neg() (or .resolve_conj())")


def _tensor(t, name: str, dtype=torch.float32, dims: int | None = None) -> int:
    """``t``'s address, once it is a contiguous CPU tensor of ``dtype`` (with ``dims`` dimensions)."""
    _plain(t, name)
    if t.dtype is dtype and t.is_cpu and t.is_contiguous() and (dims is None or t.dim() == dims):
        return t.data_ptr()
    shape = f"{dims}-d " if dims is not None else ""
    raise ValueError(f"{name} must be a contiguous {shape}{dtype} CPU tensor, got {tuple(t.shape)} {t.dtype} "
                     f"on {t.device}{'' if t.is_contiguous() else ', not contiguous'}")


def _rows(t, name: str, dims: int = 3) -> tuple[int, int]:
    """A float32 CPU tensor whose last dims are contiguous (a view of a wider row is fine): (address, row stride).
    Its tokens may be none; its heads and their dimension may not."""
    if not (isinstance(t, torch.Tensor) and t.dtype is torch.float32 and t.is_cpu and t.dim() == dims):
        raise ValueError(f"{name} must be a {dims}-d float32 CPU tensor")
    _plain(t, name)
    _shape(min(t.shape[1:]) >= 1, f"{name} {tuple(t.shape)} has no heads or a head_dim of 0")
    stride = t.stride()
    if stride[-1] != 1 or stride[-2] != t.shape[-1]:
        raise ValueError(f"{name}'s heads must be contiguous within a token, got strides {stride}")
    return t.data_ptr(), stride[0]


def _shape(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _eps(eps) -> float:
    """A norm's epsilon: a finite real number >= 0 (a string or a tensor is refused, naming ``eps``)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def _count(n, name: str) -> int:
    """A positive int (a Python or NumPy int; a float, a bool or a string is refused, naming it)."""
    try:
        value = None if isinstance(n, bool) else operator.index(n)
    except TypeError:
        value = None
    if value is None or value < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    return value


def _few_rows(x, weight_rows: int, bias, in_features: int):
    xp = _tensor(x, "x", dims=2)
    _shape(x.shape[1] >= 1, f"x {tuple(x.shape)} has no input features")
    _shape(1 <= x.shape[0] <= MAX_ROWS, f"x has {x.shape[0]} rows: the matvec kernels take 1 to {MAX_ROWS}")
    _shape(x.shape[1] == in_features, f"x {tuple(x.shape)} must have the weight's {in_features} input features")
    bp = None
    if bias is not None:
        bp = _tensor(bias, "bias", dims=1)
        _shape(bias.shape[0] == weight_rows, f"bias {tuple(bias.shape)} must have {weight_rows} entries")
    return xp, bp, torch.empty(x.shape[0], weight_rows)


def _quantized(qweight, x, per_block: int) -> int:
    _tensor(x, "x", dims=2)
    wp = _tensor(qweight, "qweight", torch.uint8, 2)
    _shape(qweight.shape[0] >= 1, f"qweight {tuple(qweight.shape)} has no rows (output features)")
    _shape(x.shape[-1] % QBLOCK == 0 and qweight.shape[1] == x.shape[-1] // QBLOCK * per_block,
           f"qweight {tuple(qweight.shape)} does not hold {x.shape[-1]} input features in blocks of {QBLOCK}")
    return wp


class CpuKernels:
    """The kernel table of one built library (:func:`minivllm.kernels.build.load`), called ``name``."""

    def __init__(self, lib: ctypes.CDLL, name: str = "cpu"):
        self.lib, self.name = lib, name
        # whether attention.py sends a step's prompt rows to prefill_attention (csrc/prefill.h): minivllm's own
        # table; a reader's (exercise 18) attends every row with its own inner loops
        self.tiled_prefill = name == "cpu"

    def __repr__(self) -> str:
        return f"CpuKernels({self.name!r})"

    def not_written(self) -> list[str]:
        """The inner loops still exercise 18's stub (``MINIVLLM_NOT_WRITTEN``): each op that calls one run once on
        a tiny input, and the loops whose op says "not written yet" (none for minivllm's own build)."""
        # a table and a cache with room past the one key: a loop that reads a block too far still returns
        q, cache, one = torch.zeros(1, 1, 8), torch.zeros(16, 1, 8), torch.ones(1, dtype=torch.int32)
        calls = {"attend_tile": lambda: self.paged_attention(q, cache, cache, torch.zeros(1, 4, dtype=torch.int32),
                                                             one, torch.tensor([0, 1], dtype=torch.int32), 4),
                 "q4_1_block_dot": lambda: self.q4_1_linear(torch.zeros(1, QBLOCK),
                                                            torch.zeros(1, Q4_1_BYTES, dtype=torch.uint8))}
        left = []
        for loop, call in calls.items():
            try:
                call()
            except NotImplementedError:
                left.append(loop)
        return left

    def _check(self, status: int) -> None:
        if status == NOT_WRITTEN:
            raise NotImplementedError(self.lib.mv_last_error().decode())
        if status:
            raise ValueError(self.lib.mv_last_error().decode())

    @_named
    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        (kp, ks), (vp, vs) = _rows(k, "k"), _rows(v, "v")
        kc, vc = _tensor(k_cache, "k_cache", dims=3), _tensor(v_cache, "v_cache", dims=3)
        sp = _tensor(slot_mapping, "slot_mapping", torch.int64, 1)
        T = k.shape[0]
        _shape(v.shape == k.shape and k.shape[1:] == k_cache.shape[1:] and v_cache.shape == k_cache.shape,
               f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, kv_heads, dim] of the caches "
               f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
        _shape(slot_mapping.shape[0] == T, f"slot_mapping has {slot_mapping.shape[0]} slots for {T} tokens")
        self._check(self.lib.mv_write_kv(kp, ks, vp, vs, kc, vc, sp, T, k.shape[1] * k.shape[2], k_cache.shape[0]))

    @_named
    def paged_attention(self, q, k_cache, v_cache, block_table, seq_lens, query_start, block_size: int) -> torch.Tensor:
        return self.paged_attention_chunked(q, k_cache, v_cache, block_table, seq_lens, query_start, block_size, 0)

    @property
    def split_kv(self) -> bool:
        """Whether this build splits a decode step's keys over the threads (minivllm's inner loops do; a build of a
        reader's, exercise 18, attends every row through the reader's ``attend_tile``, unsplit)."""
        return bool(self.lib.mv_split_kv_built())

    def paged_attention_chunked(self, q, k_cache, v_cache, block_table, seq_lens, query_start, block_size: int,
                                chunk_keys: int) -> torch.Tensor:
        """:meth:`paged_attention` with split-KV's chunk length pinned (chapter 18c): ``chunk_keys`` 0 is the rule's
        (:func:`split_kv_chunk_keys`), a positive number cuts a decode step's rows into chunks of that many keys
        (one at least as long as the longest row: unsplit). Steps with more than one query a row are not split."""
        _shape(isinstance(chunk_keys, int) and not isinstance(chunk_keys, bool) and chunk_keys >= 0,
               f"chunk_keys must be an int >= 0 (0: the rule's), got {chunk_keys!r}")
        return self._attention(self.lib.mv_paged_attention_chunked, q, k_cache, v_cache, block_table, seq_lens,
                               query_start, block_size, chunk_keys)

    @_named
    def prefill_attention(self, q, k_cache, v_cache, block_table, seq_lens, query_start,
                          block_size: int) -> torch.Tensor:
        """:meth:`paged_attention`'s arguments and result, by the tiled prefill kernel (``csrc/prefill.h``): what
        :func:`minivllm.attention.native_prefill_rows` sends there, a step's prompt rows."""
        return self._attention(self.lib.mv_prefill_attention, q, k_cache, v_cache, block_table, seq_lens,
                               query_start, block_size)

    def _attention(self, kernel, q, k_cache, v_cache, block_table, seq_lens, query_start, block_size: int, *extra):
        qp, qs_ = _rows(q, "q")
        kc, vc = _tensor(k_cache, "k_cache", dims=3), _tensor(v_cache, "v_cache", dims=3)
        bt = _tensor(block_table, "block_table", torch.int32, 2)
        sl = _tensor(seq_lens, "seq_lens", torch.int32, 1)
        qs = _tensor(query_start, "query_start", torch.int32, 1)
        T, H, D = q.shape
        B = seq_lens.shape[0]
        _shape(v_cache.shape == k_cache.shape and k_cache.shape[2] == D,
               f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be [slots, kv_heads, {D}]")
        _shape(k_cache.shape[1] >= 1 and H % k_cache.shape[1] == 0,
               f"q's {H} heads must be a multiple of k_cache's {k_cache.shape[1]} KV heads (at least one)")
        _shape(block_table.shape[0] == B and query_start.shape[0] == B + 1,
               f"block_table {tuple(block_table.shape)}, seq_lens ({B},) and query_start {tuple(query_start.shape)} "
               f"must describe the same sequences")
        _shape(isinstance(block_size, int) and block_size >= 1, f"block_size must be a positive int, got {block_size}")
        out = torch.empty(q.shape)
        self._check(kernel(out.data_ptr(), qp, qs_, kc, vc, bt, block_table.shape[1], sl, qs, B, T, H,
                           k_cache.shape[1], D, block_size, k_cache.shape[0] // block_size,
                           1.0 / math.sqrt(D), torch.get_num_threads(), *extra))
        return out

    @_named
    def rms_norm(self, x, weight, eps: float) -> torch.Tensor:
        xp, wp = _tensor(x, "x", dims=2), _tensor(weight, "weight", dims=1)
        _shape(x.shape[1] >= 1, f"x {tuple(x.shape)} has rows of no elements")
        _shape(weight.shape[0] == x.shape[1], f"weight {tuple(weight.shape)} must match x's rows {tuple(x.shape)}")
        out = torch.empty_like(x)
        self._check(self.lib.mv_rms_norm(out.data_ptr(), xp, wp, x.shape[0], x.shape[1], _eps(eps),
                                         torch.get_num_threads()))
        return out

    @_named
    def fused_add_rms_norm(self, x, residual, weight, eps: float):
        xp, rp, wp = _tensor(x, "x", dims=2), _tensor(residual, "residual", dims=2), _tensor(weight, "weight", dims=1)
        _shape(x.shape[1] >= 1, f"x {tuple(x.shape)} has rows of no elements")
        _shape(residual.shape == x.shape and weight.shape[0] == x.shape[1],
               f"x {tuple(x.shape)}, residual {tuple(residual.shape)} and weight {tuple(weight.shape)} do not match")
        self._check(self.lib.mv_fused_add_rms_norm(xp, rp, wp, x.shape[0], x.shape[1], _eps(eps),
                                                   torch.get_num_threads()))
        return x, residual

    @_named
    def rotary(self, q, k, positions, cos, sin) -> None:
        (qp, qstride), (kp, kstride) = _rows(q, "q"), _rows(k, "k")
        pp = _tensor(positions, "positions", torch.int64, 1)
        cp, sp = _tensor(cos, "cos", dims=2), _tensor(sin, "sin", dims=2)
        T, H, D = q.shape
        _shape(k.shape[0] == T and k.shape[2] == D and positions.shape[0] == T and D % 2 == 0,
               f"q {tuple(q.shape)}, k {tuple(k.shape)} and positions {tuple(positions.shape)} must share T and dim")
        _shape(cos.shape == sin.shape and cos.shape[1] == D // 2,
               f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [max_position, {D // 2}]")
        self._check(self.lib.mv_rotary(qp, qstride, kp, kstride, pp, cp, sp, T, H, k.shape[1], D, cos.shape[0],
                              torch.get_num_threads()))

    @_named
    def silu_and_mul(self, x) -> torch.Tensor:
        xp = _tensor(x, "x", dims=2)
        _shape(x.shape[1] % 2 == 0 and x.shape[1] >= 2, f"x {tuple(x.shape)} must be [T, 2 * intermediate]")
        out = torch.empty(x.shape[0], x.shape[1] // 2)
        self._check(self.lib.mv_silu_and_mul(out.data_ptr(), xp, x.shape[0], x.shape[1] // 2, torch.get_num_threads()))
        return out

    @_named
    def linear(self, x, weight, bias=None) -> torch.Tensor:
        wp = _tensor(weight, "weight", dims=2)
        _shape(min(weight.shape) >= 1, f"weight {tuple(weight.shape)} has no output or no input features")
        xp, bp, out = _few_rows(x, weight.shape[0], bias, weight.shape[1])
        self._check(self.lib.mv_linear_f32(out.data_ptr(), xp, wp, bp, x.shape[0], weight.shape[0], weight.shape[1],
                                  torch.get_num_threads()))
        return out

    @_named
    def q4_1_linear(self, x, qweight, bias=None) -> torch.Tensor:
        wp = _quantized(qweight, x, Q4_1_BYTES)
        xp, bp, out = _few_rows(x, qweight.shape[0], bias, x.shape[-1])
        self._check(self.lib.mv_q4_1_linear(out.data_ptr(), xp, wp, bp, x.shape[0], qweight.shape[0], x.shape[1],
                                   torch.get_num_threads()))
        return out

    @_named
    def q8_0_linear(self, x, qweight, bias=None) -> torch.Tensor:
        wp = _quantized(qweight, x, Q8_0_BYTES)
        xp, bp, out = _few_rows(x, qweight.shape[0], bias, x.shape[-1])
        self._check(self.lib.mv_q8_0_linear(out.data_ptr(), xp, wp, bp, x.shape[0], qweight.shape[0], x.shape[1],
                                   torch.get_num_threads()))
        return out

    @_named
    def q8_0_embedding(self, ids, table, width: int) -> torch.Tensor:
        ip, tp = _tensor(ids, "ids", torch.int64, 1), _tensor(table, "table", torch.uint8, 2)
        width = _count(width, "width")
        _shape(width % QBLOCK == 0 and table.shape[1] == width // QBLOCK * Q8_0_BYTES,
               f"table {tuple(table.shape)} does not hold rows of {width} in Q8_0 blocks")
        out = torch.empty(ids.shape[0], width)
        self._check(self.lib.mv_q8_0_embedding(out.data_ptr(), ip, tp, ids.shape[0], table.shape[0], width))
        return out

    # -- 8-bit activations (csrc/int8_dot.h): llama.cpp's integer dot products, equal to the reference's within
    # reference.int8_dot_bound, and the same bits on every CPU (AVX-512 VNNI, AVX-VNNI, AVX2, scalar)

    @property
    def int8_dot_kind(self) -> str:
        """The integer dot product this build runs, by the instruction sets it was built for (``-march=native``):
        "avx512-vnni", "avx-vnni" (``dpbusd``), "avx2-maddubs" (``maddubs`` + ``madd``) or "scalar"."""
        return self.lib.mv_int8_dot_kind().decode()

    def _int8_args(self, x, qweight, bias, per_block: int):
        xp = _tensor(x, "x", dims=2)
        wp = _tensor(qweight, "qweight", torch.uint8, 2)
        _shape(x.shape[1] % QBLOCK == 0 and qweight.shape[1] == x.shape[1] // QBLOCK * per_block,
               f"qweight {tuple(qweight.shape)} does not hold x's {x.shape[1]} input features in blocks of {QBLOCK}")
        return (wp, *_few_rows(x, qweight.shape[0], bias, x.shape[1]))

    @_named
    def quantize_q8_1(self, x) -> torch.Tensor:
        xp = _tensor(x, "x", dims=2)
        _shape(x.shape[1] % QBLOCK == 0, f"x {tuple(x.shape)}: rows must be whole blocks of {QBLOCK}")
        out = torch.empty(x.shape[0], x.shape[1] // QBLOCK * Q8_1_BYTES, dtype=torch.uint8)
        self._check(self.lib.mv_quantize_q8_1(out.data_ptr(), xp, x.shape[0], x.shape[1]))
        return out

    @_named
    def q4_1_q8_1_linear(self, x, qweight, bias=None) -> torch.Tensor:
        wp, xp, bp, out = self._int8_args(x, qweight, bias, Q4_1_BYTES)
        self._check(self.lib.mv_q4_1_q8_1_linear(out.data_ptr(), xp, wp, bp, x.shape[0], qweight.shape[0],
                                                 x.shape[1], torch.get_num_threads()))
        return out

    @_named
    def q8_0_q8_0_linear(self, x, qweight, bias=None) -> torch.Tensor:
        wp, xp, bp, out = self._int8_args(x, qweight, bias, Q8_0_BYTES)
        self._check(self.lib.mv_q8_0_q8_0_linear(out.data_ptr(), xp, wp, bp, x.shape[0], qweight.shape[0],
                                                 x.shape[1], torch.get_num_threads()))
        return out
