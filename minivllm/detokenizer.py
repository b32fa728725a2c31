"""Incremental detokenization and stop strings for streaming (chapter 07).

Decoding one token at a time breaks words and multi-byte characters: a
UTF-8 character can span several tokens, and a tokenizer may merge spaces
with the previous token. Like vLLM, we re-decode a short window of recent
tokens and emit only the text that is complete: nothing ending in the
replacement character U+FFFD, which means "character not finished yet".

Stop strings are found by one Aho-Corasick automaton over all of a request's
stop strings (:class:`StopStrings`), fed each new character once: the time a
token takes does not grow with how many stop strings there are.
"""

from __future__ import annotations

import functools
from collections import deque


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
    """minivllm's own (the engine's default ``detokenizer``): re-decode a short window, emit what is
    complete."""

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


class StopStrings:
    """Every stop string of a request in one Aho-Corasick automaton (chapter 07).

    A trie of the strings, where each node also knows the longest proper
    suffix of its path that is in the trie (``fail``) and the longest stop
    string that ends its path (``ends``). Fed one character at a time it
    follows at most as many ``fail`` links, in all, as characters it was fed,
    whatever the number of stop strings. Built once per stop list
    (:func:`stop_strings` caches it) and shared by every sample of a request;
    each sample keeps only its current node.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.goto: list[dict[str, int]] = [{}]
        self.ends: list[str | None] = [None]
        for stop in stops:
            node = 0
            for ch in stop:
                if ch not in self.goto[node]:
                    self.goto[node][ch] = len(self.goto)
                    self.goto.append({})
                    self.ends.append(None)
                node = self.goto[node][ch]
            self.ends[node] = stop
        self.fail = [0] * len(self.goto)
        queue = deque(self.goto[0].values())  # breadth first: a node's fail link is shallower than the node
        while queue:
            node = queue.popleft()
            for ch, child in self.goto[node].items():
                self.fail[child] = self._next(self.fail[node], ch)
                self.ends[child] = self.ends[child] or self.ends[self.fail[child]]
                queue.append(child)
        self.longest = max(map(len, stops), default=0)

    def _next(self, node: int, ch: str) -> int:
        while node and ch not in self.goto[node]:
            node = self.fail[node]
        return self.goto[node].get(ch, 0)

    def scan(self, node: int, text: str) -> tuple[int, tuple[int, str] | None]:
        """Feed ``text`` from ``node``; returns the node reached and the stop string that starts first in what was
        fed so far and ends in ``text`` (its start in ``text``, negative if it began before), or None."""
        first = None
        for i, ch in enumerate(text):
            if first is not None and i + 1 - self.longest >= first[0]:
                break  # a stop string ending here or later starts after the one found
            node = self._next(node, ch)
            stop = self.ends[node]
            if stop is not None and (first is None or i + 1 - len(stop) < first[0]):
                first = (i + 1 - len(stop), stop)
        return node, first


@functools.lru_cache(maxsize=32)
def stop_strings(stops: tuple[str, ...]) -> StopStrings:
    """The automaton of a stop list, built once for the samples (and repeats) of a request."""
    return StopStrings(stops)


class OutputText:
    """One sample's text as the client sees it: incremental text, stop strings and the final flush (chapter 07).

    A stop string can only be recognised once all its characters exist, so
    while the sample runs the last ``longest stop - 1`` characters are held
    back (as vLLM does, unless the stop string is to be included); when a stop
    string appears the text ends before it (or after it, with
    ``include_stop``). The new characters alone are searched, by one automaton
    over every stop string (:class:`StopStrings`); of two stop strings the
    one that starts first wins (then the shorter). At the end the whole output
    is decoded once more, so a character still waiting for its last byte is
    not lost.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] = (), include_stop: bool = False,
                 detokenizer_cls=MiniIncrementalDetokenizer):
        self.tokenizer = tokenizer
        self.detokenizer = detokenizer_cls(tokenizer, prompt_token_ids)
        self.stop, self.include_stop = list(stop), include_stop
        self.matcher = stop_strings(tuple(self.stop)) if self.stop else None
        self.node = 0  # where the matcher is after the text searched so far
        self.searched = 0  # characters of the text the matcher has seen
        self.hold_back = self.matcher.longest - 1 if self.stop and not include_stop else 0
        self.end: int | None = None  # where the text was cut by a stop string
        self.sent = 0  # characters already handed to the client

    @property
    def full_text(self) -> str:
        return self.detokenizer.text if self.end is None else self.detokenizer.text[:self.end]

    def add(self, token_ids: list[int]) -> str | None:
        """Feed new tokens; returns the stop string they completed, if any (the sample must then stop)."""
        self.detokenizer.add(token_ids)
        if self.matcher is None:
            return None
        text, start = self.detokenizer.text, self.searched
        self.node, found = self.matcher.scan(self.node, text[start:])
        self.searched = len(text)
        if found is None:
            return None
        index, stop = start + found[0], found[1]
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
