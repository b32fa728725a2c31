"""The OpenAI-compatible server, over HTTP, with the official client (chapter 13).

One real server (``python -m minivllm serve``, SmolLM2, on 127.0.0.1 and a free
port) answers every test here; each compares what it sends with the offline
engine (``LLM.generate``) on the same weights. The load, shutdown, backpressure
and failure tests run their own servers (test_serving_load.py).
"""

import json

import httpx
import openai
import pytest

from minivllm import LLM, SamplingParams
from minivllm.bench import ServerProcess
from minivllm.simple_generation import chat_prompt_ids

from serving_helpers import client, idle, metrics, sse_events, wait_until

MODEL = "smollm2-135m"
ENGINE = ("--max-num-seqs", "8", "--num-blocks", "512", "--enable-prefix-caching")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "My favourite fruit is"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess.minivllm("--model", MODEL, *ENGINE) as s:
        yield s
    assert s.returncode == 0, s.log()[-3000:]
    assert "Traceback" not in s.log(), s.log()[-3000:]


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, max_num_seqs=8, num_blocks=512, enable_prefix_caching=True, device="cpu")


@pytest.fixture(scope="module")
def api(server):
    return client(server)


def reference(offline, prompt, **params) -> object:
    return offline.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def stream_text(chunks, field="text"):
    """The joined text of a stream and every finish_reason it sent (choice 0)."""
    text, reasons = [], []
    for chunk in chunks:
        for c in chunk.choices:
            piece = c.text if field == "text" else c.delta.content
            text.append(piece or "")
            reasons += [c.finish_reason] if c.finish_reason else []
    return "".join(text), reasons


def test_greedy_streamed_equals_non_streamed_equals_offline(api, offline):
    for prompt in PROMPTS:
        want = reference(offline, prompt, temperature=0.0, max_tokens=16)
        whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        streamed, reasons = stream_text(api.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                                               temperature=0, stream=True))
        assert whole.choices[0].text == streamed == want.text, prompt
        assert reasons == [whole.choices[0].finish_reason] == [want.finish_reason]  # exactly one finish_reason
        assert whole.usage.completion_tokens == len(want.token_ids)


def test_chat_uses_the_chat_template(api, offline):
    message = "Name three colours."
    want = reference(offline, {"prompt_token_ids": chat_prompt_ids(offline.get_tokenizer(), message)},
                     temperature=0.0, max_tokens=20)
    messages = [{"role": "user", "content": message}]
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0)
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                              stream=True))
    streamed, reasons = stream_text(chunks, "delta")
    assert whole.choices[0].message.content == streamed == want.text
    assert whole.choices[0].message.role == "assistant" and chunks[0].choices[0].delta.role == "assistant"
    assert reasons == [want.finish_reason]
    assert whole.usage.prompt_tokens == len(chat_prompt_ids(offline.get_tokenizer(), message))


def test_usage_adds_up_and_counts_cached_prompt_tokens(api, offline):
    prompt = "Paged attention stores the keys and values of every sequence in fixed-size blocks. " * 3
    n_prompt = len(offline.get_tokenizer()(prompt)["input_ids"])
    first = api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    again = api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    for r in (first, again):
        u = r.usage
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (n_prompt, 8, n_prompt + 8)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < n_prompt and cached % 16 == 0  # whole blocks of the first request's prompt
    assert again.choices[0].text == first.choices[0].text  # the cache changes the cost, never the answer

    chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == n_prompt + 8
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == first.choices[0].text


def test_stop_strings_end_the_text_where_openai_would(api, offline):
    prompt = PROMPTS[2]
    full = reference(offline, prompt, temperature=0.0, max_tokens=24).text
    stop = full.split()[len(full.split()) // 2]  # a word from the middle
    cut = full.index(stop)
    for stream in (False, True):
        r = api.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                   stream=stream)
        text, reasons = stream_text(r) if stream else (r.choices[0].text, [r.choices[0].finish_reason])
        assert text == full[:cut] and reasons == ["stop"], (stop, text)
    kept = api.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                  extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:cut + len(stop)]


def test_n_seeded_samples_and_logprobs_match_the_offline_engine(api, offline):
    prompt = PROMPTS[0]
    want = offline.generate([prompt], SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8),
                            use_tqdm=False)[0].outputs
    got = api.completions.create(model=MODEL, prompt=prompt, n=2, temperature=0.8, seed=7, max_tokens=8)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [w.text for w in want]
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)

    greedy = reference(offline, prompt, temperature=0.0, max_tokens=5, logprobs=3)
    r = api.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=5, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([step[t].logprob for t, step in zip(greedy.token_ids, greedy.logprobs)],
                                              abs=1e-4)
    assert all(len(top) == 3 and max(top.values()) == pytest.approx(v, abs=1e-4)  # greedy: the top one is chosen
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 3
    assert all(len(e.top_logprobs) == 2 for e in chat.choices[0].logprobs.content)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]}}}
PERSON = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 150}}}


def test_response_format_gives_json_valid_against_the_schema_as_the_offline_engine(api, offline):
    import jsonschema

    from minivllm import StructuredOutputsParams

    message = "Describe a person as JSON with their name and age."
    want = reference(offline, {"prompt_token_ids": chat_prompt_ids(offline.get_tokenizer(), message)},
                     temperature=0.0, max_tokens=40,
                     structured_outputs=StructuredOutputsParams(json=PERSON, disable_any_whitespace=True))
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": message}], max_tokens=40,
                                    temperature=0, response_format=fmt)
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(want.text), PERSON)
    for seed in range(3):  # sampled too
        r = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": message}], max_tokens=40,
                                        temperature=1.0, seed=seed, response_format=fmt)
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    mode = api.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=12, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert mode.choices[0].text.startswith("{")
    choice = api.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=4, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")


def streamed_calls(chunks) -> tuple[dict[int, dict], list[str]]:
    """Tool calls put together from their stream deltas (as a client does), and the finish reasons."""
    calls, reasons = {}, []
    for chunk in chunks:
        for c in chunk.choices:
            reasons += [c.finish_reason] if c.finish_reason else []
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] = (d.function.name if d.function else None) or call["name"]
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    return calls, reasons


def test_tool_calls_named_and_required_come_back_as_tool_calls_streamed_or_not(api):
    import jsonschema

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0, tools=[WEATHER, TIME])
    r = api.chat.completions.create(tool_choice=named, **kwargs)
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert r.choices[0].finish_reason == "stop"
    calls, reasons = streamed_calls(api.chat.completions.create(tool_choice=named, stream=True, **kwargs))
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert calls[0]["arguments"] == call.function.arguments and reasons == ["stop"]

    r = api.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kwargs)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    calls, reasons = streamed_calls(api.chat.completions.create(tool_choice="required", parallel_tool_calls=False,
                                                                stream=True, **kwargs))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]
    assert reasons == ["tool_calls"]


COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
BAD = [  # (path, body, the param the 400 names)
    ("/v1/completions", {**COMPLETION, "temperature": -1}, "temperature"),
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**COMPLETION, "top_p": 0}, "top_p"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 9000}, "max_tokens"),  # prompt + max_tokens over the context
    ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [49152]}, "prompt"),  # a token id outside the vocabulary
    ("/v1/completions", {**COMPLETION, "prompt": ["a", "b"]}, "prompt"),  # batches are not supported
    ("/v1/completions", {**COMPLETION, "model": "gpt-4o"}, "model"),
    ("/v1/completions", {**COMPLETION, "max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "n": 0}, "n"),
    ("/v1/completions", {**COMPLETION, "seed": -1}, "seed"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "logprobs": 50}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {**COMPLETION, "temprature": 0.5}, "temprature"),  # a typo: unknown fields are refused
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", [1, 2], None),  # not an object
    ("/v1/completions", b'{"prompt": "Hello",', None),  # malformed JSON
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [WEATHER]}, "tool_choice"),  # "auto", the default: refused
    ("/v1/chat/completions", {**CHAT, "tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),  # no tools
    ("/v1/chat/completions", {**CHAT, "tools": [WEATHER],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objec"}}}], "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "objec"}}}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"},
                              "tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ("/v1/completions", {**COMPLETION, "response_format": {"type": "json_object"},
                         "structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regexp": "[0-9]+"}}, "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"choice": "yes"}}, "structured_outputs"),
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/detokenize", {"model": MODEL, "tokens": [-5]}, "tokens"),
]


def post(server, path, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    return httpx.post(server.url + path, json=body, timeout=30)


def test_bad_input_is_a_400_naming_the_parameter_and_disturbs_nothing(server, api, offline):
    want = reference(offline, PROMPTS[1], temperature=0.0, max_tokens=32)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 32, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as running:
        lines = running.iter_lines()
        head = [next(lines) for _ in range(4)]  # the stream is under way
        for path, bad, param in BAD:
            r = post(server, path, bad)
            assert r.status_code == 400, (path, bad, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            assert error["param"] == param, (bad, error)
            assert error["message"] and (param is None or param in error["message"]), error
        events = sse_events(head + list(lines))
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want.text  # the running stream never noticed
    with pytest.raises(openai.BadRequestError) as e:  # what the official client shows
        api.completions.create(model=MODEL, prompt="Hi", temperature=-0.5)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    ok = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    assert ok.choices[0].text == reference(offline, PROMPTS[0], temperature=0.0, max_tokens=6).text


def test_models_health_tokenize_detokenize(server, offline):
    tok = offline.get_tokenizer()
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["object"] == "list"
    assert httpx.get(server.url + "/health").status_code == 200
    ids = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert ids["tokens"] == tok("Hello world")["input_ids"] and ids["count"] == len(ids["tokens"])
    assert post(server, "/detokenize", {"tokens": ids["tokens"]}).json() == {"prompt": "Hello world"}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == chat_prompt_ids(tok, "Hi")
    assert post(server, "/nowhere", {}).json()["error"]["type"] == "not_found_error"


def test_metrics_carry_vllm_names_and_count_requests(server, api):
    before = metrics(server)
    api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    after = metrics(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total",
                 "vllm:generation_tokens_total", "vllm:prompt_tokens_total"):
        assert name in after, name
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"] + 1
    assert after["vllm:time_to_first_token_seconds_count"] == before["vllm:time_to_first_token_seconds_count"] + 1
    assert after["vllm:inter_token_latency_seconds_count"] == before["vllm:inter_token_latency_seconds_count"] + 4
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"] + 5
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    assert wait_until(lambda: idle(server))


def test_a_client_that_disconnects_aborts_its_request_and_frees_its_blocks(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    aborted = metrics(server)["minivllm:requests_aborted_total"]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        [next(lines) for _ in range(6)]
        assert metrics(server)["minivllm:kv_cache_used_blocks"] > 0
    assert wait_until(lambda: idle(server), 10), metrics(server)  # 4,000 tokens would take minutes
    with pytest.raises(httpx.ReadTimeout):  # not streaming: the client gives up waiting
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.5)
    assert wait_until(lambda: idle(server), 10), metrics(server)
    assert metrics(server)["minivllm:requests_aborted_total"] == aborted + 2
