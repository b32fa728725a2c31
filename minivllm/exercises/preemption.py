"""Chapter 10, preemption: the check of the reader's choice of a preemption victim, on candidate lists
and plugged into minivllm's scheduler on a squeezed KV pool.
"""

from __future__ import annotations

import random

from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import Scheduler
from minivllm.sequence import Sequence
from minivllm.simulator import make_scheduler, sim_sequence, simulate_schedule

__all__ = ["check_choose_victim", "reference_choose_victim"]


def _victim_cases(num: int = 80, seed: int = 0):
    """Lists of candidate sequences: (priority, arrival) pairs, list order shuffled so it is not arrival order."""
    hand = [
        [(0, 1.0), (0, 2.0), (0, 3.0)],  # FCFS: the newest goes
        [(0, 3.0), (0, 1.0), (0, 2.0)],  # the newest is not the last in the list
        [(1, 1.0), (0, 2.0), (0, 3.0)],  # the worst priority goes even though it came first
        [(0, 1.0), (5, 0.5), (2, 9.0)],
        [(0, 4.0)],  # a lone candidate: the requester preempts itself
        [(3, 1.0), (3, 2.0), (0, 5.0), (1, 6.0)],
    ]
    rng = random.Random(seed)
    cases = list(hand)
    for _ in range(num):
        n = rng.randint(1, 7)
        arrivals = rng.sample(range(1, 100), n)
        cases.append([(rng.randint(0, 3), float(a)) for a in arrivals])
    return cases


def _victim_seqs(case):
    return [Sequence(f"s{i}", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4), priority=p, arrival_time=a)
            for i, (p, a) in enumerate(case)]


def reference_choose_victim(candidates):
    """The victim minivllm's :meth:`Scheduler.choose_victim <minivllm.scheduler.Scheduler.choose_victim>` picks
    among ``candidates`` (every one of them allowed: unprotected and ranked below the sequence that needs a block)."""
    sched = make_scheduler(num_blocks=1, block_size=16)
    sched.running = list(candidates)
    requester = Sequence("requester", [1], SamplingParams(temperature=0.0),
                         priority=min(s.priority for s in candidates) - 1)  # outranks every candidate
    return sched.choose_victim(requester)


def _victims_in_simulation(fn):
    """Per step, the request ids preempted when the scheduler asks ``fn`` (None: the engine's own choice)."""
    class PluggedScheduler(Scheduler):
        def choose_victim(self, requester):
            below = [s for s in self.running if s.rank > requester.rank]
            unprotected = [s for s in below if s.protected_until_step <= self.step_index]
            return fn(list(unprotected or below)) if below else None

    runs = []
    for protection, policy in ((0, "fcfs"), (4, "fcfs"), (2, "priority")):
        seqs = [sim_sequence(f"r{i}", p, m, priority=(i * 7) % 3 if policy == "priority" else 0,
                             arrival=float(i), first_token=100 * i + 1)
                for i, (p, m) in enumerate([(3, 29), (3, 12), (12, 28), (1, 20), (5, 9)])]
        trace = simulate_schedule(seqs, num_blocks=26, block_size=2, max_steps=2000, max_num_seqs=5,
                                  preemption_protection_steps=protection, scheduling_policy=policy,
                                  scheduler_cls=Scheduler if fn is None else PluggedScheduler)
        runs.append(trace.preempted)
    return runs


def check_choose_victim(fn) -> None:
    """Check ``fn(candidates) -> Sequence``, the preemption victim among running sequences (chapter 10).

    The victim is the lowest-priority one (the largest ``priority`` value: lower
    runs first) and, among those, the latest arrival (``metrics.arrival_time``).
    Compared with minivllm's scheduler on hand-made and random candidate lists,
    then plugged into the real scheduler on a squeezed pool: the same requests
    must be preempted in the same steps.
    """
    cases = _victim_cases()
    for case in cases:
        seqs = _victim_seqs(case)
        given = list(seqs)
        what = "choose_victim([" + ", ".join(f"(priority={p}, arrival={a:g})" for p, a in case) + "])"
        got = fn(given)
        if given != seqs:
            raise AssertionError(f"{what}: the list was changed; pick a victim without reordering or removing "
                                 f"anything (the scheduler's running list keeps admission order)")
        expected = reference_choose_victim(seqs)
        if not any(got is s for s in seqs):
            raise AssertionError(f"{what}: expected one of the candidates (a Sequence), got {got!r}")
        if got is not expected:
            show = lambda s: f"(priority={s.priority}, arrival={s.metrics.arrival_time:g})"  # noqa: E731
            worst = max(s.priority for s in seqs)
            if got.priority < worst:
                hint = (f"lower priority values run first, so the victim has the largest value ({worst}); "
                        f"you picked priority {got.priority}")
            elif got.metrics.arrival_time < expected.metrics.arrival_time:
                hint = "among equal priorities evict the latest arrival: it has waited least and lost least"
            else:
                hint = "compare by (priority, arrival_time), both largest first"
            raise AssertionError(f"{what}:\n  expected {show(expected)}\n  got      {show(got)}\n  {hint}")
    if _victims_in_simulation(fn) != _victims_in_simulation(None):
        raise AssertionError("plugged into the scheduler, your choose_victim preempts different requests in "
                             "different steps than minivllm's")
    print(f"check_choose_victim: all {len(cases)} cases and 3 scheduler runs match minivllm's scheduler.")
