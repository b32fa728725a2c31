"""The KV pool's bookkeeping: blocks, block tables, ref counts and the prefix cache (chapters 04, 08 and 10).

Pure Python: it hands out block ids and never touches a tensor. A sequence's
``block_table`` lists its blocks in token order, so token ``i`` lives in block
``block_table[i // block_size]`` at offset ``i % block_size``.

Prefix caching: once a full block's KV is computed, the block is registered
under a chain hash of (parent hash, its token ids). A later prompt walks its
own chain and reuses every block it finds, sharing it through ref counts. A
hash is only an index: a hit is confirmed by the block's token ids and by its
parent block (id and registration generation), so a collision can never serve
wrong KV. Freed blocks keep their KV and hash; they are evicted least recently
used, and only when a new block is needed and no unhashed free block is left.

Admission is one step: :meth:`lookup_prefix` only looks, and
:meth:`allocate` claims the hits and the new blocks together, or nothing.

:class:`BlockManager` is the interface (what exercises 04 and 08 subclass:
the methods they write only raise there) with the shared helpers;
:class:`MiniBlockManager` is minivllm's own, the engine's default.

With a CPU offload tier (chapter 14, :mod:`minivllm.kv_tier`) an evicted
cached block's KV is copied to the tier instead of dropped, and a prompt whose
chain continues there (:meth:`lookup_offloaded`) gets those blocks restored
into fresh device blocks. The copies to make are taken once per step
(:meth:`take_tier_copies`): offloads run before anything writes a device
block, restores after them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from minivllm.config import cdiv
from minivllm.kv_tier import MiniOffloadTier
from minivllm.sequence import Sequence

__all__ = ["slots", "Block", "BlockManager", "MiniBlockManager"]


def slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The KV slots of tokens ``[start, end)``: token ``i`` is at offset ``i % block_size`` of block ``block_table[i // block_size]``."""
    return [block_table[i // block_size] * block_size + i % block_size for i in range(start, end)]


@dataclass
class Block:
    """One KV block: who holds it, and, while it is in the prefix cache, what it holds."""

    block_id: int
    ref_count: int = 0  # sequences whose block table holds it
    hash: int | None = None  # chain hash, while registered in the prefix cache
    tokens: tuple[int, ...] | None = None  # the token ids its KV was computed for, while registered
    # (block id, generation) of the block before it, while registered
    parent: tuple[int, int] | None = None
    generation: int = 0  # bumped at each registration, so a stale parent link never matches

    def matches(self, tokens: tuple[int, ...], parent: tuple[int, int] | None) -> bool:
        return self.hash is not None and self.tokens == tokens and self.parent == parent


class BlockManager:
    """The block manager's interface and shared helpers (an extension point: ``EngineConfig(block_manager_cls=...)``).

    Exercises 04 and 08 subclass it and write :meth:`allocate`, :meth:`free`,
    :meth:`slot_mapping` (04), :meth:`lookup_prefix`,
    :meth:`register_computed_blocks`, :meth:`take_free_block` and
    :meth:`release` (08); here they only say what they do. minivllm's own are
    :class:`MiniBlockManager`'s, the engine's default.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_cpu_blocks: int = 0, watermark: float = 0.0, num_offload_blocks: int = 0,
                 tier_cls: type = MiniOffloadTier):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = watermark * num_blocks  # headroom that admissions leave free (chapter 10)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: deque[int] = deque(range(num_blocks))  # ref 0, no hash
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 with a hash, least recently used first
        self.hash_to_block: dict[int, int] = {}
        # seq_id -> per computed full block: (chain hash, the registered block holding exactly that prefix as
        # (id, generation), or None if there is none, e.g. after a hash collision)
        self.seq_links: dict[int, list[tuple[int, tuple[int, int] | None]]] = {}
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu_blocks: deque[int] = deque(range(num_cpu_blocks))  # the swap space (chapter 10)
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.tier = tier_cls(num_offload_blocks) if num_offload_blocks else None  # chapter 14
        self.offloads: list[tuple[int, int]] = []  # (device block, tier slot) copies not yet handed to the runner
        self.restores: list[tuple[int, int]] = []  # (tier slot, device block) copies, likewise

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached-but-free ones included: they can be evicted)."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that its table covers ``num_tokens`` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(seq.block_table))

    # -- what exercises 04 and 08 write (minivllm's own: MiniBlockManager) -------------------------
    def allocate(self, seq: Sequence, num_tokens: int, cached_blocks: list[int] = (),
                 watermark: bool = False, restored: list[int] = ()) -> bool:
        """Grow ``seq``'s table to cover ``num_tokens`` tokens; all or nothing (False: nothing changed).

        ``cached_blocks`` (from :meth:`lookup_prefix`, for a sequence without
        blocks) are claimed first. With ``watermark`` the allocation must also
        leave the admission watermark free (chapter 10). ``restored`` (tier
        hashes from :meth:`lookup_offloaded`) are the first new blocks: their
        KV is copied back from the CPU tier (chapter 14). Exercise 04.
        """
        raise NotImplementedError("not written yet: BlockManager.allocate")

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (finish, abort or preemption), last first; shared blocks just lose a reference;
        then :meth:`forget` it. Exercise 04."""
        raise NotImplementedError("not written yet: BlockManager.free")

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Where the KV of ``seq``'s tokens ``[start, end)`` is written (its table must cover them). Exercise 04."""
        raise NotImplementedError("not written yet: BlockManager.slot_mapping")

    def take_free_block(self) -> int:
        """A block for new KV, owned once: an unused one, else the least recently used cached one (evicted, its KV
        offered to the CPU tier with :meth:`_offload`, chapter 14). Exercise 08."""
        raise NotImplementedError("not written yet: BlockManager.take_free_block")

    def release(self, block: int) -> None:
        """One owner fewer; with none left, a cached block waits (evictable, most recently used) and any other is
        free. Exercise 08."""
        raise NotImplementedError("not written yet: BlockManager.release")

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks that start ``seq``'s tokens, without claiming them (a pure lookup).

        The last token is never served from the cache: its logits are needed
        to sample the next token. Exercise 08.
        """
        raise NotImplementedError("not written yet: BlockManager.lookup_prefix")

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Make ``seq``'s newly completed full blocks findable (their KV is now written).

        A block whose exact prefix is already registered (another request computed
        the same tokens) is not registered twice; its successors link to the
        registered one, so later lookups follow a single chain. Exercise 08.
        """
        raise NotImplementedError("not written yet: BlockManager.register_computed_blocks")

    # -- shared helpers --------------------------------------------------------------------------
    def claim(self, block: int) -> None:
        """One more owner for a block another sequence computed (a prefix-cache hit, a fork)."""
        if self.blocks[block].ref_count == 0:
            del self.evictable[block]
        self.blocks[block].ref_count += 1

    def take_restored_blocks(self, restored: list[int]) -> list[int]:
        """Fresh blocks for tier entries ``restored`` (chapter 14), their KV's copies back queued for the step."""
        slots = [self.tier.restore(h) for h in restored]  # pinned first: the evictions below keep them
        blocks = [self.take_free_block() for _ in slots]
        self.restores.extend(zip(slots, blocks))
        return blocks

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Release ``seq``'s blocks past its first ``num_tokens`` tokens: speculative decoding's rollback (chapter 17).

        They hold only rejected drafts' KV, so none was ever registered in the
        prefix cache; a partly rejected last block stays, its rejected slots
        rewritten by the next step before it can fill up and be registered.
        """
        keep = cdiv(num_tokens, self.block_size)
        for block in reversed(seq.block_table[keep:]):
            assert self.blocks[block].hash is None, "a block past the computed tokens was cached"
            self.release(block)
        del seq.block_table[keep:]

    def forget(self, seq: Sequence) -> None:
        """Drop what the swap space and the prefix cache keep for ``seq`` (it is gone, or starts over)."""
        self.free_cpu_blocks.extend(seq.cpu_block_table)
        seq.cpu_block_table = []
        self.seq_links.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]] | None:
        """Give ``child`` ``parent``'s computed blocks: full ones shared, a partly filled last one copied.

        Returns the (source, destination) block copies to make before the
        child's next forward (copy on write), or None when no block is free for
        the copy (the child must then recompute instead).
        """
        assert not child.block_table, "fork into a sequence without blocks"
        computed = parent.cached_token_count
        full = computed // self.block_size
        partial = computed % self.block_size != 0
        if partial and self.num_free_blocks == 0:
            return None
        for block in parent.block_table[:full]:
            self.claim(block)
        child.block_table = parent.block_table[:full]
        copies = []
        if partial:
            copies.append((parent.block_table[full], self.take_free_block()))
            child.block_table.append(copies[0][1])
        child.cached_token_count = computed
        self.seq_links[child.seq_id] = list(self.seq_links.get(parent.seq_id, []))[:full]
        return copies

    # -- swap (chapter 10) ---------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self.free_cpu_blocks)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq``'s blocks to the CPU pool; returns the (device block, cpu block) copies to make."""
        pairs = [(block, self.free_cpu_blocks.popleft()) for block in seq.block_table]
        for block in reversed(seq.block_table):
            self.release(block)
        seq.block_table = []
        seq.cpu_block_table = [cpu for _, cpu in pairs]
        return pairs

    def swap_in(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]] | None:
        """Bring ``seq``'s blocks back and grow them to ``num_tokens`` tokens; the (cpu, device) copies, or None."""
        if max(len(seq.cpu_block_table), cdiv(num_tokens, self.block_size)) > self.num_free_blocks:
            return None
        pairs = [(cpu, self.take_free_block()) for cpu in seq.cpu_block_table]
        self.free_cpu_blocks.extend(seq.cpu_block_table)
        seq.cpu_block_table = []
        seq.block_table = [block for _, block in pairs]
        self.allocate(seq, num_tokens)
        return pairs

    # -- prefix cache --------------------------------------------------------------------------
    @staticmethod
    def chain_hash(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent_hash, tokens))

    def match_prefix(self, seq: Sequence) -> int:
        """Look up and claim the cached blocks that start ``seq``; returns the number of tokens they hold."""
        assert not seq.block_table, "match_prefix is for a sequence without blocks"
        hits = self.lookup_prefix(seq)
        self.allocate(seq, len(hits) * self.block_size, hits)
        return len(hits) * self.block_size

    def record_prefix_lookup(self, seq: Sequence, hit_tokens: int) -> None:
        """Count an admitted sequence's lookup: every token it looked up, and those found (vLLM's queries/hits)."""
        if self.enable_prefix_caching:
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += hit_tokens

    def _unregister(self, block: int) -> None:
        record = self.blocks[block]
        del self.hash_to_block[record.hash]
        record.hash = record.tokens = record.parent = None

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    # -- the CPU offload tier (chapter 14) -------------------------------------------------------
    def lookup_offloaded(self, seq: Sequence, start_block: int) -> list[int]:
        """The tier hashes of ``seq``'s blocks from ``start_block`` on (after its device hits),
        without claiming.

        Like :meth:`lookup_prefix`, the last token is never served.
        """
        if self.tier is None:
            return []
        tokens, bs = tuple(seq.token_ids), self.block_size
        found: list[int] = []
        h = None
        for i in range((len(tokens) - 1) // bs):
            h = self.chain_hash(h, tokens[i * bs:(i + 1) * bs])
            if i < start_block:
                continue
            if self.tier.find(h, tokens[:(i + 1) * bs]) is None:
                break
            found.append(h)
        return found

    def _offload(self, block: int) -> None:
        """A cached block is being evicted: queue its KV's copy to the tier (if the tier takes
        it)."""
        if self.tier is None:
            return
        prefix = self.cached_prefix(block)
        if prefix is None:  # an ancestor is gone from the device: no exact key, so it is not kept
            self.tier.num_dropped += 1
            return
        slot = self.tier.put(self.blocks[block].hash, prefix)
        if slot is not None:
            self.offloads.append((block, slot))

    def cached_prefix(self, block: int) -> tuple[int, ...] | None:
        """Every token id from position 0 through registered ``block``, read along its parent links."""
        parts, link = [], (block, self.blocks[block].generation)
        while link is not None:
            record = self.blocks[link[0]]
            if record.hash is None or record.generation != link[1]:
                return None
            parts.append(record.tokens)
            link = record.parent
        return tuple(t for part in reversed(parts) for t in part)

    def take_tier_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The offload and restore copies queued since the last call, for the step's runner; unpins the tier."""
        offloads, restores = self.offloads, self.restores
        self.offloads, self.restores = [], []
        if self.tier is not None:
            self.tier.unpin_all()
        return offloads, restores

    def discard_offloads(self, offloads: list[tuple[int, int]]) -> None:
        """The step was interrupted before these offload copies ran: their tier entries hold no KV."""
        if self.tier is not None and offloads:
            self.tier.discard_slots({slot for _, slot in offloads})

    # -- checks --------------------------------------------------------------------------------
    def check_invariants(self, seqs) -> None:
        """Every block is free or owned; ref counts equal owners; no block in two places."""
        owners = [0] * self.num_blocks
        cpu_owners = [0] * self.num_cpu_blocks
        for seq in seqs:
            for block in seq.block_table:
                owners[block] += 1
            for block in seq.cpu_block_table:
                cpu_owners[block] += 1
        cpu_free = set(self.free_cpu_blocks)
        assert len(cpu_free) == len(self.free_cpu_blocks), "a CPU block is twice in the free list"
        for block in range(self.num_cpu_blocks):
            assert cpu_owners[block] + (block in cpu_free) == 1, (
                f"CPU block {block} has {cpu_owners[block]} owners and is "
                f"{'' if block in cpu_free else 'not '}free"
            )
        free_set, evictable_set = set(self.free_blocks), set(self.evictable)
        assert len(free_set) == len(self.free_blocks), "a block is twice in the free list"
        assert not free_set & evictable_set, "a block is both free and evictable"
        for record in self.blocks:
            block = record.block_id
            assert record.ref_count == owners[block], \
                f"block {block}: ref count {record.ref_count} but {owners[block]} owners"
            in_free = block in free_set or block in evictable_set
            assert in_free != bool(owners[block]), (
                f"block {block} is "
                f"{'owned and free' if in_free else 'neither free nor owned (leaked)'}"
            )
            if block in evictable_set:
                assert record.hash is not None, f"evictable block {block} has no hash"
            if block in free_set:
                assert record.hash is None, f"free block {block} still has a hash"
            if record.hash is not None:
                assert self.hash_to_block.get(record.hash) == block, (
                    f"block {block}'s hash points elsewhere"
                )
        assert len(self.hash_to_block) == sum(r.hash is not None for r in self.blocks)
        if self.tier is not None:
            self.tier.check_invariants()


class MiniBlockManager(BlockManager):
    """minivllm's own block manager (the engine's default ``block_manager_cls``): exercise 04's allocation and
    slot mapping, exercise 08's prefix cache."""

    def allocate(self, seq: Sequence, num_tokens: int, cached_blocks: list[int] = (),
                 watermark: bool = False, restored: list[int] = ()) -> bool:
        assert not cached_blocks or not seq.block_table, (
            "cached blocks start a sequence without blocks"
        )
        need = cdiv(num_tokens, self.block_size) - len(seq.block_table) - len(cached_blocks)
        # they leave the free count too
        revived = sum(self.blocks[b].ref_count == 0 for b in cached_blocks)
        free_after = self.num_free_blocks - revived - max(0, need)
        if free_after < (self.watermark_blocks if watermark else 0):
            return False
        for block in cached_blocks:
            self.claim(block)
        seq.block_table.extend(cached_blocks)
        seq.block_table.extend(self.take_restored_blocks(restored))
        for _ in range(need - len(restored)):
            seq.block_table.append(self.take_free_block())
        return True

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):  # tail first: the prefix stays cached longest
            self.release(block)
        seq.block_table = []
        self.forget(seq)

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        return slots(seq.block_table, start, end, self.block_size)

    def take_free_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            self._offload(block)
            self._unregister(block)
        self.blocks[block].ref_count = 1
        return block

    def release(self, block: int) -> None:
        record = self.blocks[block]
        record.ref_count -= 1
        if record.ref_count == 0:
            if record.hash is not None:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        tokens, bs = seq.token_ids, self.block_size
        found: list[int] = []
        parent_hash, parent = None, None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            parent_hash = self.chain_hash(parent_hash, chunk)
            block = self.hash_to_block.get(parent_hash)
            if block is None or not self.blocks[block].matches(chunk, parent):
                break
            found.append(block)
            parent = (block, self.blocks[block].generation)
        return found

    def register_computed_blocks(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        links = self.seq_links.setdefault(seq.seq_id, [])
        bs = self.block_size
        for i in range(len(links), seq.cached_token_count // bs):
            chunk = tuple(seq.token_slice(i * bs, (i + 1) * bs))
            parent_hash, parent = links[-1] if links else (None, None)
            h = self.chain_hash(parent_hash, chunk)
            existing = self.hash_to_block.get(h)
            # same prefix computed elsewhere (our own hit, too), or a hash collision
            if existing is not None:
                same = self.blocks[existing].matches(chunk, parent)
                links.append((h, (existing, self.blocks[existing].generation) if same else None))
            # the chain above is unregistered: nothing can reach this block
            elif i > 0 and parent is None:
                links.append((h, None))
            else:
                record = self.blocks[seq.block_table[i]]
                record.generation += 1
                record.hash, record.tokens, record.parent = h, chunk, parent
                self.hash_to_block[h] = record.block_id
                links.append((h, (record.block_id, record.generation)))
