"""An exercise notebook's kernel (every exercise): what the setup cell's :func:`set_up_exercise` changes in it.

- A part not written yet stops its cell with its message alone. A cell that meets a stub ends in an error that
  says "not written yet": the stub's ``NotImplementedError("not written yet: Class.method")``, a check's
  ``AssertionError``, ``EngineConfig``'s ``ValueError`` for a class whose methods are stubs, or any error raised
  from one of those (its ``__cause__`` or ``__context__``). IPython would print the whole traceback, 35 to 70
  lines through minivllm with the paths of the machine that ran it, on every rendered exercise page; instead the
  cell shows ``Type: message`` in lines of at most 100 characters. The cell still fails (nbval and
  ``exercises/conftest.py`` see the error and its message, and report the cell skipped), and every other error
  keeps its full traceback.
- A stub never overwrites the reader's own part. A ``%%writefile`` cell that still holds more "not written yet"
  stubs than the file it would replace (a part the reader wrote in that file, or in this cell before it went
  back to the stub) keeps the file and says so; otherwise it writes, as IPython's ``%%writefile`` does.
"""

from __future__ import annotations

import os
import warnings

from minivllm.config import NOT_WRITTEN
from minivllm.exercises._common import wrap

__all__ = ["set_up_exercise", "one_line_for_unwritten_parts", "unwritten_part_message", "keep_written_parts",
           "stubs_in"]

TRIO_SKIPS_ITS_HANDLER = "IPython detected, but you already have a custom exception handler installed"


def _shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _chain(value: BaseException):
    """``value`` and the errors it was raised from or while handling (``__cause__``, ``__context__``), in order."""
    seen = []
    while value is not None and all(value is not e for e in seen):
        seen.append(value)
        value = value.__cause__ or (None if value.__suppress_context__ else value.__context__)
    return seen


def unwritten_part_message(value: BaseException) -> list[str] | None:
    """The lines a cell shows for an error that says a part is not written (itself or one it was raised from),
    each at most 100 characters; None for any other error."""
    chain = _chain(value)
    said = next((e for e in chain if NOT_WRITTEN in str(e)), None)
    if said is None:
        return None
    shown = [value] if said is value else [value, said]  # the error raised, and the stub's message under it
    lines = []
    for i, e in enumerate(shown):
        head = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        lines += [part for line in (head if i == 0 else f"  from {head}").split("\n")
                  for part in wrap(line).split("\n")]
    return lines


def _show(shell, etype, value, tb, tb_offset=None):
    """IPython's custom exception handler: an unwritten part's message alone, the usual traceback otherwise."""
    stb = unwritten_part_message(value)
    if stb is None:  # IPython's own display, unchanged (a UsageError's message, _render_traceback_, ...)
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        return None
    shell._showtraceback(etype, value, stb)  # what IPython's showtraceback does with its stb: the error output
    return stb


def one_line_for_unwritten_parts() -> bool:
    """Show an error that says a part is not written as its message alone in this IPython kernel (every other
    error as IPython does); False outside IPython."""
    shell = _shell()
    if shell is None:
        return False
    shell.set_custom_exc((Exception,), _show)
    # trio (imported by httpcore, under httpx, where it is installed) warns on stderr, on every exercise page, that a
    # custom handler is installed and skips its own (for its old MultiError; IPython shows exception groups itself):
    # that one message is silenced, every other warning still shows
    warnings.filterwarnings("ignore", message=TRIO_SKIPS_ITS_HANDLER, category=RuntimeWarning)
    return True


def stubs_in(text: str) -> int:
    """How many parts ``text`` still leaves to write: its "not written yet" stubs (Python's and C++'s)."""
    return text.count(NOT_WRITTEN)


def keep_written_parts() -> bool:
    """``%%writefile`` that never replaces a file by a cell with more stubs than it; False outside IPython."""
    shell = _shell()
    if shell is None:
        return False
    writefile = shell.find_cell_magic("writefile")
    writefile = getattr(writefile, "writes_stubs_over_nothing", writefile)  # set up twice: wrap IPython's once

    def guarded(line: str, cell: str):
        name = line.strip()
        path = os.path.expanduser(name[1:-1] if name[:1] in "'\"" and name[-1:] == name[:1] else name)
        if name and not name.startswith("-") and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                left = stubs_in(f.read())
            if stubs_in(cell) > left:
                print(f"Kept {path}: it has more of the part written than this cell ({left} stubs left there, "
                      f"{stubs_in(cell)} here). Delete it to start from this cell again.")
                return None
        return writefile(line, cell)

    guarded.writes_stubs_over_nothing = writefile
    shell.register_magic_function(guarded, magic_kind="cell", magic_name="writefile")
    return True


def set_up_exercise() -> bool:
    """Both of this module's changes to the exercise notebook's kernel (its setup cell); False outside IPython."""
    return one_line_for_unwritten_parts() and keep_written_parts()
