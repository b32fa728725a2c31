"""Chapter 08, prefix caching: the check of the reader's prefix cache, a ``BlockManager`` subclass with
``lookup_prefix``, ``register_computed_blocks``, ``take_free_block`` and ``release``, on targeted cases and then
inside the live engine, schedule for schedule.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

from minivllm.block_manager import BlockManager, MiniBlockManager
from minivllm.exercises._common import own_part, say
from minivllm.exercises.live import check_live, greedy
from minivllm.models import load_tokenizer
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

__all__ = ["check_prefix_cache", "system_prompt_chats", "METHODS"]

METHODS = ("lookup_prefix", "register_computed_blocks", "take_free_block", "release")  # what exercise 08 writes

BS = 4  # blocks of 4 tokens in every targeted case
X, Y, Z, W, V, Q = ([10 * k + i for i in range(1, 5)] for k in range(1, 7))  # six different full blocks
SYSTEM = ("You are Atlas, the support assistant of an online shop for hiking and camping gear. Answer politely, "
          "in plain English and in at most three sentences. Never invent product details.")
QUESTIONS = ["Where is my order?", "Can I return a tent I used once?", "How long does delivery to Spain take?",
             "Do you sell gas stoves?", "What warranty does a sleeping bag have?", "Are you open on Sunday?"]


def _seq(rid: str, tokens) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(temperature=0.0, max_tokens=1))


def _fail(what: str, hint: str, detail: str = "") -> None:
    raise AssertionError(f"{what}: {hint}" + (f"\n  {detail}" if detail else ""))


def _invariants(bm, seqs, what: str) -> None:
    try:
        bm.check_invariants(seqs)
    except AssertionError as e:
        _fail(what, f"the pool is inconsistent afterwards ({e})",
              "a registered block is in self.hash_to_block under its own hash, free blocks have no hash, "
              "evictable ones have one")


def _computed(bm, seq: Sequence, cached: int | None = None) -> list[int]:
    """What the scheduler and the model runner do for ``seq``: look up, allocate, write the KV, register."""
    hits = bm.lookup_prefix(seq)
    if not bm.allocate(seq, seq.num_tokens, hits):
        raise AssertionError(f"allocating {seq.request_id} failed: the case expects room in the pool")
    seq.cached_token_count = seq.num_tokens if cached is None else cached
    bm.register_computed_blocks(seq)
    return hits


def _expect_lookup(bm, tokens, expected: list[int], what: str, hints) -> None:
    """``lookup_prefix`` of a prompt must be ``expected``; ``hints(got)`` names the mistake."""
    seq = _seq("lookup", tokens)
    refs = [b.ref_count for b in bm.blocks]
    got = list(bm.lookup_prefix(seq))
    if [b.ref_count for b in bm.blocks] != refs or seq.block_table:
        _fail(what, "lookup_prefix only looks: it claims nothing and gives the sequence no block "
                    "(allocate claims the hits, all or nothing)")
    if got != expected:
        _fail(what, hints(got), f"expected the blocks {expected}, got {got}")


@contextmanager
def _chain_hash(fn):
    """Replace ``chain_hash`` (on BlockManager, which subclasses inherit): a hash that collides on purpose."""
    with mock.patch.object(BlockManager, "chain_hash", staticmethod(fn)):
        yield


def _registers_the_chain(cls) -> None:
    bm = cls(16, BS, enable_prefix_caching=True)
    a = _seq("a", X + Y + Z + [9])
    bm.allocate(a, a.num_tokens)
    a.cached_token_count = 13
    bm.register_computed_blocks(a)
    what = "register_computed_blocks(a) for a 13-token prompt X+Y+Z+[9] whose KV is computed, blocks of 4"
    records = [bm.blocks[b] for b in a.block_table]
    if records[3].hash is not None:
        _fail(what, "only full blocks are registered: the last block (1 token) is still being filled")
    h = BlockManager.chain_hash
    chain = [h(None, tuple(X))]
    chain += [h(chain[0], tuple(Y))]
    chain += [h(chain[1], tuple(Z))]
    got = [r.hash for r in records[:3]]
    if got == [h(None, tuple(b)) for b in (X, Y, Z)]:
        _fail(what, "the hash ignores the parent: chain it, self.chain_hash(parent_hash, tokens) with the previous "
                    "block's hash, so that it names the whole prefix", f"hashes {got}")
    if got != chain:
        _fail(what, "block i is registered under self.chain_hash(hash of block i - 1 (None for block 0), "
                    "tuple(its token ids))", f"expected the hashes {chain}\n  got {got}")
    for i, (r, tokens) in enumerate(zip(records, (X, Y, Z))):
        parent = None if i == 0 else (a.block_table[i - 1], bm.blocks[a.block_table[i - 1]].generation)
        if r.tokens != tuple(tokens) or r.parent != parent or bm.hash_to_block.get(r.hash) != r.block_id:
            _fail(what, "a registered block records its tokens (a tuple) and its parent (block id, generation), and "
                        "self.hash_to_block maps its hash to it: lookups confirm hits with them (Block.matches)",
                  f"block {i}: tokens {r.tokens}, parent {r.parent}, hash_to_block -> "
                  f"{bm.hash_to_block.get(r.hash)}; expected {tuple(tokens)}, {parent}, {r.block_id}")
    _invariants(bm, [a], what)


def _registers_what_is_computed(cls) -> None:
    bm = cls(16, BS, enable_prefix_caching=True)
    a = _seq("a", X + Y + Z + [9])
    bm.allocate(a, a.num_tokens)
    for cached, full in ((5, 1), (9, 2), (13, 3)):  # a chunked prefill: register after each chunk
        a.cached_token_count = cached
        bm.register_computed_blocks(a)
        registered = sum(bm.blocks[b].hash is not None for b in a.block_table)
        if registered != full:
            _fail(f"register_computed_blocks(a) after {cached} of a's 13 tokens are computed (blocks of 4)",
                  f"register the full blocks whose KV is written, seq.cached_token_count // block_size = {full}, "
                  f"not the blocks of tokens still to compute: a hit on them would serve KV never written",
                  f"{registered} of a's blocks are registered")
    _invariants(bm, [a], "registering chunk by chunk")
    off = cls(16, BS)
    b = _seq("b", X + Y + [9])
    off.allocate(b, b.num_tokens)
    b.cached_token_count = 9
    off.register_computed_blocks(b)
    if off.hash_to_block or off.lookup_prefix(_seq("c", X + Y + [9])):
        _fail("a block manager with enable_prefix_caching=False", "registers nothing and finds nothing: "
              "return at once when self.enable_prefix_caching is False")


def _hits(cls) -> None:
    bm = cls(16, BS, enable_prefix_caching=True)
    a = _seq("a", X + Y + Z + [9])
    _computed(bm, a)
    a0, a1, a2 = a.block_table[:3]

    _expect_lookup(bm, X + Y + W + [5], [a0, a1], "lookup_prefix(X+Y+W+[5]) after a = X+Y+Z+[9] was computed",
                   lambda got: "a prompt that shares a's first two blocks hits them, and stops at W" if len(got) < 2
                   else "stop at the first block that misses (W)")
    _expect_lookup(bm, X + Y + Z + [9], [a0, a1, a2], "lookup_prefix(a's own 13 tokens) after a was computed",
                   lambda got: "its 3 full blocks are all before the last token: all three hit; the block holding "
                               "the last token is excluded, not one block more" if len(got) < 3 else
                   "only full blocks are cached")
    _expect_lookup(bm, X + Y + Z, [a0, a1], "lookup_prefix(X+Y+Z), exactly a's 3 full blocks (12 tokens)",
                   lambda got: "the block holding the last prompt token is never served from the cache: the first "
                               "output token needs its logits, so that block runs again; only the "
                               "(len(tokens) - 1) // block_size = 2 full blocks before it may hit"
                   if len(got) == 3 else "the first two blocks hit")
    _expect_lookup(bm, W + Y + Z + [9], [], "lookup_prefix(W+Y+Z+[9]): a's last two blocks after another first block",
                   lambda got: "a block's KV depends on every token before it: after a miss (W) nothing can hit")
    _expect_lookup(bm, [7], [], "lookup_prefix([7]), a one-token prompt", lambda got: "nothing to look up")
    _invariants(bm, [a], "the lookups")


def _lru(cls) -> None:
    bm = cls(4, BS, enable_prefix_caching=True)
    a = _seq("a", X + Y + [9])
    _computed(bm, a)
    a0, a1, a2 = a.block_table
    (spare,) = [b for b in range(4) if b not in a.block_table]
    bm.free(a)  # tail first: a2 (no hash) is free, a1 then a0 become evictable
    what = "free(a) after a = X+Y+[9] was computed (its 2 full blocks cached, the third partial)"
    if a0 in bm.free_blocks or a1 in bm.free_blocks or bm.blocks[a0].hash is None:
        _fail(what, "a released block with a hash keeps its KV and its hash: it becomes evictable "
                    "(self.evictable[block] = None), not free; putting it in the free list loses its KV for good")
    if list(bm.evictable) != [a1, a0] or a2 not in bm.free_blocks:
        _fail(what, "release(block): one owner fewer; at zero, a block with a hash goes to the end of self.evictable "
                    "(most recently used last), any other to self.free_blocks",
              f"evictable {list(bm.evictable)}, free {list(bm.free_blocks)}; expected evictable [{a1}, {a0}] "
              f"(the tail was released first) and {a2} free")
    _invariants(bm, [], what)
    _expect_lookup(bm, X + Y + [9], [a0, a1], "lookup_prefix(a's prompt) after a finished",
                   lambda got: "a finished request's cached blocks stay findable until they are evicted")
    taken = [bm.take_free_block(), bm.take_free_block()]
    what = "take_free_block() twice with 2 unhashed free blocks and 2 cached ones evictable"
    if set(taken) != {spare, a2}:
        _fail(what, "take an unhashed free block first (self.free_blocks); evict a cached block only when there is "
                    "none left", f"took {taken}; the free blocks were {spare} and {a2}")
    if any(bm.blocks[b].ref_count != 1 for b in taken):
        _fail(what, "a block taken for new KV has exactly one owner: ref_count = 1")
    evicted = bm.take_free_block()
    what = f"take_free_block() with no free block left, evictable (least recently used first) [{a1}, {a0}]"
    if evicted == a0:
        _fail(what, "evict the least recently used cached block, the first of self.evictable "
                    "(self.evictable.popitem(last=False)), not the most recently used")
    if evicted != a1:
        _fail(what, f"evict the least recently used cached block ({a1})", f"took {evicted}")
    if bm.blocks[a1].hash is not None or bm.blocks[a1].ref_count != 1:
        _fail(what, "an evicted block leaves the prefix cache (self._unregister(block)) and gets one owner: its KV "
                    "is about to be overwritten, so no lookup may find it")
    _invariants(bm, [_holding(taken + [evicted])], what)
    _expect_lookup(bm, X + Y + [9], [a0], "lookup_prefix(a's prompt) after a's second block was evicted",
                   lambda got: "the first block is still cached, the second is gone")


def _holding(blocks: list[int]) -> Sequence:
    """A sequence that owns ``blocks`` (taken by hand in a case), for the invariants."""
    seq = _seq("holder", [1])
    seq.block_table = list(blocks)
    return seq


def _recency(cls) -> None:
    bm = cls(3, BS, enable_prefix_caching=True)
    blocks = []
    for rid, tokens in (("x", X + [9]), ("y", Y + [8]), ("x again", X + [5])):  # one after another
        seq = _seq(rid, tokens)
        _computed(bm, seq)
        blocks.append(seq.block_table[0])
        bm.free(seq)
    x, y, _ = blocks
    what = (f"take_free_block() with no unhashed block left, after X's block {x} and Y's block {y} were released "
            f"and X was hit and released again")
    holder = _holding([bm.take_free_block() for _ in range(len(bm.free_blocks))])
    evicted = bm.take_free_block()
    if evicted != y:
        _fail(what, "a release makes a block the most recently used (the end of self.evictable); evict from the "
                    "front, the least recently used", f"evicted {evicted}, expected {y}")
    holder.block_table.append(evicted)
    _invariants(bm, [holder], what)


def _stops_at_the_first_miss(cls) -> None:
    bm = cls(4, BS, enable_prefix_caching=True)
    a = _seq("a", X + Y + Z + [9])
    _computed(bm, a)
    a0, a1, a2, _ = a.block_table
    bm.free(a)
    bm.evictable.move_to_end(a2)  # as if a2 had been used more recently: a1 is now the least recently used
    holder = _holding([bm.take_free_block(), bm.take_free_block()])  # the free block, then a1 is evicted
    _invariants(bm, [holder], "evicting a's second block")
    _expect_lookup(bm, X + Y + Z + [9], [a0], "lookup_prefix(a's prompt) after its middle block was evicted",
                   lambda got: "stop at the first block that misses: the block after it was computed after a "
                               "prefix this lookup cannot serve" if len(got) > 1 else "block 0 is still cached")


def _collisions(cls) -> None:
    with _chain_hash(lambda parent_hash, tokens: 0):  # every block of every prompt has the hash 0
        bm = cls(16, BS, enable_prefix_caching=True)
        p = _seq("p", X + Y + [9])
        _computed(bm, p)
        x = p.block_table[0]
        what = "with chain_hash patched to return 0 (every hash collides), after p = X+Y+[9] was computed"
        if bm.hash_to_block != {0: x}:
            _fail(what, "a hash already in the cache (another prefix, or a collision) is not registered again: only "
                        "X's block may be under hash 0", f"hash_to_block is {bm.hash_to_block}")
        _invariants(bm, [p], what)
        _expect_lookup(bm, V + Y + [1], [], f"{what}, lookup_prefix(V+Y+[1])",
                       lambda got: "a hit trusted on its hash alone serves another prefix's KV: confirm it with "
                                   "self.blocks[block].matches(tokens, parent) (same tokens, same parent)")
        _expect_lookup(bm, X + X + [1], [x], f"{what}, lookup_prefix(X+X+[1])",
                       lambda got: "a hit confirmed by its tokens but not by its parent: X's block holds the KV of X "
                                   "at positions 0-3, not after X; compare the parent (block id, generation) too, "
                                   "Block.matches(tokens, parent)" if got == [x, x] else "X's block hits once")
        s = _seq("s", X + X + [2])
        _computed(bm, s)
        _invariants(bm, [p, s], f"{what}, computing s = X+X+[2]")


def _generation(cls) -> None:
    with _chain_hash(lambda parent_hash, tokens: hash(tokens)):  # a hash that forgets the parent: blocks collide
        bm = cls(3, BS, enable_prefix_caching=True)
        first = _seq("first", X + Y + [9])
        _computed(bm, first)
        b0, b1, _ = first.block_table
        bm.free(first)
        bm.evictable.move_to_end(b1)  # as if b1 had been used more recently: b0 goes first
        holder = _holding([bm.take_free_block()])  # the one unhashed block
        w = _seq("w", W)  # evicts b0 and registers W's KV in it
        _computed(bm, w)
        if w.block_table != [b0] or bm.blocks[b0].tokens != tuple(W):
            _fail("evicting block 0 of X+Y+[9] for a new prompt W", "take_free_block should evict the least "
                  "recently used block and register_computed_blocks register W in it",
                  f"W's table {w.block_table}, block {b0} holds {bm.blocks[b0].tokens}")
        _invariants(bm, [holder, w], "re-registering an evicted block")
        stale = bm.blocks[b1].parent

        def hint(got):
            if got == [b0, b1] and stale == (b0, bm.blocks[b0].generation):
                return ("the block was registered again with the same generation: bump record.generation at each "
                        "registration, so that links to its old contents go stale")
            return ("Y's block was computed after X, whose block now holds W: confirm the parent with its "
                    "generation, (block id, generation), as Block.matches does")
        _expect_lookup(bm, W + Y + [1], [b0], f"with a chain_hash that ignores the parent, lookup_prefix(W+Y+[1]) "
                       f"after X's block {b0} was evicted and now holds W, Y's block {b1} still cached", hint)


def _orphans(cls) -> None:
    with _chain_hash(lambda parent_hash, tokens: hash(tokens)):  # a hash that forgets the parent: blocks collide
        bm = cls(16, BS, enable_prefix_caching=True)
        a, s = _seq("a", X + [1]), _seq("s", V + X + Y + [2])
        _computed(bm, a)
        _computed(bm, s)  # X after V collides with a's X (a first block): s's X is not registered, so neither is Y
        what = ("with a chain_hash that ignores the parent, after a = X+[1] and then s = V+X+Y+[2] were computed, "
                "lookup_prefix(Y+[3])")
        _invariants(bm, [a, s], what)
        _expect_lookup(bm, Y + [3], [], what,
                       lambda got: "s's Y followed a block that is not in the cache (its X collided with a's): a block "
                                   "whose parent is not registered is not registered either; nothing reaches it by "
                                   "its chain, and with no parent it would pass for a prompt's first block")


def _duplicates(cls) -> None:
    bm = cls(16, BS, enable_prefix_caching=True)
    s1, s2 = _seq("s1", X + Y + Z + [1]), _seq("s2", X + Y + Q + [2])
    for s in (s1, s2):  # admitted in the same step: neither found the other's blocks
        bm.allocate(s, s.num_tokens)
    for s in (s1, s2):
        s.cached_token_count = s.num_tokens
        bm.register_computed_blocks(s)
    what = "s1 = X+Y+Z+[1] and s2 = X+Y+Q+[2] computed in the same step, then both registered"
    _invariants(bm, [s1, s2], what)
    if bm.blocks[s2.block_table[0]].hash is not None or bm.blocks[s2.block_table[1]].hash is not None:
        _fail(what, "s2's copies of X and Y duplicate a prefix already registered (s1's): leave them unregistered")
    _expect_lookup(bm, X + Y + Q + [7], s1.block_table[:2] + s2.block_table[2:3], f"{what}; lookup_prefix(X+Y+Q+[7])",
                   lambda got: "a duplicate links to the registered block (keep it in self.seq_links): the block "
                               "after it, Q, is registered with the registered Y as its parent, so lookups that "
                               "follow the chain reach it")


_CASES = (_registers_the_chain, _registers_what_is_computed, _hits, _lru, _recency, _stops_at_the_first_miss,
          _collisions, _generation, _orphans, _duplicates)


def system_prompt_chats(tokenizer, questions=QUESTIONS) -> list[list[int]]:
    """Chat prompts that share a system prompt (chapter 08): the same first blocks, then each its own question."""
    return [tokenizer(tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                     {"role": "user", "content": q}],
                                                    add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)["input_ids"] for q in questions]


def check_prefix_cache(cls, live: bool = True) -> None:
    """Check a ``BlockManager`` subclass's prefix cache (chapter 08): ``lookup_prefix``, ``register_computed_blocks``,
    ``take_free_block`` and ``release``.

    Targeted cases first (the registered chain, what is registered when,
    hits and the last-token rule, release and LRU eviction, the first miss,
    a hash that always collides, a parent evicted and registered again, a
    duplicate prefix), stopping at the first failure; then, unless
    ``live=False``, the live engine on SmolLM2: chats with a shared system
    prompt, a pool small enough to evict, every step scheduled as minivllm
    schedules it. An empty subclass is "not written yet".
    """
    cls = own_part(cls, METHODS, MiniBlockManager)
    for case in _CASES:
        case(cls)
    say("check_prefix_cache: the chain, registration, hits, the last-token rule, LRU eviction, collisions, "
          "generations and duplicates are right.")
    if not live:
        return
    tok = load_tokenizer("smollm2-135m")
    chats = system_prompt_chats(tok)
    chats += chats[:2]  # asked again later: hit if their blocks survived eviction
    requests = [(f"chat{i}", p, greedy(3)) for i, p in enumerate(chats)]
    check_live("your prefix cache", requests, parts={"block_manager_cls": cls}, tokenizer=tok, same_schedule=True,
               enable_prefix_caching=True, block_size=8, num_blocks=16, max_num_seqs=2)
