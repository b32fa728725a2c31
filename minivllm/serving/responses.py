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

__all__ = ["usage", "sse", "DONE", "CompletionFormat", "ChatFormat", "StreamState"]

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
            if c.finish_reason:
                self.done.add(c.index)
            choices.append(self.fmt.delta(c))
        return choices

    def usage_chunk(self, out: RequestOutput) -> dict:
        return self._wrap(self.fmt.chunk_object, [], usage=usage(out))

    def response(self, out: RequestOutput) -> dict:
        return self._wrap(self.fmt.object, [self.fmt.choice(c) for c in out.outputs], usage=usage(out))
