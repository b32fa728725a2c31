"""The chapters' cross-path comparisons hold on every numeric path the engine can take (issues 61, 55).

Which kernel multiplies a row follows a rule (chapters 12, 18), and a user
can pin another: the kernel table (the C++ kernels, or PyTorch's reference),
the row-major weights for up to eight rows on the C++ table, three on the
reference (the rule), or oneDNN's packed ones for every row count
(``set_plain_rows(0)``), and the GGUF's blocks for decode
rows (``quantization="gguf"`` with float32 activations: the 8-bit ones are not
exact, tests/test_int8_activations.py). Chunked against whole prefill (chapter 02),
paged against the full forward (05), a shared prefix's keys (08), a verified
chunk against decode steps and speculative against plain decoding (17),
prefix-cached against cold: each comparison runs under each path, at the
chapters' own bounds (:mod:`minivllm.tolerances`), with the exact claim (the
same greedy tokens) beside it. And the same input gives the same bits in
every fresh process, beside a busy one too: no load times a kernel.
"""

import contextlib
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from minivllm import LLM, SamplingParams, kernels
from minivllm.attention import ContiguousKVCache, MiniPagedKVCache, PagedBatch
from minivllm.bench.speculative import SPEC, speculative_prompts
from minivllm.models import load_model
from minivllm.models.linear import NATIVE_MATMUL_MAX_ROWS, PLAIN_MATMUL_MAX_ROWS
from minivllm.simple_generation import chat_prompt_ids, generate_cached, prefill_chunked
from minivllm.tolerances import MODEL_ATOL, top2_margin

PATHS = {  # name: load_model's options, and the plain rows the path pins (None: the rule, plain_rows_rule)
    "cpu kernels": ({"kernels": "cpu"}, None),
    "cpu kernels, packed every row": ({"kernels": "cpu"}, 0),
    "reference kernels": ({"kernels": "reference"}, None),
    "gguf weights": ({"kernels": "cpu", "quantization": "gguf", "gguf_activations": "float32"}, None),
}


@contextlib.contextmanager
def numeric_path(name):
    """SmolLM2 on one path (its model, its tokenizer, the engine options that give it), then the rule put back."""
    options, plain_rows = PATHS[name]
    if options["kernels"] == "cpu" and kernels.cpu_table() is None:
        pytest.skip("no C++ kernels here (no compiler): the reference path is the only one")
    model, tok = load_model("smollm2-135m", "cpu", **options)
    if model.lm_head.packed is None:
        pytest.skip("oneDNN weight packing is not available here")
    model.set_plain_rows(model.plain_rows_rule() if plain_rows is None else plain_rows)
    try:
        yield model, tok, options
    finally:
        model.set_plain_rows(model.plain_rows_rule())


def assert_same_within_rounding(got, want, what):
    diff = (got - want).abs().max().item()
    assert diff <= MODEL_ATOL, f"{what}: differ by {diff:.2e}, more than float32 rounding ({MODEL_ATOL})"


@pytest.mark.parametrize("path", PATHS)
def test_the_chapters_comparisons_hold_on_every_path(path):
    with numeric_path(path) as (model, tok, _), torch.inference_mode():
        # Chapter 17: a verified row (the last token and four drafts) against five decode steps.
        ids = chat_prompt_ids(tok, "Fix the typo in this sentence and write it out again: The quick brown fox jumsp "
                                   "over the lazy dog while the old cat sleeps in the warm sun.")
        cached, fed = ids[:-5], ids[-5:]
        n = len(cached)
        caches = []
        for _ in range(2):
            caches.append(ContiguousKVCache.for_model(model, len(ids)))
            prefill_chunked(model, cached, n, caches[-1])
        stepwise = torch.stack([model.compute_logits(model.forward(torch.tensor([t]), torch.tensor([n + i]),
                                                                   caches[0]))[0] for i, t in enumerate(fed)])
        chunk = model.compute_logits(model.forward(torch.tensor(fed), torch.arange(n, len(ids)), caches[1]))
        assert_same_within_rounding(chunk, stepwise, "chapter 17's chunk and decode steps")
        assert top2_margin(chunk) > 2 * MODEL_ATOL and torch.equal(chunk.argmax(-1), stepwise.argmax(-1))

        # Chapter 02: a prompt prefilled in chunks of 1, 3, 16 and a non-divisor against one whole prefill.
        ids = chat_prompt_ids(tok, "Summarise in one sentence: paged attention stores the keys and values of every "
                                   "sequence in fixed-size blocks, so memory is allocated on demand.")
        whole = ContiguousKVCache.for_model(model, len(ids))
        want = prefill_chunked(model, ids, len(ids), whole)
        for size in (1, 3, 16, next(c for c in range(10, len(ids)) if len(ids) % c)):
            cache = ContiguousKVCache.for_model(model, len(ids))
            got = prefill_chunked(model, ids, size, cache)
            assert_same_within_rounding(got, want, f"chapter 02's logits, chunks of {size}")
            assert_same_within_rounding(torch.stack([cache.k, cache.v]), torch.stack([whole.k, whole.v]),
                                        f"chapter 02's KV cache, chunks of {size}")
            assert got.argmax() == want.argmax()
        reference = generate_cached(model, ids, 12, eos_token_id=tok.eos_token_id).token_ids
        for size in (1, 3):
            assert generate_cached(model, ids, 12, eos_token_id=tok.eos_token_id,
                                   prefill_chunk_size=size).token_ids == reference

        # Chapter 05: two paged steps (prefills; then decodes, a chunk and a whole prompt) against full forwards.
        texts = ["The capital of France is Paris, and the capital of Italy is",
                 "Paged attention stores keys and values in fixed-size blocks so that memory",
                 "def fibonacci(n):\n    return", "Once upon a time, there was a little robot who"]
        token_ids = [tok(t)["input_ids"] for t in texts]
        new = [1, 6, 1, len(token_ids[3])]
        free = iter(torch.randperm(32, generator=torch.Generator().manual_seed(2)).tolist())
        tables = [[next(free) for _ in range(math.ceil(len(t) / 16))] for t in token_ids]
        kv = MiniPagedKVCache.for_model(model, num_blocks=32, block_size=16)
        group = model.config.num_attention_heads // model.config.num_key_value_heads
        oracle = [model.logits(t) for t in token_ids]
        for rows in ([(b, 0, len(t) - k) for b, (t, k) in enumerate(zip(token_ids, new)) if len(t) > k],
                     [(b, len(t) - k, len(t)) for b, (t, k) in enumerate(zip(token_ids, new))]):
            step_ids = torch.tensor([x for b, a, e in rows for x in token_ids[b][a:e]])
            positions = torch.tensor([p for b, a, e in rows for p in range(a, e)])
            batch = PagedBatch([tables[b] for b, _, _ in rows], [e for _, _, e in rows], [e - a for _, a, e in rows],
                               16, "cpu", group)
            got = model.logits(step_ids, positions, kv, batch)
            want = torch.cat([oracle[b][a:e] for b, a, e in rows])
            assert_same_within_rounding(got, want, "chapter 05's paged step")
            assert torch.equal(got.argmax(-1), want.argmax(-1))

        # Chapter 08: two prompts that share a prefix have the same keys and values there.
        a = tok("You are a concise assistant. Answer in one sentence. What is the capital of France?")["input_ids"]
        b = tok("You are a concise assistant. Answer in one sentence. Why is the sky blue?")["input_ids"]
        shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        kvs = []
        for prompt in (a, b):
            kvs.append(ContiguousKVCache.for_model(model, len(prompt)))
            model.logits(prompt, kv=kvs[-1])
        for pool in ("k", "v"):
            assert_same_within_rounding(getattr(kvs[0], pool)[:, :, :shared], getattr(kvs[1], pool)[:, :, :shared],
                                        f"chapter 08's shared prefix ({pool})")


@pytest.mark.parametrize("path", PATHS)
def test_speculative_and_prefix_cached_engines_give_plain_decodings_tokens_on_every_path(path):
    engines = {"plain": {}, "speculative": {"speculative_config": SPEC},
               "prefix-cached": {"enable_prefix_caching": True}}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with numeric_path(path) as (model, tok, path_options):
        prompts = speculative_prompts(tok, "repetitive", 2) + speculative_prompts(tok, "open", 1)
        tokens = {}
        for name, options in engines.items():
            llm = LLM("smollm2-135m", device="cpu", num_blocks=128, **path_options, **options)
            assert llm.engine.model is model
            runs = [llm.generate(prompts, params, use_tqdm=False)]
            if name == "prefix-cached":  # again: the prompts' blocks now come from the cache
                runs.append(llm.generate(prompts, params, use_tqdm=False))
                assert llm.engine.stats().prefix_cache_hit_rate > 0
            tokens[name] = [[o.outputs[0].token_ids for o in run] for run in runs]
    plain = tokens["plain"][0]
    assert tokens["speculative"] == [plain] and tokens["prefix-cached"] == [plain, plain]


LOGITS_SCRIPT = """
import hashlib, torch
from minivllm.models import load_model
from minivllm.attention import ContiguousKVCache
model, tok = load_model("smollm2-135m", "cpu")
ids = tok("The capital of France is Paris, and the capital of Italy is")["input_ids"]
with torch.inference_mode():
    cache = ContiguousKVCache.for_model(model, len(ids) + 3)
    rows = [model.logits(ids[:-3], kv=cache)]  # a prefill, then decodes of one row: every row count's kernel
    rows += [model.logits([t], torch.tensor([len(ids) - 3 + i]), cache) for i, t in enumerate(ids[-3:])]
print(hashlib.sha256(b"".join(r.float().numpy().tobytes() for r in rows)).hexdigest(), model.plain_max_rows,
      model.kernels)
"""


def test_a_fresh_load_beside_a_busy_process_gives_the_quiet_loads_bit_identical_logits():
    """Same input, same logits: the same bits in two fresh processes, a quiet one and one sharing its cores with a
    busy loop (a load-time race, or any other run-to-run choice, would pick another kernel there)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def logits_hash():
        out = subprocess.run([sys.executable, "-c", LOGITS_SCRIPT], capture_output=True, text=True, env=env,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    hashes = [logits_hash()]
    spin = "import time\nend = time.time() + 300\nwhile time.time() < end: pass"  # bounded, and killed below
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)
        hashes.append(logits_hash())
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert hashes[0] == hashes[1], hashes
    rule = {"cpu": NATIVE_MATMUL_MAX_ROWS, "reference": PLAIN_MATMUL_MAX_ROWS}[hashes[0][2]]
    assert hashes[0][1] == str(rule)  # the rule, in every process
