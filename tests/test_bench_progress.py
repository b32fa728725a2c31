"""``bench`` shows progress for every system and stops on Ctrl-C (chapter 11, minivllm.bench.progress).

A progress line per system on stderr; Ctrl-C ends the command with exit 130
within seconds, HF's continuous batching included (its plain ``stop()`` would
finish every queued request first), with the JSON of what finished on disk; a
peer's driver runs in a process group of its own, stopped whole, its children
too. Each Ctrl-C is sent where the test has seen the work be, into work that
waits for it, so no test races what it interrupts; the bounds on waits catch a
hang and time nothing.
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


def _alive(pid: int, within: float = 30.0) -> bool:
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


# ``python -m minivllm bench`` whose HF continuous-batching run holds at its first progress tick until Ctrl-C:
# the interrupt lands inside that run whatever the machine's speed (a plain run of the workload can end first).
# SIGINT is given Python's handler first: a job started in the background by a script (``cmd &``) inherits
# SIGINT ignored, and Python then leaves it ignored, so the Ctrl-C below would never land.
HELD_BENCH = r'''
import runpy, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as a terminal's, whatever this test inherited
from minivllm.bench.progress import Progress
tick = Progress.tick
def held(self, *args, **kwargs):  # HF's loop ticks its bar after each wait for a result
    tick(self, *args, **kwargs)
    if self.name.startswith("HF generate_batch"):
        print("held in HF generate_batch", file=sys.stderr, flush=True)
        while True:  # until Ctrl-C
            time.sleep(0.05)
Progress.tick = held
sys.argv = ["minivllm", *sys.argv[1:]]
runpy.run_module("minivllm", run_name="__main__", alter_sys=True)
'''


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_ctrl_c_stops_bench_during_hf_continuous_batching_with_exit_130_and_the_json_so_far(tmp_path):
    """SIGINT while HF's continuous batching runs: exit 130, saying what finished; the JSON holds minivllm's
    finished run ("complete": false), no child process is left. The run is held inside HF's loop until the
    signal (HELD_BENCH), so the test sends it where it has seen the run be, on any machine at any load."""
    report = tmp_path / "r.json"
    cmd = [sys.executable, "-c", HELD_BENCH, "bench", "--workload", "offline", "--model", "tiny-random",
           "--num-requests", "4", "--prompt-len", "8", "16", "--output-len", "64", "64", "--compare", "hf-batch",
           "--no-roofline", "--json", report.name]  # relative to the child's cwd: its lines name the file, and
    # the width below is the program's, not that of pytest's temporary folder (pytest-99 -> pytest-100 made a line 101)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    hang = threading.Timer(600, proc.kill)  # a bound on a hang (the read below waits for a line), not a timing
    hang.start()
    try:
        seen = []
        for line in proc.stderr:  # wait until HF's run holds inside its loop
            seen.append(line)
            if line.startswith("held in HF generate_batch"):
                break
        assert any("  minivllm: " in x for x in seen) and seen[-1].startswith("held"), seen
        kids = _children_of(proc.pid)
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        code = proc.wait(timeout=300)  # a bound on a hang, not a timing
    finally:
        hang.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 130, rest
    assert "stopped (Ctrl-C); what finished:" in rest and "  minivllm: " in rest
    assert any(x.startswith("  HF generate_batch") and x.endswith(", stopped") for x in rest.splitlines()), rest
    assert all(len(x) <= WIDTH for x in rest.splitlines()), [x for x in rest.splitlines() if len(x) > WIDTH]
    data = json.loads(report.read_text())
    assert data["complete"] is False and [r["name"] for r in data["results"]] == ["minivllm"]
    assert not [k for k in kids if _alive(k)]


FAKE_DRIVER = r'''
import json, os, subprocess, sys, time
job = json.load(open(sys.argv[1]))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])  # as vLLM's engine core
open(os.environ["FAKE_PEER_CHILD"], "w").write(str(child.pid))
with open(job["progress"], "w") as f:
    f.write("running\t7")
if job["settings"].get("finish"):
    json.dump({"token_ids": [[1] * n for n in job["max_tokens"]],
               "token_times": [[0.1] * n for n in job["max_tokens"]], "seconds": 0.5, "batch1_tpot": 0.01,
               "startup_seconds": 0.1, "version": "fake", "settings": job["settings"]}, open(sys.argv[2], "w"))
    sys.exit(0)
time.sleep(3600)  # until stopped
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

    def interrupt():  # Ctrl-C once the driver's child runs (the driver then waits for it: no race)
        found["child"] = _wait_for(fake_peer, 600)
        os.kill(os.getpid(), signal.SIGINT)

    # Ctrl-C as a terminal's: KeyboardInterrupt (a test before this one may have left another handler)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            peers.run_peer("llamacpp", workload, "tiny-random", progress=True)
    finally:
        signal.signal(signal.SIGINT, previous)
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
