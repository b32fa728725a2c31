"""Chapter 08, prefix caching: the checks of the reader's chain hashes of a prompt's full blocks and
of the prompt tokens a prefix cache serves, against minivllm's block manager.
"""

from __future__ import annotations

import random

from minivllm.block_manager import BlockManager
from minivllm.config import cdiv
from minivllm.exercises._common import _is_integer
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

__all__ = ["check_block_hashes", "reference_block_hashes", "check_cached_prefix_len", "reference_cached_prefix_len"]


def reference_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chain hashes minivllm's :class:`~minivllm.block_manager.BlockManager` registers for a computed prompt.

    A real block manager allocates the prompt, marks its KV as written and
    registers its full blocks; the hashes are read back in block order.
    """
    tokens = list(token_ids)
    full = len(tokens) // block_size
    if not tokens:
        return []
    bm = BlockManager(cdiv(len(tokens), block_size), block_size, enable_prefix_caching=True)
    seq = Sequence("reference", tokens, SamplingParams(temperature=0.0, max_tokens=1))
    bm.allocate(seq, len(tokens))
    seq.cached_token_count = len(tokens)  # as if the model had written the prompt's KV
    bm.register_computed_blocks(seq)
    return [bm.blocks[block].hash for block in seq.block_table[:full]]


def reference_cached_prefix_len(token_ids: list[int], block_size: int, cached: set[int]) -> int:
    """Prompt tokens served from a prefix cache holding the chain hashes ``cached`` (chapter 08).

    Walk the full blocks in order and stop at the first whose hash is not
    cached; never count the block holding the last prompt token, whose logits
    the first output token needs. (The engine also confirms each hit by the
    block's tokens and parent; with no hash collisions that changes nothing.)
    """
    hashes = reference_block_hashes(token_ids, block_size)[: (len(token_ids) - 1) // block_size]
    hits = 0
    for h in hashes:
        if h not in cached:
            break
        hits += 1
    return hits * block_size


def _call(fn, what, *args):
    try:
        return fn(*args)
    except TypeError as e:
        if "unhashable" in str(e):
            raise AssertionError(f"{what}: {e}: pass a block's tokens as a tuple, "
                                 f"BlockManager.chain_hash(parent_hash, tuple(block_tokens))") from None
        raise


def _random_ids(rng, n: int) -> list[int]:
    return [rng.randrange(1, 49152) for _ in range(n)]


def _block_hash_cases():
    rng = random.Random(8)
    shared = _random_ids(rng, 8)
    cases = [(list(range(100, 110)), 4), (list(range(100, 112)), 4), ([], 4), ([5, 6, 7], 4), ([9] * 12, 4),
             ([3, 1, 4, 1, 5], 1), (shared + [1, 2, 3], 4), (shared + [7, 7, 7, 7, 8], 4), (_random_ids(rng, 40), 16)]
    cases += [(_random_ids(rng, rng.randint(0, 30)), rng.choice([2, 3, 4, 8])) for _ in range(20)]
    return cases


def _hash_hint(tokens, bs, expected, got) -> str:
    h = BlockManager.chain_hash
    blocks = [tuple(tokens[i * bs:(i + 1) * bs]) for i in range(cdiv(len(tokens), bs))]
    if len(got) == len(blocks) and len(blocks) > len(expected):
        return "only full blocks get a hash: the last, partial block is still being filled"
    if len(got) != len(expected):
        return f"one hash per full block: {len(tokens)} tokens in blocks of {bs} make {len(expected)} full blocks"
    if got == [h(None, b) for b in blocks[: len(expected)]]:
        return "chain the hashes: each block's parent is the previous block's hash (None for the first block)"
    if got == [hash(b) for b in blocks[: len(expected)]] or got == [hash(tuple(tokens[:(i + 1) * bs]))
                                                                  for i in range(len(expected))]:
        return "use BlockManager.chain_hash(parent_hash, block_tokens), as the block manager does"
    return "compare the lists above"


def check_block_hashes(fn) -> None:
    """Check ``fn(token_ids, block_size) -> list[int]``, the prefix cache's chain hashes (chapter 08).

    One hash per full block, in order, ``BlockManager.chain_hash(parent, tokens)``
    with the previous block's hash as parent; compared with what minivllm's
    block manager registers for the same prompt.
    """
    cases = _block_hash_cases()
    for tokens, bs in cases:
        what = f"block_hashes({tokens if len(tokens) <= 16 else f'<{len(tokens)} tokens>'}, block_size={bs})"
        got = _call(fn, what, list(tokens), bs)
        try:
            got = [int(x) for x in got]
        except (TypeError, ValueError):
            raise AssertionError(f"{what}: expected a list of int hashes, got {got!r}") from None
        expected = reference_block_hashes(tokens, bs)
        if got != expected:
            raise AssertionError(f"{what}:\n  expected {expected}\n  got      {got}\n  "
                                 f"{_hash_hint(tokens, bs, expected, got)}")
    print(f"check_block_hashes: all {len(cases)} cases match minivllm's block manager.")


def _cached_prefix_cases():
    rng = random.Random(9)
    bs = 4
    first = _random_ids(rng, 12)  # exactly 3 blocks
    second = first[:6] + _random_ids(rng, 9)  # shares block 0, diverges inside block 1
    cached = set(reference_block_hashes(first, bs)) | set(reference_block_hashes(second, bs))
    h0, _, h2 = reference_block_hashes(first, bs)
    cases = [
        (first, bs, cached),  # the whole prompt is cached: its last block is computed anyway
        (first + [5], bs, cached),  # one more token: all 3 blocks hit
        (first + _random_ids(rng, 6), bs, cached),
        (first[:9], bs, cached),
        (first[:8], bs, cached),  # exactly 2 blocks: only 1 may hit
        (first[:4] + [1, 2, 3, 4, 5], bs, cached),  # diverges at block 1
        (second, bs, cached),
        (_random_ids(rng, 10), bs, cached),  # unrelated
        (first + [5], bs, set()),  # empty cache
        ([first[0]], bs, cached),  # a one-token prompt
        (first[:5], bs, cached),  # block 0 and one more token
        (first + [5], bs, {h0, h2}),  # block 1 missing: block 2 may not hit, though its hash is there
        (first + [5], 1, set(reference_block_hashes(first, 1))),
    ]
    for _ in range(20):
        n = rng.randint(1, 24)
        base = first + second
        prompt = base[:rng.randint(0, n)] + _random_ids(rng, rng.randint(0, 6)) or [7]
        cases.append((prompt, bs, cached))
    return cases


def check_cached_prefix_len(fn) -> None:
    """Check ``fn(token_ids, block_size, cached) -> int``, the prompt tokens a prefix cache serves (chapter 08).

    ``cached`` is the set of chain hashes in the cache. Compared with
    :func:`reference_cached_prefix_len`, which the tests hold equal to the
    block manager's own ``match_prefix``.
    """
    cases = _cached_prefix_cases()
    for tokens, bs, cached in cases:
        what = (f"cached_prefix_len({tokens if len(tokens) <= 16 else f'<{len(tokens)} tokens>'}, block_size={bs}, "
                f"cached=<{len(cached)} hashes>)")
        got = _call(fn, what, list(tokens), bs, set(cached))
        if not _is_integer(got):
            raise AssertionError(f"{what}: expected an int number of tokens, got {got!r}")
        expected = reference_cached_prefix_len(tokens, bs, cached)
        if got == expected:
            continue
        hashes = reference_block_hashes(tokens, bs)
        walk = 0
        while walk < len(hashes) and hashes[walk] in cached:
            walk += 1
        anywhere = sum(h in cached for h in hashes)
        if got == expected // bs and expected:
            hint = "return a number of tokens, not of blocks"
        elif got == walk * bs and walk * bs > expected:
            hint = (f"the last prompt token is never served from the cache (the first output token needs its "
                    f"logits): only the full blocks before it, (len - 1) // block_size = {(len(tokens) - 1) // bs}, "
                    f"may hit")
        elif got % bs:
            hint = f"only whole blocks are cached: the answer is a multiple of block_size={bs}"
        elif got >= anywhere * bs > walk * bs or got > walk * bs:
            hint = "stop at the first block that misses: later blocks cannot be used without the ones before"
        else:
            hint = f"{walk} leading block(s) of {bs} tokens are in the cache"
        raise AssertionError(f"{what}: expected {expected}, got {got}; {hint}")
    print(f"check_cached_prefix_len: all {len(cases)} cases match minivllm's prefix cache.")
