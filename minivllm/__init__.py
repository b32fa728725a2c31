"""minivllm: a small, real LLM inference engine, built chapter by chapter.

The names below load on first use (``from minivllm import LLM`` imports the
engine, and torch, then): a command that needs none of them, such as
``python -m minivllm.exercises status --no-checks``, starts in a moment.
"""

from minivllm import cpu_threads
from minivllm.lazy import lazy_names

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


__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__)
