"""``python -m minivllm.exercises status``: every part unwritten on a fresh checkout, all passing with the solutions."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.exercises.progress import PARTS, status

ROOT = Path(__file__).resolve().parent.parent


def write_parts(notebooks: Path, folder: Path) -> None:
    """What running each notebook's ``%%writefile your_engine/...`` cells leaves in ``folder``."""
    (folder / "your_engine").mkdir(parents=True, exist_ok=True)
    for path in sorted(notebooks.glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and source.startswith("%%writefile your_engine/"):
                first, body = source.split("\n", 1)
                (folder / first.split(" ", 1)[1]).write_text(body + "\n")


def run_status(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minivllm.exercises", "status", str(folder), *args],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)


def test_every_part_is_in_the_table_once():
    written = set()
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if source.startswith("%%writefile your_engine/"):
                written.add(source.split("\n", 1)[0].removeprefix("%%writefile your_engine/").removesuffix(".py"))
    assert {p.module for p in PARTS} == written  # every file an exercise writes is some part's
    assert len({(p.module, p.name) for p in PARTS}) == len(PARTS)


def test_a_fresh_checkout_has_every_part_unwritten(tmp_path):
    result = run_status(tmp_path)  # no your_engine/ at all: no exercise run yet
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.count(" missing ") == len(PARTS) and f"0 of {len(PARTS)} parts written" in result.stdout
    write_parts(ROOT / "exercises", tmp_path)  # every exercise's stubs written, nothing filled in
    result = run_status(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.count(" not written  ") == len(PARTS), result.stdout
    assert "not written yet: MyBlockManager.allocate, MyBlockManager.free, MyBlockManager.slot_mapping" in result.stdout


def test_a_failing_part_shows_its_checks_message(tmp_path, capsys):
    write_parts(ROOT / "solutions", tmp_path)
    path = tmp_path / "your_engine" / "kv_cache_memory.py"
    path.write_text(path.read_text().replace("return 2 * num_layers", "return num_layers"))  # K only
    assert status(tmp_path / "your_engine", ["03"]) is False
    out = capsys.readouterr().out
    assert "KV bytes per token                     fails" in out and "half the answer" in out
    assert "what a paged cache leaves empty        passes" in out and "2 of 2 parts written, 1 pass" in out


def test_the_solutions_pass_their_checks_through_the_status_command(tmp_path):
    """The command over every solution's written file: each part written and passing its check's targeted cases
    (the default, seconds a part; every solution notebook runs its own check with the live engine under
    ``pytest --nbval``)."""
    write_parts(ROOT / "solutions", tmp_path)
    result = run_status(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" passes") == len(PARTS), result.stdout
    n = len(PARTS)
    assert f"{n} of {n} parts written, {n} pass their checks (targeted cases)" in result.stdout
