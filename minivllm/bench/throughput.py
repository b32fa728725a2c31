"""Output tokens/s of minivllm against HF transformers ``generate``: ``python -m minivllm.bench`` (chapters 06, 11)."""

from __future__ import annotations

import argparse
import statistics

import torch

from minivllm import LLM, SamplingParams
from minivllm.bench.baselines import first_difference, hf_generate_one_at_a_time, hf_generate_static_batches
from minivllm.bench.cli import (SUBCOMMANDS, add_min_max, block_size_int, check_token_budget, nonneg_int,
                                offline_env, positive_int)
from minivllm.timing import now
from minivllm.bench.workloads import random_workload
from minivllm.config import default_device
from minivllm.models import model_folder

__all__ = ["throughput_main"]


def throughput_main(argv=None) -> int:
    """Output tokens/s of minivllm against HF transformers ``generate``, measured in one run."""
    offline_env()
    parser = argparse.ArgumentParser(prog="python -m minivllm.bench", description=throughput_main.__doc__,
                                     epilog="other benchmarks: " + ", ".join(
                                         f"python -m minivllm.bench {name} --help" for name in SUBCOMMANDS))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=positive_int, default=32)
    add_min_max(parser, "--prompt-len", default=(16, 256))
    add_min_max(parser, "--output-len", default=(16, 64))
    parser.add_argument("--seed", type=nonneg_int, default=0)
    parser.add_argument("--hf-batch-size", type=positive_int, default=16)
    parser.add_argument("--max-num-seqs", type=positive_int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    parser.add_argument("--block-size", type=block_size_int, default=16)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--skip-hf", action="store_true", help="time minivllm only (for sweeping engine settings)")
    parser.add_argument("--repeats", type=positive_int, default=1, help="time minivllm and the HF static batches this "
                        "many times and report medians (HF one at a time runs once: it is the slow reference)")
    args = parser.parse_args(argv)
    check_token_budget(parser, args.max_num_batched_tokens, args.max_num_seqs, "--max-num-seqs",
                       args.prompt_len[1], "--prompt-len MAX")

    device = torch.device(args.device) if args.device else default_device()
    engine_opts = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       block_size=args.block_size, device=str(device), dtype="float32")
    llm = LLM(args.model, **engine_opts)
    prompts, outs = random_workload(llm.get_tokenizer(), args.num_requests, tuple(args.prompt_len),
                                    tuple(args.output_len), args.seed)
    total_out = sum(outs)
    print(f"workload: {len(prompts)} requests, prompt {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
          f"({sum(map(len, prompts))} in all), output {min(outs)}-{max(outs)} tokens ({total_out} in all), "
          f"seed {args.seed}; greedy, ignore_eos; {args.model} float32 on {device} "
          f"({torch.get_num_threads()} CPU threads)")
    rows = []

    def timed(name, fn, repeats=1):
        """Median seconds over ``repeats`` runs after an untimed warm-up."""
        fn(prompts[:1], [2])
        times = []
        for _ in range(repeats):
            start = now(device)
            result = fn(prompts, outs)
            times.append(now(device) - start)
        seconds = statistics.median(times)
        short = [i for i, (r, n) in enumerate(zip(result, outs)) if len(r) != n]
        if short:
            print(f"  warning: {name} returned a wrong number of tokens for requests {short}")
        got = sum(min(len(r), n) for r, n in zip(result, outs))
        rows.append((name, seconds, got / seconds))
        spread = f"  (median of {repeats}: {min(times):.2f}-{max(times):.2f} s)" if repeats > 1 else ""
        print(f"  {name:<60} {seconds:8.2f} s {got / seconds:10.1f} output tok/s{spread}", flush=True)
        return result

    def minivllm_generate(ps, ns):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in ns]
        return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]

    opts = ", ".join(f"{k}={v}" for k, v in engine_opts.items() if k not in ("device", "dtype"))
    ours = timed(f"minivllm LLM.generate ({opts})", minivllm_generate, args.repeats)
    if args.skip_hf:
        return 0

    from transformers import AutoModelForCausalLM  # optional and heavy: only the comparison with HF needs it

    hf = AutoModelForCausalLM.from_pretrained(model_folder(args.model), dtype=torch.float32).to(device).eval()

    def compare(name, a, b):
        diffs = [(i, first_difference(x, y)) for i, (x, y) in enumerate(zip(a, b)) if x != y]
        print(f"  {name}: {len(a) - len(diffs)}/{len(a)} requests token-identical" +
              ("" if not diffs else "; differ at (request, first token): " +
               ", ".join(f"({i}, {j})" for i, j in diffs)), flush=True)
        return diffs

    single = timed("HF generate, one request at a time", lambda ps, ns: hf_generate_one_at_a_time(hf, ps, ns))
    mismatches = compare("greedy check, minivllm vs HF one at a time", ours, single)
    for i, j in mismatches:  # a greedy divergence is a bug unless the two choices were (numerically) tied
        if j is not None and j < min(len(ours[i]), len(single[i])):
            with torch.inference_mode():
                ids = torch.tensor([list(prompts[i]) + single[i][:j]], device=device)
                logits = hf(ids).logits[0, -1].float()
            gap = abs(float(logits[single[i][j]] - logits[ours[i][j]]))
            print(f"    request {i}, token {j}: HF picks {single[i][j]}, minivllm {ours[i][j]}; HF's own logits "
                  f"for the two differ by {gap:.1e} ({'a near-tie: fp32 rounding' if gap < 1e-3 else 'NOT a tie'})")
    bs = args.hf_batch_size
    batched = timed(f"HF generate, static batches of {bs} (left-padded)",
                    lambda ps, ns: hf_generate_static_batches(hf, ps, ns, bs), args.repeats)
    compare(f"for reference, HF batches of {bs} vs HF one at a time", batched, single)

    mini_tps = rows[0][2]
    print(f"\nminivllm / HF one at a time:        {mini_tps / rows[1][2]:6.2f}x")
    print(f"minivllm / HF static batches of {bs}: {mini_tps / rows[2][2]:6.2f}x")
    return 1 if mismatches else 0
