"""What a preemption costs, on paper and measured (chapter 10).

Recompute throws a victim's KV away and pays for it later in prefill compute;
swap keeps it, paying two copies over the host link. The course's reference
listing prices both with :func:`preemption_accounting`; the ``measure_*``
functions time the real operations on this machine.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from minivllm.attention import ContiguousKVCache


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
        raise ValueError("cached_tokens must be >= 0, block_size and kv_bytes_per_token >= 1, bandwidth > 0")
    swap_bytes = cached_tokens * kv_bytes_per_token
    return PreemptionCost(
        released_blocks=math.ceil(cached_tokens / block_size),
        recompute_tokens=cached_tokens,
        swap_bytes=swap_bytes,
        swap_roundtrip_ms=2 * swap_bytes / (cpu_bandwidth_gbps * 1e9) * 1e3,
    )


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_recompute_seconds_per_token(model, num_tokens: int = 256, repeats: int = 3) -> float:
    """Median time to prefill ``num_tokens`` tokens again, per token."""
    device = model.lm_head.weight.device
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    ids, pos = ids.to(device), torch.arange(num_tokens, device=device)
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        cache = ContiguousKVCache.for_model(model, num_tokens)
        _sync(device)
        t = time.perf_counter()
        model.forward(ids, pos, cache)
        _sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[len(times[1:]) // 2] / num_tokens


def measure_copy_gbps(nbytes: int = 64 << 20, device=None, pinned: bool = True, repeats: int = 5) -> dict:
    """Bandwidth of copying KV-sized buffers between the device pool and host memory, both ways.

    On a GPU it uses CUDA events (the GPU's own clock) and pinned or pageable
    host memory; on the CPU the "device" is host memory too, so this is a
    memcpy and ``pinned`` has no meaning.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    n = nbytes // 4
    src = torch.randn(n, device=device)
    host = torch.empty(n, pin_memory=pinned and device.type == "cuda")
    result = {}
    for name, (dst, source) in {"to_cpu": (host, src), "to_device": (src, host)}.items():
        times = []
        for _ in range(repeats + 1):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(source, non_blocking=True)
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                dst.copy_(source)
                times.append(time.perf_counter() - t)
        med = sorted(times[1:])[len(times[1:]) // 2]
        result[name] = nbytes / med / 1e9
    return result
