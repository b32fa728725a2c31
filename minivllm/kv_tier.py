"""The CPU offload tier of the prefix cache: where evicted cached blocks go instead of vanishing (chapter 14).

Pure Python bookkeeping, like the block manager: it hands out tier slots and
never touches a tensor (the KV pools' copies are the model runner's). An entry
is keyed by the block's chain hash and holds the block's whole token prefix
(every token from position 0 to the block's end), so a hit is exact: a hash
collision can never serve wrong KV. Entries are least recently used first;
when the tier is full its LRU entry is dropped. An entry that a step is
restoring is pinned until the step's copies are taken, so no eviction in the
same step can reuse its slot before the restore copy reads it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

__all__ = ["TierEntry", "OffloadTier", "MiniOffloadTier"]


@dataclass
class TierEntry:
    """One offloaded block: its tier slot and the token prefix its KV was computed for."""

    slot: int
    prefix: tuple[int, ...]


class OffloadTier:
    """``num_slots`` CPU block slots, an LRU map from chain hash to entry, and the step's pins: the tier's interface
    and shared helpers (an extension point, ``EngineConfig(offload_tier_cls=...)``). Exercise 14 subclasses it and
    writes :meth:`find`, :meth:`put`, :meth:`restore` and :meth:`unpin_all`; minivllm's own are
    :class:`MiniOffloadTier`'s."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(num_slots))
        self.entries: OrderedDict[int, TierEntry] = OrderedDict()  # chain hash -> entry, least recently used first
        self.pinned: set[int] = set()  # hashes restored by the step being scheduled
        self.num_offloaded = self.num_restored = self.num_dropped = 0  # blocks

    def __len__(self) -> int:
        return len(self.entries)

    # -- what exercise 14 writes (minivllm's own: MiniOffloadTier) --------------------------------
    def find(self, h: int, prefix: tuple[int, ...]) -> TierEntry | None:
        """The entry holding exactly ``prefix`` under hash ``h``, or None (a pure lookup). Exercise 14."""
        raise NotImplementedError("not written yet: OffloadTier.find")

    def put(self, h: int, prefix: tuple[int, ...]) -> int | None:
        """Take in an evicted block: the slot to copy its KV to, or None (already here, or no room).

        Already here with this prefix: None, and it becomes the most recently
        used. Another prefix under ``h`` (a collision): the newer one takes the
        hash unless the old entry is pinned. No free slot: drop the least
        recently used unpinned entry (none: the block is lost). Exercise 14.
        """
        raise NotImplementedError("not written yet: OffloadTier.put")

    def restore(self, h: int) -> int:
        """Pin an entry for this step's restore copy and mark it used; returns its slot (the entry stays).
        Exercise 14."""
        raise NotImplementedError("not written yet: OffloadTier.restore")

    def unpin_all(self) -> None:
        """The step's restore copies are handed to the runner, ordered before any later offload. Exercise 14."""
        raise NotImplementedError("not written yet: OffloadTier.unpin_all")

    # -- shared helpers --------------------------------------------------------------------------
    def discard_slots(self, slots: set[int]) -> None:
        """Forget entries whose offload copy never ran (an interrupted step): their slots hold no KV."""
        for h in [h for h, e in self.entries.items() if e.slot in slots]:
            self.drop(h, count=False)

    def drop(self, h: int, count: bool = True) -> None:
        """Forget entry ``h``: its slot freed, its pin gone; counted as dropped unless ``count`` is False."""
        self.free_slots.append(self.entries.pop(h).slot)
        self.pinned.discard(h)
        self.num_dropped += count

    def check_invariants(self) -> None:
        """Every slot is free or holds exactly one entry; pins name entries."""
        used = [e.slot for e in self.entries.values()]
        free = set(self.free_slots)
        assert len(free) == len(self.free_slots), "a tier slot is twice in the free list"
        assert len(set(used)) == len(used), "two tier entries share a slot"
        assert not free & set(used), "a tier slot is both free and used"
        assert len(free) + len(used) == self.num_slots, \
            f"tier slots leaked: {len(free)} free + {len(used)} used != {self.num_slots}"
        assert self.pinned <= set(self.entries), "a pinned hash has no tier entry"


class MiniOffloadTier(OffloadTier):
    """minivllm's own tier (the engine's default ``offload_tier_cls``): exercise 14's bookkeeping."""

    def find(self, h: int, prefix: tuple[int, ...]) -> TierEntry | None:
        entry = self.entries.get(h)
        return entry if entry is not None and entry.prefix == prefix else None

    def put(self, h: int, prefix: tuple[int, ...]) -> int | None:
        if self.find(h, prefix) is not None:  # a restored block evicted again: its KV is still here
            self.entries.move_to_end(h)
            return None
        if h in self.entries and h not in self.pinned:  # a collision: the newer prefix takes the hash
            self.drop(h)
        if h in self.entries or not (self.free_slots or self._drop_lru()):
            self.num_dropped += 1  # nowhere to keep it: its KV is lost
            return None
        slot = self.free_slots.popleft()
        self.entries[h] = TierEntry(slot, prefix)
        self.num_offloaded += 1
        return slot

    def restore(self, h: int) -> int:
        self.pinned.add(h)
        self.entries.move_to_end(h)
        self.num_restored += 1
        return self.entries[h].slot

    def unpin_all(self) -> None:
        self.pinned.clear()

    def _drop_lru(self) -> bool:
        h = next((h for h in self.entries if h not in self.pinned), None)
        if h is None:
            return False
        self.drop(h)
        return True
