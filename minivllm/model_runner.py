"""From a scheduled step to sampled tokens: one forward per engine step (chapter 06, the model runner).

The scheduler hands over a :class:`~minivllm.scheduler.SchedulerOutput`: block
copies to make first (a fork's copy on write, swaps to and from the CPU
pool), then ``(sequence, start, num_tokens)`` chunks: prefill chunks, whole
prompts and single decode tokens alike. The runner makes the copies, flattens
the chunks into one token batch (input ids, positions and the step's
attention metadata: slot mapping, block tables, masks), runs the model once,
computes logits only for the chunks that end at their sequence's last token,
and samples those (a chunk that forks ``n`` samples gets ``n`` draws).

A decode row with drafts (chapter 17) is a chunk of ``1 + d`` tokens after
the cached KV, exactly a prefill chunk; all its ``1 + d`` rows get logits and
:func:`~minivllm.sampler.verify_drafts` keeps what the model agrees with.

A row whose sample has a constraint (chapter 19) gets its grammar's bitmask
on its logits before anything samples from them (:meth:`ModelRunner.apply_grammars`),
whatever the sampler; a drafted row gets one per verified position. Rows
without one are not touched. The bitmasks need the matchers only, not the
logits, so (``overlap_grammar_fill``) one worker thread can fill them while
the forward runs on this one, and the step joins it before applying them: as
vLLM's ``EngineCore.step`` (``vllm/v1/engine/core.py``), which launches
``execute_model(..., non_block=True)``, then calls ``get_grammar_bitmask``,
then ``sample_tokens``. xgrammar's fill is C++ that releases the GIL.

Under tensor parallelism (chapter 15) every rank runs :meth:`forward_inputs`
on the same :class:`StepInputs` with its own shard of the model and its own
KV pool; rank 0 builds them from the chunks and broadcasts them
(:mod:`minivllm.distributed`), and only rank 0 samples.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch

from minivllm.attention import MiniPagedKVCache, PagedBatch
from minivllm.block_manager import slots
from minivllm.cpu_malloc import keep_freed_memory
from minivllm.cuda_graphs import DecodeGraphRunner, MiniDecodeGraphRunner
from minivllm.sampler import MiniGrammarMasker, MiniSampler, SamplerOutput, verify_drafts
from minivllm.scheduler import ScheduledChunk, SchedulerOutput
from minivllm.sequence import Sequence
from minivllm.spec_decode import accept_greedy
from minivllm.structured_output import NoContinuation


def _noop_mark(name: str) -> None:
    pass


def overlap_helps(device: torch.device) -> bool:
    """Whether filling the bitmasks during the forward can save time (``overlap_grammar_fill=None``, chapter 19):
    on a GPU the forward runs on the device and this thread waits; on a CPU only if the forward's threads leave
    a core free, else the fill's thread takes a core from the forward's team."""
    return device.type != "cpu" or torch.get_num_threads() < len(os.sched_getaffinity(0))


@dataclass
class StepInputs:
    """One step's flat token batch as plain lists: built once from the chunks, turned into tensors per rank."""

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    context_lens: list[int]
    query_lens: list[int]
    logits_rows: list[int]  # the flat rows whose logits are sampled (one per sample drawn)


class ModelRunner:
    """Owns the model, the KV pools (``kv_cache_cls``, the attention backend) and the sampler."""

    def __init__(self, model, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 kv_cache_cls=MiniPagedKVCache, sampler=None, num_offload_blocks: int = 0,
                 graph_runner_cls=MiniDecodeGraphRunner, accept=None, grammar_masker_cls=MiniGrammarMasker,
                 overlap_grammar_fill: bool | None = False):
        self.model = model
        self.grammar_masker = grammar_masker_cls()  # an extension point (exercise 19): the grammars' masks
        self.device = model.lm_head.weight.device
        # fill the masks while the forward runs (chapter 19); None: where it can help
        self.overlap_grammar_fill = overlap_helps(self.device) if overlap_grammar_fill is None else overlap_grammar_fill
        self._fill_worker: ThreadPoolExecutor | None = None  # one thread, started at the first overlapped fill
        self.last_grammar_s = {"fill": 0.0, "apply": 0.0}  # the latest step's, wherever each ran (chapter 19)
        self.accept = accept or accept_greedy  # a greedy row's acceptance rule (chapter 17's SpecAcceptor.accept)
        self.graph_runner_cls = graph_runner_cls  # an extension point (exercise 12): what enable_decode_graphs builds
        if self.device.type == "cpu":  # a step's freed buffers stay in the heap for the next step (chapter 12)
            keep_freed_memory()
        self.block_size = block_size
        extra = {"num_offload_blocks": num_offload_blocks} if num_offload_blocks else {}  # chapter 14's CPU tier
        self.kv_cache = kv_cache_cls.for_model(model, num_blocks, block_size, num_cpu_blocks, **extra)
        self.sampler = sampler if sampler is not None else MiniSampler(self.device)
        self.num_queries_per_kv = model.config.num_attention_heads // model.config.num_key_value_heads
        self.graph_runner: DecodeGraphRunner | None = None  # decode steps through static buffers (chapter 12)

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> bool:
        """Run decode-only steps through a :class:`~minivllm.cuda_graphs.DecodeGraphRunner` (chapter 12).

        ``capture`` records CUDA graphs (a GPU); without it the same padded
        batch runs eagerly (how the CPU tests drive it). Refused (False) for an
        attention backend whose ``forward`` does not declare that slot -1 writes
        nowhere, since padding rows would write into the pool.
        """
        if not getattr(type(self.kv_cache).forward, "skips_padding_slots", False):
            return False
        self.graph_runner = self.graph_runner_cls(self.model, self.kv_cache, self.block_size, max_num_seqs,
                                                  max_model_len, self.num_queries_per_kv, capture)
        return True

    def copy_blocks(self, out: SchedulerOutput) -> None:
        """Offloads to the CPU tier first (their blocks were evicted and may be written by any later copy),
        then a fork's copies, swap-outs, restores from the tier and swap-ins (they may reuse blocks just copied out)."""
        if out.offload:
            self.kv_cache.offload(out.offload)
        self.kv_cache.copy_blocks(out.copies)
        self.kv_cache.swap(out.swap_out, to_cpu=True)
        if out.restore:
            self.kv_cache.restore(out.restore)
        self.kv_cache.swap(out.swap_in, to_cpu=False)

    def step_inputs(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """The step's flat token batch as plain lists (what rank 0 broadcasts under tensor parallelism)."""
        ids, positions, logits_rows = [], [], []
        for c in chunks:
            d = len(c.spec_token_ids)
            ids.extend(c.seq.token_slice(c.start, c.end - d) + c.spec_token_ids if d else
                       c.seq.token_slice(c.start, c.end))
            positions.extend(range(c.start, c.end))
            logits_rows.extend(range(len(ids) - d - 1, len(ids)) if d else [len(ids) - 1] * len(c.sample_seqs))
        return StepInputs(ids, positions, [slot for c in chunks for slot in c.slots],
                          [c.seq.block_table for c in chunks], [c.end for c in chunks],
                          [c.num_tokens for c in chunks], logits_rows)

    def tensors(self, inputs: StepInputs):
        """Input ids, positions, the attention metadata and the rows to sample, on the device."""
        batch = PagedBatch(inputs.block_tables, inputs.context_lens, inputs.query_lens, self.block_size, self.device,
                           self.num_queries_per_kv, inputs.slot_mapping)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(inputs.token_ids), as_tensor(inputs.positions), batch, as_tensor(inputs.logits_rows)

    def prepare(self, chunks: list[ScheduledChunk]):
        """The flat tensors of one step: input ids, positions, the attention metadata, the rows to sample."""
        return self.tensors(self.step_inputs(chunks))

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], clock=None) -> SamplerOutput:
        """One forward over every chunk; a sampled token for each sequence the chunks sample, in order.

        ``clock`` (a :class:`minivllm.timing.PhaseClock`) gets the phases
        prepare, forward and sample marked, for chapter 12's breakdown of a step.
        """
        mark = clock.mark if clock is not None else _noop_mark
        if not chunks:
            return SamplerOutput([], [])
        self.last_grammar_s = {"fill": 0.0, "apply": 0.0}
        inputs = self.step_inputs(chunks)
        filling = self.start_fill(chunks, len(inputs.logits_rows)) if self.overlap_grammar_fill else None
        try:
            logits = self.forward_inputs(inputs, mark)
        except BaseException:  # joined even so: nothing else may touch the matchers while it fills
            if filling is not None:
                wait_futures([filling])
            raise
        if logits is None:
            if filling is not None:
                wait_futures([filling])
            return SamplerOutput([], [])
        self.apply_grammars(logits, chunks, mark, filling)
        if any(c.spec_token_ids for c in chunks):
            result = self.verify(logits, chunks)
        else:
            seqs = [s for c in chunks for s in c.sample_seqs]
            result = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
        mark("sample")
        return result

    def start_fill(self, chunks: list[ScheduledChunk], num_rows: int) -> Future | None:
        """The step's bitmasks filled on the worker thread, as a future of :meth:`fill_grammars`' result;
        None if no row has a grammar. The forward runs meanwhile (chapter 19)."""
        rows = self.grammar_rows(chunks)
        if not rows:
            return None
        if self._fill_worker is None:
            self._fill_worker = ThreadPoolExecutor(1, thread_name_prefix="minivllm-grammar-fill")
        return self._fill_worker.submit(self.fill_grammars, rows, num_rows, self.model.config.vocab_size)

    def fill_grammars(self, rows: list[tuple], num_rows: int, vocab_size: int) -> tuple[torch.Tensor, list[int]]:
        """A fresh bitmask of ``num_rows`` rows (every token allowed) with the constrained rows filled by the
        ``grammar_masker``, and those rows; its time goes to ``last_grammar_s["fill"]``."""
        start = time.perf_counter()
        bitmask = self.grammar_masker.new_bitmask(num_rows, vocab_size)
        index = self.grammar_masker.fill(bitmask, rows)
        self.last_grammar_s["fill"] = time.perf_counter() - start
        return bitmask, list(index)

    def stop_fill_worker(self) -> None:
        """End the fill thread, if one started (the engine's shutdown); a later step starts another."""
        worker, self._fill_worker = self._fill_worker, None
        if worker is not None:
            worker.shutdown(wait=True)

    def apply_grammars(
        self, logits: torch.Tensor, chunks: list[ScheduledChunk], mark=_noop_mark, filled: Future | None = None
    ) -> bool:
        """Mask, in place, the logits of every row whose sample has a grammar (chapter 19); False if
        none has. The time it takes is the step's "grammar" phase (the logits before it stay in
        "sample", as without one). ``filled``: the bitmasks already filled while the forward ran
        (:meth:`start_fill`), so the phase holds only what is left of the fill and the apply; its error,
        if the fill failed, is raised here, as the fill's own would be.

        A plain row gets its matcher's bitmask. A drafted row (chapter 17) has
        ``1 + d`` rows: row ``i`` follows draft ``i - 1``, so the matcher is
        advanced through the drafts to fill each position's mask, then rolled
        back (only the tokens ``update`` appends advance it for good). Past a
        draft the grammar refuses (or its end) the rows are left whole: that
        draft is rejected at its own position, where its mask forbids it.
        The runner's ``grammar_masker`` does it (an extension point, exercise
        19: minivllm's own is :class:`~minivllm.sampler.MiniGrammarMasker`).
        A row the mask leaves no token (a constraint with a dead end) raises
        :class:`~minivllm.structured_output.NoContinuation` rather than sample
        from nothing (a NaN, or token 0): the engine ends that request alone.
        """
        rows = self.grammar_rows(chunks)
        if not rows:
            return False
        mark("sample")
        if filled is not None and logits.shape[-1] == self.model.config.vocab_size:
            bitmask, index = filled.result()
        else:
            bitmask, index = self.fill_grammars(rows, logits.shape[0], logits.shape[-1])
        start = time.perf_counter()
        if index:
            self.grammar_masker.apply(logits, bitmask, index)
        self.last_grammar_s["apply"] = time.perf_counter() - start
        index = [r + i for r, _, drafts in rows for i in range(len(drafts) + 1)]
        if torch.isneginf(logits[index]).all(dim=-1).any():
            raise NoContinuation()
        mark("grammar")
        return True

    @staticmethod
    def grammar_rows(chunks: list[ScheduledChunk]) -> list[tuple]:
        """``(first logits row, grammar, drafts)`` of every constrained sample of the step, in logits order."""
        rows, row = [], 0
        for c in chunks:
            if c.spec_token_ids:
                if c.seq.grammar is not None:
                    rows.append((row, c.seq.grammar, c.spec_token_ids))
                row += len(c.spec_token_ids) + 1
                continue
            for s in c.sample_seqs:
                if s.grammar is not None:
                    rows.append((row, s.grammar, []))
                row += 1
        return rows

    def verify(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> SamplerOutput:
        """A step with drafts (chapter 17): rows without drafts go through the sampler as usual, each drafted
        row's ``1 + d`` logits through :func:`verify_drafts`; per sample, its last token and the drafts kept."""
        plain, drafted, row = [], [], 0
        for c in chunks:
            if c.spec_token_ids:
                drafted.append((c, row))
                row += len(c.spec_token_ids) + 1
            else:
                plain.extend((row + j, s) for j, s in enumerate(c.sample_seqs))
                row += len(c.sample_seqs)
        seqs = [s for _, s in plain]
        sampled = self.sampler(logits[[r for r, _ in plain]], [s.params for s in seqs], [s.generator for s in seqs]) \
            if plain else SamplerOutput([], [])
        default = getattr(self.sampler, "generator", None)
        kept = {id(c): verify_drafts(logits[r:r + len(c.spec_token_ids) + 1], c.spec_token_ids, c.seq.params,
                                     c.seq.generator or default, self.accept) for c, r in drafted}
        tokens, logprobs = iter(sampled.token_ids), iter(sampled.logprobs or [None] * len(seqs))
        out = SamplerOutput([], [], [])
        for c in chunks:
            for _ in c.sample_seqs:
                got = kept.get(id(c))
                out.token_ids.append(got[-1] if got else next(tokens))
                out.logprobs.append(None if got else next(logprobs))
                out.num_accepted.append(len(got) - 1 if got else 0)
        return out

    def forward_inputs(self, inputs: StepInputs, mark=_noop_mark) -> torch.Tensor | None:
        """One forward over a step's inputs; the logits of the rows that sample (None when no row samples)."""
        if self.graph_runner is not None and self.graph_runner.fits(inputs):
            hidden = self.graph_runner.run(inputs, mark)  # the real rows only
            rows = torch.tensor(inputs.logits_rows, dtype=torch.long, device=self.device)
        else:
            ids, positions, batch, rows = self.tensors(inputs)
            mark("prepare")
            hidden = self.model.forward(ids, positions, self.kv_cache, batch)
        mark("forward")
        if len(rows) == 0:
            return None
        return self.model.compute_logits(hidden[rows])

    def run_prefill_chunk(self, seq: Sequence, chunk_token_ids: list[int],
                          start_pos: int) -> int | None:
        """Prefill ``chunk_token_ids`` of ``seq`` at positions ``start_pos`` onward (chapter 09).

        The chunk attends to every cached token before ``start_pos`` and causally
        within itself; KV slots come from the global token index through the
        block table. Exactly what :meth:`run` does for one chunk of a batch.
        Returns the sampled token if the chunk ends the sequence, else None.
        """
        end = start_pos + len(chunk_token_ids)
        chunk_slots = slots(seq.block_table, start_pos, end, self.block_size)
        chunk = ScheduledChunk(seq, start_pos, len(chunk_token_ids), chunk_slots)
        if seq.token_slice(chunk.start, chunk.end) != list(chunk_token_ids):
            raise ValueError("chunk_token_ids must be the sequence's tokens at "
                             "[start_pos, start_pos + len)")
        out = self.run([chunk])
        return out.token_ids[0] if out.token_ids else None
