"""A kernel table checked against the reference at first use (chapter 18): one small case per op.

The Triton table has run under Triton's interpreter, never on every GPU a
reader may have (Colab's torch brings triton, so ``kernels="auto"`` picks it
on any Colab GPU). Before :func:`minivllm.kernels.choose` hands it out it runs
:func:`failing_ops`: each op once on a small case (``paged_attention`` twice,
one case on each side of the Triton table's rule), on the device and in the
dtype the model will run, against :mod:`~minivllm.kernels.reference`; a
table with a failing op is not used (:func:`checked`: the reference runs, and
one warning names the op and what went wrong). A kernel that corrupts the
GPU's memory can still take the CUDA context down; a compile error, an
exception or a wrong answer cannot.
"""

from __future__ import annotations

import warnings

import torch

from minivllm.kernels import reference
from minivllm.kernels.reference import Q4_1_BYTES, Q8_0_BYTES, QBLOCK

# (rtol, atol) of a case's result against the reference's: float32 sums in another order; a half type's rounding
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 2e-2)}


def _blocks(g, rows: int, blocks: int, size: int, halves: int) -> torch.Tensor:
    """GGUF blocks of ``size`` bytes with random quants and ``halves`` small fp16 numbers (a scale, a minimum)."""
    out = torch.randint(0, 256, (rows, blocks, size), generator=g, dtype=torch.uint8)
    out[..., : 2 * halves] = (torch.rand(rows, blocks, halves, generator=g) / 50).half().view(torch.uint8)
    return out.view(rows, blocks * size)


def cases(device, dtype: torch.dtype) -> dict[str, dict]:
    """One small case per op of the table, its arguments on ``device``: attention, the norms, rotary and the
    activation in ``dtype`` (the model's), the matvecs in float32 (their activations are float32). A case is named
    by its op, with what it adds in parentheses where an op has two (each of the Triton table's attention
    programs, chapter 18d)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    def ints(values, dt):
        return torch.tensor(values, dtype=dt, device=device)

    def zeros(*shape):
        return torch.zeros(*shape, dtype=dtype, device=device)

    H, KVH, D, f32 = 4, 2, 16, torch.float32
    q4_1, q8_0 = _blocks(g, 8, 2, Q4_1_BYTES, 2).to(device), _blocks(g, 8, 2, Q8_0_BYTES, 1).to(device)
    return {
        "write_kv": dict(k=r(3, KVH, D), v=r(3, KVH, D), k_cache=zeros(8, KVH, D), v_cache=zeros(8, KVH, D),
                         slot_mapping=ints([2, -1, 7], torch.int64)),
        # a decode row at position 4 (two blocks, out of order) and a 3-token prompt, GQA
        "paged_attention": dict(q=r(4, H, D), k_cache=r(17, KVH, D), v_cache=r(17, KVH, D),
                                block_table=ints([[3, 1], [0, 2]], torch.int32), seq_lens=ints([5, 3], torch.int32),
                                query_start=ints([0, 1, 4], torch.int32), block_size=4),
        # decode rows only (one a sequence: the Triton table's other program), one sequence with no query
        "paged_attention (decode rows)": dict(q=r(2, H, D), k_cache=r(17, KVH, D), v_cache=r(17, KVH, D),
                                              block_table=ints([[3, 1], [0, 2], [1, 0]], torch.int32),
                                              seq_lens=ints([6, 1, 0], torch.int32),
                                              query_start=ints([0, 1, 2, 2], torch.int32), block_size=4),
        # a 3-token prompt and a 5-token chunk after 2 cached keys, GQA
        "prefill_attention": dict(q=r(8, H, D), k_cache=r(17, KVH, D), v_cache=r(17, KVH, D),
                                  block_table=ints([[3, 1], [0, 2]], torch.int32), seq_lens=ints([3, 7], torch.int32),
                                  query_start=ints([0, 3, 8], torch.int32), block_size=4),
        "rms_norm": dict(x=r(3, 32), weight=r(32), eps=1e-5),
        "fused_add_rms_norm": dict(x=r(3, 32), residual=r(3, 32), weight=r(32), eps=1e-5),
        "rotary": dict(q=r(3, H, D), k=r(3, KVH, D), positions=ints([0, 5, 2], torch.int64), cos=r(8, D // 2),
                       sin=r(8, D // 2)),
        "silu_and_mul": dict(x=r(3, 64)),
        "linear": dict(x=r(2, 32, dt=f32), weight=r(8, 32, dt=f32), bias=r(8, dt=f32)),
        "q4_1_linear": dict(x=r(2, 2 * QBLOCK, dt=f32), qweight=q4_1, bias=r(8, dt=f32)),
        "q8_0_linear": dict(x=r(2, 2 * QBLOCK, dt=f32), qweight=q8_0),
        "q8_0_embedding": dict(ids=ints([0, 7, 3], torch.int64), table=q8_0, width=2 * QBLOCK),
        "quantize_q8_1": dict(x=r(2, 2 * QBLOCK, dt=f32)),
        "q4_1_q8_1_linear": dict(x=r(2, 2 * QBLOCK, dt=f32), qweight=q4_1, bias=r(8, dt=f32)),
        "q8_0_q8_0_linear": dict(x=r(2, 2 * QBLOCK, dt=f32), qweight=q8_0),
    }


def _tensors(value) -> list:
    return list(value) if isinstance(value, tuple) else [value]


def failing_ops(table, oracle, device="cpu", dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """The ops of ``table`` whose result on their small case (:func:`cases`) differs from ``oracle``'s (the
    reference), or that raise: each op's name and what went wrong; empty where every op agrees. What an op
    writes in place (the caches, rotary's q and k, the fused norm's residual) is compared too."""
    rtol, atol = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    failing = {}
    for case, args in cases(device, dtype).items():
        op = case.split(" (")[0]
        if op in failing:
            continue
        mine = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        want = getattr(oracle, op)(**args)
        try:
            got = getattr(table, op)(**mine)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)  # a kernel's failure surfaces here, under its own op
            pairs = list(zip(_tensors(got), _tensors(want), strict=True))
            pairs += [(mine[k], args[k]) for k, v in args.items() if isinstance(v, torch.Tensor)]
            for a, b in pairs:
                if a is None and b is None:
                    continue
                torch.testing.assert_close(a, b, rtol=rtol, atol=atol, check_dtype=False)
        except Exception as e:  # noqa: BLE001 (any failure is the op's: a compile error, a launch, a wrong answer)
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            failing[op] = why if case == op else f"{case[len(op) + 1:]} {why}"
    return failing


def checked(table, name: str, device, dtype: torch.dtype):
    """``table`` where :func:`failing_ops` finds nothing; else None, with one warning naming each failing op
    (the caller runs the reference instead)."""
    failing = failing_ops(table, reference, device, dtype)
    if failing:
        why = "; ".join(f"{op}: {reason}" for op, reason in failing.items())
        warnings.warn(f"minivllm: the {name} kernels failed their first-use check against the reference on "
                      f"{device} ({dtype}), the PyTorch reference runs instead: {why}", RuntimeWarning, stacklevel=3)
        return None
    return table
