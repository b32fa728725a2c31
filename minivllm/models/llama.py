"""A Llama-family decoder that reads Hugging Face weights (chapter 00, "the model").

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP;
Qwen2 adds biases to the q/k/v projections and Qwen3 normalises q and k per
head. Tokens are a flat ``[T]`` batch with explicit ``positions``: the model
never assumes a sequence starts at 0, so the same forward serves a full
prefill, a chunk of one, a decode step, or a whole scheduled batch. Where keys
and values live is the job of the ``kv`` object handed to :meth:`forward`
(see :mod:`minivllm.attention`).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.attention import NoCache, PagedBatch
from minivllm.compiled_attention import RECOMPILE_LIMIT, write_and_attend
from minivllm.config import EngineConfig

PLAIN_MATMUL_MAX_ROWS = 3
"""The most rows a packed float32 model multiplies through the plain row-major weight (chapter 12).

One to three rows (a decode step of up to three sequences) make matrix-vector
products, bound by streaming the weight from memory, where MKL's plain kernel
(``F.linear``) outran oneDNN's blocked layout on every CPU the course measured
(Intel Xeons with AVX-512 and AMX, an AMD EPYC Zen 5). It is a rule, the same
on every machine, never a timing at load: which kernel multiplies a row decides
its float32 rounding, so a stopwatch would make the same prompt give different
logits from one run to the next. :meth:`LlamaForCausalLM.set_plain_rows` pins
another split (0: oneDNN for every row count).
"""

MATVEC_MAX_ROWS = 2
"""The most rows ``compile_matvec``'s kernels take (chapter 12).

Compiled, :func:`matvec` reads each weight once for one or two rows and
streams it close to the memory's speed: on a 2-core AMD EPYC it took 60-90%
of oneDNN's packed time at one and two rows, and lost from three rows on,
where the packed GEMM reuses each loaded weight for more rows. With
``compile_matvec=True`` they take one and two rows, always (a rule, not a race).
"""

MATVEC_EVENT = "compiled matvec"  # the profiler's name for a compiled matvec call (bench.decode_op_breakdown)


def use_packed(x: torch.Tensor, plain_max_rows: int = PLAIN_MATMUL_MAX_ROWS) -> bool:
    """Whether ``x``'s rows go through the packed weight: more than ``plain_max_rows`` of them (in float32; a
    bfloat16 model always multiplies through oneDNN's packed layout)."""
    return x.shape[0] > plain_max_rows or x.dtype != torch.float32


def matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for a handful of rows, said as one pass over ``weight`` (chapter 12).

    Each row of ``x`` multiplies every weight row and sums along it. Eager
    PyTorch would materialise ``weight * row`` (a weight-sized temporary per
    row); compiled by ``torch.compile``, the rows unroll into one loop over
    the weight that loads each weight once for every row and keeps the sums
    in registers: a matrix-vector kernel bound by how fast memory streams.
    """
    return torch.stack([(weight * row).sum(-1) for row in x.unbind(0)])


class CountedCompile:
    """``fn`` under ``torch.compile`` (one whole graph, static shapes), the seconds of its compiling calls counted.

    ``compile_seconds`` is the wall time of the calls that compiled; ``shapes``
    what each compile was for: ``shape_of(args)`` (by default every tensor
    argument's shape and dtype) and the inference mode. Under the profiler
    each call is named :data:`MATVEC_EVENT`.
    """

    def __init__(self, fn, shape_of=None):
        config = torch._dynamo.config  # raised for the whole process: dynamo reads it as each call compiles
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        self.fn = torch.compile(fn, fullgraph=True, dynamic=False)
        self.shape_of = shape_of or (lambda args: tuple((tuple(a.shape), a.dtype) for a in args
                                                        if isinstance(a, torch.Tensor)))
        self.compile_seconds = 0.0
        self.shapes: set[tuple] = set()

    def __call__(self, *args) -> torch.Tensor:
        key = self.shape_of(args) + (torch.is_inference_mode_enabled(),)
        if torch.autograd.profiler._is_profiler_enabled:  # named for the profiler: its kernels are matmuls mostly
            with torch.profiler.record_function(MATVEC_EVENT):
                return self._call(key, args)
        return self._call(key, args)

    def _call(self, key, args):
        if key in self.shapes:
            return self.fn(*args)
        start = time.perf_counter()
        out = self.fn(*args)
        self.shapes.add(key)
        self.compile_seconds += time.perf_counter() - start
        return out


class CompiledMatvec(CountedCompile):
    """:func:`matvec` under ``torch.compile``: one compile per (rows, weight shape)."""

    def __init__(self):
        super().__init__(matvec)


def matvec_agrees(compiled: CompiledMatvec, weights, max_rows: int) -> bool:
    """Compile ``compiled`` for every weight shape at 1 to ``max_rows`` rows and check it against ``F.linear``
    on seeded probes (to float32 rounding)."""
    probe = torch.Generator().manual_seed(0)
    for rows in range(1, max_rows + 1):
        for w in weights:
            x = torch.randn(rows, w.shape[1], generator=probe, dtype=w.dtype)
            if not torch.allclose(compiled(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4):
                return False
    return True


def multiply(m, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ m.weight.T + bias`` through the kernel ``m``'s rules pick for ``x``'s rows (chapter 12): the compiled
    matrix-vector product up to ``m.matvec_max_rows`` rows, the plain weight up to ``m.plain_max_rows``, else the
    packed weight (where there is one)."""
    if m.matvec is not None and x.dtype == torch.float32:
        if torch.compiler.is_compiling() and x.shape[0] <= MATVEC_MAX_ROWS:  # a CompiledLayer half: traced in
            out = matvec(x, m.weight)
            return out if bias is None else out + bias
        if x.shape[0] <= m.matvec_max_rows:
            out = m.matvec(x, m.weight)
            return out if bias is None else out + bias
    if m.packed is not None and use_packed(x, m.plain_max_rows):
        return torch.ops.mkldnn._linear_pointwise(x, m.packed, bias, "none", [], "")
    return F.linear(x, m.weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` that can multiply through a prepacked oneDNN weight on the CPU (chapter 12).

    Decode steps multiply a few rows by every weight of the model, so they are
    bound by how fast weights stream from memory; oneDNN's blocked weight
    layout streams them faster than the plain row-major matmul at decode batch
    sizes of four rows and more (up to ``plain_max_rows`` rows keep the plain
    weight: :data:`PLAIN_MATMUL_MAX_ROWS`).
    :meth:`LlamaForCausalLM.pack_weights` fills ``packed``; ``weight`` stays
    the checkpoint's tensor.
    """

    packed: torch.Tensor | None = None
    plain_max_rows: int = PLAIN_MATMUL_MAX_ROWS  # set by pack_weights (the rule) or set_plain_rows
    matvec: CompiledMatvec | None = None  # set by compile_matvec, for up to matvec_max_rows rows
    matvec_max_rows: int = 0

    def matmul(self, x):
        """``x @ weight.T`` through the kernel :func:`multiply` picks for ``x``'s rows; no bias."""
        return multiply(self, x, None)

    def forward(self, x):
        return multiply(self, x, self.bias)

    def pack(self) -> None:
        """Fill ``packed`` with oneDNN's layout of ``weight``."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 32)


def mkldnn_bf16_supported() -> bool:
    """Whether oneDNN multiplies bfloat16 natively on this CPU (AMX or AVX-512 BF16); False where torch cannot say."""
    return bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())


class FusedMatmul:
    """Linears that read the same input as one packed matmul, their weights stacked (chapter 12).

    ``q_proj``, ``k_proj`` and ``v_proj`` (and ``gate_proj`` with ``up_proj``)
    multiply the same activations; one wider matmul streams the same weights
    in one kernel call instead of three. Calling it returns the linears'
    outputs side by side, ``[T, sum of out_features]``. The stacked weight is
    kept twice: in oneDNN's packed layout, and row-major (``weight``) for
    batches of at most ``plain_max_rows`` rows.
    """

    def __init__(self, *linears: Linear):
        self.weight = torch.cat([m.weight.detach() for m in linears])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 32)
        biases = [m.bias for m in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.plain_max_rows = PLAIN_MATMUL_MAX_ROWS  # set by pack_weights (the rule) or set_plain_rows
        self.matvec: CompiledMatvec | None = None  # set by compile_matvec
        self.matvec_max_rows = 0

    def __call__(self, x) -> torch.Tensor:
        return multiply(self, x, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int):
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

    def project_qkv(self, x):
        """Queries, keys and values side by side, ``[T, (heads + 2 kv_heads) * dim]``: one fused matmul where packed."""
        if self.fused_qkv is not None:
            return self.fused_qkv(x)
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def qkv_rope(self, x, cos, sin):
        """Queries and keys (RoPE applied) and values of ``x``'s rows, ``[T, heads, dim]`` each."""
        t, h, kvh = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.project_qkv(x).view(t, h + 2 * kvh, self.head_dim)
        qk, v = qkv[:, :h + kvh], qkv[:, h + kvh:]  # every query and key head, then the value heads
        if self.q_norm is not None:  # Qwen3 normalises each query and key head before RoPE
            qk = torch.cat([self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])], dim=1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        qk = qk * cos + rotate_half(qk) * sin  # RoPE on queries and keys at once
        return qk[:, :h], qk[:, h:], v

    def forward(self, x, cos, sin, positions, kv, batch):
        q, k, v = self.qkv_rope(x, cos, sin)
        out = kv.forward(self.layer_idx, q, k, v, positions, batch)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.fused_gate_up: FusedMatmul | None = None  # set by pack_weights

    def project_gate_up(self, x):
        """The gate and up projections ``[T, intermediate]``: one fused matmul where packed, else two."""
        if self.fused_gate_up is not None:
            return self.fused_gate_up(x).chunk(2, dim=-1)
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x):
        gate, up = self.project_gate_up(x)
        gate = F.silu(gate, inplace=True)  # in place: a [tokens, intermediate] buffer less per layer
        return self.down_proj(gate.mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, head_dim)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    compiled: CompiledLayer | None = None  # set by compile_matvec: both halves compiled, for up to compiled_max_rows
    compiled_max_rows: int = 0

    def before_attention(self, x, cos, sin):
        """The layer up to attention: the queries, keys and values of the normed rows."""
        return self.self_attn.qkv_rope(self.input_layernorm(x), cos, sin)

    def after_attention(self, x, attn_out):
        """The layer after attention: o_proj, the residual, the MLP and its residual."""
        attn = self.self_attn
        x = x + attn.o_proj(attn_out.reshape(x.shape[0], attn.num_heads * attn.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode_step(self, x, cos, sin, k_slots, v_slots, write, block_tables, context_lens, block_size: int):
        """The whole layer in a decode-only step, its paged attention included (:func:`write_and_attend`): what
        ``compile_matvec`` compiles as one graph, so a layer is one call."""
        q, k, v = self.before_attention(x, cos, sin)
        out = write_and_attend(q, k, v, k_slots, v_slots, write, block_tables, context_lens, block_size)
        return self.after_attention(x, out)

    def forward(self, x, cos, sin, positions, kv, batch):
        before, after = type(self).before_attention, type(self).after_attention
        if self.compiled is not None and x.shape[0] <= self.compiled_max_rows:
            in_place = getattr(kv, "decode_in_place", None)  # the paged cache, in a decode-only step
            pools = in_place(self.self_attn.layer_idx, batch) if in_place is not None else None
            if pools is not None and self.compiled.step is not None:
                return self.compiled.step(self, x, cos, sin, *pools)
            before, after = self.compiled.before, self.compiled.after
        q, k, v = before(self, x, cos, sin)
        out = kv.forward(self.self_attn.layer_idx, q, k, v, positions, batch)  # the paged cache: eager
        return after(self, x, out)


class CompiledLayer:
    """A decoder layer compiled (``compile_matvec``, chapter 12): whole, and as its two halves around attention.

    With one or two rows, a layer is a few matrix-vector products with norms,
    RoPE, the activation and the residuals between them: compiled, the
    products are :func:`matvec` loops fused with their neighbours. ``step``
    is the whole layer of a decode-only step, its paged attention too (one
    call a layer; the block tables' width is dynamic, so one compile per row
    count serves every context length); ``before`` and ``after`` are the
    halves, for rows whose attention runs eager (a prefill's, or a cache that
    is not the paged pools). Every layer has the same shapes, so one compile
    per row count serves all of them. ``step`` is None where it failed to
    compile or to agree.
    """

    def __init__(self):
        self.before = CountedCompile(DecoderLayer.before_attention)
        self.after = CountedCompile(DecoderLayer.after_attention)
        self.step: CountedCompile | None = CountedCompile(DecoderLayer.decode_step,
                                                           lambda args: (args[1].shape[0], args[-1]))  # rows, block size

    @property
    def compile_seconds(self) -> float:
        parts = (self.before, self.after) + ((self.step,) if self.step is not None else ())
        return sum(part.compile_seconds for part in parts)


class Backbone(nn.Module):
    def __init__(self, config, head_dim: int):
        super().__init__()
        # The loader builds the model on "meta", then hands it the checkpoint's weights. There a random init (or any
        # factory but empty) runs torch's Python reference, whose first call imports torch._dynamo: about 1 s of
        # every process that starts an engine (a worker, a rank). So the embedding is given an empty weight.
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(DecoderLayer(config, i, head_dim) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 causal LM with HF parameter names, so HF state dicts load as they are."""

    plain_max_rows = 0  # set by pack_weights: up to this many rows, the packed matmuls use the row-major weights
    matvec: CompiledMatvec | None = None  # set by compile_matvec: up to matvec_max_rows rows, the compiled kernel
    matvec_max_rows = 0
    compiled_layers: CompiledLayer | None = None  # set by compile_matvec: the layers' halves, compiled

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.model = Backbone(config, self.head_dim)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq, self.rope_scale = rope_inv_freq(config, self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def pack_weights(self, enabled: bool = True) -> bool:
        """Prepack the linear weights for oneDNN (CPU, float32 or bfloat16); returns whether packing is on.

        Each decoder layer's q/k/v and gate/up projections become one
        :class:`FusedMatmul` each; ``o_proj``, ``down_proj`` and the LM head
        get a packed copy. Falls back to plain ``F.linear`` wherever oneDNN is
        missing or disagrees with it on a test input, so packing never changes
        what the model computes beyond rounding. In bfloat16 (on a CPU with
        AMX or AVX-512 BF16) the packed matmuls are about 1.7x the plain ones.
        """
        linears = [m for m in self.modules() if isinstance(m, Linear)]

        def clear():
            self.matvec, self.matvec_max_rows = None, 0  # the fused matmuls are rebuilt: compile_matvec again
            self.compiled_layers = self._compile_layers(0)
            for m in linears:
                m.packed, m.matvec, m.matvec_max_rows = None, None, 0
            for layer in self.model.layers:
                layer.self_attn.fused_qkv = layer.mlp.fused_gate_up = None

        clear()
        w = self.lm_head.weight
        if (not enabled or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16)
                or not torch.backends.mkldnn.is_available()
                or (w.dtype == torch.bfloat16 and not mkldnn_bf16_supported())):
            return False
        try:
            self._pack()
            if not self._packing_agrees():
                raise RuntimeError("packed and plain matmul disagree")
        except Exception:  # any build without a working oneDNN path: plain F.linear is always right
            clear()
            return False
        self.set_plain_rows(PLAIN_MATMUL_MAX_ROWS if w.dtype == torch.float32 else 0)
        return True

    def set_plain_rows(self, rows: int) -> None:
        """Multiply up to ``rows`` rows through the row-major weights, more through oneDNN's packed ones (chapter 12):
        the rule is :data:`PLAIN_MATMUL_MAX_ROWS` in float32; pin another split here (tests run every one)."""
        if not 0 <= rows <= PLAIN_MATMUL_MAX_ROWS:
            raise ValueError(f"rows must be in 0..{PLAIN_MATMUL_MAX_ROWS}, got {rows}")
        self.plain_max_rows = rows
        for m in self.packed_matmuls():
            m.plain_max_rows = rows

    def _pack(self) -> None:
        """Fuse each layer's q/k/v and gate/up into a packed :class:`FusedMatmul`; pack o, down and the LM head."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.fused_qkv = FusedMatmul(attn.q_proj, attn.k_proj, attn.v_proj)
            mlp.fused_gate_up = FusedMatmul(mlp.gate_proj, mlp.up_proj)
            for m in (attn.o_proj, mlp.down_proj):
                m.pack()
        self.lm_head.pack()

    def packed_matmuls(self) -> list:
        """Every packed matmul of a forward: each layer's fused q/k/v, o, fused gate/up and down, then the LM head."""
        out = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out += [attn.fused_qkv, attn.o_proj, mlp.fused_gate_up, mlp.down_proj]
        return [m for m in out + [self.lm_head] if m is not None and m.packed is not None]

    def layout_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every packed matmul as (row-major weight, oneDNN packed weight), in a forward's order (chapter 12)."""
        return [(m.weight.detach(), m.packed) for m in self.packed_matmuls()]

    def matmuls(self) -> list:
        """Every matmul of a forward in order: the packed ones (:meth:`packed_matmuls`) where packed, else every
        :class:`Linear`."""
        return self.packed_matmuls() or [m for m in self.modules() if isinstance(m, Linear)]

    @torch.inference_mode()
    def compile_matvec(self, max_rows: int = MATVEC_MAX_ROWS) -> int:
        """Run up to ``max_rows`` rows through compiled :func:`matvec` kernels (chapter 12); returns how many rows
        they take (0: none, as before).

        Compiles :func:`matvec` for every weight shape at 1 to ``max_rows`` rows
        (checked against ``F.linear``) and each decoder layer's halves around
        attention whole (:class:`CompiledLayer`, checked against the eager
        halves; where they fail, the layers run the matvec per matmul): seconds
        once, as torch keeps the kernels on disk for the next process. They
        then take every decode batch of up to ``max_rows`` rows: a rule, never
        a race at load, so the same prompt gives the same logits in every
        process. Float32 on the CPU only; where compiling fails or disagrees,
        nothing changes (``max_rows=0`` turns it all off). Call it after
        :meth:`pack_weights`; :func:`~minivllm.models.load_model` does, with
        ``compile_matvec=True``, for a model of its own.
        """
        self.matvec, self.matvec_max_rows = None, 0
        matmuls, w = self.matmuls(), self.lm_head.weight
        for m in matmuls:
            m.matvec, m.matvec_max_rows = None, 0
        self.compiled_layers = self._compile_layers(0)
        if w.device.type != "cpu" or w.dtype != torch.float32 or max_rows < 1:
            return 0
        compiled = CompiledMatvec()
        try:
            if not matvec_agrees(compiled, [m.weight for m in matmuls], max_rows):
                return 0
        except Exception:  # no working compiler: the layouts stay as they are
            return 0
        self.matvec = compiled
        self.compiled_layers = self._compile_layers(max_rows)  # traces matvec into each half: set the rule first
        self._set_compiled_rows(max_rows)
        return max_rows

    def _set_compiled_rows(self, rows: int) -> None:
        """Up to ``rows`` rows through the compiled matvec and (where compiled) the layers' compiled halves."""
        self.matvec_max_rows = rows
        for m in self.matmuls():
            m.matvec, m.matvec_max_rows = self.matvec, rows
        for layer in self.model.layers:
            layer.compiled_max_rows = rows if self.compiled_layers is not None else 0

    def _compile_layers(self, rows: int) -> CompiledLayer | None:
        """Every decoder layer's halves compiled for up to ``rows`` rows (one :class:`CompiledLayer` shared by all),
        checked against the eager halves on layer 0; None (every layer eager) where compiling fails or disagrees."""
        for layer in self.model.layers:
            layer.compiled, layer.compiled_max_rows = None, 0
        if rows < 1:
            return None
        layer, probe = self.model.layers[0], torch.Generator().manual_seed(0)
        self._set_compiled_rows(rows)
        try:
            compiled = CompiledLayer()
            for r in range(1, rows + 1):
                x = torch.randn(r, self.config.hidden_size, generator=probe)
                cos, sin = self.rope(torch.arange(r) + 7, x.dtype)
                want, got = list(layer.before_attention(x, cos, sin)), list(compiled.before(layer, x, cos, sin))
                attn_out = torch.randn(want[0].shape, generator=probe)
                want.append(layer.after_attention(x, attn_out))
                got.append(compiled.after(layer, x, attn_out))
                if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(want, got)):
                    return None
        except Exception:  # no working compiler for a whole layer: the per-matmul kernels stay
            return None
        if not self._decode_step_agrees(compiled, rows):
            compiled.step = None  # the halves, with attention eager between them
        for layer in self.model.layers:
            layer.compiled = compiled
        return compiled

    def _decode_step_agrees(self, compiled: CompiledLayer, rows: int) -> bool:
        """``compiled.step`` at 1 to ``rows`` rows against the eager :meth:`DecoderLayer.decode_step` on layer 0,
        over a small seeded paged pool of the engine's default block size (the compile the engine then uses): the
        output and the keys and values it wrote."""
        layer, probe = self.model.layers[0], torch.Generator().manual_seed(1)
        block_size, heads = EngineConfig.block_size, (self.config.num_key_value_heads, self.head_dim)
        pools = [torch.randn(8 * block_size + 1, *heads, generator=probe) for _ in range(2)]  # 8 blocks + scratch
        tables, context_lens = [[1, 3, 5], [2, 4, 6]], [2 * block_size + 3, block_size + 2]  # third, second block
        try:
            for r in range(1, rows + 1):
                x = torch.randn(r, self.config.hidden_size, generator=probe)
                cos, sin = self.rope(torch.tensor(context_lens[:r]) - 1, x.dtype)
                step = PagedBatch(tables[:r], context_lens[:r], [1] * r, block_size, "cpu")  # one decode row each
                meta = (step.write_slots(8 * block_size), *step.decode_tables(), block_size)
                with torch.inference_mode(False):  # the engine's pools are ordinary tensors, not inference ones
                    want_pools, got_pools = [[p.clone() for p in pools] for _ in range(2)]
                for pool in got_pools:  # as the paged cache marks its pools: one compile for every pool size
                    torch._dynamo.mark_dynamic(pool, 0)
                want = DecoderLayer.decode_step(layer, x, cos, sin, *want_pools, *meta)
                got = compiled.step(layer, x, cos, sin, *got_pools, *meta)
                if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-4)
                           for a, b in zip([want, *want_pools], [got, *got_pools])):
                    return False
        except Exception:  # a compiler that cannot take the attention in: the halves stay
            return False
        return True

    @property
    def matvec_compile_seconds(self) -> float:
        """Seconds ``compile_matvec`` spent compiling: the matvec kernels and the layers' halves."""
        layers = self.compiled_layers.compile_seconds if self.compiled_layers is not None else 0.0
        return (self.matvec.compile_seconds if self.matvec is not None else 0.0) + layers

    def _packing_agrees(self) -> bool:
        """The packed q/k/v (fused) and LM head against plain ``F.linear`` on a seeded probe."""
        attn, w = self.model.layers[0].self_attn, self.lm_head.weight
        probe = torch.randn(PLAIN_MATMUL_MAX_ROWS + 1, attn.q_proj.in_features, generator=torch.Generator().manual_seed(0)).to(w.dtype)
        plain_qkv = torch.cat([F.linear(probe, m.weight, m.bias) for m in (attn.q_proj, attn.k_proj, attn.v_proj)], -1)
        pairs = [(attn.project_qkv(probe), plain_qkv), (self.lm_head(probe), F.linear(probe, w))]
        tol = 1e-4 if w.dtype == torch.float32 else 2e-2
        return all(torch.allclose(a, b, rtol=tol, atol=tol) for a, b in pairs)

    def rope(self, positions: torch.Tensor, dtype):
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv, batch=None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` for flat tokens ``input_ids[T]`` at ``positions[T]``.

        ``kv`` stores this forward's keys and values and says what each query
        may attend to (a :class:`minivllm.attention.KVCache`: no cache, one
        contiguous cache, or the paged pools); ``batch`` is the step's
        attention metadata for the paged cache (a ``PagedBatch``).
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, positions, kv, batch)
        return self.model.norm(x)

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
