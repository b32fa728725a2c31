"""The chapters' prose states no measurement that no cell computes (chapter pass: every number is checked).

A number with a unit of measure in a chapter's text (a percentage, a ratio,
milliseconds, bytes, a rate) must appear in a code cell of the same chapter,
where it is asserted, computed or printed; the few numbers that quote a
paper or a definition are listed below with the reason.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "book").glob("[0-9][0-9]_*.ipynb"))
MEASURE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)\s*(%|x\b|×|times\b|ms\b|s\b|seconds\b|µs\b|KiB|MiB|GiB|kB\b|MB\b|"
                     r"GB\b|GB/s|TB/s|GFLOP/s|TFLOP/s|tok/s|tokens/s)")
QUOTED = {  # chapter: numbers the text quotes from elsewhere or sets as examples, and why they need no cell
    "03_kv_cache_memory": {"60-80", "80", "4", "40"},  # the PagedAttention paper's waste figures; an 80 GB GPU
    "10_preemption": {"25"},  # the admission watermark the runs use (0.25 in the cell), a setting
    "11_benchmarks": {"200", "50"},  # an example SLO in the definition of goodput, not a measurement
}


def _prose(cell) -> str:
    text = "".join(cell["source"])
    text = re.sub(r"```.*?```", " ", text, flags=re.S)  # code blocks
    text = re.sub(r"`[^`]*`", " ", text)  # inline code
    text = re.sub(r"\$[^$]*\$", " ", text)  # math
    return re.sub(r"\]\([^)]*\)", "]", text)  # link targets


def _number_forms(number: str) -> set[str]:
    plain = number.replace(",", "")
    forms = {plain, number, plain.replace("_", "")}
    if "." in plain:
        forms.add(plain.rstrip("0").rstrip("."))
    if plain.isdigit() and len(plain) > 3:
        forms.add(f"{int(plain):_}")
    return forms


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_measurement_in_the_prose_is_computed_in_a_cell(path):
    cells = json.loads(path.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    quoted = QUOTED.get(path.stem, set())
    unchecked = []
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        for number, unit in MEASURE.findall(_prose(cell)):
            if number in quoted or number.replace(",", "") in quoted:
                continue
            if not any(re.search(rf"(?<![\w.]){re.escape(f)}(?![\w])", code) for f in _number_forms(number)):
                unchecked.append(f"{number}{unit}")
    assert not unchecked, f"{path.name}: measurements in the text that no cell computes or asserts: {unchecked}"


FIGURE = re.compile(r"plt\.show\(|\bplot_\w+\(|\.savefig\(")
CITE = re.compile(r"\{cite(?::[a-z]+)?\}`([^`]+)`")
BIB_KEYS = set(re.findall(r"^@\w+\{([^,]+),", (ROOT / "references.bib").read_text(), flags=re.M))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_draws_a_figure(path):
    code = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
    assert FIGURE.search(code), f"{path.name}: no cell draws a figure"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_cites_its_sources_in_a_local_bibliography(path):
    """Each chapter cites with its own key prefix and ends with its own bibliography (no duplicate-citation warning)."""
    text = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
    prefix = f"c{path.stem[:2]}-"
    keys = [k.strip() for group in CITE.findall(text) for k in group.split(",")]
    assert keys, f"{path.name}: cites nothing"
    assert f":keyprefix: {prefix}" in text, f"{path.name}: its bibliography needs ':keyprefix: {prefix}'"
    wrong = [k for k in keys if not k.startswith(prefix) or k[len(prefix):] not in BIB_KEYS]
    assert not wrong, f"{path.name}: citations without the prefix {prefix} or not in references.bib: {wrong}"
