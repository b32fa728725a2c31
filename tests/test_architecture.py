"""The shape of the code (minivllm/README.md): layers that point one way, short functions, extension points."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm import LLM
from minivllm.block_manager import MiniBlockManager
from minivllm.scheduler import MiniScheduler

from helpers import greedy, run_engine

ROOT = Path(__file__).resolve().parent.parent
CORE = ["config", "sampling_params", "sequence", "outputs", "block_manager", "scheduler", "simulator", "attention", "sampler",
        "detokenizer", "model_runner", "engine", "timing", "preemption", "simple_generation", "models/llama",
        "models/loader", "models/parallel", "copy_stream", "cuda_graphs", "distributed/workers", "distributed/protocol", "distributed/runner",
        "kv_transfer", "disaggregation/link", "disaggregation/worker", "disaggregation/front",
        "disaggregation/handoff"]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """Run the import-linter contract of ``root``/pyproject.toml over the ``minivllm`` package in ``root``."""
    env = {"PYTHONPATH": str(root), "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()", "--no-cache"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_layer_contract_holds():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_the_layer_contract_fails_when_a_core_module_imports_a_front_end(tmp_path):
    shutil.copytree(ROOT / "minivllm", tmp_path / "minivllm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "minivllm" / "scheduler.py", "a") as f:
        f.write("\nimport minivllm.bench  # noqa: E402  (the mistake the contract must catch)\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "BROKEN" in result.stdout
    assert "minivllm.scheduler -> minivllm.bench" in result.stdout


def test_import_minivllm_loads_no_front_end():
    code = ("import minivllm, sys; print(sorted(m for m in sys.modules if m.startswith(('minivllm.bench', "
            "'minivllm.viz', 'minivllm.exercises', 'minivllm.simulator', 'minivllm.serving', 'fastapi', "
            "'uvicorn', 'prometheus_client'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def exercise_imports(package: Path) -> dict[str, set[str]]:
    """Each module of ``minivllm/exercises`` (``package``) -> the modules of it that it imports, at its top or
    inside a function (an import deferred to a call is still a dependency)."""
    graph = {}
    for path in sorted(package.glob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minivllm.exercises."):
                found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("minivllm.exercises."))
        graph[path.stem] = found - {path.stem}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as the modules along it (the first back to itself), or None."""
    state = {}

    def visit(module, path):
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep] if dep in path else [module, dep]
            if dep not in state:
                cycle = visit(dep, path + [dep])
                if cycle:
                    return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return None


def test_the_exercise_modules_import_down_only():
    """What the checks share (parts, _common, native, live) sits below them: no module of minivllm.exercises
    imports one that imports it back, even from inside a function."""
    graph = exercise_imports(ROOT / "minivllm" / "exercises")
    assert {"parts", "_common", "native", "live", "kernels", "progress"} <= set(graph)
    assert import_cycle(graph) is None, " -> ".join(import_cycle(graph))


def test_an_import_back_up_is_a_cycle(tmp_path):
    shutil.copytree(ROOT / "minivllm" / "exercises", tmp_path / "exercises",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "exercises" / "_common.py", "a") as f:  # the circle issue 66 broke: _common -> kernels
        f.write("\n\ndef loops(table):\n    from minivllm.exercises.kernels import LOOPS\n    return LOOPS\n")
    cycle = import_cycle(exercise_imports(tmp_path / "exercises"))
    assert cycle is not None and "_common" in cycle and "kernels" in cycle, cycle


@pytest.mark.parametrize("module", CORE)
def test_core_functions_are_short(module):
    tree = ast.parse((ROOT / "minivllm" / f"{module}.py").read_text())
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 40]
    assert not long, f"functions over 40 lines in minivllm/{module}.py: {long}"


class CountingBlockManager(MiniBlockManager):
    """A reader's block manager: minivllm's, counting its allocations."""

    allocations = 0

    def allocate(self, seq, num_tokens, cached_blocks=(), watermark=False):
        type(self).allocations += 1
        return super().allocate(seq, num_tokens, cached_blocks, watermark)


class CountingScheduler(MiniScheduler):
    """A reader's scheduler: minivllm's, counting its steps."""

    steps = 0

    def schedule(self):
        type(self).steps += 1
        return super().schedule()


def test_extension_points_plug_in_subclasses_with_the_same_tokens():
    workload = [(f"r{i}", [(31 * i + j) % 40000 + 1 for j in range(6 + 5 * i)], greedy(12, ignore_eos=True))
                for i in range(5)]
    options = dict(block_size=4, num_blocks=30, max_num_seqs=3, enable_prefix_caching=True, device="cpu")
    reference = run_engine(LLM("tiny-random", **options), workload)
    plugged = LLM("tiny-random", scheduler_cls=CountingScheduler, block_manager_cls=CountingBlockManager, **options)
    assert type(plugged.engine.scheduler) is CountingScheduler
    assert type(plugged.engine.block_manager) is CountingBlockManager
    assert run_engine(plugged, workload) == reference
    assert CountingScheduler.steps > 0 and CountingBlockManager.allocations > 0
    by_name = LLM("tiny-random", scheduler_cls="minivllm.scheduler.MiniScheduler", **options)
    assert run_engine(by_name, workload) == reference
