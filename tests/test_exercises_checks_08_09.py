"""The exercise checks of chapters 08 and 09 accept right answers and reject plausible wrong ones."""

import random

import pytest

from minivllm.block_manager import BlockManager
from minivllm.exercises import (_PLAN_CASES, _block_hash_cases, _cached_prefix_cases, _random_plan_cases,
                                check_block_hashes, check_cached_prefix_len, check_plan_chunks,
                                reference_block_hashes, reference_cached_prefix_len, reference_plan_chunks)
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

H = BlockManager.chain_hash


# check_block_hashes -----------------------------------------------------------------------------------

def block_hashes(token_ids, block_size):
    """The solution notebook's answer."""
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = H(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes


def block_hashes_recursive(token_ids, block_size):
    """Another right answer: recursion from the end, a tuple result."""
    n = len(token_ids) // block_size
    if n == 0:
        return ()
    head = block_hashes_recursive(token_ids[:(n - 1) * block_size], block_size)
    return tuple(head) + (H(head[-1] if head else None, tuple(token_ids[(n - 1) * block_size:n * block_size])),)


def _blocks(tokens, bs, partial=False):
    n = -(-len(tokens) // bs) if partial else len(tokens) // bs
    return [tuple(tokens[i * bs:(i + 1) * bs]) for i in range(n)]


def hashes_with_partial(tokens, bs):
    out, parent = [], None
    for b in _blocks(tokens, bs, partial=True):
        parent = H(parent, b)
        out.append(parent)
    return out


BLOCK_HASH_WRONG = {
    "hashes the partial block too": (hashes_with_partial, "only full blocks"),
    "not chained": (lambda t, bs: [H(None, b) for b in _blocks(t, bs)], "chain the hashes"),
    "hashes lists": (lambda t, bs: [H(None, list(t[:bs]))] if len(t) >= bs else [], "tuple"),
    "plain hash of the block": (lambda t, bs: [hash(b) for b in _blocks(t, bs)], "chain_hash"),
    "hash of the whole prefix": (lambda t, bs: [hash(tuple(t[:(i + 1) * bs])) for i in range(len(t) // bs)],
                                 "chain_hash"),
    "one block short": (lambda t, bs: block_hashes(t, bs)[:-1], "one hash per full block"),
    "parent is the previous block's tokens": (
        lambda t, bs: [H(_blocks(t, bs)[i - 1] if i else None, b) for i, b in enumerate(_blocks(t, bs))], "expected"),
    "returns the blocks": (lambda t, bs: _blocks(t, bs), "int hashes"),
}


def test_reference_hashes_are_the_chain():
    for tokens, bs in _block_hash_cases():
        assert reference_block_hashes(tokens, bs) == block_hashes(tokens, bs)


@pytest.mark.parametrize("fn", [block_hashes, block_hashes_recursive, reference_block_hashes])
def test_block_hash_check_passes_right_answers(fn, capsys):
    check_block_hashes(fn)
    assert "check_block_hashes: all" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(BLOCK_HASH_WRONG))
def test_block_hash_check_rejects_wrong_answers(name):
    fn, hint = BLOCK_HASH_WRONG[name]
    with pytest.raises(AssertionError, match=hint):
        check_block_hashes(fn)


# check_cached_prefix_len ------------------------------------------------------------------------------

def cached_prefix_len(token_ids, block_size, cached):
    """The solution notebook's answer."""
    hits = 0
    for h in block_hashes(token_ids, block_size)[:(len(token_ids) - 1) // block_size]:
        if h not in cached:
            break
        hits += block_size
    return hits


def cached_prefix_len_while(token_ids, block_size, cached):
    """Another right answer: a while loop that hashes as it walks."""
    i, parent = 0, None
    while (i + 1) * block_size < len(token_ids):
        parent = H(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        if parent not in cached:
            break
        i += 1
    return i * block_size


def _walk(tokens, bs, cached, limit=None, skip=False):
    hashes = block_hashes(tokens, bs)
    if limit is not None:
        hashes = hashes[:limit(tokens, bs)]
    n = 0
    for h in hashes:
        if h in cached:
            n += 1
        elif not skip:
            break
    return n


CACHED_WRONG = {
    "serves the last token too": (lambda t, bs, c: _walk(t, bs, c) * bs, "last prompt token"),
    "counts blocks": (lambda t, bs, c: _walk(t, bs, c, lambda t, bs: (len(t) - 1) // bs), "not of blocks"),
    "does not stop at a miss": (lambda t, bs, c: _walk(t, bs, c, lambda t, bs: (len(t) - 1) // bs, skip=True) * bs,
                                "first block that misses"),
    "len // bs - 1 blocks": (lambda t, bs, c: _walk(t, bs, c, lambda t, bs: max(len(t) // bs - 1, 0)) * bs,
                             "expected"),
    "counts the tail tokens": (lambda t, bs, c: min(len(t) - 1, cached_prefix_len(t, bs, c) + len(t) % bs)
                               if cached_prefix_len(t, bs, c) else 0, "whole blocks"),
    "returns a list": (lambda t, bs, c: [cached_prefix_len(t, bs, c)], "int"),
}


def test_reference_cached_prefix_len_is_match_prefix():
    """The set-of-hashes reference equals the block manager's match_prefix after real registrations."""
    rng = random.Random(5)
    for trial in range(30):
        bs = rng.choice([1, 2, 4, 8])
        base = [rng.randrange(1, 500) for _ in range(40)]
        bm = BlockManager(num_blocks=400, block_size=bs, enable_prefix_caching=True)
        for k in range(6):
            prompt = base[:rng.randint(0, 40)] + [rng.randrange(1, 500) for _ in range(rng.randint(0, 8))] or [1]
            expected = reference_cached_prefix_len(prompt, bs, set(bm.hash_to_block))
            seq = Sequence(f"s{trial}-{k}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
            assert bm.match_prefix(seq) == expected == cached_prefix_len(prompt, bs, set(bm.hash_to_block))
            bm.allocate(seq, len(prompt))
            seq.cached_token_count = len(prompt)
            bm.register_computed_blocks(seq)
            bm.free(seq)


@pytest.mark.parametrize("fn", [cached_prefix_len, cached_prefix_len_while, reference_cached_prefix_len])
def test_cached_prefix_check_passes_right_answers(fn, capsys):
    check_cached_prefix_len(fn)
    assert "check_cached_prefix_len: all" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(CACHED_WRONG))
def test_cached_prefix_check_rejects_wrong_answers(name):
    fn, hint = CACHED_WRONG[name]
    with pytest.raises(AssertionError, match=hint):
        check_cached_prefix_len(fn)


def test_cached_prefix_cases_cover_the_traps():
    """The hand-made cases include a fully cached prompt, a missing middle block and a one-token prompt."""
    cases = _cached_prefix_cases()
    assert any(len(t) % bs == 0 and reference_cached_prefix_len(t, bs, c) == len(t) - bs for t, bs, c in cases)
    assert any(len(t) == 1 for t, _, _ in cases)
    assert any(cached_prefix_len(t, bs, c) != _walk(t, bs, c, skip=True) * bs for t, bs, c in cases)


# check_plan_chunks ------------------------------------------------------------------------------------

def plan_chunks(prompt_len, num_cached, chunk_size):
    """The solution notebook's answer."""
    return [(start, min(start + chunk_size, prompt_len)) for start in range(num_cached, prompt_len, chunk_size)]


def plan_chunks_while(prompt_len, num_cached, chunk_size):
    """Another right answer: lists, a while loop."""
    out, start = [], num_cached
    while start < prompt_len:
        end = min(prompt_len, start + chunk_size)
        out.append([start, end])
        start = end
    return out


PLAN_WRONG = {
    "ignores the cache": (lambda n, c, k: plan_chunks(n, 0, k), "start at num_cached"),
    "last chunk overflows": (lambda n, c, k: [(s, s + k) for s in range(c, n, k)], "ends exactly"),
    "inclusive end": (lambda n, c, k: [(a, b - 1) for a, b in plan_chunks(n, c, k)], "exclusive"),
    "aligned to multiples": (lambda n, c, k: [(max(s, c), min(s + k, n)) for s in range(c - c % k, n, k)],
                             "not aligned"),
    "one token too many per chunk": (lambda n, c, k: plan_chunks(n, c, k + 1), "chunk_size"),
    "off by one at the end": (lambda n, c, k: plan_chunks(n - 1, c, k) if n - 1 > c else [], "expected"),
    "empty when it fits": (lambda n, c, k: plan_chunks(n, c, k) if n - c > k else [], "at least one chunk"),
    "returns lengths": (lambda n, c, k: [b - a for a, b in plan_chunks(n, c, k)], "pairs"),
}


def test_reference_plan_is_the_engine_schedule():
    for case in _PLAN_CASES + _random_plan_cases(200, seed=1):
        assert reference_plan_chunks(*case) == plan_chunks(*case), case
    assert reference_plan_chunks(7, 0, 3) == [(0, 3), (3, 6), (6, 7)]
    assert reference_plan_chunks(12000, 8000, 1000) == [(8000, 9000), (9000, 10000), (10000, 11000), (11000, 12000)]


@pytest.mark.parametrize("fn", [plan_chunks, plan_chunks_while, reference_plan_chunks])
def test_plan_check_passes_right_answers(fn, capsys):
    check_plan_chunks(fn)
    assert "check_plan_chunks: all" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(PLAN_WRONG))
def test_plan_check_rejects_wrong_answers(name):
    fn, hint = PLAN_WRONG[name]
    with pytest.raises(AssertionError, match=hint):
        check_plan_chunks(fn)


def test_plan_check_says_what_differs():
    with pytest.raises(AssertionError) as err:
        check_plan_chunks(PLAN_WRONG["ignores the cache"][0])
    message = str(err.value)
    assert "plan_chunks(prompt_len=" in message and "expected [" in message and "got      [" in message
