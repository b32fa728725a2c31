"""minivllm: a small, real LLM inference engine, built chapter by chapter."""

from minivllm import cpu_threads

cpu_threads.apply_defaults()  # before torch loads libgomp, which reads its spin count once (chapter 11)

from minivllm.config import EngineConfig, default_device
from minivllm.engine import LLM, LLMEngine
from minivllm.outputs import CompletionOutput, EngineStats, RequestOutput
from minivllm.models import load_model, load_tokenizer
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "EngineStats",
    "default_device", "load_model", "load_tokenizer",
]
