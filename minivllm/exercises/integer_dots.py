"""Chapter 18b, integer dot products: the check of the reader's Q4_1 x Q8_1 block dot in C++
(``your_engine/int8_block_dot.cpp``, the three functions of ``minivllm/kernels/csrc/block_dot.h``).

The reader writes the block's integer sum ``sum_j q_w[j] * q_a[j]`` as a scalar loop, then with AVX2's
``_mm256_maddubs_epi16`` and ``_mm256_madd_epi16``, then the block's value ``d_w * d_a * isum + m_w * s_a``.
:func:`check_block_dot` builds the file alone (about a second), refuses what is still the stub, then runs
targeted cases against the reference's integer sums (:func:`minivllm.kernels.reference.int8_block_sums`) and the
block formula, naming the classic mistakes in the reader's terms: the activations read unsigned (``maddubs``'
operands swapped), the nibbles in another order, the sum kept in 16 bits, the block sum's term forgotten, the
scales in the wrong place.
"""

from __future__ import annotations

import struct
import time

import torch

from minivllm.exercises._common import say
from minivllm.exercises.native import BLOCK_DOT, BLOCK_DOT_FUNCTIONS, BlockDot, build_block_dot
from minivllm.kernels import reference

__all__ = ["check_block_dot", "BLOCK_DOT_FUNCTIONS"]

SCALAR, AVX2, DOT = BLOCK_DOT_FUNCTIONS
NO_AVX2 = ("this build has no AVX2 (the CPU, or the compiler's -march=native, lacks it): q4_1_q8_1_isum_avx2 runs "
           "your scalar loop here, and its intrinsics were neither compiled nor checked; run the exercise on an "
           "x86 CPU with AVX2 (any since 2013, and Colab's) to check them")


def _q4_1(d: float, m: float, quants) -> bytes:
    """One Q4_1 block: fp16 d, fp16 m, 16 bytes of two quants each (weight j low nibble, j + 16 high)."""
    q = list(quants)
    return struct.pack("<ee", d, m) + bytes(q[j] | q[j + 16] << 4 for j in range(16))


def _q8_1(d: float, s: float, quants) -> bytes:
    """One Q8_1 block: fp16 d, fp16 s, 32 signed bytes."""
    return struct.pack("<ee", d, s) + struct.pack("<32b", *quants)


def _tensor(blocks: list[bytes]) -> torch.Tensor:
    return torch.tensor([list(b) for b in blocks], dtype=torch.uint8)


def _parts(w: torch.Tensor, a: torch.Tensor):
    """Blocks ``[n, 20]`` and ``[n, 36]`` as (d_w, m_w, q_w ``[n, 32]`` 0-15, d_a, s_a, q_a ``[n, 32]``), float64
    scales and int64 quants, weight j of a block in position j."""
    n = len(w)
    d_w, m_w, q_w = reference._weight_parts(w.reshape(n, 20), 32, "q4_1")
    d_a, s_a, q_a = reference._q8_1_parts(a.reshape(n, 36), 32)
    return (d_w[:, 0].double(), m_w[:, 0].double(), q_w[:, 0].long(), d_a.double()[:, 0], s_a.double()[:, 0],
            q_a[:, 0].long())


def _isums(w: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The reference's integer sum of each pair (:func:`reference.int8_block_sums`, one block each)."""
    return reference.int8_block_sums(a, w, 32, "q4_1")[..., 0].diagonal()  # [rows, features]: pair i is (i, i)


# -- the cases ----------------------------------------------------------------------------------------------------

KNOWN_W = list(range(16)) + [15 - j // 2 for j in range(16)]  # no two readings of the nibbles give one sum
KNOWN_A = [(j + 1) * 3 * (-1) ** j for j in range(32)]  # 3, -6, 9, ..., -96: signs alternate


def _cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(what, w_blocks [n, 20], a_blocks [n, 36])``, the first ones made to tell the mistakes apart."""
    g = torch.Generator().manual_seed(1818)
    cases = [
        ("one block pair: weights 0, 1, ..., 15, then 15, 15, 14, 14, ..., 8, 8; activations 3, -6, 9, -12, ..., "
         "-96 (d_w 0.5, m_w -2.5, d_a 0.01, s_a 0.5)",
         _tensor([_q4_1(0.5, -2.5, KNOWN_W)]), _tensor([_q8_1(0.01, 0.5, KNOWN_A)])),
        ("the largest sums: every weight 15 and every activation 127, then -127 (32 * 15 * 127 = 60,960, past "
         "int16's 32,767)",
         _tensor([_q4_1(0.25, 1.0, [15] * 32)] * 2),
         _tensor([_q8_1(0.125, 508.0, [127] * 32), _q8_1(0.125, -508.0, [-127] * 32)])),
    ]
    rows = []  # (the GGUF's own blocks are this format too; parsing the file would take the check seconds)
    for _ in range(64):  # random blocks: scales, minima and quants
        x = torch.randn(1, 32, generator=g) * float(torch.rand(1, generator=g) * 4 + 0.1)
        rows.append((_q4_1(float(torch.rand(1, generator=g)) * 0.1 + 0.001, float(torch.randn(1, generator=g)) * 0.2,
                           torch.randint(0, 16, (32,), generator=g).tolist()),
                     bytes(reference.quantize_q8_1(x)[0].tolist())))
    cases.append(("64 random block pairs (activations rounded by the reference's quantize_q8_1)",
                  _tensor([w for w, _ in rows]), _tensor([a for _, a in rows])))
    return cases


# -- the mistakes -------------------------------------------------------------------------------------------------

def _wrap16(v: torch.Tensor) -> torch.Tensor:
    return (v + 32768) % 65536 - 32768


UNSIGNED = ("the activations read as unsigned bytes: q_a is signed (-127 .. 127), so a_block[4 + j] is an int8_t "
            "(-1, not 255). In AVX2, _mm256_maddubs_epi16(u, s) reads its FIRST operand as unsigned bytes and its "
            "second as signed: the 4-bit weights (0 .. 15) go first, the activations second")
ISUM_MISTAKES = [
    ("low and high nibbles swapped: byte j of qs holds weight j in its LOW 4 bits (qs[j] & 0x0F) and weight "
     "j + 16 in its HIGH 4 bits (qs[j] >> 4); in AVX2, the low nibbles are the register's lower 128 bits "
     "(_mm256_set_m128i(high, low))", lambda qs, qa: (torch.cat([qs >> 4, qs & 15], -1) * qa).sum(-1)),
    ("the nibbles read as neighbours: byte j holds weights j and j + 16, not 2j and 2j + 1",
     lambda qs, qa: (torch.stack([qs & 15, qs >> 4], -1).flatten(-2) * qa).sum(-1)),
    (UNSIGNED, lambda qs, qa: (torch.cat([qs & 15, qs >> 4], -1) * (qa % 256)).sum(-1)),
    ("the low nibble not masked: weight j is qs[j] & 0x0F; qs[j] alone still carries weight j + 16 in its high "
     "bits", lambda qs, qa: (torch.cat([qs, qs >> 4], -1) * qa).sum(-1)),
    ("Q4_1's quants are unsigned, 0 .. 15 (the block's minimum m_w carries the offset): subtracting 8 is Q4_0's "
     "rule", lambda qs, qa: ((torch.cat([qs & 15, qs >> 4], -1) - 8) * qa).sum(-1)),
]
OVERFLOW = ("the sum kept in 16 bits: a block's sum reaches 32 * 15 * 127 = 60,960, past int16's 32,767. Sum in "
            "int32 (int32_t sum; in AVX2, _mm256_madd_epi16 by ones turns maddubs' 16 int16 pair sums into 8 "
            "int32 before you add them up, never _mm256_add_epi16 / hadd_epi16)")
SATURATED = ("the sum saturates at int16's 32,767: a saturating 16-bit add (_mm256_adds_epi16, hadds_epi16) "
             "clamps a block's sum, which reaches 60,960; widen to int32 first (_mm256_madd_epi16 by ones)")
HEADER = ("the block's header read as quants: a Q4_1 block's quants start at byte 4 (w_block + 4, after fp16 d_w "
          "and m_w) and a Q8_1 block's at byte 4 (a_block + 4, after fp16 d_a and s_a)")


def _diagnose_isum(w: torch.Tensor, a: torch.Tensor, got: torch.Tensor) -> str:
    qs, qa = w[:, 4:].long(), a[:, 4:].view(torch.int8).long()
    right = (torch.cat([qs & 15, qs >> 4], -1) * qa).sum(-1)
    for hint, model in ISUM_MISTAKES:
        if torch.equal(got, model(qs, qa)):
            return hint
    if torch.equal(got, _wrap16(right)):
        return OVERFLOW
    if torch.equal(got, right.clamp(-32768, 32767)):
        return SATURATED
    whole_w, whole_a = w[:, :16].long(), a[:, :32].view(torch.int8).long()
    for ws in (qs, whole_w):
        for aa in (qa, whole_a):
            if (ws is whole_w or aa is whole_a) and torch.equal(got, (torch.cat([ws & 15, ws >> 4], -1) * aa).sum(-1)):
                return HEADER
    return ("compare your loop with block_dot.h's layouts: weight j is qs[j] & 0x0F (j < 16) or qs[j - 16] >> 4, "
            "activation j the int8 a_block[4 + j], their 32 products summed in int32")


DOT_FORMULA = "d_w * d_a * isum + m_w * s_a"
DOT_MISTAKES = [
    ("the block sum's term forgotten: a Q4_1 weight is d_w * q + m_w, so the minimum adds m_w * sum(x) = m_w * "
     "s_a to the block's dot product (s_a, bytes 2-3 of the Q8_1 block, is d_a * sum(q_a))",
     lambda d_w, m_w, d_a, s_a, I, sq: d_w * d_a * I),
    ("m_w times d_a where s_a belongs: the minimum meets every activation, m_w * sum_j d_a * q_a[j] = m_w * s_a, "
     "the block's sum (bytes 2-3 of the Q8_1 block), not its scale d_a (bytes 0-1)",
     lambda d_w, m_w, d_a, s_a, I, sq: d_w * d_a * I + m_w * d_a),
    ("the scales applied per element: you multiplied dequantised weights by dequantised activations (32 float "
     "products, and m_w * d_a * sum(q_a) where llama.cpp's formula has the block's stored sum s_a, an fp16: the "
     "two differ by its rounding). Sum the integers first, then apply the scales once: " + DOT_FORMULA,
     lambda d_w, m_w, d_a, s_a, I, sq: d_w * d_a * I + m_w * d_a * sq),
    ("only the weight's scale d_w applied to the integer sum: both blocks' scales multiply it, d_w * d_a * isum",
     lambda d_w, m_w, d_a, s_a, I, sq: d_w * I + m_w * s_a),
    ("only the activation's scale d_a applied to the integer sum: both blocks' scales multiply it, d_w * d_a * "
     "isum", lambda d_w, m_w, d_a, s_a, I, sq: d_a * I + m_w * s_a),
    ("the minimum's term scaled by d_w * d_a too: m_w * s_a is already in the units of the result; the formula is "
     + DOT_FORMULA, lambda d_w, m_w, d_a, s_a, I, sq: d_w * d_a * (I + m_w * s_a)),
    ("d_a and s_a swapped: a Q8_1 block is fp16 d_a (bytes 0-1), then fp16 s_a (bytes 2-3)",
     lambda d_w, m_w, d_a, s_a, I, sq: d_w * s_a * I + m_w * d_a),
    ("d_w and m_w swapped: a Q4_1 block is fp16 d_w (bytes 0-1), then fp16 m_w (bytes 2-3)",
     lambda d_w, m_w, d_a, s_a, I, sq: m_w * d_a * I + d_w * s_a),
]


def _dot_tolerance(d_w, m_w, d_a, s_a, I) -> torch.Tensor:
    """How far a float32 evaluation of d_w * d_a * isum + m_w * s_a may be from the exact value: d_w * d_a and
    m_w * s_a are exact (products of two halves), isum is exact as a float; any order rounds at most 3 times, each
    by 2^-24 of what it sums."""
    return 3 * 2.0 ** -24 * ((d_w * d_a * I).abs() + (m_w * s_a).abs()) + 1e-30


def _diagnose_dot(parts, I, got: torch.Tensor) -> str:
    d_w, m_w, _, d_a, s_a, q_a = parts
    sq = q_a.sum(-1).double()
    scale = (d_w * d_a * I).abs() + (m_w * s_a).abs() + (m_w * d_a * sq).abs()
    for hint, model in DOT_MISTAKES:
        if bool(((got - model(d_w, m_w, d_a, s_a, I, sq)).abs() <= 1e-5 * scale + 1e-30).all()):
            return hint
    return f"the block's value is {DOT_FORMULA} (the integer sum exact, the scales once, after it)"


# -- the check ----------------------------------------------------------------------------------------------------

def _first_off(got: torch.Tensor, want: torch.Tensor, tol=None) -> int:
    bad = got != want if tol is None else ~((got - want).abs() <= tol)
    return int(bad.nonzero()[0])


def check_block_dot(block_dot=BLOCK_DOT, live: bool = True) -> None:
    """Check your ``int8_block_dot.cpp`` (chapter 18b): ``block_dot`` is its path (built here, about a second) or
    its build (:func:`~minivllm.exercises.native.build_block_dot`).

    First, whether the three functions are written (a stub returns 0 and marks itself). Then each written one on
    targeted cases, stopping at the first failure with the mistake named: one block pair whose weights and
    signed activations tell the nibble orders and signedness apart, the largest sums (past int16), and random
    block pairs; the integer sums against the reference's
    (``reference.int8_block_sums``), the block's value against ``d_w * d_a * isum + m_w * s_a``. Where the
    build has no AVX2, ``q4_1_q8_1_isum_avx2`` is the scalar loop and the check says so. ``live`` is accepted
    for ``status``'s sake: the part has no engine to run.
    """
    start = time.perf_counter()
    part = block_dot if isinstance(block_dot, BlockDot) else build_block_dot(block_dot)
    left = part.not_written()
    if len(left) == len(BLOCK_DOT_FUNCTIONS):
        raise NotImplementedError(f"not written yet: {', '.join(left)}")
    cases = _cases()
    checked = []
    for name in (SCALAR, AVX2):
        if name in left:
            continue
        for what, w, a in cases:
            want = _isums(w, a)
            got = torch.tensor(part.call(name, w, a), dtype=torch.int64)
            if not torch.equal(got, want):
                i = _first_off(got, want)
                avx = name == AVX2 and part.isa != "avx2"
                raise AssertionError(
                    f"{name}, {what}: block pair {i} gives {int(got[i]):,}, the reference's integer sum is "
                    f"{int(want[i]):,}; {_diagnose_isum(w, a, got)}" + (f" ({NO_AVX2})" if avx else ""))
        checked.append(name)
    if DOT not in left:
        for what, w, a in cases:
            parts = _parts(w, a)
            d_w, m_w, _, d_a, s_a, _ = parts
            I = _isums(w, a).double()
            want = d_w * d_a * I + m_w * s_a  # exact in float64: products of halves and a 16-bit integer
            got = torch.tensor(part.call(DOT, w, a), dtype=torch.float64)
            tol = _dot_tolerance(d_w, m_w, d_a, s_a, I)
            if not bool(((got - want).abs() <= tol).all()):
                i = _first_off(got, want, tol)
                raise AssertionError(f"{DOT}, {what}: block pair {i} gives {float(got[i]):.9g}, {DOT_FORMULA} is "
                                     f"{float(want[i]):.9g}; {_diagnose_dot(parts, I, got)}")
        checked.append(DOT)
    blocks = sum(len(w) for _, w, _ in cases)
    verb = "matches" if len(checked) == 1 else "match"
    done = f"{', '.join(checked)} {verb} the reference on {len(cases)} cases ({blocks} block pairs"
    if left:
        raise NotImplementedError(f"not written yet: {', '.join(left)} ({done}))")
    note = "" if part.isa == "avx2" else f"; {NO_AVX2}"
    say(f"check_block_dot: {done}: the integer sums, the nibbles' order, signed activations, sums past int16, "
        f"the block formula {DOT_FORMULA}; {time.perf_counter() - start:.1f} s){note}.")
