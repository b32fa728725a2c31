"""The serving loop and its front door: ``LLMEngine`` and ``LLM`` (chapters 06 and 07).

``LLMEngine.step()`` is one turn of continuous batching: schedule, run one
forward, sample, update, and return a ``RequestOutput`` for every request that
produced a token (with the new text, detokenized incrementally). ``LLM`` wraps
it for offline use: ``generate`` a list of prompts, ``chat`` (conversations through the
model's chat template), or ``stream`` one.

Reliability rules the engine keeps:

- Bad input raises ``ValueError`` naming the field before any state changes;
  ``LLM.generate`` checks every prompt before queueing any.
- A request that fails inside a step ends alone, with ``finish_reason
  "error"`` and its blocks freed; every other request goes on.
- One owner per output: a request queued by an ``LLM`` call gets its outputs
  in that call, whoever runs the step; a request added with
  ``LLMEngine.add_request`` gets them from ``LLMEngine.step()``.
- Threads: every public method holds the engine's lock, so concurrent callers
  are serialised, never interleaved; ``LLM.generate`` and ``LLM.stream`` from
  several threads (or several open streams in one) all get their own tokens.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from typing import Iterator

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from minivllm.attention import GATHER, PagedKVCache
from minivllm.config import (EngineConfig, check, cpu_pool_blocks, free_memory_bytes, is_int, is_number, is_text,
                             resolve, resolve_function, shown)
from minivllm.detokenizer import OutputText
from minivllm.distributed import TensorParallelRunner, WorkerError, start_workers
from minivllm.model_runner import ModelRunner
from minivllm.models import load_model, load_model_shard, load_tokenizer, model_folder
from minivllm.outputs import CompletionOutput, EngineStats, RequestOutput
from minivllm.sampler import SamplerOutput
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import SchedulerOutput
from minivllm.sequence import Sequence, SequenceStatus
from minivllm.simple_generation import chat_prompt_ids
from minivllm.structured_output import GrammarBackend, NoContinuation
from minivllm.timing import PhaseClock, now

__all__ = ["LLMEngine", "LLM", "make_engine"]

MAX_PRIORITY = 2**63  # priorities are integers in (-MAX_PRIORITY, MAX_PRIORITY)
GRAMMAR_POLL_S = 0.05  # with only grammars compiling, a step waits this long at most for one (off the lock)


@dataclass
class Request:
    """One request inside the engine: its samples (``n`` sequences) and their texts."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    texts: list[OutputText]
    inbox: deque | None = None  # outputs collected for the LLM call that owns it (None: LLMEngine.step's)
    grammar: Future | None = None  # its constraint compiling (chapter 19): the request waits outside the scheduler
    grammar_deadline: float = 0.0  # when that compile's time limit ends it

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    """A request-level serving engine over one model and one paged KV pool."""

    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        check(not config.disaggregated, "disaggregated",
              "False for LLMEngine (make_engine(config) or LLM(..., disaggregated=True) runs the two workers)",
              config.disaggregated)
        self.lock = threading.RLock()
        # Tensor parallelism (chapter 15): the other ranks start first and load their shards meanwhile.
        self.workers = start_workers(config) if config.tensor_parallel_size > 1 else None
        if self.workers is not None:
            weakref.finalize(self, self.workers.shutdown)  # no worker outlives an engine that is dropped
        try:
            self._build(config)
        except BaseException:
            self.shutdown()
            raise
        self.detokenizer_cls = resolve(config.detokenizer)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self._held: list[RequestOutput] = []  # outputs for LLMEngine.step() produced by steps run for LLM calls
        self.num_steps = 0
        self.num_failed_requests = 0
        self.last_schedule = SchedulerOutput()  # what the latest step ran (chapters draw timelines from it)
        self.last_step_phases: dict[str, float] = {}  # seconds per phase of the latest step (chapter 12)
        self.sync_phase_timing = False  # on a GPU, wait for the device at each phase boundary
        self._grammar_backend: GrammarBackend | None = None  # built at the first constrained request (chapter 19)
        self.compiling: dict[str, Request] = {}  # requests waiting for their grammar (WAITING_FOR_GRAMMAR)

    def _build(self, config: EngineConfig) -> None:
        """The model (or rank 0's shard), the pool sizes, block manager, scheduler and runner."""
        device = config.torch_device if self.workers is None else self.workers.device
        if self.workers is None:
            self.model, self.tokenizer = load_model(config.model, device, config.torch_dtype, config.pack_weights,
                                                    config.kernels, config.quantization, config.gguf_activations)
        else:
            self.model = load_model_shard(config.model, self.workers.tp, device, config.torch_dtype, config.pack_weights,
                                          resolve_function(config.shard_weight, "shard_weight"), config.kernels)
            self.tokenizer = load_tokenizer(config.model)
        self.vocab_size = self.model.config.vocab_size
        self.max_model_len = self._max_model_len()
        self.kv_bytes_per_block = PagedKVCache.bytes_per_token(self.model) * config.block_size  # this rank's heads
        self.num_blocks = config.num_blocks or self._blocks_from_memory()
        self.num_cpu_blocks = cpu_pool_blocks(config, self.num_blocks)
        tier = {"num_offload_blocks": config.kv_offload_blocks} if config.kv_offload_blocks else {}  # chapter 14
        self.block_manager = resolve(config.block_manager_cls)(
            self.num_blocks, config.block_size, config.enable_prefix_caching, self.num_cpu_blocks,
            config.admission_watermark, **self._tier_options(config))
        self.scheduler = resolve(config.scheduler_cls)(config, self.block_manager, self.max_model_len,
                                                       self._eos_token_ids(), self.kv_bytes_per_block)
        args = (self.model, self.num_blocks, config.block_size, self.num_cpu_blocks,
                resolve(config.attention_backend), resolve(config.sampler)(device, config.seed))
        if self.workers is None:
            acceptor = getattr(self.scheduler, "acceptor", None)  # chapter 17: the greedy acceptance rule
            self.runner = ModelRunner(*args, **tier,
                                      graph_runner_cls=resolve(config.graph_runner_cls),
                                      accept=acceptor.accept if acceptor is not None else None,
                                      grammar_masker_cls=resolve(config.grammar_masker_cls),
                                      overlap_grammar_fill=config.overlap_grammar_fill)
        else:
            self.runner = TensorParallelRunner(self.workers, *args,
                                               grammar_masker_cls=resolve(config.grammar_masker_cls),
                                               overlap_grammar_fill=config.overlap_grammar_fill)
        self.runner.kv_cache.fused_decode = config.fused_decode  # few-row decode steps in one native call (ch. 18)
        if config.use_cuda_graphs and self.workers is None:  # decode steps replay CUDA graphs (chapter 12)
            self.runner.enable_decode_graphs(config.max_num_seqs, self.max_model_len, capture=True)

    @staticmethod
    def _tier_options(config: EngineConfig) -> dict:
        """The block manager's CPU offload tier (chapter 14): its size and class, or nothing without one."""
        if not config.kv_offload_blocks:
            return {}
        return {"num_offload_blocks": config.kv_offload_blocks, "tier_cls": resolve(config.offload_tier_cls)}

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (chapter 15) and the grammar fill's thread (chapter 19);
        idempotent.

        The engine cannot step afterwards. ``LLM`` is a context manager that
        calls this; an engine that is garbage-collected or still alive at
        interpreter exit is shut down too.
        """
        with self.lock:
            if self.workers is not None:
                self.workers.shutdown()
            if getattr(self, "runner", None) is not None:
                self.runner.stop_fill_worker()

    def check_health(self) -> None:
        """Raise :class:`WorkerError` if the engine can no longer step (vLLM's name): a tensor-parallel rank died."""
        if self.workers is not None:
            self.workers.check_health()

    def is_ready(self) -> bool:
        """Whether requests run now (the server's ``/health``); a disaggregated front says no while its workers form
        their KV link again. Requests added meanwhile wait."""
        return True

    def _max_model_len(self) -> int:
        limit = self.model.config.max_position_embeddings
        wanted = self.config.max_model_len
        check(wanted is None or wanted <= limit, "max_model_len",
              f"None or at most the model's max_position_embeddings ({limit})", wanted)
        return wanted or limit

    def _eos_token_ids(self) -> set[int]:
        """The tokenizer's EOS plus the checkpoint's generation config EOS ids (as HF ``generate`` uses)."""
        ids = {self.tokenizer.eos_token_id}
        try:
            eos = GenerationConfig.from_pretrained(model_folder(self.config.model)).eos_token_id
            ids |= set(eos if isinstance(eos, list) else [eos])
        except OSError:  # the checkpoint has no generation_config.json
            pass
        return ids - {None}

    def _blocks_from_memory(self) -> int:
        """Size the pool from free memory, capped at what ``max_num_seqs`` full-length sequences could use.

        Under tensor parallelism a block costs each rank ``1/tp`` of its bytes;
        on the CPU the ranks share one memory, so its budget is split between them.
        """
        c = self.config
        sharing = c.tensor_parallel_size if c.torch_device.type == "cpu" else 1
        budget = int(free_memory_bytes(c.torch_device) * c.kv_cache_memory_fraction) // sharing
        by_memory = budget // self.kv_bytes_per_block
        by_demand = c.max_num_seqs * c.blocks_for(self.max_model_len)
        return max(1, min(by_memory, by_demand))

    # -- requests ------------------------------------------------------------------------------
    def grammar_backend(self) -> GrammarBackend:
        """The grammar library over this engine's tokenizer and vocabulary (chapter 19), built once, at first use:
        the model's EOS ids are its stop tokens, and a matcher can roll back a step's drafts and bonus token."""
        if self._grammar_backend is None:  # the lock only to build it: a server thread compiling waits on no step
            with self.lock:
                if self._grammar_backend is None:
                    spec = self.config.speculative_config
                    self._grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size, self._eos_token_ids(),
                                                           spec.num_speculative_tokens + 1 if spec else 1,
                                                           self.config.structured_outputs_timeout_s)
        return self._grammar_backend

    def compile_constraint(self, params: SamplingParams) -> None:
        """Compile ``params``' constraint now, waiting here at most ``structured_outputs_timeout_s`` (cached; a
        ValueError naming ``structured_outputs`` if it fails or takes longer). Never under the engine's lock:
        requests compile theirs in the grammar backend's pool while they wait (:meth:`add_request`)."""
        if params.structured_outputs is not None:
            backend = self.grammar_backend()
            try:
                backend.compile(params.structured_outputs, backend.compile_timeout_s)
            except TimeoutError:
                raise ValueError(backend.timeout_error(params.structured_outputs)) from None

    def parse_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt in one of vLLM's forms (text, token ids, ``{"prompt": ...}``, ``{"prompt_token_ids": ...}``).

        Text must be valid Unicode (a lone UTF-16 surrogate is refused before the tokenizer sees it); a dict's
        value must be of its key's kind (text under "prompt", token ids under "prompt_token_ids")."""
        if isinstance(prompt, dict):
            check(len(prompt) == 1 and set(prompt) <= {"prompt", "prompt_token_ids"}, "prompt",
                  'a dict with one key, "prompt" (text) or "prompt_token_ids"', prompt)
            ((key, prompt),) = prompt.items()
            if key == "prompt":
                check(isinstance(prompt, str), "prompt", 'text under "prompt" (token ids go under "prompt_token_ids")',
                      prompt)
            else:
                check(isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt), "prompt_token_ids",
                      'a list of token ids (text goes under "prompt")', prompt)
        if isinstance(prompt, str):
            if not is_text(prompt):
                at = next(i for i, c in enumerate(prompt) if "\ud800" <= c <= "\udfff")
                raise ValueError(f"prompt must be valid Unicode text, but it holds a lone UTF-16 surrogate "
                                 f"({shown(prompt[at])} at character {at})")
            return prompt, self.tokenizer(prompt)["input_ids"]
        check(isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt), "prompt",
              'a string, a list of token ids, {"prompt": str} or {"prompt_token_ids": list}', prompt)
        return None, list(prompt)

    def validate_request(self, request_id: str, prompt, params: SamplingParams, priority: int = 0,
                         arrival_time: float | None = None) -> tuple[str | None, list[int]]:
        """Check everything a step will use, without touching any state; returns the prompt's text and ids."""
        check(isinstance(request_id, str) and request_id != "", "request_id", "a non-empty string", request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        check(isinstance(params, SamplingParams), "params", "a SamplingParams", type(params).__name__)
        params.clone()  # validates it again: it may have been changed since it was made
        check(is_int(priority) and -MAX_PRIORITY < priority < MAX_PRIORITY, "priority",
              "an integer in (-2**63, 2**63)", priority)
        check(arrival_time is None or is_number(arrival_time), "arrival_time", "None or a finite number of seconds",
              arrival_time)
        check(params.top_k <= self.vocab_size, "top_k", f"-1, 0 or an integer in [1, {self.vocab_size}]", params.top_k)
        text, ids = self.parse_prompt(prompt)
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
        return text, ids  # the constraint was checked when made; it compiles after add_request, off the lock

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> Sequence:
        """Queue a request (see :meth:`parse_prompt`). Bad input raises ValueError before anything changes.

        The engine keeps its own copy of ``params``. Returns the request's
        first sequence (with ``n > 1``, the others fork from it).

        A constrained request (chapter 19) whose grammar is not cached yet
        waits in ``WAITING_FOR_GRAMMAR``, outside the scheduler, while the
        grammar backend's pool compiles it and the other requests run (as
        vLLM's ``WAITING_FOR_FSM``); each step admits the ones whose grammar
        is ready, and ends with ``finish_reason`` "error" the ones whose
        compile failed or passed ``structured_outputs_timeout_s``.
        """
        with self.lock:
            return self._add(request_id, prompt, params, priority, arrival_time)

    def _add(self, request_id, prompt, params, priority=0, arrival_time=None, inbox=None) -> Sequence:
        params = SamplingParams() if params is None else params
        text, ids = self.validate_request(request_id, prompt, params, priority, arrival_time)
        params = params.clone()
        grammar = None if params.structured_outputs is None else self.grammar_backend().submit(
            params.structured_outputs)  # the last check: a full compile pool refuses it (GrammarCompilesBusy)
        seqs = [Sequence(request_id, ids, params.for_sample(i), priority, arrival_time, text, index=i)
                for i in range(params.n)]
        for seq in seqs:
            if seq.params.seed is not None:
                seq.generator = torch.Generator(device=self.runner.device).manual_seed(seq.params.seed)
            seq.metrics.arrival_time = seqs[0].metrics.arrival_time
        seqs[0].forks = seqs[1:]
        texts = [OutputText(self.tokenizer, ids, params.stop, params.include_stop_str_in_output, self.detokenizer_cls)
                 for _ in seqs]
        request = self.requests[request_id] = Request(request_id, text, ids, seqs, texts, inbox)
        if grammar is None:
            self.scheduler.add(seqs[0])
        elif grammar.done() and not grammar.cancelled() and grammar.exception() is None:  # cached
            self._start_grammars(request, grammar.result())
        else:
            for seq in seqs:
                seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
            request.grammar, request.grammar_deadline = grammar, now() + self.grammar_backend().compile_timeout_s
            self.compiling[request_id] = request
        return seqs[0]

    def _start_grammars(self, request: Request, compiled) -> None:
        """Each sample its own matcher of the compiled grammar (chapter 19); the request joins the queue."""
        backend = self.grammar_backend()
        for seq in request.seqs:
            seq.grammar = backend.grammar(seq.params.structured_outputs, compiled)
            seq.status = SequenceStatus.WAITING
        self.scheduler.add(request.seqs[0])

    def _admit_grammars(self) -> list[Sequence]:
        """Requests whose grammar is ready join the queue; those whose compile failed, or passed its time limit,
        end with the error (returned: their samples, for outputs). A compile still running goes on."""
        ended = []
        for request_id, request in list(self.compiling.items()):
            future, params = request.grammar, request.seqs[0].params.structured_outputs
            if not future.done() and now() < request.grammar_deadline:
                continue
            del self.compiling[request_id]
            request.grammar = None
            self.grammar_backend().release(params, future)
            if future.done() and not future.cancelled() and future.exception() is None:
                self._start_grammars(request, future.result())
                continue
            error = (self.grammar_backend().timeout_error(params) if not future.done() else
                     "structured_outputs: its compile was cancelled" if future.cancelled() else
                     str(future.exception()))
            for seq in request.seqs:
                seq.forks = []
                seq.error = error
                seq.status = SequenceStatus.FINISHED_ERROR
                seq.metrics.finish_time = now()
            self.num_failed_requests += 1
            ended.extend(request.seqs)
        return ended

    def _await_grammars(self) -> None:
        """With nothing to run but grammars compiling, wait (without the lock) until one is ready, its time
        limit ends, or ``GRAMMAR_POLL_S`` passes: a caller's loop does not spin while they compile."""
        with self.lock:
            if not self.compiling or self.scheduler.has_unfinished() or self._held:
                return
            futures = [r.grammar for r in self.compiling.values()]
            deadline = min(r.grammar_deadline for r in self.compiling.values())
        wait_futures(futures, timeout=max(0.0, min(GRAMMAR_POLL_S, deadline - now())), return_when=FIRST_COMPLETED)

    def abort_request(self, request_id: str) -> None:
        """Stop a request in any state and free every block it holds (unknown ids are ignored).

        A request owned by an ``LLM`` call gets a last output, finish reason "abort".
        """
        with self.lock:
            request = self.requests.get(request_id)
            if request is None:
                return
            if self.compiling.pop(request_id, None) is not None:  # its compile is cancelled if nobody else waits
                self.grammar_backend().release(request.seqs[0].params.structured_outputs, request.grammar)
                request.grammar = None
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.abort(seq)
            if request.inbox is not None:
                request.inbox.append(self._request_output(request, {}))
            del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        """Whether a request is still running or an output still waits for :meth:`step`."""
        with self.lock:
            return bool(self.requests or self._held)

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; a RequestOutput for every request that got a token.

        Requests owned by an ``LLM`` call are not reported here: their outputs
        go to that call. With only grammars compiling, it first waits for one
        (briefly, off the lock).
        """
        self._await_grammars()
        with self.lock:
            held, self._held = self._held, []
            return held + self._step()

    def _step(self) -> list[RequestOutput]:
        """One step; outputs of requests with an inbox go there, the others are returned."""
        outputs = []
        for out in self._run_step():
            request = self.requests[out.request_id]
            (outputs if request.inbox is None else request.inbox).append(out)
            if out.finished:
                del self.requests[out.request_id]
        return outputs

    def _run_step(self) -> list:
        ended = self._admit_grammars()
        if (ended or self.compiling) and not self.scheduler.has_unfinished():  # only grammars compiling, or failed
            return self._outputs(ended)
        clock = PhaseClock(self.runner.device, sync=self.sync_phase_timing)
        out = self.scheduler.schedule()
        clock.mark("schedule")
        try:
            self.runner.copy_blocks(out)
        except BaseException:  # interrupted: the copies may be half done, so their KV cannot be trusted
            self.scheduler.discard_copies(out)
            raise
        clock.mark("swap")
        result, failed = self._run_isolated(out, clock)
        drafts = [result.num_accepted] if result.num_accepted else []  # a step that verified drafts (chapter 17)
        produced = self.scheduler.update(out, result.token_ids, result.logprobs, *drafts)
        clock.mark("update")
        outputs = self._outputs(ended + produced + failed)
        clock.mark("detokenize")
        self.num_steps += 1
        self.last_schedule = out
        self.last_step_phases = clock.phases
        return outputs

    def _run_isolated(self, out: SchedulerOutput, clock) -> tuple[SamplerOutput, list[Sequence]]:
        """Run the step's chunks; if that fails, run them one by one and end only the ones that fail."""
        try:
            return self.runner.run(out.chunks, clock), []
        except WorkerError:  # the ranks are gone: no request can run, so the engine says why
            raise
        except Exception:
            pass
        tokens, logprobs, accepted, ok, failed = [], [], [], [], []
        for chunk in out.chunks:
            try:
                result = self.runner.run([chunk])
            except WorkerError:
                raise
            except Exception as e:
                failed.extend(self._fail(chunk.seq, e))
                continue
            ok.append(chunk)
            tokens += result.token_ids
            logprobs += result.logprobs
            accepted += result.num_accepted or [0] * len(result.token_ids)
        out.chunks = ok
        return SamplerOutput(tokens, logprobs, accepted if any(accepted) else []), failed

    def _fail(self, seq: Sequence, error: Exception) -> list[Sequence]:
        """End ``seq`` (and any sample still to fork from it) with an error; the rest of the batch goes on."""
        ended = [seq, *seq.forks]
        seq.forks = []
        for s in ended:  # a constraint's own error (chapter 19) as it is: its client's fault, a 400 at the server
            s.error = str(error) if isinstance(error, NoContinuation) else f"{type(error).__name__}: {error}"
            self.scheduler.finish(s, SequenceStatus.FINISHED_ERROR)
        self.num_failed_requests += 1
        return ended

    def _outputs(self, produced: list[Sequence]) -> list[RequestOutput]:
        """Detokenize the new tokens, apply stop strings, one RequestOutput per request that changed."""
        changed: dict[str, list[Sequence]] = {}
        for seq in produced:
            changed.setdefault(seq.request_id, []).append(seq)
        outputs = []
        for request_id, seqs in changed.items():
            request = self.requests[request_id]
            try:
                new = {seq.index: self._add_text(request, seq) for seq in seqs}
            except Exception as e:  # a bad token for the tokenizer: this request alone fails
                for seq in request.seqs:
                    if not seq.is_finished:
                        self._fail(seq, e)
                new = {seq.index: [] for seq in request.seqs}
            outputs.append(self._request_output(request, new))
        return outputs

    def _add_text(self, request: Request, seq: Sequence) -> list[int]:
        """Feed a sample's new tokens to its text; a stop string ends the sample. Returns the new token ids.

        With drafts a step may add several tokens (chapter 17): they are fed one
        by one, and a stop string inside the run drops the tokens after it."""
        text = request.texts[seq.index]
        new = seq.output_token_ids[-seq.new_token_count:] if seq.status is not SequenceStatus.FINISHED_ERROR else []
        stop = None
        for i in range(len(new)):
            stop = text.add(new[i:i + 1])
            if stop is not None:
                after = len(new) - i - 1
                if after:  # plain decoding would have stopped here: the tokens after it never happened
                    new = self.scheduler.acceptor.cut_at_stop(seq, new, i)
                    if seq.is_finished:  # ended later in the run (length, EOS): the stop string came first
                        seq.status = SequenceStatus.FINISHED_STOPPED
                break
        if stop is not None:
            seq.stop_reason = stop
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            elif seq.status is SequenceStatus.FINISHED_LENGTH:  # the last allowed token completed it: "stop" (vLLM)
                seq.status = SequenceStatus.FINISHED_STOPPED
        if seq.is_finished:
            text.finish(seq.output_token_ids)
        return new

    def _request_output(self, request: Request, new: dict[int, list[int]]) -> RequestOutput:
        completions = []
        for seq, text in zip(request.seqs, request.texts):
            delta_ids = new.get(seq.index, [])
            delta = text.delta(seq.is_finished) if seq.index in new else ""
            logprobs = self._decoded_logprobs(seq) if seq.params.logprobs is not None else None
            completions.append(CompletionOutput(seq.index, text.full_text, list(seq.output_token_ids), delta,
                                                list(delta_ids), seq.status.finish_reason, seq.stop_reason, logprobs))
        error = next((s.error for s in request.seqs if s.error), None)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             request.finished, request.seqs[0].metrics, error)

    def _decoded_logprobs(self, seq: Sequence) -> list[dict]:
        """The sample's logprobs, with each candidate's text filled in once."""
        for i, step in enumerate(seq.output_logprobs):
            if any(lp.decoded_token is None for lp in step.values()):
                seq.output_logprobs[i] = {t: replace(lp, decoded_token=self.tokenizer.decode([t]))
                                          for t, lp in step.items()}
        return list(seq.output_logprobs)

    def stats(self) -> EngineStats:
        with self.lock:
            running = self.scheduler.running
            bm = self.block_manager
            graphs = getattr(self.runner, "graph_runner", None)
            return EngineStats(
                num_running=sum(s.status == SequenceStatus.RUNNING for s in running),
                num_prefilling=sum(s.status == SequenceStatus.PREFILLING for s in running),
                num_waiting=len(self.scheduler.waiting) + len(self.compiling),  # as vLLM's WAITING_FOR_FSM
                num_swapped=len(self.scheduler.swapped),
                num_free_blocks=bm.num_free_blocks,
                num_total_blocks=bm.num_blocks,
                prefix_cache_hit_rate=bm.prefix_hit_rate,
                num_preemptions=self.scheduler.num_preemptions,
                num_recomputed_tokens=self.scheduler.num_recomputed_tokens,
                num_swapped_bytes=self.scheduler.num_swapped_bytes,
                num_free_cpu_blocks=len(bm.free_cpu_blocks),
                num_total_cpu_blocks=bm.num_cpu_blocks,
                prefix_cache_queries=bm.prefix_queried_tokens,
                prefix_cache_hits=bm.prefix_hit_tokens,
                num_failed_requests=self.num_failed_requests,
                **self._tier_stats(bm),
                **self._spec_stats(),
                attention_kernel=getattr(self.runner.kv_cache, "attention_kernel", GATHER),
                cuda_graph_sizes=tuple(sorted(graphs.graphs)) if graphs is not None else (),
                kernels=getattr(self.model, "kernels", "reference"),
                quantization=getattr(self.model, "quantization", None),
                gguf_dot=getattr(self.model, "gguf_dot", None),
                decode_path=self._decode_path(),
            )

    def _decode_path(self) -> str:
        """How a few-row decode step runs (chapter 18): "fused-step" (every layer in one native call) or
        "op-by-op"."""
        fused = getattr(self.model, "fused_decode_path", None)
        return "fused-step" if self.workers is None and fused is not None and fused(self.runner.kv_cache) \
            else "op-by-op"

    def _spec_stats(self) -> dict:
        """Speculative decoding's counters (chapter 17; vLLM's spec_decode_* names)."""
        s = getattr(self.scheduler, "spec_stats", None)
        if s is None:
            return {}
        return {"spec_decode_num_drafts": s.num_drafts, "spec_decode_num_draft_tokens": s.num_draft_tokens,
                "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": tuple(s.num_accepted_tokens_per_pos),
                "spec_decode_num_decode_steps": s.num_decode_steps,
                "spec_decode_num_emitted_tokens": s.num_emitted_tokens}

    def _tier_stats(self, bm) -> dict:
        """The CPU offload tier's counters, in blocks and bytes, and its share of the prefix hits (chapter 14)."""
        tier = getattr(bm, "tier", None)
        if tier is None:
            return {}
        counts = {"offloaded": tier.num_offloaded, "restored": tier.num_restored, "dropped": tier.num_dropped}
        stats = {f"num_{k}_blocks": v for k, v in counts.items()}
        stats.update({f"num_{k}_bytes": v * self.kv_bytes_per_block for k, v in counts.items()})
        stats.update(num_tier_blocks=len(tier), num_total_tier_blocks=tier.num_slots,
                     prefix_cache_tier_hits=tier.num_restored * bm.block_size)
        return stats

    def check_invariants(self) -> None:
        """Block-pool invariants over every live sequence (tests call this after each step)."""
        with self.lock:
            self.block_manager.check_invariants(self.scheduler.sequences)


def make_engine(config: EngineConfig) -> LLMEngine:
    """The engine a config asks for: an LLMEngine, or with ``disaggregated`` the front of two workers (chapter 16).

    The front lives a layer above (it runs LLMEngines in its workers), so it
    is named, like an extension point, and imported only when asked for.
    """
    if config.disaggregated:
        return resolve("minivllm.disaggregation.DisaggregatedEngine", "disaggregated")(config)
    return LLMEngine(config)


class LLM:
    """Offline front door: ``LLM("smollm2-135m", block_size=16, ...)`` takes any EngineConfig field.

    Safe to share between threads: calls are serialised step by step on the
    engine's lock, and each call gets exactly its own requests' outputs.
    """

    def __init__(self, model: str = "smollm2-135m", **kwargs):
        unknown = set(kwargs) - EngineConfig.field_names()
        if unknown:
            raise ValueError(f"unknown engine options {sorted(unknown)}; allowed: {sorted(EngineConfig.field_names())}")
        self.engine = make_engine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()
        self._inboxes: dict[str, deque] = {}  # outputs of this LLM's requests, until its calls take them

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (chapter 15)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @staticmethod
    def _prompt_list(prompts) -> list:
        """vLLM's prompt forms: one prompt (text, token ids or a dict), or a list of them."""
        if isinstance(prompts, (str, dict)):
            return [prompts]
        check(isinstance(prompts, (list, tuple)) and len(prompts) > 0, "prompts",
              "a prompt or a non-empty list of prompts (str, token ids, or a prompt dict)", prompts)
        if all(is_int(t) for t in prompts):
            return [list(prompts)]
        return list(prompts)

    def _add(self, prompts, sampling_params) -> list[str]:
        """Queue every prompt with an inbox for its outputs; all or nothing (a refused prompt queues none)."""
        prompts = self._prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
        else:
            params = [SamplingParams() if sampling_params is None else sampling_params] * len(prompts)
        check(len(params) == len(prompts), "sampling_params", f"one SamplingParams or one per prompt ({len(prompts)})",
              f"{len(params)} of them")
        ids = []
        with self.engine.lock:  # no step runs in between, so a refusal leaves nothing behind
            try:
                for prompt, p in zip(prompts, params):
                    ids.append(f"gen-{next(self._ids)}")
                    self._inboxes[ids[-1]] = deque()
                    self.engine._add(ids[-1], prompt, p, inbox=self._inboxes[ids[-1]])
            except BaseException:
                self._abort(ids)
                raise
        return ids

    def _abort(self, ids: list[str]) -> None:
        """Abort the requests still running and drop their inboxes."""
        with self.engine.lock:
            for rid in ids:
                self.engine.abort_request(rid)
                self._inboxes.pop(rid, None)

    def _next_outputs(self, rid: str) -> list[RequestOutput]:
        """``rid``'s outputs so far, running one engine step first if there are none yet."""
        engine = self.engine
        engine._await_grammars()  # off the lock: another thread's requests run meanwhile
        with engine.lock:
            inbox = self._inboxes[rid]
            if not inbox:
                engine._held.extend(engine._step())
            outputs = list(inbox)
            inbox.clear()
            return outputs

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the prompts' order.

        A prompt is a string, a list of token ids, ``{"prompt": ...}`` or
        ``{"prompt_token_ids": ...}``; ``prompts`` is one prompt or a list of
        them. Interrupted (Ctrl-C), it aborts its unfinished requests and frees
        their blocks.
        """
        ids = self._add(prompts, sampling_params)
        done: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
                while len(done) < len(ids):
                    for rid in ids:
                        for out in self._next_outputs(rid) if rid not in done else ():
                            if out.finished:
                                done[rid] = out
                                bar.update(1)
        finally:
            self._abort(ids)
        return [done[rid] for rid in ids]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Reply to one conversation or a list of them, as vLLM's ``LLM.chat`` (chapter 00's first example).

        A conversation is a list of ``{"role": ..., "content": ...}`` messages, rendered with the model's chat
        template (or ``chat_template``) and tokenized as :func:`~minivllm.simple_generation.chat_prompt_ids`
        does; then :meth:`generate`. ``continue_final_message`` goes on with the last message instead of starting
        the assistant's reply (and needs ``add_generation_prompt=False``).
        """
        check(isinstance(messages, (list, tuple)) and len(messages) > 0, "messages",
              "a conversation (a non-empty list of {'role': ..., 'content': ...} dicts) or a list of them", messages)
        conversations = list(messages) if all(isinstance(c, (list, tuple)) for c in messages) else [messages]
        for i, conversation in enumerate(conversations):
            name = "messages" if conversations[0] is messages else f"messages[{i}]"
            check(len(conversation) > 0, name, "a non-empty list of messages", conversation)
            for j, m in enumerate(conversation):
                check(isinstance(m, dict) and is_text(m.get("role")) and is_text(m.get("content")), f"{name}[{j}]",
                      "a dict with a 'role' and a 'content' string", m)
        check(not (add_generation_prompt and continue_final_message), "continue_final_message",
              "False when add_generation_prompt is True (vLLM's rule)", continue_final_message)
        check(chat_template is None or is_text(chat_template), "chat_template", "None or a Jinja template string",
              chat_template)
        tokenizer = self.get_tokenizer()
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                prompts.append(chat_prompt_ids(tokenizer, conversation, chat_template=chat_template,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message))
            except Exception as e:  # a template that refuses these messages (jinja's raise_exception), as the server
                raise ValueError(f"messages cannot be rendered with the chat template: {e}") from None
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one prompt's completion as it is produced (sample 0 when ``n > 1``).

        Closing the generator early aborts the request.
        """
        (rid,) = self._add([prompt], sampling_params)
        try:
            finished = False
            while not finished:
                for out in self._next_outputs(rid):
                    finished = out.finished
                    if out.outputs[0].delta_text:
                        yield out.outputs[0].delta_text
        finally:
            self._abort([rid])
