"""The OpenAI endpoints over an ``AsyncLLM``: validate, queue, stream or collect (chapter 13).

Each request is checked completely (body, model, sampling fields, prompt
against the context) before it is queued, so a bad one is a 400 that touches
nothing else. A long prompt is tokenized (and its chat template rendered) in a
worker thread: it takes seconds, and the event loop must go on answering
(``/health``, other requests, streams); a short one, on the loop, in
milliseconds. A streaming response is server-sent events, ending with
``data: [DONE]`` whatever fails; a client that goes away, streaming or not,
aborts its request at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import AsyncIterator

from fastapi import Request

from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.structured_output import GrammarCompilesBusy
from minivllm.serving.async_llm import (AsyncLLM, EngineRestarting, QueueFull, RequestFailed, RequestStream,
                                       ServerShuttingDown)
from minivllm.serving.protocol import (APIError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                       DetokenizeRequest, TokenizeRequest, bad_request)
from minivllm.serving.responses import DONE, ChatFormat, CompletionFormat, StreamState, ToolCallFormat, sse
from minivllm.timing import now

__all__ = ["OpenAIServing"]

log = logging.getLogger("minivllm.serving")
CHECK_ID = "validate"  # the request id a prompt is checked under (AsyncLLM's own ids are "req-N")
INLINE_LEN = 8192  # shorter prompts (characters or ids) are tokenized on the loop: milliseconds, in arrival order


class OpenAIServing:
    """The handlers behind the routes of :func:`minivllm.serving.app.build_app`."""

    def __init__(self, async_llm: AsyncLLM, model_name: str):
        self.llm = async_llm
        self.tokenizer = self.engine.tokenizer
        self.model_name = model_name
        self.created = int(time.time())

    @property
    def engine(self):
        """The engine the loop runs now (AsyncLLM builds a new one after a tensor-parallel rank dies)."""
        return self.llm.engine

    # -- checks ----------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(400, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           "model", code="model_not_found")

    async def checked_ids(self, prompt, params: SamplingParams, aliases: dict[str, str]) -> str | list[int]:
        """A short prompt as it is (``add_request`` tokenizes it at once, so requests queue in arrival order); a
        long one's token ids, tokenized and checked against the context in a worker thread (or a 400)."""
        if len(prompt) < INLINE_LEN:
            return prompt
        try:
            _, ids = await asyncio.to_thread(self.engine.validate_request, CHECK_ID, prompt, params)
        except ValueError as e:
            raise bad_request(e, aliases) from None
        return ids

    async def params(self, body, *args) -> SamplingParams:
        """The body's SamplingParams; with a constraint (a JSON schema to check and parse: milliseconds to a
        second) made in a worker thread, off the event loop."""
        rf, tools = body.response_format, getattr(body, "tools", None)
        if body.structured_outputs is None and (rf is None or rf.type == "text") and not tools:
            return body.sampling_params(*args)
        return await asyncio.to_thread(body.sampling_params, *args)

    async def compiled(self, params: SamplingParams, field: str, request: Request) -> None:
        """Wait for the request's constraint to compile (chapter 19) before it is queued: in the grammar backend's
        pool, off the event loop and the engine loop (cached: queueing it then finds it), an equal constraint in
        flight compiled once. A constraint that fails, or takes longer than ``structured_outputs_timeout_s``, is
        a 400 naming ``field``; a full compile pool a 429; a client that leaves meanwhile stops the wait (and
        the compile, if nobody else waits for it and it has not started)."""
        so = params.structured_outputs
        if so is None:
            return
        backend = self.engine._grammar_backend or await asyncio.to_thread(self.engine.grammar_backend)
        try:
            future = backend.submit(so)
        except GrammarCompilesBusy as e:
            raise APIError(429, str(e), field, "rate_limit_error", "grammar_compiles_busy") from None
        work, watch = asyncio.wrap_future(future), asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({work, watch}, timeout=backend.compile_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            backend.release(so, future)
        if not work.done() or work.cancelled():
            if watch.done() and not watch.cancelled():
                raise APIError(499, "client closed the request", None, "client_closed_request")
            raise APIError(400, backend.timeout_error(so).replace("structured_outputs", field, 1), field)
        if work.exception() is not None:
            raise APIError(400, str(work.exception()).replace("structured_outputs", field, 1), field)

    def submit(self, prompt, params: SamplingParams, aliases: dict[str, str], arrival: float) -> RequestStream:
        """Queue the request, or the error the client gets: 400 (bad input), 429 (queue full), 503 (draining)."""
        try:
            return self.llm.add_request(prompt, params, arrival_time=arrival)
        except ValueError as e:
            raise bad_request(e, aliases) from None
        except QueueFull as e:
            raise APIError(429, str(e), None, "rate_limit_error", "queue_full") from None
        except ServerShuttingDown as e:  # draining, or the engine is being restarted
            raise stream_error(e) from None

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of the messages rendered with the model's chat template."""
        try:
            text = self.tokenizer.apply_chat_template([m.for_template() for m in messages],
                                                      add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as e:  # a template that refuses these messages (jinja's raise_exception)
            raise APIError(400, f"messages cannot be rendered with the model's chat template: {e}",
                           "messages") from None
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def default_max_tokens(self, prompt_len: int) -> int:
        """What a chat request without max_tokens may generate: up to the context and the KV pool (as vLLM)."""
        room = min(self.engine.max_model_len, self.engine.num_blocks * self.engine.config.block_size)
        return max(1, room - prompt_len)

    # -- the endpoints ---------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        arrival = now()
        self.check_model(body.model)
        body.check_supported()
        prompt = body.one_prompt()
        params = await self.params(body, 16 if body.max_tokens is None else body.max_tokens, body.logprobs, {})
        await self.compiled(params, body.constraint_field(), request)
        stream = self.submit(await self.checked_ids(prompt, params, {}), params, {}, arrival)
        state = StreamState(CompletionFormat(body.logprobs), self.model_name, body.include_usage)
        return await self.respond(stream, state, body.stream, params.n, request)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        arrival = now()
        self.check_model(body.model)
        body.check_supported()
        wanted = body.wanted_tokens()
        aliases = {"prompt": "messages", "max_tokens": body.max_tokens_field, "logprobs": "top_logprobs"}
        k = body.num_logprobs()
        short = len(body.messages) <= 64 and sum(len(m.for_template()["content"]) for m in body.messages) < INLINE_LEN
        ids = self.chat_prompt(body.messages) if short else await asyncio.to_thread(self.chat_prompt, body.messages)
        params = await self.params(body, self.default_max_tokens(len(ids)) if wanted is None else wanted, k,
                                   aliases)
        await self.compiled(params, body.constraint_field(), request)
        stream = self.submit(await self.checked_ids(ids, params, aliases), params, aliases, arrival)
        call = body.tool_call()
        fmt = ChatFormat(k) if call is None else ToolCallFormat(k, call[1])
        state = StreamState(fmt, self.model_name, body.include_usage)
        return await self.respond(stream, state, body.stream, params.n, request)

    async def respond(self, stream: RequestStream, state: StreamState, streaming: bool, n: int, request: Request):
        """An SSE stream, or the finished response (the request is aborted if the client goes away first)."""
        if streaming:
            events = self.events(stream, state, n)
            weakref.finalize(events, stream.abort)  # a response that never starts (client gone) still aborts
            return events
        out = await self.collect(stream, request)
        return state.response(out)

    async def events(self, stream: RequestStream, state: StreamState, n: int) -> AsyncIterator[str]:
        """``data: {chunk}`` events ending with ``data: [DONE]``; an error mid-stream is an error event."""
        try:
            if state.fmt.first_deltas(n):
                yield sse(state.chunk(state.fmt.first_deltas(n)))
            last = None
            async for last in stream:
                if last.error:
                    raise failure(last)
                choices = state.deltas(last)
                if choices:
                    yield sse(state.chunk(choices))
            if state.include_usage and last is not None:
                yield sse(state.usage_chunk(last))
        except Exception as e:  # the headers are gone: the client gets an error event, then [DONE]
            if not isinstance(e, (RequestFailed, ServerShuttingDown, APIError, ValueError)):
                log.exception("the stream of %s failed", stream.request_id)
            yield sse(stream_error(e).body())
        finally:
            stream.abort()
        yield DONE

    async def collect(self, stream: RequestStream, request: Request) -> RequestOutput:
        """The request's last output; if the client disconnects first, the request is aborted."""
        async def last() -> RequestOutput:
            async for out in stream:
                pass
            return out

        work, watch = asyncio.ensure_future(last()), asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
            stream.abort()
        if not work.done() or work.cancelled():
            raise APIError(499, "client closed the request", None, "client_closed_request")
        try:
            out = work.result()
        except (RequestFailed, ServerShuttingDown) as e:
            raise stream_error(e) from None
        if out.error:
            raise stream_error(failure(out))
        return out

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "minivllm", "root": self.engine.config.model,
                                            "max_model_len": self.engine.max_model_len}]}

    async def tokenize(self, body: TokenizeRequest) -> dict:
        return await asyncio.to_thread(self._tokenize, body)  # seconds for a long prompt: not on the event loop

    def _tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            ids = self.chat_prompt(body.messages, body.add_generation_prompt)
        else:
            ids = list(self.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        return await asyncio.to_thread(self._detokenize, body)

    def _detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise APIError(400, f"tokens must be ids in [0, {self.engine.vocab_size}), got {bad[:5]}", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}


def failure(out: RequestOutput) -> Exception:
    """A failed output's error: the engine's (a worker died, its link broke: retry, a 503), its constraint's (no
    continuation, a compile that failed or timed out: the client's, a 400), or the request's own (a 500)."""
    if out.retryable:
        return EngineRestarting(f"the request failed in the engine: {out.error}; retry shortly")
    if out.error.startswith("structured_outputs"):
        return ValueError(out.error)
    return RequestFailed(f"the request failed in the engine: {out.error}")


def stream_error(e: Exception) -> APIError:
    """The error a request gets when the server shut down under it or its engine failed as a whole (503: retry),
    for bad input (400), or when the engine loop or the request in it (500, why) or the server itself (500, the
    exception's type) failed."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineRestarting):
        return APIError(503, str(e), None, "service_unavailable", "engine_restarting")
    if isinstance(e, ServerShuttingDown):
        return APIError(503, str(e), None, "service_unavailable", "shutting_down")
    if isinstance(e, ValueError):
        return bad_request(e, {})
    message = str(e) if isinstance(e, RequestFailed) else f"internal error: {type(e).__name__}"
    return APIError(500, message, None, "internal_server_error")


async def disconnected(request: Request) -> None:
    """Return when the client has gone away (the body is already read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
