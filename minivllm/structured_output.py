"""Structured outputs: a constraint compiled to a grammar over tokens, one matcher per sample (chapter 19).

A request asks for output a program can parse (vLLM's
``StructuredOutputsParams``: a JSON schema, JSON mode, a regex, a choice
among strings, an EBNF grammar). A grammar library (xgrammar, vLLM's
default backend) compiles the constraint once against the tokenizer's
vocabulary; each sample then gets a *matcher*, an automaton over tokens
whose state is the output so far. Every step the matcher fills a bitmask of
the tokens that may come next (bit ``t % 32`` of 32-bit word ``t // 32``,
set: allowed), the model runner sets the others' logits to -inf before
sampling (``sampler.apply_token_bitmask``), and the scheduler advances the
matcher with each token it appends. Under speculative decoding the runner
advances it through a row's drafts to fill each position's mask and rolls it
back; the accepted tokens then advance it for real. EOS is among the
allowed tokens only where the grammar may end (xgrammar's stop tokens are
the engine's EOS ids).

vLLM's split is the same: ``vllm/v1/structured_output/backend_xgrammar.py``
(``XgrammarBackend.compile_grammar``, ``XgrammarGrammar``: ``accept_tokens``,
``rollback``, ``fill_bitmask``, ``is_terminated``), the bitmask filled by
``StructuredOutputManager.grammar_bitmask`` (``vllm/v1/structured_output/__init__.py``,
drafts included) and applied to the logits by ``apply_grammar_bitmask``
(``vllm/v1/structured_output/utils.py``) in the GPU model runner.

Plan layer: pure Python. xgrammar is imported only when a constraint is
used, so everything else works without it; a constraint without it is a
``ValueError`` that says what to install (:data:`INSTALL`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from minivllm.config import check, is_text

__all__ = ["StructuredOutputsParams", "GrammarBackend", "Grammar", "import_xgrammar", "bitmask_words", "INSTALL",
           "MAX_CONSTRAINT_CHARS", "MAX_CHOICES"]

INSTALL = "pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2"
MAX_CONSTRAINT_CHARS = 65536  # a constraint's text (a schema serialised, a regex, a grammar, the choices) at most
MAX_CHOICES = 1024
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept per engine, least recently used dropped first
KINDS = ("json", "regex", "choice", "grammar", "json_object")
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # JSON mode is this schema, as in vLLM
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " before its message


def import_xgrammar():
    """The xgrammar module, or a ValueError naming ``structured_outputs`` and the command that installs it."""
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(f"structured_outputs needs the xgrammar package, which is not installed here: {INSTALL} "
                         f"(--no-deps: its triton dependency is of no use on a CPU)") from e
    return xgrammar


def _library_message(error: Exception) -> str:
    """xgrammar's error without its source location (first line only)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _XGR_PREFIX.sub("", first)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are xgrammar's EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a JSON schema, dict or text), ``regex``,
    ``choice`` (a list of strings), ``grammar`` (EBNF, xgrammar's GBNF dialect) or ``json_object=True`` (any
    JSON object); ``disable_any_whitespace`` makes JSON compact (no optional whitespace, so a model cannot
    stall in it). Validated on creation by the grammar library: a bad schema, regex or grammar is a
    ``ValueError`` naming ``structured_outputs`` and the field (chapter 19). Frozen: the engine compiles
    :attr:`key`, the constraint as it was when checked."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        check(self.json_object in (None, True, False), "structured_outputs.json_object", "None, True or False",
              self.json_object)
        given = [k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)]
        check(len(given) == 1, "structured_outputs", "exactly one of json, regex, choice, grammar, json_object=True",
              given)
        check(isinstance(self.disable_any_whitespace, bool), "structured_outputs.disable_any_whitespace",
              "True or False", self.disable_any_whitespace)
        kind = given[0]
        spec = getattr(self, "_spec_" + kind)()
        if len(spec) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"structured_outputs.{kind} must be at most {MAX_CONSTRAINT_CHARS} characters, "
                             f"got {len(spec)}")
        key = (kind, spec, self.disable_any_whitespace)
        _parse(key)
        object.__setattr__(self, "key", key)

    @property
    def kind(self) -> str:
        return self.key[0]

    def _spec_json(self) -> str:
        value = self.json
        if isinstance(value, str):
            check(is_text(value), "structured_outputs.json", "valid Unicode text", value)
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json must be a JSON schema, but it is not JSON: {e}") from None
        check(isinstance(value, dict), "structured_outputs.json", "a JSON schema (an object, as a dict or text)",
              value)
        try:
            return json.dumps(value, allow_nan=False, ensure_ascii=False)  # its own key order: the output follows it
        except (TypeError, ValueError, RecursionError) as e:
            raise ValueError(f"structured_outputs.json must be a JSON schema, but it cannot be written as JSON: "
                             f"{e}") from None

    def _spec_json_object(self) -> str:
        return JSON_OBJECT_SCHEMA

    def _spec_regex(self) -> str:
        check(is_text(self.regex) and self.regex != "" and "\x00" not in self.regex, "structured_outputs.regex",
              "a non-empty string without NUL characters", self.regex)
        return self.regex

    def _spec_choice(self) -> str:
        value = self.choice
        if isinstance(value, (list, tuple)) and len(value) > MAX_CHOICES:
            raise ValueError(f"structured_outputs.choice must be at most {MAX_CHOICES} strings, got {len(value)}")
        check(isinstance(value, (list, tuple)) and len(value) > 0 and all(is_text(c) and c for c in value),
              "structured_outputs.choice", "a non-empty list of non-empty strings", value)
        return choice_grammar(list(value))

    def _spec_grammar(self) -> str:
        check(is_text(self.grammar) and self.grammar.strip() != "" and "\x00" not in self.grammar,
              "structured_outputs.grammar", "a non-empty EBNF grammar (text) with a root rule", self.grammar)
        return self.grammar


def _parse(key: tuple):
    """The constraint as xgrammar's ``Grammar`` (no tokenizer needed): a bad one is a ValueError naming it."""
    xgr = import_xgrammar()
    kind, spec, compact = key
    try:
        if kind in ("json", "json_object"):
            return xgr.Grammar.from_json_schema(spec, any_whitespace=not compact)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        return xgr.Grammar.from_ebnf(spec)
    except Exception as e:  # xgrammar raises RuntimeError (and TypeError, ValueError) with the parser's message
        what = {"json": "a JSON schema xgrammar supports", "json_object": "JSON mode", "regex": "a valid regex",
                "choice": "a list of strings", "grammar": "a valid EBNF grammar"}[kind]
        raise ValueError(f"structured_outputs.{kind} must be {what}: {_library_message(e)}") from None


def bitmask_words(vocab_size: int) -> int:
    """32-bit words of one row's bitmask: one bit per token of the model's vocabulary."""
    return (vocab_size + 31) // 32


class Grammar:
    """One sample's matcher (vLLM's ``XgrammarGrammar``): the grammar's state after the sample's output so far.

    :meth:`accept` advances it by a token (False: the grammar refuses it),
    :meth:`rollback` undoes the last tokens (drafts, chapter 17), and
    :meth:`fill_bitmask` writes the next token's allowed set into a row of a
    bitmask (a tensor the model runner owns). Once it accepted a stop token
    (EOS where the grammar may end) it is terminated: the sample is done.
    """

    def __init__(self, matcher):
        self.matcher = matcher
        self.num_accepted = 0  # tokens it holds (the sample's output tokens, plus drafts while filling masks)

    def accept(self, token: int) -> bool:
        if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
            return False
        self.num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        check(0 <= num_tokens <= self.num_accepted, "num_tokens", f"in [0, {self.num_accepted}]", num_tokens)
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Row ``row`` of ``bitmask`` (int32, ``[rows, bitmask_words(vocab)]``): the tokens allowed next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """Whether the output so far is a whole sentence of the grammar (so EOS is allowed now)."""
        return self.matcher.is_completed()

    def valid_prefix(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts from here, state unchanged (drafts are trimmed to
        it before they are scheduled, as vLLM's ``validate_tokens``)."""
        kept = 0
        for token in tokens:
            if not self.accept(token):
                break
            kept += 1
        self.rollback(kept)
        return list(tokens[:kept])


class GrammarBackend:
    """xgrammar over one tokenizer (vLLM's ``XgrammarBackend``): the vocabulary's token strings and stop tokens
    (``TokenizerInfo``), the compiler, and the compiled grammars, cached by constraint (LRU,
    :data:`MAX_CACHED_GRAMMARS`), so each distinct constraint compiles once. Thread-safe: the server compiles a
    request's constraint in a worker thread before it is queued, off the engine loop."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, max_rollback_tokens: int = 0):
        xgr = self.xgr = import_xgrammar()
        self.vocab_size = vocab_size
        self.max_rollback_tokens = max_rollback_tokens
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations made (cache misses)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params``' constraint (cached); a ValueError naming it if it fails."""
        key = params.key
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        try:
            compiled = self.compiler.compile_grammar(_parse(key))
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"structured_outputs.{key[0]} could not be compiled: {_library_message(e)}") from None
        with self._lock:
            self._compiled[key] = compiled
            self.num_compiled += 1
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher for one sample of a request."""
        return Grammar(self.xgr.GrammarMatcher(self.compile(params), max_rollback_tokens=self.max_rollback_tokens))

    def __repr__(self) -> str:
        return f"GrammarBackend(xgrammar, vocab_size={self.vocab_size}, cached={len(self._compiled)})"

