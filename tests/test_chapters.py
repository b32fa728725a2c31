"""The chapters' prose states no measurement that no cell computes (chapter pass: every number is checked).

A number with a unit of measure in a chapter's text (a percentage, a ratio,
milliseconds, bytes, a rate) must appear in a code cell of the same chapter,
where it is asserted, computed or printed; the few numbers that quote a
paper or a definition are listed below with the reason. And every vLLM path
the course cites is one checked at the vLLM release the book names
(tests/vllm_paths.txt).
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "book").glob("[0-9][0-9]*_*.ipynb"))  # NN_topic, and NNb_topic for a second half
MEASURE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)\s*(%|x\b|×|times\b|ms\b|s\b|seconds\b|µs\b|KiB|MiB|GiB|kB\b|MB\b|"
                     r"GB\b|GB/s|TB/s|GFLOP/s|TFLOP/s|tok/s|tokens/s)")
QUOTED = {  # chapter: numbers the text quotes from elsewhere or sets as examples, and why they need no cell
    "03_kv_cache_memory": {"80"},  # the PagedAttention paper's waste figure (60-80%)
    "05_paged_attention": {"26"},  # the PagedAttention paper's kernel overhead (20-26%, its section 7.1)
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
    prefix = f"c{path.stem.split('_')[0]}-"  # c10-, c10b-
    keys = [k.strip() for group in CITE.findall(text) for k in group.split(",")]
    assert keys, f"{path.name}: cites nothing"
    assert f":keyprefix: {prefix}" in text, f"{path.name}: its bibliography needs ':keyprefix: {prefix}'"
    wrong = [k for k in keys if not k.startswith(prefix) or k[len(prefix):] not in BIB_KEYS]
    assert not wrong, f"{path.name}: citations without the prefix {prefix} or not in references.bib: {wrong}"


def _markdown(path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]


# A number in words with a unit of measure ("half a minute", "several microseconds") escapes the digit scan above,
# so it is not allowed in the prose at all: compute the figure in a cell and print it, or say what sets it.
WORD_NUMBER = (r"(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|fifteen|twenty|thirty|forty|fifty|"
               r"sixty|hundred|thousand|half|several|a\s+few|a\s+couple\s+of|tens\s+of|hundreds\s+of|thousands\s+of)")
UNIT_WORD = (r"(?:seconds?|minutes?|hours?|milliseconds?|microseconds?|nanoseconds?|ms|µs|"
             r"(?:kilo|mega|giga)bytes?|KiB|MiB|GiB|GB|percent|tokens/s)")
WORD_MEASURE = re.compile(rf"\b(?:{WORD_NUMBER}(?:\s+(?:a|an))?\s+{UNIT_WORD}|"
                          rf"(?:about|around|roughly|nearly|almost|most\s+of|under)\s+(?:a|an|one)\s+{UNIT_WORD}|"
                          rf"(?:takes?|took|within)\s+{UNIT_WORD}\b)", re.I)
WORDS_QUOTED = {  # chapter: phrases that are not measurements of this run, and why
}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_no_measurement_in_words(path):
    found = [m.group(0) for text in _markdown(path) for m in WORD_MEASURE.finditer(_prose({"source": [text]}))]
    found = [f for f in found if f.lower() not in WORDS_QUOTED.get(path.stem, set())]
    assert not found, f"{path.name}: measurements in words that no cell computes: {found}"


def test_word_scan_sees_the_slips_it_exists_for():
    for slip in ("a CPU run of about half a minute", "a kernel launch of several microseconds",
                 "would spend most of a minute", "SmolLM2 would take minutes here", "later loads take about a second"):
        assert WORD_MEASURE.search(slip), slip
    for fine in ("three ranks", "a few hundred kilobytes of KV, printed above" and "two passes", "the 64 sequences"):
        assert not WORD_MEASURE.search(fine), fine


TOC = ROOT / "_toc.yml"


def test_the_map_of_the_course_names_every_chapter_and_every_exercise():
    """Chapter 00's map links every chapter of the table of contents and every exercise notebook there is."""
    (the_map,) = [t for t in _markdown(ROOT / "book" / "00_introduction.ipynb") if t.startswith("## Map of the course")]
    chapters = re.findall(r"^\s*- file: book/(\d\d[a-z]?_\w+)\s*$", TOC.read_text(), flags=re.M)
    assert len(chapters) == len(CHAPTERS) and chapters == [p.stem for p in CHAPTERS]
    missing = [c for c in chapters if f"]({c}.ipynb)" not in the_map]
    exercises = sorted(p.stem for p in (ROOT / "exercises").glob("*.ipynb"))
    missing += [e for e in exercises if f"](../exercises/{e}.ipynb)" not in the_map]
    assert exercises and not missing, f"the map in 00_introduction.ipynb does not link: {missing}"
    linked = re.findall(r"\]\(\.\./exercises/(\w+)\.ipynb\)", the_map)
    assert set(linked) <= set(exercises), f"the map links exercises that do not exist: {set(linked) - set(exercises)}"


# Where minivllm parts ways with vLLM V1: when a chapter's text names the mechanism (the trigger), the chapter
# must carry a "How vLLM does it" box that points at the vLLM source that shows what vLLM does (the path).
DIVERGENCES = {
    "scheduler phases and order": (r"vLLM V1'?s? scheduler|vLLM's V1 scheduler|V1 states|PREFILLING",
                                   "vllm/v1/core/sched/scheduler.py"),
    "offload timing": (r"--kv-offloading-size|offloading connector", "offloading/scheduler.py"),
    "TP head rule": (r"valid sizes? (?:must )?divide", "vllm/model_executor/layers/linear.py"),
    "stop-token text": (r"stop_token_ids", "vllm/v1/engine/detokenizer.py"),
    "metric names": (r"`vllm:\w+`|vLLM's names", "vllm/v1/metrics/loggers.py"),
    "prefix-cache hashing": (r"SHA-256|sha256", "vllm/config/cache.py"),
    "draft lookup": (r"latest earlier occurrence", "vllm/v1/spec_decode/ngram_proposer.py"),
    "spec-decode rollback": (r"back to the pool", "vllm/v1/core/sched/scheduler.py"),
}
BOX = re.compile(r"```\{admonition\} How vLLM does it\n(.*?)```", re.S)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_a_how_vllm_does_it_box_wherever_minivllm_parts_ways(path):
    text = "\n".join(_markdown(path))
    boxes = BOX.findall(text)
    outside = BOX.sub(" ", text)
    missing = [name for name, (trigger, where) in DIVERGENCES.items()
               if re.search(trigger, outside) and not any(where in box for box in boxes)]
    assert not missing, f"{path.name} names vLLM mechanisms it does not follow without a 'How vLLM does it' box: {missing}"
    for box in boxes:
        assert ":class: note" in box and re.search(r"`(?:vllm|examples)/[\w/]+\.py`", box), \
            f"{path.name}: a 'How vLLM does it' box must name the vLLM source file it describes"


VLLM_PATHS = ROOT / "tests" / "vllm_paths.txt"
VLLM_PATH = re.compile(r"(?<![\w/.-])((?:vllm|csrc|examples|docs)/[A-Za-z0-9_./-]*[A-Za-z0-9_/])")
VLLM_LINK = re.compile(r"github\.com/vllm-project/vllm/(?:blob|tree)/([^/]+)/([^}\s]+)")
NOT_VLLM = {f"csrc/{p.name}" for p in (ROOT / "minivllm" / "kernels" / "csrc").iterdir()}  # minivllm's own C++


def _cited_vllm_paths() -> dict[str, str]:
    """Every vLLM path the course names, with one place that names it."""
    texts = []
    for path in sorted([*(ROOT / "book").glob("*.ipynb"), *(ROOT / "solutions").glob("*.ipynb")]):
        cells = json.loads(path.read_text())["cells"]
        texts += [(f"{path.name} cell {i}", "".join(c["source"])) for i, c in enumerate(cells)]
    for pattern in ("book/*.md", "minivllm/**/*.py", "minivllm/**/*.md"):
        texts += [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted(ROOT.glob(pattern))]
    cited = {m.group(1).rstrip("."): where for where, text in texts for m in VLLM_PATH.finditer(text)}
    cited.update({m.group(2): "references.bib" for m in VLLM_LINK.finditer((ROOT / "references.bib").read_text())})
    return {p: where for p, where in cited.items() if p not in NOT_VLLM}


def test_every_cited_vllm_path_was_checked_at_the_books_vllm_release():
    lines = [line for line in VLLM_PATHS.read_text().splitlines() if line and not line.startswith("#")]
    release, checked = lines[0], set(lines[1:])
    assert f"vLLM {release}" in (ROOT / "book" / "index.md").read_text(), f"book/index.md does not name vLLM {release}"
    unchecked = {p: where for p, where in _cited_vllm_paths().items() if p not in checked}
    assert not unchecked, f"vLLM paths cited but not checked at {release} (tests/vllm_paths.txt): {unchecked}"
    tags = {tag for tag, _ in VLLM_LINK.findall((ROOT / "references.bib").read_text())}
    assert tags <= {release}, f"references.bib links vLLM at {sorted(tags - {release})}, not at {release}"


DRAWS = re.compile(r"\bplt\.|\bplot_\w+\(")
IMPORTS_VIZ = re.compile(r"^\s*(import minivllm\.viz\b|from minivllm\.viz import|from minivllm import .*\bviz\b)", re.M)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_figure_is_drawn_as_svg(path):
    """A chapter imports minivllm.viz, which sets the notebook's figures to SVG, before its first figure: without
    it matplotlib draws PNGs (chapters 12 and 19 did, issue 67), squashed when the page narrows them."""
    code = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    first_figure = next((i for i, source in enumerate(code) if DRAWS.search(source)), None)
    if first_figure is None:
        pytest.skip("no figure")
    assert any(IMPORTS_VIZ.search(source) for source in code[:first_figure + 1]), (
        f"{path.name}: import minivllm.viz (figures as SVG) before the first figure, code cell {first_figure}")
