"""Exercise 18's C++ part built: the reader's inner loops (``your_engine/kernels_inner.cpp``) compiled with
minivllm's ``ops.cpp`` into a kernel table named "cpu (yours)" (chapter 18).

Below both the live engine (``load_part`` builds a ``.cpp`` part here) and the kernels' check
(:mod:`minivllm.exercises.kernels`), which imports it.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from minivllm.exercises._common import say
from minivllm.exercises.parts import PARTS_DIR
from minivllm.kernels import build
from minivllm.kernels.cpu import CpuKernels

__all__ = ["LOOPS", "YOURS", "PART", "NO_COMPILER", "compiler_status", "build_kernels", "own_table",
           "library_path"]

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
    """Your inner loops (``path``) compiled with minivllm's ``ops.cpp`` into a kernel table named "cpu (yours)".

    A build takes a few seconds and is cached by the sources, so an unchanged
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
