"""The CPU kernels' build: compiled once per machine at first use, cached, loaded with ctypes (chapter 18).

The C++ sources (``csrc/``) include no torch header, so a build takes
seconds rather than minutes. It is two translation units: ``ops.cpp`` and its
headers (the checks, the threads, every op), compiled once into an object
file cached like the library, and the inner unit ``inner_ops.cpp``, compiled
with the file of inner loops named (``inner.cpp``, or a reader's in exercise
18) and only the two loops that call them, which it inlines; the library links
the two. So a reader's edit of the inner loops rebuilds in about a second
(the inner unit and the link). ``-march=native`` compiles for the CPU at
hand (AVX2, AVX-512 or NEON), so the cache is keyed by everything that
decides the binary: the sources, the compiler, its flags, and this CPU's
instruction sets (a build made on another CPU, in a shared home directory, is
never loaded here). ``-fopenmp`` links libgomp, the OpenMP runtime torch has
already loaded, so the kernels' threads are torch's own team.

The cache is not trusted as found: a build (the library, or ``ops.cpp``'s
object) is written to a temporary file, synced to disk and renamed into place,
then its SHA-256 beside it (a sidecar ``.sha256`` file, written the same way);
a file whose bytes do not match it (truncated by a full disk, emptied,
overwritten) is never used but built again. The compiler runs under a time limit (:data:`BUILD_TIMEOUT_S`, or
``$MINIVLLM_BUILD_TIMEOUT``): one that hangs is stopped with its children and
the build fails with a :class:`BuildError` naming the limit.
"""

from __future__ import annotations

import _ctypes
import ctypes
import hashlib
import math
import os
import platform
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import torch

from minivllm.config import cache_dir

CSRC = Path(__file__).parent / "csrc"
INNER = CSRC / "inner.cpp"  # minivllm's inner loops; exercise 18 builds a reader's in their place
INNER_UNIT = CSRC / "inner_ops.cpp"  # compiled with the inner loops: the two loops that call them
REST = tuple(CSRC / name for name in ("ops.cpp", "few_rows.h", "inner.h", "inner_ops.h", "int8_dot.h", "split_kv.h",
                                      "prefill.h", "layer.h"))  # compiled once into an object: everything else
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-fno-math-errno", "-Wno-psabi"]  # both units'; no ABI notes
LINK = ["-shared", "-fopenmp"]
BUILD_TIMEOUT_S = 300.0  # seconds a compiler run may take (a build takes a few): $MINIVLLM_BUILD_TIMEOUT sets another


class BuildError(RuntimeError):
    """The kernels could not be built here: no compiler, or it refused the sources (the message says which)."""


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else ``g++``, else ``c++``; None where there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def compiler_version(cxx: str) -> str:
    """The first line of ``cxx --version`` ("" where it prints none), under the build's time limit."""
    lines = _run([cxx, "--version"]).stdout.splitlines()
    return lines[0] if lines else ""


def build_timeout() -> float:
    """The compiler's time limit in seconds: ``$MINIVLLM_BUILD_TIMEOUT``, else :data:`BUILD_TIMEOUT_S`."""
    value = os.environ.get("MINIVLLM_BUILD_TIMEOUT")
    if value is None:
        return BUILD_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds < math.inf):
        raise BuildError(f"MINIVLLM_BUILD_TIMEOUT must be a positive number of seconds, got {value!r}")
    return seconds


def _run(command: list[str]) -> subprocess.CompletedProcess:
    """``command`` in a process group of its own, under :func:`build_timeout`: past it the whole group (the
    compiler's cc1plus, as and ld too) is killed and a :class:`BuildError` names the limit."""
    limit = build_timeout()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended just now
            pass
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        raise BuildError(f"{command[0]} did not finish within {limit:g} s (the build's time limit, "
                         f"BUILD_TIMEOUT_S or $MINIVLLM_BUILD_TIMEOUT): stopped") from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digest_path(library: Path) -> Path:
    """Where a cached library's SHA-256 is kept: beside it, ``<name>.sha256``."""
    return library.with_name(library.name + ".sha256")


def verified(library: Path) -> bool:
    """Whether ``library`` is there and its bytes match the SHA-256 recorded when it was built."""
    try:
        return digest_path(library).read_text().strip() == _sha256(library)
    except OSError:
        return False


def _temporary(folder: Path, suffix: str) -> Path:
    """A new empty file in ``folder`` (the cache's own, so that the rename into place is atomic)."""
    fd, name = tempfile.mkstemp(suffix=suffix, dir=folder)
    os.close(fd)
    return Path(name)


def _publish(tmp: Path, target: Path) -> None:
    """``tmp`` renamed to ``target`` once its bytes are on disk, and the rename synced too (the folder's entry):
    a crash leaves the old file or the new one, never a part of it."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)
    folder = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _record(tmp: Path, target: Path) -> None:
    """A build (``tmp``) published as ``target``, then its SHA-256 beside it: after it, so that a crash between leaves
    it unverified, never verified and partial."""
    sha = _sha256(tmp)
    _publish(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
    record = _temporary(target.parent, ".sha256")
    record.write_text(sha + "\n")
    _publish(record, digest_path(target))


def _key(parts: list[bytes]) -> str:
    """A cache folder's name: the first 16 hex digits of a SHA-256 over ``parts`` (each hashed alone first)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:16]


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


def _build_key(cxx: str, files: list[Path], isa: tuple[str, ...]) -> str:
    """The cache key of a build of ``files``: their bytes, the compiler, its flags, ``isa`` and this CPU."""
    return _key([*(p.read_bytes() for p in files), str([compiler_version(cxx)]).encode(),
                 " ".join(FLAGS + list(isa)).encode(), cpu_key().encode()])


def _rest(cxx: str, isa: tuple[str, ...], fresh: bool) -> tuple[Path, list[str]]:
    """``ops.cpp`` and its headers compiled once into an object file, cached and verified as the library is (under
    ``kernels/<key>/``): (its path, the instruction-set flags it was compiled with). A compiler that cannot target
    this CPU compiles it with its default ISA (``ops-default-isa.o``), and the inner unit is then compiled so too."""
    folder = cache_dir() / "kernels" / _build_key(cxx, list(REST), isa)
    tries = [(list(isa), folder / "ops.o")] + ([([], folder / "ops-default-isa.o")] if isa else [])
    for march, target in tries:
        if not fresh and verified(target):
            return target, march
    folder.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(folder, ".o")
    try:
        for march, target in tries:
            done = _run([cxx, *march, *FLAGS, f"-I{CSRC}", "-c", str(CSRC / "ops.cpp"), "-o", str(tmp)])
            if done.returncode == 0:
                _record(tmp, target)
                return target, march
        raise BuildError(f"{cxx} failed on ops.cpp:\n{done.stderr.strip()[-3000:]}")
    finally:
        tmp.unlink(missing_ok=True)


def build(inner: Path = INNER, quiet: bool = False, isa: tuple[str, ...] = ("-march=native",),
          fresh: bool = False) -> Path:
    """The shared library of :mod:`minivllm.kernels`' CPU ops with ``inner`` as its inner loops: built now if no
    build for these sources, this compiler and this CPU is cached, else the cached one (``$MINIVLLM_CACHE/kernels``)
    once its bytes match their recorded SHA-256 (:func:`verified`; else it is built again). A build compiles the
    inner unit with ``inner`` and links it with ``ops.cpp``'s object (:func:`_rest`: compiled once for every
    ``inner``). ``isa`` are the instruction-set flags (the tests build an AVX2 library on an AVX-512 machine too, so
    both vector widths are checked here); ``fresh`` builds anew whatever is cached. Raises :class:`BuildError` where
    it cannot be built (no compiler, it fails, or it runs past :func:`build_timeout`)."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set $CXX, or install g++: apt-get install g++)")
    inner = Path(inner).resolve()
    target = cache_dir() / "kernels" / _build_key(cxx, [*REST, INNER_UNIT, inner], isa) / "libminivllm_kernels.so"
    if not fresh and verified(target):
        return target
    bad = target.exists() and not fresh  # a cached build whose bytes are not what was built (truncated, garbled)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"minivllm: building the CPU kernels for this machine ({inner.name}; once, a few seconds)"
              f"{': the cached build failed its SHA-256 check' if bad else ''}", flush=True)
    rest, march = _rest(cxx, isa, fresh)
    unit, tmp = _temporary(target.parent, ".o"), _temporary(target.parent, ".so")
    try:
        done = _run([cxx, *march, *FLAGS, f'-DMINIVLLM_INNER="{inner}"', f"-I{CSRC}", "-c", str(INNER_UNIT), "-o",
                     str(unit)])
        if done.returncode != 0:
            raise BuildError(f"{cxx} failed on {inner.name}:\n{done.stderr.strip()[-3000:]}")
        done = _run([cxx, *LINK, str(rest), str(unit), "-o", str(tmp)])
        if done.returncode != 0:
            raise BuildError(f"{cxx} could not link {inner.name}'s unit with ops.cpp:\n{done.stderr.strip()[-3000:]}")
        _record(tmp, target)
        return target
    finally:
        unit.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


def load(path: Path) -> ctypes.CDLL:
    """The built library, its functions typed (``import torch`` has run: libgomp is torch's). A library without
    every op's function raises :class:`BuildError` naming the first missing (it is no build of these sources)."""
    lib = ctypes.CDLL(str(path))
    P, I64, F, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "mv_write_kv": [P, I64, P, I64, P, P, P, I64, I64, I64],
        "mv_paged_attention": [P, P, I64, P, P, P, I64, P, P, I64, I64, I64, I64, I64, I64, I64, F, I],
        "mv_paged_attention_chunked": [P, P, I64, P, P, P, I64, P, P, I64, I64, I64, I64, I64, I64, I64, F, I, I64],
        "mv_split_kv_built": [],
        "mv_prefill_attention": [P, P, I64, P, P, P, I64, P, P, I64, I64, I64, I64, I64, I64, I64, F, I],
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
        "mv_decode_step": [P, P, P, P, P, P, I64, P, P, I64, P, P, I64, I64, I],
    }
    for name in [*signatures, "mv_last_error", "mv_split_kv_chunk_keys"]:
        if not hasattr(lib, name):
            _ctypes.dlclose(lib._handle)  # unloaded: a build put at the same path is then loaded afresh, not this
            raise BuildError(f"{path} has no function {name}: not a build of minivllm's kernels")
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, I
    lib.mv_last_error.argtypes, lib.mv_last_error.restype = [], ctypes.c_char_p
    lib.mv_int8_dot_kind.argtypes, lib.mv_int8_dot_kind.restype = [], ctypes.c_char_p
    lib.mv_split_kv_chunk_keys.argtypes, lib.mv_split_kv_chunk_keys.restype = [I64, I64, I64, I64], I64
    return lib


def build_standalone(source: Path, headers: tuple[Path, ...] = (), isa: tuple[str, ...] = ("-march=native",),
                     flags: tuple[str, ...] = ("-O2", "-std=c++17", "-fPIC", "-shared", "-Wno-psabi")) -> Path:
    """One C++ file built alone into a shared library (exercise 18b's block dot, chapter 18b): no ``ops.cpp``, no
    OpenMP, so about a second. Cached and verified as :func:`build` is, keyed by the file, ``headers`` (the csrc
    headers it includes), the compiler, the flags and this CPU. Raises :class:`BuildError` where it cannot be built
    (the compiler's message)."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set $CXX, or install g++: apt-get install g++)")
    source = Path(source).resolve()
    key = _key([*(p.read_bytes() for p in (source, *headers)), compiler_version(cxx).encode(),
                " ".join([*flags, *isa]).encode(), cpu_key().encode()])
    target = cache_dir() / "standalone" / key / f"lib{source.stem}.so"
    if verified(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(target.parent, ".so")
    try:
        done = _run([cxx, *isa, *flags, f"-I{CSRC}", str(source), "-o", str(tmp)])
        if done.returncode != 0 and isa and "march" in done.stderr:  # a compiler that cannot target this CPU
            # (only then: without -march a reader's AVX2 code, under #if __AVX2__, would drop out and hide its errors)
            done = _run([cxx, *flags, f"-I{CSRC}", str(source), "-o", str(tmp)])
        if done.returncode == 0:
            _record(tmp, target)
            return target
        raise BuildError(f"{cxx} failed on {source.name}:\n{done.stderr.strip()[-3000:]}")
    finally:
        tmp.unlink(missing_ok=True)
