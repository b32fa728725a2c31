"""The CPU kernels' build: compiled once per machine at first use, cached, loaded with ctypes (chapter 18).

The C++ sources (``csrc/``) include no torch header, so a build takes a
couple of seconds rather than minutes, and a reader's edit of the inner loops
(exercise 18) rebuilds as fast. ``-march=native`` compiles for the CPU at
hand (AVX2, AVX-512 or NEON), so the cache is keyed by everything that
decides the binary: the sources, the compiler, its flags, and this CPU's
instruction sets (a build made on another CPU, in a shared home directory, is
never loaded here). ``-fopenmp`` links libgomp, the OpenMP runtime torch has
already loaded, so the kernels' threads are torch's own team.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from minivllm.config import cache_dir

CSRC = Path(__file__).parent / "csrc"
INNER = CSRC / "inner.cpp"  # minivllm's inner loops; exercise 18 builds a reader's in their place
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno"]


class BuildError(RuntimeError):
    """The kernels could not be built here: no compiler, or it refused the sources (the message says which)."""


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else ``g++``, else ``c++``; None where there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def cpu_key() -> str:
    """What a ``-march=native`` binary depends on: the architecture, torch's view of its vector ISA and the CPU's
    own feature flags (``/proc/cpuinfo``, where there is one)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line.split(":", 1)[1]
                break
    except OSError:
        pass
    return f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()} {' '.join(sorted(flags.split()))}"


def build(inner: Path = INNER, quiet: bool = False, isa: tuple[str, ...] = ("-march=native",)) -> Path:
    """The shared library of :mod:`minivllm.kernels`' CPU ops with ``inner`` as its inner loops: built now if no
    build for these sources, this compiler and this CPU is cached, else the cached one (``$MINIVLLM_CACHE/kernels``).
    ``isa`` are the instruction-set flags (the tests build an AVX2 library on an AVX-512 machine too, so both
    vector widths are checked here). Raises :class:`BuildError` where it cannot be built."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set $CXX, or install g++: apt-get install g++)")
    inner = Path(inner).resolve()
    sources = [CSRC / "ops.cpp", CSRC / "inner.h", CSRC / "int8_dot.h", inner]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    digest = hashlib.sha256()
    for part in [*(p.read_bytes() for p in sources), str(version).encode(), " ".join(FLAGS + list(isa)).encode(),
                 cpu_key().encode()]:
        digest.update(hashlib.sha256(part).digest())
    target = cache_dir() / "kernels" / digest.hexdigest()[:16] / "libminivllm_kernels.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"minivllm: building the CPU kernels for this machine ({inner.name}; once, a few seconds)", flush=True)
    tmp = Path(tempfile.mkstemp(suffix=".so", dir=target.parent)[1])
    base = [cxx, *FLAGS, f'-DMINIVLLM_INNER="{inner}"', f"-I{CSRC}", str(CSRC / "ops.cpp"), "-o", str(tmp)]
    try:
        for march in (list(isa), []):  # a compiler that cannot target this CPU gets its default ISA
            done = subprocess.run(base[:1] + march + base[1:], capture_output=True, text=True)
            if done.returncode == 0:
                os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
                return target
        raise BuildError(f"{cxx} failed on {inner.name}:\n{done.stderr.strip()[-3000:]}")
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path) -> ctypes.CDLL:
    """The built library, its functions typed (``import torch`` has run: libgomp is torch's)."""
    lib = ctypes.CDLL(str(path))
    P, I64, F, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "mv_write_kv": [P, I64, P, I64, P, P, P, I64, I64, I64],
        "mv_paged_attention": [P, P, I64, P, P, P, I64, P, P, I64, I64, I64, I64, I64, I64, I64, F, I],
        "mv_rms_norm": [P, P, P, I64, I64, F, I],
        "mv_fused_add_rms_norm": [P, P, P, I64, I64, F, I],
        "mv_rotary": [P, I64, P, I64, P, P, P, I64, I64, I64, I64, I64, I],
        "mv_silu_and_mul": [P, P, I64, I64, I],
        "mv_linear_f32": [P, P, P, P, I64, I64, I64, I],
        "mv_q4_1_linear": [P, P, P, P, I64, I64, I64, I],
        "mv_q8_0_linear": [P, P, P, P, I64, I64, I64, I],
        "mv_q8_0_embedding": [P, P, P, I64, I64, I64],
        "mv_quantize_q8_1": [P, P, I64, I64],
        "mv_q4_1_q8_1_linear": [P, P, P, P, I64, I64, I64, I],
        "mv_q8_0_q8_0_linear": [P, P, P, P, I64, I64, I64, I],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, I
    lib.mv_last_error.argtypes, lib.mv_last_error.restype = [], ctypes.c_char_p
    lib.mv_int8_dot_kind.argtypes, lib.mv_int8_dot_kind.restype = [], ctypes.c_char_p
    return lib
