"""Under ``pytest --nbval``: a notebook cell whose printed output has a line wider than the book's column fails.

The book shows a cell's outputs as they print; at a 1280 px window its content
column holds LIMIT monospace characters (tests/test_page_width.py, which holds
the notebooks' code to the same width, says where the number comes from), and a
longer line is cut off. The outputs are not stored in the notebooks, so each
cell's are checked as it runs: its stdout, and the text/plain of a result that
has nothing the book would show instead (a figure, HTML). Stderr is not shown
(``stderr_output: remove-warn`` in _config.yml), nor a cell tagged
``remove-output``; an error's traceback is nbval's to judge.
"""

import re

import pytest

LIMIT = 100  # tests/test_page_width.py's LIMIT: what book/_static/minivllm.css shows at a 1280 px window
SHOWN_INSTEAD = ("text/html", "image/png", "image/jpeg", "image/svg+xml", "text/markdown", "text/latex",
                 "application/javascript", "application/vnd.jupyter.widget-view+json")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def shown_lines(outputs) -> list[str]:
    """The text lines of a cell's outputs that the book shows as monospace text."""
    texts = []
    for out in outputs or []:
        kind = out.get("output_type")
        if kind == "stream" and out.get("name") == "stdout":
            texts.append(out.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            if "text/plain" in data and not any(mime in data for mime in SHOWN_INSTEAD):
                texts.append(data["text/plain"])
    lines = []
    for text in texts:
        for line in ANSI.sub("", "".join(text) if isinstance(text, list) else text).split("\n"):
            lines.append(line.split("\r")[-1].expandtabs())  # a carriage return overwrites the line
    return lines


def too_wide(outputs, limit: int = LIMIT) -> list[str]:
    return [line for line in shown_lines(outputs) if len(line) > limit]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if call.when != "call" or not report.passed or getattr(item, "test_outputs", None) is None:
        return
    if "remove-output" in (getattr(getattr(item, "cell", None), "metadata", {}) or {}).get("tags", []):
        return
    wide = too_wide(item.test_outputs)
    if wide:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: {len(wide)} output line(s) wider than the book's column ({LIMIT} "
                           "characters):\n" + "\n".join(f"  {len(line)}: {line}" for line in wide))
