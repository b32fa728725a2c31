"""No code line of a notebook is wider than the rendered book's column (issue 54, item 2), and no wrapped line of
text starts with a character that makes MyST read it as something else (issue 67, item 2).

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
    # a collapsed cell (hide-input) opens in an admonition box: without its side padding, as wide as the others
    assert "div.cell details.hide { padding-left: 0; padding-right: 0; }" in css


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


# A line of text that MyST reads as other than the paragraph it was wrapped in (issue 67, item 2): "%" starts a
# comment (the line vanishes); a bullet, "1." or "1)", "#", ">" interrupt the paragraph with a list, a heading or a
# quote; "---" or "===" under a paragraph line makes that paragraph a heading.
COMMENT = re.compile(r"^\s*%")
INTERRUPTS = re.compile(r"^\s*([-+*]|1[.)])(\s+\S|$)|^ {0,3}(#{1,6}(\s|$)|>)|^ {0,3}(=+|-+)\s*$")
LIST_ITEM = re.compile(r"^\s*([-+*]|\d{1,9}[.)])\s+\S")
OPENS = re.compile(r"^\s*(`{3,}|~{3,})\s*(.*)$")
MARKDOWN_DIRECTIVES = ("{admonition", "{note", "{warning", "{tip", "{important", "{hint", "{seealso", "{dropdown")


def indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def misread_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each text line (outside code blocks and display math, inside an admonition too) that
    MyST reads as a comment, or as a list, heading, quote or heading underline breaking into a paragraph: a
    paragraph that holds no list item, at the paragraph's indentation or deeper (a line less indented than a list
    item's second paragraph starts the list's next item)."""
    found, fences, math, paragraph = [], [], False, []  # fences: (char, length, holds markdown) open, innermost last
    for number, line in enumerate(text.split("\n"), 1):
        fence = OPENS.match(line)
        if fence and not math:
            mark, info = fence.group(1), fence.group(2).strip()
            top = fences[-1] if fences else None
            if top and not info and mark[0] == top[0] and len(mark) >= top[1]:
                fences.pop()  # closes the innermost block
            elif not (top and not top[2]):  # a fence inside a code block is its text
                fences.append((mark[0], len(mark), info.startswith(MARKDOWN_DIRECTIVES)))
            paragraph = []
            continue
        if fences and not fences[-1][2]:
            continue
        if line.strip().startswith("$$") and line.strip().count("$$") == 1 or math and line.strip().endswith("$$"):
            math, paragraph = not math, []
            continue
        if math:
            continue
        if not line.strip():
            paragraph = []
            continue
        if COMMENT.match(line):
            found.append((number, line))
        elif (paragraph and INTERRUPTS.match(line) and not any(map(LIST_ITEM.match, paragraph))
              and not paragraph[-1].lstrip().startswith(("#", "|", ":")) and indent(line) >= indent(paragraph[0])):
            found.append((number, line))
        paragraph.append(line)
    return found


TEXTS = [*NOTEBOOKS, ROOT / "book" / "index.md"]


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_wrapped_line_reads_as_a_comment_a_list_or_a_heading(path):
    cells = (json.loads(path.read_text())["cells"] if path.suffix == ".ipynb"
             else [{"cell_type": "markdown", "source": path.read_text()}])
    found = [f"cell {index} line {number}: {line.strip()[:70]}" for index, cell in enumerate(cells)
             if cell["cell_type"] == "markdown" for number, line in misread_lines("".join(cell["source"]))]
    assert not found, (f"{path.relative_to(ROOT)}: lines MyST reads as a comment, or as a list, heading or quote "
                       f"breaking into the paragraph (rewrap them):\n" + "\n".join(found))


def test_the_misread_scan_finds_the_slips_and_passes_real_lists():
    slips = ("slot `table[i] * size + i\n% size`. Keep", "at least `budget - (seqs\n- 1)` tokens",
             "slot `table[t] * b\n+ t % b` of the pool", "a paragraph\n1. wrapped", "a title\n---",
             "- an item\n  through `x[i] * b + i\n  % b`", "a line\n# not a heading", "a line\n> not a quote")
    for text in slips:
        assert misread_lines(text) == [(2 + text.count("\n") - 1, text.split("\n")[-1])], text
    fine = ["Text:\n\n- one\n- two\n  wrapped\n- three", "## Heading\n- item", "a\n\n1. one\n2. two",
            "```python\nx = 1\n% not text\n- 1\n```", "$$\na\n- b\n$$", "a 100% line\nand - a dash",
            "| a |\n- x", "- one\n\n  its second paragraph\n- two", "````{admonition} Box\n```python\n# code\n```\ntext\n````"]
    for text in fine:
        assert misread_lines(text) == [], text
    assert misread_lines("````{admonition} Box\ntext\n+ t\n````") == [(3, "+ t")]  # a box's text is text


def test_the_math_is_served_from_the_books_own_static_files():
    """The book's Sphinx configuration points mathjax_path at MathJax 3's SVG bundle in book/_static, not at a CDN, so a book
    built locally shows its formulas offline (issue 67, item 3); one small file, no fonts to fetch."""
    jb_config = pytest.importorskip("jupyter_book.config")
    config, _ = jb_config.get_final_config(user_yaml=ROOT / "_config.yml", sourcedir=ROOT,
                                           cli_config={"latex_individualpages": False})  # what Sphinx gets
    path = config["mathjax_path"]
    assert "//" not in path, f"mathjax_path {path} is a URL: the offline book would show raw TeX"
    found = [ROOT / static / path for static in config["html_static_path"] if (ROOT / static / path).is_file()]
    assert found, f"mathjax_path {path} is in none of {config['html_static_path']}"
    bundle = found[0].read_text()
    assert found[0].stat().st_size < 2.5 * 2**20 and '"3.2.2"' in bundle and "SVG" in bundle
