"""minivllm's OpenMP spin count (minivllm.cpu_threads, chapter 11): set at import before torch, never over the
user's choice, and not handed on to the peer engines. Each case runs in a fresh interpreter: this one has torch."""

import os
import subprocess
import sys

import pytest

from minivllm.cpu_threads import MARKER, SPIN_COUNT, apply_defaults

from helpers import process_alive

SHOW = ("import os, sys\n"
        "{first}\n"
        "from minivllm.cpu_threads import spin_count_in_force\n"
        "from minivllm.bench.peers import peer_environ\n"
        "print(os.environ.get('GOMP_SPINCOUNT'), 'GOMP_SPINCOUNT' in peer_environ(), spin_count_in_force(), sep='|')")


def _fresh(first: str, **env) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", MARKER)}
    out = subprocess.run([sys.executable, "-c", SHOW.format(first=first)], env={**base, **env}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1].split("|")


def test_import_minivllm_first_sets_the_spin_count_and_keeps_it_from_the_peers():
    value, in_peer_env, words = _fresh("import minivllm\nimport torch")
    assert value == str(SPIN_COUNT)
    assert in_peer_env == "False", "a peer engine must start with its own OpenMP defaults, not minivllm's"
    assert "minivllm's default" in words


def test_a_worker_process_inherits_the_spin_count_as_minivllms_not_the_users():
    """A spawned worker (tensor parallelism, disaggregation) gets minivllm's variables in its environment."""
    value, in_peer_env, words = _fresh("import minivllm", GOMP_SPINCOUNT=str(SPIN_COUNT), **{MARKER: str(SPIN_COUNT)})
    assert value == str(SPIN_COUNT) and "minivllm's default" in words and in_peer_env == "False"
    value, in_peer_env, words = _fresh("import minivllm", GOMP_SPINCOUNT="5", **{MARKER: str(SPIN_COUNT)})
    assert value == "5" and "set by the user" in words and in_peer_env == "True"  # the user changed it since


def test_torch_imported_first_keeps_libgomps_default_and_says_so():
    value, in_peer_env, words = _fresh("import torch\nimport minivllm")
    assert value == "None"  # libgomp has read its environment already: setting it now would change nothing
    assert "torch was imported before minivllm" in words


@pytest.mark.parametrize("env", [{"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "passive"}])
def test_the_users_spin_count_or_wait_policy_is_never_replaced(env):
    value, in_peer_env, words = _fresh("import minivllm", **env)
    assert value == env.get("GOMP_SPINCOUNT", "None")
    assert in_peer_env == str("GOMP_SPINCOUNT" in env)  # the user's own setting reaches the peers too
    assert "set by the user" in words


def test_apply_defaults_on_an_environment_without_torch_loaded(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")  # as if torch were not loaded yet (restored after the test)
    environ = {}
    assert apply_defaults(environ) == {"GOMP_SPINCOUNT": str(SPIN_COUNT), MARKER: str(SPIN_COUNT)} == environ
    assert apply_defaults({"OMP_WAIT_POLICY": "active"}) == {}


def test_busy_loops_spin_and_are_stopped_by_pid_on_exit():
    from minivllm.bench.contention import busy_loops

    with busy_loops(2, seconds=60) as pids:
        assert len(pids) == 2 and all(process_alive(p) for p in pids)
    assert not any(process_alive(p) for p in pids)


def test_contention_benchmark_reports_quiet_and_loaded_figures(tmp_path):
    import json

    from minivllm.bench.contention import contention_main

    out = tmp_path / "contention.json"
    assert contention_main(["--model", "tiny-random", "--num-requests", "2", "--prompt-len", "4", "8",
                            "--output-len", "4", "4", "--busy", "1", "--repeats", "2", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert [len(figures["tok_s"][k]) for k in ("quiet", "loaded")] == [2, 2]
    assert figures["slowdown"] == pytest.approx(figures["median_quiet"] / figures["median_loaded"])
    from minivllm.cpu_threads import spin_count_in_force

    assert figures["spin_count"] == spin_count_in_force()  # what the run spun with, in words


def test_a_peers_server_starts_without_minivllms_spin_count(monkeypatch, tmp_path):
    from minivllm import cpu_threads
    from minivllm.bench import peers
    from minivllm.bench.workloads import make_workload
    from minivllm.models import load_tokenizer

    for key in ("GOMP_SPINCOUNT", MARKER):
        monkeypatch.setenv(key, str(SPIN_COUNT))
        monkeypatch.setitem(cpu_threads._set_here, key, str(SPIN_COUNT))  # as if set at import
    monkeypatch.setattr(peers, "_require", lambda key, model: None)
    monkeypatch.setattr(peers, "export_hf_folder", lambda: tmp_path)
    workload = make_workload("offline", load_tokenizer("smollm2-135m"), num_requests=2)
    server = peers.peer_server("vllm-eager", workload, ncores=2)
    assert "GOMP_SPINCOUNT" not in server.env and MARKER not in server.env
    assert server.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
