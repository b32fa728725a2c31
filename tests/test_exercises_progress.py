"""``python -m minivllm.exercises status``: every part unwritten on a fresh checkout, all passing with the solutions."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import write_parts
from minivllm.exercises.__main__ import main as exercises_main
from minivllm.exercises.progress import CHAPTERS, PARTS, WHAT_WIDTH, status

ROOT = Path(__file__).resolve().parent.parent


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


def test_every_line_of_status_has_its_columns_where_the_others_have_them(tmp_path):
    """The state column starts at the same place on every line, the long descriptions (12, 15, 18) included."""
    write_parts(ROOT / "exercises", tmp_path)
    lines = []
    assert status(tmp_path / "your_engine", run_checks=False, out=lines.append) is False
    assert len(lines) == len(PARTS) + 1 and len({line.index(" not written ") for line in lines[:-1]}) == 1, lines


def test_status_refuses_a_chapter_without_a_part_naming_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        exercises_main(["status", str(tmp_path), "--chapters", "04", "99"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --chapters: invalid choice: '99'" in err and "'04'" in err
    with pytest.raises(ValueError, match=r"chapters must be among the exercises' chapters 01, .*got \['99'\]"):
        status(tmp_path / "your_engine", ["99"], run_checks=False)
    assert exercises_main(["status", str(tmp_path), "--chapters", "3", "--no-checks"]) == 1  # 3 is 03
    assert "0 of 2 parts written" in capsys.readouterr().out
    assert "03" in CHAPTERS and "99" not in CHAPTERS


def test_status_run_elsewhere_says_where_to_run_it(tmp_path, capsys):
    """Run in a folder with neither your_engine/ nor an exercise notebook, status says where to run it; in the
    exercises' folder before any notebook ran, it only lists the parts as missing."""
    assert exercises_main(["status", str(tmp_path), "--no-checks"]) == 1
    err = capsys.readouterr().err
    assert "run this command in the folder of the exercise notebooks" in err and str(tmp_path.resolve()) in err
    (tmp_path / "04_block_manager.ipynb").write_text("{}")
    assert exercises_main(["status", str(tmp_path), "--no-checks"]) == 1
    assert capsys.readouterr().err == ""


def test_a_failing_part_shows_its_checks_message(tmp_path, capsys):
    write_parts(ROOT / "solutions", tmp_path)
    path = tmp_path / "your_engine" / "kv_cache_memory.py"
    path.write_text(path.read_text().replace("return 2 * num_layers", "return num_layers"))  # K only
    assert status(tmp_path / "your_engine", ["03"]) is False
    out = capsys.readouterr().out
    assert re.search(r"KV bytes per token +fails", out) and "half the answer" in out
    assert re.search(r"what a paged cache leaves empty +passes", out) and "2 of 2 parts written, 1 pass" in out


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


@pytest.mark.parametrize("how", ["import sys\nsys.exit(0)\n", "raise KeyboardInterrupt\n", "raise SystemExit('bye')\n"],
                         ids=["sys.exit(0)", "KeyboardInterrupt", "SystemExit('bye')"])
def test_a_part_that_stops_the_program_at_import_is_that_parts_failure(tmp_path, how):
    """Before: sys.exit(0) at import ended the command with exit 0 and nothing printed (it caught Exception only),
    and a KeyboardInterrupt escaped as a traceback."""
    write_parts(ROOT / "solutions", tmp_path)
    stopping, other = PARTS[2], PARTS[3]  # chapter 03's two parts: one stops the program, the other loads
    path = tmp_path / "your_engine" / f"{stopping.module}.py"
    path.write_text(how + path.read_text())
    result = run_status(tmp_path, "--chapters", "03", "--no-checks")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert f"{stopping.what:{WHAT_WIDTH}} fails " in lines[0] and "does not load" in lines[0], result.stdout
    assert ("SystemExit" if "exit" in how.lower() else "KeyboardInterrupt") in lines[0], lines[0]
    assert f"{other.what:{WHAT_WIDTH}} written" in lines[1] and "2 of 2 parts written" in lines[2], result.stdout


def test_ctrl_c_still_stops_the_command(tmp_path):
    write_parts(ROOT / "solutions", tmp_path)
    path, marker = tmp_path / "your_engine" / f"{PARTS[2].module}.py", tmp_path / "loading"
    path.write_text(f"import pathlib, time\npathlib.Path({str(marker)!r}).touch()\ntime.sleep(60)\n" + path.read_text())
    proc = subprocess.Popen([sys.executable, "-m", "minivllm.exercises", "status", str(tmp_path), "--chapters", "03",
                             "--no-checks"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # the user's Ctrl-C while the part loads
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err and "parts written" not in out, (out, err)
