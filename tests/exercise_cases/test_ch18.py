"""Chapter 18: a reader's two inner loops in C++ (attend_tile, q4_1_block_dot), built with minivllm's ops.cpp.

The right answer is the solution notebook's own cell; each wrong one is that
cell with one slip, the way a reader would make it. Every variant is a real
build (about a second each, then cached by its sources).
"""

import json
import os
import tempfile
from pathlib import Path

import pytest

from minivllm.exercises import check_kernels
from minivllm.kernels import build

from exercise_cases import Check

ROOT = Path(__file__).resolve().parents[2]


def _solution() -> str:
    """The C++ file the solution notebook writes (its %%writefile cell, markers and all)."""
    for cell in json.loads((ROOT / "solutions" / "18_kernels.ipynb").read_text())["cells"]:
        source = "".join(cell["source"])
        if source.startswith("%%writefile your_engine/kernels_inner.cpp"):
            return source.split("\n", 1)[1] + "\n"
    raise AssertionError("solutions/18_kernels.ipynb writes no your_engine/kernels_inner.cpp")


SOLUTION = _solution()


class Source(os.PathLike):
    """A variant of the solution's C++: the check builds it from a file written on first use."""

    def __init__(self, name: str, *edits: tuple[str, str]):
        self.__name__, self.text, self.path = name, SOLUTION, None
        for old, new in edits:
            assert old in self.text, f"{name}: the solution no longer has {old!r}"
            self.text = self.text.replace(old, new)

    def __fspath__(self) -> str:
        if self.path is None:
            self.path = Path(tempfile.mkdtemp()) / f"{self.__name__}.cpp"
            self.path.write_text(self.text)
        return str(self.path)

    def __repr__(self) -> str:
        return f"Source({self.__name__!r})"


RESCALE = "        l *= rescale;  // (0 for the first block: m = -inf)\n"
ACC_RESCALE = "        for (int d = 0; d < D; ++d) acc[d] *= rescale;\n"
LOW = "    const float low = d * (qs[j] & 0x0F) + m;  // weight j\n"
HIGH = "    const float high = d * (qs[j] >> 4) + m;   // weight j + 16\n"
D_HALF = "  const float d = half_to_float(read_u16(block));\n"
M_HALF = "  const float m = half_to_float(read_u16(block + 2));\n"
LOOP = "      for (int64_t first = 0; first <= t.pos[r]; first += t.block_size) {"
LEFT = "        const int64_t left = t.pos[r] - first + 1;"
K_ROW = "          const float* k = t.k_cache + (block * t.block_size + j) * t.kv_stride;"
V_ROW = "          const float* v = t.v_cache + (block * t.block_size + j) * t.kv_stride;"
ACC_ADD = "      acc[r][j % kLanes] += low * xr[j] + high * xr[j + 16];"

RIGHT = Source("solution")
RIGHT_PER_KEY = Source(  # another right answer: the rescale after every key (more exps, the same softmax)
    "rescale_per_key", (RESCALE, ""), (ACC_RESCALE, ""), ("        m = new_m;\n", ""),
    ("          const float p = std::exp(s[j] - new_m);\n",
     "          const float key_m = std::max(m, s[j]), c = std::exp(m - key_m);\n"
     "          const float p = std::exp(s[j] - key_m);\n          l *= c;\n"
     "          for (int d = 0; d < D; ++d) acc[d] *= c;\n          m = key_m;\n"))

NO_RESCALE = Source("no_rescale", (RESCALE, ""), (ACC_RESCALE, ""))
SUM_NOT_RESCALED = Source("sum_not_rescaled", (RESCALE, ""))
TO_BLOCK_END = Source("to_block_end", (LEFT, "        const int64_t left = t.block_size;"))
MASKED_READ = Source(  # reads the whole last block, weighting the keys after the row's position by 0
    "masked_read", (LEFT, "        const int64_t left = t.block_size;"),
    ("          s[j] = dot * t.scale;", "          s[j] = first + j <= t.pos[r] ? dot * t.scale : -INFINITY;"))
WRONG_KV_HEAD = Source("wrong_kv_head", (K_ROW, K_ROW[:-1] + " + h * D;"), (V_ROW, V_ROW[:-1] + " + h * D;"))
FIRST_HEADS_QUERY = Source("first_heads_query", ("      const float* q = t.q + r * t.q_row_stride + h * D;",
                                                 "      const float* q = t.q + r * t.q_row_stride;"))
TILE_LAST_ROW = Source("tile_last_row", (LOOP, LOOP.replace("t.pos[r]", "t.pos[t.rows - 1]")),
                       (LEFT, LEFT.replace("t.pos[r]", "t.pos[t.rows - 1]")))
MISSES_OWN_KEY = Source("misses_own_key", (LOOP, LOOP.replace("<=", "<")), (LEFT, LEFT.replace(" + 1;", ";")))
NO_SCALE = Source("no_scale", ("          s[j] = dot * t.scale;", "          s[j] = dot;"))
NOT_NORMALIZED = Source("not_normalized", ("out[d] = acc[d] / l;", "out[d] = acc[d];"))
NO_BLOCK_TABLE = Source("no_block_table", ("        const int64_t block = t.table[first / t.block_size];",
                                           "        const int64_t block = first / t.block_size;"))
NAIVE_EXP = Source(  # exp of the raw score: no maximum subtracted, no rescale (fine until the scores are large)
    "naive_exp", (RESCALE, ""), (ACC_RESCALE, ""),
    ("          const float p = std::exp(s[j] - new_m);", "          const float p = std::exp(s[j]);"))
NO_MIN = Source("no_min", (LOW, LOW.replace(" + m;", ";")), (HIGH, HIGH.replace(" + m;", ";")))
SWAPPED_NIBBLES = Source("swapped_nibbles", (LOW, LOW.replace("(qs[j] & 0x0F)", "(qs[j] >> 4)")),
                         (HIGH, HIGH.replace("(qs[j] >> 4)", "(qs[j] & 0x0F)")))
NEIGHBOUR_NIBBLES = Source(  # byte j as weights 2j and 2j + 1
    "neighbour_nibbles", (ACC_ADD, "      acc[r][j % kLanes] += low * xr[2 * j] + high * xr[2 * j + 1];"))
SCALE_AS_BF16 = Source("scale_as_bf16", (D_HALF, "  const uint32_t bits = uint32_t(read_u16(block)) << 16;\n"
                                                 "  float d;\n  std::memcpy(&d, &bits, 4);\n"))
SCALE_AS_INT = Source("scale_as_int", (D_HALF, "  const float d = read_u16(block);\n"))
SCALE_AS_FLOAT = Source("scale_as_float", (D_HALF, "  float d;\n  std::memcpy(&d, block, 4);\n"))
MIN_AS_BF16 = Source("min_as_bf16", (M_HALF, "  const uint32_t mbits = uint32_t(read_u16(block + 2)) << 16;\n"
                                             "  float m;\n  std::memcpy(&m, &mbits, 4);\n"))
Q4_0_OFFSET = Source("q4_0_offset", (LOW, LOW.replace("(qs[j] & 0x0F)", "((qs[j] & 0x0F) - 8)")),
                     (HIGH, HIGH.replace("(qs[j] >> 4)", "((qs[j] >> 4) - 8)")))
X_STRIDE_32 = Source("x_stride_32", ("      const float* xr = x + r * x_stride;", "      const float* xr = x + r * 32;"))
ASSIGNS_ACC = Source(  # the block's sum assigned to the lanes, not added: only the last block counts
    "assigns_acc", ("  for (int j = 0; j < 16; ++j) {\n", "  float sums[kMaxRows] = {};\n  for (int j = 0; j < 16; ++j) {\n"),
    (ACC_ADD, "      sums[r] += low * xr[j] + high * xr[j + 16];"),
    ("  }\n  // END SOLUTION\n}\n\n}  // namespace",
     "  }\n  for (int r = 0; r < rows; ++r) {\n    acc[r] = splat(0.0f);\n    acc[r][0] = sums[r];\n  }\n"
     "  // END SOLUTION\n}\n\n}  // namespace"))

STATE = ("      float acc[kMaxHeadDim] = {};  // the weighted values, not yet divided by l\n"
         "      float m = -INFINITY;          // the running maximum\n"
         "      float l = 0.0f;               // the running sum of exp(s - m)\n")
HEAD_LOOP = "    for (int h = 0; h < t.heads; ++h) {\n      const float* q = t.q + r * t.q_row_stride + h * D;\n"
ROW_LOOP = "  for (int r = 0; r < t.rows; ++r) {\n"
TABLE_READ = "t.table[first / t.block_size];"
SMOLLM2_BUFFERS = Source(  # the buffers sized for SmolLM2 (head_dim 64, blocks of 16): a Llama 3 head overflows
    "smollm2_buffers", ("float acc[kMaxHeadDim] = {};", "float acc[64] = {};"),
    ("float s[kMaxBlockSize];", "float s[16];"))
SCORES_FOR_16 = Source("scores_for_16", ("float s[kMaxBlockSize];", "float s[16];"))  # blocks of 32 overflow s
TABLE_FAR_OFF = Source("table_far_off", (TABLE_READ, "t.table[first / t.block_size + (1 << 28)];"))  # a sure crash
TABLE_ONE_TOO_FAR = Source("table_one_too_far", (TABLE_READ, "t.table[first / t.block_size + 1];"))
STATE_PER_ROW = Source(  # m, l and acc set once per row: the next head goes on from the last one's sums
    "state_per_row", (HEAD_LOOP + STATE, STATE.replace("      ", "    ") + HEAD_LOOP))
STATE_PER_TILE = Source(  # set once per tile
    "state_per_tile", (ROW_LOOP + HEAD_LOOP + STATE, STATE.replace("      ", "  ") + ROW_LOOP + HEAD_LOOP))
INCLUDES_MINIVLLMS = Source(  # minivllm's own loops, included to be called
    "includes_minivllms",
    ('#include "inner.h"\n', '#include "inner.h"\nnamespace theirs {\n#include "inner.cpp"\n}\n'))
KV_STRIDE_AS_DIM = Source("kv_stride_as_dim", (K_ROW, K_ROW.replace("t.kv_stride", "D")),
                          (V_ROW, V_ROW.replace("t.kv_stride", "D")))  # slots packed as if one KV head
THIRTY_TWO_QUANT_BYTES = Source(  # 32 quant bytes a block: reads past the block's 16 (and past x's 32 inputs)
    "thirty_two_quant_bytes",
    ("  for (int j = 0; j < 16; ++j) {\n    const float low", "  for (int j = 0; j < 32; ++j) {\n    const float low"))
DOES_NOT_COMPILE = Source("does_not_compile", ("const int D = t.head_dim;", "const int D = t.head_dim"))

NOT_BLOCK_END = "read to the end of its last block instead of its length"
CHECKS = [Check("18", check_kernels, [RIGHT, RIGHT_PER_KEY], {
    "the running sum not rescaled when the maximum grows": (NO_RESCALE, (
        "maximum grows in every block", "running sum not rescaled when the maximum grows", r"exp\(m_old - m_new\)")),
    "only the weighted values rescaled, not the sum": (SUM_NOT_RESCALED, "running sum not rescaled"),
    "a row read to the end of its last block": (TO_BLOCK_END, ("length ends inside a block", NOT_BLOCK_END)),
    "the slots past the length read and weighted by 0": (MASKED_READ, ("NaN in the slots after each length",
                                                                       NOT_BLOCK_END, "0 \\* NaN")),
    "the wrong KV head for a query head": (WRONG_KV_HEAD, ("grouped-query", "the wrong KV head for a query head")),
    "every query head reads the first head's query": (FIRST_HEADS_QUERY, "uses the first head's query"),
    "a chunk's rows seeing keys after their own position": (TILE_LAST_ROW, (
        "a prefill chunk", "seeing keys after their own position")),
    "each row misses its own key": (MISSES_OWN_KEY, "misses its own key"),
    "the scores not scaled": (NO_SCALE, r"multiply q \. k by t\.scale"),
    "the weighted sum not divided by the running sum": (NOT_NORMALIZED, r"out = acc / l"),
    "keys read without the block table": (NO_BLOCK_TABLE, "not found through the block table"),
    "exp of the raw score": (NAIVE_EXP, ("large scores", "overflows float32")),
    "Q4_1's min term forgotten": (NO_MIN, ("one block, one row", "min term forgotten")),
    "nibble order swapped": (SWAPPED_NIBBLES, "nibble order swapped"),
    "nibbles read as neighbours": (NEIGHBOUR_NIBBLES, "not 2j and 2j \\+ 1"),
    "the fp16 scale read as bfloat16": (SCALE_AS_BF16, "fp16 scale read as bfloat16"),
    "the fp16 scale read as an integer": (SCALE_AS_INT, "fp16 scale read as an integer"),
    "the fp16 scale read as a 4-byte float": (SCALE_AS_FLOAT, "fp16 scale read as a 4-byte float"),
    "the fp16 minimum read as bfloat16": (MIN_AS_BF16, "fp16 minimum read as bfloat16"),
    "Q4_0's offset of 8": (Q4_0_OFFSET, "subtracting 8 is Q4_0's rule"),
    "row r's inputs at x + 32 r": (X_STRIDE_32, ("rows at once", r"x_stride is the input width")),
    "the block's sum assigned, not added": (ASSIGNS_ACC, "only the last block counts"),
    "buffers sized for SmolLM2, acc of 64 and s of 16": (SMOLLM2_BUFFERS, (
        "head_dim 128", "kMaxHeadDim \\(256\\)", "float acc\\[64\\]")),
    "scores sized for blocks of 16": (SCORES_FOR_16, ("blocks of 32", "kMaxBlockSize \\(256\\)")),
    "the block table read far past its end: a crash": (TABLE_FAR_OFF, (
        r"your kernel crashed \(SIG\w+\) on", "block table read past")),
    "the block table read one block too far": (TABLE_ONE_TOO_FAR, "one decode row, 8 keys"),  # a spare block
    "m, l and acc set once per row, not per head": (STATE_PER_ROW, ("grouped-query", "go on from one query head")),
    "m, l and acc set once per tile": (STATE_PER_TILE, "go on from one query head"),
    "minivllm's inner.cpp included": (INCLUDES_MINIVLLMS, ("includes minivllm's own inner.cpp",
                                                          "the check runs your part alone")),
    "t.kv_stride taken for head_dim": (KV_STRIDE_AS_DIM, ("grouped-query", "kv_stride, the distance between")),
    "32 quant bytes a block": (THIRTY_TWO_QUANT_BYTES, "one block, one row"),  # its garbage: a hint, or none
    "a compile error": (DOES_NOT_COMPILE, ("does not compile", "(?s)^((?!psabi).)*$")),  # no -Wpsabi note
}, passes="with exactly minivllm's tokens")]

if build.compiler() is None:  # every case is a C++ build
    CHECKS[0].right, CHECKS[0].wrong = [], {}


def test_the_right_answer_is_the_solution_notebooks_file():
    assert "// BEGIN SOLUTION" in SOLUTION and "MINIVLLM_NOT_WRITTEN" not in SOLUTION
    if build.compiler() is None:
        pytest.skip("no C++ compiler here: the table's variants cannot be built")


@pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler here")
def test_minivllms_own_loops_are_not_written_yet():
    from minivllm.kernels.cpu import CpuKernels

    theirs = CpuKernels(build.load(build.build(build.INNER, quiet=True)), "a table of minivllm's library")
    with pytest.raises(NotImplementedError, match="runs minivllm's own inner loops"):
        check_kernels(theirs, live=False)
    with pytest.raises(NotImplementedError, match="minivllm's own inner.cpp"):
        check_kernels(build.INNER, live=False)


@pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler here")
def test_an_endless_loop_is_a_message(monkeypatch):
    from minivllm.exercises import kernels

    monkeypatch.setattr(kernels, "CASES_TIMEOUT", 3)  # it never ends: any limit shows the message
    endless = Source("endless", ("  const int D = t.head_dim;\n",
                                 "  const int D = t.head_dim;\n  for (volatile int i = 0; i >= 0; i += 0) {}\n"))
    with pytest.raises(AssertionError, match=r"did not finish .* in 3 s: an endless loop"):
        check_kernels(endless, live=False)
