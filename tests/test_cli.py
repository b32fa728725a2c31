"""Command lines refuse bad input before any work: a usage error naming the flag and its range, exit code 2.

Covers ``python -m minivllm generate|bench`` and ``python -m minivllm.bench [interference|shared-prefix|
preemption]`` (chapters 07-11), and the same checks one level down, in :func:`minivllm.bench.make_workload`.
"""

import errno
import importlib
import math
import os
import socket

import pytest

import minivllm
import minivllm.models
from minivllm.__main__ import main
from minivllm.bench import (interference_arrivals, main as bench_main, make_workload, poisson_times, random_workload,
                            shared_prefix_arrivals, squeezed_arrivals)
from minivllm.bench.server_process import free_port
from minivllm.models import load_tokenizer

FRONT_ENDS = ("minivllm.__main__", "minivllm.bench.cli", "minivllm.bench.throughput", "minivllm.bench.interference",
              "minivllm.bench.shared_prefix", "minivllm.bench.preemption", "minivllm.bench.harness")


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a command line loads a model (or builds an engine) before refusing its input."""
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the command line was checked")

    targets = [minivllm, minivllm.models]
    for name in FRONT_ENDS:
        try:
            targets.append(importlib.import_module(name))
        except ImportError:
            pass
    for module in targets:
        for attr in ("LLM", "load_model"):
            if hasattr(module, attr):
                monkeypatch.setattr(module, attr, loaded)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-random")


def refused(run, argv, capsys) -> str:
    """Run a command line that must be refused by argparse; return its error message."""
    with pytest.raises(SystemExit) as e:
        run(argv)
    assert e.value.code == 2, f"exit code {e.value.code} for {argv}"
    err = capsys.readouterr().err
    assert "usage:" in err and "error:" in err
    return err.split("error:", 1)[1]


BENCH = ["bench", "--workload", "offline", "--model", "tiny-random"]
ONLINE = ["bench", "--workload", "online", "--model", "tiny-random"]

MAIN_CASES = [  # (argv, the flag the message names, words of the allowed range)
    (ONLINE + ["--rate", "nan"], "--rate", "> 0"),  # used to hang: Poisson gaps of nan seconds
    (ONLINE + ["--rate", "inf"], "--rate", "> 0"),
    (ONLINE + ["--rate", "0"], "--rate", "> 0"),
    (ONLINE + ["--rate", "-2"], "--rate", "> 0"),
    (ONLINE + ["--rate", "fast"], "--rate", "number"),
    (BENCH + ["--num-requests", "0"], "--num-requests", ">= 1"),  # used to be a traceback
    (BENCH + ["--num-requests", "2.5"], "--num-requests", "integer"),
    (BENCH + ["--block-size", "0"], "--block-size", "[1, 1024]"),  # used to be a traceback
    (BENCH + ["--block-size", "4096"], "--block-size", "[1, 1024]"),
    (BENCH + ["--prompt-len", "10", "5"], "--prompt-len", "MIN <= MAX"),  # used to be a traceback
    (BENCH + ["--prompt-len", "0", "5"], "--prompt-len", ">= 1"),
    (BENCH + ["--output-len", "8", "2"], "--output-len", "MIN <= MAX"),
    (BENCH + ["--json", "/nonexistent/dir/out.json"], "--json", "does not exist"),  # used to fail after the run
    (BENCH + ["--seed", "-1"], "--seed", ">= 0"),
    (BENCH + ["--hf-batch-size", "0"], "--hf-batch-size", ">= 1"),
    (BENCH + ["--max-num-seqs", "0"], "--max-num-seqs", ">= 1"),
    (BENCH + ["--max-num-batched-tokens", "-3"], "--max-num-batched-tokens", ">= 1"),
    (BENCH + ["--chunked-prefill", "-1"], "--chunked-prefill", ">= 0"),
    (BENCH + ["--slo-ttft", "nan"], "--slo-ttft", "> 0"),
    (BENCH + ["--slo-tpot", "-5"], "--slo-tpot", "> 0"),
    (BENCH + ["--breakdown", "-1"], "--breakdown", ">= 0"),
    (BENCH + ["--rate", "2"], "--rate", "offline"),  # a size the workload does not have
    (ONLINE + ["--compare", "static"], "--compare", "offline"),  # used to load the model first
    (BENCH + ["--max-num-seqs", "8", "--max-num-batched-tokens", "4"], "--max-num-batched-tokens", ">= 8"),
    (BENCH + ["--dtype", "float16"], "--dtype", "bfloat16"),
    (["bench", "--workload", "online", "--server", "http://127.0.0.1:1", "--dtype", "bfloat16"], "--dtype",
     "the server's own"),
    (["bench", "--workload", "online", "--server", "http://127.0.0.1:1", "--kernels", "reference"],
     "--kernels/--quantization", "not with --server"),
    (BENCH + ["--quantization", "gguf", "--tensor-parallel-size", "3"], "--quantization", "--tensor-parallel-size > 1"),
    (BENCH + ["--kernels", "fast"], "--kernels", "invalid choice"),
    (BENCH + ["--gguf-activations", "float32"], "--gguf-activations", "only with --quantization gguf"),
    (["generate", "Hi", "--model", "tiny-random", "--max-tokens", "0"], "--max-tokens", ">= 1"),
    (["generate", "Hi", "--model", "tiny-random", "--temperature", "-1"], "--temperature", ">= 0"),
    (["generate", "Hi", "--model", "tiny-random", "--temperature", "nan"], "--temperature", ">= 0"),
    (["generate", "Hi", "--model", "tiny-random", "--top-p", "0"], "--top-p", "(0, 1]"),
    (["generate", "Hi", "--model", "tiny-random", "--top-p", "1.5"], "--top-p", "(0, 1]"),
    (["generate", "Hi", "--model", "tiny-random", "--top-k", "-2"], "--top-k", "-1"),
    (["generate", "Hi", "--model", "tiny-random", "--device", "tpu"], "--device", "available here"),
    (["bench", "--workload", "offline", "--device", "tpu"], "--device", "available here"),
    (["generate", "Hi", "--model", "tiny-random", "--seed", "-1"], "--seed", ">= 0"),
    (["generate", "Hi", "--model", "tiny-random", "--seed", "99999999999999999999"], "--seed", "2**63 - 1"),
    (["generate", "", "--model", "tiny-random", "--raw"], "argument prompt", "must not be empty"),
    (["generate", "a\udcffb", "--model", "tiny-random"], "argument prompt", "valid UTF-8"),  # was a traceback
    (["generate", "Hi", "--system", "\udcff", "--model", "tiny-random"], "--system", "valid UTF-8"),
    (["generate", "Hi", "--model", "no-such-model"], "--model", "cannot load 'no-such-model'"),
    (BENCH[:-1] + ["no-such-model"], "--model", "cannot load 'no-such-model'"),
]


@pytest.mark.parametrize("argv, flag, allowed", MAIN_CASES, ids=[" ".join(c[0][1:]) for c in MAIN_CASES])
def test_python_m_minivllm_refuses_bad_flags_before_loading_a_model(argv, flag, allowed, no_model, capsys):
    message = refused(main, argv, capsys)
    assert flag in message and allowed in message, message


def test_bench_json_into_a_folder_or_an_unwritable_place_is_refused(tmp_path, no_model, capsys):
    assert "folder" in refused(main, BENCH + ["--json", str(tmp_path)], capsys)
    missing = tmp_path / "no-such-dir" / "out.json"
    assert "does not exist" in refused(main, BENCH + ["--json", str(missing)], capsys)


def test_bench_refuses_a_prompt_longer_than_the_token_budget_before_loading_the_model(no_model, capsys):
    message = refused(main, BENCH + ["--prompt-len", "40", "60", "--max-num-seqs", "4",
                                     "--max-num-batched-tokens", "32"], capsys)
    assert "--max-num-batched-tokens" in message and "--chunked-prefill" in message


EXPERIMENT_CASES = [  # python -m minivllm.bench [sub] ...
    (["--num-requests", "0"], "--num-requests", ">= 1"),
    (["--prompt-len", "10", "5"], "--prompt-len", "MIN <= MAX"),
    (["--output-len", "0", "4"], "--output-len", ">= 1"),
    (["--repeats", "0"], "--repeats", ">= 1"),
    (["--block-size", "0"], "--block-size", "[1, 1024]"),
    (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], "--max-num-batched-tokens", ">= 64"),
    (["interference", "--chunk-sizes", "64", "-1"], "--chunk-sizes", ">= 0"),
    (["interference", "--num-streams", "0"], "--num-streams", ">= 1"),
    (["interference", "--long-prompt-len", "0"], "--long-prompt-len", ">= 1"),
    (["interference", "--arrive-at-step", "-1"], "--arrive-at-step", ">= 0"),
    (["interference", "--repeats", "-1"], "--repeats", ">= 1"),
    (["interference", "--max-num-batched-tokens", "4"], "--max-num-batched-tokens", ">= 9"),
    (["interference", "--chunk-sizes", "0", "--max-num-batched-tokens", "512"], "--max-num-batched-tokens",
     "1500"),
    (["shared-prefix", "--suffix-len", "48", "16"], "--suffix-len", "MIN <= MAX"),
    (["shared-prefix", "--prefix-len", "0"], "--prefix-len", ">= 1"),
    (["shared-prefix", "--output-tokens", "0"], "--output-tokens", ">= 1"),
    (["shared-prefix", "--seed", "-4"], "--seed", ">= 0"),
    (["preemption", "--pool-fraction", "0"], "--pool-fraction", "(0, 1]"),
    (["preemption", "--pool-fraction", "nan"], "--pool-fraction", "(0, 1]"),
    (["preemption", "--watermark", "1"], "--watermark", "[0, 1)"),
    (["preemption", "--copy-blocks", "0"], "--copy-blocks", ">= 1"),
    (["preemption", "--block-size", "0"], "--block-size", "[1, 1024]"),
    (["preemption", "--prompt-len", "48", "24"], "--prompt-len", "MIN <= MAX"),
]


@pytest.mark.parametrize("argv, flag, allowed", EXPERIMENT_CASES, ids=[" ".join(c[0]) for c in EXPERIMENT_CASES])
def test_python_m_minivllm_bench_refuses_bad_flags_before_loading_a_model(argv, flag, allowed, no_model, capsys):
    argv = argv[:1] + ["--model", "tiny-random"] + argv[1:] if not argv[0].startswith("-") else ["--model",
                                                                                                "tiny-random"] + argv
    message = refused(bench_main, argv, capsys)
    assert flag in message and allowed in message, message


def test_help_still_lists_every_experiment(capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert all(f"python -m minivllm.bench {name} --help" in text
               for name in ("interference", "shared-prefix", "preemption"))
    for name in ("interference", "shared-prefix", "preemption"):
        with pytest.raises(SystemExit) as e:
            bench_main([name, "--help"])
        assert e.value.code == 0 and f"python -m minivllm.bench {name}" in capsys.readouterr().out


def test_bench_help_and_the_readme_describe_every_workload_and_how_to_size_it_down(capsys):
    """bench --help lists each workload with what it measures and its default sizes as flags; the README names
    every workload and the flags that size a run down."""
    from pathlib import Path

    from minivllm.bench import WORKLOAD_PURPOSES, WORKLOADS

    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    names = [*WORKLOADS, "speculative"]
    assert all(f"  {name} " in text for name in names) and set(WORKLOAD_PURPOSES) == set(WORKLOADS)
    assert all(WORKLOAD_PURPOSES[name] in text for name in WORKLOADS)
    assert "--num-requests 32, --prompt-len 16 256, --output-len 64 64" in text  # offline's defaults
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert [name for name in names if f"`{name}`" not in readme] == []
    lines = text.split("\n")
    for name in WORKLOADS:  # the README's table gives the same default sizes as --help
        sizes = lines[lines.index(next(line for line in lines if line.startswith(f"  {name} "))) + 1].strip()
        row = next(line for line in readme.split("\n") if line.startswith(f"| `{name}` |"))
        assert sizes.startswith("fixed") or f"`{sizes.replace(',', '')}`" in row, (name, sizes, row)


# -- the same checks in the library: make_workload and the arrival builders --------------------------------

WORKLOAD_CASES = [  # (workload, sizes, words of the ValueError)
    ("online", dict(rate=math.nan), "rate must be > 0"),
    ("online", dict(rate=math.inf), "rate must be > 0"),
    ("online", dict(rate=0.0), "rate must be > 0"),
    ("shared-prefix", dict(rate=-1.0), "rate must be > 0"),
    ("offline", dict(num_requests=0), "num_requests must be an integer >= 1"),
    ("offline", dict(num_requests=2.0), "num_requests must be an integer >= 1"),
    ("offline", dict(prompt_len=(10, 5)), "prompt_len must be a (min, max) pair"),
    ("offline", dict(prompt_len=(0, 5)), "prompt_len must be a (min, max) pair"),
    ("online", dict(output_len=(3,)), "output_len must be a (min, max) pair"),
    ("shared-prefix", dict(suffix_len=(48, 16)), "suffix_len must be a (min, max) pair"),
    ("shared-prefix", dict(prefix_len=0), "prefix_len must be an integer >= 1"),
    ("interference", dict(num_streams=0), "num_streams must be an integer >= 1"),
    ("interference", dict(long_every=math.nan), "long_every must be > 0"),
    ("memory-pressure", dict(pool_fraction=0.0), "pool_fraction must be in (0, 1]"),
    ("memory-pressure", dict(pool_fraction=1.5), "pool_fraction must be in (0, 1]"),
    ("offline", dict(rate=2.0), "workload 'offline' has no size 'rate'"),
]


@pytest.mark.parametrize("name, sizes, words", WORKLOAD_CASES, ids=[f"{c[0]}-{c[1]}" for c in WORKLOAD_CASES])
def test_make_workload_refuses_bad_sizes(name, sizes, words, tok):
    with pytest.raises(ValueError) as e:
        make_workload(name, tok, **sizes)
    assert words in str(e.value)


def test_workload_builders_refuse_bad_sizes(tok):
    for call, words in [(lambda: poisson_times(3, math.nan), "rate must be > 0"),
                        (lambda: poisson_times(-1, 1.0), "num_requests must be an integer >= 0"),
                        (lambda: random_workload(tok, 2, (5, 4)), "prompt_len must be a (min, max) pair"),
                        (lambda: interference_arrivals(tok, arrive_at_step=-1), "arrive_at_step must be an integer"),
                        (lambda: shared_prefix_arrivals(tok, suffix_len=(9, 3)), "suffix_len must be a (min, max)"),
                        (lambda: squeezed_arrivals(tok, output_tokens=0), "output_tokens must be an integer >= 1")]:
        with pytest.raises(ValueError) as e:
            call()
        assert words in str(e.value)


# -- good input still runs: each experiment end to end on tiny-random ------------------------------------

TINY_RUNS = {
    "throughput": ["--model", "tiny-random", "--num-requests", "3", "--prompt-len", "8", "16", "--output-len", "3", "5",
                   "--block-size", "4", "--skip-hf"],
    "interference": ["interference", "--model", "tiny-random", "--chunk-sizes", "0", "16", "--num-streams", "2",
                     "--stream-tokens", "4", "--long-prompt-len", "40", "--long-tokens", "2", "--block-size", "4"],
    "shared-prefix": ["shared-prefix", "--model", "tiny-random", "--num-requests", "3", "--prefix-len", "16",
                      "--suffix-len", "4", "8", "--output-tokens", "3", "--block-size", "4"],
    # a squeezed pool smaller than the warm-up request used to fail in the warm-up
    "preemption": ["preemption", "--model", "tiny-random", "--num-requests", "4", "--prompt-len", "8", "12",
                   "--output-tokens", "6", "--copy-blocks", "4"],
}


@pytest.mark.parametrize("name", TINY_RUNS)
def test_every_experiment_still_runs_on_tiny_random(name, capsys):
    assert bench_main(TINY_RUNS[name]) == 0
    out = capsys.readouterr().out
    assert out.startswith("workload:" if name in ("throughput", "interference", "shared-prefix") else "tiny-random")
    assert "identical" in out or name == "throughput"


# -- python -m minivllm serve (chapter 13): every engine option is a flag, bad values refused before any model loads

SERVE_CASES = [  # (argv, the flag the message names, words of the allowed range)
    (["--block-size", "0"], "--block-size", "[1, 1024]"),
    (["--max-num-seqs", "8", "--max-num-batched-tokens", "4"], "--max-num-batched-tokens", ">= max_num_seqs"),
    (["--kv-cache-memory-fraction", "2"], "--kv-cache-memory-fraction", "(0, 1]"),
    (["--preemption-mode", "drop"], "--preemption-mode", "invalid choice"),
    (["--sampler", "no.such.Sampler"], "--sampler", "importable dotted name"),
    (["--device", "tpu"], "--device", "available here"),
    (["--port", "70000"], "--port", "[1, 65535]"),
    (["--max-queue-size", "-1"], "--max-queue-size", ">= 0"),
    (["--shutdown-grace", "-1"], "--shutdown-grace", ">= 0"),
    (["--num-blocks", "many"], "--num-blocks", "invalid int"),
    (["--num-blocks", "1", "--block-size", "1"], "--num-blocks", "at least 2"),  # no request could ever run
    (["--max-request-bytes", "0"], "--max-request-bytes", ">= 1"),
    (["--read-timeout", "0"], "--read-timeout", "> 0"),
    (["--read-timeout", "inf"], "--read-timeout", "> 0"),
    (["--shard-weight", "os.system", "--tensor-parallel-size", "2"], "--shard-weight",  # was a traceback at load
     "shard_weight(name, weight, rank, world, config)"),
    (["--kv-handoff-cls", "os.system", "--disaggregated"], "--kv-handoff-cls", "kv_handoff_cls()"),
    (["--model", "no-such-model"], "--model", "cannot load 'no-such-model'"),
]


@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if ``serve`` builds an engine (loads a model) before refusing its flags."""
    import minivllm.serving.cli

    def loaded(*args, **kwargs):
        raise AssertionError("an engine was built before the command line was checked")

    monkeypatch.setattr(minivllm.serving.cli, "LLMEngine", loaded)
    monkeypatch.setattr(minivllm.serving.cli, "make_engine", loaded)


@pytest.mark.parametrize("argv, flag, allowed", SERVE_CASES, ids=[" ".join(c[0]) for c in SERVE_CASES])
def test_serve_refuses_bad_flags_before_loading_a_model(argv, flag, allowed, no_engine, capsys):
    message = refused(main, ["serve", "--model", "tiny-random", *argv], capsys)
    assert flag in message and allowed in message, message


def test_serve_help_documents_every_engine_option(capsys):
    from minivllm.config import EngineConfig

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    flags = ["--host", "--port", "--max-queue-size", "--max-request-bytes", "--shutdown-grace", "--served-model-name"]
    flags += ["--" + name.replace("_", "-") for name in EngineConfig.field_names()]
    assert [f for f in flags if f not in text] == []
    assert "127.0.0.1" in text  # the default: this machine only


# -- values only the loaded model refutes, and the server's warm-up: still usage errors, never a traceback ------

def test_generate_refuses_what_only_the_model_knows_after_loading_it(capsys):
    for argv, flag, allowed in [(["--max-tokens", "100000"], "--max-tokens", "max_model_len (16384)"),
                                (["--top-k", "100000"], "--top-k", "[1, 49152]")]:
        message = refused(main, ["generate", "Hi", "--model", "tiny-random", *argv], capsys)
        assert flag in message and allowed in message, message


def test_serve_refuses_a_context_longer_than_the_models_before_the_port_opens(capsys):
    port = str(free_port())
    message = refused(main, ["serve", "--model", "tiny-random", "--max-model-len", "100000", "--port", port], capsys)
    assert "--max-model-len" in message and "16384" in message, message
    with socket.socket() as s:
        s.bind(("127.0.0.1", int(port)))  # the refusal let the port go


def test_serve_refuses_a_port_in_use_or_a_host_it_cannot_resolve_before_loading_a_model(no_engine, capsys):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = str(other.getsockname()[1])
        message = refused(main, ["serve", "--model", "tiny-random", "--port", port], capsys)
    assert "--port" in message and f"127.0.0.1:{port}" in message and "in use" in message, message
    message = refused(main, ["serve", "--model", "tiny-random", "--host", "no-such-host.invalid"], capsys)
    assert "--host" in message and "no-such-host.invalid" in message, message


def test_serve_holds_its_port_while_the_engine_loads(monkeypatch, capsys):
    """Tensor-parallel ranks open rendezvous and gloo sockets while the engine loads: the HTTP port is bound
    first, so none of them can be given it (a server that lost its port to its own ranks failed after the load)."""
    import minivllm.serving.cli

    port, seen = free_port(), []

    def make_engine(config):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                seen.append("free")
            except OSError as e:
                seen.append(e.errno)
        raise ValueError("max_model_len refused here, to stop the server before it serves")

    monkeypatch.setattr(minivllm.serving.cli, "make_engine", make_engine)
    message = refused(main, ["serve", "--model", "tiny-random", "--port", str(port)], capsys)
    assert "--max-model-len" in message, message
    assert seen == [errno.EADDRINUSE], f"the port was {seen} while the engine loaded"


@pytest.mark.parametrize("options", [dict(max_model_len=10), dict(num_blocks=1),
                                     dict(max_num_batched_tokens=8, max_num_seqs=8),
                                     dict(num_blocks=2, block_size=1)], ids=str)
def test_the_servers_warm_up_fits_every_small_configuration_the_engine_accepts(options):
    from minivllm.engine import LLMEngine
    from minivllm.serving.cli import warm_up

    engine = warm_up(LLMEngine(model="tiny-random", device="cpu", **options))  # used to refuse its own request
    assert engine.num_steps >= 1 and not engine.has_unfinished_requests()
    assert engine.stats().num_free_blocks == engine.num_blocks


def test_the_command_line_reports_a_refusal_in_one_line_without_a_traceback():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "minivllm", "generate", "Hi", "--model", "tiny-random",
                           "--max-tokens", "100000"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "error: argument --max-tokens:" in done.stderr.splitlines()[-1]


def test_a_prompt_argument_that_is_not_utf8_is_a_usage_error_without_a_traceback():
    import subprocess
    import sys

    done = subprocess.run([sys.executable.encode(), b"-m", b"minivllm", b"generate", b"caf\xe9", b"--model",
                           b"tiny-random"], capture_output=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2 and "Traceback" not in err, err  # before: the tokenizer's TypeError, exit 1
    assert "error: argument prompt: must be valid UTF-8 text" in err.splitlines()[-1], err


def test_bench_against_a_server_that_is_not_there_is_one_line_and_exit_1(capsys):
    assert main(["bench", "--workload", "online", "--model", "tiny-random", "--server", "http://127.0.0.1:1"]) == 1
    assert capsys.readouterr().err.splitlines() == ["python -m minivllm bench: error: cannot reach the server at "
                                                    "http://127.0.0.1:1: [Errno 111] Connection refused"]
