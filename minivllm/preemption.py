"""What a preemption costs, on paper (chapter 10).

Recompute throws a victim's KV away and pays for it later in prefill compute;
swap keeps it, paying two copies over the host link. The course's reference
listing prices both with :func:`preemption_accounting`, a formula;
``minivllm.bench``'s ``measure_*`` functions time the real operations.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from minivllm.config import cdiv


@dataclass(frozen=True)
class PreemptionCost:
    released_blocks: int  # device blocks freed by preempting
    recompute_tokens: int  # tokens to prefill again under recompute
    swap_bytes: int  # KV bytes copied each way under swap
    swap_roundtrip_ms: float  # out and back in at the given bandwidth

    def __getitem__(self, key):  # also readable as a mapping, like the reference listing's dict
        return asdict(self)[key]


def preemption_accounting(cached_tokens: int, block_size: int, kv_bytes_per_token: int,
                          cpu_bandwidth_gbps: float) -> PreemptionCost:
    """Price preempting a sequence with ``cached_tokens`` tokens of KV.

    >>> preemption_accounting(7, 4, 512 * 1024, 24).released_blocks
    2
    """
    if cached_tokens < 0 or block_size < 1 or kv_bytes_per_token < 1 or not cpu_bandwidth_gbps > 0:
        raise ValueError(
            "cached_tokens must be >= 0, block_size and kv_bytes_per_token >= 1, bandwidth > 0"
        )
    swap_bytes = cached_tokens * kv_bytes_per_token
    return PreemptionCost(
        released_blocks=cdiv(cached_tokens, block_size),
        recompute_tokens=cached_tokens,
        swap_bytes=swap_bytes,
        swap_roundtrip_ms=2 * swap_bytes / (cpu_bandwidth_gbps * 1e9) * 1e3,
    )
