"""The whole forward as one compiled graph, the CPU's answer to CUDA graphs (chapter 12, ``compile_model``).

An eager step of a small model is a few hundred small ops, each a trip
through Python and the dispatcher, and each norm, residual add, RoPE and
SiLU reads and writes its activations once more. ``torch.compile`` traces the
model's forward over flat tokens once, with the token count symbolic, and
Inductor turns every run of elementwise ops between two matmuls into one C++
loop. Two things stay opaque, called as they are at run time:

- the attention of each layer (:func:`minivllm.attention.attention_op`), whose
  metadata (slot mapping, block tables, groups) changes every step: it reads
  the step's KV cache and :class:`~minivllm.attention.PagedBatch` from
  :func:`~minivllm.attention.forward_context`;
- the packed matmuls (:func:`minivllm.models.llama.packed_matmul`), which
  keep oneDNN's weight layout and the row-count rule of the eager model.

This is what vLLM's compiled mode does on the CPU (``vllm/platforms/cpu.py``:
``CompilationMode.DYNAMO_TRACE_ONCE`` with the Inductor backend, attention and
``onednn_mm`` as custom ops). One graph serves every step with two or more
tokens, prefills and decode batches alike, and a second one single-token
steps (Dynamo specialises a size of 1); compiling takes about a minute on two
cores, once per process and model, counted in :attr:`CompiledModel.compile_seconds`.
"""

from __future__ import annotations

import time

import torch

from minivllm.attention import OpaqueAttention, forward_context

__all__ = ["CompiledModel", "RECOMPILE_LIMIT"]

RECOMPILE_LIMIT = 64  # graphs of one traced function per process: two per model (1 token, more), several models


class CompiledModel:
    """``model.forward`` under ``torch.compile``, called like it: ``(input_ids, positions, kv, batch)``.

    ``compile_seconds`` is the wall time of the calls that compiled, ``shapes``
    the token-count kinds compiled ("1 token", "2+ tokens"). If compiling fails
    (no C++ compiler, an unsupported op), the eager forward runs from then on
    and ``error`` says why; the tokens are the same either way.
    """

    def __init__(self, model):
        config = torch._dynamo.config  # raised for the whole process: dynamo reads it as each call compiles
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        self.model = model
        self.fn = torch.compile(self._traced, dynamic=True, fullgraph=True)
        self.compile_seconds = 0.0
        self.shapes: set[str] = set()
        self.error: str | None = None

    def _traced(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.forward(input_ids, positions, OpaqueAttention(), None)

    @property
    def active(self) -> bool:
        """Whether steps run compiled (False once compiling failed)."""
        return self.error is None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv, batch=None) -> torch.Tensor:
        if self.error is not None:
            return self.model.forward(input_ids, positions, kv, batch)
        shape = "1 token" if input_ids.shape[0] == 1 else "2+ tokens"
        with forward_context(kv, batch):
            if shape in self.shapes:
                return self.fn(input_ids, positions)
            start = time.perf_counter()
            try:
                hidden = self.fn(input_ids, positions)
            except Exception as e:  # compiling failed: the eager forward redoes the step (the same KV), from now on
                self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                return self.model.forward(input_ids, positions, kv, batch)
            self.compile_seconds += time.perf_counter() - start
            self.shapes.add(shape)
            return hidden
