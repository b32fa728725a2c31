"""Incremental detokenization and stop strings for streaming (chapter 07).

Decoding one token at a time breaks words and multi-byte characters: a
UTF-8 character can span several tokens, and a tokenizer may merge spaces
with the previous token. Like vLLM, we re-decode a short window of recent
tokens and emit only the text that is complete: nothing ending in the
replacement character U+FFFD, which means "character not finished yet".
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """One sample's text, token by token: the interface and shared state (an extension point,
    ``EngineConfig(detokenizer=...)``). Exercise 07 subclasses it and writes :meth:`add`; minivllm's own is
    :class:`MiniIncrementalDetokenizer`'s."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-6:])  # context so the first word decodes right
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text they complete (possibly empty), never half a character (U+FFFD),
        and appends it to ``self.text``. Exercise 07."""
        raise NotImplementedError("not written yet: IncrementalDetokenizer.add")


class MiniIncrementalDetokenizer(IncrementalDetokenizer):
    """minivllm's own (the engine's default ``detokenizer``): re-decode a short window, emit what is complete."""

    def add(self, token_ids: list[int]) -> str:
        delta = ""
        for tid in token_ids:
            self.tokens.append(tid)
            prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta


class OutputText:
    """One sample's text as the client sees it: incremental text, stop strings and the final flush (chapter 07).

    A stop string can only be recognised once all its characters exist, so
    while the sample runs the last ``longest stop - 1`` characters are held
    back (as vLLM does, unless the stop string is to be included); when a stop
    string appears the text ends before it (or after it, with
    ``include_stop``). At the end the whole output is decoded once more, so a
    character still waiting for its last byte is not lost.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] = (), include_stop: bool = False,
                 detokenizer_cls=MiniIncrementalDetokenizer):
        self.tokenizer = tokenizer
        self.detokenizer = detokenizer_cls(tokenizer, prompt_token_ids)
        self.stop, self.include_stop = list(stop), include_stop
        self.hold_back = max(map(len, self.stop)) - 1 if self.stop and not include_stop else 0
        self.end: int | None = None  # where the text was cut by a stop string
        self.sent = 0  # characters already handed to the client

    @property
    def full_text(self) -> str:
        return self.detokenizer.text if self.end is None else self.detokenizer.text[:self.end]

    def add(self, token_ids: list[int]) -> str | None:
        """Feed new tokens; returns the stop string they completed, if any (the sample must then stop)."""
        before = len(self.detokenizer.text)
        self.detokenizer.add(token_ids)
        text = self.detokenizer.text
        found = [(i, s) for s in self.stop if (i := text.find(s, max(0, before - len(s) + 1))) != -1]
        if not found:
            return None
        index, stop = min(found)
        self.end = index + len(stop) if self.include_stop else index
        return stop

    def finish(self, all_token_ids: list[int]) -> None:
        """The sample ended: decode its whole output once, to flush a character that was still incomplete."""
        if self.end is None:
            full = self.tokenizer.decode(all_token_ids, skip_special_tokens=True)
            if full.startswith(self.detokenizer.text):
                self.detokenizer.text = full

    def delta(self, finished: bool) -> str:
        """The text not yet sent that may be sent now (everything, once finished)."""
        text = self.full_text
        visible = text if finished else text[:max(self.sent, len(text) - self.hold_back)]
        delta, self.sent = visible[self.sent:], len(visible)
        return delta
