"""The server under hostile or unlucky input: a 4xx, never a 500, a dropped connection or a stalled loop (chapter 13).

One tiny-random server (nothing here depends on the model) with a 2 MB body
limit: lone UTF-16 surrogates are a 400 naming the field, a body over the limit
is a 413 before anything parses it (with a Content-Length or chunked), too many
chat messages are a 400, ``/health`` answers while a long prompt is tokenized,
and a stop string completed by the last allowed token finishes with "stop". The
last tests run the app in this process to break it on purpose mid-stream.
"""

import json
import socket
import threading
import time

import httpx
import pytest

from minivllm.bench import ServerProcess
from minivllm.serving.protocol import MAX_CHAT_MESSAGES

from helpers import stop_completed_by_last_token
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
