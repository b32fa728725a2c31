"""The check functions of each chapter's exercise: the reader's part against minivllm's own.

Each check first asks whether the part is the reader's own: a class part's
methods must be defined by the reader's class (one still a stub, or inherited
from minivllm's own ``Mini...`` class, is ``NotImplementedError("not written
yet: Class.method")``). Then it runs the part (an engine part with minivllm's
interface, or a function) on small targeted inputs and raises
``AssertionError`` at the first failure, naming the input, the first place
where it differs from minivllm and, for a known mistake, a hint; then, unless
``live=False``, the part runs inside the live engine
(:mod:`minivllm.exercises.live`). It prints one line when all pass. One
module per chapter; this package re-exports every check, so notebooks write
``from minivllm.exercises import check_block_manager`` (each loads on first
use: ``python -m minivllm.exercises status --no-checks`` loads none).
"""

from minivllm.lazy import lazy_names

_WHERE = {  # name -> the module of minivllm.exercises that defines it
    "check_goodput": "benchmarks", "check_request_latencies": "benchmarks",
    "reference_request_latencies": "benchmarks", "check_block_manager": "block_manager",
    "check_slot_mapping": "block_manager", "check_chunked_prefill": "chunked_prefill",
    "check_chunked_causal": "chunked_prefill_exact", "check_scheduler": "continuous_batching",
    "check_kv_handoff": "disaggregation", "build_kernels": "kernels", "check_kernels": "kernels",
    "chat_prompts": "live", "check_live": "live", "drive": "live", "greedy": "live", "load_part": "live",
    "check_kv_bytes_per_token": "kv_cache_memory", "check_paged_waste": "kv_cache_memory",
    "check_offload_tier": "kv_offload", "check_paged_attention": "paged_attention",
    "check_preemption": "preemption", "check_generate_cached": "prefill_decode",
    "check_prefix_cache": "prefix_caching", "check_detokenizer": "sampling_streaming",
    "check_sampler": "sampling_streaming", "check_engine_loop": "serving", "check_spec_acceptor": "spec_decode",
    "check_grammar_masker": "structured_output", "build_block_dot": "native", "check_block_dot": "integer_dots",
    "check_merge_partials": "split_kv", "check_shard_weight": "tensor_parallel", "check_graph_runner": "where_time_goes",
}

__all__ = [
    "load_part", "check_live", "drive", "chat_prompts", "greedy",  # the live engine with the reader's parts
    "check_generate_cached",  # 01 prefill and decode
    "check_chunked_causal",  # 02 chunked prefill is exact
    "check_kv_bytes_per_token", "check_paged_waste",  # 03 KV-cache memory
    "check_block_manager", "check_slot_mapping",  # 04 block manager
    "check_paged_attention",  # 05 paged attention
    "check_scheduler",  # 06 continuous batching
    "check_sampler", "check_detokenizer",  # 07 sampling and streaming
    "check_prefix_cache",  # 08 prefix caching
    "check_chunked_prefill",  # 09 chunked prefill
    "check_preemption",  # 10 preemption
    "check_request_latencies", "reference_request_latencies", "check_goodput",  # 11 measuring an engine
    "check_graph_runner",  # 12 where the time goes
    "check_engine_loop",  # 13 serving
    "check_offload_tier",  # 14 KV offload
    "check_shard_weight",  # 15 tensor parallelism
    "check_kv_handoff",  # 16 prefill/decode disaggregation
    "check_spec_acceptor",  # 17 speculative decoding
    "build_kernels", "check_kernels",  # 18 kernels
    "build_block_dot", "check_block_dot",  # 18b integer dot products
    "check_merge_partials",  # 18c split-KV
    "check_grammar_masker",  # 19 structured outputs
]


__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__)
