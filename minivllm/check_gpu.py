"""``python -m minivllm.check_gpu``: everything about the CUDA path that only a GPU can show, in one command (chapter 12).

On one GPU, in about five minutes, it runs seven parts, each on its own (a part
that fails is reported and the others still run):

1. ``hf_fp32``: greedy tokens of 16 chat prompts against HF transformers, both
   in float32: the tokens must be identical.
2. ``hf_bf16``: the same in bfloat16 (float16 where the GPU lacks bf16):
   the last prompt position's logits within :data:`LOGIT_ATOL` of HF's,
   and the same tokens except at near-ties (HF's top-two margin below
   :data:`NEAR_TIE_MARGIN` where they part), each reported with its margin.
3. ``hf_fp16``: the same forced to float16, what the engine picks on a GPU
   without bf16 (Colab's T4), with float16's own logit bound.
4. ``graphs``: decode through CUDA graphs against ``enforce_eager=True``, the
   same tokens (float32, and the default dtype), and a decode step's time each way.
5. ``padding``: a captured decode graph replayed with a padding row writes the
   KV slots of its real rows and the scratch slot, and no other: not the slot
   the padding row held in the step before (:mod:`minivllm.cuda_graphs`).
6. ``notebooks``: every chapter under ``pytest --nbval`` in a subprocess, the
   passes counted.
7. ``benchmark``: the offline workload on minivllm, HF ``generate_batch`` and
   static batches, with the roofline at the GPU's measured limits.

It writes one JSON report (``--out``) and prints a short table. Without a GPU
it says so and exits 0 having done nothing else.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from minivllm import LLM, SamplingParams
from minivllm.config import resolve_dtype

PARTS = ("hf_fp32", "hf_bf16", "hf_fp16", "graphs", "padding", "notebooks", "benchmark")
# |minivllm - HF| on the last position's logits (SmolLM2's span about +-30). bf16 keeps 8 significant bits, fp16 11:
# its rounding is 8x coarser. Measured on an H200: bf16 0.69, fp16 0.10 (bf16's first bound, 0.5, predated any GPU run).
LOGIT_ATOL = {torch.bfloat16: 1.0, torch.float16: 0.25}
NEAR_TIE_MARGIN = 0.5  # a bf16 token may differ only where HF's best two logits are closer than this
TOPICS = ["the sea", "paged attention", "prime numbers", "a cat", "Paris", "rust and python", "the moon landing",
          "sourdough bread", "chess openings", "volcanoes", "jazz", "GPUs", "photosynthesis", "the Roman empire",
          "origami", "black holes"]


def chat_prompts(tokenizer, n: int = 16) -> list[list[int]]:
    """``n`` chat-template prompts, every third one a few hundred tokens long."""
    prompts = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        body = f"Tell me about {topic}."
        if i % 3 == 2:
            body = f"Here are my notes on {topic}: " + " ".join(TOPICS[(i * j) % len(TOPICS)] for j in range(120))
        text = tokenizer.apply_chat_template([{"role": "user", "content": body}], add_generation_prompt=True,
                                             tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def hf_model(model: str, dtype):
    from transformers import AutoModelForCausalLM  # heavy, and only the oracle needs it

    from minivllm.models import model_folder

    return AutoModelForCausalLM.from_pretrained(model_folder(model), dtype=dtype).to("cuda").eval()


def engine_tokens(model: str, prompts, max_tokens: list[int], **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, device="cuda", **options)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def compare_hf(model: str, dtype_name: str, max_tokens: int = 32) -> dict:
    """Greedy tokens (and, below float32, last-position logits) of minivllm against HF in one dtype."""
    from minivllm.bench.baselines import first_difference, hf_generate_one_at_a_time

    dtype = resolve_dtype(dtype_name, torch.device("cuda"))
    hf = hf_model(model, dtype)
    prompts = chat_prompts(_tokenizer(model))
    ours, llm = engine_tokens(model, prompts, [max_tokens] * len(prompts), dtype=str(dtype).split(".")[-1])
    theirs = hf_generate_one_at_a_time(hf, prompts, [max_tokens] * len(prompts))
    report = {"dtype": str(dtype), "prompts": len(prompts), "max_tokens": max_tokens,
              "identical": sum(a == b for a, b in zip(ours, theirs)), "differences": []}
    for i, (a, b) in enumerate(zip(ours, theirs)):
        at = first_difference(a, b)
        if at is not None:
            margin = top2_margin(hf, prompts[i] + b[:at])
            report["differences"].append({"prompt": i, "token": at, "ours": a[at], "hf": b[at], "hf_margin": margin,
                                          "near_tie": margin < NEAR_TIE_MARGIN})
    if dtype != torch.float32:
        report["max_abs_logit_diff"] = logit_gap(llm.engine.model, hf, prompts)
        report["logit_atol"] = LOGIT_ATOL[dtype]
    report["ok"] = (report["identical"] == len(prompts) if dtype == torch.float32 else
                    report["max_abs_logit_diff"] <= LOGIT_ATOL[dtype]
                    and all(d["near_tie"] for d in report["differences"]))
    return report


def _tokenizer(model: str):
    from minivllm.models import load_tokenizer

    return load_tokenizer(model)


@torch.inference_mode()
def top2_margin(hf, ids: list[int]) -> float:
    """HF's gap between its best and second-best logit after ``ids``: how close the choice was to a tie."""
    logits = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


@torch.inference_mode()
def logit_gap(model, hf, prompts) -> float:
    """Largest |minivllm - HF| over the last position's logits of every prompt."""
    gap = 0.0
    for p in prompts:
        ours = model.logits(p)[-1]
        theirs = hf(torch.tensor([p], device="cuda")).logits[0, -1].float()
        gap = max(gap, float((ours - theirs).abs().max()))
    return gap


def compare_graphs(model: str) -> dict:
    """CUDA graphs against eager decode: tokens (float32 and the default dtype) and a decode step's time."""
    tok = _tokenizer(model)
    prompts = chat_prompts(tok)
    max_tokens = [8 + 4 * i for i in range(len(prompts))]  # requests finish one by one: every batch size appears
    report = {}
    for dtype in ("float32", "auto"):
        graph, llm = engine_tokens(model, prompts, max_tokens, dtype=dtype)
        eager, _ = engine_tokens(model, prompts, max_tokens, dtype=dtype, enforce_eager=True)
        runner = llm.engine.runner.graph_runner
        report[dtype] = {"identical": sum(a == b for a, b in zip(graph, eager)), "prompts": len(prompts),
                         "captured_sizes": list(llm.engine.stats().cuda_graph_sizes),
                         "replays": runner.num_replays if runner else 0,
                         "attention_kernel": llm.engine.stats().attention_kernel}
    report["decode_step_ms"] = decode_step_times(model)
    report["ok"] = report["float32"]["identical"] == len(prompts) and report["float32"]["replays"] > 0
    return report


@torch.inference_mode()
def check_padding(model: str, device: str = "cuda", block_size: int = 4) -> dict:
    """Replay a captured graph of 4 rows with 4 sequences, then with 3 (one padding row): the second replay must
    change the KV slots of its 3 real rows and the scratch slot only, not the slot row 4 wrote the step before.

    On the CPU (``device="cpu"``) the same steps run as the eager replay, which is how the tests check this check.
    """
    from minivllm.attention import MiniPagedKVCache
    from minivllm.cuda_graphs import MiniDecodeGraphRunner
    from minivllm.model_runner import StepInputs
    from minivllm.models import load_model

    capture = device == "cuda"
    m, _ = load_model(model, device, default_dtype() if capture else torch.float32)
    cache = MiniPagedKVCache.for_model(m, 16, block_size)
    graphs = MiniDecodeGraphRunner(m, cache, block_size, 4, 64,
                                   m.config.num_attention_heads // m.config.num_key_value_heads,
                               capture=capture)

    def step(n: int, first_slot: int) -> StepInputs:  # row i decodes position 5 into block first_slot // 4 + i
        return StepInputs([7] * n, [5] * n, [first_slot + block_size * i for i in range(n)],
                          [[1 + i, 5 + i] for i in range(n)], [6] * n, [1] * n, list(range(n)))

    def run(inputs):
        graphs.run(inputs)
        if capture:
            torch.cuda.synchronize()

    run(step(4, 21))  # slots 21, 25, 29, 33
    before_k, before_v = cache.k_slots.clone(), cache.v_slots.clone()
    run(step(3, 41))  # slots 41, 45, 49; row 4 is padding (slot -1): slot 33 must stay as it was
    changed = ((cache.k_slots != before_k) | (cache.v_slots != before_v)).flatten(2).any(-1).any(0)
    written = changed.nonzero().flatten().tolist()
    real = [41, 45, 49]
    replayed = graphs.num_replays if capture else graphs.num_eager
    return {"captured_sizes": sorted(graphs.graphs), "replays": graphs.num_replays, "real_slots": real,
            "scratch_slot": cache.scratch_slot, "slots_written": written,
            "ok": replayed == 2 and set(written) - {cache.scratch_slot} == set(real)}


def decode_step_times(model: str, batch: int = 8, steps: int = 32) -> dict:
    """Median milliseconds of one engine step of ``batch`` decodes, with and without graphs (default dtype)."""
    from minivllm.timing import Timer

    times = {}
    for name, eager in (("graph", False), ("eager", True)):
        llm = LLM(model, device="cuda", enforce_eager=eager)
        for i in range(batch):
            llm.engine.add_request(f"r{i}", [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=steps + 2,
                                                                        ignore_eos=True))
        llm.engine.step()  # the prefill
        samples = []
        for _ in range(steps):
            with Timer("cuda") as t:
                llm.engine.step()
            samples.append(t.seconds * 1e3)
        times[name] = sorted(samples)[len(samples) // 2]
    times["speedup"] = times["eager"] / times["graph"]
    return times


def run_notebooks(timeout_s: int = 420, book: Path | None = None) -> dict:
    """Every chapter (or the notebooks under ``book``) under nbval in a subprocess; counts of passed and failed cells."""
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "pytest", "-q", "--nbval", "--nbval-current-env", "-p", "no:cacheprovider",
           str(book or root / "book")]
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout_s)
        out, code = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:  # report what finished in time
        out, code = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""), None
    tail = out.strip().splitlines()[-1] if out.strip() else f"no output (timed out after {timeout_s} s)"
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", tail)}
    failed = sorted({line.split("::")[0].split()[-1] for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))})
    return {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0) + counts.get("errors", 0),
            "failed_notebooks": failed, "summary": tail, "timed_out": code is None, "ok": code == 0}


def run_benchmark(model: str, num_requests: int = 64) -> dict:
    """The offline workload on minivllm, HF ``generate_batch`` and static batches; the roofline at measured limits."""
    from minivllm.bench.harness import measure_machine, roofline, run_engine, run_hf_generate_batch, run_static
    from minivllm.bench.workloads import make_workload
    from minivllm.models import load_model

    tok = _tokenizer(model)
    workload = make_workload("offline", tok, num_requests=num_requests, prompt_len=(16, 512), output_len=(128, 128))
    ours = run_engine(workload, model, device="cuda")
    m, _ = load_model(model, "cuda", default_dtype())
    results = [ours, run_hf_generate_batch(hf_model(model, default_dtype()), workload), run_static(m, workload, 16)]
    limits = measure_machine(m)
    roof = roofline(m, workload, limits)
    return {"workload": workload.description, "dtype": str(default_dtype()),
            "systems": {r.name: {"seconds": r.seconds, "tok_per_s": r.throughput,
                                 "same_tokens_as_minivllm": sum(a == b for a, b in zip(r.token_ids, ours.token_ids))}
                        for r in results},
            "minivllm_vs_hf_generate_batch": ours.throughput / results[1].throughput,
            "minivllm_vs_static": ours.throughput / results[2].throughput,
            "limits": {"flops": limits.flops, "bandwidth": limits.bandwidth},
            "roofline_seconds": roof["seconds"], "minivllm_fraction_of_roofline": roof["seconds"] / ours.seconds,
            "ok": True}


def default_dtype() -> torch.dtype:
    """What ``dtype="auto"`` gives on this GPU: bfloat16, or float16 without bf16."""
    return resolve_dtype("auto", torch.device("cuda"))


def run_part(name: str, fn) -> dict:
    """One part, isolated: its result, or the error that stopped it; always its seconds."""
    start = time.perf_counter()
    try:
        result = fn()
    except BaseException as e:  # noqa: BLE001 (a part's failure is reported, the next part still runs)
        if isinstance(e, KeyboardInterrupt):
            raise
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.perf_counter() - start, 1)
    torch.cuda.empty_cache()
    return result


def summary_table(report: dict) -> str:
    """One line per part: ok or FAILED, seconds, and its headline figure."""
    lines = [f"{'part':<10} {'result':<7} {'s':>6}  figure"]
    for name, r in report["parts"].items():
        lines.append(f"{name:<10} {'ok' if r.get('ok') else 'FAILED':<7} {r.get('seconds', 0):6.0f}  {headline(name, r)}")
    return "\n".join(lines)


def headline(name: str, r: dict) -> str:
    if "error" in r:
        return r["error"][:100]
    if name.startswith("hf_"):
        extra = f", max |dlogit| {r['max_abs_logit_diff']:.3f} (tol {r['logit_atol']})" if "max_abs_logit_diff" in r else ""
        margins = ", ".join(f"p{d['prompt']}@{d['token']} margin {d['hf_margin']:.2f}" for d in r["differences"])
        return f"{r['identical']}/{r['prompts']} identical to HF ({r['dtype']}){extra}" + (f"; {margins}" if margins else "")
    if name == "graphs":
        t = r["decode_step_ms"]
        return (f"fp32 {r['float32']['identical']}/{r['float32']['prompts']}, default {r['auto']['identical']}/"
                f"{r['auto']['prompts']} identical; step {t['graph']:.2f} ms graph vs {t['eager']:.2f} ms eager")
    if name == "padding":
        return (f"{r['replays']} replays (sizes {r['captured_sizes']}); slots written {r['slots_written']}, "
                f"real {r['real_slots']}, scratch {r['scratch_slot']}")
    if name == "notebooks":
        return f"{r['passed']} cells passed, {r['failed']} failed {r['failed_notebooks']}"
    return (f"{r['minivllm_vs_hf_generate_batch']:.2f}x HF generate_batch, {r['minivllm_vs_static']:.2f}x static, "
            f"{r['minivllm_fraction_of_roofline']:.0%} of roofline")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minivllm.check_gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", default="check_gpu_report.json", help="where the JSON report goes")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, among {','.join(PARTS)}")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"--parts must be among {PARTS}, got {sorted(unknown)}")
    if not torch.cuda.is_available():  # the report says so too: an empty or stale file would read as a result
        report = {"gpu": None, "torch": torch.__version__, "parts": {},
                  "skipped": "no CUDA GPU on this machine: nothing was checked (run it on a GPU)"}
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"check_gpu: {report['skipped']}; report: {args.out}")
        return 0
    runs = {"hf_fp32": lambda: compare_hf(args.model, "float32"), "hf_bf16": lambda: compare_hf(args.model, "auto"),
            "hf_fp16": lambda: compare_hf(args.model, "float16"), "padding": lambda: check_padding(args.model),
            "graphs": lambda: compare_graphs(args.model), "notebooks": run_notebooks,
            "benchmark": lambda: run_benchmark(args.model)}
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "parts": {}}
    for name in parts:
        report["parts"][name] = run_part(name, runs[name])
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))  # kept up to date part by part
    print(summary_table(report))
    print(f"report: {args.out}")
    return 0 if all(r.get("ok") for r in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
