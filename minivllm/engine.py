"""The serving loop and its front door: ``LLMEngine`` and ``LLM`` (chapters 06 and 07).

``LLMEngine.step()`` is one turn of continuous batching: schedule, run one
forward, sample, update, and return a ``RequestOutput`` for every request that
produced a token (with the new text, detokenized incrementally). ``LLM`` wraps
it for offline use: ``generate`` a list of prompts, or ``stream`` one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

import torch

from minivllm.bench.timing import PhaseClock
from minivllm.block_manager import BlockManager
from minivllm.config import EngineConfig, free_memory_bytes, is_int
from minivllm.attention import PagedKVCache
from minivllm.detokenizer import IncrementalDetokenizer
from minivllm.model_runner import ModelRunner
from minivllm.models import load_model
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import Scheduler, SchedulerOutput
from minivllm.sequence import RequestMetrics, Sequence, SequenceStatus


@dataclass
class CompletionOutput:
    index: int
    text: str  # everything generated so far
    token_ids: list[int]
    delta_text: str = ""  # what this step added
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics


@dataclass
class EngineStats:
    num_running: int
    num_prefilling: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_recomputed_tokens: int = 0
    num_swapped_bytes: int = 0
    num_free_cpu_blocks: int = 0
    num_total_cpu_blocks: int = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def kv_utilization(self) -> float:
        return self.num_used_blocks / self.num_total_blocks


class LLMEngine:
    """A request-level serving engine over one model and one paged KV pool."""

    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        self.model, self.tokenizer = load_model(config.model, config.torch_device, config.torch_dtype)
        self.vocab_size = self.model.config.vocab_size
        self.max_model_len = config.max_model_len or self.model.config.max_position_embeddings
        self.num_blocks = config.num_blocks or self._blocks_from_memory()
        self.num_cpu_blocks = 0 if config.preemption_mode != "swap" else (
            self.num_blocks if config.num_cpu_blocks is None else config.num_cpu_blocks)
        self.kv_bytes_per_block = PagedKVCache.bytes_per_token(self.model) * config.block_size
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching,
                                          self.num_cpu_blocks)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, self._eos_token_ids(),
                                   self.kv_bytes_per_block)
        self.runner = ModelRunner(self.model, self.num_blocks, config.block_size, config.seed, self.num_cpu_blocks)
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.num_steps = 0
        self.last_schedule = SchedulerOutput()  # what the latest step ran (chapters draw timelines from it)
        self.last_step_phases: dict[str, float] = {}  # seconds per phase of the latest step (chapter 11)
        self.sync_phase_timing = False  # on a GPU, wait for the device at each phase boundary

    def _eos_token_ids(self) -> set[int]:
        """The tokenizer's EOS plus the checkpoint's generation config EOS ids (as HF ``generate`` uses)."""
        from transformers import GenerationConfig

        from minivllm.models import model_folder

        ids = {self.tokenizer.eos_token_id}
        try:
            eos = GenerationConfig.from_pretrained(model_folder(self.config.model)).eos_token_id
            ids |= set(eos if isinstance(eos, list) else [eos])
        except OSError:  # the checkpoint has no generation_config.json
            pass
        return ids - {None}

    def _blocks_from_memory(self) -> int:
        """Size the pool from free memory, capped at what ``max_num_seqs`` full-length sequences could use."""
        c = self.config
        per_block = PagedKVCache.bytes_per_token(self.model) * c.block_size
        by_memory = int(free_memory_bytes(c.torch_device) * c.kv_cache_memory_fraction) // per_block
        by_demand = c.max_num_seqs * c.blocks_for(self.max_model_len)
        return max(1, min(by_memory, by_demand))

    # -- requests ------------------------------------------------------------------------------
    def validate_request(self, request_id: str, prompt, params: SamplingParams, priority: int = 0) -> list[int]:
        """Check a request without touching any state; returns its prompt token ids."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not is_int(priority):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt must contain at least one token, got an empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt length ({len(ids)}) + max_tokens ({params.max_tokens}) must be "
                             f"<= max_model_len ({self.max_model_len})")
        blocks = self.config.blocks_for(total)
        if blocks > self.num_blocks:
            raise ValueError(f"request needs {blocks} KV blocks for prompt + max_tokens, "
                             f"but num_blocks is {self.num_blocks}")
        if not self.config.enable_chunked_prefill and len(ids) > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt length ({len(ids)}) must be <= max_num_batched_tokens "
                             f"({self.config.max_num_batched_tokens}) when enable_chunked_prefill is False")
        return ids

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> Sequence:
        """Queue a request (a string or token ids). Bad input raises ValueError before anything changes."""
        params = params or SamplingParams()
        ids = self.validate_request(request_id, prompt, params, priority)
        seq = Sequence(request_id, ids, params, priority, arrival_time,
                       prompt if isinstance(prompt, str) else None)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        self.requests[request_id] = seq
        self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, ids)
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> None:
        """Stop a request in any state and free every block it holds (unknown ids are ignored)."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.abort(seq)
        self.detokenizers.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; a RequestOutput for every request that got a token."""
        clock = PhaseClock(self.runner.device, sync=self.sync_phase_timing)
        out = self.scheduler.schedule()
        clock.mark("schedule")
        self.runner.kv_cache.swap(out.swap_out, to_cpu=True)  # out first: swap-ins may reuse those blocks
        self.runner.kv_cache.swap(out.swap_in, to_cpu=False)
        clock.mark("swap")
        sampled = self.runner.run(out.chunks, clock)
        produced = self.scheduler.update(out, sampled)
        clock.mark("update")
        outputs = [self._output(seq) for seq in produced]
        clock.mark("detokenize")
        self.num_steps += 1
        self.last_schedule = out
        self.last_step_phases = clock.phases
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        detok = self.detokenizers[seq.request_id]
        new = seq.output_token_ids[-1:]
        delta = detok.add(new)
        if seq.is_finished:
            full = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            if full.startswith(detok.text):  # flush a character still waiting for its last byte
                delta += full[len(detok.text):]
                detok.text = full
            del self.requests[seq.request_id], self.detokenizers[seq.request_id]
        completion = CompletionOutput(0, detok.text, list(seq.output_token_ids), delta, list(new),
                                      seq.status.finish_reason)
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion],
                             seq.is_finished, seq.metrics)

    def stats(self) -> EngineStats:
        running = self.scheduler.running
        bm = self.block_manager
        return EngineStats(
            num_running=sum(s.status == SequenceStatus.RUNNING for s in running),
            num_prefilling=sum(s.status == SequenceStatus.PREFILLING for s in running),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            prefix_cache_hit_rate=bm.prefix_hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_recomputed_tokens=self.scheduler.num_recomputed_tokens,
            num_swapped_bytes=self.scheduler.num_swapped_bytes,
            num_free_cpu_blocks=len(bm.free_cpu_blocks),
            num_total_cpu_blocks=bm.num_cpu_blocks,
        )

    def check_invariants(self) -> None:
        """Block-pool invariants over every live sequence (tests call this after each step)."""
        self.block_manager.check_invariants(self.scheduler.sequences)


class LLM:
    """Offline front door: ``LLM("smollm2-135m", block_size=16, ...)`` takes any EngineConfig field."""

    def __init__(self, model: str = "smollm2-135m", **kwargs):
        unknown = set(kwargs) - EngineConfig.field_names()
        if unknown:
            raise ValueError(f"unknown engine options {sorted(unknown)}; allowed: {sorted(EngineConfig.field_names())}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _requests(self, prompts, sampling_params):
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and is_int(prompts[0])):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params must be one SamplingParams or one per prompt ({len(prompts)}), got {len(params)}")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params):  # validate everything before queueing anything
            self.engine.validate_request(rid, prompt, p)
        return ids, prompts, params

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in the prompts' order."""
        from tqdm.auto import tqdm

        ids, prompts, params = self._requests(prompts, sampling_params)
        for rid, prompt, p in zip(ids, prompts, params):
            self.engine.add_request(rid, prompt, p)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in ids:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one prompt's completion as it is produced."""
        ids, prompts, params = self._requests(prompt, sampling_params)
        if len(ids) != 1:
            raise ValueError(f"stream takes one prompt, got {len(ids)}")
        rid, prompt, params = ids[0], prompts[0], params[0]
        self.engine.add_request(rid, prompt, params)
        try:
            while rid in self.engine.requests:
                for out in self.engine.step():
                    if out.request_id == rid and out.outputs[0].delta_text:
                        yield out.outputs[0].delta_text
        finally:
            self.engine.abort_request(rid)
