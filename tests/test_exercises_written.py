"""A reader's part is the reader's own (issue 53): the class a notebook names holds no answer, an empty subclass or
one that inherits minivllm's own is "not written yet" in the check, in ``status`` and in the capstone, and every
check's targeted cases come first, without the live engine when ``live=False``."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.exercises._common import NOT_WRITTEN, complete, unwritten
from minivllm.exercises.progress import PARTS, WHAT_WIDTH, part_status

from test_exercises_progress import ROOT, run_status, write_parts

CLASS_PARTS = [p for p in PARTS if p.methods]
ENGINE_CLASSES = [p for p in CLASS_PARTS if p.impl is not None]


def _id(part) -> str:
    return f"{part.chapter}-{part.name}"


def _api(part) -> type:
    """The class the exercise notebook tells the reader to subclass (the implementation's direct base)."""
    return part.impl.__mro__[1]


@pytest.mark.parametrize("part", ENGINE_CLASSES, ids=_id)
def test_the_class_a_notebook_names_holds_no_answer(part):
    """Each method the exercise asks for only raises there; minivllm's implementation class defines every one."""
    api = _api(part)
    for name in part.methods:
        assert name in vars(api), f"{api.__name__} does not declare {name}"
        assert name in vars(part.impl), f"{part.impl.__name__} does not implement {name}"
        stub = vars(api)[name]
        with pytest.raises(NotImplementedError, match=f"^{NOT_WRITTEN}: {api.__name__}.{name}$"):
            stub(*[None] * len(inspect.signature(stub).parameters))
    assert unwritten(part.impl, part.methods) != [], "minivllm's own implementation counts as the reader's"


@pytest.mark.parametrize("part", CLASS_PARTS, ids=_id)
def test_an_empty_subclass_fails_its_check_as_not_written(part):
    """``class MyX(X): pass`` fails at once (live run or not), naming every method; so does a subclass of minivllm's
    own implementation, which inherits the answer."""
    bases = [(_api(part),), (part.impl,)] if part.impl else [(object,)]  # exercise 16's class has no base
    for base in bases:
        empty = type(part.name, base, {"__module__": "readers_notebook"})
        with pytest.raises(NotImplementedError) as err:
            part.check(empty)
        message = str(err.value)
        assert message.startswith(f"{NOT_WRITTEN}: ")
        for name in part.methods:
            assert f"{part.name}.{name}" in message, message
        if base[0] is part.impl:
            assert f"minivllm's own {part.impl.__name__}" in message and "write your own" in message


def test_the_handoff_that_inherits_minivllms_is_not_written():
    from minivllm.disaggregation.handoff import KVHandoff

    part = next(p for p in PARTS if p.chapter == "16")
    inherits = type("MyHandoff", (KVHandoff,), {"__module__": "readers_notebook"})
    with pytest.raises(NotImplementedError, match="MyHandoff.transfer .*minivllm's own KVHandoff.transfer"):
        part.check(inherits)


@pytest.mark.parametrize("part", CLASS_PARTS, ids=_id)
def test_status_reports_an_empty_subclass_as_not_written(part, tmp_path):
    api = _api(part) if part.impl else None
    base = f"{api.__module__}.{api.__name__}" if api else "object"
    module, _, name = base.rpartition(".")
    header = f"from {module} import {name}\n\n\n" if module else ""
    (tmp_path / f"{part.module}.py").write_text(f"{header}class {part.name}({name}):\n    pass\n")
    state, detail = part_status(part, tmp_path)
    assert state == "not written"
    assert detail == f"{NOT_WRITTEN}: " + ", ".join(f"{part.name}.{m}" for m in part.methods)


def test_super_never_hands_back_minivllms_answer(tmp_path):
    """A method that defers to ``super()`` is the reader's by name only: as loaded, super() reaches the stub, not
    MiniBlockManager's allocate, so the check fails on it; the methods of other exercises are minivllm's."""
    from minivllm.block_manager import MiniBlockManager
    from minivllm.exercises import check_block_manager, load_part
    from minivllm.sampling_params import SamplingParams
    from minivllm.sequence import Sequence

    (tmp_path / "block_manager.py").write_text(
        "from minivllm.block_manager import BlockManager\n\n\nclass MyBlockManager(BlockManager):\n"
        "    def allocate(self, seq, num_tokens, cached_blocks=(), watermark=False, restored=()):\n"
        "        return super().allocate(seq, num_tokens, cached_blocks, watermark, restored)\n\n"
        "    def free(self, seq):\n        return super().free(seq)\n\n"
        "    def slot_mapping(self, seq, start, end):\n        return super().slot_mapping(seq, start, end)\n")
    cls = load_part("block_manager", "MyBlockManager", tmp_path)
    assert cls.__name__ == "MyBlockManager" and issubclass(cls, MiniBlockManager)
    assert unwritten(cls, ("allocate", "free", "slot_mapping")) == []  # defined by the reader...
    with pytest.raises(NotImplementedError, match="not written yet: BlockManager.allocate"):
        check_block_manager(cls, live=False)  # ...but super() is the stub, not minivllm's answer
    bm = cls(4, 4)
    assert bm.take_free_block() == 0  # exercise 08's method: minivllm's own, behind the reader's class
    with pytest.raises(NotImplementedError, match="not written yet: BlockManager.allocate"):
        bm.allocate(Sequence("a", [1, 2], SamplingParams()), 2)
    assert complete(cls, ("allocate", "free", "slot_mapping"), MiniBlockManager) is cls  # once is enough


def test_an_empty_part_is_minivllms_in_the_capstone(tmp_path, monkeypatch, capsys):
    from minivllm.exercises.capstone import your_parts

    folder = tmp_path / "your_engine"
    folder.mkdir()
    (folder / "spec_decode.py").write_text("from minivllm.spec_decode import MiniSpecAcceptor\n\n\n"
                                           "class MySpecAcceptor(MiniSpecAcceptor):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    found = your_parts([p for p in PARTS if p.chapter == "17"])  # not even probed: nothing of it is the reader's
    assert found == {}
    part = next(p for p in PARTS if p.chapter == "17")
    assert f"17 {part.what:{WHAT_WIDTH}} minivllm's: yours is {NOT_WRITTEN}" in capsys.readouterr().out


def test_targeted_cases_alone_build_no_engine(tmp_path, monkeypatch):
    """``live=False``: every solution's part passes its check's targeted cases without building an engine."""
    from minivllm import engine

    def refused(*args, **kwargs):
        raise AssertionError("live=False built an engine")

    write_parts(ROOT / "solutions", tmp_path)
    monkeypatch.setattr(engine.LLMEngine, "__init__", refused)
    monkeypatch.setattr(engine.LLM, "__init__", refused)
    states = {f"{p.chapter} {p.name}": part_status(p, tmp_path / "your_engine") for p in PARTS}
    assert all(state == ("passes", "") for state in states.values()), states


def test_status_runs_the_live_engine_only_when_asked(tmp_path):
    write_parts(ROOT / "solutions", tmp_path)
    result = run_status(tmp_path, "--chapters", "03", "--live")
    assert result.returncode == 0 and "2 pass their checks (live runs included)" in result.stdout, result.stdout
    result = run_status(tmp_path, "--chapters", "03", "--no-live")
    assert result.returncode == 0 and "2 pass their checks (targeted cases)" in result.stdout, result.stdout
    help_text = subprocess.run([sys.executable, "-m", "minivllm.exercises", "status", "--help"],
                               capture_output=True, text=True, timeout=120, cwd=ROOT).stdout
    assert "--live" in help_text and "--no-live" in help_text


def test_the_capstones_print_the_readers_parts_and_the_speculation_counters():
    """The second capstone prints the acceptor's counters when the reader's acceptor is on (exercise 17)."""
    for name in ("your_engine.ipynb", "your_server.ipynb"):
        cells = json.loads((ROOT / "solutions" / name).read_text())["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        assert "speculation(stats)" in text and '"spec_acceptor_cls" in options' in text, name
    from minivllm.exercises.capstone import speculation
    from minivllm.outputs import EngineStats

    stats = EngineStats(0, 0, 0, 0, 0, 0, 0.0, 0, spec_decode_num_drafts=3, spec_decode_num_draft_tokens=12,
                        spec_decode_num_accepted_tokens=6, spec_decode_num_decode_steps=4,
                        spec_decode_num_emitted_tokens=10)
    assert speculation(stats) == "3 drafts, 6 of 12 draft tokens accepted (50%), 2.50 tokens per step"


def test_the_chapters_show_minivllms_answer_from_its_implementation_class():
    """The book prints minivllm's answer (after the link to the exercise) from the Mini class, where it lives."""
    import re

    shown = set()
    for path in sorted((ROOT / "book").glob("*.ipynb")):
        shown |= set(re.findall(r"getsource\((\w+)\.(\w+)\)", path.read_text()))
    for part in ENGINE_CLASSES:
        for name in part.methods:
            assert (_api(part).__name__, name) not in shown, f"the book shows {_api(part).__name__}.{name}, a stub"
    assert Path(ROOT / "book").is_dir()


@pytest.mark.parametrize("part", [p for p in ENGINE_CLASSES if p.extension], ids=_id)
def test_the_engine_refuses_an_interface_for_an_extension_point(part):
    """``EngineConfig(block_manager_cls=BlockManager)`` (or its dotted name, the default's before issue 53) names the
    field and the methods not written, before anything is built, instead of failing inside a step."""
    from minivllm.config import EngineConfig

    api = _api(part)
    for value in (api, f"{api.__module__}.{api.__name__}"):
        with pytest.raises(ValueError, match=rf"^{part.extension} must be .*\({NOT_WRITTEN}: .*{api.__name__}\."
                                             rf"{part.methods[0]}"):
            EngineConfig(model="tiny-random", **{part.extension: value})


def test_asyncllm_refuses_the_engine_loop_interface():
    from minivllm import LLMEngine
    from minivllm.serving import AsyncLLM, EngineLoop

    engine = LLMEngine(model="tiny-random", num_blocks=16, device="cpu")
    with pytest.raises(ValueError, match=rf"loop_cls must be .*\({NOT_WRITTEN}: EngineLoop.route"):
        AsyncLLM(engine, loop_cls=EngineLoop)
