"""The FastAPI app: OpenAI's routes, vLLM's extras, and every error as an OpenAI error object (chapter 13).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``.
A malformed body, a wrong type or an unknown field is a 400 naming the
parameter (FastAPI's own answer would be a 422 in its own shape), and so is a
``ValueError`` from any handler. A body over ``max_request_bytes`` is a 413,
refused before anything parses it, and one not all there within
``read_timeout_s`` is a 408 (:class:`BodyLimit`).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from minivllm.serving.api import OpenAIServing
from minivllm.serving.metrics import CONTENT_TYPE, ServerMetrics
from minivllm.serving.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       TokenizeRequest, bad_request)

__all__ = ["build_app", "validation_error", "BodyLimit", "DEFAULT_MAX_REQUEST_BYTES", "DEFAULT_READ_TIMEOUT_S"]

log = logging.getLogger("minivllm.serving")
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: a 128k-token prompt as token ids is about 1 MiB
DEFAULT_READ_TIMEOUT_S = 30.0  # a request's head, then its body: 4 MiB in 30 s is about 1 Mbit/s
DRAIN_LIMIT_BYTES = 64 << 20  # an over-limit body is read (and dropped) up to this, so the client sees the 413


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets a 413 before any handler reads or parses it, and one
    not all there within ``timeout_s`` seconds of the request's head gets a 408 (and its connection is closed).

    A ``Content-Length`` over the limit is refused without keeping a byte; a
    chunked body is counted as it comes and refused when it passes the limit.
    Either way the rest is read and dropped (up to ``DRAIN_LIMIT_BYTES``, within
    the same time) so that a client still sending gets the 413 rather than a
    reset connection. A body within the limit is handed on whole. Without the
    timeout a client that sends half a body and then nothing holds its
    connection and its buffers forever (uvicorn never times a body out).
    """

    def __init__(self, app, max_bytes: int, timeout_s: float = DEFAULT_READ_TIMEOUT_S):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            more = headers.get(b"expect", b"").lower() != b"100-continue"  # else the body is not even sent
            return await self.refuse(scope, receive, send, more, deadline)
        chunks, size, more = [], 0, True
        while more:
            message = await self.next_part(receive, deadline)
            if message is None:
                return await error_response(APIError(
                    408, f"the request body did not arrive within {self.timeout_s:g} s (serve --read-timeout)",
                    None, "invalid_request_error", "request_timeout"), {"connection": "close"})(scope, receive, send)
            if message["type"] != "http.request":
                return  # the client went away before its body was complete
            chunks.append(message.get("body", b""))
            size, more = size + len(chunks[-1]), message.get("more_body", False)
            if size > self.max_bytes:
                return await self.refuse(scope, receive, send, more, deadline)
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal whole
            message, whole = whole, None
            return message if message is not None else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def next_part(receive, deadline: float):
        """The next message of the body, or None once the deadline (the loop's clock) has passed."""
        try:
            return await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
        except asyncio.TimeoutError:
            return None

    async def refuse(self, scope, receive, send, more: bool, deadline: float) -> None:
        dropped = 0
        while more and dropped < DRAIN_LIMIT_BYTES:
            message = await self.next_part(receive, deadline)
            if message is None:
                break  # past the deadline: the 413 goes out now, and the connection is closed after it
            dropped += len(message.get("body", b""))
            more = message["type"] == "http.request" and message.get("more_body", False)
        error = APIError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                         f"(serve --max-request-bytes)", None, "invalid_request_error", "request_too_large")
        await error_response(error, {"connection": "close"} if more else None)(scope, receive, send)


def error_response(error: APIError, headers=None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def build_app(serving: OpenAIServing, metrics: ServerMetrics | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              read_timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> FastAPI:
    """The server's app; its lifespan stops the engine loop when the server exits."""
    @asynccontextmanager
    async def lifespan(app):
        yield
        serving.llm.close()

    app = FastAPI(title="minivllm", lifespan=lifespan)
    app.state.serving = serving
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, timeout_s=read_timeout_s)
    _add_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return _reply(await serving.completions(body, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return _reply(await serving.chat(body, request))

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.get("/health")
    async def health():
        return Response(status_code=200 if serving.llm.is_alive else 503)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await serving.detokenize(body)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render() if metrics else b"", media_type=CONTENT_TYPE)

    return app


def _reply(result):
    """A dict is a JSON body; anything else is the async iterator of a server-sent event stream."""
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's validation error as a 400 naming the bad parameter (of a union's branches, the one that got
    furthest: a list of text parts with a bad part, rather than "not a string")."""
    err = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
    if not loc:
        return APIError(400, f"the body must be a JSON object: {err.get('msg')}")
    where = ".".join(loc)
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {where}", loc[0])
    if err.get("type") == "missing":
        return APIError(400, f"{where} is required", loc[0])
    got = repr(err.get("input"))
    got = got if len(got) <= 200 else f"{got[:200]}... ({len(got)} characters)"  # never echo a huge body back
    return APIError(400, f"{where}: {err.get('msg', '').removeprefix('Value error, ')}, got {got}", loc[0])


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, exc: RequestValidationError):
        return error_response(validation_error(exc))

    @app.exception_handler(ValueError)
    async def bad_value(request, exc: ValueError):  # bad input found past the checks: still a 400, never a 500
        return error_response(bad_request(exc, {}))

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), None, kind), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request, exc: Exception):
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", None, "internal_server_error"))
