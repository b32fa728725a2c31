"""Where the reader's engine stands: ``python -m minivllm.exercises status`` (every exercise, and the capstones).

:data:`PARTS` is the one list of the parts the exercises have the reader
write: where the notebook writes each (``your_engine/<module>.py``), the name
it defines there, the check that tests it, and for an engine part the
``EngineConfig`` extension point the capstone plugs it into. A later
chapter's part is one more line. :func:`status` says of each part whether it
is written (its file exists and no ``raise NotImplementedError("not written
yet: ...")`` is left in it) and whether its check passes, with the first line
of the check's message where it does not.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from minivllm.exercises._common import NOT_WRITTEN
from minivllm.exercises.benchmarks import check_goodput, check_request_latencies
from minivllm.exercises.block_manager import check_block_manager
from minivllm.exercises.chunked_prefill import check_chunked_prefill
from minivllm.exercises.chunked_prefill_exact import check_chunked_causal
from minivllm.exercises.continuous_batching import check_scheduler
from minivllm.exercises.disaggregation import check_kv_handoff
from minivllm.exercises.kv_cache_memory import check_kv_bytes_per_token, check_paged_waste
from minivllm.exercises.kv_offload import check_offload_tier
from minivllm.exercises.live import PARTS_DIR, load_part
from minivllm.exercises.paged_attention import check_paged_attention
from minivllm.exercises.preemption import check_preemption
from minivllm.exercises.prefill_decode import check_generate_cached
from minivllm.exercises.prefix_caching import check_prefix_cache
from minivllm.exercises.sampling_streaming import check_detokenizer, check_sampler
from minivllm.exercises.serving import check_engine_loop
from minivllm.exercises.spec_decode import check_spec_acceptor
from minivllm.exercises.tensor_parallel import check_shard_weight
from minivllm.exercises.where_time_goes import check_graph_runner

__all__ = ["Part", "PARTS", "stubs", "status", "main"]


@dataclass(frozen=True)
class Part:
    """One part the reader writes: where its exercise puts it, what checks it, where the engine takes it."""

    chapter: str
    module: str  # your_engine/<module>.py
    name: str  # the function or class the notebook defines there
    check: Callable  # minivllm.exercises' check of it
    what: str
    extension: str | None = None  # the EngineConfig field an engine part plugs into (the capstone)


PARTS = [
    Part("01", "prefill_decode", "generate_cached", check_generate_cached, "generate with a KV cache"),
    Part("02", "chunked_attention", "chunked_causal", check_chunked_causal, "chunked causal attention"),
    Part("03", "kv_cache_memory", "kv_bytes_per_token", check_kv_bytes_per_token, "KV bytes per token"),
    Part("03", "paged_waste", "paged_waste", check_paged_waste, "what a paged cache leaves empty"),
    Part("04", "block_manager", "MyBlockManager", check_block_manager, "block manager: allocate, free, slots",
         "block_manager_cls"),
    Part("05", "paged_attention", "MyPagedKVCache", check_paged_attention, "paged attention", "attention_backend"),
    Part("06", "scheduler_admission", "MyScheduler", check_scheduler, "scheduler: decodes first, admission",
         "scheduler_cls"),
    Part("07", "sampler", "MySampler", check_sampler, "sampler", "sampler"),
    Part("07", "detokenizer", "MyDetokenizer", check_detokenizer, "incremental detokenizer", "detokenizer"),
    Part("08", "prefix_caching", "MyBlockManager", check_prefix_cache, "block manager: prefix caching",
         "block_manager_cls"),
    Part("09", "chunked_prefill", "MyScheduler", check_chunked_prefill, "scheduler: chunked prefill", "scheduler_cls"),
    Part("10", "preemption", "MyScheduler", check_preemption, "scheduler: preemption", "scheduler_cls"),
    Part("11", "metrics", "request_latencies", check_request_latencies, "request latencies"),
    Part("11", "metrics", "goodput", check_goodput, "goodput"),
    Part("12", "graph_runner", "MyGraphRunner", check_graph_runner, "CUDA-graph decode batch: the padding rule",
         "graph_runner_cls"),
    Part("13", "engine_loop", "MyEngineLoop", check_engine_loop, "the server's engine loop (AsyncLLM)"),
    Part("14", "offload_tier", "MyOffloadTier", check_offload_tier, "CPU offload tier of the prefix cache",
         "offload_tier_cls"),
    Part("15", "tensor_parallel", "shard_weight", check_shard_weight, "tensor-parallel shards of a Llama layer"),
    Part("16", "disaggregation", "MyHandoff", check_kv_handoff, "KV handoff: ownership and fingerprints"),
    Part("17", "spec_decode", "MySpecAcceptor", check_spec_acceptor, "speculative decoding: accept, rollback",
         "spec_acceptor_cls"),
]


def _source(f) -> str:
    try:
        return inspect.getsource(f)
    except (OSError, TypeError):
        return ""


def stubs(obj) -> list[str]:
    """The functions of a part (a function, or a class's own methods) that still raise the exercise's stub."""
    members = vars(obj).items() if inspect.isclass(obj) else [(obj.__name__, obj)]
    return [f"{obj.__name__}.{n}" if inspect.isclass(obj) else n
            for n, f in members if callable(f) and f'NotImplementedError("{NOT_WRITTEN}' in _source(f)]


class CtrlC(KeyboardInterrupt):
    """Ctrl-C pressed while a part loads or is checked: it stops the command, as Ctrl-C does."""


@contextlib.contextmanager
def _ctrl_c_stops_the_command():
    """Ctrl-C raises :class:`CtrlC` meanwhile, so that a KeyboardInterrupt a part raises itself is told apart."""
    def pressed(signum, frame):
        raise CtrlC

    try:
        previous = signal.signal(signal.SIGINT, pressed)
    except ValueError:  # not the main thread, where Ctrl-C never lands
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stopped(e: BaseException) -> str:
    """How a part failed, for its line; a Ctrl-C the user pressed is not the part's: it goes on up."""
    if isinstance(e, CtrlC):
        raise KeyboardInterrupt from None
    return "" if isinstance(e, Exception) else " (a part must not stop the program)"


def part_status(part: Part, parts_dir: Path = PARTS_DIR, run_check: bool = True) -> tuple[str, str]:
    """``(state, detail)``: state is "missing", "not written", "fails" or "passes". Any way the part's code stops
    (an exception, ``sys.exit``, a KeyboardInterrupt it raises) is its failure; Ctrl-C still stops the command."""
    with _ctrl_c_stops_the_command():
        return _part_status(part, parts_dir, run_check)


def _part_status(part: Part, parts_dir: Path, run_check: bool) -> tuple[str, str]:
    path = Path(parts_dir) / f"{part.module}.py"
    if not path.exists():
        return "missing", f"{path} does not exist: run exercise {part.chapter}'s %%writefile cell"
    try:
        obj = load_part(part.module, part.name, parts_dir)
    except BaseException as e:  # a syntax error, a missing name, sys.exit: the reader's file, reported
        return "fails", f"{path} does not load: {type(e).__name__}: {e}{_stopped(e)}"
    left = stubs(obj)
    if left:
        return "not written", f"{NOT_WRITTEN}: {', '.join(left)}"
    if not run_check:
        return "written", ""
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the check's own success lines
            part.check(obj)
    except BaseException as e:  # AssertionError names the mistake; anything else is the reader's code failing
        message = (str(e).strip().split("\n")[0] or type(e).__name__) + _stopped(e)
        return "fails", message if isinstance(e, AssertionError) else f"{type(e).__name__}: {message}"
    return "passes", ""


def status(parts_dir: Path = PARTS_DIR, chapters: list[str] | None = None, run_checks: bool = True,
           out=print) -> bool:
    """Print one line per part (chapters: only those); True when every part listed is written and passes."""
    chosen = [p for p in PARTS if not chapters or p.chapter in chapters]
    states = []
    for part in chosen:
        state, detail = part_status(part, parts_dir, run_checks)
        states.append(state)
        out(f"{part.chapter} {part.what:38} {state:12} {detail}".rstrip())
    written = sum(s not in ("missing", "not written") for s in states)
    passing = states.count("passes")
    out(f"{written} of {len(chosen)} parts written" + (f", {passing} pass their checks" if run_checks else "")
        + f" (your parts: {Path(parts_dir).resolve()})")
    return passing == len(chosen)
