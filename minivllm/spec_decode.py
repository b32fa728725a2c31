"""Speculative decoding's plan-side parts: the n-gram drafter, the greedy acceptance rule, the counters (chapter 17).

A decode step reads every weight to make one token. Prompt lookup guesses the
next ``k`` tokens from the sequence itself (the tokens that followed the
latest earlier occurrence of its last ``n`` tokens); the engine then verifies
the guesses in one forward over ``1 + k`` positions after the cached KV (a
prefill chunk, chapter 02), keeps the drafts up to the first one the model
disagrees with, and appends the model's own token after them: 1 to ``k + 1``
tokens a step, exactly the tokens plain decoding makes.

Where the rest lives: the scheduler asks :func:`propose_ngram` for a running
sequence's drafts and books their slots (``Scheduler.schedule_running``); the
model runner verifies them (``sampler.verify_drafts``: greedy through
:meth:`SpecAcceptor.accept`, rejection sampling above temperature 0); the
scheduler's ``update`` has :meth:`SpecAcceptor.commit` append what was
accepted and roll the rest back (``BlockManager.truncate``). Pure Python: no
tensors here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["propose_ngram", "accept_greedy", "backoff_steps", "MAX_BACKOFF_STEPS", "SpecAcceptor", "MiniSpecAcceptor",
           "SpecDecodingStats"]

MAX_BACKOFF_STEPS = 8  # the longest a sequence whose drafts keep failing waits before it is drafted again


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last ``n`` tokens, ``n`` from
    ``max_n`` down to ``min_n``; ``[]`` when no suffix of those lengths occurred before.

    vLLM (``vllm/v1/spec_decode/ngram_proposer.py``) finds the longest match
    with KMP and takes its earliest occurrence; the latest one is the one most
    like what is being written now (an edit in progress), and as easy to find.
    """
    total = len(token_ids)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix, last = token_ids[total - n:], token_ids[-1]
        for start in range(total - n - 1, -1, -1):  # every earlier occurrence, latest first
            if token_ids[start + n - 1] == last and token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []


def accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """Greedy verification: ``target[i]`` is the model's argmax after the sequence and ``draft[:i]``.

    Keep drafts while they equal the target's choice, then append the
    target's own token there (the bonus token): ``len(draft) + 1`` targets in,
    1 to ``len(draft) + 1`` tokens out.
    """
    assert len(target) == len(draft) + 1, "one target token per draft, and one after them"
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target[accepted]:
        accepted += 1
    return draft[:accepted] + [target[accepted]]


def backoff_steps(misses: int) -> int:
    """Steps a sequence is not drafted after ``misses`` drafts in a row had no token accepted (chapter 17).

    A rejected draft costs its verification positions and buys nothing, so
    speculation steps aside for a sequence whose text does not repeat itself:
    1, 2, 4, ... steps, at most :data:`MAX_BACKOFF_STEPS`; the next accepted
    draft resets it. A stream that never repeats is then drafted on at most
    about one step in eight, and one that starts repeating is drafted again
    within eight steps.
    """
    return 0 if misses <= 0 else min(2 ** (misses - 1), MAX_BACKOFF_STEPS)


class SpecAcceptor:
    """What a verified decode row keeps, and the rollback of the rest (chapter 17; an extension point,
    ``EngineConfig(spec_acceptor_cls=...)``, built by the scheduler with its block manager).

    The model runner calls :meth:`accept` for a greedy row; the scheduler's
    ``update`` calls :meth:`commit` for every verified row; the engine, which
    owns the text, calls :meth:`cut_at_stop` when a stop string ends inside
    the run. The interface: exercise 17 subclasses it and writes all four;
    minivllm's own are :class:`MiniSpecAcceptor`'s.
    """

    def __init__(self, block_manager):
        self.block_manager = block_manager

    def accept(self, draft: list[int], target: list[int]) -> list[int]:
        """Greedy acceptance: ``target[i]`` is the model's argmax after the sequence and ``draft[:i]``; the drafts
        up to the first mismatch, then the model's own token there (1 to ``len(draft) + 1`` tokens)."""
        raise NotImplementedError("not written yet: SpecAcceptor.accept")

    def commit(self, seq, tokens: list[int], append) -> None:
        """Append ``tokens`` (the accepted drafts, then the bonus token) to ``seq``, then roll back.

        ``append(token)`` appends one token, applies stop tokens, EOS and
        ``max_tokens``, and returns True when that ended the request (its
        blocks are then free). On entry ``seq.cached_token_count`` equals
        ``seq.num_tokens``: every token of the sequence has its KV in the
        pool, the last one's written by this very forward, which also wrote
        each draft's KV in the slots after it. Once a draft is appended, its
        KV is the sequence's: count it in ``seq.cached_token_count`` and
        register the block it fills (never before the token is appended: a
        block is cached under its tokens). The bonus token's KV is computed
        next step. Then roll back to ``seq.cached_token_count``.
        """
        raise NotImplementedError("not written yet: SpecAcceptor.commit")

    def rollback(self, seq, num_tokens: int) -> None:
        """Return ``seq``'s blocks past its first ``num_tokens`` tokens to the pool and cut them from its table."""
        raise NotImplementedError("not written yet: SpecAcceptor.rollback")

    def cut_at_stop(self, seq, new_tokens: list[int], i: int) -> list[int]:
        """A stop string ended at ``new_tokens[i]``, this step's ``i``-th new token: plain decoding stops there, so
        the tokens after it never happened. Returns the new tokens the request keeps."""
        raise NotImplementedError("not written yet: SpecAcceptor.cut_at_stop")


class MiniSpecAcceptor(SpecAcceptor):
    """minivllm's own (the engine's default ``spec_acceptor_cls``): :func:`accept_greedy`, the append of the kept
    tokens, ``BlockManager.truncate``."""

    def accept(self, draft: list[int], target: list[int]) -> list[int]:
        return accept_greedy(draft, target)

    def commit(self, seq, tokens: list[int], append) -> None:
        for i, token in enumerate(tokens):
            if append(token):
                return
            # an accepted draft: its KV is now the sequence's, its full block cacheable
            if i < len(tokens) - 1:
                seq.cached_token_count += 1
                self.block_manager.register_computed_blocks(seq)
        self.rollback(seq, seq.cached_token_count)

    def rollback(self, seq, num_tokens: int) -> None:
        self.block_manager.truncate(seq, num_tokens)

    def cut_at_stop(self, seq, new_tokens: list[int], i: int) -> list[int]:
        seq.drop_last_tokens(len(new_tokens) - i - 1)
        return new_tokens[:i + 1]


@dataclass
class SpecDecodingStats:
    """The engine's speculative-decoding counters (vLLM's ``SpecDecodingStats``, cumulative here).

    A draft is one decode row verified with at least one draft token;
    ``num_decode_steps`` and ``num_emitted_tokens`` count every decode row
    (drafted or not) and the tokens those rows appended, so
    ``num_emitted_tokens / num_decode_steps`` is the mean tokens a sequence
    gains per step.
    """

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_decode_steps: int = 0
    num_emitted_tokens: int = 0

    def __post_init__(self):
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def observe_decode(self, num_emitted_tokens: int) -> None:
        self.num_decode_steps += 1
        self.num_emitted_tokens += num_emitted_tokens
