"""Where minivllm's GGUF mode and llama.cpp's Q4_1 part, and why: ``python -m minivllm.bench margins`` (chapter 18).

With ``quantization="gguf"`` minivllm rounds a decode step's rows to 8 bits
only when the step has at most eight (``QUANTIZED_MAX_ROWS``); its prefill and
bigger steps, nearly all of the offline workload's 32 requests decoding
together, keep float32 activations. llama.cpp rounds every row. So the two
engines' greedy tokens part where a logit margin is smaller than what 8-bit
rounding moves a margin. This runs the offline workload through both (as
``python -m minivllm bench --workload offline --quantization gguf --compare
llamacpp-q4_1``), then takes each engine's logits at every output position up
to each request's first disagreement ``p`` (minivllm: one float32 forward of
the context, and its int8 path at batch 1; llama.cpp: ``llamacpp_logits.py``
on the same file) and asks of every first disagreement whether minivllm's
margin for its token ``a`` over llama.cpp's ``b`` is below the BOUND, the
largest difference between the two engines' top-1-minus-top-2 margins where
they agree (:func:`margin_report`, pure arithmetic).

Measured once (2026-12-07, a 2-core AMD EPYC with AVX2, beside other work,
load average about 3; llama-cpp-python 0.3.36): 13/32 requests identical,
1005 of 2048 leading tokens; every one of the 19 first disagreements had
minivllm's margin below the bound (0.45) and the median top-2 margin (3.95),
the largest 0.24. At 8 of them llama.cpp's own one-sequence logits prefer
minivllm's token (its batched run's pick moves with the batch too), and
minivllm's int8 path at batch 1 (the prompt prefilled in float32, where
llama.cpp rounds it too) prefers llama.cpp's at 7: near-ties in both engines.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass

from minivllm.bench.cli import nonneg_int, offline_env, positive_int
from minivllm.bench.peers import (PeerMissing, agreement_line, leading_agreement, peer_files, peer_settings,
                                  run_peer, run_peer_job)
from minivllm.bench.progress import Progress

__all__ = ["Parting", "MarginReport", "top2_gap", "margin_report", "agreement_summary", "margins_table",
           "our_rows", "their_rows", "margins_main"]

PEER = "llamacpp-q4_1"  # llama.cpp on the embedded Q4_1 file, as it is (bench.peers.COMPARE_PEERS)
Row = dict  # one logits row as {token id: logit}: at least its two largest, and every id asked for


def top2_gap(row: Row) -> float:
    """The row's largest logit minus its second largest."""
    if len(row) < 2:
        raise ValueError(f"row must hold at least 2 logits (its top 2), got {len(row)}")
    first, second = sorted(row.values(), reverse=True)[:2]
    return first - second


@dataclass(frozen=True)
class Parting:
    """A request's first disagreement: at output position ``position`` minivllm picked ``a``, llama.cpp ``b``;
    ``ours`` is minivllm's l[a] - l[b], ``theirs`` llama.cpp's l[b] - l[a] (each its own pick's lead)."""

    request: int
    position: int
    a: int
    b: int
    ours: float
    theirs: float
    ours_int8: float | None = None  # minivllm's int8 path's l[a] - l[b], where it was computed


@dataclass(frozen=True)
class MarginReport:
    """:func:`margin_report`'s figures: the bound, the median margin where the engines agree, each parting."""

    bound: float  # the largest |our top-2 gap - their top-2 gap| at a position where the engines agree
    median_gap: float  # the median of our top-2 gaps there
    agreeing: int  # how many such positions
    partings: list[Parting]

    def explained(self, p: Parting) -> bool:
        """Whether our margin at the parting is below the bound and below the median margin."""
        return p.ours < self.bound and p.ours < self.median_gap

    @property
    def num_explained(self) -> int:
        return sum(map(self.explained, self.partings))


def margin_report(ours: list[list[Row]], theirs: list[list[Row]], our_tokens: list[list[int]],
                  their_tokens: list[list[int]], ours_int8: list[list[Row]] | None = None) -> MarginReport:
    """The margins at each request's first disagreement against the bound from the positions where they agree.

    ``ours[r][j]`` and ``theirs[r][j]`` are the two engines' logits rows at
    output position ``j`` of request ``r`` (the context: prompt + the common
    output prefix), for every ``j`` up to the first disagreement ``p``
    (included) or, for a request whose outputs agree, every output position.
    Positions before ``p`` agree: the bound is the largest difference between
    the two engines' top-1-minus-top-2 margins there, over all requests. At
    ``p``, minivllm picked ``a``, llama.cpp ``b``; a parting's rows must hold
    both. ``ours_int8``, rows of minivllm's int8 path, adds its l[a] - l[b].
    """
    n = len(our_tokens)
    for name, value in (("theirs", theirs), ("their_tokens", their_tokens), ("ours", ours), ("ours_int8", ours_int8)):
        if value is not None and len(value) != n:
            raise ValueError(f"{name} must have one entry per request ({n}), got {len(value)}")
    lead = leading_agreement(our_tokens, their_tokens)
    gaps, moved, partings = [], [], []
    for r, (p, a_out, b_out) in enumerate(zip(lead, our_tokens, their_tokens)):
        parted = p < min(len(a_out), len(b_out))
        need = p + 1 if parted else p
        for name, rows in (("ours", ours[r]), ("theirs", theirs[r]), ("ours_int8", (ours_int8 or ours)[r])):
            if len(rows) < need:
                raise ValueError(f"{name}[{r}] must hold {need} rows (output positions 0 to "
                                 f"{need - 1}), got {len(rows)}")
        for j in range(p):
            gap = top2_gap(ours[r][j])
            gaps.append(gap)
            moved.append(abs(gap - top2_gap(theirs[r][j])))
        if parted:
            a, b = a_out[p], b_out[p]
            ours_ab, theirs_ab = (_pair(rows[p], a, b, f"{name}[{r}][{p}]")
                                  for name, rows in (("ours", ours[r]), ("theirs", theirs[r])))
            int8 = None if ours_int8 is None else _pair(ours_int8[r][p], a, b, f"ours_int8[{r}][{p}]")
            partings.append(Parting(r, p, a, b, ours_ab, -theirs_ab, int8))
    bound = max(moved, default=math.nan)
    median = statistics.median(gaps) if gaps else math.nan
    return MarginReport(bound, median, len(gaps), partings)


def _pair(row: Row, a: int, b: int, name: str) -> float:
    """l[a] - l[b] of ``row``."""
    missing = [t for t in (a, b) if t not in row]
    if missing:
        raise ValueError(f"{name} must hold the logits of tokens {a} and {b}, lacks {missing}")
    return row[a] - row[b]


def agreement_summary(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """:func:`~minivllm.bench.peers.agreement_line`, then on a line of its own the leading identical tokens in
    all, of all the outputs."""
    return (f"{agreement_line(ours, theirs)}\nleading identical tokens in all: "
            f"{sum(leading_agreement(ours, theirs))} of {sum(map(len, ours))}")


def margins_table(report: MarginReport) -> str:
    """Each parting on a line (within 100 characters), then the bound, the median and the verdict."""
    lines = [f"{'req':>4} {'pos':>4} {'ours a':>7} {'theirs b':>8} {'ours l[a]-l[b]':>14} "
             f"{'theirs l[b]-l[a]':>16} {'int8 l[a]-l[b]':>14}  below bound and median"]
    for p in report.partings:
        int8 = "-" if p.ours_int8 is None else f"{p.ours_int8:.4f}"
        lines.append(f"{p.request:>4} {p.position:>4} {p.a:>7} {p.b:>8} {p.ours:>14.4f} {p.theirs:>16.4f} "
                     f"{int8:>14}  {'yes' if report.explained(p) else 'NO'}")
    lines.append(f"bound (largest difference of the engines' top-2 margins where they agree, "
                 f"{report.agreeing} positions): {report.bound:.4f}")
    lines.append(f"median top-2 margin there (ours): {report.median_gap:.4f}")
    lines.append(f"first disagreements with our margin below the bound and the median: "
                 f"{report.num_explained} of {len(report.partings)}")
    int8 = [p for p in report.partings if p.ours_int8 is not None]
    if int8:
        lines.append(f"minivllm's int8 path at batch 1 prefers llama.cpp's token there: "
                     f"{sum(p.ours_int8 < 0 for p in int8)} of {len(int8)}")
    return "\n".join(lines)


# -- The rows: minivllm's logits (float32 forward, int8 path) and llama.cpp's (its driver) ------------------

def _row(logits, top_k: int, ids) -> Row:
    """A row of the full logits as {id: logit}: the ``top_k`` largest and ``ids``."""
    values, top = logits.topk(top_k)
    row = {int(i): float(v) for i, v in zip(top, values)}
    return row | {int(i): float(logits[i]) for i in ids}


def _positions(prompts, ours, theirs):
    """Per request: the context (prompt + the common output prefix up to the last row's) and the number of
    output positions whose rows are wanted, with the ids each row must hold (a parting's a and b)."""
    out = []
    for prompt, a, b, p in zip(prompts, ours, theirs, leading_agreement(ours, theirs)):
        parted = p < min(len(a), len(b))
        n = p + 1 if parted else p
        out.append((list(prompt) + list(a[:max(n - 1, 0)]), n, {n - 1: [a[p], b[p]]} if parted else {}))
    return out


def our_rows(prompts, ours, theirs, top_k: int = 5, int8: bool = True, progress: bool = False):
    """minivllm's rows at every output position up to each first disagreement (:func:`margin_report`'s
    ``ours``; with ``int8``, also ``ours_int8``). float32: the plain model, one forward of the context.
    int8: the GGUF's blocks with 8-bit activations as at batch 1: the prompt prefilled (float32 above eight
    rows), its last row's logits, then the output tokens eight at a time (every linear on 8-bit rows)."""
    import torch

    from minivllm.attention import ContiguousKVCache
    from minivllm.models import load_model
    from minivllm.models.linear import QUANTIZED_MAX_ROWS

    plain, _ = load_model("smollm2-135m", "cpu", torch.float32)
    gguf = load_model("smollm2-135m", "cpu", torch.float32, quantization="gguf")[0] if int8 else None
    f32, q8 = [], []
    with torch.inference_mode(), Progress("minivllm logits", len(prompts), unit="requests", enabled=progress) as bar:
        for prompt, (context, n, ids) in zip(prompts, _positions(prompts, ours, theirs)):
            start = len(prompt) - 1
            logits = plain.logits(context)[start:start + n]
            f32.append([_row(logits[j], top_k, ids.get(j, ())) for j in range(n)])
            if gguf is not None:
                q8.append([_row(r, top_k, ids.get(j, ())) for j, r in enumerate(_int8_logits(
                    gguf, context, len(prompt), n, QUANTIZED_MAX_ROWS, ContiguousKVCache))])
            bar.update(1)
    return f32, (q8 if int8 else None)


def _int8_logits(model, context, prompt_len, n, rows, cache_cls):
    """The logits at the ``n`` output positions of ``context`` through ``model``'s few-row path: the prompt
    whole, then ``rows`` tokens at a time."""
    import torch

    ids = torch.tensor(context)
    cache = cache_cls.for_model(model, len(context))
    hidden = model.forward(ids[:prompt_len], torch.arange(prompt_len), cache)
    out = [model.compute_logits(hidden[-1:])]
    for a in range(prompt_len, len(context), rows):
        b = min(a + rows, len(context))
        out.append(model.compute_logits(model.forward(ids[a:b], torch.arange(a, b), cache)))
    return torch.cat(out)[:n]


def their_rows(prompts, ours, theirs, workload, top_k: int = 5, progress: bool = False):
    """llama.cpp's rows (:func:`margin_report`'s ``theirs``) from ``llamacpp_logits.py``: each context
    evaluated alone on the Q4_1 file, with the offline driver's settings."""
    wanted = _positions(prompts, ours, theirs)
    settings, env = peer_settings(PEER, workload)
    job = {"model": str(peer_files(PEER)), "settings": settings, "top_k": top_k,
           "sequences": [{"tokens": context, "rows": [[len(p) - 1 + j, ids.get(j, [])] for j in range(n)]}
                         for p, (context, n, ids) in zip(prompts, wanted)]}
    bar = Progress(f"{PEER} logits", sum(n for _, n, _ in wanted), unit="rows", enabled=progress)
    out = run_peer_job(PEER, "llamacpp_logits.py", job, env, bar=bar)
    return [[{i: v for i, v in row["top"] + row["at"]} for row in seq] for seq in out["rows"]], out["version"]


# -- python -m minivllm.bench margins -------------------------------------------------------------------------

def _top_k(text: str) -> int:
    """``--top-k``: 2 (a row's top 2 give its margin) to 100 logits kept per row."""
    if not text.strip().isdigit() or not 2 <= int(text) <= 100:
        raise argparse.ArgumentTypeError(f"must be an integer in [2, 100], got {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minivllm.bench margins", description=margins_main.__doc__)
    parser.add_argument("--num-requests", type=positive_int, default=32)
    parser.add_argument("--seed", type=nonneg_int, default=0)
    parser.add_argument("--top-k", type=_top_k, default=5, help="logits kept per row besides a and b")
    parser.add_argument("--no-int8", action="store_true", help="skip minivllm's int8 path's rows")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def margins_main(argv=None) -> int:
    """The offline workload through minivllm (quantization="gguf", 8-bit activations) and llama.cpp on the same
    Q4_1 file: their greedy agreement, and at each first disagreement both engines' margins against the bound
    (how far 8-bit rounding moves a margin where they agree). Skipped, with a line, where llama.cpp is not
    installed."""
    offline_env()
    args = _parser().parse_args(argv)
    try:
        peer_files(PEER)
    except PeerMissing as e:
        print(e)
        return 0

    from minivllm.bench.harness import run_engine
    from minivllm.bench.workloads import make_workload
    from minivllm.models import load_tokenizer

    workload = make_workload("offline", load_tokenizer("smollm2-135m"), seed=args.seed,
                             num_requests=args.num_requests)
    print(f"workload offline: {workload.description}, seed {args.seed}")
    ours = run_engine(workload, "smollm2-135m", progress=not args.quiet, quantization="gguf", block_size=16,
                      max_num_batched_tokens=2048, enable_prefix_caching=False, device="cpu",
                      dtype="float32").token_ids
    run = run_peer(PEER, workload, tpot_tokens=1, repeats=1, progress=not args.quiet)
    theirs = run.result.token_ids
    print(f"minivllm (quantization=gguf, int8) against {run.result.name} ({run.version}), greedy:")
    print(agreement_summary(ours, theirs))
    prompts = workload.prompts
    f32, int8 = our_rows(prompts, ours, theirs, args.top_k, not args.no_int8, progress=not args.quiet)
    rows, _ = their_rows(prompts, ours, theirs, workload, args.top_k, progress=not args.quiet)
    print("ours: minivllm's float32 forward of the context; int8: its 8-bit path at batch 1;\n"
          "theirs: llama.cpp's one sequence at a time")
    print(margins_table(margin_report(f32, rows, ours, theirs, int8)))
    if int8 is not None:  # the same arithmetic on both sides: how far apart their margins are then
        same = margin_report(int8, rows, ours, theirs)
        print(f"the same bound with minivllm's int8 path in place of its float32 forward: {same.bound:.4f}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(margins_main())
