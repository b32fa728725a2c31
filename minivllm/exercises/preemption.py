"""Chapter 10, preemption: the check of the reader's ``choose_victim`` and ``preempt`` (a ``Scheduler``
subclass), on targeted cases, on squeezed pools in the scheduler simulator, and then inside the live engine
with recompute and with swap, schedule for schedule.
"""

from __future__ import annotations

from minivllm.config import cdiv
from minivllm.exercises._common import own_part, say
from minivllm.exercises.live import TOPICS, check_live, greedy
from minivllm.models import load_tokenizer
from minivllm.preemption import preemption_accounting
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import MiniScheduler, SchedulerOutput
from minivllm.sequence import Sequence, SequenceStatus
from minivllm.simulator import make_scheduler, sim_sequence, simulate_schedule

__all__ = ["check_preemption", "accounting_example", "METHODS"]

METHODS = ("choose_victim", "preempt")  # what exercise 10 writes

KIB = 1024
ACCOUNTING = dict(cached_tokens=7, block_size=4, kv_bytes_per_token=512 * KIB, cpu_bandwidth_gbps=24)


def accounting_example():
    """The source notes' example: 7 cached tokens, blocks of 4, 512 KiB of KV per token, a 24 GB/s host link."""
    return preemption_accounting(**ACCOUNTING)


# -- choose_victim ---------------------------------------------------------------------------------------------

def _running(spec) -> dict[str, Sequence]:
    """``{id: (priority, arrival, protected_until_step)}`` -> running sequences, in the given (admission) order."""
    seqs = {}
    for rid, (priority, arrival, protected) in spec.items():
        seqs[rid] = Sequence(rid, [1, 2, 3], SamplingParams(temperature=0.0), priority=priority, arrival_time=arrival)
        seqs[rid].protected_until_step = protected
    return seqs


_FREE = -1  # protected_until_step of a sequence never preempted
_VICTIM_CASES = [  # (what, running {id: (priority, arrival, protected until)}, requester, expected, {got: hint})
    ("a needs a block; a, b, c have the same priority and arrived in that order",
     {"a": (0, 1.0, _FREE), "b": (0, 2.0, _FREE), "c": (0, 3.0, _FREE)}, "a", "c",
     {"b": "the earliest arrival was evicted: evict the lowest-ranked sequence, the latest arrival among equal "
           "priorities (the largest seq.rank): it has waited least",
      "a": "the requester is not a candidate: only sequences ranking below it"}),
    ("c needs a block; running in admission order c, a, b (priority 0, arrivals 3, 1, 2)",
     {"c": (0, 3.0, _FREE), "a": (0, 1.0, _FREE), "b": (0, 2.0, _FREE)}, "b", "c",
     {"a": "a ranks above the requester b (it arrived first): a victim must rank below the requester",
      None: "c ranks below b (it arrived later): it is the victim"}),
    ("a (priority 0, arrived last) needs a block; b has priority 2 and c priority 1, both arrived earlier",
     {"a": (0, 3.0, _FREE), "b": (2, 1.0, _FREE), "c": (1, 2.0, _FREE)}, "a", "b",
     {"c": "the victim ignores priority: lower priority values run first, so the victim has the largest value; "
           "compare seq.rank = (priority, arrival, id), largest first",
      None: "the victim ignores priority: b and c rank below a (larger priority values) although they arrived "
            "earlier; seq.rank = (priority, arrival, id)"}),
    ("b needs a block; a ranks above it and nobody ranks below it",
     {"a": (0, 1.0, _FREE), "b": (0, 2.0, _FREE)}, "b", None,
     {"a": "a victim above the requester: only a sequence ranking below it may be preempted; when none does, "
           "return None and the requester yields its own blocks. Otherwise the head (the best-ranked running "
           "sequence) could be preempted, and the engine loses its guarantee of progress",
      "b": "return None when nobody ranks below the requester (reserve_blocks then preempts the requester itself)"}),
    ("at step 5, a needs a block; b is unprotected, c (ranked lower) is protected until step 9",
     {"a": (0, 1.0, _FREE), "b": (0, 2.0, _FREE), "c": (0, 3.0, 9)}, "a", "b",
     {"c": "protection ignored: while an unprotected sequence ranks below the requester, skip those just resumed "
           "(protected_until_step > self.step_index): that guards against thrashing"}),
    ("at step 5, a needs a block; b and c are both protected until step 9",
     {"a": (0, 1.0, _FREE), "b": (0, 2.0, 9), "c": (0, 3.0, 9)}, "a", "c",
     {None: "protection is only a preference: when every sequence below the requester is protected, choose among "
            "them", "b": "among protected ones too, the lowest-ranked goes"}),
    ("at step 5, a needs a block; b is unprotected, c's protection ends at step 5",
     {"a": (0, 1.0, _FREE), "b": (0, 2.0, _FREE), "c": (0, 3.0, 5)}, "a", "c",
     {"b": "a sequence is protected while protected_until_step > self.step_index: at step 5, protection until "
           "step 5 is over"}),
]


def _check_victims(cls) -> None:
    for what, spec, requester, expected, hints in _VICTIM_CASES:
        sched = make_scheduler(8, 4, scheduler_cls=cls)
        seqs = _running(spec)
        sched.running, sched.step_index = list(seqs.values()), 5
        before = list(sched.running)
        victim = sched.choose_victim(seqs[requester])
        if sched.running != before:
            raise AssertionError(f"choose_victim: {what}: it changed self.running; only choose, "
                                 f"preempt(victim, out) acts")
        got = next((rid for rid, s in seqs.items() if s is victim), victim)
        if victim is not None and got is victim:
            raise AssertionError(f"choose_victim: {what}: expected a running Sequence or None, got {victim!r}")
        if got != expected:
            raise AssertionError(f"choose_victim: {what}: expected {expected}, got {got}\n  "
                                 + hints.get(got, "the lowest-ranked running sequence below the requester, "
                                                  "unprotected ones first; None if none ranks below it"))


# -- preempt ---------------------------------------------------------------------------------------------------

def _with_victim(cls, mode: str, cpu_blocks: int):
    """A scheduler whose running ``v`` has 7 tokens of KV in 2 blocks of 4 and a decode chunk in ``out``;
    ``w`` waits. Returns (scheduler, v, w, out)."""
    sched = make_scheduler(8, 4, scheduler_cls=cls, preemption_mode=mode, num_cpu_blocks=cpu_blocks)
    sched.kv_bytes_per_block = ACCOUNTING["block_size"] * ACCOUNTING["kv_bytes_per_token"]
    v = Sequence("v", list(range(1, 8)), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    sched.add(v)
    first = sched.schedule()
    sched.update(first, [7])  # v's prompt: 7 tokens of KV, and its first output token
    w = Sequence("w", [50, 51], SamplingParams(temperature=0.0, max_tokens=2))
    sched.add(w)
    out = SchedulerOutput()
    out.add(sched.chunk(v, 1))  # v's decode is already scheduled in this step
    return sched, v, w, out


def _preempt(cls, mode: str, cpu_blocks: int, what: str):
    sched, v, w, out = _with_victim(cls, mode, cpu_blocks)
    try:
        sched.preempt(v, out)
    except Exception as e:
        hint = ("swap only when the CPU pool has room (self.block_manager.can_swap_out(seq)); else fall back to "
                "recompute" if mode == "swap" and cpu_blocks < 2 else "see the traceback")
        raise AssertionError(f"preempt: {what}: it failed ({type(e).__name__}: {e})\n  {hint}") from None
    return sched, v, w, out


def _expect(ok: bool, what: str, hint: str) -> None:
    if not ok:
        raise AssertionError(f"preempt: {what}: {hint}")


def _check_common(sched, v, out, what: str) -> None:
    _expect(not out.chunks and out.num_batched_tokens == 0, what,
            "drop its chunk from this step (out.drop(seq)): it was scheduled before it lost its blocks")
    _expect(v not in sched.running, what, "take it out of self.running")
    _expect(v.metrics.num_preemptions == 1 and sched.num_preemptions == 1 and out.preempted == [v], what,
            "count the preemption: seq.metrics.num_preemptions += 1, self.num_preemptions += 1, and "
            "out.preempted.append(seq)")
    _expect(sched.block_manager.num_free_blocks == 8, what,
            f"its {accounting_example().released_blocks} device blocks must be free afterwards")


def _check_recompute(sched, v, w, out, what: str) -> None:
    _check_common(sched, v, out, what)
    cost = accounting_example()
    recomputed = (v.metrics.num_recomputed_tokens, sched.num_recomputed_tokens)
    if recomputed == (cost.released_blocks,) * 2:
        _expect(False, what, f"accounting counts blocks instead of tokens: recompute redoes its "
                             f"{cost.recompute_tokens} cached tokens (seq.cached_token_count), not its "
                             f"{cost.released_blocks} blocks; preemption_accounting(7, 4, ...) gives "
                             f"recompute_tokens={cost.recompute_tokens}")
    _expect(recomputed == (cost.recompute_tokens,) * 2, what,
            f"count the tokens to recompute, its cached_token_count ({cost.recompute_tokens}), in "
            f"seq.metrics.num_recomputed_tokens and self.num_recomputed_tokens (got {recomputed})")
    _expect(v.cached_token_count == 0, what, "recompute without resetting the cached tokens: its KV is gone, so "
            "cached_token_count goes back to 0 and it computes everything again (self._recompute_later(seq) does it)")
    _expect(v.status is SequenceStatus.WAITING and v.block_table == [], what,
            "it waits again, without blocks (self._recompute_later(seq))")
    _expect(sched.waiting.peek() is v, what, "requeue it at the front of the waiting queue, before w: it was "
            "running, it goes first (self._recompute_later(seq) pushes it with front=True)")
    _expect(sched.num_swapped_bytes == 0 and not out.swap_out and not sched.swapped, what, "recompute swaps nothing")


def _check_swap(sched, v, out, what: str) -> None:
    _check_common(sched, v, out, what)
    cost = accounting_example()
    _expect(v.status is SequenceStatus.SWAPPED and v in sched.swapped and len(v.cpu_block_table) == 2, what,
            "with preemption_mode 'swap' and room in the CPU pool (self.block_manager.can_swap_out(seq)), swap it "
            "out: self.block_manager.swap_out(seq), status SWAPPED, appended to self.swapped")
    _expect(len(out.swap_out) == 2 and sorted(b for b, _ in out.swap_out) == sorted(set(b for b, _ in out.swap_out)),
            what, "list the copies to make in this step: out.swap_out.extend(the pairs swap_out returns)")
    _expect(v.cached_token_count == 7 and v.metrics.num_recomputed_tokens == 0 and sched.num_recomputed_tokens == 0,
            what, "a swapped sequence keeps its KV (in the CPU pool): nothing to recompute, cached_token_count stays")
    swapped = cost.released_blocks * sched.kv_bytes_per_block
    _expect(v.metrics.num_swapped_bytes == swapped == sched.num_swapped_bytes, what,
            f"count the bytes copied, whole blocks: self._count_swap(seq, number of blocks) "
            f"({cost.released_blocks} blocks of {sched.kv_bytes_per_block} bytes)")


def _check_preempt(cls) -> None:
    what = "a running sequence v with 7 tokens of KV (2 blocks of 4) and a scheduled decode, w waiting"
    _check_recompute(*_preempt(cls, "recompute", 0, f"recompute: {what}"), f"recompute: {what}")
    sched, v, w, out = _preempt(cls, "swap", 8, f"swap, 8 free CPU blocks: {what}")
    _check_swap(sched, v, out, f"swap, 8 free CPU blocks: {what}")
    full = f"swap, but only 1 free CPU block for v's 2: {what}"
    sched, v, w, out = _preempt(cls, "swap", 1, full)
    _expect(v.status is not SequenceStatus.SWAPPED, full, "swap without falling back: the CPU pool cannot hold v's "
            "2 blocks (self.block_manager.can_swap_out(seq) is False), so recompute instead")
    _check_recompute(sched, v, w, out, full)


# -- the simulator: squeezed pools -----------------------------------------------------------------------------

_SIM_REQUESTS = [(3, 29), (3, 12), (12, 28), (1, 20), (5, 9)]  # (prompt tokens, output tokens)
_SIM_SETTINGS = {  # name: EngineConfig options; 26 blocks of 2 tokens hold about a third of the demand
    "recompute, no protection": dict(preemption_protection_steps=0),
    "recompute, protection 4": dict(preemption_protection_steps=4),
    "recompute, priorities": dict(scheduling_policy="priority", preemption_protection_steps=2),
    "swap, a roomy CPU pool": dict(preemption_mode="swap", num_cpu_blocks=64),
    "swap, a CPU pool of 6 blocks": dict(preemption_mode="swap", num_cpu_blocks=6),
}


def _simulate(cls, options: dict):
    priority = options.get("scheduling_policy") == "priority"
    seqs = [sim_sequence(f"r{i}", p, m, priority=(i * 7) % 3 if priority else 0, arrival=float(i),
                         first_token=100 * i + 1) for i, (p, m) in enumerate(_SIM_REQUESTS)]
    trace = simulate_schedule(seqs, num_blocks=26, block_size=2, max_steps=3000, max_num_seqs=5,
                              scheduler_cls=cls, **options)
    return trace, {s.request_id: (s.metrics.num_preemptions, s.metrics.num_recomputed_tokens) for s in seqs}


def _check_simulations(cls) -> None:
    for name, options in _SIM_SETTINGS.items():
        what = f"the scheduler simulator, 5 requests on 26 blocks of 2 tokens ({name})"
        try:
            mine, counts = _simulate(cls, options)
        except AssertionError as e:
            raise AssertionError(f"{what}: the pool is inconsistent ({e})") from None
        theirs, expected = _simulate(MiniScheduler, options)
        if len(mine.finished_step) < len(_SIM_REQUESTS):
            raise AssertionError(f"{what}: after 3,000 steps {sorted(set(mine.seqs) - set(mine.finished_step))} "
                                 f"have not finished: the engine stopped making progress (liveness)")
        for t, (a, b) in enumerate(zip(mine.preempted, theirs.preempted)):
            if a != b or mine.steps[t] != theirs.steps[t]:
                raise AssertionError(f"{what}: step {t} preempts {a} and runs {mine.steps[t]}; minivllm's scheduler "
                                     f"preempts {b} and runs {theirs.steps[t]} (request, start, tokens)")
        if counts != expected:
            raise AssertionError(f"{what}: (preemptions, recomputed tokens) per request are {counts}, "
                                 f"minivllm's {expected}")


def _live_requests(tok):
    """Five short prompts that each write 8 tokens: the KV grows mostly while decoding."""
    prompts = [tok(f"A short note about {topic}:")["input_ids"] for topic in TOPICS[:5]]
    return [(f"r{i}", p, greedy(8)) for i, p in enumerate(prompts)]


def check_preemption(cls, live: bool = True) -> None:
    """Check a ``Scheduler`` subclass's ``choose_victim`` and ``preempt`` (chapter 10).

    Targeted victims (rank, priority, arrival, protection, nobody below the
    requester), one preemption by recompute, by swap and by swap with a full
    CPU pool (the accounting of the source notes' example), five squeezed
    runs of the scheduler simulator compared step by step, stopping at the
    first failure; then, unless ``live=False``, the live engine on SmolLM2
    with a pool of about a quarter of the demand, with recompute and with
    swap. An empty subclass is "not written yet".
    """
    cls = own_part(cls, METHODS, MiniScheduler)
    _check_victims(cls)
    _check_preempt(cls)
    _check_simulations(cls)
    say("check_preemption: the victim, recompute, swap, the fallback, the accounting and five squeezed "
          "simulations are right.")
    if not live:
        return
    tok = load_tokenizer("smollm2-135m")
    requests = _live_requests(tok)
    block = 4
    demand = sum(cdiv(len(p) + sp.max_tokens, block) for _, p, sp in requests)
    longest = max(cdiv(len(p) + sp.max_tokens, block) for _, p, sp in requests)
    pool = max(demand // 4, longest)
    for mode in ("recompute", "swap"):
        check_live(f"your preemption ({mode}, a pool of {pool} of the {demand} blocks asked for)", requests,
                   parts={"scheduler_cls": cls}, tokenizer=tok, same_schedule=True, block_size=block,
                   num_blocks=pool, max_num_seqs=6, preemption_mode=mode)
