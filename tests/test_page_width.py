"""No code line of a notebook is wider than the rendered book's column (issue 54, item 2).

At a 1280 px browser window the book's content column shows LIMIT monospace
characters of a code cell or an output (book/_static/minivllm.css sets it up;
its header says how it was measured); a longer line is cut off and scrolls.
This test holds the code of every notebook in book/, solutions/ and exercises/
to it: code cells, and code blocks in the text. The outputs are not stored in
the notebooks, so the root conftest.py holds them to the same LIMIT as each
cell runs under ``pytest --nbval``.
"""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 100  # characters: what the content column shows at a 1280 px window (book/_static/minivllm.css)
NOTEBOOKS = sorted(p for folder in ("book", "solutions", "exercises") for p in (ROOT / folder).glob("*.ipynb"))
# Notebooks being rewritten elsewhere, formatted to LIMIT when that work lands: this set is to be emptied then.
FENCE = re.compile(r"^(```|~~~)")


def code_lines(cell) -> list[tuple[int, str]]:
    """(line number, line) of what a cell shows as code: every line of a code cell, a text cell's fenced blocks."""
    lines = "".join(cell["source"]).split("\n")
    if cell["cell_type"] == "code":
        return list(enumerate(lines, 1))
    shown, fenced = [], False
    for number, line in enumerate(lines, 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif fenced:
            shown.append((number, line))
    return shown


def too_long(path: Path, limit: int = LIMIT) -> list[str]:
    found = []
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        for number, line in code_lines(cell):
            if len(line) > limit:
                found.append(f"{path.relative_to(ROOT)}: cell {index} line {number}: {len(line)} > {limit}: {line.strip()[:60]}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_code_line_is_wider_than_the_column(path):
    found = too_long(path)
    assert not found, f"{len(found)} code lines wider than the book's column ({LIMIT} characters):\n" + "\n".join(found)


def test_the_check_finds_a_long_line_and_fenced_code_in_text():
    wide = "x = " + "1 + " * 30 + "1"
    text = {"cell_type": "markdown", "source": ["prose " * 40 + "\n", "```python\n", wide + "\n", "```\n"]}
    code = {"cell_type": "code", "source": ["short\n", wide]}
    assert code_lines(text) == [(3, wide)]
    assert code_lines(code) == [(1, "short"), (2, wide)]


def test_the_limit_is_the_one_the_css_names():
    css = (ROOT / "book" / "_static" / "minivllm.css").read_text()
    assert f"at least {LIMIT} monospace characters" in css


def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_output_check_reads_what_the_book_shows():
    """The root conftest.py's check of a cell's outputs under nbval: stdout and a plain-text result are shown,
    stderr and a result with a figure are not; a carriage return overwrites its line; the limit is this one."""
    hook = _root_conftest()
    assert hook.LIMIT == LIMIT
    wide = "x" * (LIMIT + 1)
    outputs = [
        {"output_type": "stream", "name": "stdout", "text": "short\n" + wide + "\n"},
        {"output_type": "stream", "name": "stderr", "text": "e" * 200},
        {"output_type": "execute_result", "data": {"text/plain": "'" + "p" * LIMIT + "'"}},
        {"output_type": "display_data", "data": {"text/plain": "<Figure " + "f" * 200 + ">", "image/png": ""}},
        {"output_type": "stream", "name": "stdout", "text": "r" * 200 + "\rdone\n\x1b[1m" + "a" * LIMIT + "\x1b[0m"},
    ]
    assert hook.too_wide(outputs) == [wide, "'" + "p" * LIMIT + "'"]
