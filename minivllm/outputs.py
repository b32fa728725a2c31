"""What the engine hands back, with vLLM's names: ``RequestOutput``, ``CompletionOutput``, ``EngineStats`` (chapters 06, 07).

A ``RequestOutput`` is one request's state after a step: one
``CompletionOutput`` per sample, each with everything generated so far and
what this step added (``delta_text``, ``delta_token_ids``), which is what a
stream sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.sequence import RequestMetrics

__all__ = ["CompletionOutput", "RequestOutput", "EngineStats"]


@dataclass
class CompletionOutput:
    index: int
    text: str  # everything generated so far
    token_ids: list[int]
    delta_text: str = ""  # what this step added
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict] | None = None  # per output token, when SamplingParams.logprobs is set


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one per sample (n), by index
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # why a sample failed (finish_reason "error")
    retryable: bool = False  # the failure was the engine's (a worker died or its link broke), not the request's: the
    # same request may succeed if sent again (the server answers 503, not 500)


@dataclass
class EngineStats:
    num_running: int
    num_prefilling: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_recomputed_tokens: int = 0
    num_swapped_bytes: int = 0
    num_free_cpu_blocks: int = 0
    num_total_cpu_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache (vLLM's counter)
    prefix_cache_hits: int = 0  # of those, tokens found
    num_failed_requests: int = 0
    # The CPU offload tier of the prefix cache (chapter 14): blocks (and bytes) copied there at eviction, copied back
    # on a hit, and lost (dropped from the full tier, or not taken in); its entries and size.
    num_offloaded_blocks: int = 0
    num_offloaded_bytes: int = 0
    num_restored_blocks: int = 0
    num_restored_bytes: int = 0
    num_dropped_blocks: int = 0
    num_dropped_bytes: int = 0
    num_tier_blocks: int = 0
    num_total_tier_blocks: int = 0
    prefix_cache_tier_hits: int = 0  # of prefix_cache_hits, tokens restored from the tier (the rest: on the device)
    attention_kernel: str = "gather+sdpa"  # the KV pool's attention (chapters 12, 18): "paged_attention kernel" (the
    # kernel table's), or PyTorch's "gather+sdpa" or "varlen+block_table"
    kernels: str = "reference"  # the kernel table under the model (chapter 18): "cpu", "triton" or "reference"
    quantization: str | None = None  # "gguf": decode rows read the GGUF's blocks as stored (chapter 18)
    gguf_dot: str | None = None  # and how they meet them (EngineConfig.gguf_activations): "q8_1 avx2-maddubs" (8-bit
    # activations in integer dot products, the instructions the CPU's features chose at build), ..., or "float32"
    decode_path: str = "op-by-op"  # a few-row decode step (chapter 18): "fused-step" (every layer in one native call,
    # EngineConfig.fused_decode) or "op-by-op" (each op called from Python)
    cuda_graph_sizes: tuple = ()  # decode batch sizes captured as CUDA graphs (empty: eager, always on the CPU)
    # Speculative decoding (chapter 17), vLLM's counters: decode rows verified with drafts, draft tokens, accepted
    # ones (in all and per draft position); every decode row, and the tokens those rows emitted (accepted + bonus)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple = ()
    spec_decode_num_decode_steps: int = 0
    spec_decode_num_emitted_tokens: int = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def prefix_cache_device_hits(self) -> int:
        """Prefix-cache hit tokens found on the device (chapter 14 splits them from the tier's)."""
        return self.prefix_cache_hits - self.prefix_cache_tier_hits

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted draft tokens per draft token (0 before any draft)."""
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens \
            if self.spec_decode_num_draft_tokens else 0.0

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """vLLM's mean acceptance length: 1 (the bonus token) + accepted tokens per draft."""
        return 1 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts \
            if self.spec_decode_num_drafts else 1.0

    @property
    def spec_decode_mean_tokens_per_step(self) -> float:
        """Tokens a decoding sequence gained per step, drafted or not (1.0 without speculation)."""
        return self.spec_decode_num_emitted_tokens / self.spec_decode_num_decode_steps \
            if self.spec_decode_num_decode_steps else 1.0

    @property
    def kv_utilization(self) -> float:
        return self.num_used_blocks / self.num_total_blocks
