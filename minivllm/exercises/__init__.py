"""The check functions of each chapter's exercise: the reader's function against minivllm's own.

Each check runs the reader's function on several small inputs, compares it
with minivllm's own implementation (the ``reference_*`` functions where the
reference is a wrapper around the engine), and raises ``AssertionError``
naming the input, the first place where the two differ and, for a known
mistake, a hint; it prints one line when all pass. One module per chapter;
this package re-exports every check, so notebooks write
``from minivllm.exercises import check_slot_mapping``.
"""

from minivllm.exercises.benchmarks import check_goodput, check_request_latencies, reference_request_latencies
from minivllm.exercises.block_manager import check_slot_mapping
from minivllm.exercises.chunked_prefill import check_plan_chunks, reference_plan_chunks
from minivllm.exercises.chunked_prefill_exact import check_chunk_mask
from minivllm.exercises.continuous_batching import check_schedule_step, reference_schedule_step
from minivllm.exercises.kv_cache_memory import check_kv_bytes_per_token, check_paged_waste
from minivllm.exercises.paged_attention import check_gather_kv, check_paged_decode_attention
from minivllm.exercises.preemption import check_choose_victim, reference_choose_victim
from minivllm.exercises.prefill_decode import check_cached_decode
from minivllm.exercises.prefix_caching import (check_block_hashes, check_cached_prefix_len, reference_block_hashes,
                                               reference_cached_prefix_len)
from minivllm.exercises.sampling_streaming import check_top_p_filter, reference_top_p

__all__ = [
    "check_cached_decode",  # 01 prefill and decode
    "check_chunk_mask",  # 02 chunked prefill is exact
    "check_kv_bytes_per_token", "check_paged_waste",  # 03 KV-cache memory
    "check_slot_mapping",  # 04 block manager
    "check_gather_kv", "check_paged_decode_attention",  # 05 paged attention
    "check_schedule_step", "reference_schedule_step",  # 06 continuous batching
    "check_top_p_filter", "reference_top_p",  # 07 sampling and streaming
    "check_block_hashes", "reference_block_hashes",  # 08 prefix caching
    "check_cached_prefix_len", "reference_cached_prefix_len",
    "check_plan_chunks", "reference_plan_chunks",  # 09 chunked prefill
    "check_choose_victim", "reference_choose_victim",  # 10 preemption
    "check_request_latencies", "reference_request_latencies", "check_goodput",  # 11 measuring an engine
]
