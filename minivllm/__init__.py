"""minivllm: a small, real LLM inference engine, built chapter by chapter."""

from minivllm.config import default_device
from minivllm.models import load_model, load_tokenizer

__version__ = "0.1.0"
__all__ = ["default_device", "load_model", "load_tokenizer"]
