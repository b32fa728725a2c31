"""What vLLM users expect of SamplingParams: n samples sharing the prompt's blocks, stop strings, logprobs."""

import random

import pytest
import torch

from minivllm import LLM, SamplingParams

from helpers import greedy, stop_completed_by_last_token


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", block_size=4, num_blocks=128, max_num_seqs=8, device="cpu")


def test_n_greedy_samples_equal_one_greedy_sample(llm):
    one = llm.generate([[3, 4, 5, 6, 7]], greedy(9, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    many = llm.generate([[3, 4, 5, 6, 7]], SamplingParams(n=3, temperature=0, max_tokens=9, ignore_eos=True),
                        use_tqdm=False)[0]
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert all(c.token_ids == one.token_ids and c.text == one.text for c in many.outputs)


@pytest.mark.parametrize("prompt_len", [8, 10])  # the prompt fills its last block, or leaves it partly empty
def test_n_seeded_samples_share_the_prompt_blocks_and_equal_their_own_seeds(llm, prompt_len):
    prompt = list(range(40, 40 + prompt_len))
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    e = llm.engine
    e.add_request("n", prompt, params)
    used, outs = [], None
    while e.has_unfinished_requests():
        for out in e.step():
            outs = out
        e.check_invariants()
        used.append(e.stats().num_used_blocks)
    full, partial = prompt_len // 4, prompt_len % 4 != 0
    # after the fork: the full prompt blocks once, plus per sample its copied partial block and its new tokens' blocks
    assert used[1] <= full + 4 * (1 + partial)
    assert used[1] < 4 * -(-(prompt_len + 2) // 4)  # less than four separate copies of the prompt
    for i, completion in enumerate(outs.outputs):
        alone = SamplingParams(temperature=1.0, seed=7 + i, max_tokens=6, ignore_eos=True)
        assert completion.token_ids == llm.generate([prompt], alone, use_tqdm=False)[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in outs.outputs}) > 1  # different seeds, different samples
    assert e.stats().num_free_blocks == 128


def test_n_samples_in_a_pool_too_small_to_hold_them_together():
    small = LLM("tiny-random", block_size=4, num_blocks=8, max_num_seqs=2, device="cpu")
    params = SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True)
    out = small.generate([[9, 8, 7, 6, 5]], params, use_tqdm=False)[0]
    expected = small.generate([[9, 8, 7, 6, 5]], greedy(12, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    assert small.engine.stats().num_free_blocks == 8


def test_stop_strings_end_the_text_like_openai(llm):
    prompt = [11, 12, 13]
    full = llm.generate([prompt], greedy(16, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop = full.text[5:8]
    assert len(stop) == 3 and full.text.find(stop) == 5
    cut = llm.generate([prompt], greedy(16, ignore_eos=True, stop=[stop, "never appears"]), use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text[:5] and cut.finish_reason == "stop" and cut.stop_reason == stop
    assert full.token_ids[:len(cut.token_ids)] == cut.token_ids and len(cut.token_ids) < len(full.token_ids)
    kept = llm.generate([prompt], greedy(16, ignore_eos=True, stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:8]
    streamed = "".join(llm.stream(prompt, greedy(16, ignore_eos=True, stop=[stop])))
    assert streamed == cut.text  # the held-back characters never leak into the stream


def test_logprobs_are_the_models_log_probabilities(llm):
    prompt = [21, 22, 23, 24]
    out = llm.generate([prompt], greedy(5, ignore_eos=True, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    ids = prompt + out.token_ids
    reference = llm.engine.model.logits(ids).log_softmax(-1)
    for i, (token, step) in enumerate(zip(out.token_ids, out.logprobs)):
        row = reference[len(prompt) - 1 + i]
        assert step[token].rank == 1  # greedy: the sampled token is the most likely
        assert len(step) == 3 and sorted(lp.rank for lp in step.values()) == [1, 2, 3]
        top = row.topk(3)
        for value, tid in zip(top.values.tolist(), top.indices.tolist()):
            assert step[tid].logprob == pytest.approx(value, abs=1e-4)
            assert step[tid].decoded_token == llm.get_tokenizer().decode([tid])
    sampled = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=5, logprobs=0), use_tqdm=False)
    for token, step in zip(sampled[0].outputs[0].token_ids, sampled[0].outputs[0].logprobs):
        assert list(step) == [token] and step[token].rank >= 1
    assert llm.generate([prompt], greedy(2), use_tqdm=False)[0].outputs[0].logprobs is None


def test_stop_token_ids_report_the_stop_reason(llm):
    first = llm.generate([[1, 2, 3]], greedy(5, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate([[1, 2, 3]], greedy(5, ignore_eos=True, stop_token_ids=[first[2]]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == first[:3] and out.outputs[0].stop_reason == first[2]


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_with_stop(llm):
    prompt, k = [11, 12, 13], 6
    before, after = (llm.generate([prompt], greedy(n, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
                     for n in (k - 1, k))
    stop = stop_completed_by_last_token(before, after)
    for max_tokens in (k, k + 4):  # the k-th token is the last allowed one, or not: vLLM says "stop" either way
        out = llm.generate([prompt], greedy(max_tokens, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == ("stop", stop, k), max_tokens
        assert out.text == after[:len(after) - len(stop)]


# -- stop lists: bounded, and matched by one automaton (issue 52) ------------------------------------------------
def most_stop_strings(seed: int = 0) -> list[str]:
    """The largest stop list SamplingParams accepts: MAX_STOP_STRINGS strings, MAX_STOP_CHARS characters in all."""
    from minivllm.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

    rng, size = random.Random(seed), MAX_STOP_CHARS // MAX_STOP_STRINGS
    return ["".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(size)) for _ in range(MAX_STOP_STRINGS)]


@pytest.mark.parametrize("field, make, limit", [
    ("stop", lambda n: [f"s{i}" for i in range(n)], "MAX_STOP_STRINGS"),
    ("stop", lambda n: ["x" * (n - 1)], "MAX_STOP_CHARS"),
    ("stop_token_ids", lambda n: list(range(n)), "MAX_STOP_TOKEN_IDS"),
])
def test_stop_lists_past_the_limits_are_refused_naming_the_field(llm, field, make, limit):
    import minivllm.sampling_params as sp

    most = getattr(sp, limit)
    extra = 2 if limit == "MAX_STOP_CHARS" else 1
    SamplingParams(**{field: make(most + extra - 1)})  # the largest list accepted
    with pytest.raises(ValueError, match=rf"^{field} must .*at most {most}\b"):
        SamplingParams(**{field: make(most + extra)})
    params = SamplingParams()
    setattr(params, field, make(300_000))  # changed after it was made: refused again when the engine copies it
    with pytest.raises(ValueError, match=rf"^{field} must .*at most {most}\b"):
        llm.engine.add_request("too-many-stops", [1, 2, 3], params)
    assert not llm.engine.has_unfinished_requests()


def naive_first_stop(text: str, before: int, stops: list[str]):
    """What the engine used to do: search every stop string in the text from where a new one could start."""
    found = [(i, s) for s in stops if (i := text.find(s, max(0, before - len(s) + 1))) != -1]
    return min(found) if found else None


@pytest.mark.parametrize("seed", range(3))
def test_the_stop_automaton_finds_what_searching_every_stop_string_finds(seed):
    from minivllm.detokenizer import StopStrings

    rng = random.Random(seed)
    for _ in range(3000):
        alphabet = rng.choice(["ab", "abc", "aab "])
        stops = sorted({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
                        for _ in range(rng.randint(1, 8))})
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        matcher, node, pos = StopStrings(tuple(stops)), 0, 0
        while pos < len(text):
            chunk = text[pos:pos + rng.randint(1, 5)]
            want = naive_first_stop(text[:pos + len(chunk)], pos, stops)
            node, found = matcher.scan(node, chunk)
            assert (None if found is None else (pos + found[0], found[1])) == want, (stops, text, pos)
            if want is not None:
                break
            pos += len(chunk)


def test_the_largest_stop_list_ends_the_text_where_its_one_matching_string_does(llm):
    prompt = [11, 12, 13]
    full = llm.generate([prompt], greedy(16, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop = full.text[5:8]
    many = most_stop_strings()
    many[77] = stop  # one of them appears in the text; the rest never do
    for n in (1, 3):
        params = SamplingParams(n=n, temperature=0, max_tokens=16, ignore_eos=True, stop=many)
        for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs:
            assert (c.text, c.finish_reason, c.stop_reason) == (full.text[:5], "stop", stop)
    assert "".join(llm.stream(prompt, greedy(16, ignore_eos=True, stop=many))) == full.text[:5]
