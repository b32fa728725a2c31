"""The exercise notebooks are generated from the solutions and kept in step."""

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from helpers import write_parts
from minivllm.exercises._common import NOT_WRITTEN

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("generate", ROOT / "exercises" / "generate.py")
generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate)

SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def test_every_solution_has_an_exercise_and_back():
    assert SOLUTIONS, "no solution notebooks"
    assert {p.name for p in SOLUTIONS} == {p.name for p in (ROOT / "exercises").glob("*.ipynb")}


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_exercises_are_up_to_date(path):
    expected = generate.render(generate.make_exercise(json.loads(path.read_text())))
    actual = (ROOT / "exercises" / path.name).read_text()
    assert actual == expected, f"exercises/{path.name} is stale: run python exercises/generate.py"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_exercises_hide_the_solutions(path):
    nb = json.loads((ROOT / "exercises" / path.name).read_text())
    if nb["metadata"].get("minivllm", {}).get("capstone"):
        pytest.skip("the capstone has nothing to write: it plugs in the other exercises' parts")
    code = "\n".join(c["source"] for c in nb["cells"] if c["cell_type"] == "code")
    assert generate.BEGIN not in code and generate.CPP_BEGIN not in code
    assert "NotImplementedError" in code or "MINIVLLM_NOT_WRITTEN(" in code  # a Python stub, or a C++ one (18)


NOTEBOOKS = sorted([*(ROOT / "book").glob("*.ipynb"), *(ROOT / "solutions").glob("*.ipynb"),
                    *(ROOT / "exercises").glob("*.ipynb")])


def test_the_repository_is_named_in_one_place():
    """_config.yml's repository (url, and branch: the release tag of pyproject's version) is what every notebook's
    setup cell installs and every link to the repository in the README and the notebooks names."""
    url, branch = generate.repository()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert branch == f"v{version}", "_config.yml's repository branch is the release tag of pyproject's version"
    owner_repo = url.removeprefix("https://github.com/")
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        assert generate.stamp_setup(nb, url, branch) == nb, f"{path}: run python exercises/generate.py"
    texts = {p: p.read_text() for p in [ROOT / "README.md", ROOT / "book" / "index.md", *NOTEBOOKS]}
    name = owner_repo.split("/")[1]
    for path, text in texts.items():
        for m in re.finditer(rf"github(?:\.com)?/([\w.-]+/{re.escape(name)})\b(/blob/[^/\s]+)?(@[\w.-]+)?", text):
            assert m.group(1) == owner_repo, f"{path.name}: {m.group(0)} is not _config.yml's {url}"
            if m.group(2) or m.group(3):
                assert (m.group(2) or m.group(3))[1:].removeprefix("blob/") == branch, f"{path.name}: {m.group(0)}"


def test_stamping_the_setup_cells_installs_from_the_configured_tag_and_hides_them():
    """generate.stamp_setup: the configured url@branch in the setup cell's pip line; both setup cells hidden, the
    second one only when no text introduces it; a notebook without the setup cell first is refused."""
    repo = generate.repository("repository:\n  url: https://github.com/someone/minivllm/\n  branch: v9.9\n")
    assert repo == ("https://github.com/someone/minivllm", "v9.9")
    setup = ('# Setup: on Colab, install minivllm and the embedded model\nimport subprocess, sys\n'
             'subprocess.run(["pip", "install", "minivllm @ git+https://github.com/minivllm/minivllm"])')
    cell = lambda kind, text: {"cell_type": kind, "metadata": {}, "source": text}  # noqa: E731
    nb = {"cells": [cell("code", setup), cell("code", "import os"), cell("code", "x = 1")]}
    out = generate.stamp_setup(nb, *repo)
    assert '"minivllm @ git+https://github.com/someone/minivllm@v9.9"' in out["cells"][0]["source"]
    assert [c["metadata"].get("tags") for c in out["cells"]] == [["hide-input"], ["hide-input"], None]
    assert generate.stamp_setup(out, *repo) == out  # stamping twice changes nothing
    introduced = {"cells": [cell("code", setup), cell("markdown", "The next cell..."), cell("code", "import os")]}
    assert [c["metadata"].get("tags") for c in generate.stamp_setup(introduced, *repo)["cells"]] == [
        ["hide-input"], None, None]
    with pytest.raises(ValueError, match="first code cell must be the setup cell"):
        generate.stamp_setup({"cells": [cell("code", "import os"), cell("code", setup)]}, *repo)


def test_strip_solutions_keeps_indentation_and_tags_top_level():
    src = "def f(x):\n    # BEGIN SOLUTION\n    return x + 1\n    # END SOLUTION\n"
    out, found, top = generate.strip_solutions(src)
    assert out == f"def f(x):\n    {generate.STUB.format('f')}\n" and found and not top
    out, found, top = generate.strip_solutions("# BEGIN SOLUTION\ny = 2\n# END SOLUTION")
    assert out == generate.STUB.format("this cell") and top


def test_a_stub_names_its_part():
    src = ("class My(Base):\n    def a(self):\n        # BEGIN SOLUTION\n        return 1\n        # END SOLUTION\n\n"
           "    def b(self):\n        x = 1\n        # BEGIN SOLUTION\n        return x\n        # END SOLUTION\n"
           "def g():\n    # BEGIN SOLUTION\n    pass\n    # END SOLUTION\n")
    out, _, _ = generate.strip_solutions(src)
    assert [line.strip() for line in out.split("\n") if generate.is_stub(line)] == [
        f'raise NotImplementedError("not written yet: {name}")' for name in ("My.a", "My.b", "g")]
    assert generate.NOT_WRITTEN == NOT_WRITTEN  # what the capstone and the status command look for


CPP_CELL = """%%writefile your_engine/kernels_inner.cpp
#include "inner.h"

namespace minivllm {

inline void attend_tile(const AttentionTile& t) {
  // BEGIN SOLUTION
  const int D = t.head_dim;  # not a marker in C++: # BEGIN SOLUTION
  // END SOLUTION
}

inline void q4_1_block_dot(const uint8_t* block, const float* x, int64_t x_stride,
                           int rows, fvec* acc) {
  // BEGIN SOLUTION
  const float d = half_to_float(read_u16(block));
  // END SOLUTION
}

}  // namespace minivllm"""


def test_cpp_regions_become_the_not_written_macro_naming_their_function():
    """A cell that writes a C++ file (exercise 18) is marked with //, and each region becomes
    MINIVLLM_NOT_WRITTEN(function); the cell is not tagged to raise (writing a file never does)."""
    out, found, top = generate.strip_solutions(CPP_CELL)
    stubs = [line.strip() for line in out.split("\n") if generate.is_stub(line)]
    assert stubs == [generate.CPP_STUB.format(name) for name in ("attend_tile", "q4_1_block_dot")]
    assert found and not top and "half_to_float" not in out and "head_dim" not in out
    assert out.startswith("%%writefile your_engine/kernels_inner.cpp\n") and out.endswith("}  // namespace minivllm")
    assert generate.solution_regions(CPP_CELL) == [
        "  const int D = t.head_dim;  # not a marker in C++: # BEGIN SOLUTION",
        "  const float d = half_to_float(read_u16(block));"]
    python = "def f():\n    x = 1  // BEGIN SOLUTION is not a Python marker\n    return x\n"
    assert generate.strip_solutions(python) == (python, False, False)
    with pytest.raises(ValueError, match="inside a C\\+\\+ function"):
        generate.strip_solutions("%%writefile a.cpp\n// BEGIN SOLUTION\nint x;\n// END SOLUTION")
    with pytest.raises(ValueError, match="without"):
        generate.strip_solutions("%%writefile a.cpp\nvoid f() {\n  // BEGIN SOLUTION\n}")


def test_a_cpp_stub_builds_and_its_op_says_not_written():
    """The generated C++ stub compiles with minivllm's ops.cpp, and each op whose inner loop is still the stub raises
    NotImplementedError("not written yet: <function>"), as a Python stub does; the other ops run."""
    from minivllm.kernels import build

    if build.compiler() is None:
        pytest.skip("no C++ compiler here")
    from minivllm.kernels.cpu import CpuKernels

    out, _, _ = generate.strip_solutions(CPP_CELL)
    import tempfile

    path = Path(tempfile.mkdtemp()) / "kernels_inner.cpp"
    path.write_text(out.split("\n", 1)[1] + "\n")
    table = CpuKernels(build.load(build.build(path, quiet=True)), "cpu (yours)")
    assert table.not_written() == ["attend_tile", "q4_1_block_dot"]
    import torch

    with pytest.raises(NotImplementedError, match="^not written yet: q4_1_block_dot$"):
        table.q4_1_linear(torch.ones(2, 64), torch.zeros(3, 40, dtype=torch.uint8))
    torch.testing.assert_close(table.silu_and_mul(torch.zeros(1, 8)), torch.zeros(1, 4))
    # minivllm's own library in the same process keeps its own flags (the inner unit's not_written is hidden: one
    # object a library, not one for every library loaded)
    own = CpuKernels(build.load(build.build(quiet=True)), "cpu")
    assert own.not_written() == [] and table.not_written() == ["attend_tile", "q4_1_block_dot"]


@pytest.mark.parametrize("src", ["# BEGIN SOLUTION\nx", "x\n# END SOLUTION", "# BEGIN SOLUTION\n# BEGIN SOLUTION\n"])
def test_unbalanced_markers_are_refused(src):
    with pytest.raises(ValueError):
        generate.strip_solutions(src)


def test_check_cells_get_raises_exception():
    nb = {"cells": [
        {"cell_type": "code", "metadata": {}, "source": "def f():\n    # BEGIN SOLUTION\n    pass\n    # END SOLUTION", "outputs": [], "execution_count": None},
        {"cell_type": "code", "metadata": {"tags": ["check"]}, "source": "check(f)", "outputs": [], "execution_count": 3},
        {"cell_type": "code", "metadata": {}, "source": "print(1)", "outputs": [], "execution_count": None},
    ], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    ex = generate.make_exercise(nb)
    tags = [c["metadata"].get("tags", []) for c in ex["cells"] if c["cell_type"] == "code"]
    assert tags == [[], ["check", "raises-exception"], []]
    assert all(c.get("execution_count") is None for c in ex["cells"] if c["cell_type"] == "code")


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_filling_the_stubs_with_the_solution_gives_the_solution(path):
    """A reader who writes the solution's code into every stub has exactly the solution notebook's code."""
    solution = json.loads(path.read_text())
    exercise = json.loads((ROOT / "exercises" / path.name).read_text())
    filled = generate.fill_stubs(exercise, solution)
    markers = (generate.CPP_BEGIN, generate.CPP_END, generate.BEGIN, generate.END)
    code = lambda nb: [functools.reduce(lambda s, m: s.replace(m, ""), markers, "".join(c["source"]))  # noqa: E731
                       for c in nb["cells"] if c["cell_type"] == "code"]
    strip = lambda cells: ["\n".join(line for line in c.split("\n") if line.strip()) for c in cells]  # noqa: E731
    assert strip(code(filled)) == strip(code(solution))


def test_a_filled_exercise_runs(tmp_path):
    """Exercise 04 with its stubs filled from the solution notebook runs to the end, its check included."""
    nbclient = pytest.importorskip("nbclient")
    name = "04_block_manager.ipynb"
    filled = generate.fill_stubs(json.loads((ROOT / "exercises" / name).read_text()),
                                 json.loads((ROOT / "solutions" / name).read_text()))
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.reads(json.dumps(filled), as_version=4)
    for cell in nb.cells:  # a solved exercise raises nowhere: no cell may fail
        cell.metadata["tags"] = [t for t in cell.metadata.get("tags", []) if t != "raises-exception"]
    nbclient.NotebookClient(nb, timeout=600, resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "check_block_manager:" in outputs and "no block leaked" in outputs


def _targets(solution: dict) -> set[str]:
    """The functions and methods whose bodies the reader writes: those holding a solution region."""
    names = set()
    for cell in solution["cells"]:
        if cell["cell_type"] == "code":
            last_def = None
            for line in "".join(cell["source"]).split("\n"):
                if (m := re.match(r"\s*def (\w+)", line)):
                    last_def = m.group(1)
                elif line.strip().startswith(generate.BEGIN) and last_def:
                    names.add(last_def)
    return names


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_chapters_point_to_the_exercise_before_showing_its_answer(path):
    """minivllm's source of an exercise's part appears only after the link to the exercise, folded whole (the printed
    source too: hide-input folds only the code, and the page showed the answer), right after a paragraph that links
    the exercise (issue 66 for chapters 18 and 19, issue 68 for the others)."""
    chapter = next((ROOT / "book").glob(path.name), None)
    if chapter is None:
        pytest.skip("no chapter of that name (the capstone)")
    cells = json.loads(chapter.read_text())["cells"]
    link = next((i for i, c in enumerate(cells) if f"exercises/{path.name}" in "".join(c["source"])), None)
    assert link is not None, f"{chapter.name} never links to its exercise"
    targets = _targets(json.loads(path.read_text()))
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        shown = set(re.findall(r"getsource\((?:\w+\.)*(\w+)\)", source)) & targets
        if re.search(r"\binner\.cpp\b.*read_text\(\)", source):  # exercise 18's answer: minivllm's C++ loops
            shown.add("inner.cpp")
        if shown:
            assert i > link, f"{chapter.name} cell {i} shows {shown} before linking to the exercise"
            tags = set(cell["metadata"].get("tags", []))
            before = next(c for c in reversed(cells[:i]) if c["cell_type"] == "markdown")
            assert f"exercises/{path.name}" in "".join(before["source"]) and "answer" in "".join(before["source"]), (
                f"{chapter.name} cell {i} shows {shown}: the text just before it must say it is the exercise's "
                "answer and link the exercise")
            assert {"hide-cell", "hide-output"} & tags, f"{chapter.name} cell {i}: fold its output (the source) too"


TRIO_AFTER_SETUP = """
import json, warnings
from IPython.core.interactiveshell import InteractiveShell
InteractiveShell.instance()
from minivllm.exercises.notebook import set_up_exercise
assert set_up_exercise()
with warnings.catch_warnings(record=True) as caught:
    import trio  # as httpx's httpcore does, in every exercise's first check cell
    warnings.warn("a real warning", RuntimeWarning)
print(json.dumps([str(w.message) for w in caught]))
"""


def test_an_exercise_kernel_imports_trio_without_a_warning_on_stderr_and_still_shows_others():
    """Every exercise page showed trio's RuntimeWarning (a custom exception handler installed: set_up_exercise's)
    as stderr in its first check cell, and the book build warned once per exercise: only that message is silenced."""
    pytest.importorskip("trio")
    pytest.importorskip("IPython")
    out = subprocess.run([sys.executable, "-c", TRIO_AFTER_SETUP], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == ["a real warning"], out.stdout


def test_an_exercise_kernel_shows_an_unwritten_part_in_one_line_and_never_writes_a_stub_over_a_part(tmp_path):
    """In a kernel set up as an exercise's setup cell does (set_up_exercise): a stub's NotImplementedError is one
    error line with its message (what a rendered page shows, what nbval and exercises/conftest.py read), other
    errors keep their traceback; a %%writefile cell with more stubs than the file it would replace keeps the file,
    and one with as many or fewer writes it."""
    nbclient, nbformat = pytest.importorskip("nbclient"), pytest.importorskip("nbformat")
    stub = 'def f():\n    raise NotImplementedError("not written yet: f")\n'
    (tmp_path / "your_engine").mkdir()
    (tmp_path / "your_engine" / "part.py").write_text("def f():\n    return 1\n")  # the reader's, in an editor
    cells = ["from minivllm.exercises.notebook import set_up_exercise\nset_up_exercise()",
             'def f():\n    raise NotImplementedError("not written yet: My.f")\nf()',
             'def g():\n    raise NotImplementedError("a real one")\ng()',
             "%%writefile your_engine/part.py\n" + stub,  # Run All over the exercise as generated: kept
             "%%writefile your_engine/part.py\ndef f():\n    return 2\n",  # the reader's next version: written
             "%%writefile your_engine/new.py\n" + stub]  # no file yet: the stub is written
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c, metadata={"tags": ["raises-exception"]})
                                         for c in cells])
    client = nbclient.NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(tmp_path)}})
    client.allow_errors = False  # only the cells tagged raises-exception may fail
    parts = {}

    def on_cell_executed(cell, cell_index, **kwargs):  # each file as the cell left it
        parts[cell_index] = {p.name: p.read_text() for p in (tmp_path / "your_engine").iterdir()}

    client.on_cell_executed = on_cell_executed
    client.execute()
    stub_error, real_error = (c.outputs for c in nb.cells[1:3])
    assert [(o.output_type, o.ename, o.evalue, o.traceback) for o in stub_error] == [
        ("error", "NotImplementedError", "not written yet: My.f", ["NotImplementedError: not written yet: My.f"])]
    assert len(real_error) == 1 and real_error[0].evalue == "a real one" and len(real_error[0].traceback) > 1
    assert "g()" in re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(real_error[0].traceback))  # ANSI colours out
    assert parts[3]["part.py"] == "def f():\n    return 1\n"
    assert "Kept your_engine/part.py" in nb.cells[3].outputs[0].text and "1 here" in nb.cells[3].outputs[0].text
    assert parts[4]["part.py"] == "def f():\n    return 2\n" and parts[5]["new.py"] == stub


def _solved_parts(folder: Path) -> dict[str, bytes]:
    """A reader's ``your_engine/`` in ``folder`` with every part written (the solutions'), as its files' bytes."""
    write_parts(ROOT / "solutions", folder)
    return _files(folder / "your_engine")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_an_unfilled_exercise_reads_as_skipped_and_leaves_the_readers_parts_alone(tmp_path):
    """pytest --nbval on exercise 03 as generated, as the test command runs it, next to a reader's your_engine/ with
    every part written: each cell that stops at a stub is skipped, naming the part (the notebook checked the stub it
    wrote, in a throwaway folder of its own: exercises/conftest.py), and the reader's parts are untouched."""
    for name in ("03_kv_cache_memory.ipynb", "conftest.py"):
        shutil.copy(ROOT / "exercises" / name, tmp_path)
    parts = _solved_parts(tmp_path)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--nbval",
                             "--nbval-current-env", "03_kv_cache_memory.ipynb"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.strip().split("\n")[-1]
    assert re.search(r"\d+ passed, 4 skipped", summary), result.stdout  # the 4 cells that call a stub
    assert result.stdout.count("not written yet: kv_bytes_per_token") == 2  # its check and the cell that uses it
    assert result.stdout.count("not written yet: paged_waste") == 2
    assert _files(tmp_path / "your_engine") == parts


def test_building_the_book_leaves_the_readers_parts_alone(tmp_path):
    """jupyter-book build with the book's _config.yml, on exercise 03 next to a reader's your_engine/ with every part
    written: the page shows each unwritten part as one line, no traceback (it ran the stub, in a temporary folder:
    run_in_temp), and the reader's parts are untouched."""
    jupyter_book = shutil.which("jupyter-book")
    if jupyter_book is None:
        pytest.skip("jupyter-book is not installed")
    for name in ("_config.yml", "references.bib"):
        shutil.copy(ROOT / name, tmp_path)
    (tmp_path / "_toc.yml").write_text("format: jb-book\nroot: exercises/03_kv_cache_memory\n")
    (tmp_path / "exercises").mkdir()
    shutil.copy(ROOT / "exercises" / "03_kv_cache_memory.ipynb", tmp_path / "exercises")
    parts = _solved_parts(tmp_path / "exercises")
    result = subprocess.run([jupyter_book, "build", str(tmp_path)], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert _files(tmp_path / "exercises" / "your_engine") == parts
    html = (tmp_path / "_build" / "html" / "exercises" / "03_kv_cache_memory.html").read_text()
    page = re.sub(r"<[^>]+>", "", html)  # the text a reader sees (the outputs are syntax-highlighted)
    for part in ("kv_bytes_per_token", "paged_waste"):
        assert page.count(f"NotImplementedError: not written yet: {part}") == 2, part
    assert "Traceback" not in page and str(tmp_path) not in page


def test_an_error_that_says_a_part_is_not_written_is_its_message_alone():
    """unwritten_part_message: the stub's NotImplementedError, a check's AssertionError, EngineConfig's ValueError
    or an error raised from any of them is shown as its message in lines of at most 100 characters (the error
    raised, then the stub's under it); any other error is None (IPython's traceback)."""
    from minivllm.exercises.notebook import unwritten_part_message

    names = ", ".join(f"MyBlockManager.method_{i}" for i in range(8))
    assert unwritten_part_message(NotImplementedError(f"{NOT_WRITTEN}: My.f")) == [
        f"NotImplementedError: {NOT_WRITTEN}: My.f"]
    lines = unwritten_part_message(ValueError(f"block_manager_cls must be a class whose methods are written "
                                              f"({NOT_WRITTEN}: {names}), got 'MyBlockManager'"))
    assert len(lines) == 4 and max(map(len, lines)) <= 100 and lines[0].startswith("ValueError: block_manager_cls")
    assert " ".join(line.strip() for line in lines).endswith("MyBlockManager.method_7), got 'MyBlockManager'")
    try:
        try:
            raise NotImplementedError(f"{NOT_WRITTEN}: g")
        except NotImplementedError:
            raise KeyError("slot")  # raised while handling the stub's error: its __context__
    except KeyError as e:
        assert unwritten_part_message(e) == ["KeyError: 'slot'", f"  from NotImplementedError: {NOT_WRITTEN}: g"]
    assert unwritten_part_message(AssertionError("a real failure")) is None
    assert unwritten_part_message(ValueError("x")) is None
    hidden = KeyError("x")
    hidden.__context__, hidden.__suppress_context__ = NotImplementedError(f"{NOT_WRITTEN}: g"), True  # from None
    assert unwritten_part_message(hidden) is None


def test_the_exercise_pages_error_check_refuses_a_traceback_a_wide_line_and_a_path():
    """exercises/conftest.py fails an nbval cell of an exercise notebook whose error is not one short 'not written
    yet' message: the test command runs every exercise notebook (its stubs unwritten) as the book build does, so
    every page's errors pass through this check there."""
    spec = importlib.util.spec_from_file_location("exercises_conftest", ROOT / "exercises" / "conftest.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    good = {"output_type": "error", "traceback": [f"NotImplementedError: {NOT_WRITTEN}: MyScheduler.schedule"]}
    assert hook.page_error_problems(good, "cell") == []
    traceback = ["\x1b[0;31mTraceback (most recent call last)", *[f'  File "engine.py", line {i}' for i in range(30)],
                 f"ValueError: ({NOT_WRITTEN}: MyScheduler.schedule)"]
    wide = [f"ValueError: scheduler_cls must be written ({NOT_WRITTEN}: MyScheduler.schedule) " + "x" * 80]
    path = [f"NotImplementedError: {NOT_WRITTEN}: My.f", f"  in {ROOT}/minivllm/engine.py"]
    other = ["KeyError: 'slot'"]
    for outs, says in [(traceback, "lines"), (wide, "a line of"), (path, "path"), (other, "not written")]:
        problems = hook.page_error_problems({"output_type": "error", "traceback": outs}, "cell")
        assert any(says in p for p in problems), (says, problems)
