"""The kernel layer (chapter 18): one table of ops under the model, each with its PyTorch reference beside it.

What ``csrc/`` and ``_custom_ops.py`` are to vLLM. The ops: ``write_kv``
(a step's keys and values into their slots), ``paged_attention`` (every row
of a step, each to its own length, through the block tables),
``prefill_attention`` (the same for a step's prompt rows, in tiles),
``rms_norm`` and ``fused_add_rms_norm``, ``rotary``, ``silu_and_mul``, and the
few-rows matrix-vector products ``linear`` (float32), ``q4_1_linear`` and
``q8_0_linear`` (the GGUF's blocks as stored) with ``q8_0_embedding``; and
llama.cpp's arithmetic for those blocks: ``quantize_q8_1`` (a row of
activations rounded to 8-bit blocks of 32), ``q4_1_q8_1_linear`` and
``q8_0_q8_0_linear`` (integer dot products, the block scales applied once a
block; the C++ table's ``int8_dot_kind`` names the instructions).

Three tables share those names: :mod:`~minivllm.kernels.reference` (PyTorch:
the oracle, and the fallback), :mod:`~minivllm.kernels.cpu` (C++ for the
CPU, float32, built once per machine at first use) and, on CUDA,
:mod:`~minivllm.kernels.triton_ops` (the attention ops in Triton). Which
table a model runs is a rule (:func:`choose`), reported in ``stats().kernels``,
and ``kernels="reference"`` pins the PyTorch one. On the C++ table a decode
step of one to eight rows runs every layer in one native call
(:mod:`~minivllm.kernels.fused`: the same kernels, the same bits).
"""

from __future__ import annotations

import functools
import types
import warnings

import torch

from minivllm.config import KERNEL_TABLES as KINDS
from minivllm.config import is_kernel_table
from minivllm.kernels import reference


@functools.cache
def cpu_table():
    """The C++ kernels (:class:`~minivllm.kernels.cpu.CpuKernels`), built for this machine at first use (once per
    process; a cached build that fails its SHA-256 check, or passes it yet does not load, is built again once);
    None, with one warning naming the cause, where they cannot be built here (no compiler, it fails, or it runs
    past the build's time limit)."""
    from minivllm.kernels import build
    from minivllm.kernels.cpu import CpuKernels

    try:
        path = build.build()
        try:
            lib = build.load(path)
        except (build.BuildError, OSError):  # its bytes are what was recorded, yet it is no library of ours
            lib = build.load(build.build(fresh=True))
        return CpuKernels(lib)
    except (build.BuildError, OSError) as e:
        warnings.warn(f"minivllm: the CPU kernels are not available, the PyTorch reference runs instead: {e}",
                      RuntimeWarning, stacklevel=2)
        return None


@functools.cache
def triton_table(dtype: torch.dtype = torch.float32) -> types.ModuleType | None:
    """The Triton kernels where Triton and a CUDA device are there and every op passes its first-use check in
    ``dtype`` (:mod:`~minivllm.kernels.selfcheck`: one small case per op against the reference, once per process
    and dtype); None otherwise, with one warning naming a failing op."""
    try:
        from minivllm.kernels import triton_ops
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from minivllm.kernels import selfcheck

    return selfcheck.checked(triton_ops, "Triton", torch.device("cuda"), dtype)


def table_name(ops) -> str:
    """What ``stats().kernels`` calls a table: its ``name`` (a ``CpuKernels``'), else its module's last name."""
    name = getattr(ops, "name", None)
    return name if isinstance(name, str) else getattr(ops, "__name__", type(ops).__name__).rsplit(".", 1)[-1]


def choose(kind, device, dtype) -> tuple[str, object]:
    """The table a model on ``device`` in ``dtype`` runs, and its name (chapter 18).

    ``"auto"``: on the CPU in float32 the C++ kernels where they build, on
    CUDA the Triton ones where Triton is installed and they pass their
    first-use check (:func:`triton_table`), else the reference.
    ``"cpu"`` and ``"triton"`` ask for those (a ``ValueError`` where they
    cannot apply), ``"reference"`` pins the PyTorch ops. A rule, never a race.
    A table itself (exercise 18: a ``CpuKernels`` built from the reader's
    inner loops) runs as given, a C++ one only on the CPU in float32.
    """
    device = torch.device(device)
    if not isinstance(kind, str) and is_kernel_table(kind):
        from minivllm.kernels.cpu import CpuKernels

        if isinstance(kind, CpuKernels) and (device.type != "cpu" or dtype != torch.float32):
            raise ValueError(f"kernels={kind!r} cannot run here ({device.type}, {dtype}): C++ kernels are for "
                             f"float32 on the CPU")
        return table_name(kind), kind
    if kind not in KINDS:
        raise ValueError(f"kernels must be one of {KINDS} or a kernel table, got {kind!r}")
    if kind == "reference":
        return "reference", reference
    if kind in ("auto", "cpu") and device.type == "cpu" and dtype == torch.float32:
        ops = cpu_table()
        if ops is not None:
            return "cpu", ops
    if kind in ("auto", "triton") and device.type == "cuda" and triton_table(dtype) is not None:
        return "triton", triton_table(dtype)
    if kind != "auto":
        raise ValueError(f"kernels={kind!r} cannot run here ({device.type}, {dtype}): the C++ kernels are for "
                         f"float32 on the CPU, built with a C++ compiler; the Triton ones for CUDA with triton, once "
                         f"they pass their first-use check")
    return "reference", reference
