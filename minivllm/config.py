"""Engine configuration and the one place the device is chosen (all chapters)."""

from __future__ import annotations

import importlib
import inspect
import math
import os
import reprlib
from dataclasses import dataclass, fields
from pathlib import Path

import torch

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)  # "auto": float32 on the CPU, bfloat16 on CUDA (float16 where bf16 is missing)
CPU_KV_BUDGET_BYTES = 4 << 30  # on the CPU the memory fraction applies to at most 4 GiB
KERNEL_TABLES = ("auto", "reference", "cpu", "triton")  # minivllm.kernels.choose (chapter 18)
KERNEL_OPS = ("write_kv", "paged_attention", "rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul", "linear",
              "q4_1_linear", "q8_0_linear", "q8_0_embedding", "quantize_q8_1", "q4_1_q8_1_linear",
              "q8_0_q8_0_linear", "prefill_attention")  # what a kernel table holds (minivllm.kernels)
QUANTIZATIONS = (None, "gguf")  # "gguf": the embedded model's blocks as stored (chapter 18)
GGUF_ACTIVATIONS = ("int8", "float32")  # what the GGUF's blocks multiply: llama.cpp's 8-bit rows, or float32 ones


def cache_dir() -> Path:
    """Where minivllm keeps what it makes once per machine (the converted model, the kernels' build):
    ``$MINIVLLM_CACHE``, or ``~/.cache/minivllm``."""
    return Path(os.environ.get("MINIVLLM_CACHE", Path.home() / ".cache" / "minivllm"))


def default_device() -> torch.device:
    """``cuda`` when a GPU is present, else ``cpu``: chosen once, used everywhere."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check(ok: bool, field: str, allowed: str, value) -> None:
    """Refuse a bad value with a ValueError that names the field and what it may be."""
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {shown(value)}")


_SHOWN = reprlib.Repr()
for _name, _most in dict(maxlevel=4, maxtuple=20, maxlist=20, maxarray=20, maxdict=10, maxset=10, maxfrozenset=10,
                         maxdeque=10, maxstring=200, maxlong=60, maxother=200).items():
    setattr(_SHOWN, _name, _most)


def shown(value) -> str:
    """A value as an error message shows it: its repr, cut short (a 4 MB list, a dict 5,000 deep never echo back)."""
    return _SHOWN.repr(value)


def is_text(value) -> bool:
    """A string any tokenizer and UTF-8 encoder takes: no lone UTF-16 surrogate (``"\\ud800"``)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_kernel_table(obj) -> bool:
    """Whether ``obj`` is a kernel table itself rather than its name: every op of :data:`KERNEL_OPS` a callable
    (a :class:`~minivllm.kernels.cpu.CpuKernels`, such as exercise 18's build of the reader's inner loops)."""
    return not isinstance(obj, str) and all(callable(getattr(obj, op, None)) for op in KERNEL_OPS)


NOT_WRITTEN = "not written yet"  # what a method an exercise has the reader write raises until it is written


def is_stub(f) -> bool:
    """Whether ``f`` (a function, or a method as a class holds it) still raises an exercise's stub,
    ``NotImplementedError("not written yet: Class.method")``: the interface classes' declared methods do."""
    code = getattr(inspect.unwrap(getattr(f, "__func__", f)), "__code__", None)
    return code is not None and any(isinstance(c, str) and c.startswith(NOT_WRITTEN) for c in code.co_consts)


def not_written(cls: type) -> list[str]:
    """``Class.method`` for each method ``cls`` runs that is still a stub (the interface a reader subclasses)."""
    return [f"{cls.__name__}.{name}" for name, f in inspect.getmembers(cls, inspect.isfunction) if is_stub(f)]


DEFAULT_MAX_NUM_SEQS = 64  # measured on a 2-core CPU (see EngineConfig)
SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 32
MAX_PROMPT_LOOKUP = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` for prompt lookup (chapter 17), validated.

    ``method="ngram"`` drafts up to ``num_speculative_tokens`` tokens a step
    from the sequence's own tokens, matching its last ``prompt_lookup_max``
    down to ``prompt_lookup_min`` tokens. As in vLLM, a missing bound takes
    the other's value, and both missing are 5.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    @classmethod
    def from_value(cls, value) -> "SpeculativeConfig | None":
        """A ``SpeculativeConfig`` from one, or from vLLM's dict form; ``None`` stays ``None`` (no speculation)."""
        if value is None or isinstance(value, cls):
            return value
        keys = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
        check(isinstance(value, dict) and set(value) <= set(keys), "speculative_config",
              f"None or a dict with the keys {keys}", value)
        method, k = value.get("method", "ngram"), value.get("num_speculative_tokens")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        check(method in SPECULATIVE_METHODS, "speculative_config.method", f"one of {SPECULATIVE_METHODS}", method)
        check(is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS, "speculative_config.num_speculative_tokens",
              f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]", k)
        check(is_int(lo) and 1 <= lo <= MAX_PROMPT_LOOKUP, "speculative_config.prompt_lookup_min",
              f"an integer in [1, {MAX_PROMPT_LOOKUP}]", lo)
        check(is_int(hi) and lo <= hi <= MAX_PROMPT_LOOKUP, "speculative_config.prompt_lookup_max",
              f"an integer in [prompt_lookup_min ({lo}), {MAX_PROMPT_LOOKUP}]", hi)
        return cls(method, k, lo, hi)


@dataclass
class EngineConfig:
    """Everything that shapes the engine; validated on creation (every chapter adds a knob).

    The KV pool holds ``num_blocks`` blocks of ``block_size`` tokens. Left as
    ``None`` it is sized from ``kv_cache_memory_fraction`` of the device's free
    memory (of at most 4 GiB on the CPU), and never larger than
    ``max_num_seqs`` sequences of ``max_model_len`` tokens could use.

    ``max_num_seqs`` left as ``None`` is 64, or ``max_num_batched_tokens`` if
    that is smaller (a step holds at least one token per running sequence).
    64 is measured (chapter 12): 128 offline requests on a 2-core CPU ran at
    141, 184, 209 and 224 tokens/s with 16, 32, 64 and 128 sequences, while a
    decode step took 84, 114, 183 and 321 ms. 64 takes most of the throughput
    at under 0.2 s a step; a GPU gains more.

    Preemption (chapter 10): ``preemption_mode`` "recompute" frees a victim's
    blocks, "swap" copies them to a CPU pool of ``num_cpu_blocks`` blocks
    (default: as many as the device pool) and falls back to recompute when it
    is full. A request that was just resumed cannot be preempted again for
    ``preemption_protection_steps`` steps (0 turns the guard off). New requests
    are not admitted while fewer than ``admission_watermark`` of the blocks
    would stay free (unless nothing is running: an idle engine always admits).
    With ``scheduling_policy="priority"`` the waiting queue is ordered by
    priority (lower runs first), improved by ``priority_aging_rate`` per step
    waited.

    Structured outputs (chapter 19): a request's grammar compiles in a worker
    thread while it waits; one that takes longer than
    ``structured_outputs_timeout_s`` seconds ends its request with that error.
    ``overlap_grammar_fill`` fills a step's bitmasks on one worker thread
    while the forward runs (as vLLM's ``EngineCore.step``), joined before the
    masks are applied; False fills them after the forward; None (the default)
    overlaps where the forward leaves something idle to overlap with: on a
    GPU, or on a CPU whose cores are not all the forward's threads
    (:func:`minivllm.model_runner.overlap_helps`). The tokens are the same
    either way.

    Extension points (as vLLM's ``scheduler_cls``): ``scheduler_cls``,
    ``block_manager_cls``, ``attention_backend`` (the paged KV cache class),
    ``sampler``, ``detokenizer`` (the incremental detokenizer class),
    ``offload_tier_cls`` (the CPU tier's bookkeeping, chapter 14),
    ``graph_runner_cls`` (the static buffers of decode steps replayed as CUDA
    graphs, chapter 12), ``spec_acceptor_cls`` (what a verified draft keeps
    and the rollback of the rest, chapter 17) and ``grammar_masker_cls`` (the
    constrained rows' bitmasks on the logits, chapter 19) take a class or its dotted name; ``shard_weight``
    (rank r's shard of a checkpoint tensor, chapter 15) a function or its
    dotted name, None for minivllm's own slicing; ``kv_handoff_cls`` (who
    frees a transfer's blocks when, and the fingerprint check, in the
    disaggregated workers, chapter 16) a class, any callable that builds the
    handoff, or its dotted name, None for minivllm's ``KVHandoff``. The
    defaults are minivllm's own, built through the same code path; the
    exercises plug a reader's part in here.

    ``pack_weights`` prepacks linear weights for oneDNN on the CPU (float32 or
    bfloat16), fusing the q/k/v and the gate/up projections (chapter 12); it
    never changes the tokens.

    ``kernels`` picks the kernel table under the model (chapter 18): "auto"
    runs the C++ kernels on the CPU in float32 (built once per machine at
    first use) and the Triton ones on CUDA where Triton is installed, else
    PyTorch's reference ops; "reference" pins those; "cpu" and "triton" insist.
    A kernel table itself runs as given (exercise 18: a ``CpuKernels`` built
    from the reader's inner loops, float32 on the CPU, one process).
    ``stats().kernels`` says which runs. ``quantization="gguf"`` (vLLM's name;
    the embedded SmolLM2, float32 on the CPU, one process) keeps the GGUF
    file's blocks too, Q4_1 for the layers and Q8_0 for the tied embedding,
    and multiplies decode batches of up to eight rows through them as stored;
    prefill keeps the float32 copy they dequantise to. ``gguf_activations``
    says what those rows are. ``"int8"`` (the default) is llama.cpp's
    arithmetic: each row is rounded once per matmul to 8-bit blocks of 32
    (Q8_1: a scale, and the block's sum for Q4_1's minimum) and meets each
    weight block in integer dot products, many multiplies an instruction
    (``maddubs``, or ``dpbusd`` with VNNI), the float scales applied once a
    block: rounding the activations changes the logits, so this mode is no
    longer HF-exact (its oracle is llama.cpp on the same file, which rounds
    the same way: ``python -m minivllm.bench margins`` compares the two;
    ``stats().gguf_dot`` names the instructions). ``"float32"`` keeps the
    rows as they are: each weight is converted to the float32 value of the
    checkpoint, so the greedy tokens are the float32 engine's (chapter 18).

    ``fused_decode`` (on by default) runs a few-row decode step's decoder
    layers in one native call on the C++ table (chapter 18: the same kernels,
    so the same bits, without a Python call an op); off, every op is called
    from Python. ``stats().decode_path`` says which: "fused-step" or
    "op-by-op" (always so on the reference, on CUDA and with tensor parallel
    workers).

    ``dtype="auto"`` is float32 on the CPU and bfloat16 on CUDA (float16 on a
    GPU without bf16, such as a T4); an explicit dtype is kept. On CUDA,
    decode-only steps replay CUDA graphs (chapter 12) unless ``enforce_eager``.

    ``kv_offload_blocks`` (chapter 14, vLLM's ``--kv-offloading-size`` counted
    in blocks rather than GiB) gives the prefix cache a CPU tier of that many
    blocks: evicted cached blocks are copied there and restored on a later hit
    instead of recomputed. It needs ``enable_prefix_caching`` and one process.

    ``tensor_parallel_size`` splits every layer over that many worker
    processes (chapter 15): it must divide the model's query and KV heads,
    which the engine checks against the checkpoint before anything starts.
    A collective that waits more than ``collective_timeout`` seconds for a
    rank (a stopped or stuck process) fails the step with ``WorkerError``.

    ``disaggregated`` runs prefill and decode in two worker processes behind
    a front (chapter 16, ``LLM(..., disaggregated=True)``); the prefill
    worker frees a request's blocks when the decode worker acknowledges its
    KV, or after ``kv_transfer_timeout`` seconds without an answer (the
    request then fails).

    ``speculative_config`` (chapter 17, vLLM's name and dict form, e.g.
    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min":
    2, "prompt_lookup_max": 4}``) drafts tokens by prompt lookup and verifies
    them in one forward; greedy output is unchanged and sampled output keeps
    its distribution (:class:`SpeculativeConfig`). ``None``: no speculation.
    """

    model: str = "smollm2-135m"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.3
    max_num_seqs: int | None = None  # None: DEFAULT_MAX_NUM_SEQS, capped by the token budget
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = False
    max_prefill_chunk_size: int = 512
    enable_prefix_caching: bool = False
    kv_offload_blocks: int = 0
    preemption_mode: str = "recompute"
    num_cpu_blocks: int | None = None
    admission_watermark: float = 0.0
    preemption_protection_steps: int = 4
    scheduling_policy: str = "fcfs"
    priority_aging_rate: float = 0.0
    structured_outputs_timeout_s: float = 30.0
    overlap_grammar_fill: bool | None = None  # None: where a step has something to overlap (the runner's rule)
    device: str | None = None
    dtype: str = "auto"
    seed: int = 0
    pack_weights: bool = True
    tensor_parallel_size: int = 1
    collective_timeout: float = 60.0
    enforce_eager: bool = False
    kernels: object = "auto"  # a table's name (KERNEL_TABLES), or a kernel table (is_kernel_table; chapter 18)
    quantization: str | None = None
    gguf_activations: str = "int8"  # with quantization="gguf": "int8" (llama.cpp's arithmetic) or "float32" (exact)
    fused_decode: bool = True  # a few-row decode step's layers in one native call (C++ table; stats().decode_path)
    disaggregated: bool = False
    kv_transfer_timeout: float = 30.0
    speculative_config: SpeculativeConfig | dict | None = None
    scheduler_cls: type | str = "minivllm.scheduler.MiniScheduler"
    block_manager_cls: type | str = "minivllm.block_manager.MiniBlockManager"
    attention_backend: type | str = "minivllm.attention.MiniPagedKVCache"
    sampler: type | str = "minivllm.sampler.MiniSampler"
    detokenizer: type | str = "minivllm.detokenizer.MiniIncrementalDetokenizer"
    offload_tier_cls: type | str = "minivllm.kv_tier.MiniOffloadTier"
    graph_runner_cls: type | str = "minivllm.cuda_graphs.MiniDecodeGraphRunner"
    spec_acceptor_cls: type | str = "minivllm.spec_decode.MiniSpecAcceptor"
    grammar_masker_cls: type | str = "minivllm.sampler.MiniGrammarMasker"
    shard_weight: object = None  # None: minivllm's own slicing; else a function or its dotted name (chapter 15)
    kv_handoff_cls: object = None  # None: minivllm's KVHandoff; else what builds one, or its dotted name (chapter 16)

    def __post_init__(self):
        check(isinstance(self.model, str) and self.model != "", "model", "a non-empty string", self.model)
        check(is_int(self.block_size) and 1 <= self.block_size <= 1024, "block_size", "an integer in [1, 1024]", self.block_size)
        check(self.num_blocks is None or (is_int(self.num_blocks) and self.num_blocks >= 1), "num_blocks", "None or an integer >= 1", self.num_blocks)
        check(self.num_blocks is None or self.num_blocks * self.block_size >= 2, "num_blocks",
              f"at least {cdiv(2, self.block_size)} with block_size {self.block_size} (the smallest request, one "
              f"prompt token and one generated, needs 2 tokens of KV)", self.num_blocks)
        check(is_number(self.kv_cache_memory_fraction) and 0 < self.kv_cache_memory_fraction <= 1, "kv_cache_memory_fraction", "in (0, 1]", self.kv_cache_memory_fraction)
        if self.max_num_seqs is None:
            budget = self.max_num_batched_tokens
            self.max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, budget) if is_int(budget) and budget >= 1 else DEFAULT_MAX_NUM_SEQS
        check(is_int(self.max_num_seqs) and self.max_num_seqs >= 1, "max_num_seqs", "an integer >= 1", self.max_num_seqs)
        check(is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens", f"an integer >= max_num_seqs ({self.max_num_seqs})", self.max_num_batched_tokens)
        check(self.max_model_len is None or (is_int(self.max_model_len) and self.max_model_len >= 2), "max_model_len", "None or an integer >= 2", self.max_model_len)
        check(isinstance(self.enable_chunked_prefill, bool), "enable_chunked_prefill", "True or False", self.enable_chunked_prefill)
        check(is_int(self.max_prefill_chunk_size) and self.max_prefill_chunk_size >= 1, "max_prefill_chunk_size", "an integer >= 1", self.max_prefill_chunk_size)
        check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "True or False", self.enable_prefix_caching)
        check(self.preemption_mode in PREEMPTION_MODES, "preemption_mode", f"one of {PREEMPTION_MODES}", self.preemption_mode)
        check(self.num_cpu_blocks is None or (is_int(self.num_cpu_blocks) and self.num_cpu_blocks >= 0), "num_cpu_blocks", "None or an integer >= 0", self.num_cpu_blocks)
        check(is_number(self.admission_watermark) and 0 <= self.admission_watermark < 1, "admission_watermark", "in [0, 1)", self.admission_watermark)
        check(is_int(self.preemption_protection_steps) and self.preemption_protection_steps >= 0, "preemption_protection_steps", "an integer >= 0", self.preemption_protection_steps)
        check(is_number(self.priority_aging_rate) and self.priority_aging_rate >= 0, "priority_aging_rate", "a number >= 0", self.priority_aging_rate)
        self._check_structured_outputs()
        check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy", f"one of {SCHEDULING_POLICIES}", self.scheduling_policy)
        check(self.device is None or str(self.device).split(":")[0] in available_devices(), "device",
              f"None or one available here: {available_devices()}", self.device)
        check(self.dtype in DTYPE_CHOICES, "dtype", f"one of {DTYPE_CHOICES}", self.dtype)
        check(is_int(self.seed) and 0 <= self.seed < 2**63, "seed", "an integer in [0, 2**63 - 1]", self.seed)
        check(isinstance(self.pack_weights, bool), "pack_weights", "True or False", self.pack_weights)
        check(isinstance(self.enforce_eager, bool), "enforce_eager", "True or False", self.enforce_eager)
        check(isinstance(self.fused_decode, bool), "fused_decode", "True or False", self.fused_decode)
        self._check_kernels()
        check(is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1, "tensor_parallel_size",
              "an integer >= 1", self.tensor_parallel_size)
        self._check_tensor_parallel_devices()
        self._check_kv_offload()
        self._check_disaggregated()
        self._check_speculative()
        self._check_extension_points()

    def _check_structured_outputs(self) -> None:
        """A compile's time limit (seconds > 0) and the mask's overlap with the forward (chapter 19)."""
        check(is_number(self.structured_outputs_timeout_s) and self.structured_outputs_timeout_s > 0,
              "structured_outputs_timeout_s", "a number of seconds > 0", self.structured_outputs_timeout_s)
        check(self.overlap_grammar_fill is None or isinstance(self.overlap_grammar_fill, bool),
              "overlap_grammar_fill", "None, True or False", self.overlap_grammar_fill)

    def _check_extension_points(self) -> None:
        """Every class extension point resolves to a class, ``shard_weight`` and ``kv_handoff_cls`` to None or a
        callable that takes the arguments it is called with."""
        for name in ("scheduler_cls", "block_manager_cls", "attention_backend", "sampler", "detokenizer",
                     "offload_tier_cls", "graph_runner_cls", "spec_acceptor_cls", "grammar_masker_cls"):
            cls = resolve(getattr(self, name), name)
            left = not_written(cls)  # e.g. the interface an exercise subclasses, named instead of minivllm's own
            check(not left, name, f"a class whose methods are written ({NOT_WRITTEN}: {', '.join(left)}; the default "
                                  f"is {getattr(EngineConfig, name)})", cls.__name__)
        resolve_function(self.shard_weight, "shard_weight", ("name", "weight", "rank", "world", "config"))
        resolve_function(self.kv_handoff_cls, "kv_handoff_cls", ())

    def _check_disaggregated(self) -> None:
        """Prefill and decode in two worker processes (chapter 16): one rank each, a positive ack timeout."""
        check(isinstance(self.disaggregated, bool), "disaggregated", "True or False", self.disaggregated)
        check(is_number(self.kv_transfer_timeout) and self.kv_transfer_timeout > 0, "kv_transfer_timeout",
              "a number of seconds > 0", self.kv_transfer_timeout)
        check(is_number(self.collective_timeout) and self.collective_timeout > 0, "collective_timeout",
              "a number of seconds > 0", self.collective_timeout)
        check(not self.disaggregated or self.tensor_parallel_size == 1, "tensor_parallel_size",
              "1 with disaggregated=True (each worker runs one process)", self.tensor_parallel_size)

    def _check_speculative(self) -> None:
        """Speculative decoding (chapter 17): vLLM's dict form becomes a ``SpeculativeConfig``; one process."""
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if self.speculative_config is not None:
            check(self.tensor_parallel_size == 1, "speculative_config",
                  "None with tensor_parallel_size > 1 (the workers verify no drafts)", self.speculative_config)
            check(not self.disaggregated, "speculative_config",
                  "None with disaggregated=True (the decode worker verifies no drafts)", self.speculative_config)

    def _check_kernels(self) -> None:
        """``kernels``: a kernel table's name, or a table (one process); ``quantization``: None or "gguf", in one
        process."""
        named = isinstance(self.kernels, str)
        check(self.kernels in KERNEL_TABLES if named else is_kernel_table(self.kernels), "kernels",
              f"one of {KERNEL_TABLES}, or a kernel table (an object with the ops {', '.join(KERNEL_OPS)}, such as "
              f"exercise 18's CpuKernels)", self.kernels)
        left = [] if named else getattr(self.kernels, "not_written", list)()  # exercise 18's stubs
        check(not left, "kernels", "a kernel table whose inner loops are written",
              f"{self.kernels!r} ({NOT_WRITTEN}: {', '.join(left)})")
        check(named or (self.tensor_parallel_size == 1 and not self.disaggregated), "kernels",
              "a table's name with tensor_parallel_size > 1 or disaggregated=True (each worker builds its own)",
              self.kernels)
        check(self.quantization in QUANTIZATIONS, "quantization", f"one of {QUANTIZATIONS}", self.quantization)
        check(self.quantization is None or (self.tensor_parallel_size == 1 and not self.disaggregated),
              "quantization", "None with tensor_parallel_size > 1 or disaggregated=True", self.quantization)
        check(self.gguf_activations in GGUF_ACTIVATIONS, "gguf_activations", f"one of {GGUF_ACTIVATIONS}",
              self.gguf_activations)
        check(self.gguf_activations == "int8" or self.quantization == "gguf", "gguf_activations",
              '"int8" (the default) unless quantization="gguf"', self.gguf_activations)

    def _check_tensor_parallel_devices(self) -> None:
        """Ranks need a device each on CUDA (NCCL), and the CPU (gloo) elsewhere (chapter 15)."""
        if self.tensor_parallel_size == 1:
            return
        kind = self.torch_device.type
        check(kind in ("cpu", "cuda"), "tensor_parallel_size", f"1 on {kind} (ranks run on cpu or cuda)",
              self.tensor_parallel_size)
        if kind == "cuda":
            gpus = torch.cuda.device_count()
            check(self.tensor_parallel_size <= gpus, "tensor_parallel_size",
                  f"at most the {gpus} CUDA devices here (one per rank)", self.tensor_parallel_size)

    def _check_kv_offload(self) -> None:
        """The CPU tier extends the prefix cache, in one process (chapter 14)."""
        check(is_int(self.kv_offload_blocks) and self.kv_offload_blocks >= 0, "kv_offload_blocks",
              "an integer >= 0", self.kv_offload_blocks)
        if self.kv_offload_blocks:
            check(self.enable_prefix_caching, "kv_offload_blocks",
                  "0 unless enable_prefix_caching=True (the tier extends the prefix cache)", self.kv_offload_blocks)
            check(self.tensor_parallel_size == 1, "kv_offload_blocks",
                  "0 with tensor_parallel_size > 1 (the workers carry no tier)", self.kv_offload_blocks)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.torch_device)

    @property
    def use_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs on a GPU unless ``enforce_eager`` (chapter 12); the CPU is always eager."""
        return self.torch_device.type == "cuda" and not self.enforce_eager and self.tensor_parallel_size == 1

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device) if self.device else default_device()

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"`` is float32 on the CPU, bfloat16 on CUDA (float16 on GPUs without bf16, e.g. a T4); others as named."""
    if name != "auto":
        return DTYPES[name]
    if torch.device(device).type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def available_devices() -> tuple[str, ...]:
    """The device types this machine can run on."""
    mps = getattr(torch.backends, "mps", None)
    return ("cpu",) + (("cuda",) if torch.cuda.is_available() else ()) + (("mps",) if mps and mps.is_available() else ())


def _import(obj, field: str, what: str):
    """``obj``, or the object its dotted name (``"package.module.Name"``) names."""
    if not isinstance(obj, str):
        return obj
    module, _, name = obj.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{field} must be {what}, got {obj!r} ({e})") from None


def resolve(obj: type | str, field: str = "class") -> type:
    """An extension point's class, given the class itself or its dotted name (``"package.module.Name"``)."""
    obj = _import(obj, field, "a class or an importable dotted name")
    check(isinstance(obj, type), field, "a class or an importable dotted name", obj)
    return obj


def resolve_function(obj, field: str, args: tuple[str, ...] | None = None):
    """An optional function extension point: None, a function, or its dotted name (as :func:`resolve` for classes).

    ``args``: the arguments it is called with. A function that cannot take them (``os.system`` as a
    ``shard_weight``) is refused here, naming the field, rather than failing when it is first called."""
    what = "None, a function or an importable dotted name"
    obj = _import(obj, field, what)
    check(obj is None or callable(obj), field, what, obj)
    if obj is not None and args is not None:
        try:
            signature = inspect.signature(obj)
        except (TypeError, ValueError):  # a builtin without one: nothing to check before it is called
            return obj
        try:
            signature.bind(*args)
        except TypeError:
            raise ValueError(f"{field} must take the arguments it is called with, {field}({', '.join(args)}); got "
                             f"{shown(obj)}, which takes {signature}") from None
    return obj


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of the device: CUDA's own count, or MemAvailable on the CPU (capped at 4 GiB)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        avail = CPU_KV_BUDGET_BYTES
    return min(avail, CPU_KV_BUDGET_BYTES)


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` tokens hold ``a`` tokens."""
    return -(-a // b)


def cpu_pool_blocks(config: EngineConfig, num_blocks: int) -> int:
    """Blocks of the CPU swap pool: none unless ``preemption_mode="swap"``, then ``num_cpu_blocks`` or the device pool's size."""
    if config.preemption_mode != "swap":
        return 0
    return num_blocks if config.num_cpu_blocks is None else config.num_cpu_blocks


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    """A real number a float can hold, not a bool: ``10**400`` is an integer but no float, so it is not."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False
