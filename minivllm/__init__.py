"""minivllm: a small, real LLM inference engine, built chapter by chapter.

The names below load on first use (``from minivllm import LLM`` imports the
engine, and torch, then): a command that needs none of them, such as
``python -m minivllm.exercises status --no-checks``, starts in a moment.
"""

import importlib

from minivllm import cpu_threads

cpu_threads.apply_defaults()  # before torch loads libgomp, which reads its spin count once (chapter 11)

__version__ = "0.1.0"
_WHERE = {  # name -> the module that defines it
    "EngineConfig": "config", "default_device": "config", "LLM": "engine", "LLMEngine": "engine",
    "CompletionOutput": "outputs", "EngineStats": "outputs", "RequestOutput": "outputs",
    "load_model": "models", "load_tokenizer": "models",
    "SamplingParams": "sampling_params", "StructuredOutputsParams": "sampling_params",
}
__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "EngineStats",
    "default_device", "load_model", "load_tokenizer",
]


def __getattr__(name: str):
    """A public name (imported from its module on first use, then kept), or a submodule (``minivllm.engine``)."""
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
