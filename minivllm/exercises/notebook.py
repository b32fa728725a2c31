"""An exercise notebook's kernel (every exercise): what the setup cell's :func:`set_up_exercise` changes in it.

- A part not written yet stops its cell with one line. A check cell that meets a stub ends in
  ``NotImplementedError("not written yet: Class.method")``; IPython would print the whole traceback, 20 to 30
  lines through minivllm's checks with the paths of the machine that ran it, on every rendered exercise page. The
  cell still fails (nbval and ``exercises/conftest.py`` see the error and its message, and report the cell
  skipped), and every other error keeps its full traceback.
- A stub never overwrites the reader's own part. A ``%%writefile`` cell that still holds more "not written yet"
  stubs than the file it would replace (a part the reader wrote in that file, or in this cell before it went
  back to the stub) keeps the file and says so; otherwise it writes, as IPython's ``%%writefile`` does.
"""

from __future__ import annotations

import os

from minivllm.config import NOT_WRITTEN

__all__ = ["set_up_exercise", "one_line_for_unwritten_parts", "keep_written_parts", "stubs_in"]


def _shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _show(shell, etype, value, tb, tb_offset=None):
    """IPython's custom exception handler: one line for a "not written yet", the usual traceback otherwise."""
    if str(value).startswith(NOT_WRITTEN):
        stb = [f"{etype.__name__}: {value}"]
    else:
        stb = shell.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
    shell._showtraceback(etype, value, stb)  # what IPython's showtraceback does with its stb: the error output
    return stb


def one_line_for_unwritten_parts() -> bool:
    """Show an unwritten part's ``NotImplementedError`` as one line in this IPython kernel; False outside IPython."""
    shell = _shell()
    if shell is None:
        return False
    shell.set_custom_exc((NotImplementedError,), _show)
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
