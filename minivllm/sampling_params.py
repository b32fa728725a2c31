"""How each request wants its tokens chosen and when it stops (chapter 07, sampling and streaming)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minivllm.config import check, is_int, is_number
from minivllm.structured_output import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a smaller temperature samples greedily
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_N = 128
MAX_SEED = 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1
# Bounds on what every token of every sample is checked against (vLLM has none; a request could send 300,000 stop
# strings in a 4 MiB body). Stop strings are matched by one automaton, so their number does not slow a token down,
# but building it takes time and memory in proportion to their total length.
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 8192  # in all
MAX_STOP_TOKEN_IDS = 128


@dataclass
class SamplingParams:
    """vLLM's names and meanings, validated on creation.

    ``temperature`` below ``1e-5`` (0 included) is greedy, as in vLLM: dividing
    float32 logits by a smaller one overflows. ``top_k`` of 0 or -1 and
    ``top_p == 1`` switch those filters off. ``n`` samples share the prompt's
    KV blocks. A ``seed`` gives the request its own random generator (sample
    ``i`` uses ``seed + i``), so its tokens do not depend on what else shares
    the batch. ``stop`` strings end the text before them (unless
    ``include_stop_str_in_output``); ``stop_token_ids`` and EOS (unless
    ``ignore_eos``) end it at a token. A request may have at most
    ``MAX_STOP_STRINGS`` stop strings, ``MAX_STOP_CHARS`` characters of them in
    all, and ``MAX_STOP_TOKEN_IDS`` stop token ids. ``logprobs`` asks for that many most
    likely tokens' log-probabilities (under the model's own distribution) at
    every step, beside the sampled token's (under a constraint, of the masked
    distribution: a token the grammar forbids has no probability, as in vLLM,
    whose bitmask is applied to the logits before its sampler computes them).
    ``structured_outputs`` (a :class:`StructuredOutputsParams`, chapter 19)
    constrains the output to a JSON schema, a regex, a choice or a grammar;
    it is checked when made, and compiled in the engine's grammar pool while
    the request waits (``WAITING_FOR_GRAMMAR``, the others running; at most
    ``structured_outputs_timeout_s``). A constrained sample ends when its grammar does (EOS where the
    grammar may end, ``ignore_eos`` or not); cut short by ``max_tokens`` its
    finish reason is "length".

    The engine keeps its own copy (:meth:`clone`) of the params it accepts, so
    changing this object afterwards changes nothing already queued.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        check(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"an integer in [1, {MAX_N}]", self.n)
        check(is_number(self.temperature) and self.temperature >= 0, "temperature", "a finite number >= 0",
              self.temperature)
        check(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        check(is_int(self.top_k) and -1 <= self.top_k <= MAX_TOKEN_ID, "top_k",
              "-1 or 0 (off) or an integer >= 1", self.top_k)
        check(self.seed is None or (is_int(self.seed) and 0 <= self.seed <= MAX_SEED), "seed",
              "None or an integer in [0, 2**63 - 1]", self.seed)
        check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        self.stop = _string_list(self.stop)
        self.stop_token_ids = _token_id_list(self.stop_token_ids)
        check(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output", "True or False",
              self.include_stop_str_in_output)
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "True or False", self.ignore_eos)
        check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
              f"None or an integer in [0, {MAX_LOGPROBS}]", self.logprobs)
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "None or a StructuredOutputsParams", self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def clone(self) -> SamplingParams:
        """A validated copy that shares no list with this one (the engine keeps one per request)."""
        return dataclasses.replace(self)

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of ``n``: one sample each, seeds ``seed + index``."""
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return dataclasses.replace(self, n=1, seed=seed)


def _string_list(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    _check_count(value, "stop", MAX_STOP_STRINGS, "strings")
    check(isinstance(value, (list, tuple)) and all(isinstance(s, str) and s for s in value), "stop",
          "None, a non-empty string or a list of non-empty strings", value)
    total = sum(map(len, value))
    if total > MAX_STOP_CHARS:
        raise ValueError(f"stop must hold at most {MAX_STOP_CHARS} characters in all, got {total}")
    return list(value)


def _token_id_list(value) -> list[int]:
    if value is None:
        return []
    _check_count(value, "stop_token_ids", MAX_STOP_TOKEN_IDS, "token ids")
    check(isinstance(value, (list, tuple)) and all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in value),
          "stop_token_ids", "None or a list of token ids >= 0", value)
    return list(value)


def _check_count(value, field: str, most: int, what: str) -> None:
    """A list longer than ``most`` is refused by its length (before anything looks at, or echoes, its items)."""
    if isinstance(value, (list, tuple)) and len(value) > most:
        raise ValueError(f"{field} must be at most {most} {what}, got {len(value)}")
