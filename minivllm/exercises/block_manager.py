"""Chapter 04, the block manager: the check of the reader's slot mapping (where each token's KV lives
in the paged pool), against the one :class:`minivllm.attention.PagedBatch` builds.
"""

from __future__ import annotations

from minivllm.attention import PagedBatch
from minivllm.exercises._common import _as_id_list

__all__ = ["check_slot_mapping"]


_SLOT_CASES = [  # (block_table, start, end, block_size)
    ([7, 2, 9], 0, 10, 4),    # a whole prompt: three blocks, the last one half full
    ([7, 2, 9], 9, 10, 4),    # one decode token in the third block
    ([7, 2, 9], 3, 9, 4),     # a chunk that crosses two block boundaries
    ([3, 0, 5, 1], 4, 8, 4),  # exactly the second block
    ([5, 1, 4], 0, 3, 1),     # block_size 1: the table is the slot mapping
    ([11, 4], 16, 17, 16),    # first token of a fresh block
    ([0, 1, 2], 0, 12, 4),    # identity table: slot = token index
]


def check_slot_mapping(fn) -> None:
    """Check ``fn(block_table, start, end, block_size) -> list[int]``: KV slots of tokens ``[start, end)`` (chapter 04).

    Token ``i`` lives in physical block ``block_table[i // block_size]`` at
    offset ``i % block_size``: slot ``block * block_size + offset``. Compared
    with the slot mapping :class:`minivllm.attention.PagedBatch` builds.
    """
    for table, start, end, bs in _SLOT_CASES:
        what = f"slot_mapping({table}, start={start}, end={end}, block_size={bs})"
        expected = PagedBatch([table], [end], [end - start], bs, "cpu").slot_mapping.tolist()
        got = _as_id_list(fn(list(table), start, end, bs), what)
        if got == expected:
            continue
        tokens = list(range(start, end))
        if len(got) != len(expected):
            hint = (f"; one slot per token in [{start}, {end})" + (" (not from token 0)" if len(got) == end else ""))
            raise AssertionError(f"{what}: expected {len(expected)} slot{'s' * (len(expected) != 1)}, "
                                 f"got {len(got)}: {got}{hint}")
        j = next(j for j, (e, g) in enumerate(zip(expected, got)) if e != g)
        i = tokens[j]
        candidates = {
            "the logical block i // block_size was used as the physical block: look it up in block_table":
                [t // bs * bs + t % bs for t in tokens],
            "a slot is block * block_size + offset: the block id was not multiplied by block_size":
                [table[t // bs] + t % bs for t in tokens],
            "the offset inside the block is i % block_size":
                [table[t // bs] * bs for t in tokens],
        }
        hint = next((h for h, c in candidates.items() if c == got and c != expected), "")
        raise AssertionError(
            f"{what}: token {i} (block_table[{i // bs}] = {table[i // bs]}, offset {i % bs}) should be in slot "
            f"{expected[j]}, got {got[j]}" + (f"; {hint}" if hint else "") +
            f"\n  expected {expected}\n  got      {got}")
    print(f"check_slot_mapping: all {len(_SLOT_CASES)} cases match PagedBatch's slot mapping.")
