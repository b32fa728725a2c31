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
``from minivllm.exercises import check_block_manager``.
"""

from minivllm.exercises.benchmarks import check_goodput, check_request_latencies, reference_request_latencies
from minivllm.exercises.block_manager import check_block_manager, check_slot_mapping
from minivllm.exercises.chunked_prefill import check_chunked_prefill
from minivllm.exercises.chunked_prefill_exact import check_chunked_causal
from minivllm.exercises.continuous_batching import check_scheduler
from minivllm.exercises.disaggregation import check_kv_handoff
from minivllm.exercises.kernels import build_kernels, check_kernels
from minivllm.exercises.live import chat_prompts, check_live, drive, greedy, load_part
from minivllm.exercises.kv_cache_memory import check_kv_bytes_per_token, check_paged_waste
from minivllm.exercises.kv_offload import check_offload_tier
from minivllm.exercises.paged_attention import check_paged_attention
from minivllm.exercises.preemption import check_preemption
from minivllm.exercises.prefill_decode import check_generate_cached
from minivllm.exercises.prefix_caching import check_prefix_cache
from minivllm.exercises.sampling_streaming import check_detokenizer, check_sampler
from minivllm.exercises.serving import check_engine_loop
from minivllm.exercises.spec_decode import check_spec_acceptor
from minivllm.exercises.structured_output import check_grammar_masker
from minivllm.exercises.tensor_parallel import check_shard_weight
from minivllm.exercises.where_time_goes import check_graph_runner

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
    "check_grammar_masker",  # 19 structured outputs
]
