"""Helpers that the checks of several chapters share: reading the token ids a reader's function
returns, telling an int from a float or a bool, and whether a part is the reader's own.

A class exercise has the reader subclass the class its notebook names (``BlockManager``, ``Scheduler``, ...),
which holds the interface only: the methods the exercise asks for raise ``NotImplementedError("not written yet:
Class.method")`` there, and minivllm's own live in a subclass the notebook does not point to
(``MiniBlockManager``, ...). :func:`unwritten` says which of an exercise's methods are not the reader's own (still
a stub, or minivllm's, inherited); :func:`complete` puts minivllm's own behind the reader's class for the methods
*other* exercises write, so a part runs in the engine alone.
"""

from __future__ import annotations

import inspect
import numbers
import textwrap

import torch

from minivllm.config import NOT_WRITTEN, is_stub  # a stub raises NotImplementedError("not written yet: ...")

WIDTH = 100  # characters: what the book's column shows (tests/test_page_width.py)


def wrap(message: str) -> str:
    """``message`` in lines of at most WIDTH characters, the continuation lines indented."""
    return textwrap.fill(message, WIDTH, subsequent_indent="    ", break_long_words=False)


def say(message: str) -> None:
    """Print a check's message in lines of at most WIDTH characters, the continuation lines indented."""
    print(wrap(message))


def _as_id_list(value, what: str) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise AssertionError(f"{what}: expected a flat list of token ids, got a tensor of shape {tuple(value.shape)}")
        return [int(t) for t in value.tolist()]
    try:
        return [int(t) for t in value]
    except TypeError:
        raise AssertionError(f"{what}: expected a list of token ids, got {type(value).__name__}") from None


def _is_integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_minivllms(obj) -> bool:
    """Whether a class or function is minivllm's own (defined in the ``minivllm`` package)."""
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "minivllm"


def _owner(cls: type, name: str) -> type | None:
    """The class of ``cls``'s MRO whose ``name`` an instance runs (of the reader's own class, when :func:`complete`
    completed ``cls``)."""
    return next((k for k in vars(cls).get("_exercise_raw", cls).__mro__ if name in vars(k)), None)


def unwritten(part, methods: tuple[str, ...] = ()) -> list[str]:
    """What of a part is not the reader's own, each as ``Class.method`` (or the function's name).

    A class part: each of ``methods`` that ``part`` runs from a stub, or from
    minivllm (the class the notebook names declares it; minivllm's own
    implementation, inherited, is not the reader's either). A function part:
    itself, while it is the exercise's stub. A kernel table (exercise 18's C++
    build) or exercise 18b's ``BlockDot``: each function still ``MINIVLLM_NOT_WRITTEN``.
    """
    from minivllm.kernels.cpu import CpuKernels

    if isinstance(part, CpuKernels) or (not inspect.isclass(part) and not callable(part)
                                         and callable(getattr(part, "not_written", None))):  # a C++ part's build
        return part.not_written()
    if not inspect.isclass(part):
        return [part.__name__] if is_stub(part) else []
    left = []
    for name in methods:
        owner = _owner(part, name)
        label = f"{part.__name__}.{name}"
        if owner is None or is_stub(vars(owner)[name]):
            left.append(label)
        elif is_minivllms(owner):
            left.append(f"{label} (minivllm's own {owner.__name__}.{name}, inherited: write your own)")
    return left


def require_written(part, methods: tuple[str, ...] = ()) -> None:
    """Raise ``NotImplementedError("not written yet: Class.method, ...")`` unless the whole part is the reader's."""
    left = unwritten(part, methods)
    if left:
        raise NotImplementedError(f"{NOT_WRITTEN}: {', '.join(left)}")


def complete(cls: type, methods: tuple[str, ...], impl: type) -> type:
    """``cls`` as the engine runs it: minivllm's ``impl`` behind it for the methods other exercises write.

    The exercise's own ``methods`` never reach ``impl``: one ``cls`` does not
    define (or inherits from ``impl``) raises the stub, and so does
    ``super().method()``, which must not hand back minivllm's answer. The
    class keeps its name; it is ``cls`` itself when nothing is to add.
    """
    if getattr(cls, "_exercise_part", None) == (impl, tuple(methods)):
        return cls  # already completed
    api = impl.__mro__[1]  # the class the notebook names, whose methods are the stubs
    blanks = type(f"{api.__name__}Stubs", (), {"_exercise_blanks": True, **{m: vars(api)[m] for m in methods}})
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                 "_exercise_part": (impl, tuple(methods)), "_exercise_raw": cls}
    return type(cls.__name__, (cls, blanks, impl), namespace)


def own_part(cls, methods: tuple[str, ...], impl: type) -> type:
    """A class exercise's check starts here: ``cls`` completed (:func:`complete`) once every one of ``methods`` is
    the reader's own (:func:`require_written`), so an empty subclass fails at once with "not written yet"."""
    if not inspect.isclass(cls):
        raise AssertionError(f"expected a class (a subclass of {impl.__mro__[1].__name__}), got {cls!r}")
    require_written(cls, methods)
    return complete(cls, methods, impl)
