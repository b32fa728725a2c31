"""Seeded, named workloads: which requests arrive, when, and how many tokens each wants (chapters 06-11)."""

from __future__ import annotations

from dataclasses import dataclass


def random_workload(tokenizer, num_requests: int = 32, prompt_len: tuple[int, int] = (16, 256),
                    output_len: tuple[int, int] = (16, 64), seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """``num_requests`` prompts of random ordinary token ids and their output lengths, drawn with ``seed``.

    Lengths are uniform in the inclusive ranges; special tokens (EOS, chat
    markers) never appear in a prompt. Random ids, as vLLM's own throughput
    benchmark uses: the cost of a forward does not depend on what the tokens say.
    """
    import random

    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    low = max(special, default=-1) + 1
    vocab = len(tokenizer)
    prompts = [[rng.randrange(low, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(num_requests)]
    outputs = [rng.randint(*output_len) for _ in range(num_requests)]
    return prompts, outputs


@dataclass
class Arrival:
    """A request that joins the engine at step ``at_step``, and not before ``after_first_token_of`` has its first token.

    ``after_first_token_of`` builds a closed loop (a chat user who sends the next
    question once the previous answer starts); left ``None``, only the step counts.
    """

    request_id: str
    prompt: list[int] | str
    params: object  # SamplingParams
    at_step: int = 0
    after_first_token_of: str | None = None


def _exactly(n: int):
    from minivllm.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def interference_arrivals(tokenizer, num_streams: int = 8, stream_prompt_len: int = 16, stream_tokens: int = 64,
                          long_prompt_len: int = 1500, long_tokens: int = 16, arrive_at_step: int = 4,
                          seed: int = 0) -> list[Arrival]:
    """``num_streams`` short requests that stream ``stream_tokens`` tokens each, then one long prompt (chapter 09).

    The streams (``stream-0`` ...) all arrive at step 0; ``long`` arrives at
    step ``arrive_at_step``, while they are decoding. Greedy, ``ignore_eos``.
    """
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
    (system,), _ = random_workload(tokenizer, 1, (prefix_len, prefix_len), (1, 1), seed)
    suffixes, _ = random_workload(tokenizer, num_requests, tuple(suffix_len), (1, 1), seed + 1)
    return [Arrival(f"req-{i}", system + s, _exactly(output_tokens),
                    after_first_token_of=f"req-{i - 1}" if i else None) for i, s in enumerate(suffixes)]


def squeezed_arrivals(tokenizer, num_requests: int = 8, prompt_len=(24, 48), output_tokens: int = 32,
                      seed: int = 0) -> list[Arrival]:
    """``num_requests`` requests that all arrive at step 0, greedy, exactly ``output_tokens`` tokens each (chapter 10)."""
    prompts, _ = random_workload(tokenizer, num_requests, tuple(prompt_len), (1, 1), seed)
    return [Arrival(f"r{i}", p, _exactly(output_tokens)) for i, p in enumerate(prompts)]


def _blocks_for(arrivals: list[Arrival], block_size: int) -> int:
    return sum(-(-(len(a.prompt) + a.params.max_tokens) // block_size) for a in arrivals)
