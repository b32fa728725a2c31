"""The OpenAI request bodies the server accepts, their errors, and how they become ``SamplingParams`` (chapter 13).

Bodies are validated strictly (a string where a number belongs is an error, not
a conversion) and unknown fields are refused, as OpenAI's API does. OpenAI's
fields map onto vLLM's ``SamplingParams``; vLLM's extensions (``top_k``,
``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``) are accepted
too. Fields the engine cannot honour are accepted only at their neutral value.
Structured outputs (chapter 19): ``response_format`` (``text``,
``json_object``, ``json_schema``) on both endpoints, vLLM's
``structured_outputs`` extension (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``), and on chat a forced tool call: a named
``tool_choice`` constrains the reply to that function's parameters, and
``"required"`` to a JSON list of calls (``{"name", "parameters"}``, vLLM's
schema); ``"auto"`` (the default when ``tools`` are given) is refused, since
no parser here tells a tool call from text. One constraint per request.
``response_format`` and tool calls ask for compact JSON (no optional
whitespace: vLLM's ``disable_any_whitespace``, a server option there): with
whitespace allowed, SmolLM2 stalls in newlines until ``max_tokens``.
Every refusal is an :class:`APIError` naming the parameter. Text must be valid
Unicode (JSON can spell a lone UTF-16 surrogate, ``"\\ud800"``, that no tokenizer
or UTF-8 encoder takes), and a chat holds at most ``MAX_CHAT_MESSAGES`` messages.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from minivllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["APIError", "CompletionRequest", "ChatCompletionRequest", "ChatMessage", "TokenizeRequest",
           "DetokenizeRequest", "ResponseFormat", "Tool", "param_of", "bad_request", "MAX_CHAT_MESSAGES"]

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
    """Whether ``value`` (text, or lists and dicts of it) holds a lone UTF-16 surrogate; walked without recursion,
    so a body nested any depth is safe (a list of numbers is skipped at its first item)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item) is not None:
                return True
        elif isinstance(item, list):
            if item and isinstance(item[0], (str, list, dict)):
                stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
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


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's ``name``, ``schema`` (required here), ``description``, ``strict``
    (the schema is always enforced, strict or not)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    json_schema: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ANY_OBJECT = {"type": "object"}  # a function without parameters takes any object


def constraint(field: str, **given) -> StructuredOutputsParams:
    """``StructuredOutputsParams(**given)``, or a 400 naming ``field`` (the request's name for it) when the
    constraint is bad or xgrammar is missing (the message's ``structured_outputs...`` becomes ``field``)."""
    try:
        return StructuredOutputsParams(**given)
    except TypeError as e:  # a key StructuredOutputsParams does not have (vLLM's structured_outputs extension)
        raise APIError(400, f"{field} has an unknown or misplaced key: {e}", field.split(".")[0]) from None
    except ValueError as e:
        message = str(e) if field == "structured_outputs" else \
            re.sub(r"^structured_outputs(\.json\b)?", field, str(e))
        raise APIError(400, message, field.split(".")[0]) from None


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
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM extension: StructuredOutputsParams' fields

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
        rf = self.response_format
        if rf is not None and (rf.type == "json_schema") != (rf.json_schema is not None):
            raise APIError(400, 'response_format.json_schema is required with type "json_schema", and only '
                           "there", "response_format")

    def constraints(self) -> list[tuple[str, StructuredOutputsParams]]:
        """Each constraint the body asks for, with the field that asks (chapter 19)."""
        found = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "json_object":  # compact JSON (see the module's docstring)
                found.append(("response_format", constraint("response_format", json_object=True,
                                                            disable_any_whitespace=True)))
            else:
                found.append(("response_format", constraint("response_format.json_schema.schema",
                                                             json=rf.json_schema.json_schema,
                                                             disable_any_whitespace=True)))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", constraint("structured_outputs", **self.structured_outputs)))
        return found

    def constraint_field(self) -> str:
        """The field a compile error of the request's constraint is named after."""
        rf = self.response_format
        return "response_format" if rf is not None and rf.type != "text" else "structured_outputs"

    def structured(self) -> StructuredOutputsParams | None:
        """The request's one constraint, or None; two are a 400 naming the second."""
        found = self.constraints()
        if len(found) > 1:
            raise APIError(400, f"{found[1][0]} cannot be combined with {found[0][0]}: a request takes one "
                           f"constraint", found[1][0])
        return found[0][1] if found else None

    def sampling_params(self, max_tokens: int, logprobs: int | None, aliases: dict[str, str]) -> SamplingParams:
        """The engine's SamplingParams; a bad value is a 400 naming the request's field."""
        structured = self.structured()
        try:
            return SamplingParams(
                n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
                seed=self.seed, max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
                logprobs=logprobs, structured_outputs=structured)
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
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_call(self) -> tuple[str, str | None] | None:
        """A forced tool call: ("named", the function's name) or ("required", None); None for a plain reply.
        ``"auto"`` (OpenAI's default when tools are given) is a 400 naming ``tool_choice``."""
        tools, choice = self.tools or [], self.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        if choice == "none":
            return None
        if not tools:
            raise APIError(400, f"tool_choice {shown_choice(choice)} needs tools, and none are given", "tool_choice")
        if choice == "auto":
            raise APIError(400, 'tool_choice "auto" (the default when tools are given) is not supported: this server '
                           'cannot tell a tool call from text; give "required", a named function or "none"',
                           "tool_choice")
        if choice == "required":
            return "required", None
        names = [t.function.name for t in tools]
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among "
                           f"the tools ({', '.join(names)})", "tool_choice")
        return "named", choice.function.name

    def tool_schema(self, mode: str, name: str | None) -> dict:
        """The JSON schema a forced call's reply follows: the named function's parameters, or for "required" a list
        of at least one ``{"name", "parameters"}`` (at most one without ``parallel_tool_calls``), as vLLM's."""
        params = {t.function.name: t.function.parameters or ANY_OBJECT for t in self.tools}
        if mode == "named":
            return params[name]
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                  "required": ["name", "parameters"], "additionalProperties": False} for n, p in params.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return {**schema, "maxItems": 1} if self.parallel_tool_calls is False else schema

    def constraint_field(self) -> str:
        return "tools" if self.tool_call() is not None else super().constraint_field()

    def constraints(self) -> list[tuple[str, StructuredOutputsParams]]:
        call = self.tool_call()
        found = super().constraints()
        if call is not None:
            schema = self.tool_schema(*call)
            found.append(("tool_choice", constraint("tools", json=schema, disable_any_whitespace=True)))
        return found

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def shown_choice(choice) -> str:
    return f'"{choice}"' if isinstance(choice, str) else f"naming {choice.function.name!r}"


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
