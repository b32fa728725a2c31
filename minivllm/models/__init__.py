"""Model loading and the Llama-family forward (chapter 00)."""

from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.loader import SMOLLM2, TINY_RANDOM, load_model, load_tokenizer, model_folder

__all__ = ["LlamaForCausalLM", "SMOLLM2", "TINY_RANDOM", "load_model", "load_tokenizer", "model_folder"]
