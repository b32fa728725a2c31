"""Model loading, the Llama-family forward (chapter 00) and its tensor-parallel shards (chapter 15).

The names below load on first use (:mod:`minivllm.lazy`): a process that needs only
:mod:`minivllm.models.gguf_file` (exercise 18's check child) does not import transformers.
"""

from minivllm.lazy import lazy_names

_WHERE = {  # name -> the module of minivllm.models that defines it
    "LlamaForCausalLM": "llama", "ParallelLlamaForCausalLM": "parallel", "TensorParallelGroup": "parallel",
    "SMOLLM2": "loader", "TINY_RANDOM": "loader", "TINY_RANDOM_8H": "loader", "load_config": "loader",
    "load_model": "loader", "load_model_shard": "loader", "load_tokenizer": "loader", "model_folder": "loader",
}
__all__ = ["LlamaForCausalLM", "ParallelLlamaForCausalLM", "TensorParallelGroup", "SMOLLM2", "TINY_RANDOM",
           "TINY_RANDOM_8H", "load_config", "load_model", "load_model_shard", "load_tokenizer", "model_folder"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__)
