"""``pytest --nbval`` on the exercise notebooks: each runs in a throwaway folder, and a cell that stops at a part
still to write is reported *skipped*.

An exercise's ``%%writefile your_engine/...`` cell writes the stub. Run here,
next to the reader's own ``your_engine/``, it would overwrite the parts they
wrote; so the kernel of a notebook in this folder starts in a fresh temporary
folder of its own, removed when the notebook is done, as the book build does
(``run_in_temp`` in ``_config.yml``). The notebook then checks the stub it
just wrote, whatever the reader has.

A cell that stops at a stub (tagged ``raises-exception`` by ``generate.py``)
ends in ``NotImplementedError("not written yet: Class.method")``, which nbval
counts as a pass; here it is a skip whose reason names the part (``pytest
-rs`` lists them), so an unfilled notebook never reads as passed. Such an
error is what the book's page shows: one short message, no traceback
(:func:`page_error_problems`), or the cell fails.
"""

import re
import shutil
import tempfile
from pathlib import Path

import pytest

try:
    from nbval import plugin as nbval_plugin
except ImportError:  # pytest without nbval: no notebook runs here
    nbval_plugin = None

NOT_WRITTEN = re.compile(r"not written yet:\s+[\w.]+")  # \s: the shown line may wrap there
HERE = Path(__file__).resolve().parent
PAGE_LINES, PAGE_WIDTH = 4, 100  # what an unwritten part may show on the page: a few lines within the column


def page_error_problems(out: dict, where: str) -> list[str]:
    """What is wrong with an error a cell shows (an nbval output, as the book shows it): it must say which part is
    not written, in at most PAGE_LINES lines of at most PAGE_WIDTH characters, no traceback, no path of this
    machine (minivllm.exercises.notebook's handler; issue 67)."""
    lines = "\n".join(out.get("traceback", [])).split("\n")
    text = "\n".join(lines)
    found = []
    if not NOT_WRITTEN.search(text) or len(lines) > PAGE_LINES or "Traceback" in text:
        found.append(f"{where}: {len(lines)} lines, not one short 'not written yet' message: {lines[-1][:80]}")
    found += [f"{where}: a line of {len(line)} characters" for line in lines if len(line) > PAGE_WIDTH]
    found += [f"{where}: shows a path of this machine" for line in lines
              if str(HERE.parent) in line or "minivllm-exercise-" in line]
    return found

if nbval_plugin is not None and not hasattr(nbval_plugin.RunningKernel, "exercise_folders"):
    class _KernelInThrowawayFolder(nbval_plugin.RunningKernel):
        """nbval's kernel, started in a fresh temporary folder when its notebook is in an exercise folder."""

        exercise_folders: set = set()  # every folder whose conftest.py is this one (a test copies it)

        def __init__(self, kernel_name, cwd=None, **kwargs):
            self.folder = None
            if cwd is not None and Path(cwd).resolve() in self.exercise_folders:
                cwd = self.folder = tempfile.mkdtemp(prefix="minivllm-exercise-")
            super().__init__(kernel_name, cwd=cwd, **kwargs)

        def stop(self):
            try:
                super().stop()
            finally:
                if self.folder is not None:
                    shutil.rmtree(self.folder, ignore_errors=True)

    nbval_plugin.RunningKernel = _KernelInThrowawayFolder
if nbval_plugin is not None:
    nbval_plugin.RunningKernel.exercise_folders.add(HERE)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if call.when != "call" or not report.passed:
        return
    for out in getattr(item, "test_outputs", None) or []:  # an nbval cell's outputs
        said = "\n".join([out.get("evalue", ""), *out.get("traceback", [])])  # an error raised from a stub's: its line
        found = out.get("output_type") == "error" and NOT_WRITTEN.search(said)
        wrong = page_error_problems(out, item.name) if out.get("output_type") == "error" else []
        if wrong:  # the page would show a traceback, or a line the column cuts
            report.outcome, report.longrepr = "failed", "\n".join(wrong)
            return
        if found:
            report.outcome = "skipped"
            reason = f"{item.name}: {' '.join(found.group().split())} (python -m minivllm.exercises status)"
            report.longrepr = (str(item.path), None, reason)
            return
