"""Chapter 12, where the time goes: the check of the reader's ``load`` (a ``DecodeGraphRunner`` subclass), which
writes a decode step into the static buffers that CUDA graphs replay, padding rows included. Targeted steps on
``tiny-random``'s pool (the bucket, the real rows, padding that writes only the scratch slot, no stale slot from an
earlier step, buffers kept in place), then the live engine (``graph_runner_cls``): CUDA graphs on a GPU, their
eager replay on the CPU.
"""

from __future__ import annotations

import torch

from minivllm.attention import MiniPagedKVCache
from minivllm.cuda_graphs import MiniDecodeGraphRunner, bucket_for
from minivllm.engine import LLM
from minivllm.exercises._common import own_part, say
from minivllm.exercises.live import chat_prompts, drive
from minivllm.model_runner import StepInputs
from minivllm.models import load_model, load_tokenizer
from minivllm.sampling_params import SamplingParams

__all__ = ["check_graph_runner", "METHODS"]

METHODS = ("load",)  # what exercise 12 writes

NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN = 24, 4, 64
BUFFERS = ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables")
_models: dict = {}
_live_references: dict = {}  # minivllm's runner in the live engine, per options: computed once a session


def _tiny():
    if "tiny" not in _models:
        _models["tiny"] = load_model("tiny-random", torch.device("cpu"), torch.float32)[0]
    return _models["tiny"]


def _step(rows: list[tuple[int, int, list[int]]]) -> StepInputs:
    """A decode step: per row (token id, its position, its block table); the token's slot follows from them."""
    ids, positions, tables = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for _, p, t in rows]
    return StepInputs(ids, positions, slots, tables, [p + 1 for p in positions], [1] * len(rows),
                      list(range(len(rows))))


def _rows(n: int, first_block: int, position: int = 6, token: int = 7) -> list:
    """``n`` rows, row i holding blocks ``first_block + 2i`` and ``first_block + 2i + 1``, decoding at ``position``."""
    return [(token + i, position, [first_block + 2 * i, first_block + 2 * i + 1]) for i in range(n)]


# (what, max_num_seqs, steps): each step runs after the ones before it on the same runner
_CASES = [
    ("a batch of 3 on sizes (1, 2, 4, 8): one padding row", 8, [_rows(3, 1)]),
    ("a batch of 4, then a batch of 3 (the fourth sequence finished; its blocks may go to another sequence)", 8,
     [_rows(4, 1), _rows(3, 11)]),
    ("a batch of 8, then a batch of 5: three padding rows after three real ones", 8, [_rows(8, 1), _rows(5, 2)]),
    ("a batch of 5 with max_num_seqs=6: the captured sizes are (1, 2, 4, 6)", 6, [_rows(5, 1)]),
    ("a full batch of 8, then a batch of 1", 8, [_rows(8, 1), _rows(1, 17)]),
    ("tables of different lengths (1, 3 and 2 blocks) after a step with long tables", 4,
     [[(5, 10, [1, 2, 3]), (6, 10, [4, 5, 6]), (7, 10, [7, 8, 9]), (8, 10, [10, 11, 12])],
      [(5, 2, [13]), (6, 9, [14, 15, 16]), (7, 5, [17, 18])]]),
]


def _fail(what: str, problem: str, hint: str = "") -> None:
    raise AssertionError(f"{what}: {problem}" + (f"; {hint}" if hint else ""))


def _check_in_place(runner, ptrs: dict, what: str) -> None:
    for name in BUFFERS:
        if getattr(runner, name).data_ptr() != ptrs[name]:
            _fail(what, f"self.{name} is a new tensor after load",
                  f"write into the static buffers in place (self.{name}[:b].copy_(...)): a CUDA graph replays "
                  "the addresses it recorded, so a new tensor is never read and the graph runs the old step again")


def _check_real_rows(runner, inputs: StepInputs, what: str) -> None:
    n = len(inputs.query_lens)
    given = {"input_ids": "token_ids", "positions": "positions", "slot_mapping": "slot_mapping",
             "context_lens": "context_lens"}  # buffer: the field of StepInputs it holds
    for name, field in given.items():
        got, want = getattr(runner, name)[:n].tolist(), getattr(inputs, field)
        if got != want:
            _fail(what, f"self.{name}[:{n}] is {got}, expected {want}",
                  f"row i is the step's i-th sequence: self.{name}[i] = inputs.{field}[i]")
    for i, table in enumerate(inputs.block_tables):
        got = runner.block_tables[i, :len(table)].tolist()
        if got != table:
            _fail(what, f"row {i}'s block table starts {got}, expected {table}",
                  "each row's table goes at the start of its row of self.block_tables")


def _check_padding(runner, inputs: StepInputs, b: int, earlier_slots: set, what: str) -> None:
    n = len(inputs.query_lens)
    for r in range(n, b):
        slot, ctx, pos = (int(getattr(runner, name)[r]) for name in ("slot_mapping", "context_lens", "positions"))
        if slot != -1:
            if slot in earlier_slots:
                hint = (f"the padding row kept the slot of an earlier step: rewrite every row up to b before each "
                        "replay, -1 for each padding row (the rule against freeing blocks out of step with graph "
                        f"slots: block {slot // BLOCK_SIZE} may belong to another sequence now)")
            elif slot >= 0:
                hint = (f"slot {slot} is a real slot of block {slot // BLOCK_SIZE}, which some sequence may own: a "
                        "padding row's slot is -1, which the KV pool sends to a scratch slot no block table reaches")
            else:
                hint = "a padding row's slot is -1 (the scratch slot)"
            _fail(what, f"padding row {r} has slot {slot}", hint)
        if ctx < 1:
            _fail(what, f"padding row {r} has context length {ctx}",
                  "a row with no key to attend to divides 0 by 0 in its softmax (NaN); give padding rows context "
                  "length 1: they read one key of block 0 and write nothing")
        if not 0 <= pos < MAX_MODEL_LEN:
            _fail(what, f"padding row {r} has position {pos}", "a position the model has (0 will do)")
    tables = runner.block_tables[:b]
    if tables.min() < 0 or tables.max() >= NUM_BLOCKS:
        bad = tables[(tables < 0) | (tables >= NUM_BLOCKS)][0].item()
        _fail(what, f"self.block_tables[:{b}] holds block id {bad}",
              f"the attention reads whole rows of the table: every entry must be a block of the pool (pad with "
              f"0, not -1)")


def _check_pool(cache, before: torch.Tensor, inputs: StepInputs, what: str) -> None:
    changed = set((cache.k_slots[0] != before).any(-1).any(-1).nonzero().flatten().tolist())
    real = set(inputs.slot_mapping)
    stray = sorted(changed - real - {cache.scratch_slot})
    if stray:
        _fail(what, f"the padded forward wrote KV slots {stray}, which are no real row's slot of this step",
              "only the step's own slots and the scratch slot may change")


def _check_case(cls, what: str, max_num_seqs: int, steps) -> None:
    model = _tiny()
    cache = MiniPagedKVCache.for_model(model, NUM_BLOCKS, BLOCK_SIZE)
    runner = cls(model, cache, BLOCK_SIZE, max_num_seqs, MAX_MODEL_LEN,
                 model.config.num_attention_heads // model.config.num_key_value_heads)
    ptrs = {name: getattr(runner, name).data_ptr() for name in BUFFERS}
    earlier: set = set()
    for i, rows in enumerate(steps):
        inputs = _step(rows)
        label = what if len(steps) == 1 else f"{what}, step {i + 1}"
        n = len(rows)
        try:
            b = runner.load(inputs)
        except Exception as e:
            raise AssertionError(f"{label}: load raised {type(e).__name__}: {e} (the buffers hold "
                                 f"{runner.sizes[-1]} rows, the largest captured size)") from e
        want = bucket_for(n, runner.sizes)
        if b != want:
            _fail(label, f"load returned {b} for a batch of {n} with captured sizes {tuple(runner.sizes)}",
                  f"run the smallest captured size that holds the batch, {want} (bucket_for(n, self.sizes)): "
                  "a graph exists only for those sizes" + (", and the largest is max_num_seqs" if b > want else ""))
        _check_in_place(runner, ptrs, label)
        _check_real_rows(runner, inputs, label)
        _check_padding(runner, inputs, b, earlier - set(inputs.slot_mapping), label)
        before = cache.k_slots[0].clone()
        with torch.inference_mode():
            hidden = runner._forward(b)[:n]
        _check_pool(cache, before, inputs, label)
        if not torch.isfinite(hidden).all():
            _fail(label, "the real rows' hidden states are not finite", "a padding row must not disturb them")
        earlier |= set(inputs.slot_mapping)


def _live_requests(tok) -> list:
    """Five short chat prompts that finish one by one, so the decode batch takes every size from 5 down to 1."""
    prompts = chat_prompts(tok, 8)
    short = [p for i, p in enumerate(prompts) if i % 3 != 2][:5]  # the short chat prompts
    return [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=3 + 3 * i, ignore_eos=True))
            for i, p in enumerate(short)]


def _run(cls, options: dict, requests, what: str) -> tuple[dict, list, int]:
    llm = LLM("smollm2-135m", **options, graph_runner_cls=cls)
    runner = llm.engine.runner
    if runner.graph_runner is None:  # the CPU: the same padded batches, replayed eagerly
        assert runner.enable_decode_graphs(options["max_num_seqs"], llm.engine.max_model_len, capture=False)
    graphs, sizes = runner.graph_runner, []
    load = graphs.load
    graphs.load = lambda inputs: sizes.append((len(inputs.query_lens), load(inputs))) or sizes[-1][1]
    outputs, _ = drive(llm, requests, what)
    return outputs, sizes, graphs.num_replays


def _check_live(cls, tok) -> str:
    options = dict(block_size=BLOCK_SIZE, num_blocks=120, max_num_seqs=6)  # sizes (1, 2, 4, 6): 5 and 3 are padded
    requests = _live_requests(tok)
    key = tuple(sorted(options.items()))
    if key not in _live_references:
        _live_references[key] = _run(MiniDecodeGraphRunner, options, requests, "minivllm's graph runner")
    expected, expected_sizes, _ = _live_references[key]
    what = "your graph runner in the live engine"
    outputs, sizes, replays = _run(cls, options, requests, what)
    for rid, want in expected.items():
        if outputs[rid] != want:
            i = next((i for i, (a, b) in enumerate(zip(want, outputs[rid])) if a != b), len(want))
            _fail(what, f"request {rid} differs from minivllm's engine at output token {i}: expected {want}, "
                  f"got {outputs[rid]}", "a padding row wrote into a real sequence's KV, or a real row was misplaced")
    if sizes != expected_sizes:
        _fail(what, f"the decode steps ran as (rows, size) {sizes}, minivllm's as {expected_sizes}")
    padded = sum(n < b for n, b in sizes)
    assert padded, "the live workload must pad some decode batches"
    kind = f"{replays} CUDA graph replays" if replays else "the eager replay (no GPU)"
    return f"{len(sizes)} decode steps through your buffers, {padded} of them padded, {kind}"


def check_graph_runner(cls, live: bool = True) -> None:
    """Check a ``DecodeGraphRunner`` subclass's ``load`` (chapter 12).

    Targeted steps first, each on a fresh pool of ``tiny-random`` and after
    the steps before it: the bucket, the real rows, the padding rows (slot -1,
    context length 1, no slot left from an earlier step), the tables, the
    buffers kept in place, and the padded forward writing no slot but the
    step's own; the first failure stops the check. Then, unless
    ``live=False``, the live engine on SmolLM2 with the class as its graph
    runner: CUDA graphs captured on a GPU, the same padded batches replayed
    eagerly on the CPU, with minivllm's tokens and batch sizes. An empty
    subclass is "not written yet".
    """
    cls = own_part(cls, METHODS, MiniDecodeGraphRunner)
    for what, max_num_seqs, steps in _CASES:
        _check_case(cls, what, max_num_seqs, steps)
    say(f"check_graph_runner: all {len(_CASES)} padded steps are right: the bucket, the real rows, padding that "
          "writes only the scratch slot, no stale slot, the buffers in place.")
    if not live:
        return
    tok = load_tokenizer("smollm2-135m")
    summary = _check_live(cls, tok)
    say(f"check_graph_runner: the live engine (smollm2-135m, {summary}) gave exactly minivllm's tokens; the block "
          "invariants held after every step and no block leaked.")
