"""Where the reader's engine stands: ``python -m minivllm.exercises status`` (every exercise, and the capstones).

For each part of :data:`~minivllm.exercises.parts.PARTS` (the one table of the parts the exercises have the
reader write), :func:`status` says whether it is written (its file exists, and each method its exercise asks for is the
reader's own: no ``raise NotImplementedError("not written yet: ...")`` left,
none inherited from minivllm) and whether its check's targeted cases pass
(the live engine too with ``live=True``), with the first line of the check's
message where they do not.
"""

from __future__ import annotations

import contextlib
import io
import signal
from pathlib import Path

from minivllm.exercises.parts import CHAPTER_WIDTH, CHAPTERS, PARTS, PARTS_DIR, WHAT_WIDTH, Part

__all__ = ["Part", "PARTS", "CHAPTERS", "WHAT_WIDTH", "CHAPTER_WIDTH", "part_status", "status"]


class CtrlC(KeyboardInterrupt):
    """Ctrl-C pressed while a part loads or is checked: it stops the command, as Ctrl-C does."""


@contextlib.contextmanager
def _ctrl_c_stops_the_command():
    """Ctrl-C raises :class:`CtrlC` meanwhile, so that a KeyboardInterrupt a part raises itself is told apart."""
    def pressed(signum, frame):
        raise CtrlC

    try:
        previous = signal.signal(signal.SIGINT, pressed)
    except ValueError:  # not the main thread, where Ctrl-C never lands
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stopped(e: BaseException) -> str:
    """How a part failed, for its line; a Ctrl-C the user pressed is not the part's: it goes on up."""
    if isinstance(e, CtrlC):
        raise KeyboardInterrupt from None
    return "" if isinstance(e, Exception) else " (a part must not stop the program)"


def part_status(part: Part, parts_dir: Path = PARTS_DIR, run_check: bool = True,
                live: bool = False) -> tuple[str, str]:
    """``(state, detail)``: state is "missing", "not written", "written" (``run_check`` False), "fails" or
    "passes" (the check's targeted cases; the live engine too with ``live``). Any way the part's code stops (an
    exception, ``sys.exit``, a KeyboardInterrupt it raises) is its failure; Ctrl-C still stops the command."""
    with _ctrl_c_stops_the_command():
        return _part_status(part, parts_dir, run_check, live)


def _part_status(part: Part, parts_dir: Path, run_check: bool, live: bool) -> tuple[str, str]:
    path = Path(parts_dir) / part.file
    if not path.exists():
        return "missing", f"{path} does not exist: run exercise {part.chapter}'s %%writefile cell"
    from minivllm.exercises._common import NOT_WRITTEN, unwritten  # torch and the engine: only for a file there
    from minivllm.exercises.live import load_part

    try:
        obj = load_part(part.module, part.name, parts_dir)
    except BaseException as e:  # a syntax error, a missing name, sys.exit: the reader's file, reported
        return "fails", f"{path} does not load: {type(e).__name__}: {e}{_stopped(e)}"
    left = unwritten(obj, part.methods)
    if left:
        return "not written", f"{NOT_WRITTEN}: {', '.join(left)}"
    if not run_check:
        return "written", ""
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the check's own success lines
            part.check(obj, live=live)
    except BaseException as e:  # AssertionError names the mistake; anything else is the reader's code failing
        message = (str(e).strip().split("\n")[0] or type(e).__name__) + _stopped(e)
        return "fails", message if isinstance(e, AssertionError) else f"{type(e).__name__}: {message}"
    return "passes", ""


def status(parts_dir: Path = PARTS_DIR, chapters: list[str] | None = None, run_checks: bool = True,
           out=print, live: bool = False) -> bool:
    """Print one line per part (chapters: only those); True when every part listed is written and passes its
    check's targeted cases (and, with ``live``, its live run)."""
    if chapters:
        from minivllm.config import check

        unknown = sorted(set(chapters) - set(CHAPTERS))
        check(not unknown, "chapters", f"among the exercises' chapters {', '.join(CHAPTERS)}", unknown)
    chosen = [p for p in PARTS if not chapters or p.chapter in chapters]
    states = []
    for part in chosen:
        state, detail = part_status(part, parts_dir, run_checks, live)
        states.append(state)
        out(f"{part.chapter:{CHAPTER_WIDTH}} {part.what:{WHAT_WIDTH}} {state:12} {detail}".rstrip())
    written = sum(s not in ("missing", "not written") for s in states)
    passing = states.count("passes")
    checked = f", {passing} pass their checks ({'live runs included' if live else 'targeted cases'})"
    out(f"{written} of {len(chosen)} parts written" + (checked if run_checks else "")
        + f" (your parts: {Path(parts_dir).resolve()})")
    return passing == len(chosen)
