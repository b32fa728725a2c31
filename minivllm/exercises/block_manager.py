"""Chapter 04, the block manager: the check of the reader's ``allocate``, ``free`` and ``slot_mapping``
(a ``BlockManager`` subclass), on targeted cases and then inside the live engine.
"""

from __future__ import annotations

from minivllm.block_manager import MiniBlockManager, slots
from minivllm.exercises._common import _as_id_list, own_part, say
from minivllm.exercises.live import chat_prompts, check_live, greedy
from minivllm.models import load_tokenizer
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

__all__ = ["check_block_manager", "check_slot_mapping", "METHODS"]

METHODS = ("allocate", "free", "slot_mapping")  # what exercise 04 writes


_SLOT_CASES = [  # (block_table, start, end, block_size)
    ([7, 2, 9], 0, 10, 4),    # a whole prompt: three blocks, the last one half full
    ([7, 2, 9], 9, 10, 4),    # one decode token in the third block
    ([7, 2, 9], 3, 9, 4),     # a chunk that crosses two block boundaries
    ([3, 0, 5, 1], 4, 8, 4),  # exactly the second block
    ([5, 1, 4], 0, 3, 1),     # block_size 1: the table is the slot mapping
    ([11, 4], 16, 17, 16),    # first token of a fresh block
    ([0, 1, 2], 0, 12, 4),    # identity table: slot = token index
]


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(temperature=0.0))


def _slot_hint(table, start, end, bs, expected, got) -> str:
    tokens = list(range(start, end))
    if len(got) != len(expected):
        return (f"expected {len(expected)} slots, got {len(got)}: one slot per token in [{start}, {end})"
                + (" (not from token 0)" if len(got) == end else ""))
    j = next(j for j, (e, g) in enumerate(zip(expected, got)) if e != g)
    i = tokens[j]
    candidates = {
        "the logical block i // block_size was used as the physical block: look it up in block_table":
            [t // bs * bs + t % bs for t in tokens],
        "a slot is block * block_size + offset: the block id was not multiplied by block_size":
            [table[t // bs] + t % bs for t in tokens],
        "the offset inside the block is i % block_size": [table[t // bs] * bs for t in tokens],
    }
    hint = next((h for h, c in candidates.items() if c == got), "")
    return (f"token {i} (block_table[{i // bs}] = {table[i // bs]}, offset {i % bs}) should be in slot {expected[j]}, "
            f"got {got[j]}" + (f"; {hint}" if hint else "") + f"\n  expected {expected}\n  got      {got}")


def _check_slots(slot_fn) -> None:
    for table, start, end, bs in _SLOT_CASES:
        what = f"slot_mapping(block_table={table}, start={start}, end={end}) with block_size={bs}"
        expected = slots(table, start, end, bs)
        got = _as_id_list(slot_fn(list(table), start, end, bs), what)
        if got != expected:
            raise AssertionError(f"{what}: {_slot_hint(table, start, end, bs, expected, got)}")


def check_slot_mapping(fn) -> None:
    """Check ``fn(block_table, start, end, block_size) -> list[int]``: KV slots of tokens ``[start, end)`` (chapter 04)."""
    _check_slots(fn)
    say(f"check_slot_mapping: all {len(_SLOT_CASES)} cases match the block manager's slot mapping.")


def _expect(ok: bool, what: str, hint: str) -> None:
    if not ok:
        raise AssertionError(f"{what}: {hint}")


def _invariants(bm, seqs, what: str) -> None:
    try:
        bm.check_invariants(seqs)
    except AssertionError as e:
        raise AssertionError(f"{what}: the pool is inconsistent afterwards ({e})") from None


def _check_growth(cls) -> None:
    bm, a = cls(8, 4), _seq("a", 10)
    _expect(bm.allocate(a, 10) is True, "allocate(a, 10) on an empty pool of 8 blocks", "should return True")
    _expect(len(a.block_table) == 3, f"allocate(a, 10) with block_size 4 gave {len(a.block_table)} blocks",
            "10 tokens need ceil(10 / 4) = 3 blocks: a partly filled block is still a block")
    _expect(bm.num_free_blocks == 5, "after allocate(a, 10)", f"5 of 8 blocks should be free, {bm.num_free_blocks} are")
    bm.allocate(a, 12)
    _expect(len(a.block_table) == 3, f"allocate(a, 12) after allocate(a, 10) left {len(a.block_table)} blocks",
            "12 tokens still fit in the 3 blocks a holds: allocate only the blocks the table lacks")
    bm.allocate(a, 13)
    _expect(len(a.block_table) == 4, f"allocate(a, 13) left {len(a.block_table)} blocks",
            "the 13th token needs a 4th block")
    _invariants(bm, [a], "allocate(a, 10), (a, 12), (a, 13)")


def _check_all_or_nothing(cls) -> None:
    bm, a, b = cls(4, 4), _seq("a", 12), _seq("b", 8)
    bm.allocate(a, 12)
    result = bm.allocate(b, 8)
    _expect(result is False, "allocate(b, 8) needs 2 blocks with 1 free", f"should return False, returned {result!r}")
    _expect(b.block_table == [] and bm.num_free_blocks == 1, "allocate(b, 8) with 1 free block of the 2 it needs",
            "all or nothing: when the pool cannot cover the request, take nothing and return False")
    _invariants(bm, [a, b], "a refused allocate")


def _check_sharing(cls) -> None:
    bm, a, b = cls(8, 4), _seq("a", 9), _seq("b", 12)
    bm.allocate(a, 9)
    shared = a.block_table[:2]
    _expect(bm.allocate(b, 12, cached_blocks=shared) is True, "allocate(b, 12, cached_blocks=<a's first 2 blocks>)",
            "should return True")
    _expect(b.block_table[:2] == shared and len(b.block_table) == 3,
            f"allocate(b, 12, cached_blocks={shared}) gave b the table {b.block_table}",
            "claim cached_blocks first (self.claim(block)), in order, then take only the blocks still missing")
    _expect([bm.blocks[x].ref_count for x in shared] == [2, 2], "after b shares a's first two blocks",
            "a shared block's ref_count counts its owners (2 here)")
    _invariants(bm, [a, b], "sharing two blocks")
    bm.free(a)
    _expect(a.block_table == [], "free(a)", "the sequence's block_table must be empty afterwards")
    _expect([bm.blocks[x].ref_count for x in shared] == [1, 1] and bm.num_free_blocks == 5,
            f"free(a) while b shares two of its blocks left {bm.num_free_blocks} free blocks",
            "a shared block loses one reference and stays allocated while b holds it; only a's own block is free")
    _invariants(bm, [b], "free(a) with shared blocks")
    bm.free(b)
    _expect(bm.num_free_blocks == 8, "free(b) after free(a)", "every block should be free again")
    _invariants(bm, [], "freeing everything")


def _check_watermark(cls) -> None:
    bm, a, b = cls(8, 4, watermark=0.5), _seq("a", 16), _seq("b", 4)  # keep 4 of 8 blocks free for admissions
    _expect(bm.allocate(a, 16, watermark=True) is True, "allocate(a, 16, watermark=True) with a watermark of 4 blocks",
            "it leaves exactly 4 of 8 blocks free, which the watermark allows")
    _expect(bm.allocate(b, 4, watermark=True) is False and b.block_table == [],
            "allocate(b, 4, watermark=True) would leave 3 free blocks, under the watermark of 4",
            "with watermark=True refuse an allocation that leaves fewer than self.watermark_blocks free")
    _expect(bm.allocate(b, 4) is True, "allocate(b, 4) without the watermark", "a running sequence may use the headroom")
    _invariants(bm, [a, b], "the watermark cases")


def _cached(bm, seq, num_tokens: int) -> list[int]:
    """Give ``seq`` blocks for ``num_tokens`` tokens and register them in the prefix cache (minivllm's own methods)."""
    MiniBlockManager.allocate(bm, seq, num_tokens)
    seq.cached_token_count = num_tokens
    bm.register_computed_blocks(seq)
    return list(seq.block_table)


def _check_cached_blocks_cost(cls) -> None:
    bm, a, b = cls(4, 4, enable_prefix_caching=True), _seq("a", 12), _seq("b", 12)
    shared = _cached(bm, a, 12)[:2]
    what = f"allocate(b, 12, cached_blocks={shared}) while a holds them, with 1 free block"
    _expect(bm.allocate(b, 12, cached_blocks=shared) is True, what,
            "should return True: a cached block another sequence holds is shared, so claiming it costs no free "
            "block; b needs only 1 new block")
    _invariants(bm, [a, b], "sharing held cached blocks")
    bm, a, b, c = cls(4, 4, enable_prefix_caching=True), _seq("a", 8), _seq("b", 4), _seq("c", 16)
    unowned = _cached(bm, a, 8)
    MiniBlockManager.free(bm, a)  # a's two blocks stay cached, held by nobody (evictable), counted as free
    MiniBlockManager.allocate(bm, b, 4)
    what = (f"allocate(c, 16, cached_blocks={unowned}) where nobody holds those cached blocks, with "
            f"num_free_blocks = 3 (the 2 cached ones included) and 2 new blocks needed")
    hint = ("claiming a cached block nobody holds takes a free block too: it is counted in num_free_blocks until "
            "claimed, so the allocation needs 2 (cached) + 2 (new) of the 3 free blocks")
    free_before = bm.num_free_blocks
    try:
        result = bm.allocate(c, 16, cached_blocks=unowned)
    except (KeyError, IndexError) as e:  # the pool ran dry halfway (evictable.popitem on an empty dict)
        raise AssertionError(f"{what}: allocate ran out of blocks halfway ({type(e).__name__}: {e}); {hint}") from None
    _expect(result is False and c.block_table == [] and bm.num_free_blocks == free_before, what,
            f"should return False and change nothing, returned {result!r}; {hint}")
    _invariants(bm, [b, c], "a refused allocate with cached blocks nobody holds")


def _check_free(cls) -> None:
    bm, a = cls(8, 4, enable_prefix_caching=True), _seq("a", 12)
    bm.allocate(a, 12)
    a.cached_token_count = 12
    bm.register_computed_blocks(a)
    table = list(a.block_table)
    bm.free(a)
    _expect(list(bm.evictable) == table[::-1], f"free(a) of a's 3 cached blocks {table}",
            f"release the last block first: the evictable queue (evicted from its start) is {list(bm.evictable)}, "
            f"it should be {table[::-1]}, so a prompt's first blocks stay cached longest (a later prompt reuses a "
            f"prefix only from block 0)")
    _expect(a.seq_id not in bm.seq_links, "free(a) of a sequence with cached blocks",
            "end free with self.forget(seq): it drops the sequence's prefix-cache links (and its swap space)")
    bm, a = cls(8, 4, num_cpu_blocks=4), _seq("a", 8)
    bm.allocate(a, 8)
    bm.swap_out(a)  # preempted to the swap space (chapter 10), then aborted
    bm.free(a)
    _expect(len(bm.free_cpu_blocks) == 4 and a.cpu_block_table == [],
            "free(a) of a sequence swapped out to the CPU (chapter 10)",
            f"its {4 - len(bm.free_cpu_blocks)} CPU blocks are still taken: end free with self.forget(seq), which "
            f"gives back the swap space and the prefix-cache links")
    _invariants(bm, [a], "freeing a swapped-out sequence")


def _check_restored(cls) -> None:
    """Chapter 14's CPU tier: the scheduler passes restored (tier hashes) as allocate's fifth argument."""
    bm, a, b = cls(4, 4, enable_prefix_caching=True, num_offload_blocks=4), _seq("a", 9), _seq("b", 16)
    _cached(bm, a, 9)
    MiniBlockManager.free(bm, a)
    MiniBlockManager.allocate(bm, b, 16)  # evicts a's two cached blocks: their KV goes to the tier
    MiniBlockManager.free(bm, b)
    bm.take_tier_copies()
    again = _seq("a2", 9)
    restored = bm.lookup_offloaded(again, 0)
    what = (f"allocate(a2, 9, [], False, restored) with restored = the {len(restored)} tier entries of a2's first "
            f"blocks (chapter 14's CPU tier)")
    try:
        result = bm.allocate(again, 9, [], False, restored)
    except TypeError as e:
        raise AssertionError(f"{what}: {e}: the scheduler passes restored as the fifth argument when the KV offload "
                             f"tier is on: give allocate the parameter restored=()") from None
    _, restores = bm.take_tier_copies()
    _expect(result is True and len(again.block_table) == 3 and [b for _, b in restores] == again.block_table[:2], what,
            f"the restored blocks are the first new blocks: take them with self.take_restored_blocks(restored) "
            f"(it queues their KV's copy back), then the rest with self.take_free_block(); got the table "
            f"{again.block_table} and restore copies into {[b for _, b in restores]}")
    _invariants(bm, [again], "restoring from the tier")


def check_block_manager(cls, live: bool = True) -> None:
    """Check a ``BlockManager`` subclass's ``allocate``, ``free`` and ``slot_mapping`` (chapter 04).

    First that the three are yours (an empty subclass is "not written yet"),
    then targeted cases (ceil division, growing a table, all or nothing,
    shared blocks and ref counts, what cached blocks cost, the watermark, the
    order free releases and its ``forget``, chapter 14's restored blocks, the
    slot of every token), stopping at the first failure; then, unless
    ``live=False``, the live engine on SmolLM2 with the class as its block
    manager.
    """
    cls = own_part(cls, METHODS, MiniBlockManager)
    _check_growth(cls)
    _check_all_or_nothing(cls)
    _check_sharing(cls)
    _check_cached_blocks_cost(cls)
    _check_watermark(cls)
    _check_free(cls)
    _check_restored(cls)
    _check_slots(lambda table, start, end, bs: cls(max(table) + 1, bs).slot_mapping(_with_table(table, end), start, end))
    say("check_block_manager: growth, all or nothing, sharing, cached blocks, the watermark, free, restored blocks "
          "and the slot mapping are right.")
    if not live:
        return
    tok = load_tokenizer("smollm2-135m")
    requests = [(f"r{i}", p, greedy(8)) for i, p in enumerate(chat_prompts(tok, 3))]
    check_live("your block manager", requests, block_size=4, num_blocks=160, max_num_seqs=4,
               parts={"block_manager_cls": cls}, tokenizer=tok)


def _with_table(table: list[int], num_tokens: int) -> Sequence:
    seq = Sequence("t", [1] * num_tokens, SamplingParams())
    seq.block_table = list(table)
    return seq
