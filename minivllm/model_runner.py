"""From a scheduled batch to sampled tokens: one forward per engine step (chapter 06, the model runner).

The scheduler hands over ``(sequence, start, num_tokens)`` chunks: prefill
chunks, whole prompts and single decode tokens alike. The runner flattens
them into one token batch (input ids, positions, slot mapping, block tables,
context lengths), runs the model once, computes logits only for the chunks
that end at their sequence's last token, and samples those.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minivllm.attention import PagedBatch, PagedKVCache
from minivllm.sampler import sample
from minivllm.sequence import Sequence


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at position ``start`` (= its cached_token_count)."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool = field(init=False)  # only a chunk that reaches the sequence's last token samples

    def __post_init__(self):
        self.samples = self.end == self.seq.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, seed: int = 0, num_cpu_blocks: int = 0):
        self.model = model
        self.device = model.lm_head.weight.device
        self.block_size = block_size
        self.kv_cache = PagedKVCache.for_model(model, num_blocks, block_size, num_cpu_blocks)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def prepare(self, chunks: list[ScheduledChunk]):
        """The flat tensors of one step: input ids, positions, paged-attention indices, rows to sample."""
        ids, positions, logits_rows = [], [], []
        for c in chunks:
            ids.extend(c.seq.token_slice(c.start, c.end))
            positions.extend(range(c.start, c.end))
            if c.samples:
                logits_rows.append(len(ids) - 1)
        batch = PagedBatch([c.seq.block_table for c in chunks], [c.end for c in chunks],
                           [c.num_tokens for c in chunks], self.block_size, self.device)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(positions), batch, as_tensor(logits_rows)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], clock=None) -> list[int]:
        """One forward over every chunk; returns a sampled token for each chunk that samples, in order.

        ``clock`` (a :class:`minivllm.bench.PhaseClock`) gets the phases prepare,
        forward and sample marked, for chapter 11's breakdown of a step.
        """
        mark = clock.mark if clock is not None else (lambda name: None)
        if not chunks:
            return []
        ids, positions, batch, rows = self.prepare(chunks)
        self.kv_cache.batch = batch
        mark("prepare")
        hidden = self.model.forward(ids, positions, self.kv_cache)
        mark("forward")
        if len(rows) == 0:
            return []
        logits = self.model.compute_logits(hidden[rows])
        sampling = [c.seq for c in chunks if c.samples]
        tokens = sample(logits, [s.params for s in sampling], [s.generator for s in sampling], self.generator)
        mark("sample")
        return tokens

    def run_prefill_chunk(self, seq: Sequence, chunk_token_ids: list[int], start_pos: int) -> int | None:
        """Prefill ``chunk_token_ids`` of ``seq`` at positions ``start_pos`` onward (chapter 09).

        The chunk attends to every cached token before ``start_pos`` and causally
        within itself; KV slots come from the global token index through the
        block table. Exactly what :meth:`run` does for one chunk of a batch.
        Returns the sampled token if the chunk ends the sequence, else None.
        """
        chunk = ScheduledChunk(seq, start_pos, len(chunk_token_ids))
        if seq.token_slice(chunk.start, chunk.end) != list(chunk_token_ids):
            raise ValueError("chunk_token_ids must be the sequence's tokens at [start_pos, start_pos + len)")
        out = self.run([chunk])
        return out[0] if out else None
