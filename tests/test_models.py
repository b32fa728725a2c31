"""minivllm's own Llama forward against HF transformers on the same weights."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from minivllm import kernels as minivllm_kernels
from minivllm import load_model
from minivllm.attention import ContiguousKVCache
from minivllm.models import load_config, load_tokenizer, model_folder
from minivllm.models.llama import rope_inv_freq
from minivllm.models.loader import FORWARD_FIELDS

PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Paged attention stores keys and values in fixed-size blocks. " * 8,
]


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("which", ["smollm2-135m", "tiny-random"])
def test_logits_match_transformers(which, packed, hf_models):
    """Within 2e-4 on logits that reach |30|: float32 rounding (about 1e-5 relative), whichever matmul runs."""
    model, tok = load_model(which, "cpu", pack_weights=packed)
    if (model.lm_head.packed is not None) != packed:
        pytest.skip("oneDNN weight packing is not available here")
    hf = hf_models(which)
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        ours = model.logits(ids)
        with torch.no_grad():
            theirs = hf(torch.tensor([ids])).logits[0]
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max().item() < 2e-4, prompt


def test_packed_and_plain_models_share_the_checkpoint():
    """Packing adds a oneDNN copy for the matmul; both models hold the very same parameter tensors."""
    packed, _ = load_model("smollm2-135m", "cpu", pack_weights=True)
    plain, _ = load_model("smollm2-135m", "cpu", pack_weights=False)
    assert plain.lm_head.packed is None and packed is not plain
    for (name, a), (_, b) in zip(packed.named_parameters(), plain.named_parameters()):
        assert a.data_ptr() == b.data_ptr(), name
    assert packed.lm_head.weight is packed.model.embed_tokens.weight  # tied embeddings
    assert load_model("smollm2-135m", "cpu", pack_weights=True)[0] is packed  # cached per option


def test_packing_fuses_the_projections_that_share_an_input():
    """q/k/v and gate/up run as one packed matmul each, side by side each linear's own output; unpacked, apart."""
    packed, _ = load_model("smollm2-135m", "cpu", pack_weights=True)
    plain, _ = load_model("smollm2-135m", "cpu", pack_weights=False)
    if packed.lm_head.packed is None:
        pytest.skip("oneDNN weight packing is not available here")
    linear = torch.nn.functional.linear
    for model, fused in ((packed, True), (plain, False)):
        attn, mlp = model.model.layers[3].self_attn, model.model.layers[3].mlp
        assert (attn.fused_qkv is not None, mlp.fused_gate_up is not None) == (fused, fused)
        assert attn.q_proj.packed is None and (attn.o_proj.packed is not None) == fused
        x = torch.randn(5, attn.q_proj.in_features)
        qkv = attn.project_qkv(x)
        assert qkv.shape == (5, 576 + 192 + 192)
        q, k, v = qkv.split([576, 192, 192], dim=-1)
        gate, up = mlp.project_gate_up(x).chunk(2, dim=-1)
        for out, m in ((q, attn.q_proj), (k, attn.k_proj), (v, attn.v_proj), (gate, mlp.gate_proj), (up, mlp.up_proj)):
            assert torch.allclose(out, linear(x, m.weight), atol=1e-4)


@pytest.mark.parametrize("kernels", ["cpu", "reference"])
@pytest.mark.parametrize("plain_max_rows", ["rule", 3, 1, 0])
def test_a_packed_model_multiplies_up_to_plain_max_rows_through_the_row_major_weights(plain_max_rows, kernels):
    """Matrix-vector products (at most the model's plain_max_rows rows) run on the row-major weights: the C++
    table's linear (up to eight rows: the rule there) or F.linear (up to three: the rule on PyTorch's kernels);
    more rows run oneDNN's packed copy: bitwise what each kernel gives, and each other's to float32 rounding."""
    from minivllm.models.linear import NATIVE_MATMUL_MAX_ROWS, PLAIN_MATMUL_MAX_ROWS

    if kernels == "cpu" and minivllm_kernels.cpu_table() is None:
        pytest.skip("no C++ kernels here")
    packed, _ = load_model("smollm2-135m", "cpu", pack_weights=True, kernels=kernels)
    if packed.lm_head.packed is None:
        pytest.skip("oneDNN weight packing is not available here")
    rule = {"cpu": NATIVE_MATMUL_MAX_ROWS, "reference": PLAIN_MATMUL_MAX_ROWS}[kernels]
    assert packed.plain_max_rows == rule == {"cpu": 8, "reference": 3}[kernels]  # the rule: rows and the table
    plain_max_rows = rule if plain_max_rows == "rule" else plain_max_rows
    linear, onednn = torch.nn.functional.linear, torch.ops.mkldnn._linear_pointwise
    row_major = minivllm_kernels.cpu_table().linear if kernels == "cpu" else linear
    attn, mlp = packed.model.layers[2].self_attn, packed.model.layers[2].mlp
    stacked = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(attn.fused_qkv.weight, stacked)  # the fused matmul keeps the stacked row-major weight too
    matmuls = packed.packed_matmuls()
    assert len(matmuls) == 4 * len(packed.model.layers) + 1 and all(m.plain_max_rows == rule for m in matmuls)
    try:
        packed.set_plain_rows(plain_max_rows)
        for rows in (1, 2, 3, 4, 8, 9):
            x = torch.randn(rows, attn.q_proj.in_features)
            h = torch.randn(rows, mlp.down_proj.in_features)
            plain = rows <= plain_max_rows
            cases = [(attn.fused_qkv(x), stacked, attn.fused_qkv.packed, x), (attn.o_proj(x), attn.o_proj.weight,
                     attn.o_proj.packed, x), (mlp.down_proj(h), mlp.down_proj.weight, mlp.down_proj.packed, h),
                     (packed.lm_head(x), packed.lm_head.weight, packed.lm_head.packed, x)]
            for out, weight, packed_weight, inp in cases:
                want = row_major(inp, weight) if plain else onednn(inp, packed_weight, None, "none", [], "")
                assert torch.equal(out, want), f"{rows} rows should run {'row-major' if plain else 'packed'}"
                assert torch.allclose(out, linear(inp, weight), atol=1e-4)
    finally:
        packed.set_plain_rows(rule)


def test_the_layout_is_a_rule_never_timed(monkeypatch):
    """Which kernel multiplies a row decides its rounding, so no load times one against another (issue 61): with
    every clock of the process frozen, packing keeps the plain layout for the rule's rows, as always;
    set_plain_rows pins another split, within its range."""
    import time as time_module

    from minivllm.models import linear

    def frozen():
        raise AssertionError("a model load read the clock to choose a kernel")

    model, _ = load_model("smollm2-135m", "cpu", pack_weights=True)
    if model.lm_head.packed is None:
        pytest.skip("oneDNN weight packing is not available here")
    for name in ("perf_counter", "monotonic", "time", "perf_counter_ns", "monotonic_ns", "time_ns"):
        monkeypatch.setattr(time_module, name, frozen)
    try:  # the model is load_model's shared one: put it back as it was
        rule = model.plain_rows_rule()
        assert rule == (linear.NATIVE_MATMUL_MAX_ROWS if model.kernels == "cpu" else linear.PLAIN_MATMUL_MAX_ROWS)
        assert model.pack_weights() and model.plain_max_rows == rule
        assert all(m.plain_max_rows == rule for m in model.packed_matmuls())
        model.set_plain_rows(0)
        assert all(m.plain_max_rows == 0 for m in model.packed_matmuls())
        with pytest.raises(ValueError, match="rows must be in 0..8"):
            model.set_plain_rows(9)
    finally:
        model.set_plain_rows(model.plain_rows_rule())


def test_matmul_layouts_times_both_layouts_over_every_layer():
    """Chapter 12's timing of the two weight layouts: a positive time for each row count and layout."""
    from minivllm.bench import matmul_layouts

    packed, _ = load_model("smollm2-135m", "cpu", pack_weights=True)
    plain, _ = load_model("smollm2-135m", "cpu", pack_weights=False)
    with pytest.raises(ValueError, match="pack_weights=True"):
        matmul_layouts(plain)
    if packed.lm_head.packed is None:
        pytest.skip("oneDNN weight packing is not available here")
    times = matmul_layouts(packed, rows=(1, 4, 9), repeats=1)
    kernel = {"cpu kernel"} if packed.kernels == "cpu" else set()  # the C++ matvec, up to its 8 rows
    assert set(times) == {1, 4, 9} and [set(t) for t in times.values()] == [{"plain", "packed"} | kernel] * 2 + [
        {"plain", "packed"}]
    assert all(s > 0 for t in times.values() for s in t.values())


def test_bfloat16_packing_computes_what_the_plain_bfloat16_model_does():
    """On a CPU with bf16 oneDNN, packing (and fusing) a bf16 model keeps its logits to within one bf16 step."""
    from minivllm.models.linear import mkldnn_bf16_supported

    if not mkldnn_bf16_supported():
        pytest.skip("no bfloat16 oneDNN on this CPU")
    packed, tok = load_model("smollm2-135m", "cpu", torch.bfloat16, pack_weights=True)
    plain, _ = load_model("smollm2-135m", "cpu", torch.bfloat16, pack_weights=False)
    assert packed.model.layers[0].mlp.fused_gate_up is not None and plain.lm_head.packed is None
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        a, b = packed.logits(ids).float(), plain.logits(ids).float()
        assert (a - b).abs().max().item() <= 0.125 and torch.equal(a.argmax(-1), b.argmax(-1)), prompt


def test_smollm2_architecture(smollm2):
    model, tok = smollm2
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    assert model.head_dim == 64 and c.vocab_size == 49152
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings
    assert tok.eos_token == "<|im_end|>"


def test_tiny_random_is_seeded(tiny, tmp_path, monkeypatch):
    """A fresh cache folder rebuilds exactly the same weights from the seed."""
    from minivllm.models import loader

    smollm2 = loader.smollm2_folder()  # reuse its tokenizer; do not convert it again
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    (tmp_path / "smollm2-135m").symlink_to(smollm2)
    _, again, _ = loader._read_checkpoint("tiny-random", "cpu", torch.float32)
    assert (tmp_path / "tiny-random" / "model.safetensors").exists()
    assert set(again) == set(tiny[0].state_dict())
    for name, tensor in tiny[0].state_dict().items():
        assert torch.equal(tensor, again[name]), name


def test_positions_offset_matches_cached_forward(tiny):
    """Running a suffix at positions [a, b) after caching [0, a) equals the full forward."""
    model, tok = tiny
    ids = torch.tensor(tok(PROMPTS[3])["input_ids"])
    full = model.logits(ids)
    cache = ContiguousKVCache.for_model(model, len(ids))
    a = len(ids) // 3
    model.logits(ids[:a], torch.arange(a), cache)
    tail = model.logits(ids[a:], torch.arange(a, len(ids)), cache)
    assert (tail - full[a:]).abs().max().item() < 1e-4


def test_unknown_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type"):
        load_model(str(tmp_path))


def test_starting_an_engine_imports_no_compiler_and_no_architecture_config():
    """The loader builds the model on "meta": a random init there would import torch._dynamo (about 1 s of every
    worker's and rank's start) for weights the checkpoint then replaces. The embedding is still the checkpoint's.
    Nor does it import transformers' Llama config class, which pulls in torch.distributed.tensor (about 1.3 s)."""
    code = ("import sys, torch, minivllm; from minivllm.models import load_model, model_folder; "
            "from safetensors.torch import load_file; "
            "llm = minivllm.LLM('tiny-random', device='cpu'); "
            "model, _ = load_model('tiny-random', 'cpu'); "
            "out = llm.generate([[5, 6, 7]], minivllm.SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False); "
            "saved = load_file(next(model_folder('tiny-random').glob('*.safetensors')))['model.embed_tokens.weight']; "
            "print('torch._dynamo' in sys.modules, len(out[0].outputs[0].token_ids), "
            "torch.equal(model.model.embed_tokens.weight, saved), model.model.rotary.cos.device, "
            "'torch.distributed.tensor' in sys.modules)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "4", "True", "cpu", "False"], out.stdout


def _tiny_config() -> dict:
    """tiny-random's config.json (transformers 5's spelling: ``rope_parameters``)."""
    return json.loads((model_folder("tiny-random") / "config.json").read_text())


def _in_v4_spelling(raw: dict, rope_scaling) -> dict:
    """``raw`` with RoPE spelled as transformers 4 writes it: ``rope_theta`` beside ``rope_scaling``."""
    return {**{k: v for k, v in raw.items() if k != "rope_parameters"},
            "rope_theta": raw["rope_parameters"]["rope_theta"], "rope_scaling": rope_scaling}


def _config_folder(folder, config: dict) -> str:
    """A model folder holding only ``config``, as load_config reads it."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-random", "tiny-random-8h"])
def test_a_config_that_states_the_forward_fields_reads_as_transformers_reads_it(name):
    """load_config takes such a config.json as it stands, without the architecture's class; every field the forward
    reads, and the RoPE table, are what AutoConfig gives."""
    from transformers import AutoConfig

    ours, theirs = load_config(name), AutoConfig.from_pretrained(model_folder(name))
    assert type(ours).__name__ != "LlamaConfig", "the architecture's config class was loaded"
    for field in FORWARD_FIELDS + ("model_type", "attention_bias"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert torch.equal(rope_inv_freq(ours, ours.head_dim)[0], rope_inv_freq(theirs, theirs.head_dim)[0])


def test_a_config_in_transformers_4s_spelling_reads_as_it_stands_and_quietly(tmp_path):
    """Most Hub checkpoints spell plain RoPE ``rope_theta`` with ``rope_scaling: null``: the same config and RoPE
    table, without the architecture's class and without transformers 5's warning about the old key."""
    raw = _tiny_config()
    folder = _config_folder(tmp_path / "v4", _in_v4_spelling(raw, None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load_config(folder)
    assert type(config).__name__ != "LlamaConfig", "the architecture's config class was loaded"
    assert torch.equal(rope_inv_freq(config, raw["head_dim"])[0],
                       rope_inv_freq(load_config("tiny-random"), raw["head_dim"])[0])


def test_a_config_that_leaves_a_field_out_or_scales_rope_goes_through_transformers(tmp_path):
    """Where config.json omits a field the forward reads, the architecture's default fills it (KV heads = query
    heads for Llama); scaled RoPE in transformers 4's spelling (``rope_scaling``) is applied, not dropped."""
    raw = _tiny_config()
    plain = rope_inv_freq(load_config("tiny-random"), raw["head_dim"])[0]
    no_kv = {k: v for k, v in raw.items() if k != "num_key_value_heads"}
    config = load_config(_config_folder(tmp_path / "no_kv_heads", no_kv))
    assert (type(config).__name__, config.num_key_value_heads) == ("LlamaConfig", raw["num_attention_heads"])
    linear = _in_v4_spelling(raw, {"rope_type": "linear", "factor": 2.0})
    config = load_config(_config_folder(tmp_path / "linear_rope", linear))
    assert type(config).__name__ == "LlamaConfig"  # transformers 4's generic class would not read rope_scaling
    assert torch.allclose(rope_inv_freq(config, raw["head_dim"])[0], plain / 2)


@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-random"])
def test_the_embedded_models_tokenizer_is_the_one_autotokenizer_loads(name):
    """load_tokenizer loads the folders the loader writes without AutoTokenizer (which loads the model config
    class first): the same ids, text, chat template and special tokens."""
    from transformers import AutoTokenizer

    ours, theirs = load_tokenizer(name), AutoTokenizer.from_pretrained(model_folder(name))
    assert type(ours) is type(theirs)
    for text in PROMPTS + ["ünïcode  spaces\n\n\t<|im_end|>"]:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
        assert ours.decode(ours(text)["input_ids"]) == theirs.decode(theirs(text)["input_ids"]), text
    chat = [{"role": "user", "content": "What is paged attention?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == theirs.apply_chat_template(
        chat, add_generation_prompt=True)
    assert (ours.all_special_ids, ours.eos_token_id, ours.pad_token_id, len(ours)) == (
        theirs.all_special_ids, theirs.eos_token_id, theirs.pad_token_id, len(theirs))


def test_the_converted_tokenizer_has_the_special_tokens_the_gguf_states():
    """transformers 5.17's GGUF conversion made ``<|im_start|>`` the end-of-sequence token (a chat reply then ran
    past ``<|im_end|>``); the loader sets bos, eos, unk and pad from the GGUF's own ids."""
    from minivllm.models.loader import gguf_path, gguf_special_tokens, set_special_tokens

    ids = gguf_special_tokens(gguf_path())
    assert ids == {"bos_token": 1, "eos_token": 2, "unk_token": 0, "pad_token": 2}
    tok = load_tokenizer("smollm2-135m")
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (1, 2, 0, 2)
    assert tok.eos_token == "<|im_end|>"
    tok.eos_token, tok.pad_token = "<|im_start|>", None  # what the 5.17 conversion gave
    set_special_tokens(tok, ids)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 2, 2)


def test_the_gguf_tensor_table_is_gguf_readers_on_every_tensor_of_the_embedded_file():
    """``read_gguf_tensors`` walks the header and skips the metadata (milliseconds); ``gguf.GGUFReader`` decodes it
    all (seconds): the same names in the same order, types, ggml dims, array shapes, dtypes and bytes."""
    import numpy as np
    from gguf import GGUFReader

    from minivllm.models.loader import gguf_path, read_gguf_tensors

    ours, theirs = read_gguf_tensors(gguf_path()), GGUFReader(gguf_path()).tensors
    assert list(ours) == [t.name for t in theirs] and len(ours) == 272
    for t in theirs:
        mine = ours[t.name]
        assert mine.tensor_type == t.tensor_type and mine.shape == tuple(int(d) for d in t.shape), t.name
        assert mine.data.shape == t.data.shape and mine.data.dtype == t.data.dtype, t.name
        assert np.array_equal(mine.data, t.data, equal_nan=mine.data.dtype != np.uint8), t.name
    assert {t.tensor_type.name for t in ours.values()} == {"F32", "Q4_1", "Q8_0"}


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    from minivllm.models.loader import read_gguf_tensors

    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_tensors(path)
