"""OpenAI response bodies and stream chunks built from ``RequestOutput`` (chapter 13).

A completion and a chat completion differ only in their wrapping: ``text``
versus ``message``/``delta``, the object names and the logprobs layout.
:class:`CompletionFormat` and :class:`ChatFormat` hold those differences; the
server's streaming and non-streaming paths are the same for both.
"""

from __future__ import annotations

import json
import time
import uuid

from minivllm.outputs import CompletionOutput, RequestOutput

__all__ = ["usage", "sse", "DONE", "CompletionFormat", "ChatFormat", "ToolCallFormat", "StreamState"]

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    """One server-sent event: ``data: {json}`` and a blank line."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def usage(out: RequestOutput) -> dict:
    """Prompt, completion and cached prompt tokens, as OpenAI counts them (all ``n`` samples' tokens)."""
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.metrics.num_cached_tokens}}


def _top(step: dict, k: int) -> list:
    """The ``k`` most likely candidates of one step, by rank."""
    return sorted((lp for lp in step.values() if lp.rank <= k), key=lambda lp: lp.rank)


class CompletionFormat:
    """``/v1/completions``: choices carry ``text``; logprobs as token, token_logprobs, top_logprobs, text_offset."""

    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, num_logprobs: int | None):
        self.k = num_logprobs

    def choice(self, c: CompletionOutput) -> dict:
        return {"index": c.index, "text": c.text, "logprobs": self.logprobs(c, 0), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def delta(self, c: CompletionOutput) -> dict:
        start = len(c.token_ids) - len(c.delta_token_ids)
        return {"index": c.index, "text": c.delta_text, "logprobs": self.logprobs(c, start),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def first_deltas(self, n: int) -> list[dict]:
        return []

    def logprobs(self, c: CompletionOutput, start: int) -> dict | None:
        if self.k is None or c.logprobs is None:
            return None
        steps = c.logprobs[start:]
        tokens = [step[t].decoded_token for t, step in zip(c.token_ids[start:], steps)]
        offset = sum(len(step[t].decoded_token) for t, step in zip(c.token_ids[:start], c.logprobs[:start]))
        offsets = [offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [step[t].logprob for t, step in zip(c.token_ids[start:], steps)],
                "top_logprobs": [{lp.decoded_token: lp.logprob for lp in _top(step, self.k)} for step in steps],
                "text_offset": offsets}


class ChatFormat(CompletionFormat):
    """``/v1/chat/completions``: choices carry ``message`` (or ``delta``); logprobs as ``content`` entries."""

    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def choice(self, c: CompletionOutput) -> dict:
        return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": self.logprobs(c, 0), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def delta(self, c: CompletionOutput) -> dict:
        start = len(c.token_ids) - len(c.delta_token_ids)
        return {"index": c.index, "delta": {"content": c.delta_text}, "logprobs": self.logprobs(c, start),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def first_deltas(self, n: int) -> list[dict]:
        """The opening chunk of each choice names the role, as OpenAI's does."""
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)]

    def logprobs(self, c: CompletionOutput, start: int) -> dict | None:
        if self.k is None or c.logprobs is None:
            return None

        def entry(lp, token: str) -> dict:
            return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

        return {"content": [{**entry(step[t], step[t].decoded_token),
                             "top_logprobs": [entry(lp, lp.decoded_token) for lp in _top(step, self.k)]}
                            for t, step in zip(c.token_ids[start:], c.logprobs[start:])]}


class ToolCallFormat(ChatFormat):
    """A chat reply forced to call a tool (chapter 19): ``message.tool_calls``, each call's arguments a JSON string.

    Named (``tool_choice`` naming a function): the reply is that function's
    arguments, streamed as ``tool_calls[0].function.arguments`` deltas after a
    first delta with the call's id and name; finish reason as the engine's. "required": the reply is a JSON list
    of ``{"name", "parameters"}``, given as calls once whole (streamed in one delta at the end), finish reason
    "tool_calls"; cut short (``length``) it cannot be parsed and comes back as ``content``.
    """

    def __init__(self, num_logprobs: int | None, named: str | None):
        super().__init__(num_logprobs)
        self.named = named  # the function a named tool_choice forces; None: "required"
        self.ids: dict[tuple[int, int], str] = {}

    def call_id(self, choice: int, i: int) -> str:
        return self.ids.setdefault((choice, i), f"call_{uuid.uuid4().hex[:24]}")

    def calls(self, c: CompletionOutput) -> list[dict] | None:
        """The reply's calls, or None when it is not a whole list of them ("required" cut short)."""
        if self.named is not None:
            return [self._call(c.index, 0, self.named, c.text)]
        try:  # the grammar made it a list of calls, unless max_tokens or a stop string cut it short
            return [self._call(c.index, i, item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                    for i, item in enumerate(json.loads(c.text))]
        except (ValueError, RecursionError, TypeError, KeyError):
            return None

    def _call(self, choice: int, i: int, name: str, arguments: str) -> dict:
        return {"id": self.call_id(choice, i), "type": "function", "function": {"name": name, "arguments": arguments}}

    def finish_reason(self, c: CompletionOutput, calls) -> str | None:
        return "tool_calls" if self.named is None and calls is not None and c.finish_reason == "stop" \
            else c.finish_reason

    def choice(self, c: CompletionOutput) -> dict:
        calls = self.calls(c)
        message = {"role": "assistant", "content": c.text} if calls is None else \
            {"role": "assistant", "content": None, "tool_calls": calls}
        return {"index": c.index, "message": message, "logprobs": self.logprobs(c, 0),
                "finish_reason": self.finish_reason(c, calls), "stop_reason": c.stop_reason}

    def delta(self, c: CompletionOutput) -> dict | None:
        if self.named is not None:
            start = len(c.token_ids) - len(c.delta_token_ids)
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": c.delta_text}}]} if c.delta_text else {}
            return {"index": c.index, "delta": delta, "logprobs": self.logprobs(c, start),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if not c.finish_reason:
            return None  # "required": the list is given whole, at the end
        calls = self.calls(c)
        delta = {"content": c.text} if calls is None else \
            {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        return {"index": c.index, "delta": delta, "logprobs": self.logprobs(c, 0),
                "finish_reason": self.finish_reason(c, calls), "stop_reason": c.stop_reason}

    def first_deltas(self, n: int) -> list[dict]:
        firsts = super().first_deltas(n)
        if self.named is not None:
            for d in firsts:
                d["delta"]["tool_calls"] = [{"index": 0, "id": self.call_id(d["index"], 0), "type": "function",
                                             "function": {"name": self.named, "arguments": ""}}]
        return firsts


class StreamState:
    """One response's id, format and which choices have already sent their finish reason."""

    def __init__(self, fmt: CompletionFormat, model: str, include_usage: bool = False):
        self.fmt, self.model, self.include_usage = fmt, model, include_usage
        self.id = f"{fmt.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.done: set[int] = set()

    def _wrap(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def chunk(self, choices: list[dict]) -> dict:
        return self._wrap(self.fmt.chunk_object, choices, **({"usage": None} if self.include_usage else {}))

    def deltas(self, out: RequestOutput) -> list[dict]:
        """This step's new text per choice; a choice's finish reason is sent exactly once."""
        choices = []
        for c in out.outputs:
            if c.index in self.done or not (c.delta_token_ids or c.delta_text or c.finish_reason):
                continue
            choice = self.fmt.delta(c)
            if choice is None:  # nothing to send yet (a "required" tool call is sent whole)
                continue
            if c.finish_reason:
                self.done.add(c.index)
            choices.append(choice)
        return choices

    def usage_chunk(self, out: RequestOutput) -> dict:
        return self._wrap(self.fmt.chunk_object, [], usage=usage(out))

    def response(self, out: RequestOutput) -> dict:
        return self._wrap(self.fmt.object, [self.fmt.choice(c) for c in out.outputs], usage=usage(out))
