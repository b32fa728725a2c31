"""How each request wants its tokens chosen (chapter 07, sampling and streaming)."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.config import is_int, is_number


@dataclass
class SamplingParams:
    """vLLM's names. ``temperature == 0`` is greedy; ``top_k == -1`` and ``top_p == 1`` switch those filters off.

    A request with a ``seed`` gets its own random generator, so it samples the
    same tokens whatever else shares its batch.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if not (is_number(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not (is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1)):
            raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        p = self.top_p
        if not (is_number(p) and 0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not (is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.stop_token_ids is not None:
            if not all(is_int(i) and i >= 0 for i in self.stop_token_ids):
                raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
            self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be None or an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
