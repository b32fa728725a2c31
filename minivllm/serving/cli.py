"""``python -m minivllm serve``: every ``EngineConfig`` field as a flag, then uvicorn (chapter 13).

Flags are made from the ``EngineConfig`` dataclass, so a new engine option is
a new flag. Bad values are refused as usage errors naming the flag before any
model loads (and a value only the loaded model refutes, such as a longer
``--max-model-len``, before the port opens). The port is bound before the
model loads, so a port in use is refused at once; uvicorn listens on it once
the engine is warm. A request must arrive within ``--read-timeout`` seconds:
its head (or the connection is closed), then its body (or a 408). SIGTERM
(or Ctrl-C) stops accepting requests, lets the ones in flight finish for
``--shutdown-grace`` seconds, aborts the rest, and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import signal
import socket
import sys
from dataclasses import MISSING, fields
from typing import NoReturn

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from minivllm.config import (DTYPE_CHOICES, GGUF_ACTIVATIONS, KERNEL_TABLES, PREEMPTION_MODES, SCHEDULING_POLICIES,
                             EngineConfig)
from minivllm.engine import LLMEngine, make_engine
from minivllm.models import load_config
from minivllm.sampling_params import SamplingParams
from minivllm.serving.api import OpenAIServing
from minivllm.serving.app import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_READ_TIMEOUT_S, build_app
from minivllm.serving.async_llm import AsyncLLM
from minivllm.serving.metrics import ServerMetrics

__all__ = ["add_serve_arguments", "engine_config", "serve_main", "GracefulServer", "TimedH11Protocol", "FIELD_HELP",
           "usage_error", "check_model", "warm_up", "bind_port"]

FIELD_HELP = {
    "collective_timeout": "seconds a tensor-parallel collective waits for a stopped or stuck rank before the step "
                          "fails and the server rebuilds the engine (default: 60.0)",
    "model": "smollm2-135m (embedded), tiny-random, a Hugging Face folder or repo id",
    "block_size": "tokens per KV block",
    "num_blocks": "KV blocks in the pool (default: sized from --kv-cache-memory-fraction)",
    "kv_cache_memory_fraction": "share of free device memory for the KV pool (on a CPU, of at most 4 GiB)",
    "max_num_seqs": "most sequences running at once (default: 64, or --max-num-batched-tokens if smaller)",
    "max_num_batched_tokens": "token budget of one step",
    "max_model_len": "longest prompt + output (default: the model's)",
    "enable_chunked_prefill": "split long prompts into chunks mixed with decodes",
    "max_prefill_chunk_size": "largest prefill chunk with chunked prefill",
    "enable_prefix_caching": "reuse the KV blocks of known prompt prefixes",
    "preemption_mode": f"what a preempted sequence loses: {', '.join(PREEMPTION_MODES)}",
    "num_cpu_blocks": "CPU swap pool in blocks (swap mode; default: as many as the device pool)",
    "admission_watermark": "share of blocks kept free when admitting new requests",
    "preemption_protection_steps": "steps a resumed sequence cannot be preempted again",
    "scheduling_policy": f"order of the waiting queue: {', '.join(SCHEDULING_POLICIES)}",
    "priority_aging_rate": "priority gained per step waited (priority policy)",
    "device": "cpu or cuda (default: cuda when available)",
    "dtype": f"weights and KV: {', '.join(DTYPE_CHOICES)} (auto: float32 on cpu, bfloat16 on cuda)",
    "enforce_eager": "never replay decode steps as CUDA graphs (graphs are on by default on cuda)",
    "seed": "seed of the sampler for requests without their own seed",
    "pack_weights": "prepack (and fuse) linear weights for oneDNN on the CPU (float32, bfloat16)",
    "kernels": f"kernel table under the model: {', '.join(KERNEL_TABLES)} (auto: C++ on the CPU in float32, Triton "
               "on CUDA, where they build; else PyTorch's reference)",
    "quantization": "gguf: decode rows read the embedded GGUF's Q4_1/Q8_0 blocks as stored (smollm2-135m, float32 "
                    "on the CPU)",
    "gguf_activations": "with --quantization gguf: int8 rounds decode rows to 8-bit blocks and multiplies integers, "
                        "as llama.cpp (no longer HF-exact); float32 keeps them (exact to the float32 weights)",
    "scheduler_cls": "scheduler class, as a dotted name",
    "block_manager_cls": "block manager class, as a dotted name",
    "attention_backend": "paged KV cache class, as a dotted name",
    "sampler": "sampler class, as a dotted name",
    "detokenizer": "incremental detokenizer class, as a dotted name",
    "offload_tier_cls": "CPU offload tier class (its bookkeeping), as a dotted name",
    "graph_runner_cls": "decode CUDA graph runner class (static buffers, padding), as a dotted name",
    "shard_weight": "tensor-parallel sharding function (rank r's shard of a checkpoint tensor), as a dotted name "
                    "(default: None, minivllm's own slicing)",
    "kv_handoff_cls": "disaggregated KV handoff class (when the prefill worker frees a transfer's blocks, the "
                      "fingerprint check), as a dotted name (default: None, minivllm's KVHandoff)",
    "speculative_config": 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                          '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (default: None, off)',
}
CHOICES = {"preemption_mode": PREEMPTION_MODES, "scheduling_policy": SCHEDULING_POLICIES, "dtype": DTYPE_CHOICES,
           "kernels": KERNEL_TABLES, "quantization": ("gguf",), "gguf_activations": GGUF_ACTIVATIONS}


def json_object(text: str) -> dict:
    """A flag's JSON object (``--speculative-config``); anything else is a usage error."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


TYPES = {"int": int, "int | None": int, "float": float, "float | None": float,
         "SpeculativeConfig | dict | None": json_object}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own flags, then one per EngineConfig field (``--block-size``, ``--enable-prefix-caching``...)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this "
                        "machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    parser.add_argument("--max-queue-size", type=int, default=None, metavar="N",
                        help="at most N requests wait beyond the --max-num-seqs that run; more get 429 at once "
                             "(default: no limit)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                        help="a request body larger than this gets 413 before it is parsed (default: %(default)s, "
                             "4 MiB)")
    parser.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S, metavar="SECONDS",
                        help="a connection whose request line and headers are not all there within this many "
                             "seconds is closed, and a body not all there within as many more gets 408 "
                             "(default: %(default)s)")
    parser.add_argument("--shutdown-grace", type=float, default=10.0, metavar="SECONDS",
                        help="on SIGTERM, how long requests in flight may run before they are aborted "
                             "(default: %(default)s)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="uvicorn's log level; info logs every request (default: %(default)s)")
    engine = parser.add_argument_group("engine options (every EngineConfig field)")
    for f in fields(EngineConfig):
        default = f.default if f.default is not MISSING else None
        doc = FIELD_HELP.get(f.name, f"EngineConfig.{f.name} (see minivllm/config.py)")
        kwargs = {"default": default, "help": doc if "default" in doc else f"{doc} (default: {default})"}
        if f.type in ("bool", "bool | None"):  # --flag, --no-flag; unset: the default (None: the engine decides)
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = TYPES.get(str(f.type), str)
            kwargs["choices"] = CHOICES.get(f.name)
            kwargs["metavar"] = None if f.name in CHOICES else f.name.upper()
        engine.add_argument(_flag(f.name), dest=f"engine_{f.name}", **kwargs)


def engine_config(args, parser: argparse.ArgumentParser) -> EngineConfig:
    """The EngineConfig of the flags; a value it refuses is a usage error naming the flag (nothing loads)."""
    if not 1 <= args.port <= 65535:
        parser.error(f"argument --port: must be an integer in [1, 65535], got {args.port}")
    if args.max_queue_size is not None and args.max_queue_size < 0:
        parser.error(f"argument --max-queue-size: must be an integer >= 0, got {args.max_queue_size}")
    if args.max_request_bytes < 1:
        parser.error(f"argument --max-request-bytes: must be an integer >= 1, got {args.max_request_bytes}")
    if not 0 < args.read_timeout < float("inf"):
        parser.error(f"argument --read-timeout: must be a finite number of seconds > 0, got {args.read_timeout}")
    if not args.shutdown_grace >= 0 or args.shutdown_grace == float("inf"):
        parser.error(f"argument --shutdown-grace: must be a finite number >= 0, got {args.shutdown_grace}")
    options = {f.name: getattr(args, f"engine_{f.name}") for f in fields(EngineConfig)}
    try:
        config = EngineConfig(**options)
    except ValueError as e:
        usage_error(parser, e)
    check_model(parser, config.model)
    return config


def usage_error(parser: argparse.ArgumentParser, error: ValueError) -> NoReturn:
    """An engine's ``ValueError`` (its first word is the field) as a usage error naming the flag; exit status 2."""
    field = str(error).split(" ", 1)[0].split(".")[0]  # speculative_config.method: --speculative-config
    parser.error(f"argument {_flag(field) if field in EngineConfig.field_names() else '--model'}: {error}")


def check_model(parser: argparse.ArgumentParser, name: str) -> None:
    """A model that cannot be found or is not supported is a usage error, before anything loads (only its
    config is read)."""
    try:
        load_config(name)
    except (OSError, ValueError) as e:
        parser.error(f"argument --model: cannot load {name!r}: {str(e).splitlines()[0]}")


def warm_up(engine: LLMEngine) -> LLMEngine:
    """One short request before the port opens: the first forwards pay one-off set-up costs (the kernels' build,
    the first time on a machine, happens as the engine loads).

    It is 16 prompt tokens and 2 generated, or less where the context, the KV
    pool or (without chunked prefill) the step's token budget is smaller, so
    every configuration the engine accepts can warm up.
    """
    c = engine.config
    room = min(18, engine.max_model_len, engine.num_blocks * c.block_size)
    if room < 2:
        raise ValueError(f"num_blocks must hold at least 2 tokens (one prompt token and one generated); the pool "
                         f"sized from kv_cache_memory_fraction has {engine.num_blocks} of {c.block_size}")
    max_tokens = 2 if room > 2 else 1
    prompt_len = room - max_tokens if c.enable_chunked_prefill else min(room - max_tokens, c.max_num_batched_tokens)
    engine.add_request("warm-up", list(range(100, 100 + prompt_len)),
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def bind_port(parser: argparse.ArgumentParser, host: str, port: int) -> socket.socket:
    """The HTTP port, bound before the model loads: a port in use is a usage error at once, not after the load,
    and no socket the engine opens meanwhile (tensor-parallel ranks' rendezvous and gloo) can be given it.

    uvicorn listens on this socket once the engine is warm; until then a connection is refused."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        parser.error(f"argument --host: cannot resolve {host!r}: {e.strerror}")
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart need not wait
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        parser.error(f"argument --port: cannot listen on {host}:{port}: {e.strerror}")
    return sock


class TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a deadline for each request's head: a connection whose request line and
    headers are not all there within ``head_timeout_s`` of its start (or of its previous response) is closed.
    uvicorn times out only an idle connection between requests, so a client that sends half a head and then
    nothing would hold its connection forever. (The body's deadline is the app's: :class:`BodyLimit`.)"""

    def __init__(self, *args, head_timeout_s: float = DEFAULT_READ_TIMEOUT_S, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_timeout_s, self._head_timer = head_timeout_s, None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _head_late(self) -> None:
        if self.cycle is None or self.cycle.response_complete:  # no request is being read or answered
            self.transport.close()


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose exit signal first starts the engine's drain (no new requests, a grace period)."""

    def __init__(self, config: uvicorn.Config, async_llm: AsyncLLM, grace_s: float):
        super().__init__(config)
        self.async_llm, self.grace_s = async_llm, grace_s

    def handle_exit(self, sig, frame) -> None:
        self.async_llm.shutdown(self.grace_s)
        super().handle_exit(sig, frame)


def serve_main(args, parser: argparse.ArgumentParser) -> int:
    """Load the model, open the port, serve until SIGTERM or Ctrl-C; 0 after a graceful stop."""
    config = engine_config(args, parser)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    name = args.served_model_name or config.model
    metrics = ServerMetrics(name, speculative=config.speculative_config is not None)
    with bind_port(parser, args.host, args.port) as sock:  # before the load: nothing the engine opens can take it
        try:  # built in the loop's thread; what the engine refuses of the model (a longer --max-model-len) is usage
            async_llm = AsyncLLM(lambda: warm_up(make_engine(config)), args.max_queue_size, metrics)
        except ValueError as e:
            usage_error(parser, e)
        engine = async_llm.engine
        app = build_app(OpenAIServing(async_llm, name), metrics, args.max_request_bytes, args.read_timeout)
        http = functools.partial(TimedH11Protocol, head_timeout_s=args.read_timeout)
        server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                               timeout_graceful_shutdown=int(args.shutdown_grace) + 5, http=http),
                                async_llm, args.shutdown_grace)
        print(f"minivllm: serving {name} ({engine.num_blocks} KV blocks of {config.block_size}) on "
              f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn re-raises the signal after its graceful stop: exit 0
            signal.signal(sig, _drained)
        server.run(sockets=[sock])
    async_llm.close()
    async_llm.engine.shutdown()  # worker processes (tensor parallel, disaggregated), if any (idempotent)
    return 0


def _drained(sig, frame) -> None:
    """SIGTERM or Ctrl-C after uvicorn's graceful shutdown: the drain is done, nothing left to do."""
