"""Exercise 18's C++ part built: the reader's inner loops (``your_engine/kernels_inner.cpp``) compiled with
minivllm's ``ops.cpp`` into a kernel table named "cpu (yours)" (chapter 18); and exercise 18b's block dot
(``your_engine/int8_block_dot.cpp``), built alone and called through ctypes (:class:`BlockDot`).

Below both the live engine (``load_part`` builds a ``.cpp`` part here) and the kernels' check
(:mod:`minivllm.exercises.kernels`), which imports it.
"""

from __future__ import annotations

import ctypes
import os
import re
import time
from pathlib import Path

from minivllm.exercises._common import say
from minivllm.exercises.parts import PARTS_DIR
from minivllm.kernels import build
from minivllm.kernels.cpu import CpuKernels

__all__ = ["LOOPS", "YOURS", "PART", "NO_COMPILER", "compiler_status", "build_kernels", "own_table",
           "library_path", "BLOCK_DOT", "BLOCK_DOT_FUNCTIONS", "BlockDot", "build_block_dot", "build_part"]

LOOPS = ("attend_tile", "q4_1_block_dot")  # what exercise 18 has the reader write
YOURS = "cpu (yours)"  # the name stats().kernels reports for the reader's table
PART = PARTS_DIR / "kernels_inner.cpp"
NO_COMPILER = ("exercise 18 builds your inner loops with a C++ compiler, and none is found here ($CXX, g++ or c++). "
               "Install one: `apt-get install g++` (Debian, Ubuntu), `xcode-select --install` (macOS), or run the "
               "notebook on Colab, which has g++. Then run this cell again.")
ALONE = "the check runs your part alone"  # what a delegation to minivllm's own loops is told
_INCLUDES_INNER = re.compile(r'^\s*#\s*include\s*[<"]([^>"]*[/\\])?inner\.cpp[>"]', re.MULTILINE)


def compiler_status() -> str:
    """One line: the C++ compiler the exercise builds with, or what is missing and how to get it."""
    cxx = build.compiler()
    if cxx is None:
        return NO_COMPILER
    try:
        version = build.compiler_version(cxx) or "version unknown"
    except build.BuildError as e:  # it hangs: stopped at the build's time limit
        version = str(e)
    return f"C++ compiler: {cxx} ({version})"


def build_kernels(path: Path | str = PART, quiet: bool = False) -> CpuKernels:
    """Your inner loops (``path``) linked with minivllm's ``ops.cpp`` into a kernel table named "cpu (yours)".

    Your file is compiled with the two loops that call it (``inner_ops.cpp``),
    ``ops.cpp`` once for every file (:func:`~minivllm.kernels.build.build`), so
    a build takes about a second; it is cached by the sources, so an unchanged
    file loads at once. A file that does not compile raises ``AssertionError``
    with the compiler's message; one that includes minivllm's own ``inner.cpp``
    (its loops, to call), ``AssertionError`` too; no compiler, ``RuntimeError``
    saying how to get one.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run the %%writefile cell of exercise 18 first")
    if _INCLUDES_INNER.search(path.read_text(errors="replace")):
        raise AssertionError(f"{path} includes minivllm's own inner.cpp, whose attend_tile and q4_1_block_dot are "
                             f"the answer: {ALONE}; write both loops in your file (include inner.h only)")
    if build.compiler() is None:
        raise RuntimeError(NO_COMPILER)
    start = time.perf_counter()
    try:
        lib = build.load(build.build(path, quiet=True))
    except build.BuildError as e:
        raise AssertionError(f"{path} does not compile: {e}") from None
    if not quiet:
        say(f"{path} with minivllm's ops.cpp: built in {time.perf_counter() - start:.1f} s (an unchanged "
            "file comes from the cache)")
    return CpuKernels(lib, YOURS)


def library_path(table: CpuKernels) -> Path:
    """The shared library a kernel table was loaded from."""
    return Path(table.lib._name).resolve()


def own_table(kernels) -> CpuKernels:
    """The reader's table from what they hand a check: the path of their inner loops (built here), or a table
    :func:`build_kernels` built. minivllm's own inner loops (its ``inner.cpp``, its table or a table of its
    library) are "not written yet"."""
    mine = f"not written yet: {', '.join(LOOPS)}"
    if isinstance(kernels, (str, os.PathLike)):
        path = Path(kernels)
        if path.resolve() == build.INNER.resolve():
            raise NotImplementedError(f"{mine} ({path} is minivllm's own inner.cpp: build yours)")
        return build_kernels(path, quiet=True)
    if not isinstance(kernels, CpuKernels):
        raise AssertionError(f"expected the path of your kernels_inner.cpp or its build (build_kernels(path)), got "
                             f"{kernels!r}")
    if library_path(kernels) == build.build(build.INNER, quiet=True).resolve():
        raise NotImplementedError(f"{mine} ({kernels!r} runs minivllm's own inner loops, its inner.cpp: build "
                                  "yours with build_kernels)")
    return kernels


# -- exercise 18b: one Q4_1 x Q8_1 block dot, built alone ---------------------------------------------------------

BLOCK_DOT = PARTS_DIR / "int8_block_dot.cpp"
BLOCK_DOT_FUNCTIONS = ("q4_1_q8_1_isum_scalar", "q4_1_q8_1_isum_avx2", "q4_1_q8_1_block_dot")  # csrc/block_dot.h


class BlockDot:
    """Exercise 18b's build: the reader's three functions of ``block_dot.h``, each called through ctypes on one
    Q4_1 block (20 bytes) and one Q8_1 block (36 bytes) at a time."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.lib, self.path = lib, path
        for name in BLOCK_DOT_FUNCTIONS:
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = ctypes.c_float if name.endswith("block_dot") else ctypes.c_int32
        lib.mv18b_not_written.argtypes, lib.mv18b_not_written.restype = [], ctypes.c_int
        lib.mv18b_isa.argtypes, lib.mv18b_isa.restype = [], ctypes.c_char_p

    @property
    def isa(self) -> str:
        """"avx2" where the build has AVX2 (``q4_1_q8_1_isum_avx2``'s intrinsics compiled), else "scalar"."""
        return self.lib.mv18b_isa().decode()

    def not_written(self) -> list[str]:
        """The functions still the exercise's stub (``MINIVLLM_NOT_WRITTEN``): each is called once on zero blocks."""
        w, a = (ctypes.c_uint8 * 20)(), (ctypes.c_uint8 * 36)()
        for name in BLOCK_DOT_FUNCTIONS:
            getattr(self.lib, name)(ctypes.addressof(w), ctypes.addressof(a))
        mask = self.lib.mv18b_not_written()
        return [name for i, name in enumerate(BLOCK_DOT_FUNCTIONS) if mask >> i & 1]

    def call(self, name: str, w_blocks, a_blocks) -> list:
        """``name`` on each pair of rows of ``w_blocks`` ``uint8 [n, 20]`` and ``a_blocks`` ``uint8 [n, 36]``
        (contiguous CPU tensors): n ints or floats. A function still the stub raises "not written yet"."""
        if w_blocks.shape[1:] != (20,) or a_blocks.shape[1:] != (36,) or len(w_blocks) != len(a_blocks):
            raise ValueError(f"expected uint8 blocks [n, 20] and [n, 36], got {tuple(w_blocks.shape)} and "
                             f"{tuple(a_blocks.shape)}")
        w_blocks, a_blocks = w_blocks.contiguous(), a_blocks.contiguous()
        fn, w0, a0 = getattr(self.lib, name), w_blocks.data_ptr(), a_blocks.data_ptr()
        out = [fn(w0 + 20 * i, a0 + 36 * i) for i in range(len(w_blocks))]
        if self.lib.mv18b_not_written() >> BLOCK_DOT_FUNCTIONS.index(name) & 1:
            raise NotImplementedError(f"not written yet: {name}")
        return out

    def __repr__(self) -> str:
        return f"BlockDot({str(self.path)!r}, {self.isa})"


def build_block_dot(path: Path | str = BLOCK_DOT) -> BlockDot:
    """Your ``int8_block_dot.cpp`` (exercise 18b) built alone with ``-O2 -march=native`` (about a second, cached by
    its bytes) and loaded: a :class:`BlockDot`. A file that does not compile raises ``AssertionError`` with the
    compiler's message; no compiler, ``RuntimeError`` saying how to get one."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run the %%writefile cell of exercise 18b first")
    if build.compiler() is None:
        raise RuntimeError(NO_COMPILER.replace("exercise 18 builds your inner loops", "exercise 18b builds your "
                                               "block dot"))
    headers = tuple(build.CSRC / h for h in ("block_dot.h", "int8_dot.h", "inner.h"))
    try:
        lib = ctypes.CDLL(str(build.build_standalone(path, headers)))
    except build.BuildError as e:
        raise AssertionError(f"{path} does not compile: {e}") from None
    missing = [name for name in (*BLOCK_DOT_FUNCTIONS, "mv18b_not_written") if not hasattr(lib, name)]
    if missing:
        raise AssertionError(f"{path} defines no {', '.join(missing)}: include \"block_dot.h\" and define the "
                             "three functions it declares")
    return BlockDot(lib, path)


def build_part(path: Path | str):
    """A C++ part built as its exercise builds it: exercise 18b's block dot, else exercise 18's kernel table."""
    path = Path(path)
    return build_block_dot(path) if path.name == BLOCK_DOT.name else build_kernels(path, quiet=True)
