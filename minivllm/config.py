"""Engine configuration and the one place the device is chosen (all chapters)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_KV_BUDGET_BYTES = 4 << 30  # on the CPU the memory fraction applies to at most 4 GiB


def default_device() -> torch.device:
    """``cuda`` when a GPU is present, else ``cpu``: chosen once, used everywhere."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _check(ok: bool, field: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


@dataclass
class EngineConfig:
    """Everything that shapes the engine; validated on creation (every chapter adds a knob).

    The KV pool holds ``num_blocks`` blocks of ``block_size`` tokens. Left as
    ``None`` it is sized from ``kv_cache_memory_fraction`` of the device's free
    memory (of at most 4 GiB on the CPU), and never larger than
    ``max_num_seqs`` sequences of ``max_model_len`` tokens could use.

    Preemption (chapter 10): ``preemption_mode`` "recompute" frees a victim's
    blocks, "swap" copies them to a CPU pool of ``num_cpu_blocks`` blocks
    (default: as many as the device pool) and falls back to recompute when it
    is full. A request that was just resumed cannot be preempted again for
    ``preemption_protection_steps`` steps (0 turns the guard off). New requests
    are not admitted while fewer than ``admission_watermark`` of the blocks
    would stay free (unless nothing is running: an idle engine always admits). With ``scheduling_policy="priority"`` the waiting queue is
    ordered by priority (lower runs first), improved by ``priority_aging_rate``
    per step waited.
    """

    model: str = "smollm2-135m"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.3
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = False
    max_prefill_chunk_size: int = 512
    enable_prefix_caching: bool = False
    preemption_mode: str = "recompute"
    num_cpu_blocks: int | None = None
    admission_watermark: float = 0.0
    preemption_protection_steps: int = 4
    scheduling_policy: str = "fcfs"
    priority_aging_rate: float = 0.0
    device: str | None = None
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self):
        _check(isinstance(self.model, str) and self.model != "", "model", "a non-empty string", self.model)
        _check(is_int(self.block_size) and 1 <= self.block_size <= 1024, "block_size", "an integer in [1, 1024]", self.block_size)
        _check(self.num_blocks is None or (is_int(self.num_blocks) and self.num_blocks >= 1), "num_blocks", "None or an integer >= 1", self.num_blocks)
        _check(is_number(self.kv_cache_memory_fraction) and 0 < self.kv_cache_memory_fraction <= 1, "kv_cache_memory_fraction", "in (0, 1]", self.kv_cache_memory_fraction)
        _check(is_int(self.max_num_seqs) and self.max_num_seqs >= 1, "max_num_seqs", "an integer >= 1", self.max_num_seqs)
        _check(is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens", f"an integer >= max_num_seqs ({self.max_num_seqs})", self.max_num_batched_tokens)
        _check(self.max_model_len is None or (is_int(self.max_model_len) and self.max_model_len >= 2), "max_model_len", "None or an integer >= 2", self.max_model_len)
        _check(isinstance(self.enable_chunked_prefill, bool), "enable_chunked_prefill", "True or False", self.enable_chunked_prefill)
        _check(is_int(self.max_prefill_chunk_size) and self.max_prefill_chunk_size >= 1, "max_prefill_chunk_size", "an integer >= 1", self.max_prefill_chunk_size)
        _check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "True or False", self.enable_prefix_caching)
        _check(self.preemption_mode in PREEMPTION_MODES, "preemption_mode", f"one of {PREEMPTION_MODES}", self.preemption_mode)
        _check(self.num_cpu_blocks is None or (is_int(self.num_cpu_blocks) and self.num_cpu_blocks >= 0), "num_cpu_blocks", "None or an integer >= 0", self.num_cpu_blocks)
        _check(is_number(self.admission_watermark) and 0 <= self.admission_watermark < 1, "admission_watermark", "in [0, 1)", self.admission_watermark)
        _check(is_int(self.preemption_protection_steps) and self.preemption_protection_steps >= 0, "preemption_protection_steps", "an integer >= 0", self.preemption_protection_steps)
        _check(is_number(self.priority_aging_rate) and self.priority_aging_rate >= 0, "priority_aging_rate", "a number >= 0", self.priority_aging_rate)
        _check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy", f"one of {SCHEDULING_POLICIES}", self.scheduling_policy)
        _check(self.device is None or str(self.device).split(":")[0] in ("cpu", "cuda", "mps"), "device", "None, 'cpu', 'cuda' or 'mps'", self.device)
        _check(self.dtype in DTYPES, "dtype", f"one of {tuple(DTYPES)}", self.dtype)
        _check(is_int(self.seed), "seed", "an integer", self.seed)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device) if self.device else default_device()

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of the device: CUDA's own count, or MemAvailable on the CPU (capped at 4 GiB)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        avail = CPU_KV_BUDGET_BYTES
    return min(avail, CPU_KV_BUDGET_BYTES)


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
