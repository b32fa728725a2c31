"""Chapter 15: a reader's shard_weight(name, weight, rank, world, config), plugged in as EngineConfig.shard_weight."""

import math

import torch

from minivllm.exercises import check_shard_weight
from minivllm.exercises.tensor_parallel import reference_shard_weight, small_config

from exercise_cases import Check

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def shard_weight(name, weight, rank, world, config):
    """The solution notebook's answer."""
    module = name.split(".")[-2]
    if module in COLUMN:
        n = weight.shape[0] // world
        return weight[rank * n:(rank + 1) * n]
    if module in ROW:
        n = weight.shape[1] // world
        return weight[:, rank * n:(rank + 1) * n]
    if module in ("embed_tokens", "lm_head"):
        per_rank = math.ceil(weight.shape[0] / world)
        part = weight[rank * per_rank:(rank + 1) * per_rank]
        return torch.cat([part, part.new_zeros(per_rank - part.shape[0], weight.shape[1])])
    return weight


def shard_by_heads(name, weight, rank, world, config):
    """Another shape: heads counted from the config, torch.chunk and narrow, F.pad for the vocabulary."""
    module = name.split(".")[-2]
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if module in ("q_proj", "k_proj", "v_proj"):
        heads = config.num_attention_heads if module == "q_proj" else config.num_key_value_heads
        per = heads // world
        return weight.narrow(0, rank * per * d, per * d)
    if module in ("gate_proj", "up_proj"):
        return weight.chunk(world, dim=0)[rank]
    if module in ROW:
        return weight.chunk(world, dim=1)[rank]
    if module in ("embed_tokens", "lm_head"):
        per_rank = -(-weight.shape[0] // world)
        padded = torch.nn.functional.pad(weight, (0, 0, 0, per_rank * world - weight.shape[0]))
        return padded[rank * per_rank:(rank + 1) * per_rank]
    return weight


def column_by_columns(name, weight, rank, world, config):
    if name.split(".")[-2] in COLUMN:
        return weight.chunk(world, dim=1)[rank]
    return shard_weight(name, weight, rank, world, config)


def row_by_rows(name, weight, rank, world, config):
    if name.split(".")[-2] == "o_proj":
        return weight.chunk(world, dim=0)[rank]
    return shard_weight(name, weight, rank, world, config)


def down_by_rows(name, weight, rank, world, config):
    if name.split(".")[-2] == "down_proj":
        return weight.chunk(world, dim=0)[rank]
    return shard_weight(name, weight, rank, world, config)


def kv_as_query_heads(name, weight, rank, world, config):
    """k/v sliced with the query heads' count per rank (no GQA)."""
    if name.split(".")[-2] in ("k_proj", "v_proj"):
        n = config.num_attention_heads // world * config.head_dim
        return weight[rank * n:(rank + 1) * n]
    return shard_weight(name, weight, rank, world, config)


def strided_heads(name, weight, rank, world, config):
    """Every world-th row: the right shape, but not this rank's heads."""
    if name.split(".")[-2] in COLUMN:
        return weight[rank::world]
    return shard_weight(name, weight, rank, world, config)


def norms_split(name, weight, rank, world, config):
    if "norm" in name:
        return weight.chunk(world)[rank]
    return shard_weight(name, weight, rank, world, config)


def vocab_unpadded(name, weight, rank, world, config):
    """torch.chunk: uneven vocabulary slices, the last one short."""
    if name.split(".")[-2] in ("embed_tokens", "lm_head"):
        return weight.chunk(world)[rank]
    return shard_weight(name, weight, rank, world, config)


def vocab_replicated(name, weight, rank, world, config):
    if name.split(".")[-2] in ("embed_tokens", "lm_head"):
        return weight
    return shard_weight(name, weight, rank, world, config)


def test_reference_is_the_loaders_slicing():
    """The check's oracle slices as load_model_shard does: column rows, row columns, whole norms, padded vocab."""
    config = small_config()
    w = torch.arange(10 * 18.0).reshape(10, 18)
    assert torch.equal(reference_shard_weight("model.embed_tokens.weight", w, 2, 3, config)[:2], w[8:])
    assert not reference_shard_weight("model.embed_tokens.weight", w, 2, 3, config)[2:].any()
    k = torch.arange(6 * 18.0).reshape(6, 18)
    assert torch.equal(reference_shard_weight("model.layers.0.self_attn.k_proj.weight", k, 1, 3, config), k[2:4])
    down = torch.arange(18 * 12.0).reshape(18, 12)
    assert torch.equal(reference_shard_weight("model.layers.0.mlp.down_proj.weight", down, 1, 3, config), down[:, 4:8])
    norm = torch.arange(18.0)
    assert torch.equal(reference_shard_weight("model.norm.weight", norm, 2, 3, config), norm)


CHECKS = [Check("15", check_shard_weight, [shard_weight, shard_by_heads, reference_shard_weight], {
    "column parallel split by columns": (column_by_columns, "split by output features: dim 0"),
    "o_proj split by rows": (row_by_rows, ("o_proj", "split by input features: dim 1")),
    "down_proj split by rows": (down_by_rows, ("down_proj", "split its columns")),
    "KV heads split as query heads": (kv_as_query_heads, ("k_proj", "num_key_value_heads // world KV heads")),
    "strided heads": (strided_heads, ("wrong values", "rank r takes rows")),
    "norms split": (norms_split, "replicate it"),
    "vocabulary not padded": (vocab_unpadded, ("embed_tokens", "padded\\s+with zero rows")),
    "vocabulary replicated": (vocab_replicated, ("embed_tokens", "split by vocabulary")),
}, passes="the live engine")]
