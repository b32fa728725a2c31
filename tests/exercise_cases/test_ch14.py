"""Chapter 14: a reader's CPU offload tier (find, put, restore, unpin_all), plugged in as offload_tier_cls."""

from minivllm.exercises import check_offload_tier
from minivllm.kv_tier import OffloadTier, TierEntry

from exercise_cases import Check


class MyOffloadTier(OffloadTier):
    """The solution notebook's answer."""

    def find(self, h, prefix):
        entry = self.entries.get(h)
        return entry if entry is not None and entry.prefix == prefix else None

    def put(self, h, prefix):
        if self.find(h, prefix) is not None:
            self.entries.move_to_end(h)
            return None
        if h in self.entries:
            if h in self.pinned:
                self.num_dropped += 1
                return None
            self.drop(h)
        if not self.free_slots:
            victim = next((k for k in self.entries if k not in self.pinned), None)
            if victim is None:
                self.num_dropped += 1
                return None
            self.drop(victim)
        slot = self.free_slots.popleft()
        self.entries[h] = TierEntry(slot, prefix)
        self.num_offloaded += 1
        return slot

    def restore(self, h):
        self.pinned.add(h)
        self.entries.move_to_end(h)
        self.num_restored += 1
        return self.entries[h].slot

    def unpin_all(self):
        self.pinned.clear()


class FindsByHashOnly(MyOffloadTier):
    def find(self, h, prefix):
        return self.entries.get(h)


class FindTouchesLRU(MyOffloadTier):
    def find(self, h, prefix):
        entry = super().find(h, prefix)
        if entry is not None:
            self.entries.move_to_end(h)
        return entry


class CopiesAgain(MyOffloadTier):
    def put(self, h, prefix):  # no "already here" check: a restored block evicted again is copied a second time
        if h in self.entries and h not in self.pinned:
            self.drop(h)
        return super().put(h, prefix)


class DropsMostRecent(MyOffloadTier):
    def put(self, h, prefix):
        if not self.free_slots and self.find(h, prefix) is None and h not in self.entries:
            victim = next((k for k in reversed(self.entries) if k not in self.pinned), None)
            if victim is not None:
                self.drop(victim)
        return super().put(h, prefix)


class DropsPinned(MyOffloadTier):
    def put(self, h, prefix):
        if not self.free_slots and self.find(h, prefix) is None and h not in self.entries:
            self.drop(next(iter(self.entries)))
        return super().put(h, prefix)


class FullTierRaises(MyOffloadTier):
    def put(self, h, prefix):
        if not self.free_slots and self.find(h, prefix) is None and h not in self.entries:
            self.drop(next(k for k in self.entries if k not in self.pinned))  # StopIteration when all are pinned
        return super().put(h, prefix)


class DropsUncounted(MyOffloadTier):
    def put(self, h, prefix):
        if not self.free_slots and self.find(h, prefix) is None and h not in self.entries:
            victim = next((k for k in self.entries if k not in self.pinned), None)
            if victim is not None:
                self.drop(victim, count=False)
        return super().put(h, prefix)


class CollisionKeepsOld(MyOffloadTier):
    def put(self, h, prefix):
        if h in self.entries and self.find(h, prefix) is None:
            return None  # the old prefix keeps the hash; the new block is lost, uncounted
        return super().put(h, prefix)


class RestoreWithoutPin(MyOffloadTier):
    def restore(self, h):
        self.entries.move_to_end(h)
        self.num_restored += 1
        return self.entries[h].slot


class RestoreKeepsLRUOrder(MyOffloadTier):
    def restore(self, h):
        self.pinned.add(h)
        self.num_restored += 1
        return self.entries[h].slot


class RestoreTakesTheEntry(MyOffloadTier):
    def restore(self, h):
        slot = super().restore(h)
        self.drop(h, count=False)  # as if a restored block left the tier
        return slot


class KeepsPins(MyOffloadTier):
    def unpin_all(self):
        pass


class CountsEachPinOnce(MyOffloadTier):
    """Passes every targeted case (one restore each): a block restored twice in one step is counted once."""

    def restore(self, h):
        if h not in self.pinned:
            self.num_restored += 1
        self.pinned.add(h)
        self.entries.move_to_end(h)
        return self.entries[h].slot


CHECKS = [Check("14", check_offload_tier, [MyOffloadTier], {
    "find by hash only": (FindsByHashOnly, "hash collision"),
    "find reorders the LRU": (FindTouchesLRU, "pure lookup"),
    "copies a block already there": (CopiesAgain, "already in the tier"),
    "drops the most recent entry": (DropsMostRecent, "least recently used entry"),
    "drops a pinned entry": (DropsPinned, "never drop it"),
    "a full pinned tier raises": (FullTierRaises, ("raised StopIteration", "every entry is pinned")),
    "drops without counting": (DropsUncounted, "num_dropped counts"),
    "a collision keeps the old prefix": (CollisionKeepsOld, "the newer prefix takes the hash"),
    "restore without a pin": (RestoreWithoutPin, "restore pins the entry"),
    "restore is not a use": (RestoreKeepsLRUOrder, "a restore is a use"),
    "restore takes the entry out": (RestoreTakesTheEntry, "keep it"),
    "pins kept after the step": (KeepsPins, "clear every pin"),
    "a restore counted once per pin (random operations)": (CountsEachPinOnce, (
        r"num_restored is \d+, expected \d+", "the rule for restore\(\d\) here: restore pins the entry", "counts it")),
}, passes="the live engine")]
