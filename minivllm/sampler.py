"""Turning logits into tokens, a batch at a time (chapter 07, sampling and streaming).

Greedy rows take the argmax. The others are scaled by temperature, filtered
by top-k and top-p, and drawn with the request's own generator when it has a
seed, so its tokens do not depend on what else is in the batch. Rows that ask
for ``logprobs`` also get the log-probabilities of the sampled token and of
the most likely ones, under the model's own distribution (before temperature
and filters, as vLLM reports them by default).

Speculative decoding (chapter 17) verifies a row's drafts with
:func:`verify_drafts`: greedy keeps drafts while they are the argmax; above
temperature 0 it is rejection sampling with the draft as a point mass
(Leviathan et al. 2023; vLLM's ``vllm/v1/sample/rejection_sampler.py`` with
no draft probabilities), which leaves the output distribution exactly that of
plain sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode import accept_greedy
from minivllm.structured_output import bitmask_words

__all__ = ["Logprob", "SamplerOutput", "Sampler", "MiniSampler", "apply_top_k_top_p", "apply_token_bitmask", "mask_logits", "sample",
           "top_logprobs", "verify_drafts", "GrammarMasker", "MiniGrammarMasker"]


@dataclass(frozen=True)
class Logprob:
    """vLLM's record of one candidate token: its log-probability and its rank (1 = most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)  # per row, when asked for
    num_accepted: list[int] = field(default_factory=list)  # per row, drafts kept before its token (chapter 17)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p remove, row by row; ``top_k <= 0`` and ``top_p == 1``
    keep all."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)
    remove = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each token
    remove |= before >= top_p[:, None]  # keep the smallest prefix whose mass reaches top_p
    remove[:, 0] = False  # the most likely token always survives
    filtered = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, filtered)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of ``rows`` whose token the row's bitmask forbids (chapter 19): the
    reference, in PyTorch. ``bitmask [len(logits), ceil(vocab / 32)]`` is int32 in xgrammar's layout: token ``t`` is
    bit ``t % 32`` (least significant first) of word ``t // 32``, set when allowed. vLLM applies it at the same
    place, before the sampler (``apply_grammar_bitmask`` in ``vllm/v1/structured_output/utils.py``)."""
    vocab = logits.shape[-1]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[index.to(bitmask.device)].unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """:func:`apply_token_bitmask`'s result, fast: xgrammar's C++ kernel for float32 and bfloat16 logits on the CPU
    (the call vLLM makes), the PyTorch reference elsewhere. The reference unpacks the whole vocabulary's bits
    and rewrites the row; the kernel writes -inf into each forbidden token's logit only, so its time follows
    their number (chapter 19 times it apart from the fill)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16):
        from xgrammar.kernels.apply_token_bitmask_inplace_cpu import apply_token_bitmask_inplace_cpu

        apply_token_bitmask_inplace_cpu(logits, bitmask, logits.shape[-1], rows)
    else:
        apply_token_bitmask(logits, bitmask, rows)


class GrammarMasker:
    """The grammars' masks on a step's logits, before anything samples from them (chapter 19; an extension point,
    ``EngineConfig(grammar_masker_cls=...)``, built by the model runner).

    The runner calls it with the step's logits and ``rows``: one
    ``(first, grammar, drafts)`` per constrained sample, ``first`` its
    logits row, ``grammar`` its matcher (a
    :class:`~minivllm.structured_output.Grammar`) and ``drafts`` its draft
    tokens (chapter 17; empty without speculation), whose ``len(drafts) + 1``
    positions are the logits rows ``first`` to ``first + len(drafts)``. Rows
    no sample constrains are never given. :meth:`__call__` makes the step's
    bitmask (every token allowed in every row), has :meth:`fill` write the
    constrained rows' and :meth:`apply` put them on the logits. The runner
    makes the same three calls itself, the first two on its fill thread while
    the forward runs (``EngineConfig.overlap_grammar_fill``). The interface:
    exercise 19 subclasses it and writes both; minivllm's own are
    :class:`MiniGrammarMasker`'s.
    """

    def __call__(self, logits: torch.Tensor, rows: list[tuple]) -> None:
        bitmask = self.new_bitmask(logits.shape[0], logits.shape[-1])
        index = self.fill(bitmask, rows)
        if index:
            self.apply(logits, bitmask, list(index))

    @staticmethod
    def new_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
        """``[num_rows, bitmask_words(vocab_size)]`` int32, every bit set (every token allowed), on the CPU, where
        the matchers write."""
        return torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)

    def fill(self, bitmask: torch.Tensor, rows: list[tuple]) -> list[int]:
        """Write each constrained position's allowed tokens into its row of ``bitmask``; return those rows.

        Position ``i`` of a sample (logits row ``first + i``) follows its
        first ``i`` drafts: advance the matcher through them
        (``grammar.accept``, False where the grammar refuses a draft: it did
        not advance, and the rows after it are left whole, since that draft
        is rejected at its own position), filling one row per position
        (``grammar.fill_bitmask(bitmask, row)``, not once terminated), then
        roll it back (``grammar.rollback``): its state afterwards is what it
        was, since only the tokens the scheduler appends advance it for good.
        """
        raise NotImplementedError("not written yet: GrammarMasker.fill")

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, index: list[int]) -> None:
        """Set to -inf, in place, the logits of rows ``index`` whose token that row of ``bitmask`` forbids, and
        leave every other logit exactly as it is. xgrammar's layout: token ``t`` is bit ``t % 32`` (least
        significant first) of 32-bit word ``t // 32``, set when allowed."""
        raise NotImplementedError("not written yet: GrammarMasker.apply")


class MiniGrammarMasker(GrammarMasker):
    """minivllm's own (the engine's default ``grammar_masker_cls``): advance, fill and roll back each matcher,
    then :func:`mask_logits` (xgrammar's C++ kernel on the CPU)."""

    def fill(self, bitmask: torch.Tensor, rows: list[tuple]) -> list[int]:
        index = []
        for first, grammar, drafts in rows:
            advanced = 0
            try:
                for i in range(len(drafts) + 1):
                    if advanced == i and not grammar.is_terminated():
                        grammar.fill_bitmask(bitmask, first + i)
                    index.append(first + i)
                    if i < len(drafts) and advanced == i and grammar.accept(drafts[i]):
                        advanced += 1
            finally:
                grammar.rollback(advanced)
        return index

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, index: list[int]) -> None:
        mask_logits(logits, bitmask, index)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> list[int]:
    """One token per row of ``logits [N, vocab]``."""
    # the argmax (first index on ties), about twice as fast as argmax on a CPU
    out = logits.max(dim=-1).indices
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        temp = torch.tensor(
            [params[i].temperature for i in rows], device=logits.device, dtype=logits.dtype
        )
        top_k = torch.tensor([params[i].top_k for i in rows], device=logits.device)
        top_p = torch.tensor(
            [params[i].top_p for i in rows], device=logits.device, dtype=logits.dtype
        )
        probs = apply_top_k_top_p(logits[idx] / temp[:, None], top_k, top_p).softmax(dim=-1)
        for j, i in enumerate(rows):
            g = generators[i] or default_generator
            out[i] = torch.multinomial(probs[j], 1, generator=g)[0]
    return out.tolist()


def verify_drafts(logits: torch.Tensor, draft: list[int], params: SamplingParams,
                  generator: torch.Generator | None, accept=accept_greedy) -> list[int]:
    """The tokens a row keeps from its ``draft``: ``logits [len(draft) + 1, vocab]`` are the target's after the
    sequence and each draft prefix. Returns the accepted drafts and one more token (1 to ``len(draft) + 1``).

    Greedy: ``accept`` (:func:`minivllm.spec_decode.accept_greedy`, or the
    engine's ``SpecAcceptor.accept``, chapter 17's extension point) on the argmaxes. Above
    temperature 0, with ``p`` the target's (filtered) distribution: draft
    ``x`` is accepted with probability ``p(x)`` (the draft is a point mass,
    ``q(x) = 1``); at the first rejection the token is drawn from the residual
    ``max(0, p - q)`` normalised, that is ``p`` without ``x``; if all are
    accepted the bonus token is drawn from the last row. Each token then has
    exactly the distribution plain sampling gives it.
    """
    if params.greedy:
        return accept(draft, logits.max(dim=-1).indices.tolist())
    rows, device = logits.shape[0], logits.device
    top_k = torch.full((rows,), params.top_k, device=device)
    top_p = torch.full((rows,), params.top_p, device=device, dtype=logits.dtype)
    probs = apply_top_k_top_p(logits / params.temperature, top_k, top_p).softmax(dim=-1)
    for i, x in enumerate(draft):
        if torch.rand(1, generator=generator, device=device)[0] < probs[i, x]:
            continue
        residual = probs[i].clone()
        residual[x] = 0.0  # p(x) < 1 here, so the rest has mass
        return draft[:i] + [int(torch.multinomial(residual, 1, generator=generator)[0])]
    return draft + [int(torch.multinomial(probs[-1], 1, generator=generator)[0])]


def top_logprobs(logits: torch.Tensor, token_id: int, k: int) -> dict[int, Logprob]:
    """The sampled token's log-probability and rank, and the ``k`` most likely tokens' (one row of logits).

    A token masked to -inf (a grammar forbids it, chapter 19) is no candidate: fewer than ``k`` may come back."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs[token_id]
    result = {token_id: Logprob(float(chosen), int((logprobs > chosen).sum()) + 1)}
    if k:
        values, ids = logprobs.topk(k)
        for rank, (value, tid) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            if value != float("-inf"):
                result.setdefault(tid, Logprob(value, rank))
    return result


class Sampler:
    """The engine's sampler: its interface and shared helper (an extension point: ``EngineConfig(sampler=...)``).

    ``Sampler(device, seed)`` owns the generator of requests without a seed;
    calling it with a step's logits rows, their params and their generators
    returns the tokens (and the logprobs asked for, :meth:`logprobs`).
    Exercise 07 subclasses it and writes ``__call__``; minivllm's own is
    :class:`MiniSampler`'s.
    """

    def __init__(self, device, seed: int = 0):
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SamplerOutput:
        """One token per row of ``logits [N, vocab]``: greedy rows the argmax; the others divided by their
        temperature, filtered by top-k then top-p, and drawn with ``generators[i]`` (``self.generator`` when it is
        None); with the logprobs asked for (:meth:`logprobs`). Exercise 07."""
        raise NotImplementedError("not written yet: Sampler.__call__")

    def logprobs(self, logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list:
        """Per row, the sampled and most likely tokens' logprobs when its params ask (``logprobs=k``), else None."""
        return [None if p.logprobs is None else top_logprobs(logits[i], tokens[i], p.logprobs)
                for i, p in enumerate(params)]


class MiniSampler(Sampler):
    """minivllm's own sampler (the engine's default ``sampler``): :func:`sample`, a batch at a
    time."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SamplerOutput:
        tokens = sample(logits, params, generators, self.generator)
        return SamplerOutput(tokens, self.logprobs(logits, tokens, params))
