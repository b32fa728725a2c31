"""Incremental detokenization for streaming (chapter 07).

Decoding one token at a time breaks words and multi-byte characters: a
UTF-8 character can span several tokens, and a tokenizer may merge spaces
with the previous token. Like vLLM, we re-decode a short window of recent
tokens and emit only the text that is complete: nothing ending in the
replacement character U+FFFD, which means "character not finished yet".
"""

from __future__ import annotations


class IncrementalDetokenizer:
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
        """Feed new tokens; returns the text they complete (possibly empty)."""
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
