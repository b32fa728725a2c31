"""The server under hostile or unlucky input: a 4xx, never a 500, a dropped connection or a stalled loop (chapter 13).

One tiny-random server (nothing here depends on the model) with a 2 MB body
limit: lone UTF-16 surrogates are a 400 naming the field, a body over the limit
is a 413 before anything parses it (with a Content-Length or chunked), too many
chat messages are a 400, ``/health`` answers while a long prompt is tokenized,
and a stop string completed by the last allowed token finishes with "stop". The
last tests run the app in this process to break it on purpose mid-stream.
"""

import json
import re
import socket
import threading
import time

import httpx
import pytest

from minivllm.bench import ServerProcess
from minivllm.serving.protocol import MAX_CHAT_MESSAGES

from helpers import dead_end_after, stop_completed_by_last_token
from serving_helpers import sse_events

LIMIT = 2_000_000
READ_TIMEOUT = 3  # seconds for a request's head, then as many for its body


@pytest.fixture(scope="module")
def server():
    with ServerProcess.minivllm("--model", "tiny-random", "--num-blocks", "256", "--max-request-bytes",
                                str(LIMIT), "--read-timeout", str(READ_TIMEOUT)) as s:
        yield s
    assert s.returncode == 0, s.log()[-3000:]
    assert "Traceback" not in s.log(), s.log()[-3000:]


def post(server, path, body: bytes | dict, **kwargs) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(server.url + path, json=body, timeout=120, **kwargs)
    return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=120,
                      **kwargs)


USER = '[{"role": "user", "content": "Hi"}]'
SURROGATES = [  # (path, the JSON text, with a lone surrogate escaped as \\udXXX, the param the 400 names)
    ("/v1/completions", r'{"prompt": "\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", r'{"prompt": ["ok \udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", r'{"prompt": "Hi", "stop": ["\ud800"], "max_tokens": 2}', "stop"),
    ("/v1/completions", r'{"model": "\ud800", "prompt": "Hi", "max_tokens": 2}', "model"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 2}', "messages"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}',
     "messages"),
    ("/v1/chat/completions", r'{"model": "\udbff", "messages": ' + USER + "}", "model"),
    ("/tokenize", r'{"prompt": "\ud800"}', "prompt"),
    ("/tokenize", r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages"),
    ("/tokenize", r'{"model": "\ud800", "prompt": "Hi"}', "model"),
    ("/detokenize", r'{"model": "\ud800", "tokens": [1, 2]}', "model"),
]


def test_lone_surrogates_are_a_400_naming_the_field(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:  # one connection: a 500 used to drop it
        for path, text, param in SURROGATES:
            r = http.post(path, content=text.encode(), headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, text, r.text)
            error = r.json()["error"]
            assert error["param"] == param and param in error["message"] and "surrogate" in error["message"], error
        pair = http.post("/v1/completions", content=rb'{"prompt": "\ud83d\ude00", "max_tokens": 2}',
                         headers={"content-type": "application/json"})  # a valid pair is one character: fine
        assert pair.status_code == 200, pair.text


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(server):
    body = b'{"prompt": "' + b"x" * LIMIT  # over the limit, and not even JSON: nothing may parse it
    halves = [body[:LIMIT // 2], body[LIMIT // 2:]]
    for content in (body, iter(halves)):  # with a Content-Length, then chunked (no length)
        r = httpx.post(server.url + "/v1/completions", content=content, timeout=120,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert f"{LIMIT} bytes" in error["message"] and "--max-request-bytes" in error["message"], error
    assert post(server, "/tokenize", {"prompt": "Hi"}).status_code == 200  # the server goes on


def test_too_many_chat_messages_are_a_400_naming_messages(server):
    messages = [{"role": "user", "content": "Hi"}] * (MAX_CHAT_MESSAGES + 1)
    for path, body in (("/v1/chat/completions", {"messages": messages, "max_tokens": 1}),
                       ("/tokenize", {"messages": messages})):
        r = post(server, path, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and str(MAX_CHAT_MESSAGES) in error["message"], error
        assert len(r.content) < 2000  # the error does not echo the messages back
    assert post(server, "/tokenize", {"messages": messages[:MAX_CHAT_MESSAGES]}).json()["count"] > MAX_CHAT_MESSAGES


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 1}),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
    ("/tokenize", lambda text: {"prompt": text}),
], ids=["completions", "chat", "tokenize"])
def test_health_answers_while_a_long_prompt_is_tokenized(server, path, body):
    text = "paged attention keeps every sequence in blocks " * (LIMIT // 2 // 48)  # 1 MB: seconds to tokenize
    done = {}

    def send():
        done["response"] = post(server, path, body(text))
        done["at"] = time.monotonic()

    sent = time.monotonic()
    big = threading.Thread(target=send)
    big.start()
    answered = []
    try:
        while big.is_alive() and len(answered) < 400:
            r = httpx.get(server.url + "/health", timeout=5)  # generous: it used to wait for the whole tokenizing
            answered.append((time.monotonic(), r.status_code))
            time.sleep(0.02)
    finally:
        big.join(120)
    end = done["at"]
    assert done["response"].status_code == (200 if path == "/tokenize" else 400)  # 400: longer than the context
    # the event loop was free all along: /health answered in the third quarter of the long request's time, too
    # (a loop busy tokenizing answers only before it starts or once it is done)
    third_quarter = (sent + (end - sent) / 2, sent + 3 * (end - sent) / 4)
    assert any(third_quarter[0] < t < third_quarter[1] and code == 200 for t, code in answered), (sent, end, answered)


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_with_stop(server):
    prompt, k = [11, 12, 13], 6
    base = {"prompt": prompt, "temperature": 0, "ignore_eos": True}
    before, after = (post(server, "/v1/completions", {**base, "max_tokens": n}).json()["choices"][0]["text"]
                     for n in (k - 1, k))
    stop = stop_completed_by_last_token(before, after)
    whole = post(server, "/v1/completions", {**base, "max_tokens": k, "stop": [stop]}).json()
    choice = whole["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], choice["text"]) == ("stop", stop, after[:-len(stop)])
    assert whole["usage"]["completion_tokens"] == k
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={**base, "max_tokens": k, "stop": [stop], "stream": True}) as r:
        events = sse_events(r.iter_lines())
    reasons = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert reasons == ["stop"] and events[-1] == "[DONE]"
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == after[:-len(stop)]


def test_stop_lists_past_the_limits_are_a_400_naming_the_field(server):
    """Before: 300,000 stop strings in a 3.9 MB body were accepted, and searched one by one at every token."""
    from minivllm.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

    size = MAX_STOP_CHARS // MAX_STOP_STRINGS
    most = [f"{i:0{size}d}" for i in range(MAX_STOP_STRINGS)]
    base = {"prompt": [11, 12, 13], "max_tokens": 4}
    for stream in (False, True):
        for field, value in [("stop", [f"{i}" for i in range(150_000)]), ("stop", most + ["x"]),
                             ("stop", most[:-1] + ["x" * (size + 1)]),
                             ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1)))]:
            r = post(server, "/v1/completions", {**base, field: value, "stream": stream})
            assert r.status_code == 400, (field, len(value), r.text[:300])
            error = r.json()["error"]
            assert error["param"] == field and "at most" in error["message"], error
            assert len(r.content) < 2000, "the error echoed the list back"
    for field, value in [("stop", most), ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS)))]:  # the largest
        r = post(server, "/v1/completions", {**base, field: value})
        assert r.status_code == 200, r.text[:300]


def until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends on ``sock`` until it closes it, and how long that took (bounded)."""
    start, data = time.monotonic(), b""
    sock.settimeout(30)
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def test_half_sent_requests_are_timed_out_and_others_are_served_meanwhile(server):
    """Before: uvicorn times a body out never, a head only between requests: half a request held its connection
    (and the buffers behind it) for as long as the client liked."""
    body = json.dumps({"prompt": [11, 12, 13], "max_tokens": 2}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    halves = [head + body[:10], head[:30], b""]  # half a body, half a head, nothing at all
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in halves]
    for sock, half in zip(socks, halves):
        sock.sendall(half)
    served = post(server, "/v1/completions", {"prompt": [11, 12, 13], "max_tokens": 2})  # meanwhile: served
    assert served.status_code == 200, served.text
    (answer, _), (nothing, _), (empty, _) = (until_closed(s) for s in socks)  # each closed, well before 30 s
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"code":"request_timeout"' in answer, answer
    assert b"--read-timeout" in answer and nothing == empty == b""
    with socket.create_connection(("127.0.0.1", server.port)) as slow:  # slow but steady, within the time: served
        whole = head.replace(b"Host: x", b"Host: x\r\nConnection: close") + body
        for i in range(0, len(whole), 16):
            slow.sendall(whole[i:i + 16])
            time.sleep(0.02)
        answer, _ = until_closed(slow)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


# -- in this process: the app over a real engine, with a part broken on purpose ------------------------------

@pytest.fixture(scope="module")
def app():
    from starlette.testclient import TestClient

    from minivllm.engine import LLMEngine
    from minivllm.serving.api import OpenAIServing
    from minivllm.serving.app import build_app
    from minivllm.serving.async_llm import AsyncLLM

    serving = OpenAIServing(AsyncLLM(LLMEngine(model="tiny-random", num_blocks=64, device="cpu")), "tiny-random")
    with TestClient(build_app(serving), raise_server_exceptions=False) as client:
        yield client  # leaving it runs the lifespan's end: the engine loop stops


def test_a_stream_that_fails_after_it_started_ends_with_an_error_event_and_done(app, monkeypatch):
    from minivllm.serving.responses import StreamState

    def broken(self, out):
        raise RuntimeError("a bug in the response code")

    monkeypatch.setattr(StreamState, "deltas", broken)
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "stream": True}),
                       ("/v1/chat/completions", {"messages": json.loads(USER), "max_tokens": 4, "stream": True})):
        r = app.post(path, json=body)
        assert r.status_code == 200  # the headers went out before the failure
        events = sse_events(r.text.splitlines())
        assert events[-1] == "[DONE]", r.text
        assert events[-2]["error"]["type"] == "internal_server_error", events


def test_a_value_error_in_a_handler_is_a_400_naming_the_field_never_a_500(app, monkeypatch):
    from minivllm.serving.responses import StreamState

    def refuses(self, out):
        raise ValueError("logprobs cannot be shown for this request")

    monkeypatch.setattr(StreamState, "response", refuses)
    r = app.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    monkeypatch.setattr(StreamState, "deltas", refuses)
    events = sse_events(app.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True})
                        .text.splitlines())
    assert events[-1] == "[DONE]" and events[-2]["error"]["param"] == "logprobs", events


# -- structured outputs under hostile input (issue 65) -------------------------------------------------------------
def deep_items(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("extra, param, says", [
    ({"structured_outputs": {"json": deep_items(480)}}, "structured_outputs", "nest objects and arrays at most 64"),
    ({"structured_outputs": {"json": '{"type": "array", "items": ' * 1100 + "{}" + "}" * 1100}},
     "structured_outputs", "at most 64"),
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "structured_outputs",
     '"uniqueItems"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "string", "minLength": -5}}}}, "response_format", '"minLength" -5'),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs", "json_object must be None, True or False"),
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs", "admits no output"),
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs", "admits no output"),
])
def test_hostile_constraints_are_a_400_naming_the_field_and_the_connection_lives_on(server, extra, param, says):
    """Before: 500s (has_surrogate's recursion, json.loads' RecursionError, a mask with no token), "Check failed"
    text, or accepted and not enforced; after a 500 the keep-alive connection was reset in 2 of 3 tries."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json={"messages": json.loads(USER), "max_tokens": 4, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and says in r.json()["error"]["message"], r.text
        ok = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})  # the same connection
        assert ok.status_code == 200, ok.text


@pytest.fixture
def slow_compiles(monkeypatch):
    """Every compile (xgrammar's ``GrammarCompiler.compile_grammar``) blocks until the test sets the returned
    event, then compiles for real."""
    xgr = pytest.importorskip("xgrammar")
    release, real = threading.Event(), xgr.GrammarCompiler.compile_grammar

    def compile_grammar(self, grammar, *args, **kwargs):
        release.calls += 1
        assert release.wait(300), "the test never released the compile"
        return real(self, grammar, *args, **kwargs)

    release.calls = 0
    monkeypatch.setattr(xgr.GrammarCompiler, "compile_grammar", compile_grammar)
    yield release
    release.set()


def test_plain_requests_are_served_while_constrained_ones_wait_for_their_grammars(app, slow_compiles):
    """Before: each compile took a thread of the default pool (six of them on two cores) until it ended, so
    /tokenize and every other worker-thread job waited for the slowest grammar. Now the compiles wait in their
    own pool, at most MAX_COMPILES_IN_FLIGHT of them (one more is a 429), and nothing else waits on them."""
    from minivllm.structured_output import MAX_COMPILES_IN_FLIGHT
    results = {}

    def post(i):
        body = {"prompt": "Hi", "max_tokens": 16, "temperature": 0,
                "structured_outputs": {"regex": f"[0-9]{{2}}-served-{i}"}}
        results[i] = app.post("/v1/completions", json=body)

    waiting = [threading.Thread(target=post, args=(i,)) for i in range(MAX_COMPILES_IN_FLIGHT)]
    for t in waiting:
        t.start()
    for _ in range(2400):  # a bounded wait for the compiles to be in flight, not a timing
        if slow_compiles.calls >= 2:
            break
        time.sleep(0.05)
    served = threading.Event()

    def plain():
        results["tokenize"] = app.post("/tokenize", json={"prompt": "Hello there"})
        results["plain"] = app.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8})
        results["health"] = app.get("/health")
        served.set()

    threading.Thread(target=plain).start()
    assert served.wait(300), "the plain requests waited for the grammars"
    assert results["tokenize"].status_code == 200 and results["health"].status_code == 200
    assert results["plain"].status_code == 200 and results["plain"].json()["choices"][0]["finish_reason"] == "length"
    busy = app.post("/v1/completions", json={"prompt": "Hi", "structured_outputs": {"regex": "[a-z]+-busy"}})
    assert busy.status_code == 429 and "MAX_COMPILES_IN_FLIGHT" in busy.json()["error"]["message"], busy.text
    assert all(t.is_alive() for t in waiting) and not set(results) & set(range(MAX_COMPILES_IN_FLIGHT))
    slow_compiles.set()
    for t in waiting:
        t.join(300)
    for i in range(MAX_COMPILES_IN_FLIGHT):
        r = results[i]
        assert r.status_code == 200 and re.fullmatch(f"[0-9]{{2}}-served-{i}", r.json()["choices"][0]["text"]), r.text


def test_a_compile_past_its_time_limit_is_a_400_naming_the_limit(app, slow_compiles, monkeypatch):
    backend = app.app.state.serving.engine.grammar_backend()
    monkeypatch.setattr(backend, "compile_timeout_s", 0.5)
    r = app.post("/v1/chat/completions", json={"messages": json.loads(USER), "max_tokens": 4,
                                                "structured_outputs": {"regex": "[a-z]+-never-compiles"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    assert "limit of 0.5 s (EngineConfig.structured_outputs_timeout_s)" in r.json()["error"]["message"], r.text
    assert app.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_a_mask_with_no_token_mid_output_is_a_400_saying_so_never_a_500(app, monkeypatch):
    dead_end_after(monkeypatch, 2)  # the grammar reaches a state with no way on after two tokens
    for temperature in (0, 1):  # two tokens cannot end the regex first (no token holds 20 letters)
        r = app.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8, "temperature": temperature,
                                              "seed": 3, "structured_outputs": {"regex": "[a-z]{40,50}"}})
        assert r.status_code == 400, r.text
        assert "structured_outputs admits no continuation" in r.json()["error"]["message"], r.text


def test_a_client_that_leaves_while_its_grammar_is_queued_cancels_the_compile(app, slow_compiles):
    """Before: the compile ran on in a worker thread, and its abandoned request was queued when it ended."""
    import asyncio

    from minivllm import SamplingParams, StructuredOutputsParams
    from minivllm.serving.protocol import APIError
    from minivllm.structured_output import COMPILE_WORKERS
    serving = app.app.state.serving
    backend = serving.engine.grammar_backend()
    holding = [StructuredOutputsParams(regex=f"[a-z]+-hold-{i}") for i in range(COMPILE_WORKERS)]
    futures = [backend.submit(so) for so in holding]  # every worker busy: the next compile queues
    for _ in range(2400):  # a bounded wait for the workers to take them, not a timing
        if slow_compiles.calls == COMPILE_WORKERS:
            break
        time.sleep(0.05)

    class Gone:  # the client has left: the next message is the disconnect
        async def receive(self):
            return {"type": "http.disconnect"}

    so = StructuredOutputsParams(regex="[a-z]+-left")
    with pytest.raises(APIError) as refused:
        asyncio.run(serving.compiled(SamplingParams(structured_outputs=so), "structured_outputs", Gone()))
    assert refused.value.status == 499
    assert so.key not in backend._in_flight  # cancelled before any worker took it
    slow_compiles.set()
    for params, future in zip(holding, futures):
        future.result(300)
        backend.release(params, future)
    assert slow_compiles.calls == COMPILE_WORKERS  # the left client's grammar never compiled


def test_health_answers_while_a_json_schema_is_parsed(app, monkeypatch):
    """Before: a schema was checked and parsed on the event loop (four 12 KB schemas stalled /health for 12 s)."""
    from minivllm import structured_output
    release, parsing, real = threading.Event(), threading.Event(), structured_output._parse

    def slow_parse(key):
        if "slow-parse" in key[1]:
            parsing.set()
            assert release.wait(300), "the test never released the parse"
        return real(key)

    monkeypatch.setattr(structured_output, "_parse", slow_parse)
    results = {}
    body = {"prompt": "Hi", "max_tokens": 4, "structured_outputs": {"json": {
        "type": "object", "properties": {"slow-parse": {"type": "integer"}}, "required": ["slow-parse"]}}}
    waiting = threading.Thread(target=lambda: results.setdefault("constrained", app.post("/v1/completions",
                                                                                          json=body)))
    waiting.start()
    try:
        assert parsing.wait(300)
        served = threading.Event()
        threading.Thread(target=lambda: (results.setdefault("health", app.get("/health")), served.set())).start()
        assert served.wait(300), "/health waited for the schema's parse"
        assert results["health"].status_code == 200 and waiting.is_alive()
    finally:
        release.set()
    waiting.join(300)
    assert results["constrained"].status_code == 200, results["constrained"].text
