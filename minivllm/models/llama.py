"""A Llama-family decoder that reads Hugging Face weights (chapter 00, "the model").

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP;
Qwen2 adds biases to the q/k/v projections and Qwen3 normalises q and k per
head. Tokens are a flat ``[T]`` batch with explicit ``positions``: the model
never assumes a sequence starts at 0, so the same forward serves a full
prefill, a chunk of one, a decode step, or a whole scheduled batch. Where keys
and values live is the job of the ``kv`` object handed to :meth:`forward`
(see :mod:`minivllm.attention`). The norms, the rotary embedding and the MLP's
activation are ops of the kernel table the model runs (:mod:`minivllm.kernels`,
chapter 18): PyTorch's reference, or the C++ kernels built for this CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.attention import NoCache
from minivllm.kernels import reference
from minivllm.models.linear import FusedMatmul, Linear, WeightLayouts


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``; given the residual stream too, adds ``x`` into it first and returns
    both (one fused pass: ``fused_add_rms_norm``)."""

    ops = reference  # the model's kernel table (LlamaForCausalLM.use_kernels)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of RoPE; non-default schemes (Llama 3 scaling, YaRN) use HF's own table."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu")  # also when building on "meta"
        return 1.0 / (theta ** (exponents / head_dim)), 1.0  # (see Backbone): the loader moves it to the device
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # only for scaled RoPE variants

    return ROPE_INIT_FUNCTIONS[rope_type](config)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """The cos and sin of every position's rotary angles, ``[max_position_embeddings, head_dim / 2]`` each, computed
    once; calling it turns queries and keys in place (``rotary``). One instance serves every layer."""

    ops = reference

    def __init__(self, config, head_dim: int):
        super().__init__()
        self.config, self.head_dim = config, head_dim
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, device, dtype) -> None:
        """Fill the tables on ``device`` (the model is built on "meta", then loaded): angles in float32, as HF."""
        inv_freq, scale = rope_inv_freq(self.config, self.head_dim)
        positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :].float()
        self.cos = (freqs.cos() * scale).to(device=device, dtype=dtype)
        self.sin = (freqs.sin() * scale).to(device=device, dtype=dtype)

    def forward(self, q, k, positions) -> None:
        self.ops.rotary(q, k, positions, self.cos, self.sin)


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, rotary: RotaryEmbedding):
        super().__init__()
        h, kvh, d = config.num_attention_heads, config.num_key_value_heads, head_dim
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.layer_idx, self.num_heads, self.num_kv_heads, self.head_dim = layer_idx, h, kvh, d
        self.q_proj = Linear(config.hidden_size, h * d, bias=bias)
        self.k_proj = Linear(config.hidden_size, kvh * d, bias=bias)
        self.v_proj = Linear(config.hidden_size, kvh * d, bias=bias)
        self.o_proj = Linear(h * d, config.hidden_size, bias=getattr(config, "attention_bias", False))
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.fused_qkv: FusedMatmul | None = None  # set by pack_weights
        self.__dict__["rotary"] = rotary  # shared by every layer: not a submodule of each

    def project_qkv(self, x):
        """Queries, keys and values side by side, ``[T, (heads + 2 kv_heads) * dim]``: one fused matmul where packed."""
        if self.fused_qkv is not None:
            return self.fused_qkv(x)
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def qkv_rope(self, x, positions):
        """Queries and keys (RoPE applied) and values of ``x``'s rows, ``[T, heads, dim]`` each: views of one buffer."""
        t, h, kvh = x.shape[0], self.num_heads, self.num_kv_heads
        q, k, v = self.project_qkv(x).view(t, h + 2 * kvh, self.head_dim).split([h, kvh, kvh], dim=1)
        if self.q_norm is not None:  # Qwen3 normalises each query and key head before RoPE
            q = self.q_norm(q.reshape(t * h, -1)).view(t, h, -1)
            k = self.k_norm(k.reshape(t * kvh, -1)).view(t, kvh, -1)
        self.rotary(q, k, positions)
        return q, k, v

    def forward(self, x, positions, kv, batch):
        q, k, v = self.qkv_rope(x, positions)
        out = kv.forward(self.layer_idx, q, k, v, positions, batch)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    ops = reference

    def __init__(self, config):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.fused_gate_up: FusedMatmul | None = None  # set by pack_weights

    def project_gate_up(self, x):
        """The gate and up projections side by side ``[T, 2 * intermediate]``: one fused matmul where packed."""
        if self.fused_gate_up is not None:
            return self.fused_gate_up(x)
        return torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.project_gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, head_dim, rotary)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, positions, kv, batch):
        """One layer over the residual stream: ``x`` is the previous layer's output, not yet added to ``residual``
        (None before the first layer, where ``x`` is the stream). Returns the new pair."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, kv, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Backbone(nn.Module):
    def __init__(self, config, head_dim: int):
        super().__init__()
        # The loader builds the model on "meta", then hands it the checkpoint's weights. There a random init (or any
        # factory but empty) runs torch's Python reference, whose first call imports torch._dynamo: about 1 s of
        # every process that starts an engine (a worker, a rank). So the embedding is given an empty weight.
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.rotary = RotaryEmbedding(config, head_dim)
        self.layers = nn.ModuleList(DecoderLayer(config, i, head_dim, self.rotary)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(WeightLayouts, nn.Module):
    """Llama / Qwen2 / Qwen3 causal LM with HF parameter names, so HF state dicts load as they are."""

    plain_max_rows = 0  # set by pack_weights (plain_rows_rule): up to this many rows, the row-major weights
    kernels = "reference"  # the kernel table the model runs (use_kernels): "reference", "cpu" or "triton"
    ops = reference
    quantization: str | None = None  # "gguf" once use_gguf_weights gave the linears the file's blocks
    gguf_activations: str | None = None  # then what they multiply: "int8" (llama.cpp's arithmetic) or "float32"
    fused_decode_supported = True  # a few-row decode step may run its layers in one native call (tensor parallel: no)

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.model = Backbone(config, self.head_dim)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def gguf_dot(self) -> str | None:
        """How decode rows meet the GGUF's blocks (chapter 18): None without them, "float32" (the rows as they are),
        or "q8_1 " and the integer dot product of the kernel table: "avx512-vnni", "avx-vnni", "avx2-maddubs" or
        "scalar" (the C++ table, by the instruction sets it was built for), "torch" (the reference)."""
        if self.quantization is None:
            return None
        return "float32" if self.gguf_activations == "float32" else f"q8_1 {getattr(self.ops, 'int8_dot_kind', '?')}"

    def use_kernels(self, name: str, ops) -> None:
        """Run the norms, the rotary embedding, the activation and the quantized matmuls through ``ops``, the
        kernel table called ``name`` (:func:`minivllm.kernels.choose`; chapter 18)."""
        self.kernels, self.ops = name, ops
        for m in self.modules():
            if isinstance(m, (RMSNorm, RotaryEmbedding, MLP)):
                m.ops = ops
        for m in self.linears():
            if m.quantized_linear is not None:
                m.quantized_linear = getattr(ops, m.quantized_linear.__name__)
        for m in self.packed_matmuls():
            if isinstance(m, FusedMatmul):
                m.stack_quantized()
        self.use_native_linear(ops)

    def rope(self, positions: torch.Tensor, dtype):
        """cos and sin ``[T, head_dim]`` of the rotary angles at ``positions`` (chapter 00: what ``rotary`` applies,
        ``q * cos + rotate_half(q) * sin``)."""
        rotary = self.model.rotary
        cos, sin = rotary.cos[positions], rotary.sin[positions]
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv, batch=None
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` for flat tokens ``input_ids[T]`` at ``positions[T]``.

        ``kv`` stores this forward's keys and values and says what each query
        may attend to (a :class:`minivllm.attention.KVCache`: no cache, one
        contiguous cache, or the paged pools); ``batch`` is the step's
        attention metadata for the paged cache (a ``PagedBatch``).
        """
        x, residual = self.model.embed_tokens(input_ids), None
        # a few decode rows on the C++ table: every layer in one native call (chapter 18e)
        hidden = self.fused_decode(x, positions, kv, batch)
        if hidden is not None:
            return hidden
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, kv, batch)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for the rows of ``hidden`` that sample a token (only those: the vocab is large)."""
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def logits(self, input_ids, positions=None, kv=None, batch=None) -> torch.Tensor:
        """Logits for every token: the convenience form used by tests and chapters."""
        input_ids = torch.as_tensor(input_ids, device=self.lm_head.weight.device)
        if positions is None:
            positions = torch.arange(len(input_ids), device=input_ids.device)
        return self.compute_logits(self.forward(input_ids, positions, kv or NoCache(), batch))
