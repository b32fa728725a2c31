"""Chapter 15's measurements: shard shapes, the all-reduce against the matmul it saves, a step's compute and communication.

Every function that needs several ranks runs them as spawned subprocesses
(:func:`minivllm.distributed.run_on_ranks`, or an engine's own workers), so
they work from a notebook. Timings are medians on whatever machine runs them;
on a 2-core CPU the ranks share two cores, which the chapter says with the
figures.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minivllm.distributed import run_on_ranks
from minivllm.models.parallel import ParallelLlamaForCausalLM, TensorParallelGroup
from minivllm.timing import median_time

__all__ = ["layer_shards", "allreduce_vs_matmul", "step_split", "summarize_steps"]


def layer_shards(config, tp_size: int) -> list[dict]:
    """Every parameter of layer 0, the embedding and the LM head: full shape, one rank's shape, how it is split."""
    with torch.device("meta"):
        full = ParallelLlamaForCausalLM(config, TensorParallelGroup(0, 1))
        shard = ParallelLlamaForCausalLM(config, TensorParallelGroup(0, tp_size))
    shapes = dict(shard.named_parameters(remove_duplicate=False))
    rows = []
    for name, p in full.named_parameters(remove_duplicate=False):
        if ".layers." in name and ".layers.0." not in name:
            continue
        module = shard.get_submodule(name.rpartition(".")[0])
        dim = getattr(module, "shard_dims", {}).get(name.rpartition(".")[2])
        rows.append({"name": name, "layer": type(module).__name__, "full": tuple(p.shape),
                     "shard": tuple(shapes[name].shape), "split": {0: "rows", 1: "columns", None: "replicated"}[dim]})
    return rows


def _down_proj_on_rank(tp: TensorParallelGroup, tokens: list[int], hidden: int, intermediate: int,
                       repeats: int) -> list[dict]:
    """On each rank: its slice of a row-parallel matmul and the all-reduce; on rank 0 also the whole matmul."""
    per = intermediate // tp.size
    cols = slice(tp.rank * per, (tp.rank + 1) * per)
    threads, results = torch.get_num_threads(), []
    for t in tokens:
        gen = torch.Generator().manual_seed(t)
        x, w = torch.randn(t, intermediate, generator=gen), torch.randn(hidden, intermediate, generator=gen) / 40
        xs, ws = x[:, cols].contiguous(), w[:, cols].contiguous()
        dist.barrier()
        shard = median_time(lambda: F.linear(xs, ws), repeats=repeats)
        reduce_times, y = [], None
        for _ in range(repeats):
            y = F.linear(xs, ws)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(y)
            reduce_times.append(time.perf_counter() - start)
        full = None
        if tp.rank == 0:  # the matmul one process would do, with every core (the other ranks wait)
            torch.set_num_threads(threads * tp.size)
            full = median_time(lambda: F.linear(x, w), repeats=repeats)
            torch.set_num_threads(threads)
        dist.barrier()
        error = float((y - F.linear(x, w)).abs().max())
        results.append({"tokens": t, "full_s": full, "shard_s": shard, "allreduce_s": statistics.median(reduce_times),
                        "max_abs_error": error})
    return results


def allreduce_vs_matmul(world: int, tokens=(1, 16, 256), hidden: int = 576, intermediate: int = 1536,
                        repeats: int = 20) -> list[dict]:
    """SmolLM2's down projection split over ``world`` CPU ranks: the matmul it saves against the all-reduce it costs.

    Per token count: the whole matmul on one process (all cores), one
    rank's slice, the all-reduce of the ``[tokens, hidden]`` partial sums, and
    how far the reduced sum is from the whole matmul (float32 rounding).
    """
    return run_on_ranks(_down_proj_on_rank, world, list(tokens), hidden, intermediate, repeats)[0]


def step_split(llm, prompts, params) -> tuple[dict, list[dict]]:
    """Run ``prompts`` through ``llm``'s engine step by step: the finished outputs by request id, and per step
    its tokens and rank 0's seconds.

    ``model_s`` is the step's swap, prepare, forward and sample phases;
    ``comm_s`` the part rank 0 spent in collectives and broadcasts (waiting
    for the slowest rank included); ``compute_s`` the rest; ``collectives``
    counts the forward's all-reduces and gathers. With one process there is
    no communication.
    """
    engine = llm.engine
    tp = getattr(engine.runner, "tp", None)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"split-{i}", prompt, params)
    outputs, steps = {}, []
    while engine.has_unfinished_requests():
        before = (tp.comm_seconds, tp.broadcast_seconds, tp.num_collectives) if tp else (0.0, 0.0, 0)
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        after = (tp.comm_seconds, tp.broadcast_seconds, tp.num_collectives) if tp else (0.0, 0.0, 0)
        comm, bcast, collectives = (a - b for a, b in zip(after, before))
        model = sum(engine.last_step_phases.get(k, 0.0) for k in ("swap", "prepare", "forward", "sample"))
        chunks = engine.last_schedule.chunks
        steps.append({"tokens": sum(c.num_tokens for c in chunks), "decode": all(c.num_tokens == 1 for c in chunks),
                      "model_s": model, "comm_s": comm, "broadcast_s": bcast, "compute_s": model - comm,
                      "collectives": collectives})
    return outputs, steps


def summarize_steps(steps: list[dict]) -> dict[str, dict]:
    """Medians of the decode steps and the prefill steps (any step with a chunk of more than one token)."""
    out = {}
    for kind, wanted in (("decode", True), ("prefill", False)):
        chosen = [s for s in steps if s["decode"] == wanted and s["tokens"]]
        if chosen:
            out[kind] = {k: statistics.median(s[k] for s in chosen)
                         for k in ("tokens", "model_s", "compute_s", "comm_s", "broadcast_s")}
            out[kind]["steps"] = len(chosen)
    return out
