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
-rs`` lists them), so an unfilled notebook never reads as passed.
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
        if found:
            report.outcome = "skipped"
            reason = f"{item.name}: {' '.join(found.group().split())} (python -m minivllm.exercises status)"
            report.longrepr = (str(item.path), None, reason)
            return
