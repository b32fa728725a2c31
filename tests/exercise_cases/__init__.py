"""Each chapter's exercise check with the answers it must accept and the mistakes it must name.

One module per chapter (``test_chNN.py``) defines right answers (the solution
notebook's, and other shapes), the characteristic wrong answers and a
``CHECKS`` list of :class:`Check`; ``tests/test_exercises_checks.py`` runs the
whole table. Plain tests in these modules (a reference against the engine)
are collected by pytest as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Check:
    """One exercise check, the answers it must accept and the mistakes it must name."""

    chapter: str
    check: Callable
    right: list[Callable]
    wrong: dict[str, tuple[Callable, str | tuple[str, ...]]]  # mistake: (answer, hint pattern or patterns)
    passes: str = ""  # more of the success line than "check_x: "
    model_fixture: str | None = None  # a conftest fixture whose model the check gets as second argument
    kwargs: dict = field(default_factory=dict)  # passed to the check

    @property
    def name(self) -> str:
        return self.check.__name__.removeprefix("check_")

    def run(self, fn, request) -> None:
        extra = [request.getfixturevalue(self.model_fixture)[0]] if self.model_fixture else []
        self.check(fn, *extra, **self.kwargs)
