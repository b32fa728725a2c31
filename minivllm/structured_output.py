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

Hostile constraints: a schema keyword xgrammar would not enforce, or nesting
past :data:`MAX_SCHEMA_DEPTH`, is refused by name when the params are made;
a grammar compiles in :class:`GrammarBackend`'s bounded pool under a time
limit, never on a caller's thread; a grammar no token can begin is refused
when compiled, and a mask that later admits no token ends its request
(:class:`NoContinuation`).

Plan layer: pure Python. xgrammar is imported only when a constraint is
used, so everything else works without it; a constraint without it is a
``ValueError`` that says what to install (:data:`INSTALL`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from minivllm.config import check, is_text, shown

__all__ = ["StructuredOutputsParams", "GrammarBackend", "Grammar", "GrammarCompilesBusy", "NoContinuation",
           "import_xgrammar",
           "bitmask_words", "unsupported_json_feature", "INSTALL", "MAX_CONSTRAINT_CHARS", "MAX_CHOICES",
           "MAX_SCHEMA_DEPTH", "COMPILE_WORKERS", "MAX_COMPILES_IN_FLIGHT", "MAX_CACHED_GRAMMAR_BYTES",
           "COMPILE_TIMEOUT_S"]

INSTALL = "pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2"
MAX_CONSTRAINT_CHARS = 65536  # a constraint's text (a schema serialised, a regex, a grammar, the choices) at most
MAX_CHOICES = 1024
MAX_SCHEMA_DEPTH = 64  # a JSON schema nested deeper (objects and arrays) is refused before anything walks it
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept per engine, least recently used dropped first...
MAX_CACHED_GRAMMAR_BYTES = 256 << 20  # ...and at most this many bytes of them (xgrammar's memory_size_bytes)
COMPILE_WORKERS = 2  # threads compiling grammars, per engine (xgrammar releases the GIL while it compiles)
MAX_COMPILES_IN_FLIGHT = 8  # distinct constraints queued or compiling (timed-out ones still running count)
COMPILE_TIMEOUT_S = 30.0  # EngineConfig.structured_outputs_timeout_s's default
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
        check(self.json_object is None or isinstance(self.json_object, bool), "structured_outputs.json_object",
              "None, True or False", self.json_object)
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
            if len(value) > MAX_CONSTRAINT_CHARS:  # before parsing it
                raise ValueError(f"structured_outputs.json must be at most {MAX_CONSTRAINT_CHARS} characters, "
                                 f"got {len(value)}")
            if text_depth(value) > MAX_SCHEMA_DEPTH:  # before parsing: json.loads recurses as deep as the text
                raise ValueError(DEPTH_MESSAGE)
            try:
                value = json.loads(value)
            except RecursionError:  # the parser's own limit (sys.getrecursionlimit): past ours in any case
                raise ValueError(DEPTH_MESSAGE) from None
            except ValueError as e:
                raise ValueError(f"structured_outputs.json must be a JSON schema, but it is not JSON: {e}") from None
        check(isinstance(value, dict), "structured_outputs.json", "a JSON schema (an object, as a dict or text)",
              value)
        _check_depth(value)
        found = unsupported_json_feature(value)
        if found is not None:
            raise ValueError(f"structured_outputs.json {found}")
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


def nesting_depth(value, limit: int) -> int:
    """How deep ``value`` nests dicts and lists (1: a flat one), counted without recursion and only up to
    ``limit + 1``, so any depth is safe to ask about."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def text_depth(text: str) -> int:
    """How deep JSON text nests its objects and arrays (brackets inside strings not counted), without parsing it."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


DEPTH_MESSAGE = (f"structured_outputs.json must nest objects and arrays at most {MAX_SCHEMA_DEPTH} deep "
                 f"(MAX_SCHEMA_DEPTH), got a deeper schema")


def _check_depth(schema) -> None:
    if nesting_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ValueError(DEPTH_MESSAGE)


# What xgrammar does not enforce: vLLM's xgrammar backend refuses a schema with any of these
# (``has_xgrammar_unsupported_json_features``, vllm/v1/structured_output/backend_xgrammar.py at vLLM commit
# 030141c: multipleOf, uniqueItems, contains, minContains, maxContains, an unsupported string
# format, a pattern or format beside minLength/maxLength, propertyNames beside properties, patternProperties
# beside properties or more than one). minivllm refuses them wherever they stand (vLLM only under the matching
# "type"), and also what xgrammar 0.2.9 accepts and then ignores: "not", "if"/"then"/"else",
# "dependentSchemas"/"dependentRequired", an allOf of several schemas (json_schema_converter.cc: "Support for
# allOf with multiple options is still ongoing"), a $ref outside the schema (it warns and allows anything),
# and an empty "type" list.
UNSUPPORTED_KEYWORDS = ("multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "not", "if",
                        "then", "else", "dependentSchemas", "dependentRequired")
STRING_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                            "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
                  "propertyNames", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def unsupported_json_feature(schema: dict) -> str | None:
    """Why xgrammar would not enforce ``schema`` (the keyword and where it is), or None (chapter 19)."""
    stack = [(schema, "#")]
    while stack:
        node, at = stack.pop()
        if not isinstance(node, dict):
            continue
        for keyword in UNSUPPORTED_KEYWORDS:
            if keyword in node and not (keyword == "uniqueItems" and node[keyword] is False):
                return f'uses "{keyword}" (at {at}), which xgrammar does not enforce'
        for keyword in COUNT_KEYWORDS:
            value = node.get(keyword)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                return f'has "{keyword}" {shown(value)} (at {at}); it must be an integer >= 0'
        if node.get("type") == []:
            return f'has an empty "type" list (at {at}), which no value satisfies'
        if "format" in node and node["format"] not in STRING_FORMATS:
            return f'uses "format" {shown(node["format"])} (at {at}), which xgrammar does not enforce'
        if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
            return f'has "pattern" or "format" beside "minLength"/"maxLength" (at {at}); xgrammar drops the lengths'
        if "propertyNames" in node and ("properties" in node or "patternProperties" in node
                                        or isinstance(node.get("additionalProperties"), dict)):
            return f'has "propertyNames" beside "properties" (at {at}), which xgrammar does not enforce together'
        if isinstance(node.get("patternProperties"), dict) and ("properties" in node
                                                                or len(node["patternProperties"]) > 1):
            return f'has "patternProperties" beside "properties" or several patterns (at {at}), which xgrammar ' \
                   f'does not enforce together'
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f'has an "allOf" of {len(node["allOf"])} schemas (at {at}), which xgrammar does not intersect'
        ref = node.get("$ref")
        if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
            return f'has a "$ref" outside the schema, {shown(ref)} (at {at}), which cannot be resolved here'
        for keyword in _SCHEMA_MAPS:
            if isinstance(node.get(keyword), dict):
                stack.extend((v, f"{at}/{keyword}/{k}") for k, v in node[keyword].items())
        for keyword in _SCHEMA_VALUES:
            stack.append((node.get(keyword), f"{at}/{keyword}"))
        for keyword in _SCHEMA_LISTS:
            if isinstance(node.get(keyword), list):
                stack.extend((v, f"{at}/{keyword}/{i}") for i, v in enumerate(node[keyword]))
    return None


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


class CompilePool:
    """At most ``workers`` daemon threads running queued calls, each call's result a ``Future``: a compile
    xgrammar cannot stop never holds up the process's exit (a ``ThreadPoolExecutor`` joins its threads at exit),
    and a thread ends when the queue is empty (a dropped engine leaves none behind)."""

    def __init__(self, workers: int, name: str):
        self.workers, self.name = workers, name
        self._queue: deque = deque()
        self._running = 0
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> Future:
        future = Future()
        with self._lock:
            self._queue.append((future, fn, args))
            if self._running < self.workers:
                self._running += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self._running}", daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running -= 1
                    return
                future, fn, args = self._queue.popleft()
            if not future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            try:
                result = fn(*args)
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        """Cancel what is queued (a running call ends on its own)."""
        with self._lock:
            queued, self._queue = list(self._queue), deque()
        for future, _, _ in queued:
            future.cancel()


class NoContinuation(ValueError):
    """A constrained sample's grammar allows no next token (its mask is empty, and it may not end here)."""

    def __init__(self):
        super().__init__("structured_outputs admits no continuation of the output so far: the constraint's "
                         "grammar allows no next token here")


class GrammarCompilesBusy(ValueError):
    """Too many distinct constraints are compiling already (:data:`MAX_COMPILES_IN_FLIGHT`): retry later (a 429)."""


class GrammarBackend:
    """xgrammar over one tokenizer (vLLM's ``XgrammarBackend``): the vocabulary's token strings and stop tokens
    (``TokenizerInfo``), the compiler, and the compiled grammars (chapter 19).

    Compiling takes from milliseconds to minutes (``'.*' * 300`` as a regex: seconds, growing with the square
    of its length), so it never runs on a caller's thread: :meth:`submit` hands it to a pool of
    :data:`COMPILE_WORKERS` threads and returns a future, while the request waits in a state of its own
    (``SequenceStatus.WAITING_FOR_GRAMMAR``) and the others run. As in vLLM (commit 00b6063, v0.11), whose
    ``StructuredOutputManager.grammar_init`` (``vllm/v1/structured_output/__init__.py``) submits
    ``_async_create_grammar`` to a ``ThreadPoolExecutor`` of half the CPUs, and whose scheduler leaves a
    request in ``RequestStatus.WAITING_FOR_FSM`` (``vllm/v1/request.py``) until that future is done. vLLM
    has no time limit, no bound on the queue and no dedupe of equal constraints in flight; minivllm adds them. Identical
    constraints in flight share one compile (keyed by :attr:`StructuredOutputsParams.key`); the compiled
    grammars are cached, least recently used dropped first, at most :data:`MAX_CACHED_GRAMMARS` of them and
    :data:`MAX_CACHED_GRAMMAR_BYTES` in all (xgrammar's ``CompiledGrammar.memory_size_bytes``).

    xgrammar's compile cannot be interrupted: a request whose grammar takes longer than
    ``compile_timeout_s`` ends with that error (its waiter gives up), and the worker is free only when the
    compile ends. So at most :data:`MAX_COMPILES_IN_FLIGHT` distinct constraints may be queued or compiling,
    timed-out ones included; past that a new one is refused at once (:class:`GrammarCompilesBusy`) rather
    than queued behind them. A flood of slow constraints can keep the compile workers busy, but no plain
    request, cached constraint, engine step or event loop ever waits on them. A compile nobody waits for
    any more (:meth:`release`) is cancelled if it has not started."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, max_rollback_tokens: int = 0,
                 compile_timeout_s: float = COMPILE_TIMEOUT_S):
        xgr = self.xgr = import_xgrammar()
        self.vocab_size = vocab_size
        self.max_rollback_tokens = max_rollback_tokens
        self.compile_timeout_s = compile_timeout_s
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[tuple, tuple[object, int]] = OrderedDict()  # key -> (grammar, its bytes)
        self.cached_bytes = 0
        self._in_flight: dict[tuple, Future] = {}
        self._waiters: dict[tuple, int] = {}  # callers still waiting for each in-flight compile
        self._lock = threading.RLock()  # RLock: a cancelled future runs its callback in the cancelling thread
        self._pool = CompilePool(COMPILE_WORKERS, "minivllm-grammar")
        self.num_compiled = 0  # compilations made (cache misses)

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``params``' constraint, as a future: done at once if cached, the compile
        already in flight for an equal constraint, or a new one in the pool. Its error, if it fails, is a
        ValueError naming ``structured_outputs``. Each caller of a future not yet done calls :meth:`release`
        once when it stops waiting. Raises :class:`GrammarCompilesBusy` when the pool is full."""
        key = params.key
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                done = Future()
                done.set_result(self._compiled[key][0])
                return done
            future = self._in_flight.get(key)
            if future is not None:
                self._waiters[key] += 1
                return future
            if len(self._in_flight) >= MAX_COMPILES_IN_FLIGHT:
                raise GrammarCompilesBusy(
                    f"structured_outputs cannot be compiled now: {MAX_COMPILES_IN_FLIGHT} other constraints "
                    f"are compiling (MAX_COMPILES_IN_FLIGHT); retry later")
            future = self._in_flight[key] = self._pool.submit(self.build, key)
            self._waiters[key] = 1
            future.add_done_callback(lambda f, key=key: self._finished(key, f))  # after: it may run at once, here
            return future

    def release(self, params: StructuredOutputsParams, future: Future) -> None:
        """A caller of :meth:`submit` stops waiting for ``future``; the last one cancels it if it has not
        started (a started compile runs on: xgrammar cannot stop it; its grammar is cached)."""
        key = params.key
        with self._lock:
            if self._in_flight.get(key) is not future:
                return
            self._waiters[key] -= 1
            if self._waiters[key] <= 0:
                future.cancel()

    def _finished(self, key: tuple, future: Future) -> None:
        with self._lock:
            if self._in_flight.get(key) is future:
                del self._in_flight[key]
                self._waiters.pop(key, None)
            if future.cancelled() or future.exception() is not None:
                return
            compiled = future.result()
            size = int(getattr(compiled, "memory_size_bytes", 0))
            self.num_compiled += 1
            if size > MAX_CACHED_GRAMMAR_BYTES:
                return  # its own requests use it; no cache would hold it
            self._compiled[key] = (compiled, size)
            self.cached_bytes += size
            while len(self._compiled) > MAX_CACHED_GRAMMARS or self.cached_bytes > MAX_CACHED_GRAMMAR_BYTES:
                self.cached_bytes -= self._compiled.popitem(last=False)[1][1]

    def build(self, key: tuple):
        """Compile one constraint (in a pool worker): xgrammar's ``CompiledGrammar``, or a ValueError naming it.
        A grammar no token can begin (``regex="[^\\s\\S]"``, ``root ::= root``) admits no output: refused."""
        try:
            compiled = self.compiler.compile_grammar(_parse(key))
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"structured_outputs.{key[0]} could not be compiled: {_library_message(e)}") from None
        if not self.admits_a_token(self.xgr.GrammarMatcher(compiled)):
            raise ValueError(f"structured_outputs.{key[0]} admits no output: no token can begin it")
        return compiled

    def admits_a_token(self, matcher) -> bool:
        """Whether ``matcher``'s next-token mask allows any token (EOS counts where the grammar may end)."""
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())

    def compile(self, params: StructuredOutputsParams, timeout: float | None = None):
        """The compiled grammar of ``params``' constraint, waiting for it here (at most ``timeout`` seconds)."""
        future = self.submit(params)
        try:
            return future.result(timeout)
        finally:
            self.release(params, future)

    def timeout_error(self, params: StructuredOutputsParams) -> str:
        return (f"structured_outputs.{params.kind} took longer to compile than the limit of "
                f"{self.compile_timeout_s:g} s (EngineConfig.structured_outputs_timeout_s)")

    def grammar(self, params: StructuredOutputsParams, compiled=None) -> Grammar:
        """A fresh matcher for one sample of a request (of ``compiled``, or the constraint compiled here)."""
        compiled = self.compile(params) if compiled is None else compiled
        return Grammar(self.xgr.GrammarMatcher(compiled, max_rollback_tokens=self.max_rollback_tokens))

    def shutdown(self) -> None:
        """Stop taking compiles; queued ones are cancelled (a running one ends on its own)."""
        self._pool.shutdown()

    def __repr__(self) -> str:
        return (f"GrammarBackend(xgrammar, vocab_size={self.vocab_size}, cached={len(self._compiled)}, "
                f"in_flight={len(self._in_flight)})")
