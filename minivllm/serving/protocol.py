"""The OpenAI request bodies the server accepts, their errors, and how they become ``SamplingParams`` (chapter 13).

Bodies are validated strictly (a string where a number belongs is an error, not
a conversion) and unknown fields are refused, as OpenAI's API does. OpenAI's
fields map onto vLLM's ``SamplingParams``; vLLM's extensions (``top_k``,
``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``) are accepted
too. Fields the engine cannot honour are accepted only at their neutral value.
Every refusal is an :class:`APIError` naming the parameter. Text must be valid
Unicode (JSON can spell a lone UTF-16 surrogate, ``"\\ud800"``, that no tokenizer
or UTF-8 encoder takes), and a chat holds at most ``MAX_CHAT_MESSAGES`` messages.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from minivllm.sampling_params import SamplingParams

__all__ = ["APIError", "CompletionRequest", "ChatCompletionRequest", "ChatMessage", "TokenizeRequest",
           "DetokenizeRequest", "param_of", "bad_request", "MAX_CHAT_MESSAGES"]

MAX_CHAT_MESSAGES = 2048  # more is a 400: validating and rendering them is work done before any other check
_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    """An error the client gets as OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        message = message.encode("utf-8", "backslashreplace").decode()  # a lone surrogate cannot go out as UTF-8
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def param_of(message: str, aliases: dict[str, str]) -> str:
    """The request field a ``ValueError`` from ``SamplingParams`` or the engine names (its first word)."""
    first = message.split(" ", 1)[0]
    if first == "request" or (first == "prompt" and "max_tokens (" in message):  # prompt + max_tokens too long
        first = "max_tokens"
    return aliases.get(first, first)


def bad_request(error: ValueError, aliases: dict[str, str]) -> APIError:
    """A 400 for an engine ``ValueError``, naming the field as the client called it (``aliases``: ours -> theirs)."""
    message = str(error)
    param = param_of(message, aliases)
    first = message.split(" ", 1)[0]
    if first != param and aliases.get(first) == param:
        message = param + message[len(first):]
    elif param not in message:
        message += f" (request field {param!r})"
    return APIError(400, message, param)


def has_surrogate(value) -> bool:
    """Whether ``value`` (text, or lists and dicts of it) holds a lone UTF-16 surrogate (lists of numbers: no)."""
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, list):
        return bool(value) and isinstance(value[0], (str, list, dict)) and any(map(has_surrogate, value))
    if isinstance(value, dict):
        return any(map(has_surrogate, value)) or any(map(has_surrogate, value.values()))
    return False


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @field_validator("*")
    @classmethod
    def _unicode_text(cls, value):
        if has_surrogate(value):
            raise ValueError("must be valid Unicode text, but it holds a lone UTF-16 surrogate (\\ud800-\\udfff)")
        return value


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    include_stop_str_in_output: bool = False  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the operator's logs; no effect on the output
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {"presence_penalty": (0.0,), "frequency_penalty": (0.0,), "logit_bias": ({},)}

    def check_supported(self) -> None:
        """Refuse a field this server cannot honour, unless it has its neutral value."""
        for field, neutral in self.NEUTRAL.items():
            value = getattr(self, field)
            if value is not None and value not in neutral:
                raise APIError(400, f"{field} is not supported by this server; it may only be "
                               f"{' or '.join(map(repr, neutral))}, got {value!r}", field)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")

    def sampling_params(self, max_tokens: int, logprobs: int | None, aliases: dict[str, str]) -> SamplingParams:
        """The engine's SamplingParams; a bad value is a 400 naming the request's field."""
        try:
            return SamplingParams(
                n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
                seed=self.seed, max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
                logprobs=logprobs)
        except ValueError as e:
            raise bad_request(e, aliases) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt (text or token ids)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {**_Sampling.NEUTRAL, "echo": (False,), "suffix": ("",), "best_of": (1,)}

    def one_prompt(self) -> str | list[int]:
        """The prompt; a batch of several is refused (send one request per prompt)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"prompt must be one prompt (a string or a list of token ids); batches of "
                               f"several are not supported, got {len(p)}", "prompt")
            p = p[0]
        return p


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict:
        """The message as the chat template takes it (text parts joined; OpenAI's "developer" is "system")."""
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {**_Sampling.NEUTRAL, "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False),
               "response_format": ({"type": "text"},)}

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's): a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_CHAT_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]
