"""Chapter 15, tensor parallelism: the check of the reader's ``shard_weight(name, weight, rank, world, config)``,
rank ``rank``'s shard of one checkpoint tensor, on every tensor of a small GQA layer against the engine's own
slicing, then inside the live engine on two gloo ranks (``EngineConfig.shard_weight``).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from minivllm.engine import LLM
from minivllm.exercises._common import say
from minivllm.exercises.live import _reference, drive, greedy, spawnable
from minivllm.models import TensorParallelGroup
from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.loader import read_slice
from minivllm.models.parallel import COLUMN_PARALLEL, ROW_PARALLEL, ParallelLlamaForCausalLM, shard_slice

__all__ = ["check_shard_weight", "reference_shard_weight", "small_config"]

HINTS = {
    "column": "a column-parallel weight (q/k/v, gate/up) is split by output features: dim 0, the rows of the "
              "[out_features, in_features] weight; rank r takes rows [r n/world, (r+1) n/world)",
    "kv": "k_proj and v_proj have num_key_value_heads heads (3 here, against 9 query heads: grouped-query "
          "attention), so rank r takes num_key_value_heads // world KV heads of head_dim rows each, not a query "
          "head count's worth",
    "row": "a row-parallel weight (o_proj, down_proj) is split by input features: dim 1, the columns; rank r "
           "reads the slice of the input its column-parallel predecessor produced, and the all-reduce adds the "
           "partial outputs",
    "down": "down_proj reads the MLP width: split its columns (dim 1), the same slice of the intermediate features "
            "gate_proj and up_proj give this rank, not its rows",
    "norm": "a norm's weight is tiny and every rank applies it to the whole hidden vector: replicate it (return "
            "the whole tensor on every rank)",
    "vocab": "embed_tokens and lm_head are split by vocabulary (dim 0) in slices of ceil(vocab / world) rows; "
             "rank r takes token ids [r per_rank, (r+1) per_rank), and the last slice, when shorter, is padded "
             "with zero rows to per_rank (vocabulary 10 over 3 ranks: 4, 4, then 2 + 2 zero rows)",
}


def small_config(vocab_size: int = 10) -> LlamaConfig:
    """One Llama layer with SmolLM2's grouping (9 query heads, 3 KV heads) at head_dim 2, MLP width 12."""
    return LlamaConfig(hidden_size=18, intermediate_size=12, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=2, num_hidden_layers=1, vocab_size=vocab_size, tie_word_embeddings=False)


def reference_shard_weight(name: str, weight: torch.Tensor, rank: int, world: int, config) -> torch.Tensor:
    """minivllm's shard of ``weight``: the slice the engine's loader reads (``shard_slice``), padded as it pads."""
    with torch.device("meta"):
        shell = ParallelLlamaForCausalLM(config, TensorParallelGroup(rank, world))
    return read_slice(weight, *shard_slice(shell, name, tuple(weight.shape)))


def _hint(name: str) -> str:
    module = name.rsplit(".", 2)[-2]
    if "norm" in module:
        return HINTS["norm"]
    if module in ("embed_tokens", "lm_head"):
        return HINTS["vocab"]
    if module in ("k_proj", "v_proj"):
        return HINTS["kv"] + "; " + HINTS["column"]
    if module == "down_proj":
        return HINTS["down"]
    return HINTS["column"] if module in COLUMN_PARALLEL else HINTS["row"] if module in ROW_PARALLEL else ""


def _what_it_holds(got: torch.Tensor, want: torch.Tensor, full: torch.Tensor) -> str:
    """The first element that differs, and which element of the full weight the reader's shard put there."""
    index = tuple(int(i) for i in (got != want).nonzero()[0])
    value = got[index].item()
    where = (full == value).nonzero()
    source = f"the full weight's element {tuple(int(i) for i in where[0])}" if len(where) else f"the value {value}"
    expected = "a zero (padding)" if want[index].item() == 0 and not (full == 0).any() else \
        f"the full weight's element {tuple(int(i) for i in (full == want[index]).nonzero()[0])}"
    return f"at {index} it holds {source}, expected {expected}"


def _check_tensor(fn, name: str, full: torch.Tensor, rank: int, world: int, config) -> None:
    call = f"shard_weight({name!r}, <a {list(full.shape)} tensor>, rank={rank}, world={world}, config)"
    want = reference_shard_weight(name, full, rank, world, config)
    try:
        got = fn(name, full.clone(), rank, world, config)
    except Exception as e:
        raise AssertionError(f"{call} raised {type(e).__name__}: {e}") from e
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{call} returned {type(got).__name__}, expected a tensor")
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{call} returned a {list(got.shape)} shard, expected {list(want.shape)}; {_hint(name)}")
    if got.dtype != want.dtype or not torch.equal(got, want):
        raise AssertionError(f"{call}: the shard has the right shape but the wrong values: "
                             f"{_what_it_holds(got, want, full)}; {_hint(name)}")


def _check_targeted(fn) -> int:
    """Every tensor of the small layer, every rank, for 1 and 3 ranks (the vocabulary uneven over 3)."""
    config = small_config()
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    cases = 0
    for world in (1, 3):
        for name, shape in shapes.items():
            offset = 1 + cases * 1000  # distinct nonzero values: a wrong element names where it came from
            full = torch.arange(offset, offset + shape.numel(), dtype=torch.float32).reshape(shape)
            for rank in range(world):
                _check_tensor(fn, name, full, rank, world, config)
            cases += 1
    return cases


def _check_live(fn, model: str, world: int, requests, options: dict) -> str:
    expected, _, _ = _reference(model, options, requests)  # one process, the whole model
    what = f"your shard_weight in the live engine ({model}, tensor_parallel_size={world})"
    with LLM(model, tensor_parallel_size=world, shard_weight=spawnable(fn, "shard_weight"), **options) as llm:
        outputs, schedule = drive(llm, requests, what)
    for rid, want in expected.items():
        if outputs[rid] != want:
            i = next((i for i, (a, b) in enumerate(zip(want, outputs[rid])) if a != b), len(want))
            raise AssertionError(f"{what}: request {rid} differs from the single-process engine at output token {i}: "
                                 f"expected {want}, got {outputs[rid]}")
    return f"{len(requests)} requests, {len(schedule)} steps"


def check_shard_weight(fn, model: str = "tiny-random-8h", world: int = 2, live: bool = True) -> None:
    """Check ``fn(name, weight, rank, world, config)``, rank ``rank``'s shard of a checkpoint tensor (chapter 15).

    First every tensor of one Llama layer with SmolLM2's grouping (9 query
    heads, 3 KV heads), its embedding and LM head, on every rank of 1 and 3
    ranks, against the slices minivllm's loader reads; a difference names the
    tensor, the rank and the element, with a hint for each classic mistake.
    The first failure stops the check. Then, unless ``live=False``, the live
    engine with ``shard_weight=fn`` on ``world`` gloo ranks must give the
    single-process engine's greedy tokens.
    """
    cases = _check_targeted(fn)
    say(f"check_shard_weight: column-parallel, row-parallel, replicated and vocabulary-parallel shards are right "
          f"({cases} tensors of a 9-query-head, 3-KV-head layer, every rank of 1 and 3 ranks).")
    if not live:
        return
    prompts = [[(37 * i + j) % 200 + 3 for j in range(5 + 7 * i)] for i in range(4)]
    requests = [(str(i), p, greedy(6)) for i, p in enumerate(prompts)]
    options = dict(device="cpu", dtype="float32", num_blocks=32, block_size=8, max_num_seqs=4)
    done = _check_live(fn, model, world, requests, options)
    say(f"check_shard_weight: the live engine ({model}, tensor_parallel_size={world} over gloo, {done}) with your "
          f"shards gave exactly the single-process engine's greedy tokens.")
