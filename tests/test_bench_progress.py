"""``bench`` shows progress for every system and stops on Ctrl-C (chapter 11, minivllm.bench.progress).

A progress line per system on stderr; Ctrl-C ends the command with exit 130
within seconds, HF's continuous batching included (its plain ``stop()`` would
finish every queued request first), with the JSON of what finished on disk; a
peer's driver runs in a process group of its own, stopped whole, its children
too. The bounds here are generous (a loaded machine): they catch a hang, they
time nothing.
"""

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from minivllm.bench import make_workload, peers
from minivllm.bench.progress import WIDTH, Progress
from minivllm.models import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def test_progress_lines_are_throttled_short_and_end_with_the_last_count():
    out = io.StringIO()
    bar = Progress("a system with a rather long name that goes on and on and on", 100, requests=4, every=3600,
                   stream=out)
    bar.update(10, 1)
    bar.update(90, 3)  # throttled: no line until close
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].endswith(": 0/100 tokens, 0/4 requests, 0 s")
    assert "100/100 tokens, 4/4 requests" in lines[1] and all(len(x) <= WIDTH for x in lines)
    bar.update(5)  # closed: nothing more
    assert len(out.getvalue().splitlines()) == 2
    with Progress("x", 10, stream=out, enabled=False) as quiet:
        quiet.update(3)
    assert len(out.getvalue().splitlines()) == 2
    with pytest.raises(KeyboardInterrupt):
        with Progress("stopped one", 10, stream=out) as bar:
            raise KeyboardInterrupt
    assert out.getvalue().splitlines()[-1].endswith(", stopped")


def _children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (Linux /proc)."""
    kids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid) and not fields.get("State", "").startswith("Z"):
            kids.append(int(status.parent.name))
    return kids


def _alive(pid: int, within: float = 5.0) -> bool:
    """Is ``pid`` still running ``within`` seconds (a signalled process takes a moment to go)?"""
    end = time.perf_counter() + within
    while _running(pid) and time.perf_counter() < end:
        time.sleep(0.05)
    return _running(pid)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] if Path(f"/proc/{pid}").exists() else "X"
    return state not in ("Z", "X")


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_ctrl_c_stops_bench_during_hf_continuous_batching_with_exit_130_and_the_json_so_far(tmp_path):
    """SIGINT once HF's continuous batching runs: exit 130 soon, saying what finished; the JSON holds minivllm's finished run ("complete": false), no child process is left."""
    report = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "minivllm", "bench", "--workload", "offline", "--model", "tiny-random",
           "--num-requests", "32", "--prompt-len", "8", "16", "--output-len", "128", "128", "--compare", "hf-batch",
           "--no-roofline", "--json", str(report)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        seen = []
        for line in proc.stderr:  # wait until HF's timed run has begun (its first progress line)
            seen.append(line)
            if line.startswith("  HF generate_batch"):
                break
        assert any("  minivllm: " in x for x in seen), seen
        kids = _children_of(proc.pid)
        time.sleep(0.3)  # into the run, past the line's own write
        sent = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        code = proc.wait(timeout=60)
        took = time.perf_counter() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 130, rest
    assert took < 10, f"exit took {took:.1f} s after Ctrl-C"
    assert "stopped (Ctrl-C); what finished:" in rest and "  minivllm: " in rest
    assert all(len(x) <= WIDTH for x in rest.splitlines())
    data = json.loads(report.read_text())
    assert data["complete"] is False and [r["name"] for r in data["results"]] == ["minivllm"]
    assert not [k for k in kids if _alive(k)]


FAKE_DRIVER = r'''
import json, os, subprocess, sys, time
job = json.load(open(sys.argv[1]))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # as vLLM's engine core
open(os.environ["FAKE_PEER_CHILD"], "w").write(str(child.pid))
with open(job["progress"], "w") as f:
    f.write("running\t7")
if job["settings"].get("finish"):
    json.dump({"token_ids": [[1] * n for n in job["max_tokens"]],
               "token_times": [[0.1] * n for n in job["max_tokens"]], "seconds": 0.5, "batch1_tpot": 0.01,
               "startup_seconds": 0.1, "version": "fake", "settings": job["settings"]}, open(sys.argv[2], "w"))
    sys.exit(0)
time.sleep(120)
'''


@pytest.fixture
def fake_peer(tmp_path, monkeypatch):
    """``llamacpp`` made a fake driver in this python: it starts a child that sleeps, as vLLM starts its engine
    core, writes its progress, then finishes (settings ``finish``) or sleeps; where the child's pid is written."""
    drivers = tmp_path / "drivers"
    drivers.mkdir()
    (drivers / "fake.py").write_text(FAKE_DRIVER)
    fake = peers.Peer("a fake peer", "fake", (), "", "fake.py")
    monkeypatch.setattr(peers, "DRIVERS", drivers)
    monkeypatch.setitem(peers.PEERS, "llamacpp", fake)
    monkeypatch.setattr(peers, "venv_python", lambda peer: Path(sys.executable))
    monkeypatch.setattr(peers, "_require", lambda key, model: fake)
    monkeypatch.setattr(peers, "_files", lambda key: tmp_path / "model")
    monkeypatch.setenv("FAKE_PEER_CHILD", str(tmp_path / "child.pid"))
    return tmp_path / "child.pid"


def _wait_for(path: Path, seconds: float = 60) -> int:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_ctrl_c_during_a_peer_stops_its_driver_and_every_process_it_started(fake_peer, monkeypatch, capsys):
    workload = make_workload("offline", load_tokenizer("tiny-random"), num_requests=2, output_len=(3, 3))
    monkeypatch.setattr(peers, "peer_settings", lambda key, w: ({"finish": False}, {}))
    found = {}

    def interrupt():  # Ctrl-C once the driver's child runs
        found["child"] = _wait_for(fake_peer)
        found["sent"] = time.perf_counter()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        peers.run_peer("llamacpp", workload, "tiny-random", progress=True)
    took = time.perf_counter() - found["sent"]
    assert took < 10, f"run_peer took {took:.1f} s to stop"
    assert not _alive(found["child"]), "the driver's child outlived Ctrl-C"
    assert capsys.readouterr().err.splitlines()[-1].endswith(", stopped")


def test_a_peers_progress_is_relayed_and_its_leftover_children_are_stopped(fake_peer, monkeypatch, capsys):
    workload = make_workload("offline", load_tokenizer("tiny-random"), num_requests=2, output_len=(3, 3))
    monkeypatch.setattr(peers, "peer_settings", lambda key, w: ({"finish": True, "n_seq_max": 2, "n_threads": 1},
                                                               {}))
    run = peers.run_peer("llamacpp", workload, "tiny-random", progress=True)
    assert run.result.token_ids == [[1, 1, 1], [1, 1, 1]] and run.version == "fake"
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("  llamacpp: 0/6 tokens") and not err[-1].endswith("stopped")
    assert not _alive(_wait_for(fake_peer, 1)), "a child left by the driver was not stopped"
