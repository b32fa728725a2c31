"""Structured outputs on and off: ``python -m minivllm bench --workload structured`` (chapter 19).

Chat prompts that ask for a person as JSON, run with a JSON-schema constraint
(compact JSON, vLLM's ``disable_any_whitespace``) and without one, at every
batch size (all requests at once), in alternation on fresh warmed-up
engines; greedy. The constrained run goes twice, with the bitmasks filled
after the forward and while it runs (``EngineConfig.overlap_grammar_fill``,
the runner's switch flipped between runs on one engine). Reported: the
share of answers that parse and validate against the schema, output
tokens/s, median TPOT, the fill, the apply and the forward apart (ms a
step, each where it ran: the fill on the worker thread when overlapped), and
the grammar's share of a step: what it adds to the step's path (the
runner's "grammar" phase: the fill and the apply, or, overlapped, the wait
for the fill and the apply). The constrained runs go first; the
unconstrained one then gives each request exactly as many tokens
(``ignore_eos``), so the batches shrink alike and their TPOTs compare.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.bench.cli import bench_parser, offline_env, positive_int
from minivllm.bench.metrics import tpot
from minivllm.bench.trace import warm_up
from minivllm.config import default_device
from minivllm.models import load_tokenizer

__all__ = ["PERSON_SCHEMA", "structured_prompts", "is_valid", "run_structured", "structured_main"]

PERSON_SCHEMA = {"type": "object", "required": ["name", "age", "city"], "additionalProperties": False,
                 "properties": {"name": {"type": "string", "maxLength": 40},
                                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                "city": {"type": "string", "maxLength": 40}}}
PEOPLE = ["a sailor", "a baker", "a chess player", "an astronaut", "a painter", "a violinist", "a gardener",
          "a detective", "a teacher", "a pilot", "a librarian", "a chef", "a farmer", "a poet", "a nurse", "a miner"]


def structured_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` chat prompts asking for a person as JSON with a name, an age and a city."""
    prompts = []
    for i in range(n):
        body = (f"Invent {PEOPLE[i % len(PEOPLE)]} and describe them as a JSON object with the keys name, age and "
                "city. Answer with the JSON only.")
        text = tokenizer.apply_chat_template([{"role": "user", "content": body}], add_generation_prompt=True,
                                             tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def is_valid(text: str, schema: dict = PERSON_SCHEMA) -> bool:
    """Whether ``text`` is JSON that validates against ``schema``."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_structured(llm: LLM, prompts, output_tokens, constrained: bool, overlap: bool | None = None) -> dict:
    """One timed batch, every prompt at once, stepped here so that each step's phases add up. ``output_tokens``:
    the most a request may generate, or a list of exactly how many each does (unconstrained runs). ``overlap``:
    fill the bitmasks while the forward runs, or after it (None: the engine's setting)."""
    so = StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True) if constrained else None
    lengths = output_tokens if isinstance(output_tokens, list) else [output_tokens] * len(prompts)
    engine, runner = llm.engine, llm.engine.runner
    setting = runner.overlap_grammar_fill
    runner.overlap_grammar_fill = setting if overlap is None else overlap
    for i, ids in enumerate(prompts):
        engine.add_request(f"s{i}", ids, SamplingParams(temperature=0.0, max_tokens=lengths[i],
                                                        ignore_eos=not constrained, structured_outputs=so))
    outs, steps = {}, 0
    total = dict.fromkeys(("step", "grammar", "forward", "fill", "apply"), 0.0)
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
            total["step"] += time.perf_counter() - t
            for phase in ("grammar", "forward"):
                total[phase] += engine.last_step_phases.get(phase, 0.0)
            for part in ("fill", "apply"):
                total[part] += runner.last_grammar_s[part]
            steps += 1
    finally:
        runner.overlap_grammar_fill = setting
    wall = time.perf_counter() - start
    done = [outs[f"s{i}"] for i in range(len(prompts))]
    per_step = {f"{k}_ms_per_step": total[k] / steps * 1e3 for k in ("grammar", "forward", "fill", "apply")}
    return {"valid": sum(is_valid(o.outputs[0].text) for o in done) / len(done),
            "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in done) / wall,
            "tpot_s": statistics.median(tpot(o.metrics) for o in done if len(o.outputs[0].token_ids) > 1),
            **per_step, "grammar_share": total["grammar"] / total["step"],
            "texts": [o.outputs[0].text for o in done], "lengths": [len(o.outputs[0].token_ids) for o in done]}


def structured_main(argv=None) -> int:
    """A JSON-schema constraint off and on (the masks filled after the forward, and while it runs), batch 1 and
    16: validity, tokens/s, TPOT, the fill, the apply and the forward apart, the grammar's share of a step."""
    offline_env()
    parser = bench_parser("structured", structured_main.__doc__)
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 16])
    parser.add_argument("--output-tokens", type=positive_int, default=64)
    args = parser.parse_args(argv)
    if args.output_tokens < 2:
        parser.error("argument --output-tokens: must be >= 2 (TPOT needs two tokens), got 1")
    device = torch.device(args.device) if args.device else default_device()
    tok = load_tokenizer(args.model)
    biggest = max(args.batch_sizes)
    print(f"structured outputs (a JSON schema: name, age, city; compact) off vs on, the masks filled after the "
          f"forward (serial) or while it runs (overlap); up to {args.output_tokens} greedy tokens per request; "
          f"{args.model} float32 on {device} ({torch.get_num_threads()} CPU threads), {args.repeats} repeat(s), "
          f"serial, overlap, then off (as many tokens per request)", flush=True)
    llm = LLM(args.model, block_size=args.block_size, num_blocks=biggest * 32, max_num_seqs=biggest,
              max_num_batched_tokens=max(args.max_num_batched_tokens, biggest * 8), device=str(device),
              dtype="float32", seed=args.seed)
    warm_up(llm)
    print(f"\n{'batch':>5} {'schema':>7} {'valid':>6} {'tok/s':>7} {'TPOT ms':>8} {'forward':>8} {'fill':>6} "
          f"{'apply':>6} {'grammar':>8} {'share':>6} {'TPOT /off':>9}   (ms a step)")
    keys = ("valid", "tokens_per_s", "tpot_s", "forward_ms_per_step", "fill_ms_per_step", "apply_ms_per_step",
            "grammar_ms_per_step", "grammar_share")
    for b in args.batch_sizes:
        prompts = structured_prompts(tok, b)
        runs = {"off": [], "serial": [], "overlap": []}
        for _ in range(args.repeats):
            runs["serial"].append(run_structured(llm, prompts, args.output_tokens, True, overlap=False))
            runs["overlap"].append(run_structured(llm, prompts, runs["serial"][-1]["lengths"], True, overlap=True))
            runs["off"].append(run_structured(llm, prompts, runs["serial"][-1]["lengths"], False))
        med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
        for name, m in med.items():
            ratio = f"{m['tpot_s'] / med['off']['tpot_s']:.2f}x" if name != "off" else ""
            print(f"{b:5d} {name:>7} {m['valid']:6.0%} {m['tokens_per_s']:7.1f} {m['tpot_s'] * 1e3:8.1f} "
                  f"{m['forward_ms_per_step']:8.2f} {m['fill_ms_per_step']:6.3f} {m['apply_ms_per_step']:6.3f} "
                  f"{m['grammar_ms_per_step']:8.3f} {m['grammar_share']:6.1%} {ratio:>9}", flush=True)
        print(f"      e.g. {runs['overlap'][0]['texts'][0]}")
    return 0
