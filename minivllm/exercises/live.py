"""The live engine with a reader's parts plugged in (every chapter's exercise, and the capstone).

An exercise notebook writes the reader's part to ``your_engine/<part>.py``
(a ``%%writefile`` cell) and loads it with :func:`load_part`. The part has the
interface of minivllm's own (a subclass of ``BlockManager``, ``Scheduler``,
``PagedKVCache``, ``Sampler``, ...: the classes that declare it, whose
methods minivllm writes in ``MiniBlockManager``, ``MiniScheduler``, ...), so
:func:`check_live` puts it into an ``LLM`` through ``EngineConfig`` (the
extension points) and runs the real engine on the embedded model: invariants after every step, no leaked block,
and the same tokens as minivllm's own engine, or the first request and token
that differ.
"""

from __future__ import annotations

import importlib.util
import inspect
import pickle
import random
from pathlib import Path

from minivllm.engine import LLM
from minivllm.exercises._common import complete, say
from minivllm.exercises.native import build_part
from minivllm.exercises.parts import PARTS, PARTS_DIR
from minivllm.sampling_params import SamplingParams

__all__ = ["PARTS_DIR", "load_part", "SpawnablePart", "spawnable", "chat_prompts", "greedy", "drive", "check_live"]

TOPICS = ["the sea", "paged attention", "prime numbers", "a cat", "Paris", "rust and python", "the moon landing",
          "sourdough bread", "chess openings", "volcanoes", "jazz", "GPUs", "photosynthesis", "the Roman empire",
          "origami", "black holes"]
_references: dict = {}  # minivllm's own outputs, per (model, options, requests): computed once a session


def load_part(module: str, name: str, parts_dir: Path = PARTS_DIR):
    """``name`` from ``your_engine/<module>.py``, loaded afresh (so an edited part is picked up).

    A class part comes as the engine runs it (:func:`~minivllm.exercises._common.complete`): with minivllm's own
    behind it for the methods other exercises write, while each method of its own exercise is yours or raises
    "not written yet". A C++ part (``module`` a ``.cpp`` file, exercises 18 and 18b) comes built: its kernel table,
    or 18b's :class:`~minivllm.exercises.native.BlockDot`.
    """
    if module.endswith(".cpp"):
        return build_part(Path(parts_dir) / module)
    path = Path(parts_dir) / f"{module}.py"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run the %%writefile cell of that exercise first")
    spec = importlib.util.spec_from_file_location(f"your_engine_{module}", path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    part = getattr(loaded, name)
    found = next((p for p in PARTS if (p.module, p.name) == (module, name) and p.impl is not None), None)
    return complete(part, found.methods, found.impl) if found is not None and inspect.isclass(part) else part


class SpawnablePart:
    """``name`` of ``your_engine/<module>.py`` as a callable that pickles as its file and name.

    A spawned tensor-parallel rank (chapter 15) cannot import a module loaded
    from a path: it unpickles this and loads the reader's file itself, from the
    same folder (an absolute path: its working directory may differ).
    """

    def __init__(self, module: str, name: str, parts_dir: Path | str = PARTS_DIR):
        self.module, self.name, self.parts_dir = module, name, str(Path(parts_dir).resolve())
        self.fn = load_part(module, name, self.parts_dir)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        return SpawnablePart, (self.module, self.name, self.parts_dir)


def spawnable(part, what: str):
    """``part`` (a function or a class) as a spawned worker receives it: itself when it pickles, a
    :class:`SpawnablePart` when :func:`load_part` loaded it (from the folder its file is in; chapters 15, 16)."""
    try:
        pickle.dumps(part)
        return part
    except (pickle.PicklingError, AttributeError, TypeError):
        module = getattr(part, "__module__", "") or ""
        if module.startswith("your_engine_"):
            return SpawnablePart(module.removeprefix("your_engine_"), part.__name__, _folder(part))
        raise AssertionError(f"{what} must be defined at the top level of a module (or of a your_engine/ file "
                             "loaded with load_part): the worker processes import it") from None


def _folder(part) -> Path:
    """The folder of the file ``part`` was loaded from (a class's: its methods')."""
    for f in list(vars(part).values()) if inspect.isclass(part) else [part]:
        code = getattr(f, "__code__", None)
        if code is not None:
            return Path(code.co_filename).parent
    return PARTS_DIR


def chat_prompts(tokenizer, n: int = 16, seed: int = 0, note_words: tuple[int, int] = (100, 200)) -> list[list[int]]:
    """Chat prompts of mixed lengths: short questions, and every third one notes of ``note_words`` words (by
    default 100 to 200: several hundred tokens)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        body = f"Tell me about {topic}."
        if i % 3 == 2:
            notes = " ".join(rng.choice(TOPICS) for _ in range(rng.randint(*note_words)))
            body = f"Here are my notes on {topic}: {notes}. Summarise {topic}."
        text = tokenizer.apply_chat_template([{"role": "user", "content": body}], add_generation_prompt=True,
                                             tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy and exactly ``max_tokens`` tokens, so a run never depends on where EOS falls."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def drive(llm: LLM, requests, what: str = "the engine",
          texts: dict | None = None) -> tuple[dict[str, list[int]], list[list[tuple]]]:
    """Step ``llm``'s engine over ``(request id, prompt ids, params)`` until all finish.

    Returns each request's output tokens and the schedule: per step, its
    chunks as ``(request id, start, num_tokens)``. The block invariants are
    checked after every step and nothing may stay allocated at the end; a
    failure names the step. ``texts``, when given, collects each request's
    streamed ``delta_text`` of every output (chapter 07).
    """
    engine = llm.engine
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    outputs, schedule = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if texts is not None:
                texts.setdefault(out.request_id, []).append(out.outputs[0].delta_text)
            if out.finished:
                if out.error:
                    raise AssertionError(f"{what}: request {out.request_id} failed inside the engine: {out.error}")
                outputs[out.request_id] = out.outputs[0].token_ids
        schedule.append([(c.seq.request_id, c.start, c.num_tokens) for c in engine.last_schedule.chunks])
        try:
            engine.check_invariants()
        except AssertionError as e:
            raise AssertionError(f"{what}: after step {len(schedule)} the block pool is inconsistent: {e}") from None
        if len(schedule) > 20_000:
            raise AssertionError(f"{what}: no progress after {len(schedule)} steps: {engine.stats()}")
    bm = engine.block_manager
    if bm.num_free_blocks != bm.num_blocks or len(bm.free_cpu_blocks) != bm.num_cpu_blocks:
        raise AssertionError(f"{what}: every request finished but {bm.num_blocks - bm.num_free_blocks} blocks "
                             f"are still allocated (a leak: a freed sequence kept its blocks)")
    return outputs, schedule


def _reference(model: str, options: dict, requests):
    key = (model, tuple(sorted(options.items())),
           tuple((rid, tuple(p), repr(sp)) for rid, p, sp in requests))  # every param: seeds, top-k, top-p
    if key not in _references:
        texts = {}
        _references[key] = (*drive(LLM(model, **options), requests, "minivllm's engine", texts), texts)
    return _references[key]


def _first_difference(mine: list[list[tuple]], theirs: list[list[tuple]]) -> str | None:
    for step, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return f"step {step} runs {a} (request, start, tokens), minivllm's scheduler runs {b}"
    if len(mine) != len(theirs):
        return f"it takes {len(mine)} steps, minivllm's scheduler {len(theirs)}"
    return None


def _first_text_difference(mine: dict[str, list[str]], theirs: dict[str, list[str]]) -> str | None:
    for rid, want in theirs.items():
        got = mine.get(rid, [])
        for i, (a, b) in enumerate(zip(got, want)):
            if a != b:
                return (f"request {rid}'s streamed text differs at its output {i}: minivllm's engine streams {b!r}, "
                        f"yours {a!r} (the text so far: {''.join(want[:i])!r})")
        if len(got) != len(want):
            return f"request {rid} streamed {len(got)} outputs, minivllm's engine {len(want)}"
    return None


def check_live(what: str, requests, model: str = "smollm2-135m", parts: dict | None = None,
               tokenizer=None, same_schedule: bool = False, same_text: bool = False, **options) -> int:
    """Run the engine with ``parts`` (EngineConfig extension points) and compare it with minivllm's own.

    Returns the number of steps. Raises AssertionError naming the first
    request and output token that differ (or, with ``same_schedule``, the
    first step scheduled differently; with ``same_text``, the first streamed
    text delta that differs), a request that failed, a broken invariant or a
    leaked block.
    """
    texts = {}
    ours, schedule = drive(LLM(model, **options, **(parts or {})), requests, what, texts)
    expected, expected_schedule, expected_texts = _reference(model, options, requests)
    difference = _first_difference(schedule, expected_schedule) if same_schedule else None
    if difference:
        raise AssertionError(f"{what}: {difference}")
    steps = len(schedule)
    for rid, want in expected.items():
        got = ours[rid]
        if got != want:
            i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            show = (lambda t: f"{t} {tokenizer.decode([t])!r}") if tokenizer is not None else str
            expected_i = show(want[i]) if i < len(want) else "the end"
            got_i = show(got[i]) if i < len(got) else "the end"
            raise AssertionError(f"{what}: request {rid} differs from minivllm's engine at output token {i}: "
                                 f"expected {expected_i}, got {got_i}")
    text_difference = _first_text_difference(texts, expected_texts) if same_text else None
    if text_difference:
        raise AssertionError(f"{what}: {text_difference}")
    say(f"{what}: the live engine ({model}, {len(requests)} requests, {steps} steps) gave exactly minivllm's "
          f"tokens{' and streamed text' * same_text}; the block invariants held after every step and no block "
          f"leaked.")
    return steps
