"""``python -m minivllm.bench margins`` (minivllm.bench.peer_margins, chapter 18): the margin arithmetic on
hand-made rows, the llama.cpp logits driver against a fake ``llama_cpp``, minivllm's own rows against its
engines' greedy tokens, and the command without the peer (a skip line). No test needs llama.cpp installed."""

import ctypes
import importlib.util
import math
import sys

import pytest

from minivllm.bench import main as bench_main
from minivllm.bench import peer_margins
from minivllm.bench.peer_margins import (MarginReport, Parting, agreement_summary, margin_report, margins_table,
                                         our_rows, top2_gap)
from minivllm.bench.peers import DRIVERS

# Two requests: 0 agrees throughout (2 tokens); 1 parts at output position 1 (minivllm 3, llama.cpp 4).
OUR_TOKENS = [[1, 2], [1, 3]]
THEIR_TOKENS = [[1, 2], [1, 4]]


def rows(parting_ours=None, parting_theirs=None):
    """Each engine's rows: the top-2 gaps at agreeing positions are (ours, theirs) (1.0, 0.8), (0.5, 1.0),
    (2.0, 1.9): they move by 0.2, 0.5 (ours below theirs) and 0.1, so the bound is 0.5 and our median gap 1.0."""
    ours = [[{1: 5.0, 2: 4.0}, {1: 2.5, 2: 3.0}],
            [{7: 4.0, 1: 6.0}, parting_ours or {3: 2.0, 4: 1.9, 9: -5.0}, {0: 90.0, 5: 0.0}]]
    theirs = [[{1: 4.8, 2: 4.0}, {2: 3.0, 1: 2.0}],
              [{1: 6.0, 7: 4.1}, parting_theirs or {4: 7.2, 3: 2.0}]]
    return ours, theirs


def test_top2_gap_is_the_largest_logit_minus_the_second_whatever_the_order():
    assert top2_gap({5: 1.0, 9: 3.5, 2: 3.0}) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="^row must hold at least 2 logits"):
        top2_gap({1: 0.0})


def test_each_engine_s_margin_is_its_own_pick_over_the_others_and_the_bound_comes_from_agreeing_positions():
    ours, theirs = rows()
    report = margin_report(ours, theirs, OUR_TOKENS, THEIR_TOKENS)
    # the parting's own rows (gaps 0.1 against 5.2) and the row after it are not where the engines agree
    assert report.bound == pytest.approx(0.5) and report.median_gap == pytest.approx(1.0)
    assert report.agreeing == 3
    (p,) = report.partings
    assert (p.request, p.position, p.a, p.b) == (1, 1, 3, 4)
    assert p.ours == pytest.approx(0.1) and p.theirs == pytest.approx(5.2)  # l[a] - l[b] ours, l[b] - l[a] theirs
    assert p.ours_int8 is None and report.explained(p) and report.num_explained == 1


def test_a_parting_with_our_margin_above_the_bound_is_not_explained():
    ours, theirs = rows(parting_ours={3: 3.0, 4: 2.0, 9: 0.0})  # our margin 1.0: above the bound 0.5
    report = margin_report(ours, theirs, OUR_TOKENS, THEIR_TOKENS)
    assert report.partings[0].ours == pytest.approx(1.0)
    assert not report.explained(report.partings[0]) and report.num_explained == 0
    ours, theirs = rows(parting_ours={3: 2.3, 4: 2.0, 9: 0.0})  # 0.3: below |0.5 - 1.0|, above 0.8 - 1.0 and 0.2
    assert margin_report(ours, theirs, OUR_TOKENS, THEIR_TOKENS).num_explained == 1


def test_a_margin_below_the_bound_but_not_the_median_is_not_explained():
    report = MarginReport(bound=2.0, median_gap=0.5, agreeing=10, partings=[Parting(0, 3, 1, 2, 0.7, 0.1)])
    assert not report.explained(report.partings[0])


def test_the_int8_rows_give_their_own_margin_at_the_parting():
    ours, theirs = rows()
    int8 = [[{}, {}], [{}, {3: 1.0, 4: 1.25}]]
    report = margin_report(ours, theirs, OUR_TOKENS, THEIR_TOKENS, int8)
    assert report.partings[0].ours_int8 == pytest.approx(-0.25)
    assert "prefers llama.cpp's token there: 1 of 1" in margins_table(report)


def test_bad_rows_are_refused_naming_what_is_wrong():
    ours, theirs = rows(parting_theirs={4: 7.2, 8: 2.0})
    with pytest.raises(ValueError, match=r"^theirs\[1\]\[1\] must hold the logits of tokens 3 and 4, lacks \[3\]"):
        margin_report(ours, theirs, OUR_TOKENS, THEIR_TOKENS)
    ours, theirs = rows()
    with pytest.raises(ValueError, match=r"^theirs\[0\] must hold 2 rows"):
        margin_report(ours, [theirs[0][:1], theirs[1]], OUR_TOKENS, THEIR_TOKENS)
    with pytest.raises(ValueError, match=r"^theirs must have one entry per request \(2\), got 1"):
        margin_report(ours, theirs[:1], OUR_TOKENS, THEIR_TOKENS)


def test_no_agreeing_position_leaves_no_bound_and_nothing_explained():
    report = margin_report([[{1: 1.0, 2: 0.0}]], [[{1: 0.0, 2: 1.0}]], [[1]], [[2]])
    assert math.isnan(report.bound) and report.num_explained == 0 and report.partings[0].ours == 1.0


def test_the_agreement_summary_and_the_table_fit_the_column():
    assert agreement_summary([[1, 2, 3], [1, 2, 3]], [[1, 2, 3], [1, 9, 3]]) == (
        "1/2 requests identical; leading identical tokens min 1, mean 2.0 of 3.0\n"
        "leading identical tokens in all: 4 of 6")
    ours, theirs = rows()
    table = margins_table(margin_report(ours, theirs, OUR_TOKENS, THEIR_TOKENS))
    assert "1 of 1" in table and "0.5000" in table and "yes" in table
    assert max(map(len, table.splitlines())) <= 100


# -- llama.cpp's logits driver, against a fake llama_cpp ---------------------------------------------------

VOCAB = 40


class FakeLlama:
    """Logits that hash the sequence's history up to each row: 2.0 at one token, 1.0 at the next id. Checks that
    one sequence is fed from position 0 and that only the asked positions carry logits."""

    def __init__(self):
        self.cleared, self.asked = 0, None

    def llama_get_memory(self, ctx):
        return "mem"

    def llama_memory_clear(self, mem, data):
        self.cleared += 1

    def llama_decode(self, ctx, batch):
        assert [batch.pos[i] for i in range(batch.n_tokens)] == list(range(batch.n_tokens))
        assert all(batch.seq_id[i][0] == 0 for i in range(batch.n_tokens))
        self.tokens = [batch.token[i] for i in range(batch.n_tokens)]
        self.asked = [i for i in range(batch.n_tokens) if batch.logits[i]]
        return 0

    def llama_get_logits_ith(self, ctx, i):
        assert i in self.asked
        logits = (ctypes.c_float * VOCAB)()
        top = hash(tuple(self.tokens[:i + 1])) % VOCAB
        logits[top], logits[(top + 1) % VOCAB] = 2.0, 1.0
        return ctypes.cast(logits, ctypes.POINTER(ctypes.c_float))


class FakeBatch:
    def __init__(self, n):
        self.token, self.pos, self.n_seq_id, self.logits = [0] * n, [0] * n, [0] * n, [0] * n
        self.seq_id = [[0] for _ in range(n)]
        self.n_tokens = 0


def _logits_driver():
    if str(DRIVERS) not in sys.path:  # as when the peer's python runs it: its folder first (_progress, offline)
        sys.path.insert(0, str(DRIVERS))
    spec = importlib.util.spec_from_file_location("llamacpp_logits", DRIVERS / "llamacpp_logits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_logits_driver_returns_the_asked_rows_only_their_top_and_the_named_ids():
    driver, lib = _logits_driver(), FakeLlama()
    tokens = [5, 6, 7, 8, 9]
    out = driver.rows(lib, None, FakeBatch(8), 8, VOCAB, tokens, [[4, [0]], [2, []]], 3)
    assert lib.cleared == 1 and lib.asked == [2, 4]
    assert len(out) == 2  # in position order
    for row, p in zip(out, (2, 4)):
        top = hash(tuple(tokens[:p + 1])) % VOCAB
        assert [i for i, _ in row["top"]][:2] == [top, (top + 1) % VOCAB]
        assert [v for _, v in row["top"]] == [2.0, 1.0, 0.0]
    logits = dict.fromkeys(range(VOCAB), 0.0) | {top: 2.0, (top + 1) % VOCAB: 1.0}  # position 4's row
    assert out[1]["at"] == [[0, logits[0]]] and out[0]["at"] == []
    with pytest.raises(ValueError, match="distinct positions in"):
        driver.rows(lib, None, FakeBatch(8), 8, VOCAB, tokens, [[5, []]], 3)
    with pytest.raises(ValueError, match="n_batch=4"):
        driver.rows(lib, None, FakeBatch(8), 4, VOCAB, tokens, [[0, []]], 3)


# -- minivllm's rows, against its engines' greedy tokens ---------------------------------------------------

def test_our_rows_pick_the_float32_and_the_batch_1_int8_engines_tokens():
    """Up to a parting made at output position 5: the float32 forward's top-1 is the float32 engine's token
    at each position, the int8 path's the int8 engine's at batch 1 (the path whose logits it claims to be)."""
    from minivllm import LLM, SamplingParams, kernels

    if kernels.cpu_table() is None:
        pytest.skip("quantization='gguf' runs the C++ kernels, which do not build here")
    prompt = list(range(1000, 1024))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = {}
    for name, opts in (("float32", {}), ("int8", {"quantization": "gguf"})):
        llm = LLM("smollm2-135m", num_blocks=8, max_num_seqs=1, device="cpu", dtype="float32", **opts)
        outs[name] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    for name, which in (("float32", 0), ("int8", 1)):
        ours = outs[name]
        theirs = ours[:5] + [ours[5] + 1] + ours[6:]
        got = our_rows([prompt], [ours], [theirs], top_k=2)[which][0]
        assert len(got) == 6 and {ours[5], ours[5] + 1} <= set(got[5])
        assert [max(row, key=row.get) for row in got] == ours[:6], name


# -- the command -----------------------------------------------------------------------------------------------

def test_margins_without_llamacpp_prints_a_skip_line_and_runs_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    from minivllm.bench import harness

    monkeypatch.setattr(harness, "run_engine", lambda *a, **k: pytest.fail("ran the workload without the peer"))
    assert bench_main(["margins", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llamacpp-q4_1: skipped, llama.cpp (llama-cpp-python) is not installed")
    assert "python -m minivllm.bench peers setup" in out and str(tmp_path) in out


def test_margins_has_help_and_refuses_bad_flags(capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["margins", "--help"])
    assert e.value.code == 0 and "python -m minivllm.bench margins" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        peer_margins.margins_main(["--num-requests", "0"])
    assert e.value.code == 2 and "--num-requests: must be an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        peer_margins.margins_main(["--top-k", "1"])
    assert e.value.code == 2 and "--top-k: must be an integer in [2, 100], got '1'" in capsys.readouterr().err
