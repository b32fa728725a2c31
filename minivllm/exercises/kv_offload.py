"""Chapter 14, KV offload: the check of the reader's CPU offload tier (an ``OffloadTier`` subclass with
``find``, ``put``, ``restore`` and ``unpin_all``), on targeted cases, a long random sequence of operations
against minivllm's tier, and then inside the live engine (``offload_tier_cls``).
"""

from __future__ import annotations

import random

from minivllm.engine import LLM
from minivllm.exercises._common import own_part, say
from minivllm.exercises.live import _reference, chat_prompts, drive, greedy
from minivllm.kv_tier import MiniOffloadTier, TierEntry
from minivllm.models import load_tokenizer

__all__ = ["check_offload_tier", "METHODS"]

METHODS = ("find", "put", "restore", "unpin_all")  # what exercise 14 writes

COUNTERS = ("num_offloaded", "num_restored", "num_dropped")
_live_references: dict = {}  # minivllm's tier in the live engine, per options: computed once a session


def _tier(cls, num_slots: int, entries=(), pinned=()):
    """A tier of ``cls`` in a given state: ``entries`` (hash, prefix), least recently used first, in slots 0, 1, ..."""
    tier = cls(num_slots)
    for h, prefix in entries:
        tier.entries[h] = TierEntry(tier.free_slots.popleft(), tuple(prefix))
    tier.pinned.update(pinned)
    return tier


def _state(tier) -> dict:
    return {"entries (hash, slot, prefix), least recently used first": [(h, e.slot, e.prefix)
                                                                        for h, e in tier.entries.items()],
            "pinned": sorted(tier.pinned), "free_slots": list(tier.free_slots),
            **{c: getattr(tier, c) for c in COUNTERS}}


def _call(what: str, method, *args):
    """The reader's method called; an exception becomes a failure that names the call."""
    try:
        return method(*args)
    except Exception as e:
        raise AssertionError(f"{what}: {method.__name__}{args} raised {type(e).__name__}: {e}") from e


def _expect(ok: bool, what: str, hint: str) -> None:
    if not ok:
        raise AssertionError(f"{what}: {hint}")


def _same_state(mine, ref, what: str, hints: dict[str, str]) -> None:
    """Each differing part of the state, named, with the hint for that part."""
    a, b = _state(mine), _state(ref)
    for key in b:
        if a[key] != b[key]:
            raise AssertionError(f"{what}: {key} is {a[key]}, expected {b[key]}" +
                                 (f"; {hints[key]}" if key in hints else ""))
    try:
        mine.check_invariants()
    except AssertionError as e:
        raise AssertionError(f"{what}: the tier is inconsistent afterwards ({e})") from None


A, B, C, D = (101, (1, 2)), (202, (3, 4)), (303, (5, 6)), (404, (7, 8))  # (chain hash, token prefix)
LRU = "entries (hash, slot, prefix), least recently used first"


def _check_find(cls) -> None:
    tier = _tier(cls, 4, [A, B])
    before = _state(tier)
    hit = _call("find", tier.find, *A)
    _expect(isinstance(hit, TierEntry) and hit.slot == 0 and hit.prefix == A[1],
            f"find({A[0]}, {A[1]}) with that exact entry in slot 0", f"should return its TierEntry, got {hit!r}")
    _expect(tier.find(999, (1, 2)) is None, "find(999, ...) with no entry under hash 999", "should return None")
    got = _call("find", tier.find, A[0], (9, 9))
    _expect(got is None, f"find({A[0]}, (9, 9)): hash {A[0]} holds the prefix {A[1]}, not (9, 9)",
            f"got {got!r}; a hash collision: a hit must hold exactly this token prefix (compare entry.prefix with "
            "prefix), or the engine serves another prompt's KV")
    _expect(_state(tier) == before, "find() changed the tier",
            f"{_state(tier)} instead of {before}; find is a pure lookup (the block manager calls it for every block "
            "of a chain, also for a request that is then not admitted): never reorder, pin or count there")


def _check_put(cls, ref_cls=MiniOffloadTier) -> None:
    slot_hint = {"free_slots": "a new entry takes the first free slot, self.free_slots.popleft()",
                 "num_offloaded": "count every block taken in, and only those, in num_offloaded",
                 "num_dropped": "num_dropped counts every block whose KV is lost: an entry dropped to make room, "
                                "or a block the tier could not take"}
    cases = [  # (what, num_slots, entries, pinned, put, expected return, hints by part of the state)
        ("put into an empty tier of 2 slots", 2, [], [], A, 0,
         {LRU: "record the block as TierEntry(slot, prefix) under its hash"}),
        ("put(A) when A is already there with the same prefix (a restored block evicted again)", 3, [A, B], [], A,
         None, {"return": "A is already in the tier with this exact prefix (find(h, prefix) finds it): its KV is "
                          "still there, so copy nothing and return None",
                LRU: "its KV is still in the tier: no second copy, but it was just used, so move it to the most "
                     "recently used end (self.entries.move_to_end(h))",
                "free_slots": "A is already here: take no slot", "num_offloaded": "A is already here: no copy"}),
        ("put(C) into a full tier of 2 holding A (least recently used) and B", 2, [A, B], [], C, 0,
         {LRU: "a full tier drops its least recently used entry, the first of self.entries (OrderedDict order)"}),
        ("put(C) into a full tier of 2 holding A (least recently used, pinned) and B", 2, [A, B], [A[0]], C, 1,
         {LRU: "a pinned entry is being restored by this step (its slot is read after this eviction's copy): "
               "never drop it; drop the least recently used entry that is not pinned"}),
        ("put(C) into a full tier whose every entry is pinned", 2, [A, B], [A[0], B[0]], C, None,
         {LRU: "with every entry pinned there is nowhere to put the block: change nothing and return None"}),
        ("put(A's hash, (9, 9)): a collision, another prefix under A's hash", 3, [A, B], [], (A[0], (9, 9)), 2,
         dict.fromkeys((LRU, "return"), "a collision: the newer prefix takes the hash; drop the old entry "
                                        "(self.drop(h)) and store the new one")),
        ("put(A's hash, (9, 9)) while A (another prefix) is pinned", 3, [A, B], [A[0]], (A[0], (9, 9)), None,
         {LRU: "the colliding entry is pinned for a restore: keep it, do not take the new block"}),
    ]
    for what, slots, entries, pinned, (h, prefix), want, hints in cases:
        mine, ref = _tier(cls, slots, entries, pinned), _tier(ref_cls, slots, entries, pinned)
        try:
            got = _call(what, mine.put, h, prefix)
        except AssertionError as e:
            raise AssertionError(f"{e}; {hints[LRU]}") from None
        expected = ref.put(h, prefix)
        assert expected == want, (what, expected)
        if got != expected and (got is None or expected is None):
            hint = hints.get("return") or ("the block is not copied, so put must return None" if expected is None
                                           else "return the slot to copy the block's KV to")
            raise AssertionError(f"{what}: put returned {got!r}, expected {expected!r}; {hint}")
        _same_state(mine, ref, what, {**slot_hint, **hints})  # a wrong slot shows in the state, with its hint
        _expect(got == expected, what, f"put returned slot {got!r}, but the entry is in slot {expected!r}")


def _check_restore_and_unpin(cls) -> None:
    hints = {"pinned": "restore pins the entry (self.pinned.add(h)) until the step's copies are taken: an eviction "
                       "in the same step must not reuse its slot before the restore reads it",
             LRU: "a restore is a use: move the entry to the most recently used end, and keep it (the KV stays "
                  "in the tier, so the block is not copied again when it is evicted next)",
             "num_restored": "count each restore in num_restored"}
    mine, ref = _tier(cls, 3, [A, B, C]), _tier(MiniOffloadTier, 3, [A, B, C])
    got = _call("restore", mine.restore, A[0])
    _expect(got == 0, f"restore({A[0]}) with A in slot 0", f"should return its slot 0, got {got!r}")
    ref.restore(A[0])
    _same_state(mine, ref, f"restore({A[0]}) in a tier holding A, B, C", hints)
    _call("unpin_all", mine.unpin_all)
    ref.unpin_all()
    _same_state(mine, ref, "unpin_all() after restore(A)",
                {**hints, "pinned": "the step's restores are handed to the runner: clear every pin (or a pinned "
                                    "entry can never be dropped, and the tier fills up with pins)"})


def _random_ops(seed: int, n: int):
    rng = random.Random(seed)
    prefixes = {h: (h, h + 1) for h in range(8)}
    for _ in range(n):
        kind = rng.choices(["put", "put", "find", "restore", "unpin"], [4, 1, 2, 2, 1])[0]
        h = rng.randrange(8)
        prefix = prefixes[h] if rng.random() < 0.9 else (h, 99)  # now and then a collision
        yield kind, h, prefix


def _rule(ref, kind: str, h: int, prefix: tuple) -> str:
    """The rule that decides operation ``kind`` on minivllm's tier ``ref`` as it is now (before the operation)."""
    if kind == "find":
        return ("find is a pure lookup: the entry under h if it holds exactly this prefix, else None; it never "
                "reorders, pins or counts")
    if kind == "restore":
        return ("restore pins the entry (self.pinned.add(h)), makes it the most recently used, counts it in "
                "num_restored and returns its slot; the entry stays")
    if kind == "unpin":
        return "unpin_all clears every pin (self.pinned.clear())"
    entries, pinned = list(ref.entries), ref.pinned
    if ref.find(h, prefix) is not None:
        return (f"put of a block already in the tier with this exact prefix (hash {h}): copy nothing, return None, "
                "and make the entry the most recently used (self.entries.move_to_end(h))")
    if h in ref.entries:
        if h in pinned:
            return (f"a collision with a pinned entry (hash {h} holds {ref.entries[h].prefix}, pinned): keep it; the "
                    "new block is lost: return None and count it in num_dropped")
        return (f"a collision (hash {h} holds {ref.entries[h].prefix}, not {prefix}): the newer prefix takes the "
                "hash: drop the old entry (self.drop(h), counted in num_dropped), then store the new one in the "
                "first free slot")
    if not ref.free_slots:
        victim = next((k for k in entries if k not in pinned), None)
        if victim is None:
            return ("the tier is full and every entry is pinned: the block is lost, return None and count it in "
                    "num_dropped")
        return (f"the tier is full: drop the least recently used entry that is not pinned (hash {victim}; "
                f"least recently used first: {entries}, pinned {sorted(pinned)}), then store the block in the slot "
                "that frees")
    return ("a new entry takes the first free slot (self.free_slots.popleft()) at the most recently used end, "
            "counted in num_offloaded, and put returns that slot")


def _check_sequence(cls, num_slots: int = 4, seed: int = 0, n: int = 300) -> None:
    """A random mix of operations on a tier of 4 slots, state compared after each: the first that differs, with
    the rule that decided it."""
    mine, ref, log = cls(num_slots), MiniOffloadTier(num_slots), []
    for kind, h, prefix in _random_ops(seed, n):
        if kind == "restore" and ref.find(h, prefix) is None:  # as the block manager does: only what find returns
            continue
        rule = _rule(ref, kind, h, prefix)
        if kind == "restore":
            call = f"restore({h})"
            got, expected = _call(call, mine.restore, h), ref.restore(h)
        elif kind == "unpin":
            call = "unpin_all()"
            got, expected = _call(call, mine.unpin_all), ref.unpin_all()
        else:
            call = f"{kind}({h}, {prefix})"
            got, expected = _call(call, getattr(mine, kind), h, prefix), getattr(ref, kind)(h, prefix)
        log.append(call)
        what = f"after {len(log)} operations on a tier of {num_slots} slots (the last ones: {'; '.join(log[-4:])})"
        if got != expected:
            raise AssertionError(f"{what}: {call} returned {got!r}, expected {expected!r}; the rule here: {rule}")
        try:
            _same_state(mine, ref, what, {})
        except AssertionError as e:
            raise AssertionError(f"{e}; the rule for {call} here: {rule}") from None


def _live_requests(tok):
    prompts = chat_prompts(tok, 6)  # two of them several hundred tokens long
    params = greedy(3)
    return [(f"{r}-{i}", p, params) for r, ps in enumerate((prompts, prompts[:4])) for i, p in enumerate(ps)]


def _run_tier(options: dict, requests, what: str, tier_cls=None) -> tuple[dict, dict]:
    llm = LLM("smollm2-135m", **options, **({"offload_tier_cls": tier_cls} if tier_cls else {}))
    outputs, _ = drive(llm, requests, what)
    stats = llm.engine.stats()
    return outputs, {c: getattr(stats, f"{c}_blocks") for c in COUNTERS}


def _check_live(cls, options: dict, requests) -> str:
    off = {k: v for k, v in options.items() if k != "kv_offload_blocks"}
    expected, _, _ = _reference("smollm2-135m", off, requests)  # the oracle: no tier at all
    key = (tuple(sorted(options.items())), tuple(rid for rid, _, _ in requests))
    if key not in _live_references:
        _live_references[key] = _run_tier(options, requests, "minivllm's tier")[1]
    ref_counts = _live_references[key]
    what = f"your tier in the live engine (a tier of {options['kv_offload_blocks']} blocks)"
    outputs, counts = _run_tier(options, requests, what, cls)
    for rid, want in expected.items():
        if outputs[rid] != want:
            i = next((i for i, (a, b) in enumerate(zip(want, outputs[rid])) if a != b), len(want))
            raise AssertionError(f"{what}: request {rid} differs from the engine without a tier at output token {i}: "
                                 f"expected {want}, got {outputs[rid]} (a restore brought back the wrong KV)")
    if counts != ref_counts:
        raise AssertionError(f"{what}: the tier's counters are {counts}, minivllm's tier counts {ref_counts} on the "
                             "same run (an entry kept, dropped or restored that minivllm's would not)")
    assert ref_counts["num_restored"] > 0, "the live workload must restore blocks"
    return f"{counts['num_offloaded']} offloaded, {counts['num_restored']} restored, {counts['num_dropped']} dropped"


def check_offload_tier(cls, live: bool = True) -> None:
    """Check an ``OffloadTier`` subclass's ``find``, ``put``, ``restore`` and ``unpin_all`` (chapter 14).

    Targeted cases first (the exact prefix check, a pure lookup, a block
    already there, LRU eviction, pins, collisions, the counters), then 300
    random operations against minivllm's tier (a failure names the rule that
    decides the operation), stopping at the first failure; then, unless
    ``live=False``, the live engine on SmolLM2 with the class as its tier,
    twice: a tier that holds everything
    evicted, and one so small that it drops entries while restores are pinned.
    Both must give exactly the tokens of the engine without a tier, and the
    counters of minivllm's tier. An empty subclass is "not written yet".
    """
    cls = own_part(cls, METHODS, MiniOffloadTier)
    _check_find(cls)
    _check_put(cls)
    _check_restore_and_unpin(cls)
    _check_sequence(cls)
    say("check_offload_tier: the exact prefix check, LRU eviction, pins, collisions and the counters are right "
          "(targeted cases and 300 random operations).")
    if not live:
        return
    tok = load_tokenizer("smollm2-135m")
    requests = _live_requests(tok)
    # float32 on a GPU too (as chapter 14 measures it): a prompt served partly from the tier is prefilled in other
    # shapes than one computed whole, and bf16 may round those differently
    base = dict(block_size=16, num_blocks=40, enable_prefix_caching=True, max_num_seqs=4, dtype="float32")
    for tier_blocks in (128, 6):
        counts = _check_live(cls, {**base, "kv_offload_blocks": tier_blocks}, requests)
        say(f"check_offload_tier: the live engine (smollm2-135m, {len(requests)} requests, a tier of "
              f"{tier_blocks} blocks: {counts}) gave exactly the tokens of the engine without a tier, with minivllm's "
              "counters; the block invariants held after every step.")
