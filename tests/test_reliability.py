"""No hang, no poisoned engine, no lost output, no silent corruption: each class a hostile user found, as tests."""

import threading

import pytest

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.sampler import MiniSampler

from helpers import greedy, run_engine

TINY = dict(device="cpu")


def drive(engine, arrivals=(), max_steps=2000):
    """Step until done (requests ``(step, id, prompt, params)`` join on time); fails instead of hanging."""
    pending = sorted(arrivals, key=lambda a: a[0])
    outs, step = {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        engine.check_invariants()
        step += 1
        assert step < max_steps, f"no progress after {max_steps} steps: {engine.stats()}"
    return outs, step


@pytest.fixture(scope="module")
def alone():
    """The oracle: each request in an engine of its own with room to spare."""
    llm = LLM("tiny-random", block_size=4, num_blocks=256, **TINY)
    return lambda prompt, params: llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


# -- 1. progress is guaranteed -------------------------------------------------------------------
def test_recompute_without_chunked_prefill_finishes(alone):
    """A preempted request must recompute prompt + output (38 tokens) with a 16-token budget: it is chunked."""
    llm = LLM("tiny-random", block_size=4, num_blocks=10, max_num_seqs=2, max_num_batched_tokens=16, **TINY)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = {"a": list(range(100, 108)), "b": list(range(200, 208))}
    outs, steps = drive(llm.engine, [(0, rid, p, params) for rid, p in prompts.items()], max_steps=500)
    assert llm.engine.stats().num_preemptions > 0
    assert outs == {rid: alone(p, params) for rid, p in prompts.items()}


def test_protection_never_makes_the_head_preempt_itself(alone):
    """Chunked prefill + protection: 1,495 preemptions in 3,000 steps before; now it finishes like guard-off."""
    config = dict(block_size=5, num_blocks=14, max_num_seqs=5, max_num_batched_tokens=38, enable_chunked_prefill=True,
                  max_prefill_chunk_size=15, **TINY)
    arrivals = [(0, "a", list(range(1, 18)), greedy(17, ignore_eos=True)),
                (4, "b", list(range(100, 140)), greedy(19, ignore_eos=True)),
                (6, "c", list(range(200, 238)), greedy(25, ignore_eos=True))]
    results = {}
    for protection in (4, 0):
        llm = LLM("tiny-random", preemption_protection_steps=protection, **config)
        outs, steps = drive(llm.engine, arrivals, max_steps=400)
        results[protection] = (steps, llm.engine.stats().num_preemptions)
        assert outs == {rid: alone(p, sp) for _, rid, p, sp in arrivals}
    (guarded_steps, guarded_preemptions), (free_steps, _) = results[4], results[0]
    assert guarded_steps <= 2 * free_steps and guarded_preemptions < 20, results


# -- 2. validation covers everything step() will use ----------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", block_size=4, num_blocks=64, max_num_seqs=4, **TINY)


BAD_PARAMS = [
    (dict(top_k=2**63), "top_k"), (dict(top_k=49153), "top_k"), (dict(seed=2**64), "seed"), (dict(seed=-1), "seed"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature="0.5"), "temperature"),
    (dict(stop_token_ids=5), "stop_token_ids"), (dict(stop_token_ids=[2**40]), "stop_token_ids"),
    (dict(stop=3), "stop"), (dict(stop=[""]), "stop"), (dict(n=0), "n"), (dict(logprobs=21), "logprobs"),
    (dict(max_tokens=2.0), "max_tokens"), (dict(ignore_eos="yes"), "ignore_eos"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS)
def test_bad_sampling_params_are_refused_naming_the_field(llm, kwargs, field):
    try:
        params = SamplingParams(**kwargs)  # refused here, or (top_k above the vocabulary) at add_request
    except ValueError as e:
        assert field in str(e)
        return
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request("bad", [1, 2, 3], params)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs,field", [(dict(priority=10**400), "priority"), (dict(priority=float("nan")), "priority"),
                                          (dict(priority=1.5), "priority"), (dict(arrival_time="now"), "arrival_time"),
                                          (dict(arrival_time=float("inf")), "arrival_time")])
def test_bad_priority_or_arrival_time_is_refused(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request("bad", [1, 2, 3], greedy(3), **kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_a_temperature_too_small_to_divide_by_is_greedy(llm):
    """1e-39 overflowed float32 logits and poisoned the engine; below 1e-5 it now samples greedily (vLLM's rule)."""
    tiny_t = llm.generate([[5, 6, 7]], SamplingParams(temperature=1e-39, max_tokens=8), use_tqdm=False)[0]
    assert tiny_t.outputs[0].token_ids == llm.generate([[5, 6, 7]], greedy(8), use_tqdm=False)[0].outputs[0].token_ids


def test_params_changed_after_add_request_change_nothing(llm, alone):
    params = greedy(6, ignore_eos=True)
    llm.engine.add_request("p", [4, 5, 6], params)
    params.temperature, params.max_tokens, params.top_k = -1.0, 10**9, 2**63  # bypasses validation
    outs, _ = drive(llm.engine)
    assert outs == {"p": alone([4, 5, 6], greedy(6, ignore_eos=True))}
    with pytest.raises(ValueError, match="temperature"):  # and the changed object is checked again if reused
        llm.engine.add_request("again", [1, 2], params)


def test_generate_is_all_or_nothing(llm):
    with pytest.raises(ValueError, match="prompt token ids"):
        llm.generate([[1, 2, 3], [1, 10**7]], greedy(4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats().num_free_blocks == 64
    out = llm.generate([[1, 2, 3]], greedy(4), use_tqdm=False)  # nothing stale comes back
    assert len(out) == 1 and out[0].prompt_token_ids == [1, 2, 3]


def test_an_interrupted_generate_leaves_nothing_behind(llm, monkeypatch, alone):
    runner, calls = llm.engine.runner, []
    real_run = runner.run

    def interrupted(chunks, clock=None):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_run(chunks, clock)

    monkeypatch.setattr(runner, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3], [4, 5, 6, 7]], greedy(10, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats().num_free_blocks == 64
    llm.engine.check_invariants()
    assert llm.generate([[8, 9]], greedy(5, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids == \
        alone([8, 9], greedy(5, ignore_eos=True))


# -- 3. isolation: one failing request, the others go on -----------------------------------------
class FussySampler(MiniSampler):
    """Fails any batch holding a row with temperature 0.7, as a broken sampler for one request would."""

    def __call__(self, logits, params, generators):
        if any(p.temperature == 0.7 for p in params):
            raise RuntimeError("cannot sample at 0.7")
        return super().__call__(logits, params, generators)


def test_a_request_failing_inside_step_ends_alone(alone):
    llm = LLM("tiny-random", block_size=4, num_blocks=64, sampler=FussySampler, **TINY)
    e = llm.engine
    good = {f"g{i}": ([10 + i, 20, 30], greedy(6, ignore_eos=True)) for i in range(3)}
    for rid, (p, sp) in good.items():
        e.add_request(rid, p, sp)
    e.add_request("bad", [7, 8, 9], SamplingParams(temperature=0.7, max_tokens=6))
    finished = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                finished[out.request_id] = out
        e.check_invariants()
    assert finished["bad"].outputs[0].finish_reason == "error" and "cannot sample" in finished["bad"].error
    assert {rid: finished[rid].outputs[0].token_ids for rid in good} == {rid: alone(*good[rid]) for rid in good}
    assert e.stats().num_free_blocks == 64 and e.stats().num_failed_requests == 1
    assert llm.generate([[1, 2]], greedy(3), use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_a_request_whose_params_break_in_the_sampler_fails_alone(llm, alone):
    """NaN slipped into the engine's own copy (past validation): multinomial raises for that row only."""
    e = llm.engine
    e.add_request("ok", [3, 4, 5], greedy(5, ignore_eos=True))
    e.add_request("nan", [6, 7, 8], SamplingParams(temperature=1.0, max_tokens=5))
    e.requests["nan"].seqs[0].params.temperature = float("nan")
    outs, _ = drive(e)
    assert outs["ok"] == alone([3, 4, 5], greedy(5, ignore_eos=True)) and outs["nan"] == []
    assert e.stats().num_free_blocks == 64


# -- 4. and 5. one owner per output; threads ----------------------------------------------------
def test_interleaved_streams_keep_every_delta(llm):
    params = greedy(12, ignore_eos=True)
    expected = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].text for p in ("Hello", "Good morning")]
    a, b = llm.stream("Hello", params), llm.stream("Good morning", params)
    texts, live = ["", ""], [a, b]
    while live:
        for i, s in enumerate((a, b)):
            if s in live:
                try:
                    texts[i] += next(s)
                except StopIteration:
                    live.remove(s)
    assert texts == expected


def test_generate_during_a_stream_and_direct_requests_keep_their_outputs(llm):
    params = greedy(10, ignore_eos=True)
    expected_stream = llm.generate(["Once"], params, use_tqdm=False)[0].outputs[0].text
    expected_direct = llm.generate([[9, 8, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    e = llm.engine
    e.add_request("direct", [9, 8, 7], params)
    stream = llm.stream("Once", params)
    text = next(stream)
    llm.generate([[1, 2, 3, 4]], greedy(20, ignore_eos=True), use_tqdm=False)  # runs the stream's request to the end
    text += "".join(stream)
    assert text == expected_stream
    tokens = []
    while e.has_unfinished_requests():
        for out in e.step():
            assert out.request_id == "direct"
            tokens += out.outputs[0].delta_token_ids
    assert tokens == expected_direct


@pytest.mark.parametrize("trial", range(3))
def test_two_threads_on_one_llm_get_their_own_correct_tokens(llm, trial):
    prompts = {t: [[100 * t + i, 7, 8 + i] for i in range(5)] for t in range(2)}
    params = greedy(8 + trial, ignore_eos=True)
    expected = {t: [o.outputs[0].token_ids for o in llm.generate(prompts[t], params, use_tqdm=False)] for t in prompts}
    got, errors = {}, []

    def worker(t):
        try:
            got[t] = [o.outputs[0].token_ids for o in llm.generate(prompts[t], params, use_tqdm=False)]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in prompts]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors and got == expected
    llm.engine.check_invariants()
    assert llm.engine.stats().num_free_blocks == 64


def test_threads_mixing_streams_and_generate_calls_keep_their_tokens(llm):
    params = greedy(9, ignore_eos=True)
    prompts = ["One", "Two", [7, 7, 7], [8, 8]]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    got = {}

    def streamer(i):
        got[i] = "".join(llm.stream(prompts[i], params))

    def generator(i):
        got[i] = llm.generate([prompts[i]], params, use_tqdm=False)[0].outputs[0].text

    threads = [threading.Thread(target=f, args=(i,)) for i, f in enumerate([streamer, generator, streamer, generator])]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert [got.get(i) for i in range(4)] == expected
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats().num_free_blocks == 64


# -- 6. vLLM's prompt forms ------------------------------------------------------------------------
def test_prompt_forms(llm):
    tok = llm.get_tokenizer()
    ids = tok("a b c")["input_ids"]
    by_form = [llm.generate(p, greedy(4), use_tqdm=False)[0].outputs[0].token_ids
               for p in ("a b c", ids, {"prompt": "a b c"}, {"prompt_token_ids": ids}, [{"prompt_token_ids": ids}])]
    assert all(x == by_form[0] for x in by_form)
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(2), use_tqdm=False)[0].prompt_token_ids == [5, 6, 7]
    assert len(llm.generate(["x", [5, 6], {"prompt": "y"}], greedy(2), use_tqdm=False)) == 3


@pytest.mark.parametrize("prompts", [None, {"a b", "c d"}, [], {"text": "x"}, {"prompt": "a", "prompt_token_ids": [1]},
                                     [[1, 2], "x", 5], 42, [1.5, 2]])
def test_other_prompt_forms_are_refused(llm, prompts):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompts, greedy(2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def nested(depth: int) -> dict:
    prompt = {"prompt": "x"}
    for _ in range(depth):
        prompt = {"prompt": prompt}
    return prompt


@pytest.mark.parametrize("prompt, field, words", [
    ("a\ud800b", "prompt", "lone UTF-16 surrogate"),  # before: the tokenizer's TypeError
    ({"prompt": "\udcff"}, "prompt", "lone UTF-16 surrogate"),
    ({"prompt_token_ids": "abc"}, "prompt_token_ids", "list of token ids"),  # before: accepted as text
    ({"prompt": [1, 2, 3]}, "prompt", "text under"),  # before: accepted as token ids
    (nested(3), "prompt", "text under"),  # before: accepted, the inner dict parsed in turn
    (nested(5000), "prompt", "text under"),  # before: RecursionError
    ([nested(5000)], "prompt", ""),  # generate: a list of one prompt; add_request: not a list of token ids
], ids=["surrogate", "surrogate-in-dict", "ids-as-text", "text-as-ids", "nested", "nested-5000", "nested-in-list"])
def test_a_prompt_of_the_wrong_kind_is_a_value_error_naming_its_field(llm, prompt, field, words):
    for call in (lambda: llm.generate(prompt, greedy(2), use_tqdm=False),
                 lambda: llm.engine.add_request("bad-prompt", prompt, greedy(2))):
        with pytest.raises(ValueError, match=rf"^{field} must .*{words}") as refused:
            call()
        assert len(str(refused.value)) < 300  # the prompt is not echoed back whole
    assert not llm.engine.has_unfinished_requests()


# -- 7. the smaller ones -------------------------------------------------------------------------
def test_prefix_cache_hit_rate_stays_a_rate_after_recompute():
    llm = LLM("tiny-random", block_size=4, num_blocks=12, max_num_seqs=3, enable_prefix_caching=True, **TINY)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9] + [10 + i] for i in range(3)]
    run_engine(llm, [(f"r{i}", p, greedy(20, ignore_eos=True)) for i, p in enumerate(prompts)])
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and 0 < stats.prefix_cache_hit_rate <= 1
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries


@pytest.mark.parametrize("kwargs,field", [(dict(device="cuda"), "device"), (dict(device="tpu"), "device"),
                                          (dict(seed=-1), "seed"), (dict(scheduler_cls="no.such.Scheduler"), "scheduler_cls"),
                                          (dict(sampler=42), "sampler")])
def test_engine_config_refuses_what_cannot_run_here(kwargs, field):
    if kwargs.get("device") == "cuda":
        pytest.importorskip("torch").cuda.is_available() and pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="tiny-random", **kwargs)


def test_max_model_len_above_the_model_is_refused():
    with pytest.raises(ValueError, match="max_model_len"):
        LLM("tiny-random", max_model_len=10**6, num_blocks=8, **TINY)
