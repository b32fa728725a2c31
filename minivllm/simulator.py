"""The scheduler simulator: the real Scheduler and BlockManager driven by a fake model, no tensors (chapter 10)."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.config import EngineConfig, cpu_pool_blocks, resolve
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import Scheduler
from minivllm.sequence import Sequence

__all__ = ["make_scheduler", "SimTrace", "sim_sequence", "simulate_schedule"]


def make_scheduler(num_blocks: int, block_size: int = 4, max_model_len: int = 1_000_000,
                   eos_token_ids=frozenset(), **config) -> Scheduler:
    """A scheduler and its block manager without a model, built as the engine builds them (any EngineConfig field)."""
    cfg = EngineConfig(model="tiny-random", block_size=block_size, num_blocks=num_blocks, **config)
    bm = resolve(cfg.block_manager_cls)(num_blocks, block_size, cfg.enable_prefix_caching,
                                        cpu_pool_blocks(cfg, num_blocks), cfg.admission_watermark)
    return resolve(cfg.scheduler_cls)(cfg, bm, max_model_len, eos_token_ids)


@dataclass
class SimTrace:
    """What :func:`simulate_schedule` saw: per step the chunks ``(request id, start, n)`` and the preempted ids."""

    steps: list[list[tuple[str, int, int]]]
    preempted: list[list[str]]
    seqs: dict  # request id -> Sequence
    finished_step: dict[str, int]  # request id -> step in which it got its last token
    scheduler: object

    def num_preemptions(self, request_id: str) -> int:
        return self.seqs[request_id].metrics.num_preemptions

    def timeline(self) -> list[list[tuple[str, str]]]:
        """Per step ``(request id, kind)`` for :func:`minivllm.viz.plot_batch_timeline`; kind "recompute" for KV
        computed again after a preemption (prompt and earlier outputs), "preempted" the step it was evicted."""
        out = []
        for chunks, pre in zip(self.steps, self.preempted):
            row = []
            for rid, start, n in chunks:
                s = self.seqs[rid]
                kind = "decode" if n == 1 and start >= s.num_prompt_tokens else "prefill"
                if s.metrics.num_preemptions and kind == "prefill" and rid in self._evicted_before(len(out)):
                    kind = "recompute"
                row.append((rid, kind))
            row += [(rid, "preempted") for rid in pre if rid not in {r for r, _ in row}]
            out.append(row)
        return out

    def _evicted_before(self, t: int) -> set[str]:
        return {rid for pre in self.preempted[:t] for rid in pre}


def sim_sequence(request_id: str, prompt_len: int, max_tokens: int, priority: int = 0, arrival: float = 0.0,
                 first_token: int = 1):
    """A request for :func:`simulate_schedule`: ``prompt_len`` distinct token ids, exactly ``max_tokens`` outputs."""
    return Sequence(request_id, list(range(first_token, first_token + prompt_len)),
                    SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                    priority=priority, arrival_time=arrival)


def simulate_schedule(arrivals, num_blocks: int, block_size: int = 4, max_steps: int = 10_000, token: int = 5,
                      stop=None, **config) -> SimTrace:
    """Drive the real :class:`~minivllm.scheduler.Scheduler` and ``BlockManager`` with a fake model (chapter 10).

    ``arrivals`` is a list of sequences (all arrive at step 0) or a function
    ``step -> list of sequences`` arriving before that step is scheduled. Every
    sampling chunk "samples" ``token``. Runs until nothing is left (or
    ``stop(trace)`` is true, or ``max_steps``); checks the block invariants each step.
    Pure Python, no tensors: thousands of steps per second. ``config`` takes
    any EngineConfig field, ``scheduler_cls`` (a reader's scheduler) included.
    """
    sched = make_scheduler(num_blocks, block_size, **config)
    bm = sched.block_manager
    arrive = arrivals if callable(arrivals) else (lambda t, first=list(arrivals): first if t == 0 else [])
    trace = SimTrace([], [], {}, {}, sched)
    for t in range(max_steps):
        for s in arrive(t):
            trace.seqs[s.request_id] = s
            sched.add(s)
        if not sched.has_unfinished() and not callable(arrivals):
            break
        out = sched.schedule()
        sched.update(out, [token] * sum(len(c.sample_seqs) for c in out.chunks))
        bm.check_invariants(sched.sequences)
        trace.steps.append([(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks])
        trace.preempted.append([s.request_id for s in out.preempted])
        for c in out.chunks:
            if c.seq.is_finished and c.seq.request_id not in trace.finished_step:
                trace.finished_step[c.seq.request_id] = t
        if stop is not None and stop(trace):
            break
    return trace
