"""How a Llama-family model's weights are laid out for the kernels that multiply them (chapters 12, 18).

A decode step multiplies a few rows by every weight, bound by streaming the
weights from memory; a prefill multiplies many rows, bound by arithmetic.
:class:`Linear` picks the kernel by the rows it is given, by a rule: the GGUF's
blocks as stored (``quantization="gguf"``) for a few rows, the plain row-major
weight for one to three (one to eight through the C++ table's ``linear`` where
the model runs it), oneDNN's packed layout above. :class:`FusedMatmul`
stacks the projections that read the same input into one matmul.
:class:`WeightLayouts` is what the model does with them: pack, fuse, pin a
split, take the GGUF's blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.attention import PAGED_KERNEL, MiniPagedKVCache
from minivllm.kernels.cpu import MAX_ROWS, CpuKernels

PLAIN_MATMUL_MAX_ROWS = 3
"""The most rows a packed float32 model on PyTorch's kernels multiplies through the plain row-major weight (chapter 12).

One to three rows (a decode step of up to three sequences) make matrix-vector
products, bound by streaming the weight from memory, where MKL's plain kernel
(``F.linear``) outran oneDNN's blocked layout on the Intel Xeons the course
measured. On the C++ kernel table the split is :data:`NATIVE_MATMUL_MAX_ROWS`
instead. It is a rule, the same on every machine, never a timing at load:
which kernel multiplies a row decides its float32 rounding, so a stopwatch
would make the same prompt give different logits from one run to the next.
:meth:`LlamaForCausalLM.set_plain_rows` pins another split (0: oneDNN for
every row count).
"""

NATIVE_MATMUL_MAX_ROWS = MAX_ROWS
"""The most rows a float32 model on the C++ kernel table multiplies through the table's ``linear`` (chapters 12, 18).

One to eight rows stream the row-major weight once for all of them, every
row's sums in registers (``mv_linear_f32``): on a 2-core AMD EPYC (AVX2) the
table's ``linear`` took 53 µs where ``F.linear`` took 89 for one row of the
fused q/k/v weight, 129 against 253 (oneDNN's packed weight: 161) at eight,
and 3.3 against 9.4 ms for one row of the LM head, where MKL's one-row kernel
reads 12 GB/s of a machine's 28. Above eight rows oneDNN's packed weight
reuses each weight across the rows. The rule reads the rows and the table,
never a clock, and ``in_features`` must be whole vectors of 16 floats (the
kernel's lanes on every CPU), else the row-major ``F.linear`` runs.
"""

NATIVE_LANES = 16  # in_features a multiple of this goes through the table's linear (csrc kLanes: 8 or 16)

QUANTIZED_MAX_ROWS = 8
"""The most rows a model with the GGUF's weights (``quantization="gguf"``) multiplies through them as stored.

A decode step of up to eight sequences reads each 4-bit block once for every
row (``q4_1_linear``); more rows multiply the float32 copy through oneDNN's
GEMM, which reuses each weight across many rows (chapter 18).
"""


def use_packed(x: torch.Tensor, plain_max_rows: int = PLAIN_MATMUL_MAX_ROWS) -> bool:
    """Whether ``x``'s rows go through the packed weight: more than ``plain_max_rows`` of them (in float32; a
    bfloat16 model always multiplies through oneDNN's packed layout)."""
    return x.shape[0] > plain_max_rows or x.dtype != torch.float32


def use_native(m, x: torch.Tensor) -> bool:
    """Whether ``x``'s rows (not sent to the packed weight) go through the C++ table's ``linear``
    (:data:`NATIVE_MATMUL_MAX_ROWS`): the model runs that table, ``x`` is float32 with 1 to 8 rows, its features
    whole vectors, and the weight is row-major in memory (a tensor-parallel shard may be a strided view)."""
    return (m.native_linear is not None and 1 <= x.shape[0] <= NATIVE_MATMUL_MAX_ROWS and x.dtype == torch.float32
            and x.dim() == 2 and x.shape[1] % NATIVE_LANES == 0 and m.weight.is_contiguous())


def multiply(m, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ m.weight.T + bias`` through the kernel the rules pick for ``x``'s rows (chapters 12, 18): the weights
    as the GGUF stores them for up to :data:`QUANTIZED_MAX_ROWS` rows (where loaded), the plain weight up to
    ``m.plain_max_rows`` (through the C++ table's ``linear`` where the model runs it, :func:`use_native`), else
    the packed weight (where there is one)."""
    if m.qweight is not None and x.shape[0] <= QUANTIZED_MAX_ROWS:
        return m.quantized_linear(x, m.qweight, bias)
    if m.packed is not None and use_packed(x, m.plain_max_rows):
        return torch.ops.mkldnn._linear_pointwise(x, m.packed, bias, "none", [], "")
    if use_native(m, x):
        return m.native_linear(x.contiguous(), m.weight, bias)
    return F.linear(x, m.weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` that can multiply through a prepacked oneDNN weight, or the GGUF's blocks (chapters 12, 18).

    Decode steps multiply a few rows by every weight of the model, so they are
    bound by how fast weights stream from memory; oneDNN's blocked weight
    layout streams them faster than the plain row-major matmul at decode batch
    sizes of four rows and more (up to ``plain_max_rows`` rows keep the plain
    weight: :data:`PLAIN_MATMUL_MAX_ROWS`, or :data:`NATIVE_MATMUL_MAX_ROWS`
    through the C++ table's ``linear``, ``native_linear``). :meth:`LlamaForCausalLM.pack_weights`
    fills ``packed``; :meth:`LlamaForCausalLM.use_gguf_weights` fills ``qweight``
    (and ``quantized_linear``, its kernel); ``weight`` stays the checkpoint's tensor.
    """

    packed: torch.Tensor | None = None
    plain_max_rows: int = PLAIN_MATMUL_MAX_ROWS  # set by pack_weights (the rule) or set_plain_rows
    qweight: torch.Tensor | None = None  # the GGUF's blocks, uint8 [out_features, blocks * bytes]
    quantized_linear = None  # the op that reads them: q4_1_linear or q8_0_linear of the model's kernel table (float32
    # activations), q4_1_q8_1_linear or q8_0_q8_0_linear (8-bit activations, llama.cpp's integer dot products)
    native_linear = None  # the C++ table's linear, where the model runs that table (use_kernels; use_native)

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
    batches of at most ``plain_max_rows`` rows; and stacked as the GGUF stores
    it (``qweight``) where the model reads those.
    """

    def __init__(self, *linears: Linear):
        self.linears = linears
        self.weight = torch.cat([m.weight.detach() for m in linears])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 32)
        biases = [m.bias for m in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.plain_max_rows = PLAIN_MATMUL_MAX_ROWS  # set by pack_weights (the rule) or set_plain_rows
        self.native_linear = linears[0].native_linear
        self.stack_quantized()

    def stack_quantized(self) -> None:
        """Stack the linears' GGUF blocks where every one has them (:meth:`LlamaForCausalLM.use_gguf_weights`)."""
        parts = [m.qweight for m in self.linears]
        self.qweight = torch.cat(parts) if all(p is not None for p in parts) else None
        self.quantized_linear = self.linears[0].quantized_linear

    def __call__(self, x) -> torch.Tensor:
        return multiply(self, x, self.bias)


class WeightLayouts:
    """The weight layouts of :class:`~minivllm.models.llama.LlamaForCausalLM` (a mixin: it reads
    ``self.model.layers`` and ``self.lm_head``)."""

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    @torch.no_grad()
    def use_gguf_weights(self, blocks: dict[str, tuple[str, torch.Tensor]], activations: str = "int8") -> None:
        """Give each linear the GGUF's blocks of its weight (chapter 18): ``{parameter name: ("q4_1" or "q8_0",
        uint8 [out_features, bytes])}``. Up to :data:`QUANTIZED_MAX_ROWS` rows then multiply through them;
        ``weight`` stays the float32 weights they dequantise to, for prefill's GEMM. ``activations``: "int8"
        rounds those rows to 8-bit blocks and multiplies integers, as llama.cpp (``q4_1_q8_1_linear``,
        ``q8_0_q8_0_linear``); "float32" multiplies them as they are (``q4_1_linear``, ``q8_0_linear``: exact to
        the float32 weights)."""
        ops = {"int8": {"q4_1": "q4_1_q8_1_linear", "q8_0": "q8_0_q8_0_linear"},
               "float32": {"q4_1": "q4_1_linear", "q8_0": "q8_0_linear"}}[activations]
        names = {m: name for name, m in self.named_modules()}
        for m in self.linears():
            name = names[m] + ".weight"
            if name not in blocks and m is self.lm_head and getattr(self.config, "tie_word_embeddings", False):
                name = "model.embed_tokens.weight"
            if name in blocks:
                kind, qweight = blocks[name]
                m.qweight, m.quantized_linear = qweight, getattr(self.ops, ops[kind])
        for m in self.packed_matmuls():
            if isinstance(m, FusedMatmul):
                m.stack_quantized()
        self.quantization, self.gguf_activations, self._decode_step = "gguf", activations, None

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
        linears = self.linears()

        def clear():
            for m in linears:
                m.packed = None
            for layer in self.model.layers:
                layer.self_attn.fused_qkv = layer.mlp.fused_gate_up = None

        clear()
        self._decode_step = None
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
        self.set_plain_rows(self.plain_rows_rule())
        return True

    def plain_rows_rule(self) -> int:
        """The rows a packed model multiplies through its row-major weights (chapters 12, 18): up to
        :data:`NATIVE_MATMUL_MAX_ROWS` on the C++ table, :data:`PLAIN_MATMUL_MAX_ROWS` on PyTorch's kernels (in
        float32), none in bfloat16."""
        if self.lm_head.weight.dtype != torch.float32:
            return 0
        return NATIVE_MATMUL_MAX_ROWS if self.lm_head.native_linear is not None else PLAIN_MATMUL_MAX_ROWS

    def use_native_linear(self, ops) -> None:
        """Give every linear the table's ``linear`` where ``ops`` is a C++ table (:func:`use_native`), then put the
        split back to its rule where the weights are packed."""
        native = ops.linear if isinstance(ops, CpuKernels) else None
        for m in self.linears() + self.packed_matmuls():
            m.native_linear = native
        self._decode_step = None
        if self.lm_head.packed is not None:
            self.set_plain_rows(self.plain_rows_rule())

    _decode_step = None  # the fused decode step's plan (decode_step_plan): built at first use, None after a change

    def decode_step_plan(self):
        """The model's layers as :class:`~minivllm.kernels.fused.DecodeStep` (its weights' addresses, once per
        model), or False where the step cannot run fused: not the C++ table, a layer's matmul that the rule sends
        elsewhere for a few rows (not the row-major or GGUF weights), Qwen3's q/k norms, tensor parallel shards."""
        if self._decode_step is None:
            self._decode_step = self._build_decode_step() or False
        return self._decode_step

    def fused_decode(self, x, positions, kv, batch):
        """The final hidden states of a few-row decode step through ONE native call for every layer
        (:class:`~minivllm.kernels.fused.DecodeStep`, chapter 18), or None where this step takes the op-by-op path:
        a prefill or mixed step, more rows than the rule's row-major or GGUF matmuls take, a model without a plan
        (:meth:`decode_step_plan`), or a KV cache that is not minivllm's own paged one on this table (or has
        ``fused_decode`` off: ``EngineConfig.fused_decode``). ``x`` is the embedded tokens (overwritten)."""
        if batch is None or not self.fused_decode_path(kv) or getattr(batch, "max_q", 0) != 1:
            return None
        plan = self.decode_step_plan()
        if not 1 <= x.shape[0] <= plan.max_rows or batch.context_lens.shape[0] != x.shape[0]:
            return None
        return plan(x, positions, batch.slot_mapping, batch.block_table, batch.context_lens, batch.cu_seq_q,
                    kv.k_slots, kv.v_slots, kv.block_size)

    def fused_decode_path(self, kv) -> bool:
        """Whether few-row decode steps through ``kv`` run every layer in one native call (``stats().decode_path``
        "fused-step"): the model has a plan, ``kv`` is :class:`~minivllm.attention.MiniPagedKVCache` attending with
        this model's table and its ``fused_decode`` is on."""
        return (getattr(kv, "fused_decode", False) and type(kv).forward is MiniPagedKVCache.forward
                and getattr(kv, "attention_kernel", None) == PAGED_KERNEL and kv.ops is self.ops
                and bool(self.decode_step_plan()))

    def _build_decode_step(self):
        from minivllm.kernels.fused import DecodeStep

        layers = self.model.layers
        if (not isinstance(self.ops, CpuKernels) or not getattr(self, "fused_decode_supported", False)
                or self.lm_head.weight.dtype != torch.float32):
            return None
        norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        if any(n.eps != self.model.norm.eps for n in norms) or layers[0].self_attn.q_norm is not None:
            return None
        described, limits = [], []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            mats = {"qkv": attn.fused_qkv, "o": attn.o_proj, "gate_up": mlp.fused_gate_up, "down": mlp.down_proj}
            entry = {"input_norm": layer.input_layernorm.weight.detach(),
                     "post_norm": layer.post_attention_layernorm.weight.detach()}
            for name, m in mats.items():
                if m is None:
                    return None
                bias = None if m.bias is None else m.bias.detach()
                in_features = m.weight.shape[1]
                if m.qweight is not None:
                    entry[name] = (m.quantized_linear.__name__, m.qweight, bias)
                    limits.append(QUANTIZED_MAX_ROWS)
                elif m.native_linear is not None and in_features % NATIVE_LANES == 0:
                    entry[name] = ("linear", m.weight.detach(), bias)
                    limits.append(m.plain_max_rows if m.packed is not None else NATIVE_MATMUL_MAX_ROWS)
                else:
                    return None
            described.append(entry)
        max_rows = min(limits + [NATIVE_MATMUL_MAX_ROWS])
        if max_rows < 1:
            return None
        attn, rotary = layers[0].self_attn, self.model.rotary
        return DecodeStep(self.ops, described, self.model.norm.weight.detach(), rotary.cos, rotary.sin,
                          self.model.norm.eps, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                          self.config.intermediate_size, max_rows)

    def set_plain_rows(self, rows: int) -> None:
        """Multiply up to ``rows`` rows through the row-major weights, more through oneDNN's packed ones (chapter 12):
        the rule is :meth:`plain_rows_rule`; pin another split here (tests run every one)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= NATIVE_MATMUL_MAX_ROWS:
            raise ValueError(f"rows must be in 0..{NATIVE_MATMUL_MAX_ROWS}, got {rows!r}")
        self.plain_max_rows, self._decode_step = rows, None
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

    def _packing_agrees(self) -> bool:
        """The packed q/k/v (fused) and LM head against plain ``F.linear`` on a seeded probe."""
        attn, w = self.model.layers[0].self_attn, self.lm_head.weight
        probe = torch.randn(PLAIN_MATMUL_MAX_ROWS + 1, attn.q_proj.in_features,
                            generator=torch.Generator().manual_seed(0)).to(w.dtype)
        plain_qkv = torch.cat([F.linear(probe, m.weight, m.bias) for m in (attn.q_proj, attn.k_proj, attn.v_proj)], -1)
        pairs = [(attn.project_qkv(probe), plain_qkv), (self.lm_head(probe), F.linear(probe, w))]
        tol = 1e-4 if w.dtype == torch.float32 else 2e-2
        return all(torch.allclose(a, b, rtol=tol, atol=tol) for a, b in pairs)
