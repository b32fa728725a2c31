"""Seeded, named workloads: which requests arrive, when, and how many tokens each wants (chapters 06-11)."""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass

from minivllm.config import cdiv, is_int, is_number
from minivllm.sampling_params import SamplingParams

__all__ = ["random_workload", "ordinary_token_ids", "Arrival", "interference_arrivals", "shared_prefix_arrivals", "squeezed_arrivals",
           "Workload", "poisson_times", "WORKLOADS", "WORKLOAD_PURPOSES", "make_workload", "check_workload_sizes"]


# -- Sizes are checked before anything is drawn: a clear ValueError naming the field and its range -------------

def _count(low: int):
    def check(field: str, value) -> None:
        if not (is_int(value) and value >= low):
            raise ValueError(f"{field} must be an integer >= {low}, got {value!r}")
    return check


def _length_range(field: str, value) -> None:
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(is_int(v) for v in value)
            and 1 <= value[0] <= value[1]):
        raise ValueError(f"{field} must be a (min, max) pair of integers with 1 <= min <= max, got {value!r}")


def _positive(field: str, value) -> None:
    if not (is_number(value) and value > 0):
        raise ValueError(f"{field} must be > 0 and finite, got {value!r}")


def _fraction(field: str, value) -> None:
    if not (is_number(value) and 0 < value <= 1):
        raise ValueError(f"{field} must be in (0, 1], got {value!r}")


def _integer(field: str, value) -> None:
    if not is_int(value):
        raise ValueError(f"{field} must be an integer, got {value!r}")


_SIZE_RULES = {  # every size any workload builder takes -> its check
    **dict.fromkeys(("num_requests", "num_streams", "prefix_len", "stream_prompt_len", "stream_tokens",
                     "long_prompt_len", "long_tokens", "output_tokens"), _count(1)),
    **dict.fromkeys(("num_long", "arrive_at_step"), _count(0)),
    **dict.fromkeys(("prompt_len", "output_len", "suffix_len"), _length_range),
    **dict.fromkeys(("rate", "long_every"), _positive),
    "pool_fraction": _fraction,
    "seed": _integer,
}


def _check(**sizes) -> None:
    for field, value in sizes.items():
        _SIZE_RULES[field](field, value)


def ordinary_token_ids(tokenizer) -> tuple[int, int]:
    """``[low, high)``: the token ids above every special and added token (EOS, chat markers), for random prompts."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return max(special, default=-1) + 1, len(tokenizer)


def random_workload(tokenizer, num_requests: int = 32, prompt_len: tuple[int, int] = (16, 256),
                    output_len: tuple[int, int] = (16, 64), seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """``num_requests`` prompts of random ordinary token ids and their output lengths, drawn with ``seed``.

    Lengths are uniform in the inclusive ranges; special tokens (EOS, chat
    markers) never appear in a prompt. Random ids, as vLLM's own throughput
    benchmark uses: the cost of a forward does not depend on what the tokens say.
    """
    _check(prompt_len=prompt_len, output_len=output_len, seed=seed)
    _count(0)("num_requests", num_requests)
    rng = random.Random(seed)
    low, vocab = ordinary_token_ids(tokenizer)
    prompts = [[rng.randrange(low, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(num_requests)]
    outputs = [rng.randint(*output_len) for _ in range(num_requests)]
    return prompts, outputs


@dataclass
class Arrival:
    """A request that joins the engine at step ``at_step``, and not before ``after_first_token_of`` has its first token.

    ``after_first_token_of`` builds a closed loop (a chat user who sends the next
    question once the previous answer starts); left ``None``, only the step counts.
    ``at_time`` (seconds after the replay starts) makes an open loop on the wall
    clock instead, as online serving sees it (chapter 11's Poisson arrivals);
    the request's arrival time is then that moment, so queueing counts in its TTFT.
    """

    request_id: str
    prompt: list[int] | str
    params: object  # SamplingParams
    at_step: int = 0
    after_first_token_of: str | None = None
    at_time: float | None = None


def _exactly(n: int):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def interference_arrivals(tokenizer, num_streams: int = 8, stream_prompt_len: int = 16, stream_tokens: int = 64,
                          long_prompt_len: int = 1500, long_tokens: int = 16, arrive_at_step: int = 4,
                          seed: int = 0) -> list[Arrival]:
    """``num_streams`` short requests that stream ``stream_tokens`` tokens each, then one long prompt (chapter 09).

    The streams (``stream-0`` ...) all arrive at step 0; ``long`` arrives at
    step ``arrive_at_step``, while they are decoding. Greedy, ``ignore_eos``.
    """
    _check(num_streams=num_streams, stream_prompt_len=stream_prompt_len, stream_tokens=stream_tokens,
           long_prompt_len=long_prompt_len, long_tokens=long_tokens, arrive_at_step=arrive_at_step, seed=seed)
    prompts, _ = random_workload(tokenizer, num_streams, (stream_prompt_len, stream_prompt_len), (1, 1), seed)
    (long_prompt,), _ = random_workload(tokenizer, 1, (long_prompt_len, long_prompt_len), (1, 1), seed + 1)
    arrivals = [Arrival(f"stream-{i}", p, _exactly(stream_tokens)) for i, p in enumerate(prompts)]
    return arrivals + [Arrival("long", long_prompt, _exactly(long_tokens), at_step=arrive_at_step)]


def shared_prefix_arrivals(tokenizer, num_requests: int = 16, prefix_len: int = 512, suffix_len=(16, 48),
                           output_tokens: int = 16, seed: int = 0) -> list[Arrival]:
    """``num_requests`` prompts that start with the same ``prefix_len``-token system prompt (chapter 08).

    Each request (``req-0`` ...) has its own suffix of ``suffix_len`` tokens and
    arrives once the previous one has its first token, as a chat user would: by
    then the prefix's KV is computed and, with prefix caching, can be reused.
    """
    _check(num_requests=num_requests, prefix_len=prefix_len, suffix_len=suffix_len, output_tokens=output_tokens,
           seed=seed)
    (system,), _ = random_workload(tokenizer, 1, (prefix_len, prefix_len), (1, 1), seed)
    suffixes, _ = random_workload(tokenizer, num_requests, tuple(suffix_len), (1, 1), seed + 1)
    return [Arrival(f"req-{i}", system + s, _exactly(output_tokens),
                    after_first_token_of=f"req-{i - 1}" if i else None) for i, s in enumerate(suffixes)]


def squeezed_arrivals(tokenizer, num_requests: int = 8, prompt_len=(24, 48), output_tokens: int = 32,
                      seed: int = 0) -> list[Arrival]:
    """``num_requests`` requests that all arrive at step 0, greedy, exactly ``output_tokens`` tokens each (chapter 10)."""
    _check(num_requests=num_requests, prompt_len=prompt_len, output_tokens=output_tokens, seed=seed)
    prompts, _ = random_workload(tokenizer, num_requests, tuple(prompt_len), (1, 1), seed)
    return [Arrival(f"r{i}", p, _exactly(output_tokens)) for i, p in enumerate(prompts)]


def _blocks_for(arrivals: list[Arrival], block_size: int) -> int:
    return sum(cdiv(len(a.prompt) + a.params.max_tokens, block_size) for a in arrivals)


# -- Named workloads for the harness (chapter 11) ------------------------------------------------------

@dataclass
class Workload:
    """A named, seeded workload: the requests and when they arrive, plus the KV pool it asks for.

    ``pool_fraction`` (memory pressure) sizes the KV pool to that share of
    what all requests would hold at once; None leaves the engine's own size.
    """

    name: str
    description: str
    arrivals: list[Arrival]
    pool_fraction: float | None = None

    @property
    def prompts(self) -> list[list[int]]:
        return [list(a.prompt) for a in self.arrivals]

    @property
    def max_tokens(self) -> list[int]:
        return [a.params.max_tokens for a in self.arrivals]

    @property
    def is_offline(self) -> bool:
        """Every request is there at the start: the only kind one-request-at-a-time baselines can run."""
        return all(a.at_step == 0 and a.after_first_token_of is None and not a.at_time for a in self.arrivals)

    def kv_blocks_needed(self, block_size: int) -> int:
        return _blocks_for(self.arrivals, block_size)

    def num_blocks(self, block_size: int) -> int | None:
        """The squeezed pool of a memory-pressure workload (never below its longest request), else None."""
        if self.pool_fraction is None:
            return None
        longest = max(cdiv(len(a.prompt) + a.params.max_tokens, block_size) for a in self.arrivals)
        return max(int(self.kv_blocks_needed(block_size) * self.pool_fraction), longest)


def poisson_times(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Send times of a Poisson process with ``rate`` requests per second: exponential gaps, first at 0."""
    _count(0)("num_requests", num_requests)
    _positive("rate", rate)
    _integer("seed", seed)
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _offline(tokenizer, num_requests=32, prompt_len=(16, 256), output_len=(64, 64), seed=0):
    prompts, outs = random_workload(tokenizer, num_requests, tuple(prompt_len), tuple(output_len), seed)
    return Workload("offline", f"{num_requests} requests at once, prompts {prompt_len[0]}-{prompt_len[1]} tokens, "
                    f"{output_len[0]}-{output_len[1]} output tokens",
                    [Arrival(f"req-{i}", p, _exactly(n)) for i, (p, n) in enumerate(zip(prompts, outs))])


def _online(tokenizer, num_requests=32, prompt_len=(16, 256), output_len=(16, 64), rate=4.0, seed=0):
    prompts, outs = random_workload(tokenizer, num_requests, tuple(prompt_len), tuple(output_len), seed)
    times = poisson_times(num_requests, rate, seed)
    return Workload("online", f"{num_requests} requests, Poisson arrivals at {rate:g}/s, prompts "
                    f"{prompt_len[0]}-{prompt_len[1]} tokens, {output_len[0]}-{output_len[1]} output tokens",
                    [Arrival(f"req-{i}", p, _exactly(n), at_time=t)
                     for i, (p, n, t) in enumerate(zip(prompts, outs, times))])


def _shared_prefix(tokenizer, num_requests=16, prefix_len=512, suffix_len=(16, 48), output_len=(16, 16),
                   rate=2.0, seed=0):
    (system,), _ = random_workload(tokenizer, 1, (prefix_len, prefix_len), (1, 1), seed)
    suffixes, outs = random_workload(tokenizer, num_requests, tuple(suffix_len), tuple(output_len), seed + 1)
    times = poisson_times(num_requests, rate, seed)
    return Workload("shared-prefix", f"{num_requests} requests sharing a {prefix_len}-token system prompt, own "
                    f"suffix {suffix_len[0]}-{suffix_len[1]} tokens, Poisson arrivals at {rate:g}/s",
                    [Arrival(f"req-{i}", system + s, _exactly(n), at_time=t)
                     for i, (s, n, t) in enumerate(zip(suffixes, outs, times))])


def _interference(tokenizer, num_streams=8, stream_prompt_len=16, stream_tokens=64, num_long=2,
                  long_prompt_len=1500, long_tokens=16, long_every=1.0, seed=0):
    streams, _ = random_workload(tokenizer, num_streams, (stream_prompt_len, stream_prompt_len), (1, 1), seed)
    longs, _ = random_workload(tokenizer, num_long, (long_prompt_len, long_prompt_len), (1, 1), seed + 1)
    return Workload("interference", f"{num_streams} streams of {stream_tokens} tokens; a {long_prompt_len}-token "
                    f"prompt every {long_every:g} s ({num_long} in all) while they decode",
                    [Arrival(f"stream-{i}", p, _exactly(stream_tokens)) for i, p in enumerate(streams)]
                    + [Arrival(f"long-{i}", p, _exactly(long_tokens), at_time=long_every * (i + 1))
                       for i, p in enumerate(longs)])


def _memory_pressure(tokenizer, num_requests=16, prompt_len=(64, 128), output_len=(64, 64), pool_fraction=0.3,
                     seed=0):
    w = _offline(tokenizer, num_requests, prompt_len, output_len, seed)
    return Workload("memory-pressure", w.description + f"; KV pool {pool_fraction:.0%} of what they need at once",
                    w.arrivals, pool_fraction)


WORKLOADS = {"offline": _offline, "online": _online, "shared-prefix": _shared_prefix,
             "interference": _interference, "memory-pressure": _memory_pressure}
WORKLOAD_PURPOSES = {  # what each workload measures: bench --help and the README list them
    "offline": "every request at once: throughput and latency against HF transformers (chapter 11)",
    "online": "Poisson arrivals at --rate per second: TTFT, TPOT and ITL under load (chapters 11, 13)",
    "shared-prefix": "one long system prompt shared by every request: what --prefix-caching saves (chapter 08)",
    "interference": "decode streams while long prompts arrive: what prefills do to ITL (chapter 09)",
    "memory-pressure": "the offline mix in a KV pool too small for it: preemption (chapter 10)",
}


def check_workload_sizes(name: str, **sizes) -> None:
    """Raise ValueError, naming the field and its allowed range, unless :func:`make_workload` would accept these.

    Needs no tokenizer, so a command line can check its flags before loading anything.
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {name!r}")
    takes = [p for p in inspect.signature(WORKLOADS[name]).parameters if p != "tokenizer"]
    for field in sizes:
        if field not in takes:
            raise ValueError(f"workload {name!r} has no size {field!r}; its sizes are {', '.join(takes)}")
    _check(**sizes)


def make_workload(name: str, tokenizer, seed: int = 0, **sizes) -> Workload:
    """The workload ``name`` (one of :data:`WORKLOADS`), drawn with ``seed``; ``sizes`` override its defaults.

    Defaults are chapter 11's CPU sizes (offline: 32 requests, prompts 16-256,
    64 output tokens); chapters pass smaller ones on a CPU and larger on a GPU.
    Bad sizes raise ValueError before anything is drawn.
    """
    check_workload_sizes(name, seed=seed, **sizes)
    return WORKLOADS[name](tokenizer, seed=seed, **sizes)
