"""Shared test workloads, oracles and process checks."""

import json
import random
from pathlib import Path

import torch

from minivllm import LLM, SamplingParams

TOPICS = ["the sea", "paged attention", "prime numbers", "a cat", "Paris", "rust and python",
          "the moon landing", "sourdough bread", "chess openings", "volcanoes", "jazz", "GPUs",
          "photosynthesis", "the Roman empire", "origami", "black holes"]


def mixed_prompts(tok, n=16, seed=0):
    """Chat prompts of mixed lengths: short questions and several-hundred-token ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        body = f"Tell me about {topic}."
        if i % 3 == 2:  # a long one: several hundred tokens
            body = (f"Here are my notes on {topic}: " + " ".join(rng.choice(TOPICS) for _ in range(rng.randint(100, 200)))
                    + f". Summarise {topic}.")
        text = tok.apply_chat_template([{"role": "user", "content": body}], add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    return prompts


def readers_loops() -> str:
    """minivllm's inner loops as exercise 18 builds a reader's: without MINIVLLM_OWN_INNER (every row through
    attend_tile, unsplit). One text for every test that builds such a table, so an empty cache compiles it once."""
    from minivllm.kernels import build

    return build.INNER.read_text() + "\n#undef MINIVLLM_OWN_INNER\n"


def hf_greedy(hf_model, prompt_ids, max_new_tokens, eos_token_id=None):
    """HF transformers generate, one prompt at a time: the oracle."""
    ids = torch.tensor([prompt_ids])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                            do_sample=False, eos_token_id=eos_token_id, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def run_engine(llm: LLM, requests, check=True, all_samples=False):
    """Drive llm.engine step by step over ``(id, ids, params)``; checks invariants after each step.

    Returns each request's tokens (with ``all_samples``, the list of every sample's tokens)."""
    engine = llm.engine
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = [c.token_ids for c in o.outputs] if all_samples else o.outputs[0].token_ids
        if check:
            engine.check_invariants()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm.free_cpu_blocks) == bm.num_cpu_blocks, "blocks leaked"
    return outs


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def stop_completed_by_last_token(before: str, after: str) -> str:
    """The shortest stop string that ``after`` (the text one token longer than ``before``) holds first at its very
    end and ``before`` does not hold: the last token completes it."""
    return next(s for m in range(1, len(after) + 1)
                if after.find(s := after[-m:]) == len(after) - m and s not in before)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (read from /proc: a test that started it stops it by PID)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def write_parts(notebooks: Path, folder: Path) -> None:
    """What running each notebook's ``%%writefile your_engine/...`` cells leaves in ``folder``."""
    (folder / "your_engine").mkdir(parents=True, exist_ok=True)
    for path in sorted(notebooks.glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and source.startswith("%%writefile your_engine/"):
                first, body = source.split("\n", 1)
                (folder / first.split(" ", 1)[1]).write_text(body + "\n")


def dead_end_after(monkeypatch, tokens: int) -> None:
    """Every grammar reaches a state with no way on after ``tokens`` accepted tokens: its mask admits nothing
    (a constraint that admits no continuation, chapter 19)."""
    from minivllm.structured_output import Grammar

    real = Grammar.fill_bitmask

    def dead_end(self, bitmask, row):
        real(self, bitmask, row)
        if self.num_accepted >= tokens:
            bitmask[row] = 0

    monkeypatch.setattr(Grammar, "fill_bitmask", dead_end)
