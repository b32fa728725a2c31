"""The benchmark harness: one workload through every system, the same metrics for all (chapter 11).

:func:`run_engine` replays a :class:`~minivllm.bench.workloads.Workload` through
minivllm step by step; the ``run_*`` baselines (naive, contiguous cache,
static batches, HF transformers) run offline workloads the way a user of each
would. Each returns a :class:`BenchResult`: wall time, outputs, and per-request
token times, so TTFT, TPOT, ITL and E2E mean the same thing for every row.
:func:`roofline` says how fast the machine could run the workload at all.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from minivllm import LLM
from minivllm.bench.baselines import _hf_generation_config, hf_generate_batch, static_batch_generate
from minivllm.bench.metrics import RequestTimes, ServingMetrics, serving_metrics
from minivllm.bench.progress import Progress
from minivllm.bench.trace import StepRecord, replay, warm_up
from minivllm.bench.workloads import Workload, _exactly, random_workload
from minivllm.block_manager import MiniBlockManager
from minivllm.config import cdiv
from minivllm.models import load_model
from minivllm.models.linear import QUANTIZED_MAX_ROWS, Linear
from minivllm.simple_generation import generate_cached, generate_naive
from minivllm.timing import Timer, now, quiet_profile

__all__ = ["BenchResult", "run_engine", "run_naive", "run_contiguous", "run_static", "run_hf_generate",
           "run_hf_generate_batch", "LADDER", "run_ladder", "ReservingBlockManager", "MachineLimits", "measure_machine",
           "matmul_layouts", "roofline", "step_breakdown", "OP_KINDS", "decode_op_breakdown", "format_results", "same_outputs"]


@dataclass
class BenchResult:
    """What one system did with one workload: wall time, outputs and when each token appeared."""

    name: str
    seconds: float
    token_ids: list[list[int]]  # in the workload's request order
    requests: list  # per request: arrival_time and token_times (RequestMetrics or RequestTimes)
    steps: list[StepRecord] = field(default_factory=list)  # engine steps (minivllm only)
    stats: object = None  # the engine's EngineStats after the run (minivllm only)
    start: float = 0.0  # perf_counter time the run started (step timelines are drawn from it)

    @property
    def output_tokens(self) -> int:
        return sum(map(len, self.token_ids))

    @property
    def throughput(self) -> float:
        """Output tokens per second of wall time."""
        return self.output_tokens / self.seconds

    def metrics(self, slo: dict | None = None) -> ServingMetrics:
        return serving_metrics(self.requests, self.seconds, slo)


def same_outputs(a: BenchResult, b: BenchResult) -> int:
    """How many requests got identical token ids in both results."""
    return sum(x == y for x, y in zip(a.token_ids, b.token_ids))


# -- minivllm ------------------------------------------------------------------------------------------

def run_engine(workload: Workload, model: str = "smollm2-135m", name: str = "minivllm", progress: bool = False,
               **engine_options) -> BenchResult:
    """Replay ``workload`` through a fresh :class:`~minivllm.LLM` built with ``engine_options``.

    One short untimed request warms the engine up first. Unless ``num_blocks``
    is given, the KV pool holds every request at once (a memory-pressure
    workload gets its squeezed pool instead).
    """
    block_size = engine_options.get("block_size", 16)
    engine_options.setdefault("max_num_seqs", max(16, len(workload.arrivals)))
    if "num_blocks" not in engine_options:  # the squeezed pool, or room for every request at once (and the warm-up)
        engine_options["num_blocks"] = (workload.num_blocks(block_size) if workload.pool_fraction is not None
                                        else workload.kv_blocks_needed(block_size) + cdiv(64, block_size))
    llm = LLM(model, **engine_options)
    try:
        warm_up(llm)
        engine = llm.engine
        device = engine.runner.device
        before = engine.stats()
        with Progress(name, sum(workload.max_tokens), enabled=progress) as bar:
            trace = replay(engine, workload.arrivals, device, label=name, on_step=lambda r: bar.update(r.sampled))
    except BaseException:  # Ctrl-C too: no tensor-parallel worker outlives the run
        llm.shutdown()
        raise
    stats = engine.stats()
    for f in ("num_preemptions", "num_recomputed_tokens", "num_swapped_bytes"):  # leave out the warm-up
        setattr(stats, f, getattr(stats, f) - getattr(before, f))
    ids = [a.request_id for a in workload.arrivals]
    return BenchResult(name, trace.seconds, [trace.token_ids[i] for i in ids], [trace.metrics[i] for i in ids],
                       trace.steps, stats, trace.start)


# -- Baselines: what a user would run instead (offline workloads: every request is there at t=0) ------

def _offline_only(workload: Workload, who: str) -> None:
    if not workload.is_offline:
        raise ValueError(f"{who} runs offline workloads only (every request at the start); "
                         f"{workload.name!r} has arrivals over time")


def _result(name, start, end, token_ids, token_times, workload) -> BenchResult:
    requests = [RequestTimes(start, list(t), len(p)) for t, p in zip(token_times, workload.prompts)]
    return BenchResult(name, end - start, [list(x) for x in token_ids], requests, start=start)


def _progress(name: str, workload: Workload, enabled: bool) -> Progress:
    """A baseline's progress line: output tokens and finished requests of the workload's."""
    return Progress(name, sum(workload.max_tokens), requests=len(workload.prompts), enabled=enabled)


def _one_at_a_time(name, generate, model, workload: Workload, progress: bool = False) -> BenchResult:
    _offline_only(workload, name)
    device = model.lm_head.weight.device
    generate(model, workload.prompts[0][:8], 2)  # warm-up
    ids, times = [], []
    with _progress(name, workload, progress) as bar:
        start = now(device)
        for prompt, n in zip(workload.prompts, workload.max_tokens):
            called = time.perf_counter()
            r = generate(model, prompt, n)
            ids.append(r.token_ids)
            times.append(list(itertools.accumulate(r.step_times_s, initial=called + r.ttft_s)))
            bar.update(n, 1)
        end = now(device)
    return _result(name, start, end, ids, times, workload)


def run_naive(model, workload: Workload, progress: bool = False) -> BenchResult:
    """Chapter 01's loop without a KV cache: every token recomputes the whole sequence, one request at a time."""
    return _one_at_a_time("naive (no KV cache)", generate_naive, model, workload, progress)


def run_contiguous(model, workload: Workload, progress: bool = False) -> BenchResult:
    """Chapter 01's contiguous KV cache, one request at a time."""
    return _one_at_a_time("contiguous KV cache, one at a time", generate_cached, model, workload, progress)


def run_static(model, workload: Workload, batch_size: int = 16, progress: bool = False) -> BenchResult:
    """Chapter 06's static padded batches on minivllm's own model: the batching policy is the only change."""
    _offline_only(workload, "static batching")
    device = model.lm_head.weight.device
    static_batch_generate(model, workload.prompts[:1], [2], 1)
    name = f"static batches of {batch_size}"
    with _progress(name, workload, progress) as bar:
        start = now(device)
        out = static_batch_generate(model, workload.prompts, workload.max_tokens, batch_size, on_step=bar.update)
        end = now(device)
    return _result(name, start, end, out.token_ids, out.token_times, workload)


class _TokenClock:
    """A transformers StoppingCriteria that never stops: it notes when each generation step's tokens exist, and
    calls ``on_step(step)`` after each (progress; Ctrl-C lands between two steps)."""

    def __init__(self, on_step=None):
        self.times: list[float] = []
        self.on_step = on_step

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        if self.on_step is not None:
            self.on_step(len(self.times))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_hf_generate(hf_model, workload: Workload, batch_size: int = 1, progress: bool = False) -> BenchResult:
    """HF transformers ``generate``: one request at a time (``batch_size=1``) or static left-padded batches."""
    from transformers import StoppingCriteriaList  # optional and heavy: only the HF baseline needs it

    _offline_only(workload, "HF generate")
    device = hf_model.device
    pad_id = _hf_generation_config(hf_model, 1).pad_token_id
    prompts, wants = workload.prompts, workload.max_tokens

    def generate(batch, n, on_step=None):
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        clock = _TokenClock(on_step)
        with torch.inference_mode():
            gen = hf_model.generate(input_ids=ids, attention_mask=mask, stopping_criteria=StoppingCriteriaList([clock]),
                                    generation_config=_hf_generation_config(hf_model, n))
        return gen[:, width:].tolist(), clock.times

    generate([prompts[0][:8]], 2)  # warm-up
    ids, times = [], []
    name = "HF generate, one at a time" if batch_size == 1 else f"HF generate, static batches of {batch_size}"
    with _progress(name, workload, progress) as bar:
        start = now(device)
        for lo in range(0, len(prompts), batch_size):
            batch, n = prompts[lo:lo + batch_size], wants[lo:lo + batch_size]
            out, clock = generate(batch, max(n), lambda step: bar.update(sum(k >= step for k in n),
                                                                           sum(k == step for k in n)))
            ids += [o[:k] for o, k in zip(out, n)]
            times += [clock[:k] for k in n]
        end = now(device)
    return _result(name, start, end, ids, times, workload)


def run_hf_generate_batch(hf_model, workload: Workload, progress: bool = False) -> BenchResult:
    """HF transformers continuous batching, ``generate_batch`` (paged attention), on the same requests."""
    _offline_only(workload, "HF generate_batch")
    device = hf_model.device
    hf_generate_batch(hf_model, [workload.prompts[0][:8]], [2])  # warm-up
    name = "HF generate_batch (continuous batching)"

    def on_progress(tokens, requests):
        bar.done, bar.requests_done = tokens, requests
        bar.tick()

    with _progress(name, workload, progress) as bar:
        start = now(device)
        ids, times = hf_generate_batch(hf_model, workload.prompts, workload.max_tokens, timestamps=True,
                                       on_progress=on_progress)
        end = now(device)
    return _result(name, start, end, ids, times, workload)


# -- The ladder: one optimisation per rung (chapter 11) -------------------------------------------------

LADDER = ["naive (no KV cache)", "contiguous KV cache, one at a time", "static batches",
          "continuous batching + paged KV"]


def run_ladder(workload: Workload, model: str = "smollm2-135m", device=None, batch_size: int = 8,
               rungs=None, **engine_options) -> list[BenchResult]:
    """``workload`` through every rung of :data:`LADDER` (or the named ``rungs``), in order, same model.

    The later chapters' features (paging against reservation, prefix caching,
    chunked prefill) need workloads of their own to show anything, so chapter 11
    runs them as pairs with :func:`run_engine` (and :class:`ReservingBlockManager`).
    """
    rungs = LADDER if rungs is None else rungs
    unknown = set(rungs) - set(LADDER)
    if unknown:
        raise ValueError(f"rungs must be among {LADDER}, got {sorted(unknown)}")
    m, _ = load_model(model, device)  # float32: every rung, the engine too, runs the same weights in the same dtype
    opts = dict(device=str(m.lm_head.weight.device), dtype="float32", **engine_options)
    runs = {
        LADDER[0]: lambda: run_naive(m, workload),
        LADDER[1]: lambda: run_contiguous(m, workload),
        LADDER[2]: lambda: run_static(m, workload, batch_size),
        LADDER[3]: lambda: run_engine(workload, model, LADDER[3], **opts),
    }
    return [runs[r]() for r in rungs]


class ReservingBlockManager(MiniBlockManager):
    """Continuous batching without paging's point: a request claims room for prompt + max_tokens when admitted.

    That is a contiguous cache's reservation (chapter 03), counted in blocks,
    so at the same memory budget it shows what paging, allocating as tokens
    arrive, adds to continuous batching: more requests fit at once (chapter 11).
    """

    def allocate(self, seq, num_tokens, cached_blocks=(), watermark=False, restored=()):
        reservation = seq.num_prompt_tokens + seq.params.max_tokens
        return super().allocate(seq, max(num_tokens, reservation), cached_blocks, watermark, restored)


def format_results(results: list[BenchResult], reference: BenchResult | None = None, slo: dict | None = None,
                   roofline_seconds: float | None = None) -> str:
    """One line per system: time, output tok/s, ratio to ``reference``, TTFT/TPOT/ITL in ms, same outputs.

    The name column is as wide as the longest name (at most 42 characters), the others as their
    headers, so a table of the ladder's or the HF baselines' names fits in 100 characters.
    """
    ref = reference or results[0]
    width = min(42, max(len("system"), *(len(r.name) for r in results)))
    head = (f"{'system':<{width}} {'time s':>6} {'tok/s':>6} {'ratio':>5} {'TTFT p50':>8} {'TTFT p99':>8} "
            f"{'TPOT p50':>8} {'ITL p99':>7} {'same':>5}")
    if slo:
        head += f" {'goodput':>8}"
    if roofline_seconds:
        head += f" {'roofline':>8}"
    lines = [head]
    for r in results:
        m = r.metrics(slo)
        line = (f"{r.name[:width]:<{width}} {r.seconds:6.2f} {r.throughput:6.1f} {r.throughput / ref.throughput:4.2f}x "
                f"{m.ttft.p50 * 1e3:6.0f}ms {m.ttft.p99 * 1e3:6.0f}ms {m.tpot.p50 * 1e3:6.1f}ms "
                f"{m.itl.p99 * 1e3:5.0f}ms {same_outputs(r, ref):>2}/{len(r.token_ids):<2}")
        if slo:
            line += f" {m.goodput:6.2f}/s"
        if roofline_seconds:
            line += f" {roofline_seconds / r.seconds:8.0%}"
        lines.append(line)
    return "\n".join(line.rstrip() for line in lines)


# -- The machine's limits and the workload's roofline ----------------------------------------------------

@dataclass
class MachineLimits:
    """What this device can do at best: matmul FLOP/s at the model's own shapes, and memory bandwidth."""

    flops: float  # best FLOP/s measured over the model's linear layers
    bandwidth: float  # bytes/s, streaming a buffer much larger than the caches
    flops_by_tokens: dict = field(default_factory=dict)  # tokens per matmul -> FLOP/s

    def __str__(self) -> str:
        by = ", ".join(f"{t}: {f / 1e9:.0f}" for t, f in self.flops_by_tokens.items())
        return (f"matmul {self.flops / 1e9:.0f} GFLOP/s at best, memory {self.bandwidth / 1e9:.1f} GB/s\n"
                f"  matmul GFLOP/s by tokens per matmul: {by}")  # two lines: each within 100 characters


def _linears(model):
    return [m for m in model.model.layers.modules() if isinstance(m, Linear)]


@torch.inference_mode()
def measure_machine(model, token_counts=(1, 16, 64, 256, 1024), repeats: int = 3,
                    buffer_bytes: int = 512 * 2**20) -> MachineLimits:
    """Time one decoder layer's matmuls at each token count, and a large buffer's read.

    Runs the layer's own projections as the forward runs them (fused where
    :meth:`~minivllm.models.llama.LlamaForCausalLM.pack_weights` fused them),
    so the figures are for the kernels the engine runs (timed with
    :class:`~minivllm.bench.timing.Timer`: CUDA events on a GPU).
    """
    device = model.lm_head.weight.device
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    layer = [m for m in _linears(model) if m in set(model.model.layers[0].modules())]
    flop_per_token = 2 * sum(m.weight.numel() for m in layer)
    matmuls = [(attn.q_proj.in_features, attn.project_qkv), (attn.o_proj.in_features, attn.o_proj),
               (mlp.gate_proj.in_features, mlp.project_gate_up), (mlp.down_proj.in_features, mlp.down_proj)]
    dtype = model.lm_head.weight.dtype
    by_tokens = {}
    for t in token_counts:
        xs = {n: torch.randn(t, n, device=device, dtype=dtype) for n, _ in matmuls}
        best = float("inf")
        for _ in range(repeats + 1):
            with Timer(device) as timer:
                for n, matmul in matmuls:
                    matmul(xs[n])
            best = min(best, timer.seconds)
        by_tokens[t] = flop_per_token * t / best
    buf = torch.empty(buffer_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    best = float("inf")
    for _ in range(repeats + 1):
        with Timer(device) as timer:
            buf.sum()
        best = min(best, timer.seconds)
    return MachineLimits(max(by_tokens.values()), buffer_bytes / best, by_tokens)


def matmul_layouts(model, rows=(1, 2, 4, 16), repeats: int = 5) -> dict[int, dict[str, float]]:
    """Seconds for all of a forward's matmuls at each row count, through each weight layout (chapter 12).

    ``"plain"`` multiplies by the row-major weights (``F.linear``), ``"packed"``
    by oneDNN's blocked copies, each over every layer's own weights in turn
    (as a decode step streams them, not one cache-hot matrix), alternating;
    each figure is the median of ``repeats``. With the C++ kernels
    (``model.kernels == "cpu"``) their streaming matrix-vector product is
    ``"cpu kernel"`` too, up to its rows (chapter 18). Needs a packed model
    (``pack_weights=True`` on a float32 CPU).
    """
    if model.lm_head.packed is None:
        raise ValueError("matmul_layouts needs a model with packed weights (pack_weights=True, float32 on the CPU)")
    pairs = model.layout_pairs()
    run = {"plain": lambda xs: [F.linear(xs[w.shape[1]], w) for w, _ in pairs],
           "packed": lambda xs: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                 for w, p in pairs]}
    out = {}
    with torch.inference_mode():
        for r in rows:
            kernels = dict(run)
            if model.kernels == "cpu" and r <= QUANTIZED_MAX_ROWS:
                kernels["cpu kernel"] = lambda xs: [model.ops.linear(xs[w.shape[1]], w) for w, _ in pairs]
            xs = {k: torch.randn(r, k, dtype=pairs[0][0].dtype) for k in {w.shape[1] for w, _ in pairs}}
            times = {name: [] for name in kernels}
            for _ in range(repeats + 1):  # alternating, after one warm-up round
                for name, matmuls in kernels.items():
                    start = time.perf_counter()
                    matmuls(xs)
                    times[name].append(time.perf_counter() - start)
            out[r] = {name: statistics.median(t[1:]) for name, t in times.items()}
    return out


def roofline(model, workload: Workload, limits: MachineLimits) -> dict:
    """The fastest this machine could run ``workload``: a lower bound on time, whatever the engine.

    Every prompt token costs its matmul and attention FLOPs at the best FLOP/s
    measured; then each decode step carries every request still generating (an
    ideal continuous batch of any size) and costs the larger of its FLOPs and its
    bytes (all weights, plus each sequence's KV) at the measured bandwidth.
    Arrival times are ignored, so for online workloads it bounds the work only.
    """
    c = model.config
    weights = sum(m.weight.numel() for m in _linears(model))
    elem = model.lm_head.weight.element_size()
    vocab_flops = 2 * model.lm_head.weight.numel()
    weight_bytes = (weights + model.lm_head.weight.numel()) * elem
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * model.head_dim * elem
    attn_per_key = 4 * c.num_hidden_layers * c.num_attention_heads * model.head_dim  # q.k and p.v per query-key pair

    def token_flops(pos: int) -> float:  # the token at position ``pos`` attends to pos + 1 keys
        return 2 * weights + attn_per_key * (pos + 1)

    prompts, outs = [len(p) for p in workload.prompts], workload.max_tokens
    prefill_flops = sum(sum(token_flops(i) for i in range(p)) + vocab_flops for p in prompts)
    prefill_s = prefill_flops / limits.flops
    decode_s = 0.0
    for step in range(1, max(outs)):
        active = [(p, n) for p, n in zip(prompts, outs) if n > step]
        flops = sum(token_flops(p + step - 1) + vocab_flops for p, _ in active)
        nbytes = weight_bytes + sum((p + step) * kv_per_token for p, _ in active)
        decode_s += max(flops / limits.flops, nbytes / limits.bandwidth)
    seconds = prefill_s + decode_s
    return {"seconds": seconds, "prefill_s": prefill_s, "decode_s": decode_s,
            "throughput": sum(outs) / seconds}


# -- Where the time goes: the phases of one engine step (chapter 11) --------------------------------------

def _start_decoding(llm, batch: int, prompt_len: int, steps: int, seed: int, label: str) -> list[str]:
    """``batch`` requests of ``prompt_len`` random tokens, prefilled and one step into decoding; their ids.

    Each has room for ``steps`` more decode steps. The step breakdowns below
    time the steps that follow, then abort these requests.
    """
    engine = llm.engine
    prompts, _ = random_workload(llm.get_tokenizer(), batch, (prompt_len, prompt_len), (1, 1), seed)
    ids = [f"{label}-{batch}-{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, _exactly(steps + 3))
    while any(s.status.name != "RUNNING" or not s.output_token_ids for s in engine.scheduler.sequences
              if s.request_id in ids):
        engine.step()
    engine.step()  # the first all-decode step: not measured
    return ids


OP_KINDS = {  # profiler op name -> what it is, for decode_op_breakdown (first match wins)
    "linear": "matmuls", "addmm": "matmuls", "aten::mm": "matmuls", "aten::bmm": "matmuls",
    "index_select": "KV gather", "scaled_dot_product": "attention", "varlen_attn": "attention",
    "index_copy": "KV write", "aten::max": "sampling", "argmax": "sampling",
    "minivllm::paged_attention": "attention", "minivllm::write_kv": "KV write",  # the kernel table's (chapter 18)
    "_linear": "matmuls",  # minivllm::linear, q4_1_linear, q8_0_linear
}


def _op_kind(event) -> str:
    """The kind of a profiler event, by its name (:data:`OP_KINDS`)."""
    return next((k for pattern, k in OP_KINDS.items() if pattern in event.name), "other ops")


def decode_op_breakdown(llm, batch: int, prompt_len: int = 64, steps: int = 5, seed: int = 0) -> dict[str, float]:
    """Seconds per decode step with ``batch`` running requests, by kind of op (chapter 12).

    Runs ``steps`` all-decode steps under the PyTorch profiler and sums each
    op's own time (device time on a GPU) into the kinds of :data:`OP_KINDS`;
    everything else is ``"other ops"`` (norms, RoPE, activations, residuals,
    indexing). ``"total"`` is their sum: op time, without the Python between ops.
    ``"calls"`` counts the operator calls a step makes (every event the
    profiler records: torch's ops and the kernel table's, chapter 18). The
    steps run op by op: the fused decode step (chapter 18e) is one native call
    of the same kernels, which the profiler cannot split into kinds.
    """
    from torch.profiler import ProfilerActivity

    engine = llm.engine
    ids = _start_decoding(llm, batch, prompt_len, steps, seed, "ops")
    cuda = torch.device(engine.runner.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    kv = engine.runner.kv_cache
    fused, kv.fused_decode = getattr(kv, "fused_decode", False), False
    try:
        with quiet_profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            if cuda:
                torch.cuda.synchronize()
    finally:
        kv.fused_decode = fused
    for rid in ids:
        engine.abort_request(rid)
    out = dict.fromkeys([*dict.fromkeys(OP_KINDS.values()), "other ops"], 0.0)
    for event in prof.events():
        us = getattr(event, "self_device_time_total", 0) if cuda else event.self_cpu_time_total
        out[_op_kind(event)] += us / 1e6 / steps
    out["total"] = sum(out.values())
    out["calls"] = len(prof.events()) / steps
    return out


def step_breakdown(llm, batch_sizes=(1, 2, 4, 8, 16, 32, 64), prompt_len: int = 64, steps: int = 5,
                   seed: int = 0) -> dict[int, dict[str, float]]:
    """Median seconds per phase of a decode step with ``B`` running requests, for each ``B``.

    Phases: schedule, swap, prepare (input tensors), forward (the model),
    sample (logits and sampling), update (scheduler bookkeeping), detokenize.
    ``"python"`` is everything outside the forward and the logits: the engine's
    own overhead, which a bigger batch amortises. Each figure is the median over
    ``steps`` steps, so the phases need not add up to the median total exactly.
    """
    engine = llm.engine
    engine.sync_phase_timing = True
    out = {}
    try:
        for B in batch_sizes:
            ids = _start_decoding(llm, B, prompt_len, steps, seed + B, "breakdown")
            samples = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                phases = dict(engine.last_step_phases, total=time.perf_counter() - t0)
                phases["python"] = phases["total"] - phases.get("forward", 0.0) - phases.get("sample", 0.0)
                samples.append(phases)
            for rid in ids:
                engine.abort_request(rid)
            out[B] = {k: statistics.median(s.get(k, 0.0) for s in samples) for k in samples[0]}
    finally:
        engine.sync_phase_timing = False
    return out
