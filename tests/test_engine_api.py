"""LLMEngine/LLM behaviour on the tiny model: validation, abort, streaming, stats, sampling."""

import math

import pytest

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.sequence import SequenceStatus as S

from helpers import greedy


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=128,
               max_model_len=200, device="cpu")


def _snapshot(engine):
    return (dict(engine.requests), list(engine.scheduler.waiting), list(engine.scheduler.running),
            engine.block_manager.num_free_blocks, engine.stats())


BAD = [
    (dict(prompt=[]), "at least one token"),
    (dict(prompt=[5, 10**6]), r"prompt token ids must be in \[0, 49152\)"),
    (dict(prompt=[5, -1]), "prompt token ids"),
    (dict(prompt=list(range(1, 190)), params=greedy(20)), "max_model_len"),
    (dict(prompt=list(range(1, 100)), params=greedy(102)), "max_model_len"),
    (dict(prompt=list(range(1, 151))), "max_num_batched_tokens"),
    (dict(request_id="busy"), "already in use"),
    (dict(request_id=""), "request_id"),
    (dict(prompt="hello", params="greedy"), "params must be a SamplingParams"),
    (dict(priority=1.5), "priority"),
]


@pytest.mark.parametrize("kwargs,match", BAD)
def test_bad_requests_are_refused_without_disturbing_anything(llm, kwargs, match):
    engine = llm.engine
    engine.add_request("busy", [1, 2, 3], greedy(30))
    engine.step()  # busy is running
    before = _snapshot(engine)
    args = dict(request_id="new", prompt=[1, 2, 3], params=greedy(4), priority=0) | kwargs
    with pytest.raises(ValueError, match=match):
        engine.add_request(args["request_id"], args["prompt"], args["params"], args["priority"])
    assert _snapshot(engine) == before
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.requests == {} and engine.block_manager.num_free_blocks == 64


def test_request_larger_than_the_pool_is_refused():
    small = LLM("tiny-random", block_size=4, num_blocks=8, device="cpu")
    with pytest.raises(ValueError, match="num_blocks is 8"):
        small.engine.add_request("r", list(range(1, 30)), greedy(4))  # 33 tokens -> 9 blocks
    assert not small.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=0), "block_size"), (dict(num_blocks=0), "num_blocks"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=2, max_num_seqs=4), "max_num_batched_tokens"),
    (dict(preemption_mode="drop"), "preemption_mode"), (dict(dtype="int8"), "dtype"),
    (dict(max_prefill_chunk_size=0), "max_prefill_chunk_size"), (dict(kv_cache_memory_fraction=0), "kv_cache_memory_fraction"),
])
def test_engine_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_max_num_seqs_defaults_to_64_capped_by_the_token_budget():
    """Unset, it is 64 (measured, chapter 12), or the token budget if that is smaller; a given value is kept."""
    assert EngineConfig().max_num_seqs == 64
    assert EngineConfig(max_num_batched_tokens=16).max_num_seqs == 16
    assert EngineConfig(max_num_seqs=8, max_num_batched_tokens=16).max_num_seqs == 8
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must be an integer >= max_num_seqs \(32\)"):
        EngineConfig(max_num_seqs=32, max_num_batched_tokens=16)


def test_unknown_llm_option_is_refused():
    with pytest.raises(ValueError, match="unknown engine options"):
        LLM("tiny-random", blok_size=16)


def test_abort_from_each_state_frees_everything():
    llm = LLM("tiny-random", block_size=4, num_blocks=64, max_num_seqs=2, enable_chunked_prefill=True,
              max_prefill_chunk_size=8, device="cpu")
    e = llm.engine
    e.add_request("run", [1, 2, 3], greedy(50))
    e.add_request("pre", list(range(10, 50)), greedy(5))
    e.add_request("wait", [7, 8, 9], greedy(5))
    e.step(), e.step()
    states = {rid: e.requests[rid].seqs[0].status for rid in ("run", "pre", "wait")}
    assert states == {"run": S.RUNNING, "pre": S.PREFILLING, "wait": S.WAITING}
    for rid in ("pre", "run", "wait"):
        e.abort_request(rid)
        e.check_invariants()
    assert not e.has_unfinished_requests() and e.block_manager.num_free_blocks == 64
    e.abort_request("never-existed")  # harmless


def test_step_outputs_stream_deltas_and_metrics(llm):
    e = llm.engine
    prompt = llm.get_tokenizer()("Once upon a time")["input_ids"]
    e.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    deltas, tokens, last = [], [], None
    while e.has_unfinished_requests():
        for out in e.step():
            deltas.append(out.outputs[0].delta_text)
            tokens += out.outputs[0].delta_token_ids
            last = out
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert tokens == last.outputs[0].token_ids and len(tokens) == 6
    assert "".join(deltas) == last.outputs[0].text == llm.get_tokenizer().decode(tokens, skip_special_tokens=True)
    m = last.metrics
    assert m.num_prompt_tokens == len(prompt) and m.num_output_tokens == 6 and len(m.token_times) == 6
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time


def test_stream_yields_the_generated_text(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    pieces = list(llm.stream("Hello there", params))
    assert "".join(pieces) == llm.generate("Hello there", params, use_tqdm=False)[0].outputs[0].text


def test_seeded_sampling_is_independent_of_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate([[9, 9], [5, 6, 7], list(range(20, 40))],
                         [SamplingParams(temperature=1.0, max_tokens=9), params, greedy(5)], use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone
    other = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=4321, ignore_eos=True)
    assert llm.generate([[5, 6, 7]], other, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stats_snapshot(llm):
    e = llm.engine
    for i in range(6):
        e.add_request(f"q{i}", [i + 1, 2, 3], greedy(3))
    st = e.stats()
    assert (st.num_waiting, st.num_running, st.num_free_blocks, st.num_total_blocks) == (6, 0, 64, 64)
    e.step()
    st = e.stats()
    assert st.num_running == 4 and st.num_waiting == 2 and st.num_free_blocks < 64
    while e.has_unfinished_requests():
        e.step()
    assert e.stats().num_free_blocks == 64


def test_generate_accepts_strings_and_ids_in_order(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(["a b c", tok("x y")["input_ids"]], greedy(3), use_tqdm=False)
    assert outs[0].prompt == "a b c" and outs[1].prompt_token_ids == tok("x y")["input_ids"]


def test_chat_renders_each_conversation_with_the_chat_template(llm):
    """LLM.chat, as vLLM's: one conversation or a list of them, each rendered by the model's chat template up to
    where the assistant's reply starts, then generated as those token ids."""
    tok = llm.get_tokenizer()
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    brief = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    outs = llm.chat([question, brief], greedy(5), use_tqdm=False)
    for out, conversation in zip(outs, (question, brief)):
        text = tok.decode(out.prompt_token_ids)
        assert all(m["content"] in text for m in conversation) and text.endswith("<|im_start|>assistant\n"), text
    want = llm.generate([out.prompt_token_ids for out in outs], greedy(5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in want]
    (one,) = llm.chat(question, greedy(5), use_tqdm=False)  # one conversation alone
    assert one.prompt_token_ids == outs[0].prompt_token_ids
    (more,) = llm.chat(question + [{"role": "assistant", "content": "The answer is"}], greedy(2), use_tqdm=False,
                       add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(more.prompt_token_ids).endswith("The answer is")  # the reply goes on from there


@pytest.mark.parametrize("messages,kwargs,match", [
    ("Hi!", {}, "messages must be a conversation"),
    ([], {}, "messages must be a conversation"),
    ([{"role": "user"}], {}, r"messages\[0\] must be a dict with a 'role' and a 'content'"),
    ([[{"role": "user", "content": "a"}], []], {}, r"messages\[1\] must be a non-empty list"),
    ([[{"role": "user", "content": "a"}], [{"role": "user", "content": "\ud800"}]], {}, r"messages\[1\]\[0\]"),
    ([{"role": "user", "content": "a"}], dict(continue_final_message=True), "continue_final_message"),
    ([{"role": "user", "content": "a"}], dict(chat_template=3), "chat_template"),
])
def test_chat_refuses_bad_messages_naming_them_before_queueing_anything(llm, messages, kwargs, match):
    before = _snapshot(llm.engine)
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, greedy(2), use_tqdm=False, **kwargs)
    assert _snapshot(llm.engine) == before


def test_the_readmes_first_example_prints_a_sensible_answer(capsys):
    """The first Python block of the README (a chat with the embedded SmolLM2) runs and answers its question."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = re.search(r"## Use the engine\n.*?```python\n(.*?)```", readme, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    assert "Paris" in capsys.readouterr().out
