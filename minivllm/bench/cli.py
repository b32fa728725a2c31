"""What the benchmark command lines share (chapters 08-11): checked flag types (bad input is a usage error before
any model loads), the common flags, replaying settings on fresh engines, the ``python -m minivllm.bench`` dispatcher."""

from __future__ import annotations

import argparse
import math
import os
import sys

from minivllm import LLM
from minivllm.bench.trace import replay, warm_up
from minivllm.bench.workloads import _blocks_for
from minivllm.config import GGUF_ACTIVATIONS, KERNEL_TABLES, available_devices, is_text, shown

__all__ = ["positive_int", "nonneg_int", "block_size_int", "top_k_int", "positive_finite_float", "nonneg_finite_float",
           "probability", "watermark_fraction", "device_name", "server_url", "writable_file", "MinMax", "add_min_max",
           "add_kernel_flags", "kernel_options", "add_chunked_prefill_flag", "chunked_prefill_options", "check_token_budget", "bench_parser", "offline_env", "SUBCOMMANDS"]


# -- Checked types: each parses one flag's text or raises ArgumentTypeError saying the allowed range ---------

def _int_type(allowed: str, ok):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value
    return parse


def _float_type(allowed: str, ok):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value
    return parse


positive_int = _int_type("an integer >= 1", lambda v: v >= 1)
nonneg_int = _int_type("an integer >= 0", lambda v: v >= 0)
block_size_int = _int_type("an integer in [1, 1024]", lambda v: 1 <= v <= 1024)
top_k_int = _int_type("-1 or 0 (off) or an integer >= 1", lambda v: v >= -1)
positive_finite_float = _float_type("a finite number > 0", lambda v: v > 0)
nonneg_finite_float = _float_type("a finite number >= 0", lambda v: v >= 0)
probability = _float_type("a number in (0, 1]", lambda v: 0 < v <= 1)  # also a share, e.g. of the KV demand
watermark_fraction = _float_type("a number in [0, 1)", lambda v: 0 <= v < 1)


def unicode_text(text: str) -> str:
    """Text a tokenizer takes: an argument with bytes that are not UTF-8 (Python gives them as lone surrogates)."""
    if not is_text(text):
        raise argparse.ArgumentTypeError(f"must be valid UTF-8 text, got bytes that are not ({shown(text)})")
    return text


def device_name(text: str) -> str:
    """A device this machine has (``cpu``, ``cuda``, ``cuda:1``, ...)."""
    if text.split(":")[0] not in available_devices():
        raise argparse.ArgumentTypeError(f"must be a device available here, one of {available_devices()}, got {text!r}")
    return text


def server_url(text: str) -> str:
    """The base URL of an HTTP server, ``http://host:port`` (chapter 13's online benchmark)."""
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1].strip("/")) == 0:
        raise argparse.ArgumentTypeError(f"must be a URL like http://127.0.0.1:8000, got {text!r}")
    return text.rstrip("/")


def writable_file(text: str) -> str:
    """A file path whose folder exists and can be written: checked before a long run, not after it."""
    path = os.path.abspath(text)
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"must be a file name, got the folder {text!r}")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"must be in an existing folder, but {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"must be a file this user can write, got {text!r}")
    return text


class MinMax(argparse.Action):
    """``--flag MIN MAX`` (each checked by the flag's ``type``): refuses MIN > MAX as a usage error."""

    def __call__(self, parser, namespace, values, option_string=None):
        low, high = values
        if low > high:
            raise argparse.ArgumentError(self, f"needs MIN <= MAX, got {low} {high}")
        setattr(namespace, self.dest, (low, high))


def add_min_max(parser, flag: str, default, help: str | None = None) -> None:
    """A ``MIN MAX`` pair of token counts, each >= 1, MIN <= MAX."""
    parser.add_argument(flag, type=positive_int, nargs=2, metavar=("MIN", "MAX"), action=MinMax, default=default,
                        help=help)


def add_kernel_flags(parser, whose: str = "") -> None:
    """``--kernels`` and ``--quantization``: the kernel table under minivllm's model and the GGUF's weights as stored
    (chapter 18); ``whose`` names what they apply to. :func:`kernel_options` turns them into engine options."""
    parser.add_argument("--kernels", choices=KERNEL_TABLES, default="auto",
                        help=f"{whose}the kernel table: C++ on the CPU, Triton on CUDA, or PyTorch's reference "
                             "(default: %(default)s, the native kernels where they build)")
    parser.add_argument("--quantization", choices=["gguf"], default=None,
                        help=f"{whose}decode rows read the embedded GGUF's Q4_1/Q8_0 blocks as stored (float32 on "
                             "the CPU; default: off)")
    parser.add_argument("--gguf-activations", choices=GGUF_ACTIVATIONS, default="int8",
                        help=f"{whose}with --quantization gguf, the decode rows: int8 rounds them to 8-bit blocks "
                             "and multiplies integers, as llama.cpp; float32 keeps them, exact to the float32 "
                             "weights (default: %(default)s)")


def kernel_options(args) -> dict:
    """The engine options of ``--kernels`` and ``--quantization`` (only those not at their defaults)."""
    out = {"kernels": args.kernels} if args.kernels != "auto" else {}
    out |= {"quantization": args.quantization} if args.quantization else {}
    return out | ({"gguf_activations": args.gguf_activations} if args.gguf_activations != "int8" else {})


def add_chunked_prefill_flag(parser, whose: str = "") -> None:
    """``--chunked-prefill CHUNK``: chunked prefill with this chunk size, 0 for off (chapter 09);
    :func:`chunked_prefill_options` turns it into engine options."""
    parser.add_argument("--chunked-prefill", type=nonneg_int, default=0, metavar="CHUNK",
                        help=f"{whose}chunked prefill with this chunk size (0 = off)")


def chunked_prefill_options(chunk: int) -> dict:
    """The engine options of ``--chunked-prefill CHUNK`` (none when it is 0)."""
    return dict(enable_chunked_prefill=True, max_prefill_chunk_size=chunk) if chunk else {}


def check_token_budget(parser, budget: int, max_num_seqs: int, seqs_from: str, longest_prompt: int | None = None,
                       prompt_from: str = "the longest prompt") -> None:
    """Refuse engine settings no step could satisfy, as usage errors, before any model loads.

    ``--max-num-batched-tokens`` must cover one token per running sequence and,
    when chunked prefill is off (``longest_prompt`` given), the longest prompt.
    """
    if budget < max_num_seqs:
        parser.error(f"argument --max-num-batched-tokens: must be >= {max_num_seqs} ({seqs_from}), got {budget}")
    if longest_prompt is not None and budget < longest_prompt:
        parser.error(f"argument --max-num-batched-tokens: must be >= {longest_prompt} ({prompt_from}) unless "
                     f"chunked prefill is on, got {budget}")


# -- The flags and set-up every chapter experiment shares -------------------------------------------------

def offline_env() -> None:
    """Read models from the local folders and keep tokenizers quiet, unless the user says otherwise."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def bench_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """``python -m minivllm.bench PROG`` with the flags every chapter experiment takes."""
    parser = argparse.ArgumentParser(prog=f"python -m minivllm.bench {prog}", description=description)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--block-size", type=block_size_int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    parser.add_argument("--repeats", type=positive_int, default=1, help="run every setting this many times, round "
                                                                        "robin; report the median of each figure")
    parser.add_argument("--seed", type=nonneg_int, default=0)
    parser.add_argument("--device", type=device_name, default=None, help="cpu or cuda (default: cuda when available)")
    return parser


def _replay_settings(args, arrivals, device, settings: dict, max_num_seqs: int) -> dict:
    """``{key: (label, engine options)}`` -> ``{key: [ServingTrace per repeat]}``: a fresh, warmed-up engine per run,
    the settings taken round robin ``args.repeats`` times, all on a pool that holds every request."""
    num_blocks = _blocks_for(arrivals, args.block_size) + 8
    traces: dict = {key: [] for key in settings}
    for _ in range(args.repeats):
        for key, (label, opts) in settings.items():
            llm = LLM(args.model, block_size=args.block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, device=str(device), dtype="float32",
                      **opts)
            warm_up(llm)
            traces[key].append(replay(llm.engine, arrivals, device, label=label))
            del llm
    return traces


def _same_outputs(traces) -> bool:
    first = traces[0].token_ids
    return all(t.token_ids == first for t in traces[1:])


SUBCOMMANDS = ("interference", "shared-prefix", "preemption", "serving", "kv-offload", "disaggregation",
               "speculative", "structured", "peers", "margins",
               "contention")  # python -m minivllm.bench NAME (bench/__init__)
