"""llama.cpp's side of ``--compare llamacpp`` (chapter 11): run inside the ``llama-cpp-python`` environment.

``python llamacpp_offline.py JOB.json RESULT.json``, the same job and result
files as ``vllm_offline.py``. llama.cpp's own continuous batching, through its
low-level batch API as its ``llama-batched``/``llama-server`` examples do: up to
``n_seq_max`` sequences share one unified KV cache, and every ``llama_decode``
carries one decode token per running sequence first, then prompt tokens up to
``n_batch`` (split into ``n_ubatch`` micro-batches by llama.cpp). A finished
sequence's cells are freed (``llama_memory_seq_rm``) and its slot goes to the
next waiting request. Greedy is the argmax of the row's logits.
"""

import json
import os
import statistics
import sys
import time
from collections import deque

from _progress import Progress  # beside this file (peer_drivers/)


class Slots:
    """The running sequences: request index, prompt tokens fed, tokens generated, per KV sequence id."""

    def __init__(self, n):
        self.free = list(range(n))[::-1]
        self.running = {}  # seq id -> [request, prompt tokens fed]


def _add(batch, n, token, pos, seq, logits):
    batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = token, pos, 1, logits
    batch.seq_id[n][0] = seq


def _fill(batch, slots, prompts, ids, n_batch):
    """One step's batch: a decode token per running sequence past its prompt, then prompt chunks; its logit rows."""
    n, rows = 0, []
    for seq, (r, fed) in slots.running.items():
        if fed == len(prompts[r]):
            _add(batch, n, ids[r][-1], fed + len(ids[r]) - 1, seq, 1)
            rows.append((n, seq))
            n += 1
    for seq, state in slots.running.items():
        r, fed = state
        if fed < len(prompts[r]) and n < n_batch:
            take = min(len(prompts[r]) - fed, n_batch - n)
            for j in range(take):
                _add(batch, n + j, prompts[r][fed + j], fed + j, seq, int(fed + j == len(prompts[r]) - 1))
            n += take
            state[1] = fed + take
            if state[1] == len(prompts[r]):
                rows.append((n - 1, seq))
    batch.n_tokens = n
    return rows


def run(lib, ctx, batch, n_batch, n_slots, prompts, max_tokens, n_vocab, progress=None):
    """Every request queued at once, decoded to the end; (token ids, token times, seconds). ``progress(done)``
    after each step, with the output tokens so far."""
    import numpy as np

    mem = lib.llama_get_memory(ctx)
    lib.llama_memory_clear(mem, True)
    waiting, slots = deque(range(len(prompts))), Slots(n_slots)
    ids, times = [[] for _ in prompts], [[] for _ in prompts]
    start = time.perf_counter()
    while waiting or slots.running:
        while waiting and slots.free:
            slots.running[slots.free.pop()] = [waiting.popleft(), 0]
        rows = _fill(batch, slots, prompts, ids, n_batch)
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed (KV cache too small for the batch?)")
        t = time.perf_counter() - start
        for i, seq in rows:
            r = slots.running[seq][0]
            logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
            ids[r].append(int(logits.argmax()))
            times[r].append(t)
            if len(ids[r]) == max_tokens[r]:
                lib.llama_memory_seq_rm(mem, seq, -1, -1)
                del slots.running[seq]
                slots.free.append(seq)
        if progress is not None:
            progress(sum(map(len, ids)))
    return ids, times, time.perf_counter() - start


def open_context(lib, path, s):
    """The model file at ``path`` and a context with the settings ``s`` (fp32 KV, one unified cache of
    ``n_seq_max`` sequences); (model, context, vocabulary size). The logits driver opens its context so too."""
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(path.encode(), lib.llama_model_default_params())
    cparams = lib.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = s["n_ctx"], s["n_batch"], s["n_ubatch"]
    cparams.n_seq_max, cparams.kv_unified = s["n_seq_max"], True
    cparams.n_threads = cparams.n_threads_batch = s["n_threads"]
    cparams.type_k = cparams.type_v = lib.GGML_TYPE_F32  # fp32 KV, as minivllm and vLLM (llama.cpp's default: F16)
    cparams.no_perf = True
    ctx = lib.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError(f"llama_init_from_model failed with {s}")
    return model, ctx, lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))


def close_context(lib, model, ctx, batch) -> None:
    """Free what :func:`open_context` and ``llama_batch_init`` made, the batch first."""
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)


def main(job_path, result_path):
    import llama_cpp as lib

    job = json.load(open(job_path))
    s = job["settings"]
    progress = Progress(job.get("progress"))
    progress("loading", force=True)
    began = time.perf_counter()
    model, ctx, n_vocab = open_context(lib, job["model"], s)
    batch = lib.llama_batch_init(s["n_batch"], 0, 1)
    go = lambda ps, ns, slots=s["n_seq_max"], on=None: run(lib, ctx, batch, s["n_batch"], slots, ps, ns,  # noqa: E731
                                                           n_vocab, on)
    go([job["prompts"][0][:8]], [2])  # warm-up
    startup = time.perf_counter() - began
    progress("running", force=True)
    ids, times, secs = go(job["prompts"], job["max_tokens"], on=lambda done: progress("running", done))
    progress("batch-1 TPOT", sum(map(len, ids)), force=True)
    p, k = job["tpot"]["prompt"], job["tpot"]["tokens"]
    tpot = statistics.median((go([p], [1 + k])[2] - go([p], [1])[2]) / k for _ in range(job["tpot"]["repeats"]))
    env = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GGML_", "LLAMA_"))}
    json.dump({"token_ids": ids, "token_times": times, "seconds": secs, "batch1_tpot": tpot,
               "startup_seconds": startup, "version": lib.__version__,
               "settings": {**s, "type_k": "f32", "type_v": "f32", "kv_unified": True, "env": env}},
              open(result_path, "w"))
    close_context(lib, model, ctx, batch)


if __name__ == "__main__":
    main(*sys.argv[1:3])
