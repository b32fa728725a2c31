"""Chapter 08: a reader's prefix cache (lookup_prefix, register_computed_blocks, take_free_block, release)."""

from minivllm.block_manager import BlockManager
from minivllm.exercises import check_prefix_cache

from exercise_cases import Check


class MyBlockManager(BlockManager):
    """The solution notebook's answer."""

    def lookup_prefix(self, seq):
        if not self.enable_prefix_caching:
            return []
        tokens, bs = seq.token_ids, self.block_size
        found, parent_hash, parent = [], None, None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            parent_hash = self.chain_hash(parent_hash, chunk)
            block = self.hash_to_block.get(parent_hash)
            if block is None or not self.blocks[block].matches(chunk, parent):
                break
            found.append(block)
            parent = (block, self.blocks[block].generation)
        return found

    def register_computed_blocks(self, seq):
        if not self.enable_prefix_caching:
            return
        links = self.seq_links.setdefault(seq.seq_id, [])
        bs = self.block_size
        for i in range(len(links), seq.cached_token_count // bs):
            chunk = tuple(seq.token_slice(i * bs, (i + 1) * bs))
            parent_hash, parent = links[-1] if links else (None, None)
            h = self.chain_hash(parent_hash, chunk)
            existing = self.hash_to_block.get(h)
            if existing is not None:
                same = self.blocks[existing].matches(chunk, parent)
                links.append((h, (existing, self.blocks[existing].generation) if same else None))
            elif i > 0 and parent is None:
                links.append((h, None))
            else:
                record = self.blocks[seq.block_table[i]]
                record.generation += 1
                record.hash, record.tokens, record.parent = h, chunk, parent
                self.hash_to_block[h] = record.block_id
                links.append((h, (record.block_id, record.generation)))

    def take_free_block(self):
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            self._unregister(block)
        self.blocks[block].ref_count = 1
        return block

    def release(self, block):
        record = self.blocks[block]
        record.ref_count -= 1
        if record.ref_count == 0:
            if record.hash is not None:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)


def _lookup(hash_parent=True, confirm="both", last_token=False, stop=True):
    """A lookup_prefix with one rule changed; confirm: "both", "tokens", "id" (parent id, no generation) or "none"."""
    def lookup_prefix(self, seq):
        if not self.enable_prefix_caching:
            return []
        tokens, bs = seq.token_ids, self.block_size
        found, parent_hash, parent = [], None, None
        for i in range((len(tokens) if last_token else len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            parent_hash = self.chain_hash(parent_hash if hash_parent else None, chunk)
            block = self.hash_to_block.get(parent_hash)
            record = None if block is None else self.blocks[block]
            ok = record is not None and {
                "both": lambda: record.matches(chunk, parent),
                "tokens": lambda: record.tokens == chunk,
                "id": lambda: record.tokens == chunk and (record.parent or (None,))[0] == (parent or (None,))[0],
                "none": lambda: True}[confirm]()
            if not ok:
                if stop:
                    break
                continue
            found.append(block)
            parent = (block, record.generation)
        return found
    return lookup_prefix


def _register(hash_parent=True, computed=True, bump=True, duplicates="link", orphans=False):
    """A register_computed_blocks with one rule changed; duplicates: "link", "overwrite" or "break" (link None)."""
    def register_computed_blocks(self, seq):
        if not self.enable_prefix_caching:
            return
        links = self.seq_links.setdefault(seq.seq_id, [])
        bs = self.block_size
        for i in range(len(links), (seq.cached_token_count if computed else seq.num_tokens) // bs):
            chunk = tuple(seq.token_slice(i * bs, (i + 1) * bs))
            parent_hash, parent = links[-1] if links else (None, None)
            h = self.chain_hash(parent_hash if hash_parent else None, chunk)
            existing = self.hash_to_block.get(h)
            if existing is not None and duplicates != "overwrite":
                same = self.blocks[existing].matches(chunk, parent) and duplicates == "link"
                links.append((h, (existing, self.blocks[existing].generation) if same else None))
            elif i > 0 and parent is None and not orphans:
                links.append((h, None))
            else:
                record = self.blocks[seq.block_table[i]]
                record.generation += bump
                record.hash, record.tokens, record.parent = h, chunk, parent
                self.hash_to_block[h] = record.block_id
                links.append((h, (record.block_id, record.generation)))
    return register_computed_blocks


def _wrong(**methods):
    return type("WrongBlockManager", (MyBlockManager,), methods)


def take_evicting_first(self):
    if self.evictable:
        block, _ = self.evictable.popitem(last=False)
        self._unregister(block)
    else:
        block = self.free_blocks.popleft()
    self.blocks[block].ref_count = 1
    return block


def take_most_recent(self):
    if self.free_blocks:
        block = self.free_blocks.popleft()
    else:
        block, _ = self.evictable.popitem()  # last=True: the most recently used
        self._unregister(block)
    self.blocks[block].ref_count = 1
    return block


def take_without_unregistering(self):
    block = self.free_blocks.popleft() if self.free_blocks else self.evictable.popitem(last=False)[0]
    self.blocks[block].ref_count = 1
    return block


def release_to_free_list(self, block):
    record = self.blocks[block]
    record.ref_count -= 1
    if record.ref_count == 0:
        if record.hash is not None:
            self._unregister(block)  # the KV is forgotten
        self.free_blocks.append(block)


def release_to_front(self, block):
    MyBlockManager.release(self, block)
    if block in self.evictable:
        self.evictable.move_to_end(block, last=False)


def lookup_and_claim(self, seq):
    hits = MyBlockManager.lookup_prefix(self, seq)
    for block in hits:
        self.claim(block)
    return hits


CHECKS = [Check("08", check_prefix_cache, [MyBlockManager], {
    "the hash ignores the parent": (_wrong(lookup_prefix=_lookup(hash_parent=False),
                                           register_computed_blocks=_register(hash_parent=False)),
                                    "ignores the parent"),
    "a hit trusted on its hash": (_wrong(lookup_prefix=_lookup(confirm="none")), "hash alone"),
    "a hit confirmed by tokens only": (_wrong(lookup_prefix=_lookup(confirm="tokens")), "not by its parent"),
    "the parent's generation ignored": (_wrong(lookup_prefix=_lookup(confirm="id")), "with its generation"),
    "no generation bump": (_wrong(register_computed_blocks=_register(bump=False)), "bump record.generation"),
    "serves the last prompt token": (_wrong(lookup_prefix=_lookup(last_token=True)), "last prompt token"),
    "no stop at a miss": (_wrong(lookup_prefix=_lookup(confirm="tokens", stop=False)), "stop at the first block"),
    "lookup claims the hits": (_wrong(lookup_prefix=lookup_and_claim), "only looks"),
    "registers uncomputed blocks": (_wrong(register_computed_blocks=_register(computed=False)), "never written"),
    "a duplicate overwrites the registered block": (_wrong(register_computed_blocks=_register(duplicates="overwrite")),
                                                    "not registered again"),
    "a duplicate breaks the chain": (_wrong(register_computed_blocks=_register(duplicates="break")),
                                     "a duplicate links to the registered block"),
    "an orphan registered as a first block": (_wrong(register_computed_blocks=_register(orphans=True)),
                                              "whose parent is not registered"),
    "evicts before using a free block": (_wrong(take_free_block=take_evicting_first), "unhashed free block first"),
    "evicts the most recently used": (_wrong(take_free_block=take_most_recent), "not the most recently used"),
    "eviction keeps the hash": (_wrong(take_free_block=take_without_unregistering), "leaves the prefix cache"),
    "a freed cached block goes to the free list": (_wrong(release=release_to_free_list), "loses its KV"),
    "a release is the least recent": (_wrong(release=release_to_front), "most recently used"),
}, passes="the live engine")]
