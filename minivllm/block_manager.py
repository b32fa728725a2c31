"""The KV pool's bookkeeping: blocks, block tables, ref counts and the prefix cache (chapters 04 and 08).

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
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from minivllm.sequence import Sequence


@dataclass(frozen=True)
class CachedBlock:
    """What a registered block holds: its tokens and the exact parent it was computed after."""

    tokens: tuple[int, ...]
    parent: tuple[int, int] | None  # (block id, generation) of the previous block, None for the first


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_cpu_blocks: int = 0):
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu_blocks: deque[int] = deque(range(num_cpu_blocks))  # the swap space (chapter 10)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # ref 0, no hash
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 with a hash, least recently used first
        self.block_hash: dict[int, int] = {}
        self.hash_to_block: dict[int, int] = {}
        self.cached: dict[int, CachedBlock] = {}
        self.generation = [0] * num_blocks  # bumped each time a block is registered
        # request id -> per computed full block: (chain hash, the registered block holding exactly that
        # prefix as (id, generation), or None if there is none, e.g. after a hash collision)
        self.seq_links: dict[str, list[tuple[int, tuple[int, int] | None]]] = {}
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

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
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s table to cover ``num_tokens`` tokens; all or nothing (False, unchanged)."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:  # evict the least recently used cached block
            block, _ = self.evictable.popitem(last=False)
            self._unregister(block)
        self.ref_counts[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (finish, abort or preemption). Shared blocks just lose a reference."""
        self._release(seq.block_table)
        seq.block_table = []
        self.free_cpu_blocks.extend(seq.cpu_block_table)
        seq.cpu_block_table = []
        self.seq_links.pop(seq.request_id, None)

    def _release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):  # tail first: the prefix stays cached longest
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self.block_hash:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)

    # -- swap (chapter 10) ---------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self.free_cpu_blocks)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq``'s blocks to the CPU pool; returns the (device block, cpu block) copies to make."""
        pairs = [(block, self.free_cpu_blocks.popleft()) for block in seq.block_table]
        self._release(seq.block_table)
        seq.block_table = []
        seq.cpu_block_table = [cpu for _, cpu in pairs]
        return pairs

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring ``seq``'s blocks back to the device; returns the (cpu block, device block) copies to make."""
        assert len(seq.cpu_block_table) <= self.num_free_blocks, "swap_in without room"
        pairs = [(cpu, self._take_free_block()) for cpu in seq.cpu_block_table]
        self.free_cpu_blocks.extend(seq.cpu_block_table)
        seq.cpu_block_table = []
        seq.block_table = [block for _, block in pairs]
        return pairs

    # -- prefix cache --------------------------------------------------------------------------
    @staticmethod
    def chain_hash(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent_hash, tokens))

    def match_prefix(self, seq: Sequence) -> int:
        """Claim the cached blocks that start ``seq``'s tokens; returns the number of tokens they hold.

        Only for a sequence with no blocks yet. The last token is never served
        from the cache: its logits are needed to sample the next token.
        """
        assert not seq.block_table, "match_prefix is for a sequence without blocks"
        if not self.enable_prefix_caching:
            return 0
        tokens, bs = seq.token_ids, self.block_size
        links: list[tuple[int, tuple[int, int] | None]] = []
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = self.chain_hash(links[-1][0] if links else None, chunk)
            block = self.hash_to_block.get(h)
            if block is None or self.cached[block] != CachedBlock(chunk, links[-1][1] if links else None):
                break
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            links.append((h, (block, self.generation[block])))
        self.seq_links[seq.request_id] = links
        return len(links) * bs

    def record_prefix_lookup(self, seq: Sequence, hit_tokens: int) -> None:
        """Count an admitted request's lookup in the hit rate (a failed admission is retried, not counted)."""
        if self.enable_prefix_caching:
            self.prefix_queried_tokens += seq.num_prompt_tokens
            self.prefix_hit_tokens += hit_tokens

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Make ``seq``'s newly completed full blocks findable (their KV is now written).

        A block whose exact prefix is already registered (another request computed
        the same tokens) is not registered twice; its successors link to the
        registered one, so later lookups follow a single chain.
        """
        if not self.enable_prefix_caching:
            return
        links = self.seq_links.setdefault(seq.request_id, [])
        bs = self.block_size
        for i in range(len(links), seq.cached_token_count // bs):
            chunk = tuple(seq.token_slice(i * bs, (i + 1) * bs))
            parent_hash, parent = links[-1] if links else (None, None)
            h = self.chain_hash(parent_hash, chunk)
            expected = CachedBlock(chunk, parent)
            existing = self.hash_to_block.get(h)
            if existing is not None:  # same prefix computed elsewhere, or a hash collision
                same = self.cached[existing] == expected
                links.append((h, (existing, self.generation[existing]) if same else None))
            elif i > 0 and parent is None:  # the chain above is unregistered: nothing can reach this block
                links.append((h, None))
            else:
                block = seq.block_table[i]
                self.generation[block] += 1
                self.block_hash[block] = h
                self.hash_to_block[h] = block
                self.cached[block] = expected
                links.append((h, (block, self.generation[block])))

    def _unregister(self, block: int) -> None:
        h = self.block_hash.pop(block)
        del self.hash_to_block[h]
        del self.cached[block]

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

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
            assert cpu_owners[block] + (block in cpu_free) == 1, \
                f"CPU block {block} has {cpu_owners[block]} owners and is {'' if block in cpu_free else 'not '}free"
        free, evictable = list(self.free_blocks), list(self.evictable)
        free_set, evictable_set = set(free), set(evictable)
        assert len(free_set) == len(free), "a block is twice in the free list"
        assert not free_set & evictable_set, "a block is both free and evictable"
        for block in range(self.num_blocks):
            assert self.ref_counts[block] == owners[block], \
                f"block {block}: ref count {self.ref_counts[block]} but {owners[block]} owners"
            in_free = block in free_set or block in evictable_set
            assert in_free != bool(owners[block]), \
                f"block {block} is {'owned and free' if in_free else 'neither free nor owned (leaked)'}"
        assert all(b in self.block_hash for b in evictable), "an evictable block has no hash"
        assert not any(b in self.block_hash for b in free), "a free block still has a hash"
        assert all(self.hash_to_block[h] == b for b, h in self.block_hash.items())
        assert len(self.hash_to_block) == len(self.block_hash) == len(self.cached)
