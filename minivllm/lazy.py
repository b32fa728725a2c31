"""A package's public names loaded on first use (PEP 562): ``import minivllm`` and
``python -m minivllm.exercises status --no-checks`` load no torch until a name needs it."""

import importlib
import sys


def lazy_names(package: str, where: dict[str, str], public: list[str]):
    """``(__getattr__, __dir__)`` for ``package``: a name of ``where`` is imported from its submodule
    (``where[name]``) on first use, then kept; any other name is a submodule, if there is one."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str):
        if name in where:
            value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
            namespace[name] = value
            return value
        if not name.startswith("__"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(namespace) | set(public))

    return __getattr__, __dir__
