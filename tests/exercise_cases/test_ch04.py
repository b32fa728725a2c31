"""Chapter 04: a reader's block manager (allocate, free, slot_mapping)."""

from minivllm.block_manager import BlockManager
from minivllm.exercises import check_block_manager

from exercise_cases import Check


class MyBlockManager(BlockManager):
    """The solution notebook's answer."""

    def allocate(self, seq, num_tokens, cached_blocks=(), watermark=False, restored=()):
        need = -(-num_tokens // self.block_size) - len(seq.block_table) - len(cached_blocks)
        revived = sum(self.blocks[b].ref_count == 0 for b in cached_blocks)
        if self.num_free_blocks - revived - max(0, need) < (self.watermark_blocks if watermark else 0):
            return False
        for block in cached_blocks:
            self.claim(block)
        seq.block_table.extend(cached_blocks)
        seq.block_table.extend(self.take_restored_blocks(restored))
        for _ in range(need - len(restored)):
            seq.block_table.append(self.take_free_block())
        return True

    def free(self, seq):
        for block in reversed(seq.block_table):
            self.release(block)
        seq.block_table = []
        self.forget(seq)

    def slot_mapping(self, seq, start, end):
        bs = self.block_size
        return [seq.block_table[i // bs] * bs + i % bs for i in range(start, end)]


class FloorDivision(MyBlockManager):
    def allocate(self, seq, num_tokens, cached_blocks=(), watermark=False, restored=()):
        return super().allocate(seq, num_tokens // self.block_size * self.block_size, cached_blocks, watermark,
                                restored)


class GrowsTwice(MyBlockManager):
    def allocate(self, seq, num_tokens, cached_blocks=(), watermark=False):
        need = -(-num_tokens // self.block_size) - len(cached_blocks)  # forgets the blocks it already holds
        if need > self.num_free_blocks:
            return False
        seq.block_table.extend(cached_blocks)
        for block in cached_blocks:
            self.claim(block)
        seq.block_table.extend(self.take_free_block() for _ in range(need))
        return True


class TakesWhatItCan(MyBlockManager):
    def allocate(self, seq, num_tokens, cached_blocks=(), watermark=False):
        while len(seq.block_table) * self.block_size < num_tokens:
            if not self.num_free_blocks:
                return False  # keeps the blocks it took
            seq.block_table.append(self.take_free_block())
        return True


class IgnoresCachedBlocks(MyBlockManager):
    def allocate(self, seq, num_tokens, cached_blocks=(), watermark=False, restored=()):
        return super().allocate(seq, num_tokens, (), watermark, restored)


class CachedBlocksCostNothing(MyBlockManager):
    """The issue's allocator: all or nothing over the new blocks alone, as if every cached block were shared."""

    def allocate(self, seq, num_tokens, cached_blocks=(), watermark=False, restored=()):
        need = -(-num_tokens // self.block_size) - len(seq.block_table) - len(cached_blocks)
        if need > self.num_free_blocks - (self.watermark_blocks if watermark else 0):
            return False
        for block in cached_blocks:
            self.claim(block)
        seq.block_table.extend(cached_blocks)
        seq.block_table.extend(self.take_restored_blocks(restored))
        seq.block_table.extend(self.take_free_block() for _ in range(need - len(restored)))
        return True


class CachedBlocksAllCost(MyBlockManager):
    """The opposite slip: every cached block counted as taken, even one another sequence holds."""

    def allocate(self, seq, num_tokens, cached_blocks=(), watermark=False, restored=()):
        need = -(-num_tokens // self.block_size) - len(seq.block_table) - len(cached_blocks)
        if self.num_free_blocks - len(cached_blocks) - max(0, need) < (self.watermark_blocks if watermark else 0):
            return False
        return super().allocate(seq, num_tokens, cached_blocks, watermark, restored)


class IgnoresWatermark(MyBlockManager):
    def allocate(self, seq, num_tokens, cached_blocks=(), watermark=False, restored=()):
        return super().allocate(seq, num_tokens, cached_blocks, False, restored)


class NoRestoredArgument(MyBlockManager):
    """The signature exercise 04 used to give: chapter 14's scheduler passes a fifth argument."""

    def allocate(self, seq, num_tokens, cached_blocks=(), watermark=False):
        return super().allocate(seq, num_tokens, cached_blocks, watermark)


class IgnoresRestored(MyBlockManager):
    def allocate(self, seq, num_tokens, cached_blocks=(), watermark=False, restored=()):
        return super().allocate(seq, num_tokens, cached_blocks, watermark)  # plain blocks: their KV never comes back


class FreesSharedBlocks(MyBlockManager):
    def free(self, seq):
        for block in seq.block_table:
            self.blocks[block].ref_count = 0
            self.free_blocks.append(block)
        seq.block_table = []
        self.forget(seq)


class FreesFirstToLast(MyBlockManager):
    def free(self, seq):
        for block in seq.block_table:
            self.release(block)
        seq.block_table = []
        self.forget(seq)


class FreesWithoutForget(MyBlockManager):
    def free(self, seq):
        for block in reversed(seq.block_table):
            self.release(block)
        seq.block_table = []


class KeepsItsTable(MyBlockManager):
    def free(self, seq):
        for block in reversed(seq.block_table):
            self.release(block)
        self.forget(seq)


class SlotWithoutBlockSize(MyBlockManager):
    def slot_mapping(self, seq, start, end):
        return [seq.block_table[i // self.block_size] + i % self.block_size for i in range(start, end)]


class SlotFromLogicalBlock(MyBlockManager):
    def slot_mapping(self, seq, start, end):
        return list(range(start, end))


CHECKS = [Check("04", check_block_manager, [MyBlockManager], {
    "floor division": (FloorDivision, "ceil"),
    "grows the table twice": (GrowsTwice, "only the blocks the table lacks"),
    "not all or nothing": (TakesWhatItCan, "all or nothing"),
    "ignores cached blocks": (IgnoresCachedBlocks, "claim cached_blocks"),
    "cached blocks nobody holds cost nothing": (CachedBlocksCostNothing,
                                                "claiming a cached block nobody holds takes a free block too"),
    "every cached block costs a block": (CachedBlocksAllCost, "claiming it costs no free block"),
    "ignores the watermark": (IgnoresWatermark, "watermark_blocks"),
    "no restored argument": (NoRestoredArgument, "give allocate the parameter restored=()"),
    "ignores restored": (IgnoresRestored, r"self.take_restored_blocks\(restored\)"),
    "frees a shared block": (FreesSharedBlocks, "shared block loses one reference"),
    "frees first to last": (FreesFirstToLast, "release the last block first"),
    "free without forget": (FreesWithoutForget, r"end free with self.forget\(seq\)"),
    "keeps its table": (KeepsItsTable, "block_table must be empty"),
    "slot without block_size": (SlotWithoutBlockSize, "not multiplied by block_size"),
    "slot from the logical block": (SlotFromLogicalBlock, "logical block"),
}, passes="the live engine")]
