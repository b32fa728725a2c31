"""Model loading, the Llama-family forward (chapter 00) and its tensor-parallel shards (chapter 15)."""

from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.loader import (SMOLLM2, TINY_RANDOM, TINY_RANDOM_8H, load_config, load_model, load_model_shard,
                                    load_tokenizer, model_folder)
from minivllm.models.parallel import ParallelLlamaForCausalLM, TensorParallelGroup

__all__ = ["LlamaForCausalLM", "ParallelLlamaForCausalLM", "TensorParallelGroup", "SMOLLM2", "TINY_RANDOM",
           "TINY_RANDOM_8H", "load_config", "load_model", "load_model_shard", "load_tokenizer", "model_folder"]
