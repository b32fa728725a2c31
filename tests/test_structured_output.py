"""Structured outputs (chapter 19): the constraint's validation, the bitmask against xgrammar's own, valid JSON for
every request of a JSON-schema workload (greedy and sampled; with speculation, preemption by recompute and swap,
n = 3, prefix caching, tensor parallelism), unconstrained rows untouched, "length" for output cut short, EOS only
where the grammar ends, logprobs of the masked distribution, and the refusals.

The mask guarantees validity on any model, so the seeded random model is the oracle for "valid" (its schema bounds
every string and number, so each answer fits in ``MAX_TOKENS``); SmolLM2 shows the answers are sensible."""

import json
import re
import sys

import jsonschema
import pytest
import torch

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.sampler import apply_token_bitmask, mask_logits
from minivllm.sequence import Sequence
from minivllm.structured_output import INSTALL, MAX_CHOICES, bitmask_words

from helpers import dead_end_after, run_engine

xgr = pytest.importorskip("xgrammar")  # the README's commands install it; without it only the refusal is tested

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"enum": ["Paris", "Oslo", "Lima"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
COMPACT = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
MAX_TOKENS = 64
NAMES = ["Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal"]
PREFIX = "People, one JSON object each, as in the examples. "  # shared by every prompt: prefix-cache hits


def workload_prompts(tok, n: int = 16) -> list[list[int]]:
    """Prompts with a JSON example in them (so prompt lookup drafts JSON), sharing a first block or two. 16: twice
    the 8 sequences the preemption settings run at once in 24 blocks (each needs about 7), every name twice."""
    return [tok(PREFIX + f'Example: {{"name": "{NAMES[i % 8]}", "age": {20 + i}, "city": "Oslo"}}. Person {i}:')
            ["input_ids"] for i in range(n)]


def assert_valid(texts, schema=SCHEMA):
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def run(llm, prompts, params, all_samples=False):
    requests = [(f"r{i}", ids, params) for i, ids in enumerate(prompts)]
    return run_engine(llm, requests, all_samples=all_samples)


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("tiny-random", num_blocks=256, max_num_seqs=16, device="cpu")


@pytest.fixture(scope="module")
def prompts(tiny_llm):
    return workload_prompts(tiny_llm.get_tokenizer())


@pytest.fixture(scope="module")
def plain_outputs(tiny_llm, prompts):
    """The workload greedy and sampled (seeded) on the engine with nothing else on: the reference."""
    return {kind: run(tiny_llm, prompts, params(kind)) for kind in ("greedy", "sampled")}


def params(kind: str, **kw) -> SamplingParams:
    sampling = dict(temperature=0.0) if kind == "greedy" else dict(temperature=1.0, top_p=0.9, seed=7)
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "structured_outputs": COMPACT, **sampling, **kw})


def texts(llm, outputs) -> list[str]:
    tok = llm.get_tokenizer()
    return [tok.decode(ids, skip_special_tokens=True) for ids in outputs.values()]


# -- the request side ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,message", [
    (dict(), r"structured_outputs must be exactly one of json, regex, choice, grammar, json_object=True, got \[\]"),
    (dict(json=SCHEMA, regex="a"), r"exactly one of .* got \['json', 'regex'\]"),
    (dict(json="{not json"), r"structured_outputs.json must be a JSON schema, but it is not JSON"),
    (dict(json=[1, 2]), r"structured_outputs.json must be a JSON schema \(an object"),
    (dict(json={"type": "objec"}), r"structured_outputs.json must be a JSON schema xgrammar supports: .*objec"),
    (dict(json={"x": float("nan")}), r"structured_outputs.json must be a JSON schema, but it cannot be written"),
    (dict(regex="(ab"), r"structured_outputs.regex must be a valid regex: .*parenthesis"),
    (dict(regex=""), r"structured_outputs.regex must be a non-empty string"),
    (dict(choice=[]), r"structured_outputs.choice must be a non-empty list of non-empty strings"),
    (dict(choice=["a", 3]), r"structured_outputs.choice must be"),
    (dict(choice=["a"] * (MAX_CHOICES + 1)), rf"structured_outputs.choice must be at most {MAX_CHOICES} strings"),
    (dict(grammar="root ::= undefined_rule"), r"structured_outputs.grammar must be a valid EBNF grammar: .*undefined"),
    (dict(grammar="\ud800"), r"structured_outputs.grammar must be a non-empty EBNF grammar"),
    (dict(json_object="yes"), r"structured_outputs.json_object must be None, True or False"),
    (dict(json_object=True, disable_any_whitespace=1), r"structured_outputs.disable_any_whitespace must be True"),
    (dict(regex="a" * 70000), r"structured_outputs.regex must be at most 65536 characters"),
])
def test_bad_constraints_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_sampling_params_take_only_a_constraint_object_and_keep_it_as_checked():
    with pytest.raises(ValueError, match="structured_outputs must be None or a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})
    schema = json.loads(json.dumps(SCHEMA))
    so = StructuredOutputsParams(json=schema)
    schema["properties"]["name"]["maxLength"] = "broken"  # changed after the check: the engine compiles the key
    assert '"maxLength": 6' in so.key[1]
    with pytest.raises(AttributeError):  # frozen
        so.regex = "a"
    for kind, value in [("regex", "[0-9]+"), ("choice", ["yes", "no"]), ("grammar", 'root ::= "a" | "b"'),
                        ("json_object", True), ("json", json.dumps(SCHEMA))]:
        assert StructuredOutputsParams(**{kind: value}).kind == kind


def test_without_xgrammar_a_constraint_says_what_to_install_and_the_rest_works(monkeypatch, tiny_llm):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    with pytest.raises(ValueError, match=r"structured_outputs needs the xgrammar package.*" + re.escape(INSTALL)):
        StructuredOutputsParams(regex="[0-9]+")
    out = tiny_llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_request_whose_params_were_broken_after_the_check_queues_nothing(tiny_llm):
    p = SamplingParams(max_tokens=4)
    p.structured_outputs = "regex: [0-9]+"  # set after the check: validate_request checks the params again
    with pytest.raises(ValueError, match="structured_outputs must be None or a StructuredOutputsParams"):
        tiny_llm.generate(["Hello", "there"], [SamplingParams(max_tokens=4), p], use_tqdm=False)
    assert not tiny_llm.engine.requests and not tiny_llm.engine.scheduler.has_unfinished()


def test_the_disaggregated_engine_refuses_a_constraint_before_anything_else():
    from minivllm.disaggregation import DisaggregatedEngine

    with pytest.raises(ValueError, match="structured_outputs must be None with disaggregated=True"):
        DisaggregatedEngine.validate_request(None, "r", "Hello", params("greedy"))


# -- the mask --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [64, 100, 49152])
def test_the_bitmask_reference_matches_xgrammar_and_the_engines_kernel(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, bitmask_words(vocab)), dtype=torch.int32, generator=g)
    rows = [4, 0, 2]
    ours, fast, theirs = logits.clone(), logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask, rows)
    mask_logits(fast, bitmask, rows)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=rows, backend="torch_native")
    assert torch.equal(ours, theirs) and torch.equal(fast, theirs)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])  # rows without a mask untouched
    assert ours.isinf().any(1).tolist() == [True, False, True, False, True]
    token = 32 * 1 + 5  # bit 5 of word 1, least significant first
    single = torch.zeros(1, bitmask_words(vocab), dtype=torch.int32)
    single[0, 1] = 1 << 5
    one = logits[:1].clone()
    apply_token_bitmask(one, single, [0])
    assert one[0].isfinite().nonzero().flatten().tolist() == [token]


def test_a_sample_dropping_tokens_rolls_its_matcher_back(tiny_llm):
    grammar = tiny_llm.engine.grammar_backend().grammar(StructuredOutputsParams(regex="[a-z]+"))
    seq = Sequence("r", [1, 2], SamplingParams())
    seq.grammar = grammar
    tok = tiny_llm.get_tokenizer()
    for t in tok("abc def")["input_ids"][:1]:
        assert grammar.accept(t)
        seq.output_token_ids.append(t)
        seq.metrics.token_times.append(0.0)
    seq.drop_last_tokens(1)
    assert grammar.num_accepted == 0 and not grammar.is_completed()


# -- the engine: valid output, exactly ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_every_request_of_the_workload_is_valid_json_and_compiles_once(tiny_llm, plain_outputs, kind):
    outputs = plain_outputs[kind]
    assert len(outputs) == 16
    assert_valid(texts(tiny_llm, outputs))
    backend = tiny_llm.engine.grammar_backend()
    compiled = backend.num_compiled
    again = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=SCHEMA,
                                                                                    disable_any_whitespace=True))
    tiny_llm.generate(["Hello", "Hi"], again, use_tqdm=False)
    assert backend.num_compiled == compiled  # an equal constraint, made anew, is found in the cache


SETTINGS = {
    "speculation": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                            "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
    "recompute": dict(num_blocks=24, max_num_seqs=8, preemption_mode="recompute"),
    "swap": dict(num_blocks=24, max_num_seqs=8, preemption_mode="swap", num_cpu_blocks=64),
    "prefix_caching": dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_prefill_chunk_size=8),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_valid_and_unchanged_with_speculation_preemption_and_prefix_caching(setting, prompts, plain_outputs):
    llm = LLM("tiny-random", device="cpu", **{"num_blocks": 256, "max_num_seqs": 16, **SETTINGS[setting]})
    for kind in ("greedy", "sampled"):
        outputs = run(llm, prompts, params(kind))
        assert_valid(texts(llm, outputs))
        if kind == "greedy" or setting != "speculation":  # rejection sampling draws other random numbers
            assert outputs == plain_outputs[kind], kind
    stats = llm.engine.stats()
    seen = {"speculation": stats.spec_decode_num_accepted_tokens if setting == "speculation" else 0,
            "recompute": stats.num_recomputed_tokens, "swap": stats.num_swapped_bytes,
            "prefix_caching": stats.prefix_cache_hits}[setting]
    assert seen > 0, f"the workload never exercised {setting}"


def test_three_samples_each_have_their_own_matcher(tiny_llm, prompts):
    outputs = run(tiny_llm, prompts[:12], params("sampled", n=3), all_samples=True)
    tok = tiny_llm.get_tokenizer()
    samples = [tok.decode(ids, skip_special_tokens=True) for per_request in outputs.values() for ids in per_request]
    assert len(samples) == 36
    assert_valid(samples)
    assert len(set(samples)) > 12  # the samples of a request differ


def test_tensor_parallel_masks_once_where_the_logits_are(prompts, plain_outputs):
    with LLM("tiny-random", device="cpu", num_blocks=256, max_num_seqs=16, tensor_parallel_size=2) as llm:
        outputs = run(llm, prompts[:8], params("greedy"))
    assert outputs == {rid: plain_outputs["greedy"][rid] for rid in outputs}


def test_unconstrained_rows_in_a_mixed_batch_give_the_tokens_they_give_alone(tiny_llm, prompts):
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    mixed = run_engine(tiny_llm, [(f"r{i}", ids, plain if i % 2 == 0 else params("greedy"))
                                  for i, ids in enumerate(prompts[:8])])
    for i in range(0, 8, 2):
        assert mixed[f"r{i}"] == run(tiny_llm, [prompts[i]], plain)["r0"]


# -- where the output ends ---------------------------------------------------------------------------------------------
def test_output_cut_short_by_max_tokens_ends_with_length(tiny_llm):
    long_choice = StructuredOutputsParams(choice=["x" * 200])
    endless = StructuredOutputsParams(grammar='root ::= "ab" root')
    for so in (long_choice, endless):
        (out,) = tiny_llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=5, structured_outputs=so),
                                   use_tqdm=False)
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5
        assert out.outputs[0].text.startswith("x") or out.outputs[0].text.startswith("ab")


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_comes_only_where_the_grammar_may_end(tiny_llm, ignore_eos):
    so = StructuredOutputsParams(regex="[0-9]{3}")
    outs = tiny_llm.generate(["Hello", "A number:", "x"], SamplingParams(temperature=1.0, seed=3, max_tokens=32,
                                                                          structured_outputs=so, ignore_eos=ignore_eos),
                             use_tqdm=False)
    eos = tiny_llm.get_tokenizer().eos_token_id
    for out in outs:
        c = out.outputs[0]
        assert len(c.text) == 3 and c.text.isdigit() and c.finish_reason == "stop"
        assert c.token_ids[-1] == eos  # the grammar's end: the only token it allowed after three digits


def test_logprobs_are_the_masked_distributions(tiny_llm):
    so = StructuredOutputsParams(choice=["yes", "no"])
    (out,) = tiny_llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8, logprobs=20,
                                                         structured_outputs=so), use_tqdm=False)
    c = out.outputs[0]
    assert c.text in ("yes", "no")
    for token, step in zip(c.token_ids, c.logprobs):
        assert len(step) < 20  # only the tokens the grammar allows are candidates
        total = sum(torch.tensor(lp.logprob).exp().item() for lp in step.values())
        assert abs(total - 1.0) < 1e-4, step  # the mass is all on them: renormalised after the mask
        assert step[token].rank == 1  # greedy takes the masked argmax


def test_smollm2_answers_chat_prompts_with_sensible_valid_json():
    llm = LLM("smollm2-135m", device="cpu", num_blocks=128)
    tok = llm.get_tokenizer()
    schema = {"type": "object", "required": ["name", "age"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
    questions = ["Describe a person as JSON with their name and age.", "Who is Ada Lovelace? Answer in JSON.",
                 "Invent a character for a story (name, age).", "Tell me about a famous painter."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in questions]
    compact = StructuredOutputsParams(json=schema, disable_any_whitespace=True)  # else it stalls in newlines
    constrained = SamplingParams(temperature=0, max_tokens=48, structured_outputs=compact)
    plain = SamplingParams(temperature=0, max_tokens=24)
    outs = llm.generate(prompts + prompts, [constrained] * 4 + [plain] * 4, use_tqdm=False)
    assert_valid([o.outputs[0].text for o in outs[:4]], schema)
    for o in outs[:4]:
        assert json.loads(o.outputs[0].text)["name"].strip(), o.outputs[0].text  # a name, not an empty string
    alone = llm.generate(prompts, plain, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[4:]] == [o.outputs[0].token_ids for o in alone]


def test_the_structured_benchmark_reports_validity_and_the_grammars_share(tiny_llm, capsys):
    from minivllm.bench import run_structured, structured_main, structured_prompts

    prompts = structured_prompts(tiny_llm.get_tokenizer(), 3)
    setting = tiny_llm.engine.runner.overlap_grammar_fill
    on = run_structured(tiny_llm, prompts, 160, constrained=True, overlap=False)
    overlapped = run_structured(tiny_llm, prompts, on["lengths"], constrained=True, overlap=True)
    off = run_structured(tiny_llm, prompts, on["lengths"], constrained=False)
    assert on["valid"] == overlapped["valid"] == 1.0 and off["valid"] == 0.0 and off["lengths"] == on["lengths"]
    assert overlapped["texts"] == on["texts"] and tiny_llm.engine.runner.overlap_grammar_fill is setting  # back
    for run in (on, overlapped):
        assert run["grammar_ms_per_step"] > 0 and 0 < run["grammar_share"] < 1
        assert run["fill_ms_per_step"] > 0 and run["apply_ms_per_step"] > 0 and run["forward_ms_per_step"] > 0
    assert off["grammar_share"] == off["fill_ms_per_step"] == off["apply_ms_per_step"] == 0
    assert structured_main(["--model", "tiny-random", "--batch-sizes", "2", "--output-tokens", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert {"serial", "overlap", "off"} <= {line.split()[1] for line in lines if line.split()[:1] == ["2"]}
    assert any("fill" in line and "apply" in line and "forward" in line for line in lines)


# -- hostile constraints (issue 65): refused by name, never a 500, never a stall ----------------------------------
def nested(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "array", "uniqueItems": True}, '"uniqueItems"'),
    ({"not": {"type": "string"}}, '"not"'),
    ({"type": "array", "contains": {"const": 1}}, '"contains"'),
    ({"type": "integer", "multipleOf": 3}, '"multipleOf"'),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, '"allOf" of 2'),
    ({"$ref": "http://example.com/x.json"}, '"\\$ref" outside the schema'),
    ({"type": []}, 'empty "type"'),
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
     r'"uniqueItems" \(at #/properties/tags\)'),
    ({"type": "string", "format": "credit-card"}, '"format"'),
    ({"type": "string", "minLength": -5}, '"minLength" -5'),
    ({"type": "array", "maxItems": 2.5}, '"maxItems" 2.5'),
])
def test_schema_keywords_xgrammar_does_not_enforce_are_refused_by_name(schema, keyword):
    """Before: accepted, and 12 of 28 outputs broke their schema ([1, 2, 2] under uniqueItems); minLength -5 was
    xgrammar's internal "Check failed" text at compile time."""
    with pytest.raises(ValueError, match=r"^structured_outputs\.json .*" + keyword):
        StructuredOutputsParams(json=schema)
    StructuredOutputsParams(json={"type": "object", "properties": {"not": {"type": "integer"}}})  # a name here


def test_deep_schemas_are_a_value_error_naming_the_limit_never_a_recursion_error():
    from minivllm.structured_output import MAX_SCHEMA_DEPTH
    StructuredOutputsParams(json=nested(MAX_SCHEMA_DEPTH - 1))
    as_text = '{"type": "array", "items": ' * 1100 + '{"type": "integer"}' + "}" * 1100  # json.loads: RecursionError
    limit = sys.getrecursionlimit()
    try:
        for recursion_limit in (limit, 10_000):  # a library may raise it: json.loads then parses 1,100 levels
            sys.setrecursionlimit(recursion_limit)
            for schema in (nested(MAX_SCHEMA_DEPTH), nested(480), as_text, "[" * 1100 + "]" * 1100):
                with pytest.raises(ValueError, match=rf"json must nest .* at most {MAX_SCHEMA_DEPTH}"):
                    StructuredOutputsParams(json=schema)
    finally:
        sys.setrecursionlimit(limit)


def test_json_object_takes_only_a_real_bool():
    for value in (1, 0, 1.0):
        with pytest.raises(ValueError, match="structured_outputs.json_object must be None, True or False"):
            StructuredOutputsParams(json_object=value)


@pytest.mark.parametrize("fields", [dict(regex=r"[^\s\S]"), dict(grammar="root ::= root")])
def test_a_constraint_no_output_satisfies_ends_its_request_with_that_error(tiny_llm, fields):
    """Before: it built, then failed "token 0 is not allowed" (greedy) or with a NaN from sampling."""
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=3)):
        p = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**fields), **sampling)
        bad, plain = tiny_llm.generate(["Hi", "Hi"], [p, SamplingParams(max_tokens=4, **sampling)], use_tqdm=False)
        assert bad.outputs[0].finish_reason == "error" and "admits no output" in bad.error, bad.error
        assert plain.outputs[0].finish_reason == "length"


def test_a_mask_that_admits_no_token_mid_output_ends_the_request_saying_so(tiny_llm, monkeypatch):
    dead_end_after(monkeypatch, 2)  # the grammar reaches a state with no way on after two tokens
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=3)):
        p = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z]{40,50}"), **sampling)
        bad, plain = tiny_llm.generate(["Hi", "Hi"], [p, SamplingParams(max_tokens=8, **sampling)], use_tqdm=False)
        assert bad.outputs[0].finish_reason == "error", bad
        assert bad.error.startswith("structured_outputs admits no continuation"), bad.error
        assert len(bad.outputs[0].token_ids) == 2 and plain.outputs[0].finish_reason == "length"


# -- compiling off the step (issue 65, item 3) ---------------------------------------------------------------------
@pytest.fixture
def slow_compiles(monkeypatch):
    """Every compile (xgrammar's ``GrammarCompiler.compile_grammar``) blocks until the test sets the returned
    event, then compiles for real; ``calls`` counts them."""
    import threading
    release, calls, real = threading.Event(), [], xgr.GrammarCompiler.compile_grammar

    def compile_grammar(self, grammar, *args, **kwargs):
        calls.append(grammar)
        assert release.wait(300), "the test never released the compile"
        return real(self, grammar, *args, **kwargs)

    monkeypatch.setattr(xgr.GrammarCompiler, "compile_grammar", compile_grammar)
    release.calls = calls
    yield release
    release.set()


def wait_for(condition, what: str):
    import time
    for _ in range(2400):  # a bounded wait for a state, not a timing
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def test_a_plain_request_finishes_while_a_constrained_one_waits_for_its_grammar(tiny_llm, slow_compiles):
    """Before: LLM compiled under the engine lock, so the plain request waited for the whole compile."""
    import threading
    engine = tiny_llm.engine
    so = StructuredOutputsParams(regex="[0-9]{3}-slow-offline")
    results = {}
    constrained = threading.Thread(target=lambda: results.setdefault("constrained", tiny_llm.generate(
        ["Hi"], SamplingParams(max_tokens=32, temperature=0, structured_outputs=so), use_tqdm=False)))
    constrained.start()
    wait_for(lambda: engine.compiling, "the constrained request waits for its grammar")
    (request,) = engine.compiling.values()
    assert all(s.status.name == "WAITING_FOR_GRAMMAR" for s in request.seqs)
    done = threading.Event()
    threading.Thread(target=lambda: (results.setdefault("plain", tiny_llm.generate(
        ["Hello"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)), done.set())).start()
    assert done.wait(300), "the plain request waited for the constrained one's grammar"
    assert results["plain"][0].outputs[0].finish_reason == "length"
    assert constrained.is_alive() and engine.compiling and "constrained" not in results
    slow_compiles.set()
    constrained.join(300)
    out = results["constrained"][0]
    assert out.outputs[0].finish_reason == "stop" and re.fullmatch("[0-9]{3}-slow-offline", out.outputs[0].text)


def test_equal_constraints_in_flight_compile_once_and_an_abort_cancels_a_queued_compile(tiny_llm, slow_compiles):
    from minivllm.structured_output import COMPILE_WORKERS, MAX_COMPILES_IN_FLIGHT, GrammarCompilesBusy
    engine, backend = tiny_llm.engine, tiny_llm.engine.grammar_backend()
    p = [SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex=f"[a-z]+{i}-dedupe"))
         for i in range(MAX_COMPILES_IN_FLIGHT)]
    for i in (0, 0, 0):  # three requests, one constraint
        engine.add_request(f"same-{len(engine.compiling)}", "Hi", p[i])
    for i in range(1, MAX_COMPILES_IN_FLIGHT):
        engine.add_request(f"other-{i}", "Hi", p[i])
    wait_for(lambda: len(slow_compiles.calls) == COMPILE_WORKERS, "the workers took their compiles")
    with pytest.raises(GrammarCompilesBusy, match="MAX_COMPILES_IN_FLIGHT"):  # a flood is refused, not queued
        engine.add_request("one-too-many", "Hi", SamplingParams(structured_outputs=StructuredOutputsParams(
            regex="[a-z]+-too-many")))
    queued = engine.requests[f"other-{MAX_COMPILES_IN_FLIGHT - 1}"].grammar
    engine.abort_request(f"other-{MAX_COMPILES_IN_FLIGHT - 1}")
    assert queued.cancelled()  # nobody else waited and no worker had started it
    slow_compiles.set()
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(outputs) == 3 + MAX_COMPILES_IN_FLIGHT - 2 and all(o.error is None for o in outputs.values())
    assert len(slow_compiles.calls) == MAX_COMPILES_IN_FLIGHT - 1  # one for the three, none for the cancelled


def test_the_grammar_cache_is_bounded_by_bytes(tiny_llm, monkeypatch):
    from minivllm import structured_output
    backend = tiny_llm.engine.grammar_backend()
    one = backend.compile(StructuredOutputsParams(regex="[a-z]+-bytes-0")).memory_size_bytes
    assert one > 0
    monkeypatch.setattr(structured_output, "MAX_CACHED_GRAMMAR_BYTES", 3 * one)
    for i in range(1, 6):
        backend.compile(StructuredOutputsParams(regex=f"[a-z]+-bytes-{i}"))
        assert backend.cached_bytes <= 3 * one
    assert sum(size for _, size in backend._compiled.values()) == backend.cached_bytes


def test_a_compile_past_its_time_limit_ends_its_request_with_the_limits_error(tiny_llm, monkeypatch):
    """Real xgrammar: '.*' * 300 compiles for seconds (quadratic in its length); the limit here is 0.2 s."""
    backend = tiny_llm.engine.grammar_backend()
    monkeypatch.setattr(backend, "compile_timeout_s", 0.2)
    slow = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex=".*" * 300))
    bad, plain = tiny_llm.generate(["Hi", "Hi"], [slow, SamplingParams(max_tokens=4)], use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and plain.outputs[0].finish_reason == "length"
    assert "took longer to compile than the limit of 0.2 s (EngineConfig.structured_outputs_timeout_s)" in bad.error


# -- the masks filled while the forward runs (issue 71, item 9) ----------------------------------------------------
OVERLAP_CASES = {  # name: (engine options, how many prompts)
    "batch 1": ({}, 1),
    "batch 8, ends mid-batch": ({}, 8),
    "speculation": (SETTINGS["speculation"], 8),
}


def mixed_lengths(kind: str, n: int) -> list:
    """Requests that end at different steps: some cut by ``max_tokens``, the others where the grammar ends."""
    return [params(kind, max_tokens=6 + 5 * i) if i % 2 else params(kind) for i in range(n)]


@pytest.mark.parametrize("case", sorted(OVERLAP_CASES))
def test_the_overlapped_fill_gives_the_same_tokens_and_runs_while_the_forward_does(case, prompts):
    import threading
    options, n = OVERLAP_CASES[case]
    tokens, fill_threads = {}, {}
    for overlap in (False, True):
        llm = LLM("tiny-random", device="cpu", num_blocks=256, max_num_seqs=16, overlap_grammar_fill=overlap,
                  **options)
        masker, threads = llm.engine.runner.grammar_masker, set()
        real_fill = masker.fill
        masker.fill = lambda bitmask, rows: (threads.add(threading.current_thread().name), real_fill(bitmask, rows))[1]
        for kind in ("greedy", "sampled"):
            tokens[overlap, kind] = run_engine(llm, [(f"r{i}", ids, p) for i, (ids, p) in
                                                     enumerate(zip(prompts[:n], mixed_lengths(kind, n)))])
        fill_threads[overlap] = threads
        llm.shutdown()
    for kind in ("greedy", "sampled"):
        assert tokens[True, kind] == tokens[False, kind], kind
        assert_valid(texts(llm, {r: t for r, t in tokens[True, kind].items() if int(r[1:]) % 2 == 0}))
    assert fill_threads[False] == {"MainThread"}
    assert len(fill_threads[True]) == 1 and fill_threads[True] != {"MainThread"}  # one worker thread


def test_the_fill_runs_while_the_forward_runs_and_no_thread_outlives_shutdown(prompts):
    """Deterministic, no timing: the forward waits (bounded) for the fill to finish, the fill for the forward to
    start; only fills made during the forward can let both go on."""
    import threading
    before = set(threading.enumerate())  # other engines' fill threads (the module's) are not this one's
    llm = LLM("tiny-random", device="cpu", num_blocks=64, max_num_seqs=4, overlap_grammar_fill=True)
    runner = llm.engine.runner
    real_forward, real_fill = runner.forward_inputs, runner.grammar_masker.fill
    started, filled, met = threading.Event(), threading.Event(), []

    def forward(inputs, mark):
        started.set()
        met.append(filled.wait(60))  # a fill during this forward sets it
        filled.clear()
        return real_forward(inputs, mark)

    def fill(bitmask, rows):
        assert started.wait(60), "the forward never started while the fill waited for it"
        started.clear()
        index = real_fill(bitmask, rows)
        filled.set()
        return index

    runner.forward_inputs, runner.grammar_masker.fill = forward, fill
    out = run_engine(llm, [("r0", prompts[0], params("greedy", max_tokens=8))])
    assert len(out["r0"]) == 8 and met == [True] * 8
    fillers = [t for t in set(threading.enumerate()) - before if t.name.startswith("minivllm-grammar-fill")]
    assert len(fillers) == 1  # one worker thread, kept between steps
    llm.shutdown()
    assert not any(t.is_alive() for t in fillers)  # joined


class FailingFill:
    """A masker (minivllm's) whose fill fails from its third call on, on whichever thread it runs."""

    def __init__(self):
        from minivllm.sampler import MiniGrammarMasker
        self.masker, self.calls = MiniGrammarMasker(), 0

    def __getattr__(self, name):
        return getattr(self.masker, name)

    def fill(self, bitmask, rows):
        self.calls += 1
        if self.calls >= 3:
            raise RuntimeError("the fill broke")
        return self.masker.fill(bitmask, rows)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_error_in_the_fill_reaches_the_step_as_without_the_overlap(overlap):
    llm = LLM("tiny-random", device="cpu", num_blocks=64, max_num_seqs=4, overlap_grammar_fill=overlap)
    llm.engine.runner.grammar_masker = FailingFill()
    p = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z]{20}"))
    bad, plain = llm.generate(["Hi", "Hi"], [p, SamplingParams(temperature=0, max_tokens=8)], use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and bad.error == "RuntimeError: the fill broke", bad.error
    assert plain.outputs[0].finish_reason == "length"
    llm.shutdown()


def test_overlap_grammar_fill_is_validated_and_by_default_follows_the_rule(monkeypatch):
    from minivllm import model_runner
    from minivllm.config import EngineConfig
    with pytest.raises(ValueError, match="overlap_grammar_fill"):
        EngineConfig(model="tiny-random", overlap_grammar_fill="yes")
    cores = len(model_runner.os.sched_getaffinity(0))
    assert model_runner.overlap_helps(torch.device("cuda"))  # the device computes, this thread waits
    for threads, helps in ((cores, False), (max(1, cores - 1), cores > 1)):  # a core left free, or none
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        assert model_runner.overlap_helps(torch.device("cpu")) is helps
        llm = LLM("tiny-random", device="cpu", num_blocks=16, max_num_seqs=2)
        assert llm.engine.runner.overlap_grammar_fill is helps
