"""Generate exercises/NN_topic.ipynb from solutions/NN_topic.ipynb.

In a solution notebook the reader's part sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` lines. Each such region becomes
``raise NotImplementedError("not written yet: Class.method")`` at the marker's
indentation, naming the function around it. In a cell that writes a C++ file
(``%%writefile your_engine/....cpp``, exercise 18) the markers are
``// BEGIN SOLUTION`` and ``// END SOLUTION``, and a region becomes
``MINIVLLM_NOT_WRITTEN(function);``, which makes the op that calls the
function fail with "not written yet: function" (a ``NotImplementedError`` in
Python). Cells tagged ``check`` (the ones
that call the reader's code) and cells whose region is at the top level would
then raise, so they get the ``raises-exception`` tag that nbval and Jupyter
Book honour; ``exercises/conftest.py`` reports such a cell as skipped, with
the part's name, instead of passed. Cells tagged ``answer`` (the answers to
"To think about") are left out.

It first writes the book's repository into every notebook (``book/``, ``solutions/``): ``_config.yml``'s
``repository`` (its ``url`` and ``branch``, a release tag) is the one place that names it; the launch buttons
open that branch, and the setup cell (the first code cell) installs minivllm from it on Colab, where nothing of
the repository is there yet to read it from. The setup cells get the ``hide-input`` tag (the second one, which
sets the device, unless the text introduces it).

    python exercises/generate.py          # rewrite the setup cells and exercises/
    python exercises/generate.py --check  # exit 1 if either is out of date
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
NOT_WRITTEN = "not written yet"  # minivllm.exercises.progress looks for it too
STUB = 'raise NotImplementedError("' + NOT_WRITTEN + ': {}")'
ANSWER = "answer"  # the tag of cells that only the solution notebook keeps
CPP_BEGIN, CPP_END = "// BEGIN SOLUTION", "// END SOLUTION"  # in a cell that writes a C++ file
CPP_STUB = "MINIVLLM_NOT_WRITTEN({});  // " + NOT_WRITTEN  # minivllm/kernels/csrc/inner.h defines the macro
CPP_SUFFIXES = (".cpp", ".cc", ".h", ".hpp")
CPP_FUNCTION = re.compile(r"(\s*)(?:(?:inline|static|constexpr)\s+)*[\w:<>]+[\s*&]+(\w+)\s*\([^;]*$")
BANNER = (
    "> **Exercise notebook.** Fill in every `raise NotImplementedError(\"not written yet: ...\")`, then run the "
    "check cells; the worked solution is in `solutions/` of the repository. "
    "`python -m minivllm.exercises status`, run in this folder, lists every part of your engine: written or "
    "not, and whether its check passes."
)


CONFIG = ROOT / "_config.yml"
SETUP = "# Setup: on Colab, install minivllm"  # how the first code cell of every notebook starts
INSTALL = re.compile(r'"minivllm @ git\+[^"]*"')  # the setup cell's pip requirement for minivllm
HIDDEN = "hide-input"  # Jupyter Book shows the cell's output, and its code only when asked


def repository(config: str | None = None) -> tuple[str, str]:
    """``_config.yml``'s repository: ``(url, branch)``, the branch a release tag (a fork changes both there)."""
    import yaml  # Jupyter Book's own dependency

    repo = yaml.safe_load(CONFIG.read_text() if config is None else config)["repository"]
    return repo["url"].rstrip("/"), repo["branch"]


def _source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _set_source(cell, text: str) -> None:
    cell["source"] = text.splitlines(keepends=True) if isinstance(cell["source"], list) else text


def stamp_setup(nb: dict, url: str, branch: str) -> dict:
    """``nb`` with its setup cells as ``_config.yml`` says: minivllm installed from ``url`` at ``branch``, and the
    cells hidden (the second one unless a text cell right before it introduces it, as in chapter 00)."""
    nb = copy.deepcopy(nb)
    cells = nb["cells"]
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    if len(code) < 2 or not _source(cells[code[0]]).startswith(SETUP):
        raise ValueError(f"a notebook's first code cell must be the setup cell ({SETUP!r} ...)")
    setup = cells[code[0]]
    if not INSTALL.search(_source(setup)):
        raise ValueError("the setup cell must install minivllm with pip: \"minivllm @ git+URL@BRANCH\"")
    _set_source(setup, INSTALL.sub(f'"minivllm @ git+{url}@{branch}"', _source(setup)))
    hidden = [code[0]] + ([code[1]] if cells[code[1] - 1]["cell_type"] == "code" else [])
    for i in hidden:
        tags = cells[i].setdefault("metadata", {}).setdefault("tags", [])
        if HIDDEN not in tags:
            tags.append(HIDDEN)
    return nb


def part_name(lines: list[str], indent: str) -> str:
    """The function around a region at ``indent``, as ``Class.method``: the nearest ``def``/``class`` lines above."""
    names, depth = [], len(indent)
    for line in reversed(lines):
        m = re.match(r"(\s*)(?:async\s+)?(?:def|class)\s+(\w+)", line)
        if m and len(m.group(1)) < depth:
            names.append(m.group(2))
            depth = len(m.group(1))
    return ".".join(reversed(names)) or "this cell"


def cpp_function(lines: list[str], indent: str) -> str:
    """The C++ function whose body holds a region at ``indent``: the nearest definition above, less indented."""
    for line in reversed(lines):
        m = CPP_FUNCTION.match(line)
        if m and len(m.group(1)) < len(indent):
            return m.group(2)
    raise ValueError("a // BEGIN SOLUTION region must sit inside a C++ function's body")


def is_cpp(source: str) -> bool:
    """Whether a cell writes a C++ file (``%%writefile path.cpp``): its regions are marked ``//``."""
    first = source.split("\n", 1)[0].split()
    return len(first) == 2 and first[0] == "%%writefile" and first[1].endswith(CPP_SUFFIXES)


def is_stub(line: str) -> bool:
    return line.strip().startswith((STUB.split("{")[0], CPP_STUB.split("{")[0]))


def _markers(source: str) -> tuple[str, str]:
    return (CPP_BEGIN, CPP_END) if is_cpp(source) else (BEGIN, END)


def strip_solutions(source: str) -> tuple[str, bool, bool]:
    """Return ``(source with regions stubbed, any region found, a region at top level)``."""
    begin, end = _markers(source)
    cpp = begin == CPP_BEGIN
    out, inside, found, top = [], False, False, False
    for line in source.split("\n"):
        stripped = line.strip()
        if stripped.startswith(begin):
            if inside:
                raise ValueError(f"nested {begin!r}")
            indent = line[: len(line) - len(line.lstrip())]
            stub = CPP_STUB.format(cpp_function(out, indent)) if cpp else STUB.format(part_name(out, indent))
            out.append(indent + stub)
            inside, found, top = True, True, top or (indent == "" and not cpp)
        elif stripped.startswith(end):
            if not inside:
                raise ValueError(f"{end!r} without {begin!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{begin!r} without {end!r}")
    return "\n".join(out), found, top


CPP_BANNER = (" In the C++ cells, replace every `MINIVLLM_NOT_WRITTEN(...)` line with the function's body: until "
              "then the op that calls it raises `NotImplementedError(\"not written yet: ...\")`.")


def make_exercise(solution: dict) -> dict:
    """The exercise version of a solution notebook (a JSON dict), outputs cleared."""
    nb = copy.deepcopy(solution)
    nb["cells"] = [c for c in nb["cells"] if ANSWER not in c.get("metadata", {}).get("tags", [])]
    regions, cpp = 0, False
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        cpp = cpp or is_cpp(source)
        source, found, top = strip_solutions(source)
        regions += found
        cell["source"] = source
        cell["outputs"], cell["execution_count"] = [], None
        tags = cell.setdefault("metadata", {}).setdefault("tags", [])
        if (top or "check" in tags) and "raises-exception" not in tags:
            tags.append("raises-exception")
    if regions == 0 and not nb["metadata"].get("minivllm", {}).get("capstone"):
        raise ValueError("a solution notebook needs at least one '# BEGIN SOLUTION' region (or '// BEGIN SOLUTION' "
                         "in a C++ cell; or be the capstone)")
    nb["cells"].insert(1, {"cell_type": "markdown", "metadata": {}, "source": BANNER + CPP_BANNER * cpp})
    return nb


def solution_regions(source: str) -> list[str]:
    """The text of each marked region of a cell, markers excluded, in order."""
    begin, end = _markers(source)
    regions, current = [], None
    for line in source.split("\n"):
        if line.strip().startswith(begin):
            current = []
        elif line.strip().startswith(end):
            regions.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return regions


def fill_stubs(exercise: dict, solution: dict) -> dict:
    """The exercise with every stub replaced by the solution's code for it: what a reader who solved it has."""
    nb = copy.deepcopy(exercise)
    regions = iter(r for c in solution["cells"] if c["cell_type"] == "code"
                   for r in solution_regions("".join(c["source"])))
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).split("\n")
            cell["source"] = "\n".join(next(regions) if is_stub(line) else line for line in lines)
    return nb


def render(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if exercises/ is out of date")
    args = parser.parse_args(argv)
    stale = []
    url, branch = repository()
    for path in sorted([*(ROOT / "book").glob("*.ipynb"), *(ROOT / "solutions").glob("*.ipynb")]):
        text = render(stamp_setup(json.loads(path.read_text()), url, branch))
        if path.read_text() != text:
            stale.append(f"{path.parent.name}/{path.name}")
            if not args.check:
                path.write_text(text)
    for src in sorted((ROOT / "solutions").glob("*.ipynb")):
        dst = ROOT / "exercises" / src.name
        text = render(make_exercise(json.loads(src.read_text())))
        if not dst.exists() or dst.read_text() != text:
            stale.append(f"exercises/{dst.name}")
            if not args.check:
                dst.write_text(text)
    if args.check and stale:
        print("out of date (run python exercises/generate.py):", ", ".join(stale))
        return 1
    print(("stale: " if args.check else "written: ") + (", ".join(stale) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
