"""The exercise notebooks are generated from the solutions and kept in step."""

import importlib.util
import json
from pathlib import Path

import pytest

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
    code = "\n".join(c["source"] for c in nb["cells"] if c["cell_type"] == "code")
    assert generate.BEGIN not in code and "NotImplementedError" in code


def test_strip_solutions_keeps_indentation_and_tags_top_level():
    src = "def f(x):\n    # BEGIN SOLUTION\n    return x + 1\n    # END SOLUTION\n"
    out, found, top = generate.strip_solutions(src)
    assert out == f"def f(x):\n    {generate.STUB}\n" and found and not top
    out, found, top = generate.strip_solutions("# BEGIN SOLUTION\ny = 2\n# END SOLUTION")
    assert out == generate.STUB and top


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
