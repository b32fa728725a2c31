"""Tensor-parallel layers: one model split across ranks, Megatron style (chapter 15).

A linear layer ``Y = X W^T`` can be split two ways. **Column parallel**
splits ``W`` by output features: rank ``r`` holds rows ``[r n/tp, (r+1) n/tp)``
of ``W`` and computes its own slice of ``Y`` from the whole ``X``, with no
communication. **Row parallel** splits ``W`` by input features: rank ``r``
holds a slice of the columns, reads the matching slice of ``X`` and computes
a partial ``Y``; the partial results add up to ``Y`` (one all-reduce).
Chained column then row, the slice each rank produces is exactly the slice
the next layer reads, so an attention block (q/k/v column parallel by heads,
o_proj row parallel) and an MLP (gate/up column parallel, down row parallel)
each cost one all-reduce, whatever the nonlinearity between them.

The vocabulary is split too: each rank embeds the token ids in its range
(zeros elsewhere; an all-reduce completes the rows) and computes the logits
of its range, gathered to rank 0, the only rank that samples. Norms are small
and replicated.

:class:`ParallelLlamaForCausalLM` is :class:`~minivllm.models.llama.LlamaForCausalLM`
over a per-rank config (heads, KV heads and MLP width divided by ``tp``)
with these layers in place of the plain ones; the loader
(:func:`~minivllm.models.loader.load_model_shard`) reads each rank's slices
of the checkpoint only. With ``tp = 1`` none of this is used.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minivllm.models.linear import Linear
from minivllm.models.llama import LlamaForCausalLM, RMSNorm

__all__ = [
    "TensorParallelGroup", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead",
    "ParallelLlamaForCausalLM", "shard_config", "valid_tensor_parallel_sizes", "shard_slice", "weight_bytes",
]

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(eq=False)
class TensorParallelGroup:
    """This rank, the number of ranks, the process group of the forward's collectives, and their time.

    ``comm_seconds`` adds up the wall time spent in this rank's collectives
    (all-reduce, gather, and the step broadcasts the runner adds): on the CPU
    (gloo) they are synchronous, so it includes waiting for the slowest rank.
    """

    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed ProcessGroup; None: the default group
    comm_seconds: float = 0.0
    num_collectives: int = 0
    broadcast_seconds: float = 0.0  # the part of comm_seconds spent in rank 0's step broadcasts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        start = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.count(start)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's ``x`` concatenated along the last dim; the other ranks get None."""
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0, group=self.group)
        self.count(start)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def count(self, start: float) -> None:
        self.comm_seconds += time.perf_counter() - start
        self.num_collectives += 1


def _split(n: int, tp: TensorParallelGroup, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what} ({n}) must divide by tensor_parallel_size ({tp.size})")
    return n // tp.size


class ColumnParallelLinear(Linear):
    """``W`` split by output features (rows of the weight): a slice of ``Y`` per rank, no
    communication."""

    shard_dims = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup):
        super().__init__(in_features, _split(out_features, tp, "output features"), bias=bias)
        self.tp = tp


class RowParallelLinear(Linear):
    """``W`` split by input features (columns of the weight): partial sums, added up by one all-reduce.

    The bias (if any) is added once, after the sum, so every rank holds it whole.
    """

    shard_dims = {"weight": 1}

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup):
        super().__init__(_split(in_features, tp, "input features"), out_features, bias=bias)
        self.tp = tp

    def forward(self, x):
        y = self.matmul(x)
        self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank ``r`` holds the embedding rows of token ids ``[r V/tp, (r+1) V/tp)`` (padded to equal slices).

    Each rank looks up the ids in its range and writes zeros for the others;
    the all-reduce sums one real row with zeros, so the result is exact.
    """

    shard_dims = {"weight": 0}

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup):
        super().__init__()
        self.tp, self.num_embeddings = tp, num_embeddings
        self.per_rank = math.ceil(num_embeddings / tp.size)
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim))

    def forward(self, input_ids):
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.per_rank)
        x = F.embedding(torch.where(inside, local, 0), self.weight)
        x.masked_fill_(~inside[:, None], 0)
        return self.tp.all_reduce(x)


class ParallelLMHead(Linear):
    """The logits of this rank's vocabulary slice, gathered (and unpadded) on rank 0; None on the others."""

    shard_dims = {"weight": 0}

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallelGroup):
        super().__init__(hidden_size, math.ceil(vocab_size / tp.size), bias=False)
        self.tp, self.vocab_size = tp, vocab_size

    def forward(self, hidden):
        logits = self.tp.gather_last_dim(super().forward(hidden))
        return None if logits is None else logits[:, : self.vocab_size]


def valid_tensor_parallel_sizes(config) -> list[int]:
    """The sizes that divide the query heads, the KV heads and the MLP width (SmolLM2-135M: 1 and 3)."""
    n = math.gcd(config.num_attention_heads, config.num_key_value_heads, config.intermediate_size)
    return [d for d in range(1, n + 1) if n % d == 0]


def shard_config(config, tp_size: int):
    """A copy of the HF config with one rank's heads, KV heads and MLP width (the vocabulary stays whole)."""
    local = copy.deepcopy(config)
    local.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    local.num_attention_heads = config.num_attention_heads // tp_size
    local.num_key_value_heads = config.num_key_value_heads // tp_size
    local.intermediate_size = config.intermediate_size // tp_size
    return local


class ParallelLlamaForCausalLM(LlamaForCausalLM):
    """One rank's shard of a Llama-family model: the same forward, parallel layers, this rank's KV heads.

    ``config`` is the per-rank config (what the KV pool and the attention read);
    ``full_config`` the checkpoint's. Collectives run in the same order on
    every rank, so every rank must run every forward.
    """

    fused_decode_supported = False  # each layer's matmuls end in collectives: the op-by-op path

    def __init__(self, config, tp: TensorParallelGroup):
        super().__init__(shard_config(config, tp.size))
        self.full_config, self.tp = config, tp
        h, kvh, d, hidden = config.num_attention_heads, config.num_key_value_heads, self.head_dim, config.hidden_size
        qkv_bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.q_proj = ColumnParallelLinear(hidden, h * d, qkv_bias, tp)
            attn.k_proj = ColumnParallelLinear(hidden, kvh * d, qkv_bias, tp)
            attn.v_proj = ColumnParallelLinear(hidden, kvh * d, qkv_bias, tp)
            attn.o_proj = RowParallelLinear(h * d, hidden, getattr(config, "attention_bias", False), tp)
            mlp.gate_proj = ColumnParallelLinear(hidden, config.intermediate_size, False, tp)
            mlp.up_proj = ColumnParallelLinear(hidden, config.intermediate_size, False, tp)
            mlp.down_proj = RowParallelLinear(config.intermediate_size, hidden, False, tp)
        self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp)
        self.lm_head = ParallelLMHead(hidden, config.vocab_size, tp)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on rank 0 (gathered from every rank's slice); None on the other ranks."""
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()


def shard_slice(model: nn.Module, name: str, full_shape: tuple[int, ...]):
    """How rank ``model.tp.rank`` reads checkpoint tensor ``name``: ``(dim, start, stop, padded length)``.

    ``dim`` is None for a tensor every rank holds whole (the norms, a row
    parallel bias). The last vocabulary slice may be shorter than the others:
    the loader pads it with zero rows.
    """
    module_name, _, param = name.rpartition(".")
    module = model.get_submodule(module_name)
    dim = getattr(module, "shard_dims", {}).get(param)
    if dim is None:
        return None, 0, full_shape[0] if full_shape else 0, None
    local = getattr(module, param).shape[dim]
    start = model.tp.rank * local
    return dim, start, min(start + local, full_shape[dim]), local


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the weights split across ranks and of those every rank holds whole (norms, row-parallel biases).

    Works on a plain model too (every linear and the embedding count as
    split), so a shard's figures compare with the single-process model's.
    Tied weights count once.
    """
    out, seen = {"sharded": 0, "replicated": 0}, set()
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            whole = isinstance(module, RMSNorm) or (isinstance(module, RowParallelLinear) and pname == "bias")
            out["replicated" if whole else "sharded"] += p.numel() * p.element_size()
    return out
