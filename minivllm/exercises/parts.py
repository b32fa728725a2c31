"""The parts the exercises have the reader write (every exercise, the capstones): one table, :data:`PARTS`.

Each :class:`Part` says where its notebook writes it (``your_engine/<module>.py``), the name it defines there,
the check that tests it, the methods a class part's exercise asks for and minivllm's own class that completes
the rest (its ``Mini...`` class, which the notebook does not point to), and for an engine part the
``EngineConfig`` extension point the capstone plugs it into. A later chapter's part is one more line. This
module imports no other of ``minivllm.exercises`` (it names them as strings, loaded on first use), so each of
them may import it: the live engine (``load_part``), the progress report, the capstone.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["PARTS_DIR", "Part", "PARTS", "CHAPTERS", "WHAT_WIDTH", "CHAPTER_WIDTH"]

PARTS_DIR = Path("your_engine")  # next to the notebooks: each exercise writes its part here


def _load(where: str):
    """``"module:name"`` (a module of minivllm) -> the object, importing the module."""
    module, name = where.split(":")
    return getattr(importlib.import_module(f"minivllm.{module}"), name)


@dataclass(frozen=True)
class Part:
    """One part the reader writes: where its exercise puts it, what checks it, where the engine takes it.

    The check, the methods and minivllm's own class are named ``"module:name"`` (modules of minivllm) and load
    on first use (:attr:`check`, :attr:`methods`, :attr:`impl`): saying which parts exist needs no torch.
    """

    chapter: str
    module: str  # your_engine/<module>.py, or the file itself where it is not Python (exercise 18's .cpp)
    name: str  # the function or class the notebook defines there
    check_at: str  # minivllm.exercises' check of it
    what: str
    extension: str | None = None  # the EngineConfig field an engine part plugs into (the capstone)
    methods_at: str | None = None  # a class part: the methods its exercise asks for
    impl_at: str | None = None  # a class part: minivllm's own class, whose methods complete the reader's (load_part)

    @property
    def check(self) -> Callable:
        """minivllm.exercises' check of the part."""
        return _load(self.check_at)

    @property
    def methods(self) -> tuple[str, ...]:
        """A class part: the methods its exercise asks for (``()`` for a function part)."""
        return _load(self.methods_at) if self.methods_at else ()

    @property
    def impl(self) -> type | None:
        """A class part: minivllm's own class, whose methods complete the reader's (``load_part``)."""
        return _load(self.impl_at) if self.impl_at else None

    @property
    def file(self) -> str:
        """The part's file under ``your_engine/``."""
        return self.module if Path(self.module).suffix else f"{self.module}.py"


PARTS = [
    Part("01", "prefill_decode", "generate_cached", "exercises.prefill_decode:check_generate_cached",
         "generate with a KV cache"),
    Part("02", "chunked_attention", "chunked_causal", "exercises.chunked_prefill_exact:check_chunked_causal",
         "chunked causal attention"),
    Part("03", "kv_cache_memory", "kv_bytes_per_token", "exercises.kv_cache_memory:check_kv_bytes_per_token",
         "KV bytes per token"),
    Part("03", "paged_waste", "paged_waste", "exercises.kv_cache_memory:check_paged_waste",
         "what a paged cache leaves empty"),
    Part("04", "block_manager", "MyBlockManager", "exercises.block_manager:check_block_manager",
         "block manager: allocate, free, slots", "block_manager_cls", "exercises.block_manager:METHODS",
         "block_manager:MiniBlockManager"),
    Part("05", "paged_attention", "MyPagedKVCache", "exercises.paged_attention:check_paged_attention",
         "paged attention", "attention_backend", "exercises.paged_attention:METHODS", "attention:MiniPagedKVCache"),
    Part("06", "scheduler_admission", "MyScheduler", "exercises.continuous_batching:check_scheduler",
         "scheduler: decodes first, admission", "scheduler_cls", "exercises.continuous_batching:METHODS",
         "scheduler:MiniScheduler"),
    Part("07", "sampler", "MySampler", "exercises.sampling_streaming:check_sampler", "sampler", "sampler",
         "exercises.sampling_streaming:SAMPLER_METHODS", "sampler:MiniSampler"),
    Part("07", "detokenizer", "MyDetokenizer", "exercises.sampling_streaming:check_detokenizer",
         "incremental detokenizer", "detokenizer", "exercises.sampling_streaming:DETOKENIZER_METHODS",
         "detokenizer:MiniIncrementalDetokenizer"),
    Part("08", "prefix_caching", "MyBlockManager", "exercises.prefix_caching:check_prefix_cache",
         "block manager: prefix caching", "block_manager_cls", "exercises.prefix_caching:METHODS",
         "block_manager:MiniBlockManager"),
    Part("09", "chunked_prefill", "MyScheduler", "exercises.chunked_prefill:check_chunked_prefill",
         "scheduler: chunked prefill", "scheduler_cls", "exercises.chunked_prefill:METHODS",
         "scheduler:MiniScheduler"),
    Part("10", "preemption", "MyScheduler", "exercises.preemption:check_preemption", "scheduler: preemption",
         "scheduler_cls", "exercises.preemption:METHODS", "scheduler:MiniScheduler"),
    Part("11", "metrics", "request_latencies", "exercises.benchmarks:check_request_latencies", "request latencies"),
    Part("11", "metrics", "goodput", "exercises.benchmarks:check_goodput", "goodput"),
    Part("12", "graph_runner", "MyGraphRunner", "exercises.where_time_goes:check_graph_runner",
         "CUDA-graph decode batch: the padding rule", "graph_runner_cls", "exercises.where_time_goes:METHODS",
         "cuda_graphs:MiniDecodeGraphRunner"),
    Part("13", "engine_loop", "MyEngineLoop", "exercises.serving:check_engine_loop",
         "the server's engine loop (AsyncLLM)", None, "exercises.serving:METHODS",
         "serving.engine_loop:MiniEngineLoop"),
    Part("14", "offload_tier", "MyOffloadTier", "exercises.kv_offload:check_offload_tier",
         "CPU offload tier of the prefix cache", "offload_tier_cls", "exercises.kv_offload:METHODS",
         "kv_tier:MiniOffloadTier"),
    Part("15", "tensor_parallel", "shard_weight", "exercises.tensor_parallel:check_shard_weight",
         "tensor-parallel shards of a Llama layer"),
    Part("16", "disaggregation", "MyHandoff", "exercises.disaggregation:check_kv_handoff",
         "KV handoff: ownership and fingerprints", None, "exercises.disaggregation:METHODS"),
    Part("17", "spec_decode", "MySpecAcceptor", "exercises.spec_decode:check_spec_acceptor",
         "speculative decoding: accept, rollback", "spec_acceptor_cls", "exercises.spec_decode:METHODS",
         "spec_decode:MiniSpecAcceptor"),
    Part("18", "kernels_inner.cpp", "kernels", "exercises.kernels:check_kernels",
         "kernels: attention tile, Q4_1 dot (C++)", "kernels"),
    Part("18b", "int8_block_dot.cpp", "block_dot", "exercises.integer_dots:check_block_dot",
         "Q4_1 x Q8_1 block dot: integers (C++)"),
    Part("18c", "split_kv", "merge_partials", "exercises.split_kv:check_merge_partials",
         "split-KV: merge partial softmaxes"),
    Part("19", "grammar_masker", "MyGrammarMasker", "exercises.structured_output:check_grammar_masker",
         "structured outputs: the grammar's mask", "grammar_masker_cls", "exercises.structured_output:METHODS",
         "sampler:MiniGrammarMasker"),
]

CHAPTERS = sorted({p.chapter for p in PARTS})  # the chapters whose exercises have a part: status --chapters
WHAT_WIDTH = max(len(p.what) for p in PARTS)  # one column for the parts' descriptions, whichever are listed
CHAPTER_WIDTH = max(len(p.chapter) for p in PARTS)  # and for their chapters ("18b" is one character wider)
