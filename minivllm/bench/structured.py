"""Structured outputs on and off: ``python -m minivllm bench --workload structured`` (chapter 19).

Chat prompts that ask for a person as JSON, run with a JSON-schema constraint
(compact JSON, vLLM's ``disable_any_whitespace``) and without one, at every
batch size (all requests at once), in alternation on fresh warmed-up
engines; greedy. Reported: the share of answers that parse and validate
against the schema, output tokens/s, median TPOT, and the grammar's own
time per step (the bitmasks filled and applied, the runner's "grammar"
phase) against the whole step. The constrained run goes first; the
unconstrained one then gives each request exactly as many tokens
(``ignore_eos``), so both batches shrink alike and their TPOTs compare.
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


def run_structured(llm: LLM, prompts, output_tokens, constrained: bool) -> dict:
    """One timed batch, every prompt at once, stepped here so that each step's phases add up. ``output_tokens``:
    the most a request may generate, or a list of exactly how many each does (unconstrained runs)."""
    so = StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True) if constrained else None
    lengths = output_tokens if isinstance(output_tokens, list) else [output_tokens] * len(prompts)
    engine = llm.engine
    for i, ids in enumerate(prompts):
        engine.add_request(f"s{i}", ids, SamplingParams(temperature=0.0, max_tokens=lengths[i],
                                                        ignore_eos=not constrained, structured_outputs=so))
    outs, grammar_s, step_s, steps = {}, 0.0, 0.0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        step_s += time.perf_counter() - t
        grammar_s += engine.last_step_phases.get("grammar", 0.0)
        steps += 1
    wall = time.perf_counter() - start
    done = [outs[f"s{i}"] for i in range(len(prompts))]
    return {"valid": sum(is_valid(o.outputs[0].text) for o in done) / len(done),
            "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in done) / wall,
            "tpot_s": statistics.median(tpot(o.metrics) for o in done if len(o.outputs[0].token_ids) > 1),
            "grammar_ms_per_step": grammar_s / steps * 1e3, "grammar_share": grammar_s / step_s,
            "texts": [o.outputs[0].text for o in done], "lengths": [len(o.outputs[0].token_ids) for o in done]}


def structured_main(argv=None) -> int:
    """A JSON-schema constraint on and off, batch 1 and 16: validity, tokens/s, TPOT, the grammar's share."""
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
    print(f"structured outputs (a JSON schema: name, age, city; compact) off vs on; up to {args.output_tokens} "
          f"greedy tokens per request; {args.model} float32 on {device} ({torch.get_num_threads()} CPU threads), "
          f"{args.repeats} repeat(s), on then off (as many tokens per request)", flush=True)
    llm = LLM(args.model, block_size=args.block_size, num_blocks=biggest * 32, max_num_seqs=biggest,
              max_num_batched_tokens=max(args.max_num_batched_tokens, biggest * 8), device=str(device),
              dtype="float32", seed=args.seed)
    warm_up(llm)
    print(f"\n{'batch':>5} {'schema':>6} {'valid':>6} {'tok/s':>7} {'TPOT ms':>8} {'grammar ms/step':>15} "
          f"{'share':>6} {'TPOT on/off':>11}")
    for b in args.batch_sizes:
        prompts = structured_prompts(tok, b)
        runs = {False: [], True: []}
        for _ in range(args.repeats):
            runs[True].append(run_structured(llm, prompts, args.output_tokens, True))
            runs[False].append(run_structured(llm, prompts, runs[True][-1]["lengths"], False))
        med = {on: {k: statistics.median(r[k] for r in rs) for k in ("valid", "tokens_per_s", "tpot_s",
                                                                        "grammar_ms_per_step", "grammar_share")}
               for on, rs in runs.items()}
        ratio = med[True]["tpot_s"] / med[False]["tpot_s"]
        for on in (False, True):
            m = med[on]
            print(f"{b:5d} {'on' if on else 'off':>6} {m['valid']:6.0%} {m['tokens_per_s']:7.1f} "
                  f"{m['tpot_s'] * 1e3:8.1f} {m['grammar_ms_per_step']:15.3f} {m['grammar_share']:6.1%} "
                  f"{f'{ratio:.2f}x' if on else '':>11}", flush=True)
        print(f"      e.g. {runs[True][0]['texts'][0]}")
    return 0
