"""The capstone, your engine: every part the reader wrote, plugged into one engine (after chapter 11).

Each exercise notebook wrote its part to ``your_engine/<module>.py``.
:func:`your_parts` loads them, probes each on the tiny model, and uses
minivllm's own where a part is missing or not written yet (a method its
exercise asks for still a stub, or inherited from minivllm's own class),
saying which; parts that subclass the same class (the scheduler's passes from
chapters 06, 09 and 10; the block manager of chapters 04 and 08) are combined
into one class, so the engine runs all of them at once. :func:`your_llm` builds the
engine so that every part is used: the offload tier (14) gets blocks to
hold, and on the CPU the graph runner (12) runs the padded decode batches
eagerly, as its exercise's check does. The grammar masker (19) acts only on
constrained requests: its probe runs one.
"""

from __future__ import annotations

from minivllm.config import default_device
from minivllm.engine import LLM
from minivllm.exercises._common import NOT_WRITTEN, unwritten
from minivllm.exercises.live import PARTS_DIR, drive, greedy, load_part
from minivllm.exercises.progress import PARTS, WHAT_WIDTH, Part
from minivllm.sampling_params import SamplingParams
from minivllm.structured_output import StructuredOutputsParams

__all__ = ["your_parts", "your_options", "your_llm", "speculation", "lineage"]


_PROBE = dict(block_size=4, num_blocks=24, max_num_seqs=3, max_num_batched_tokens=24, enable_chunked_prefill=True,
              max_prefill_chunk_size=8, enable_prefix_caching=True)
# chapter 17's part runs only with speculation on: the capstone turns it on with it (the probe's prompts repeat)
_WITH = {"spec_acceptor_cls": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                      "prompt_lookup_min": 2, "prompt_lookup_max": 4}}}


def _probe(part: Part, cls) -> str | None:
    """Why ``cls`` cannot stand in yet (not written, an error), or None: a short run of the tiny model with it
    alone (``cls`` as :func:`load_part` completes it)."""
    if unwritten(cls, part.methods):  # a method the probe may not reach (e.g. choose_victim without preemption)
        return NOT_WRITTEN
    requests = [(f"p{i}", [7, 7, 7, 7, 7, 7, 7, 7] + list(range(10 + i, 13 + 3 * i)), greedy(6)) for i in range(4)]
    try:
        if part.extension == "grammar_masker_cls":  # a masker acts on constrained rows only: the probe has one
            requests.append(("g", [7, 7, 7, 7, 7, 7, 7, 7, 10, 11], SamplingParams(
                temperature=0.0, max_tokens=6, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))))
        drive(your_llm("tiny-random", {part.extension: cls, **_WITH.get(part.extension, {})}, **_PROBE), requests,
              f"your {part.what}")
    except NotImplementedError:
        return NOT_WRITTEN
    except Exception as e:  # a failing part is reported, not used
        return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return None


def your_parts(parts: list[Part] = PARTS) -> dict[str, list]:
    """Every engine part the reader wrote that runs, by extension point; prints which chapter's part is used."""
    found: dict[str, list] = {}
    for part in (p for p in parts if p.extension):
        path = PARTS_DIR / part.file
        problem = "missing (run exercise {} first)".format(part.chapter) if not path.exists() else None
        cls = None if problem else load_part(part.module, part.name)
        problem = problem or _probe(part, cls)
        print(f"{part.chapter} {part.what:{WHAT_WIDTH}} "
              + ("yours" if problem is None else f"minivllm's: yours is {problem}"))
        if problem is None:
            found.setdefault(part.extension, []).append(cls)
    return found


def your_options(found: dict[str, list]) -> dict:
    """EngineConfig options with the reader's parts: same-kind parts combined into one class (later chapters first),
    minivllm's own class behind them for what no exercise of the reader's wrote. The C++ kernels (18) run on the
    CPU: an engine on a GPU keeps minivllm's there, and says so."""
    options = {}
    for extension, classes in found.items():
        if extension == "kernels" and default_device().type != "cpu":
            print(f"your kernels (18) run on the CPU: the engine on {default_device()} runs minivllm's own")
            continue
        if len(classes) == 1:
            options[extension] = classes[0]
        else:
            impl = classes[0]._exercise_part[0]  # what load_part completed them with, e.g. MiniScheduler
            raw = [c._exercise_raw for c in reversed(classes)]
            options[extension] = type(f"Your{impl.__mro__[1].__name__}", (*raw, impl), {})
        options.update(_WITH.get(extension, {}))
    return options


def your_llm(model: str, options: dict, **engine_options) -> LLM:
    """An ``LLM`` with the reader's parts (``options``) where each is used: a tier (14) of as many blocks as the
    pool, unless ``kv_offload_blocks`` is given; a graph runner (12) replayed eagerly on the CPU (a GPU captures it)."""
    if "offload_tier_cls" in options and not engine_options.get("kv_offload_blocks"):
        engine_options = {**engine_options, "kv_offload_blocks": engine_options.get("num_blocks") or 64,
                          "enable_prefix_caching": True}
    llm = LLM(model, **engine_options, **options)
    engine, runner = llm.engine, llm.engine.runner
    if "graph_runner_cls" in options and runner.graph_runner is None:
        if engine.config.torch_device.type == "cuda" or not runner.enable_decode_graphs(
                engine.config.max_num_seqs, engine.max_model_len, capture=False):
            print("your graph runner is not used: the attention backend does not declare "
                  "forward.skips_padding_slots = True (exercise 05), so no decode step is padded")
    return llm


def speculation(stats) -> str:
    """An engine's speculative-decoding counters (chapter 17), from its ``stats()``: drafts, acceptance, tokens per
    step."""
    return (f"{stats.spec_decode_num_drafts} drafts, {stats.spec_decode_num_accepted_tokens} of "
            f"{stats.spec_decode_num_draft_tokens} draft tokens accepted ({stats.spec_decode_acceptance_rate:.0%}), "
            f"{stats.spec_decode_mean_tokens_per_step:.2f} tokens per step")


def lineage(cls: type) -> str:
    """Whose methods an extension point's class runs, first to last: the reader's classes, then minivllm's own (the
    stubs :func:`~minivllm.exercises._common.complete` adds, and the combined class itself, left out)."""
    shown = [c for c in cls.__mro__[:-1] if not vars(c).get("_exercise_blanks") and "_exercise_part" not in vars(c)
             and c.__module__ != __name__]
    return " > ".join(f"{c.__module__.removeprefix('your_engine_')}.{c.__name__}" for c in shown)
