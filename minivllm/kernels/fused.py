"""A few-row decode step's decoder layers in one native call (chapter 18): ``csrc/layer.h``'s ``mv_decode_step``.

The op-by-op path calls about six C++ ops and four matmuls a layer through
their Python wrappers (a ctypes call, its checks, a tensor for each output:
10-15 µs each, some 300 a step of SmolLM2's 30 layers). :class:`DecodeStep`
holds one model's weights' addresses in C structs (a ``DecodeLayer`` a layer,
built once per model and kept alive with the tensors they point into) and runs
a whole decode step's layers, then the final norm, in ONE call: once a step
rather than once a layer, because the step's metadata (positions, slots, block
tables, lengths) is the same for every layer, so it is checked once, before
any memory is written, and the Python loop over layers goes too. The C++ calls
the same kernels with the same arguments as the op-by-op path, so its output
equals that path's bit for bit (tests/test_fused_decode.py). The op-by-op path
stays for prefill, mixed steps, the reference table, CUDA and tensor
parallelism; a reader's table (exercise 18) runs it through the reader's own
inner loops, since ``layer.h`` is built into every table's library.
"""

from __future__ import annotations

import ctypes

import torch

from minivllm.kernels.cpu import MAX_ROWS, CpuKernels, _count, _named, _shape, _tensor
from minivllm.kernels.reference import Q4_1_BYTES, Q8_0_BYTES, QBLOCK

KINDS = {"linear": 0, "q4_1_linear": 1, "q8_0_linear": 2, "q4_1_q8_1_linear": 3, "q8_0_q8_0_linear": 4}
"""The op of a matmul (by its name in the table) as ``layer.h``'s ``MatmulKind``."""

BLOCK_BYTES = {"q4_1_linear": Q4_1_BYTES, "q8_0_linear": Q8_0_BYTES, "q4_1_q8_1_linear": Q4_1_BYTES,
               "q8_0_q8_0_linear": Q8_0_BYTES}

P, I64 = ctypes.c_void_p, ctypes.c_int64


class DecodeMatmul(ctypes.Structure):
    _fields_ = [("kind", I64), ("weight", P), ("bias", P), ("N", I64), ("K", I64)]


class DecodeLayer(ctypes.Structure):
    _fields_ = [("input_norm", P), ("post_norm", P), ("qkv", DecodeMatmul), ("o", DecodeMatmul),
                ("gate_up", DecodeMatmul), ("down", DecodeMatmul)]


class DecodeModel(ctypes.Structure):
    _fields_ = [("layers", I64), ("hidden", I64), ("heads", I64), ("kv_heads", I64), ("head_dim", I64),
                ("intermediate", I64), ("eps", ctypes.c_double), ("cos", P), ("sin", P), ("max_position", I64),
                ("final_norm", P), ("layer", ctypes.POINTER(DecodeLayer))]


def _matmul(op: str, weight, bias, n: int, k: int, where: str) -> DecodeMatmul:
    """One matmul's struct, once its weight (float32 [n, k], or the GGUF's blocks) and bias ([n]) are checked."""
    _shape(op in KINDS, f"{where}: {op!r} is not one of the decode step's matmuls {tuple(KINDS)}")
    if op == "linear":
        wp = _tensor(weight, f"{where}.weight", dims=2)
        _shape(tuple(weight.shape) == (n, k), f"{where}.weight {tuple(weight.shape)} must be [{n}, {k}]")
    else:
        wp = _tensor(weight, f"{where}.qweight", torch.uint8, 2)
        _shape(k % QBLOCK == 0 and tuple(weight.shape) == (n, k // QBLOCK * BLOCK_BYTES[op]),
               f"{where}.qweight {tuple(weight.shape)} does not hold [{n}, {k}] in {op}'s blocks")
    bp = None
    if bias is not None:
        bp = _tensor(bias, f"{where}.bias", dims=1)
        _shape(bias.shape[0] == n, f"{where}.bias {tuple(bias.shape)} must have {n} entries")
    return DecodeMatmul(KINDS[op], wp, bp, n, k)


class DecodeStep:
    """One model's layers as C structs for ``mv_decode_step``, and the call that runs a decode step through them.

    ``layers``: per layer a dict of ``input_norm`` and ``post_norm`` (weights
    ``[hidden]``) and ``qkv``, ``o``, ``gate_up``, ``down``, each ``(op name,
    weight, bias)`` (the op the model's rule runs for a few rows: ``"linear"``
    on float32 weights, or the GGUF's ``q4_1_linear``, ``q4_1_q8_1_linear``,
    ...). ``max_rows``: the most rows the model's rule sends through those ops
    (the step refuses more). Every tensor is checked here, once; the structs
    keep them alive.
    """

    def __init__(self, ops: CpuKernels, layers: list[dict], final_norm, cos, sin, eps: float, heads: int,
                 kv_heads: int, head_dim: int, intermediate: int, max_rows: int = MAX_ROWS):
        _shape(isinstance(ops, CpuKernels), f"ops must be a C++ kernel table (CpuKernels), got {ops!r}")
        _shape(len(layers) >= 1, "layers must hold at least one layer")
        _shape(isinstance(max_rows, int) and 1 <= max_rows <= MAX_ROWS, f"max_rows must be in 1..{MAX_ROWS}")
        heads, kv_heads, head_dim, intermediate = (_count(n, name) for n, name in (
            (heads, "heads"), (kv_heads, "kv_heads"), (head_dim, "head_dim"), (intermediate, "intermediate")))
        _tensor(final_norm, "final_norm", dims=1)
        hidden = final_norm.shape[0]
        cp, sp = _tensor(cos, "cos", dims=2), _tensor(sin, "sin", dims=2)
        _shape(cos.shape == sin.shape and 2 * cos.shape[1] == head_dim,
               f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [max_position, {head_dim // 2}]")
        self.ops, self.max_rows, self.heads, self.kv_heads, self.head_dim = ops, max_rows, heads, kv_heads, head_dim
        self.hidden, self.num_layers = hidden, len(layers)
        shapes = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
                  "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}
        self.layers = (DecodeLayer * len(layers))()
        self.tensors = [final_norm, cos, sin]  # what the structs point into, kept alive with them
        for i, layer in enumerate(layers):
            norms = {}
            for name in ("input_norm", "post_norm"):
                norms[name] = _tensor(layer[name], f"layers[{i}].{name}", dims=1)
                _shape(layer[name].shape[0] == hidden, f"layers[{i}].{name} must have {hidden} entries")
            mats = {name: _matmul(*layer[name], *shapes[name], f"layers[{i}].{name}") for name in shapes}
            self.layers[i] = DecodeLayer(norms["input_norm"], norms["post_norm"], **mats)
            self.tensors += [layer["input_norm"], layer["post_norm"]]
            self.tensors += [t for name in shapes for t in layer[name][1:] if t is not None]
        self.model = DecodeModel(len(layers), hidden, heads, kv_heads, head_dim, intermediate, float(eps), cp, sp,
                                 cos.shape[0], final_norm.data_ptr(),
                                 ctypes.cast(self.layers, ctypes.POINTER(DecodeLayer)))

    @_named
    def decode_step(self, x, positions, slot_mapping, block_table, context_lens, cu_seq_q, k_slots, v_slots,
                    block_size: int) -> torch.Tensor:
        """The final norm's output ``[T, hidden]`` of every layer over ``x`` (the embedded tokens ``[T, hidden]``,
        used as the residual stream: overwritten) for a decode step of ``T`` rows (row t: one sequence's token at
        ``positions[t]``, its keys and values written to ``slot_mapping[t]`` of the pools ``k_slots``, ``v_slots``
        ``[layers, slots, kv_heads, head_dim]``, attending through ``block_table[t]`` to ``context_lens[t]`` keys;
        ``cu_seq_q`` is ``0..T``). The profiler sees it as ``minivllm::decode_step``."""
        xp = _tensor(x, "x", dims=2)
        T = x.shape[0]
        _shape(1 <= T <= self.max_rows and x.shape[1] == self.hidden,
               f"x {tuple(x.shape)} must be [1..{self.max_rows} rows, {self.hidden}]")
        pp = _tensor(positions, "positions", torch.int64, 1)
        sp = _tensor(slot_mapping, "slot_mapping", torch.int64, 1)
        bt = _tensor(block_table, "block_table", torch.int32, 2)
        cl = _tensor(context_lens, "context_lens", torch.int32, 1)
        qs = _tensor(cu_seq_q, "cu_seq_q", torch.int32, 1)
        _shape(positions.shape[0] == T and slot_mapping.shape[0] == T and block_table.shape[0] == T
               and context_lens.shape[0] == T and cu_seq_q.shape[0] == T + 1,
               f"positions {tuple(positions.shape)}, slot_mapping {tuple(slot_mapping.shape)}, block_table "
               f"{tuple(block_table.shape)}, context_lens {tuple(context_lens.shape)} and cu_seq_q "
               f"{tuple(cu_seq_q.shape)} must describe the {T} rows (one query each)")
        kp, vp = _tensor(k_slots, "k_slots", dims=4), _tensor(v_slots, "v_slots", dims=4)
        _shape(k_slots.shape == v_slots.shape and k_slots.shape[0] == self.num_layers
               and tuple(k_slots.shape[2:]) == (self.kv_heads, self.head_dim),
               f"k_slots {tuple(k_slots.shape)} and v_slots {tuple(v_slots.shape)} must be [{self.num_layers}, "
               f"slots, {self.kv_heads}, {self.head_dim}]")
        _shape(isinstance(block_size, int) and block_size >= 1, f"block_size must be a positive int, got {block_size}")
        out = torch.empty(T, self.hidden)
        self.ops._check(self.ops.lib.mv_decode_step(
            ctypes.byref(self.model), out.data_ptr(), xp, pp, sp, bt, block_table.shape[1], cl, qs, T, kp, vp,
            k_slots.shape[1], block_size, torch.get_num_threads()))
        return out

    __call__ = decode_step

