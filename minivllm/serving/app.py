"""The FastAPI app: OpenAI's routes, vLLM's extras, and every error as an OpenAI error object (chapter 13).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``.
A malformed body, a wrong type or an unknown field is a 400 naming the
parameter (FastAPI's own answer would be a 422 in its own shape).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from minivllm.serving.api import OpenAIServing
from minivllm.serving.metrics import CONTENT_TYPE, ServerMetrics
from minivllm.serving.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       TokenizeRequest)

__all__ = ["build_app", "validation_error"]

log = logging.getLogger("minivllm.serving")


def build_app(serving: OpenAIServing, metrics: ServerMetrics | None = None) -> FastAPI:
    """The server's app; its lifespan stops the engine loop when the server exits."""
    @asynccontextmanager
    async def lifespan(app):
        yield
        serving.llm.close()

    app = FastAPI(title="minivllm", lifespan=lifespan)
    app.state.serving = serving
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
        return serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return serving.detokenize(body)

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
    """FastAPI's validation error as a 400 naming the first bad parameter."""
    err = exc.errors()[0]
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
    return APIError(400, f"{where}: {err.get('msg')}, got {err.get('input')!r}", loc[0])


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, exc: RequestValidationError):
        err = validation_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), None, kind).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request, exc: Exception):
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}", None,
                                     "internal_server_error").body(), status_code=500)
