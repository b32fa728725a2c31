"""CUDA graphs for decode steps (chapter 12): launch a whole decode forward with one call.

A decode step of a small model is a few hundred tiny kernels, and on a GPU
launching them costs more than running them. A CUDA graph records the
kernels of one forward once and replays them with a single launch. A graph
replays fixed shapes and fixed addresses, so:

- decode-only steps are captured for a few batch sizes (:func:`capture_sizes`:
  1, 2, 4, 8, 16, ... up to ``max_num_seqs``), all in one memory pool;
- every input lives in a static buffer (input ids, positions, slot mapping,
  context lengths, block tables), rewritten in place before each replay;
- a batch of ``n`` runs the smallest captured size ``b >= n``
  (:func:`bucket_for`); its ``b - n`` padding rows have slot -1, which the KV
  pool writes to a scratch slot no block table reaches, context length 1
  and block table zeros (they read one key of block 0), and their outputs
  are cut off before sampling, so they are never sampled.

**The rule against "freeing blocks out of step with graph slots".** A graph
writes keys and values wherever its static slot mapping says at replay time.
If a row kept the slot of an earlier step, a replay could write into a block
that was freed since and now belongs to another sequence. So: *before every
replay all ``b`` rows of the slot mapping are rewritten: the step's ``n`` real
slots (blocks the block manager gave to this step's sequences) and -1 for
every padding row; a graph of size ``b`` reads no row beyond ``b``.* No stale
slot survives into a replay, and since the buffers are filled on the compute
stream before the replay is queued, the GPU sees them in order.

The same code runs on the CPU as an eager "replay" (``capture=False``): the
padded batch through the same static buffers, which is how the tests check
the padding, the slots and the tokens without a GPU.
"""

from __future__ import annotations

import warnings

import torch

from minivllm.attention import PagedBatch
from minivllm.config import cdiv

__all__ = ["capture_sizes", "bucket_for", "DecodeGraphRunner", "MiniDecodeGraphRunner", "GRAPH_MAX_CONTEXT"]

# Longest context a captured step attends over; a decode step with a longer one runs eagerly. The gather
# kernel reads this many keys per row in every replay (varlen reads only the real ones), so it stays modest.
GRAPH_MAX_CONTEXT = 1024


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: powers of two below ``max_num_seqs``, and ``max_num_seqs`` itself."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def bucket_for(n: int, sizes: list[int]) -> int:
    """The smallest captured size that holds ``n`` rows."""
    if not 1 <= n <= sizes[-1]:
        raise ValueError(f"a decode batch must have 1 to {sizes[-1]} rows, got {n}")
    return next(b for b in sizes if b >= n)


class DecodeGraphRunner:
    """Static buffers and one graph per batch size for a model and its paged KV pool (see the module doc).

    ``capture=True`` (CUDA) records the graphs now; ``capture=False`` runs
    the same padded batch eagerly, on any device. ``num_replays`` and
    ``num_eager`` count the steps each way. The interface (an extension point,
    ``graph_runner_cls``): exercise 12 subclasses it and writes :meth:`load`;
    minivllm's own is :class:`MiniDecodeGraphRunner`'s.
    """

    def __init__(self, model, kv_cache, block_size: int, max_num_seqs: int, max_model_len: int,
                 num_queries_per_kv: int = 1, capture: bool = False):
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.num_queries_per_kv = num_queries_per_kv
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = cdiv(min(max_model_len, GRAPH_MAX_CONTEXT), block_size)
        device, rows = model.lm_head.weight.device, self.sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(rows, self.max_blocks, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = self.num_eager = 0
        if capture:
            self.capture()

    def fits(self, inputs) -> bool:
        """Whether a step (a ``StepInputs``) is decode-only and within the captured sizes and context."""
        q = inputs.query_lens
        return (0 < len(q) <= self.sizes[-1] and all(n == 1 for n in q)
                and all(len(t) <= self.max_blocks for t in inputs.block_tables))

    def load(self, inputs) -> int:
        """Write the step (a ``StepInputs``) into the static buffers in place, every row up to the size run: the
        real rows, then padding rows (slot -1, context length 1, block 0); returns that size. Exercise 12."""
        raise NotImplementedError("not written yet: DecodeGraphRunner.load")

    def _forward(self, b: int) -> torch.Tensor:
        """The padded forward of size ``b`` over the static buffers (what a graph records)."""
        batch = PagedBatch.for_decode(self.block_tables[:b], self.context_lens[:b], self.slot_mapping[:b],
                                      self.block_size, self.num_queries_per_kv)
        return self.model.forward(self.input_ids[:b], self.positions[:b], self.kv_cache, batch)

    @torch.inference_mode()
    def run(self, inputs, mark=lambda name: None) -> torch.Tensor:
        """Hidden states of the step's real rows: a graph replay if one was captured, else the eager replay."""
        b = self.load(inputs)
        mark("prepare")
        if b in self.graphs:
            self.graphs[b].replay()
            hidden = self.outputs[b]
            self.num_replays += 1
        else:
            hidden = self._forward(b)
            self.num_eager += 1
        return hidden[:len(inputs.query_lens)]  # padding rows are cut here: they are never sampled

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first, into one shared memory pool (CUDA only).

        The buffers hold padding (slot -1) while capturing, so the warm-up and
        the recording write only the scratch slot. A forward that cannot be
        captured (an attention backend that reads a tensor on the host: a
        boolean-mask index, ``.item()``, ``.tolist()``) leaves no graph: a
        warning names the backend and the error, and decode steps run eagerly.
        """
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(1)
        stream = torch.cuda.current_stream()
        try:
            self._record_graphs()
        except RuntimeError as e:  # torch's CUDA errors (AcceleratorError among them) are RuntimeErrors
            torch.cuda.set_stream(stream)  # a failed capture leaves its capture stream current
            self.graphs.clear()
            self.outputs.clear()
            warnings.warn(f"CUDA graph capture failed with the attention backend {type(self.kv_cache).__name__} "
                          f"({str(e).splitlines()[0]}); decode steps run eagerly. A captured forward must not read a "
                          "tensor on the host: no boolean-mask indexing, .item() or .tolist()", RuntimeWarning,
                          stacklevel=2)

    def _record_graphs(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for b in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture, as the CUDA graphs docs advise
                self._forward(b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()


class MiniDecodeGraphRunner(DecodeGraphRunner):
    """minivllm's own (the engine's default ``graph_runner_cls``): the padding rule of exercise 12."""

    def load(self, inputs) -> int:
        n = len(inputs.query_lens)
        b, w = bucket_for(n, self.sizes), self.max_blocks
        pad = b - n
        host = {self.input_ids: inputs.token_ids + [0] * pad, self.positions: inputs.positions + [0] * pad,
                self.slot_mapping: inputs.slot_mapping + [-1] * pad, self.context_lens: inputs.context_lens + [1] * pad,
                self.block_tables: [t + [0] * (w - len(t)) for t in inputs.block_tables] + [[0] * w] * pad}
        for buffer, values in host.items():
            buffer[:b].copy_(torch.tensor(values, dtype=torch.long))
        return b
