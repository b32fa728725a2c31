"""llama.cpp's logits rows for ``python -m minivllm.bench margins`` (chapter 18): run inside the
``llama-cpp-python`` environment.

``python llamacpp_logits.py JOB.json RESULT.json``, the job and result files of
``llamacpp_offline.py`` (``minivllm.bench.peers.run_peer_job``), its context
opened the same way (``open_context``: fp32 KV, the job's ``n_threads``). The
job names the model file, the settings, ``top_k`` and ``sequences``: each
``{"tokens": [...], "rows": [[position, [token ids]], ...]}``. Each sequence is
evaluated alone, as one sequence from position 0 (the cache cleared first, one
``llama_decode``), asking logits of the listed positions only. The result holds,
per sequence and listed position, ``{"top": [[id, logit], ...], "at": [[id,
logit], ...]}``: the ``top_k`` largest logits and those of the named ids, not
whole rows (a row is 49,152 floats), so the JSON stays small.
"""

import json
import sys

from _progress import Progress  # beside this file (peer_drivers/)
from llamacpp_offline import close_context, open_context


def rows(lib, ctx, batch, n_batch, n_vocab, tokens, wanted, top_k):
    """The logits rows of ``tokens`` (one sequence from position 0) at the positions of ``wanted``
    (``[[position, ids], ...]``): for each, its ``top_k`` largest and the named ids' logits."""
    import numpy as np

    if not 1 <= len(tokens) <= n_batch:
        raise ValueError(f"a sequence must hold 1 to n_batch={n_batch} tokens, got {len(tokens)}")
    wanted = sorted((int(p), [int(i) for i in ids]) for p, ids in wanted)
    if any(not 0 <= p < len(tokens) for p, _ in wanted) or len({p for p, _ in wanted}) != len(wanted):
        raise ValueError(f"rows must name distinct positions in [0, {len(tokens)}), got {[p for p, _ in wanted]}")
    asked = {p for p, _ in wanted}
    lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
    for i, token in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = int(token), i, 1, int(i in asked)
        batch.seq_id[i][0] = 0
    batch.n_tokens = len(tokens)
    if lib.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed (KV cache too small for the sequence?)")
    out = []
    for p, ids in wanted:  # in batch order
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, p), shape=(n_vocab,))
        top = np.argpartition(-logits, top_k - 1)[:top_k]
        top = sorted(top.tolist(), key=lambda i: (-logits[i], i))
        out.append({"top": [[i, float(logits[i])] for i in top], "at": [[i, float(logits[i])] for i in ids]})
    return out


def main(job_path, result_path):
    import llama_cpp as lib

    job = json.load(open(job_path))
    s = job["settings"]
    progress = Progress(job.get("progress"))
    progress("loading", force=True)
    model, ctx, n_vocab = open_context(lib, job["model"], s)
    batch = lib.llama_batch_init(s["n_batch"], 0, 1)
    out = []
    for seq in job["sequences"]:
        out.append(rows(lib, ctx, batch, s["n_batch"], n_vocab, seq["tokens"], seq["rows"], job["top_k"]))
        progress("logits", sum(map(len, out)))
    json.dump({"rows": out, "version": lib.__version__, "settings": {**s, "type_k": "f32", "type_v": "f32"}},
              open(result_path, "w"))
    close_context(lib, model, ctx, batch)


if __name__ == "__main__":
    main(*sys.argv[1:3])
