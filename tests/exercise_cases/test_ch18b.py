"""Chapter 18b: a reader's Q4_1 x Q8_1 block dot in C++ (scalar, AVX2, the block formula), built alone.

The right answer is the solution notebook's own cell; each wrong one is that
cell with one slip, the way a reader would make it. Every variant is a real
build (about a second each, then cached by its bytes).
"""

import ctypes
import json
import os
import tempfile
from pathlib import Path

import pytest

from minivllm.exercises import build_block_dot, check_block_dot
from minivllm.kernels import build

from exercise_cases import Check

ROOT = Path(__file__).resolve().parents[2]
CELL = "%%writefile your_engine/int8_block_dot.cpp"


def _cell(folder: str) -> str:
    """The C++ file a notebook of ``folder`` writes (its %%writefile cell)."""
    for cell in json.loads((ROOT / folder / "18b_integer_dots.ipynb").read_text())["cells"]:
        source = "".join(cell["source"])
        if source.startswith(CELL):
            return source.split("\n", 1)[1] + "\n"
    raise AssertionError(f"{folder}/18b_integer_dots.ipynb writes no your_engine/int8_block_dot.cpp")


SOLUTION = _cell("solutions")


class Source(os.PathLike):
    """A variant of the solution's C++: the check builds it from a file written on first use."""

    def __init__(self, name: str, *edits: tuple[str, str], text: str = SOLUTION):
        self.__name__, self.text, self.path = name, text, None
        for old, new in edits:
            assert old in self.text, f"{name}: the solution no longer has {old!r}"
            self.text = self.text.replace(old, new)

    def __fspath__(self) -> str:
        if self.path is None:
            self.path = Path(tempfile.mkdtemp()) / "int8_block_dot.cpp"
            self.path.write_text(self.text)
        return str(self.path)

    def __repr__(self) -> str:
        return f"Source({self.__name__!r})"


LOW = "    sum += (qs[j] & 0x0F) * qa[j];     // weight j: the low nibble\n"
HIGH = "    sum += (qs[j] >> 4) * qa[j + 16];  // weight j + 16: the high nibble\n"
QA = "  const int8_t* qa = reinterpret_cast<const int8_t*>(a_block + 4);\n"
MADDUBS = "_mm256_maddubs_epi16(w, a)"
SET = "_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs)"
WIDEN = "  const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));  // 8 x int32\n"
REDUCE = ("  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));\n"
          "  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));  // lanes 0+2, 1+3\n"
          "  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));  // and the two left\n"
          "  return _mm_cvtsi128_si32(s);\n")
DOT = "  return d_w * d_a * static_cast<float>(q4_1_q8_1_isum_avx2(w_block, a_block)) + m_w * s_a;\n"

RIGHT = Source("solution")
RIGHT_SCALAR_DOT = Source(  # another right answer: the block formula from the scalar sum, scales grouped otherwise
    "scalar_dot", (DOT, "  const int32_t isum = q4_1_q8_1_isum_scalar(w_block, a_block);\n"
                        "  return d_w * (d_a * static_cast<float>(isum)) + m_w * s_a;\n"))

# the integer sum, scalar
SCALAR_UNSIGNED = Source("scalar_unsigned", (QA, "  const uint8_t* qa = a_block + 4;\n"))
SCALAR_SWAPPED_NIBBLES = Source("scalar_swapped_nibbles", (LOW, LOW.replace("(qs[j] & 0x0F)", "(qs[j] >> 4)")),
                                (HIGH, HIGH.replace("(qs[j] >> 4)", "(qs[j] & 0x0F)")))
SCALAR_NEIGHBOURS = Source("scalar_neighbours", (LOW, LOW.replace("qa[j]", "qa[2 * j]")),
                           (HIGH, HIGH.replace("qa[j + 16]", "qa[2 * j + 1]")))
SCALAR_INT16 = Source("scalar_int16", ("  int32_t sum = 0;", "  int16_t sum = 0;"))
SCALAR_UNMASKED = Source("scalar_unmasked", (LOW, LOW.replace("(qs[j] & 0x0F)", "qs[j]")))
SCALAR_Q4_0 = Source("scalar_q4_0", (LOW, LOW.replace("(qs[j] & 0x0F)", "((qs[j] & 0x0F) - 8)")),
                     (HIGH, HIGH.replace("(qs[j] >> 4)", "((qs[j] >> 4) - 8)")))
SCALAR_HEADER = Source("scalar_header", (QA, QA.replace("a_block + 4", "a_block")))

# the integer sum, AVX2 (the scalar loop right)
AVX2_SWAPPED_OPERANDS = Source("avx2_swapped_operands", (MADDUBS, "_mm256_maddubs_epi16(a, w)"))
AVX2_SWAPPED_HALVES = Source("avx2_swapped_halves", (SET, "_mm256_set_m128i(qs, _mm_srli_epi16(qs, 4))"))
AVX2_INT16_SUM = Source(  # the pairs added up in 16 bits: no madd by ones
    "avx2_int16_sum", (WIDEN, ""),
    (REDUCE, "  __m128i s = _mm_add_epi16(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));\n"
             "  s = _mm_hadd_epi16(s, s);\n  s = _mm_hadd_epi16(s, s);\n  s = _mm_hadd_epi16(s, s);\n"
             "  return static_cast<int16_t>(_mm_extract_epi16(s, 0));\n"))
AVX2_SATURATING_SUM = Source(  # the same with saturating adds
    "avx2_saturating_sum", (WIDEN, ""),
    (REDUCE, "  __m128i s = _mm_adds_epi16(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));\n"
             "  s = _mm_hadds_epi16(s, s);\n  s = _mm_hadds_epi16(s, s);\n  s = _mm_hadds_epi16(s, s);\n"
             "  return static_cast<int16_t>(_mm_extract_epi16(s, 0));\n"))
UNPACK = ("  const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs),  // high | low\n"
          "                                     _mm256_set1_epi8(0x0F));                     // weights 0 .. 31\n")
AVX2_UNMASKED = Source(  # the nibbles shifted, never masked: the low half keeps each byte's high bits
    "avx2_unmasked", (UNPACK, "  const __m256i w = _mm256_set_m128i(\n"
                              "      _mm_and_si128(_mm_srli_epi16(qs, 4), _mm_set1_epi8(0x0F)), qs);\n"))

# the block's value
NO_MIN = Source("no_min", (DOT, DOT.replace(" + m_w * s_a;", ";")))
MIN_TIMES_D_A = Source("min_times_d_a", (DOT, DOT.replace("m_w * s_a", "m_w * d_a")))
PER_ELEMENT = Source(  # dequantised weights times dequantised activations: 32 float products
    "per_element", (DOT, "  float sum = 0.0f;\n  for (int j = 0; j < 32; ++j) {\n"
                         "    const int q = j < 16 ? (w_block[4 + j] & 0x0F) : (w_block[4 + j - 16] >> 4);\n"
                         "    sum += (d_w * q + m_w) * (d_a * static_cast<int8_t>(a_block[4 + j]));\n  }\n"
                         "  return sum;\n"))
ONLY_D_W = Source("only_d_w", (DOT, DOT.replace("d_w * d_a * ", "d_w * ")))
MIN_SCALED_TOO = Source("min_scaled_too", (DOT, "  return d_w * d_a * (static_cast<float>(q4_1_q8_1_isum_avx2("
                                                "w_block, a_block)) + m_w * s_a);\n"))
D_S_SWAPPED = Source("d_s_swapped", ("half_to_float(read_u16(a_block)), s_a = half_to_float(read_u16(a_block + 2))",
                                     "half_to_float(read_u16(a_block + 2)), s_a = half_to_float(read_u16(a_block))"))
DOES_NOT_COMPILE = Source("does_not_compile", ("  return sum;\n", "  return sum\n"))
NO_INCLUDE = Source("no_include", ('#include "block_dot.h"\n', '#include <cstdint>\n'))

CHECKS = [Check("18b", check_block_dot, [RIGHT, RIGHT_SCALAR_DOT], {
    "scalar: activations read unsigned": (SCALAR_UNSIGNED, ("q4_1_q8_1_isum_scalar, one block pair",
                                                           "activations read as unsigned", "FIRST operand")),
    "scalar: nibbles swapped": (SCALAR_SWAPPED_NIBBLES, ("isum_scalar", "low and high nibbles swapped")),
    "scalar: nibbles as neighbours": (SCALAR_NEIGHBOURS, "not 2j and 2j \\+ 1"),
    "scalar: the sum in int16": (SCALAR_INT16, ("the largest sums", "sum kept in 16 bits", "60,960")),
    "scalar: the low nibble unmasked": (SCALAR_UNMASKED, "low nibble not masked"),
    "scalar: Q4_0's offset of 8": (SCALAR_Q4_0, "subtracting 8 is Q4_0's rule"),
    "scalar: the Q8_1 header read as quants": (SCALAR_HEADER, "header read as quants"),
    "avx2: maddubs' operands swapped": (AVX2_SWAPPED_OPERANDS, ("q4_1_q8_1_isum_avx2", "activations read as unsigned",
                                                                "_mm256_maddubs_epi16\\(u, s\\)")),
    "avx2: the register's halves swapped": (AVX2_SWAPPED_HALVES, ("isum_avx2", "low and high nibbles swapped")),
    "avx2: the pairs summed in int16": (AVX2_INT16_SUM, ("isum_avx2, the largest sums", "sum kept in 16 bits")),
    "avx2: the pairs summed with saturation": (AVX2_SATURATING_SUM, ("isum_avx2", "saturates at int16")),
    "avx2: the low nibbles unmasked": (AVX2_UNMASKED, ("isum_avx2", "low nibble not masked")),
    "the block sum's term forgotten": (NO_MIN, ("q4_1_q8_1_block_dot", "block sum's term forgotten")),
    "m_w times d_a": (MIN_TIMES_D_A, "m_w times d_a where s_a belongs"),
    "the scales per element": (PER_ELEMENT, ("scales applied per element", "Sum the integers first")),
    "only d_w applied": (ONLY_D_W, "only the weight's scale d_w"),
    "the minimum's term scaled too": (MIN_SCALED_TOO, "minimum's term scaled by d_w \\* d_a too"),
    "d_a and s_a swapped": (D_S_SWAPPED, "d_a and s_a swapped"),
    "a compile error": (DOES_NOT_COMPILE, ("does not compile", "(?s)^((?!psabi).)*$")),
    "block_dot.h not included": (NO_INCLUDE, "does not compile"),
}, passes="match the reference")]

if build.compiler() is None:  # every case is a C++ build
    CHECKS[0].right, CHECKS[0].wrong = [], {}

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler here")


@needs_compiler
def test_the_stub_is_not_written_yet_and_the_check_says_which():
    stub = Source("stub", text=_cell("exercises"))
    with pytest.raises(NotImplementedError, match="not written yet: q4_1_q8_1_isum_scalar, q4_1_q8_1_isum_avx2, "
                                                  "q4_1_q8_1_block_dot"):
        check_block_dot(stub)
    assert build_block_dot(stub).not_written() == ["q4_1_q8_1_isum_scalar", "q4_1_q8_1_isum_avx2",
                                                   "q4_1_q8_1_block_dot"]


@needs_compiler
def test_the_scalar_loop_alone_passes_its_cases_and_the_rest_is_not_written():
    """A reader who wrote the scalar loop first hears it passes, and what is left."""
    scalar = SOLUTION.split("int32_t q4_1_q8_1_isum_avx2", 1)[0]
    rest = _cell("exercises").split("int32_t q4_1_q8_1_isum_avx2", 1)[1]
    partly = Source("partly", text=scalar + "int32_t q4_1_q8_1_isum_avx2" + rest)
    with pytest.raises(NotImplementedError, match=r"not written yet: q4_1_q8_1_isum_avx2, q4_1_q8_1_block_dot "
                                                  r"\(q4_1_q8_1_isum_scalar matches the reference"):
        check_block_dot(partly)


@needs_compiler
def test_without_avx2_the_scalar_loop_stands_in_and_the_check_says_so(monkeypatch, capsys):
    """A build without AVX2 (here: -march=x86-64, the baseline without it) runs the scaffold's scalar fallback."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 baseline build")
    real = build.build_standalone
    monkeypatch.setattr(build, "build_standalone",
                        lambda source, headers=(), isa=("-march=native",), **kw: real(source, headers,
                                                                                      ("-march=x86-64",), **kw))
    part = build_block_dot(Source("baseline"))
    assert part.isa == "scalar"
    check_block_dot(part)
    out = " ".join(capsys.readouterr().out.split())
    assert "this build has no AVX2" in out and "neither compiled nor checked" in out


@needs_compiler
def test_a_standalone_build_is_cached_and_a_spoilt_one_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    source = Path(os.fspath(Source("cached")))
    headers = (build.CSRC / "block_dot.h",)
    first = build.build_standalone(source, headers)
    assert build.verified(first) and build.build_standalone(source, headers) == first
    first.write_bytes(b"spoilt")  # a truncated or garbled cached library
    assert not build.verified(first)
    again = build.build_standalone(source, headers)
    assert again == first and build.verified(again)
    assert ctypes.CDLL(str(again)).mv18b_isa  # a library again, that loads
