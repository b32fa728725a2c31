"""An exercise notebook's kernel (every exercise): a part not written yet stops its cell with one line.

A check cell that meets a stub ends in ``NotImplementedError("not written yet: Class.method")``. IPython would
print the whole traceback, 20 to 30 lines through minivllm's checks with the paths of the machine that ran it,
on every rendered exercise page; the setup cell of each exercise calls :func:`one_line_for_unwritten_parts`, and
such an error is then shown as its one last line. The cell still fails (nbval and ``exercises/conftest.py`` see
the error and its message, and report the cell skipped), and every other error keeps its full traceback.
"""

from __future__ import annotations

from minivllm.config import NOT_WRITTEN

__all__ = ["one_line_for_unwritten_parts"]


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
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False
    shell.set_custom_exc((NotImplementedError,), _show)
    return True
