"""Speculative decoding on and off: ``python -m minivllm bench --workload speculative`` (chapter 17).

Two workloads of chat prompts: "repetitive", where the answer copies spans of
the prompt (fix the typo in a paragraph of four sentences, about 80 tokens,
and write it out again: prompt lookup drafts it), and "open", short questions
whose answers the prompt does not contain.
Each runs at every batch size (all requests at once), speculation off and on
in alternation, on fresh warmed-up engines; greedy, exact output lengths.
Reported: median TPOT, output tokens/s, the acceptance rate and the tokens a
sequence gains per step, and whether the outputs are identical.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from minivllm import LLM, SamplingParams
from minivllm.bench.cli import bench_parser, offline_env, positive_int
from minivllm.bench.metrics import tpot
from minivllm.bench.trace import warm_up
from minivllm.config import default_device
from minivllm.models import load_tokenizer

__all__ = ["speculative_prompts", "run_speculative", "speculative_main"]

SENTENCES = ["The quick brown fox jumps over the lazy dog while the old cat sleeps in the warm sun.",
             "Our train leaves the station at seven and reaches the coast just before lunch.",
             "Please bring two notebooks, a pencil and your library card to the first lesson.",
             "The garden behind the house is full of roses, tomatoes and tall green beans.",
             "My sister plays the violin in a small orchestra that meets every Thursday evening.",
             "The museum closes early on Sundays, so we should arrive before three o'clock.",
             "He painted the kitchen door bright yellow and hung a small mirror next to it.",
             "A cold wind blew across the lake and the boats rocked gently at the pier."]
TOPICS = ["the sea", "prime numbers", "a cat", "Paris", "the moon landing", "sourdough bread", "chess openings",
          "volcanoes", "jazz", "GPUs", "photosynthesis", "the Roman empire", "origami", "black holes", "rust", "tea"]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _typo(sentence: str, rng: random.Random) -> str:
    """The sentence with two neighbouring letters of one longer word swapped."""
    words = sentence.split()
    i = rng.choice([j for j, w in enumerate(words) if len(w) > 4])
    w = words[i]
    k = rng.randrange(1, len(w) - 2)
    words[i] = w[:k] + w[k + 1] + w[k] + w[k + 2:]
    return " ".join(words)


def speculative_prompts(tokenizer, kind: str, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` chat prompts: "repetitive" (fix the typo and write the paragraph out again) or "open" (a question)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if kind == "repetitive":  # a paragraph, not a sentence: the copy is longer than the reply's preamble
            paragraph = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(4))
            body = "Fix the typo in this paragraph and write the whole paragraph out again:\n\n" + _typo(paragraph, rng)
        else:
            body = f"Tell me about {TOPICS[i % len(TOPICS)]}."
        text = tokenizer.apply_chat_template([{"role": "user", "content": body}], add_generation_prompt=True,
                                             tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def run_speculative(llm: LLM, prompts, output_tokens: int) -> dict:
    """One timed batch: every prompt at once, exactly ``output_tokens`` greedy tokens each."""
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    before = llm.engine.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    s = llm.engine.stats()
    drafted = s.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = s.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    steps = s.spec_decode_num_decode_steps - before.spec_decode_num_decode_steps
    emitted = s.spec_decode_num_emitted_tokens - before.spec_decode_num_emitted_tokens
    return {"tpot_s": statistics.median(tpot(o.metrics) for o in outs),
            "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
            "acceptance": accepted / drafted if drafted else 0.0, "draft_tokens": drafted,
            "tokens_per_step": emitted / steps if steps else 1.0,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def speculative_main(argv=None) -> int:
    """Speculative decoding off and on, batch 1, 4 and 16, where prompt lookup helps and where it does not."""
    offline_env()
    parser = bench_parser("speculative", speculative_main.__doc__)
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--output-tokens", type=positive_int, default=64)
    parser.add_argument("--num-speculative-tokens", type=positive_int, default=SPEC["num_speculative_tokens"])
    args = parser.parse_args(argv)
    if args.output_tokens < 2:
        parser.error("argument --output-tokens: must be >= 2 (TPOT needs two tokens), got 1")
    device = torch.device(args.device) if args.device else default_device()
    tok = load_tokenizer(args.model)
    spec = {**SPEC, "num_speculative_tokens": args.num_speculative_tokens}
    biggest = max(args.batch_sizes)
    print(f"speculative decoding (ngram, k={spec['num_speculative_tokens']}, n-grams "
          f"{spec['prompt_lookup_min']}-{spec['prompt_lookup_max']}) off vs on; {args.output_tokens} greedy tokens "
          f"per request; {args.model} float32 on {device} ({torch.get_num_threads()} CPU threads), "
          f"{args.repeats} repeat(s), off and on alternating", flush=True)
    engines = {}
    for on in (False, True):
        engines[on] = LLM(args.model, block_size=args.block_size, num_blocks=biggest * 32, max_num_seqs=biggest,
                          max_num_batched_tokens=max(args.max_num_batched_tokens, biggest * 8), device=str(device),
                          dtype="float32", seed=args.seed, speculative_config=spec if on else None)
        warm_up(engines[on])
    print(f"\n{'workload':>11} {'batch':>5} {'spec':>4} {'TPOT ms':>8} {'tok/s':>7} {'accept':>7} "
          f"{'tok/step':>8} {'TPOT off/on':>11}")
    rows, identical = [], True
    for kind in ("repetitive", "open"):
        for b in args.batch_sizes:
            prompts = speculative_prompts(tok, kind, b, args.seed)
            runs = {False: [], True: []}
            for _ in range(args.repeats):
                for on in (False, True):
                    runs[on].append(run_speculative(engines[on], prompts, args.output_tokens))
            same = runs[False][0]["token_ids"] == runs[True][0]["token_ids"]
            med = {on: {k: statistics.median(r[k] for r in rs) for k in ("tpot_s", "tokens_per_s", "acceptance",
                                                                            "tokens_per_step")}
                   for on, rs in runs.items()}
            ratio = med[False]["tpot_s"] / med[True]["tpot_s"]
            for on in (False, True):
                m = med[on]
                print(f"{kind:>11} {b:5d} {'on' if on else 'off':>4} {m['tpot_s'] * 1e3:8.1f} "
                      f"{m['tokens_per_s']:7.1f} {m['acceptance'] if on else float('nan'):7.2f} "
                      f"{m['tokens_per_step']:8.2f} {f'{ratio:.2f}x' if on else '':>11}", flush=True)
                rows.append((kind, b, on, m))
            identical &= same
    print(f"\ngreedy outputs identical with speculation off and on: {identical}")
    first = {(k, b, on): m for k, b, on, m in rows}
    lo = min(args.batch_sizes)
    rep = first[("repetitive", lo, False)]["tpot_s"] / first[("repetitive", lo, True)]["tpot_s"]
    slow = first[("open", lo, True)]["tpot_s"] / first[("open", lo, False)]["tpot_s"] - 1
    print(f"target at batch {lo}: repetitive TPOT >= 1.8x lower with speculation: {rep:.2f}x -> "
          f"{'met' if rep >= 1.8 else 'MISSED'}; open no more than 5% slower: {slow:+.1%} -> "
          f"{'met' if slow <= 0.05 else 'MISSED'}")
    return 0
