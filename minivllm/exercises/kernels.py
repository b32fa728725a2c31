"""Chapter 18, kernels: the check of the reader's two inner loops in C++ (``your_engine/kernels_inner.cpp``).

The reader writes ``attend_tile`` (a tile of query rows times the query heads
that share one KV head, an online softmax over the sequence's keys through its
block table, each row to its own position) and ``q4_1_block_dot`` (one GGUF
Q4_1 block times a few rows of activations). minivllm's scaffolding
(``minivllm/kernels/csrc/ops.cpp``: the checks, the threads, compiled once;
``inner_ops.cpp``: the loops around them) is linked with them into a kernel
table, ``CpuKernels`` named "cpu (yours)", in about a second
(:func:`~minivllm.exercises.native.build_kernels`).
:func:`check_kernels` runs targeted cases against the PyTorch reference first,
up to inner.h's kMaxHeadDim and kMaxBlockSize, in a child process (a crash of
the reader's loops is a message naming the case, and the notebook lives), and
names the classic mistakes in the reader's terms, then (unless ``live=False``) runs SmolLM2 with
the reader's table (``LLM(..., kernels=yours)``), with and without the GGUF's
blocks, and asks for exactly minivllm's tokens.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minivllm.exercises._common import say
from minivllm.exercises.native import (LOOPS, NO_COMPILER, PART, YOURS, build_kernels, compiler_status,  # noqa: F401
                                       library_path, own_table)  # (the notebook imports the build from here too)
from minivllm.kernels import build, reference
from minivllm.kernels.cpu import CpuKernels
from minivllm.tolerances import ATTENTION_ATOL

__all__ = ["LOOPS", "YOURS", "NO_COMPILER", "LIMITS", "compiler_status", "build_kernels", "check_kernels"]


def _limits() -> dict[str, int]:
    """inner.h's limits on a tile's sizes, which every inner loop must handle: kMaxHeadDim, kMaxBlockSize."""
    text = (build.CSRC / "inner.h").read_text()
    return {name: int(re.search(rf"constexpr int {name} = (\d+);", text).group(1))
            for name in ("kMaxHeadDim", "kMaxBlockSize")}


LIMITS = _limits()
Q4_1_ATOL, Q4_1_RTOL = 1e-4, 1e-5  # float32 sums of up to 1,536 products in another order (tests/test_kernels.py)
SMALL = (64, 16)  # the head_dim and block size of every case before the sizes' own (SmolLM2's are 64 and 16)
TOO_SMALL = ("a buffer sized for a smaller model (float acc[64], float s[16]): the kernel must handle any head_dim "
             f"up to kMaxHeadDim ({LIMITS['kMaxHeadDim']}) and any block size up to kMaxBlockSize "
             f"({LIMITS['kMaxBlockSize']}), inner.h's limits")
OUT_OF_BOUNDS_ATTENTION = ("a read or write outside an array: the block table read past a row's last block "
                           "(t.table[i / t.block_size] is there only for keys i <= t.pos[r]), a slot outside the "
                           "cache, an index into a buffer past head_dim or block_size, or an output past the tile")
OUT_OF_BOUNDS_Q4_1 = ("a read or write outside an array: a block is 20 bytes (d, m, then qs[0 .. 15]), row r's "
                      "inputs are x[r * x_stride + 0 .. 31], and acc has rows entries of kLanes lanes")
SIZES = (f"your loop is right at head_dim up to {SMALL[0]} and blocks up to {SMALL[1]} keys (SmolLM2's sizes), "
         f"but not here: {TOO_SMALL}; size a head's buffers kMaxHeadDim and a block's kMaxBlockSize")

# -- paged attention: the cases and the mistakes they tell apart --------------------------------------------------

TABLE_GUARD = 16  # entries after a case's block table, in its memory: see _batch


def _batch(seqs, heads: int, kv_heads: int, dim: int, block_size: int, seed: int):
    """A step of sequences ``(queries, length)``: random queries and caches (every slot of the pool holds some
    key), block tables shuffled over the pool (the +1 slot: the engine's scratch slot). The table's memory goes on
    past its last row with :data:`TABLE_GUARD` entries naming a block no sequence owns, so a loop that reads past
    the table reads other keys, the same in every run (not whatever memory follows: a crash or, by chance, the
    right block)."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(math.ceil(n / block_size) for _, n in seqs) + 2
    k_cache = torch.randn(blocks * block_size + 1, kv_heads, dim, generator=g)
    v_cache = torch.randn(blocks * block_size + 1, kv_heads, dim, generator=g)
    order = iter(torch.randperm(blocks, generator=g).tolist())
    tables = [[next(order) for _ in range(math.ceil(n / block_size))] for _, n in seqs]
    width = max(1, max(map(len, tables)))
    rows = [x for t in tables for x in t + [0] * (width - len(t))]
    table = torch.tensor(rows + [next(order)] * TABLE_GUARD, dtype=torch.int32)[:len(rows)].view(len(tables), width)
    lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    starts = torch.tensor([0, *itertools.accumulate(q for q, _ in seqs)], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), heads, dim, generator=g)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table, seq_lens=lens, query_start=starts,
                block_size=block_size)


def _slot(args, b: int, t: int) -> int:
    bs = args["block_size"]
    return int(args["block_table"][b, t // bs]) * bs + t % bs


def _rows(args):
    """Every query row of a batch: (flat index, sequence, position)."""
    starts, lens = args["query_start"].tolist(), args["seq_lens"].tolist()
    for b, n in enumerate(lens):
        count = starts[b + 1] - starts[b]
        for i in range(count):
            yield starts[b] + i, b, n - count + i


def _model(args, visible=None, kv_head=None, query_head=None, scale: bool = True, normalize: bool = True,
           use_table: bool = True, carry: bool = False, packed: bool = False) -> torch.Tensor:
    """Attention as a reader's kernel might compute it, in float64: ``visible(b, pos, length)`` the keys a row
    sees (its own position by default), ``kv_head(h, group)`` the KV head query head ``h`` reads, ``query_head(h,
    group)`` whose query it uses; no scale, no division by the sum, slots without the table, the running state
    carried from one query head of a row to the next (``carry``), a slot's keys found at slot * head_dim
    (``packed``): the mistakes."""
    q, kc, vc = args["q"].double(), args["k_cache"].double(), args["v_cache"].double()
    H, D, KVH = q.shape[1], q.shape[2], kc.shape[1]
    group = H // KVH
    out = torch.zeros_like(q)
    flat_k, flat_v = kc.reshape(-1, D), vc.reshape(-1, D)  # key rows of every (slot, KV head), as memory holds them
    for i, b, pos in _rows(args):
        length = int(args["seq_lens"][b])
        keys = visible(b, pos, length) if visible else range(pos + 1)
        for h in range(H):
            g = kv_head(h, group) if kv_head else h // group
            qh = q[i, query_head(h, group) if query_head else h]
            rows = [(_slot(args, b, t) if use_table else t) * (1 if packed else KVH) + g for t in keys]
            s = flat_k[rows] @ qh * (1 / math.sqrt(D) if scale else 1.0)
            if carry and h % group:  # the sums of the row's earlier heads of this group, never reset
                s, rows = torch.cat([prev_s, s]), prev_rows + rows
            prev_s, prev_rows = s, rows
            p = torch.exp(s - s.max())
            out[i, h] = (p @ flat_v[rows]) / (p.sum() if normalize else 1.0)  # acc is relative to the max
    return out.float()


UNEXPLAINED = "compare your loop with the contract in inner.h (the comment above attend_tile)"
RESCALE = ("the running sum not rescaled when the maximum grows: when a block's largest score beats the running "
           "maximum m, multiply the running sum l and every weighted value in acc by exp(m_old - m_new) before adding "
           "the block's own exp(s - m_new) terms")


def _attention_case(what, seqs, heads, block_size, seed, scores=None, q_scale: float = 1.0, poison: bool = False,
                    otherwise: str = UNEXPLAINED):
    """One targeted case ``(what, args, otherwise)``: the batch, with the first sequence's scores set by ``scores``
    (key t's score for its first query, first head) where given, queries scaled, NaN in every slot past a
    sequence's length when ``poison``; ``otherwise``, the hint when no known mistake explains a wrong output."""
    h, kvh, d = heads
    args = _batch(seqs, h, kvh, d, block_size, seed)
    if scores is not None:  # keys along the query's direction, so that q . k_t * scale = scores[t]
        qv = args["q"][0, 0]
        unit = qv / qv.norm()
        for t, s in enumerate(scores):
            slot = _slot(args, 0, t)
            noise = args["k_cache"][slot, 0] - (args["k_cache"][slot, 0] @ unit) * unit  # orthogonal part kept
            args["k_cache"][slot, 0] = noise + unit * (s * math.sqrt(d) / qv.norm())
    args["q"] = args["q"] * q_scale
    if poison:
        for b, (_, n) in enumerate(seqs):
            for t in range(n, math.ceil(n / block_size) * block_size):
                slot = _slot(args, b, t)
                args["k_cache"][slot], args["v_cache"][slot] = float("nan"), float("nan")
    return what, args, otherwise


def _attention_cases():
    rising = [0.6 * t - 3.0 for t in range(12)]
    falling = [3.0] + [(-1) ** t * 0.3 for t in range(1, 8)]
    return [
        _attention_case("one decode row, 8 keys in 2 blocks of 4 through a shuffled block table; its first key has "
                        "the largest score", [(1, 8)], (1, 1, 16), 4, 1, scores=falling),
        _attention_case("one decode row, 12 keys in 3 blocks of 4, each key's score above the last (the running "
                        "maximum grows in every block)", [(1, 12)], (1, 1, 16), 4, 2, scores=rising,
                        otherwise=RESCALE),
        _attention_case("decode rows whose length ends inside a block (5 and 7 keys, blocks of 4): the slots after "
                        "the length hold other keys", [(1, 5), (1, 7)], (1, 1, 16), 4, 3),
        _attention_case("decode rows of 5 and 7 keys (blocks of 4) with NaN in the slots after each length",
                        [(1, 5), (1, 7)], (1, 1, 16), 4, 4, poison=True),
        _attention_case("grouped-query attention: 6 query heads read 2 KV heads (3 each), two decode rows",
                        [(1, 9), (1, 6)], (6, 2, 16), 4, 5),
        _attention_case("a prefill chunk: 6 query rows at positions 5..10 after 5 cached keys (blocks of 4)",
                        [(6, 11)], (2, 1, 16), 4, 6),
        _attention_case("large scores (queries 200x): exp of a raw score overflows float32", [(1, 9), (3, 6)],
                        (2, 1, 16), 4, 7, q_scale=200.0),
    ] + [_attention_case(f"random step {i}: decode rows, chunks and whole prompts, {h} query heads on {kvh} KV heads, "
                         f"head_dim {d}, blocks of {bs}", seqs, (h, kvh, d), bs, 100 + i)
         for i, (seqs, (h, kvh, d), bs) in enumerate([
             ([(1, 37), (5, 21), (3, 3), (0, 4), (16, 16)], (9, 3, 64), 16),
             ([(1, 1), (4, 30), (1, 29)], (4, 2, 16), 7),
             ([(2, 9), (1, 13), (9, 9)], (8, 4, 8), 1),
             ([(1, 45), (3, 40)], (2, 2, 40), 8),
             ([(20, 100), (1, 600)], (6, 1, 32), 16)])] + [
        _attention_case(f"{why}: {h} query heads on {kvh} KV heads, head_dim {d}, blocks of {bs}", seqs, (h, kvh, d),
                        bs, 200 + i, otherwise=SIZES)
        for i, (why, seqs, (h, kvh, d), bs) in enumerate([
            ("head_dim 128 (Llama 3's)", [(1, 40), (3, 20)], (4, 2, 128), 16),
            ("blocks of 32 keys", [(1, 70), (4, 40)], (2, 1, 64), 32),
            ("blocks of 128", [(1, 300), (2, 130)], (2, 1, 128), 128),
            ("the limits, kMaxHeadDim and kMaxBlockSize", [(1, 300), (2, 257)], (2, 1, LIMITS["kMaxHeadDim"]),
             LIMITS["kMaxBlockSize"])])]


def _where(got, want, args) -> str:
    """The first (sequence, position, head) where ``got`` is off, and by how much."""
    bad = ~torch.isclose(got, want, rtol=0, atol=ATTENTION_ATOL) | got.isnan()
    i, h = [int(x) for x in bad.any(-1).nonzero()[0]]
    b, pos = next((b, pos) for j, b, pos in _rows(args) if j == i)
    err = (got[i, h] - want[i, h]).abs().max()
    return f"sequence {b}'s query at position {pos}, head {h}: off by {float(err):.3g}"


def _close(a, b) -> bool:
    return bool(torch.allclose(a, b, rtol=0, atol=10 * ATTENTION_ATOL))


def _diagnose_attention(args, got, otherwise: str) -> str:
    """The mistake that explains ``got``, in the reader's terms (``otherwise`` when none does)."""
    bs = args["block_size"]
    H, KVH = args["q"].shape[1], args["k_cache"].shape[1]
    poisoned = bool(args["k_cache"].isnan().any())
    if got.isnan().any() and not poisoned:
        return ("exp of a raw score overflows float32 (exp(89) is inf, and inf / inf is NaN): subtract the running "
                "maximum m before exp, exp(s - m), and rescale the sums when m grows")
    if got.isnan().any():
        return ("a row read to the end of its last block instead of its length: the slots after a row's position "
                "hold NaN here, and even with weight 0 they poison the sums (0 * NaN = NaN); stop the loop over "
                "keys at t.pos[r], the row's own position")
    models = [
        ("a row read to the end of its last block instead of its length: row r sees keys 0 .. t.pos[r] (its "
         "position), not the whole block that holds it; the slots after it hold other keys (or nothing yet)",
         dict(visible=lambda b, p, n: range((p // bs + 1) * bs))),
        ("a chunk's rows seeing keys after their own position: row r of the tile sees keys 0 .. t.pos[r] only "
         "(the causal rule, chapter 02), not as far as the tile's last row", dict(visible=lambda b, p, n: range(n))),
        ("each row misses its own key: row r sees keys 0 .. t.pos[r], its own position included (key <= pos)",
         dict(visible=lambda b, p, n: range(p))),
        ("the scores are not scaled: multiply q . k by t.scale (1 / sqrt(head_dim)) before the softmax",
         dict(scale=False)),
        ("the weighted sum is not divided by the running sum l at the end (out = acc / l)", dict(normalize=False)),
        ("key t is not found through the block table: it lives in slot t.table[t / block_size] * block_size + "
         "t % block_size (a row's blocks are scattered over the pool), not in slot t", dict(use_table=False)),
        ("the wrong KV head for a query head: the tile's `heads` query heads all read the one KV head that k_cache "
         "and v_cache point at (key t is k_cache[slot * kv_stride + d] for every h); h offsets only the query and "
         "the output", dict(kv_head=lambda h, g: h // g + h % g)),
        ("every query head uses the first head's query: query head h of row r is q[r * q_row_stride + "
         "h * head_dim + d]", dict(query_head=lambda h, g: h // g * g)),
        ("a key's vector is t.k_cache + slot * t.kv_stride (and its value t.v_cache + slot * t.kv_stride): "
         "kv_stride, the distance between two slots, is kv_heads * head_dim, not head_dim", dict(packed=True)),
        ("the running maximum m, sum l and weighted values acc go on from one query head to the next: each (row, "
         "head) is a softmax of its own, so set m = -inf, l = 0 and acc = 0 at the start of each, inside the loop "
         "over heads", dict(carry=True)),
    ]
    for hint, options in models:
        if (options.get("kv_head") or options.get("query_head") or options.get("carry")) and H == KVH \
                or options.get("packed") and KVH == 1:
            continue
        try:
            model = _model(args, **options)
        except IndexError:  # the mistake would read past the pool's end here: not this one
            continue
        if _close(got, model):
            return hint
    ok = torch.isclose(got, reference.paged_attention(**args), rtol=0, atol=ATTENTION_ATOL).all(-1)  # [T, H]
    group = H // KVH
    if group > 1 and bool(ok[:, ::group].all()) and not bool(ok.all()):
        return ("with several query heads per KV head, the tile's first query head is right and the others are "
                "not: query head h of the tile reads q + r * q_row_stride + h * head_dim, writes out + r * "
                "out_row_stride + h * head_dim, and every one of them reads the one KV head k_cache and v_cache "
                "point at")
    return otherwise


def _shape(args) -> str:
    """A case's sizes, in the tile's terms: rows, block size, head_dim."""
    T, H, D = args["q"].shape
    return (f"rows {T}, sequences {len(args['seq_lens'])} of up to {int(args['seq_lens'].max())} keys, block size "
            f"{args['block_size']}, head_dim {D}")


def _check_attention(table: CpuKernels, started=lambda what, sizes, cause: None) -> int:
    """Each case against the reference; ``started(what, sizes, cause)`` is told each case before it runs, with
    the usual cause of a crash there (the child process of :func:`_run_cases` writes it down)."""
    cases = _attention_cases()
    for i, (what, args, otherwise) in enumerate(cases):
        beyond = args["q"].shape[2] > SMALL[0] or args["block_size"] > SMALL[1]  # every earlier case passed
        started(f"paged attention case {i + 1} of {len(cases)}, {what}", _shape(args),
                f"{TOO_SMALL}; or {OUT_OF_BOUNDS_ATTENTION}" if beyond else OUT_OF_BOUNDS_ATTENTION)
        want = reference.paged_attention(**args)
        try:
            got = table.paged_attention(**args)
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"paged attention, {what}: your kernel raised {type(e).__name__}: {e}") from e
        if got.isnan().any() or not torch.allclose(got, want, rtol=0, atol=ATTENTION_ATOL):
            hint = otherwise if beyond else _diagnose_attention(args, got, otherwise)
            raise AssertionError(f"paged attention, {what}: {_where(got, want, args)}; {hint}")
    return len(cases)


# -- Q4_1: the blocks, the cases and the mistakes ----------------------------------------------------------------

def _block(d: float, m: float, quants) -> bytes:
    """One Q4_1 block as the GGUF stores it: fp16 d, fp16 m, 16 bytes of two quants each (weight j low, j+16 high)."""
    quants = list(quants)
    return struct.pack("<ee", d, m) + bytes(quants[j] | quants[j + 16] << 4 for j in range(16))


def _decode(qweight: torch.Tensor, in_features: int, nibbles: str = "low first", d_as: str = "fp16",
            m_as: str = "fp16", offset: int = 0, with_min: bool = True) -> torch.Tensor:
    """The weights of Q4_1 blocks read as a reader's loop might: the nibbles in another order, d or m read as
    another type, a Q4_0-style offset, the min forgotten (float64)."""
    blocks = qweight.view(qweight.shape[0], in_features // 32, 20)
    raw = blocks[..., 0:4].contiguous()

    def value(lo: int, as_: str) -> torch.Tensor:
        two = raw[..., lo:lo + 2].contiguous()
        if as_ == "fp16":
            return two.view(torch.float16).double()[..., 0]
        if as_ == "bf16":
            return two.view(torch.bfloat16).double()[..., 0]
        if as_ == "int":
            return two.view(torch.int16).double()[..., 0] % 65536
        return raw.view(torch.float32).double()[..., 0]  # "f32": the 4 bytes at the block's start

    d, m = value(0, d_as), value(2, m_as)
    qs = blocks[..., 4:].long()
    low, high = qs & 0x0F, qs >> 4
    q = {"low first": torch.cat([low, high], -1), "high first": torch.cat([high, low], -1),
         "interleaved": torch.stack([low, high], -1).flatten(-2)}[nibbles].double() - offset
    w = q * d[..., None] + (m[..., None] if with_min else 0.0)
    return w.reshape(qweight.shape[0], in_features)


Q4_1_MISTAKES = [
    ("Q4_1's min term forgotten: weight = d * q + m, and the block's fp16 minimum m (bytes 2-3) is added to each "
     "of its 32 weights", dict(with_min=False)),
    ("nibble order swapped: byte j holds weight j in its LOW 4 bits (q & 0x0F) and weight j + 16 in its HIGH 4 "
     "bits (q >> 4)", dict(nibbles="high first")),
    ("the nibbles read as neighbours: byte j holds weights j (low 4 bits) and j + 16 (high 4 bits), not 2j and "
     "2j + 1", dict(nibbles="interleaved")),
    ("the fp16 scale read as bfloat16: bytes 0-1 are an IEEE half (5 exponent bits, 10 mantissa bits): "
     "half_to_float(read_u16(block))", dict(d_as="bf16")),
    ("the fp16 scale read as an integer: bytes 0-1 are an IEEE half, whose bits mean a float: "
     "half_to_float(read_u16(block)) converts them", dict(d_as="int")),
    ("the fp16 scale read as a 4-byte float: d is 2 bytes (an IEEE half), and m the next 2: "
     "half_to_float(read_u16(block))", dict(d_as="f32")),
    ("the fp16 minimum read as bfloat16: bytes 2-3 are an IEEE half: half_to_float(read_u16(block + 2))",
     dict(m_as="bf16")),
    ("the fp16 minimum read as an integer: bytes 2-3 are an IEEE half: half_to_float(read_u16(block + 2))",
     dict(m_as="int")),
    ("Q4_1's quants are unsigned, 0 to 15 (weight = d * q + m): subtracting 8 is Q4_0's rule", dict(offset=8)),
]


def _q4_1_cases():
    g = torch.Generator().manual_seed(18)
    quants = list(range(16)) + [15 - j // 2 for j in range(16)]  # no two readings of the block give one sum
    first = torch.tensor(list(_block(0.5, -2.5, quants)), dtype=torch.uint8)
    x1 = torch.arange(1, 33, dtype=torch.float32)[None]
    rows = []
    for n in range(5):  # 5 output features of 3 blocks each: random scales, mins and quants
        rows.append(b"".join(_block(float(torch.rand(1, generator=g)) * 0.1 + 0.01,
                                    float(torch.randn(1, generator=g)) * 0.2,
                                    torch.randint(0, 16, (32,), generator=g).tolist()) for _ in range(3)))
    many = torch.tensor([list(r) for r in rows], dtype=torch.uint8)
    cases = [("one block, one row: d = 0.5, m = -2.5, quants 0..15 then 15, 15, 14, 14, ..., 8, x = 1, 2, ..., 32", x1, first[None],
              None)]
    for r in (1, 2, 5, 8):
        cases.append((f"{r} row{'s' * (r > 1)} at once, 5 output features of 3 blocks each (random d, m, quants)",
                      torch.randn(r, 96, generator=g), many, None))
    try:
        from minivllm.models.gguf_file import gguf_path, read_gguf_tensors  # not the loader: no transformers

        tensors = read_gguf_tensors(gguf_path())
        for name, r in (("blk.0.ffn_down.weight", 3), ("blk.3.attn_q.weight", 8)):
            qweight = torch.from_numpy(tensors[name].data.copy())
            k = qweight.shape[1] // 20 * 32
            cases.append((f"the embedded GGUF's {name} ({qweight.shape[0]} x {k}), {r} rows and a bias",
                          torch.randn(r, k, generator=g), qweight, torch.randn(qweight.shape[0], generator=g)))
    except (ImportError, FileNotFoundError, OSError):  # no embedded model here: the made-up blocks above suffice
        pass
    return cases


def _diagnose_q4_1(x, qweight, got) -> str:
    xd = x.double()
    for hint, options in Q4_1_MISTAKES:
        want = xd @ _decode(qweight, x.shape[1], **options).T
        if torch.allclose(got.double(), want, rtol=1e-4, atol=1e-3):
            return hint
    w = _decode(qweight, x.shape[1])
    exact = xd @ w.T
    if not got.isfinite().all() or bool((got.double().abs() > 10 * (xd.abs() @ w.abs().T) + 1).any()):
        return ("a number far beyond any sum of this block's products: a read past the block (its 16 quant bytes "
                "are qs[0 .. 15], each holding weights j and j + 16) or past row r's 32 inputs")
    blocks = x.shape[1] // 32
    last = xd[:, -32:] @ w[:, -32:].T
    if blocks > 1 and torch.allclose(got.double(), last, rtol=1e-4, atol=1e-3):
        return ("only the last block counts: add into acc[r] (acc[r] += ...), which holds the earlier blocks' "
                "sums, instead of assigning it")
    ok = torch.isclose(got.double(), exact, rtol=1e-4, atol=1e-3).all(-1)
    if x.shape[0] > 1 and bool(ok[0]) and not bool(ok.all()):
        return ("the first row is right and the others are not: row r's 32 inputs are x[r * x_stride + 0 .. 31] "
                "(x_stride is the input width, not 32), and its sums go to acc[r]")
    return "compare your loop with the contract in inner.h"


def _check_q4_1(table: CpuKernels, started=lambda what, sizes, cause: None) -> int:
    cases = _q4_1_cases()
    for i, (what, x, qweight, bias) in enumerate(cases):
        started(f"Q4_1 matvec case {i + 1} of {len(cases)}, {what}",
                f"{x.shape[0]} rows of {x.shape[1]} inputs, {qweight.shape[0]} output features", OUT_OF_BOUNDS_Q4_1)
        want = reference.q4_1_linear(x, qweight, bias)
        try:
            got = table.q4_1_linear(x, qweight, bias)
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"Q4_1 matvec, {what}: your kernel raised {type(e).__name__}: {e}") from e
        if not torch.allclose(got, want, rtol=Q4_1_RTOL, atol=Q4_1_ATOL):
            r, n = [int(i) for i in (~torch.isclose(got, want, rtol=Q4_1_RTOL, atol=Q4_1_ATOL)).nonzero()[0]]
            hint = _diagnose_q4_1(x, qweight, got - (bias if bias is not None else 0))
            raise AssertionError(f"Q4_1 matvec, {what}: row {r}, output {n} is {float(got[r, n]):.6g}, expected "
                                 f"{float(want[r, n]):.6g}; {hint}")
    return len(cases)


# -- the targeted cases in a child process: a crash is a message, not a dead notebook -------------------------------

CASES_TIMEOUT = 300  # seconds: the targeted cases take a few; a process still running after this is in an endless loop


def _cases_child(lib: str, log: str) -> None:
    """The child process of :func:`_run_cases`: the targeted cases on the library at ``lib``, each case's name
    appended to the file ``log`` before it runs, the outcome last (JSON lines: plain data, never a pickle)."""
    with open(log, "a", encoding="utf-8") as f:
        def write(**record):
            f.write(json.dumps(record) + "\n")
            f.flush()

        table = CpuKernels(build.load(Path(lib)), YOURS)
        started = lambda what, sizes, cause: write(case=what, sizes=sizes, cause=cause)  # noqa: E731
        started("the first call of each loop (is it written?)", "one key, head_dim 8; one Q4_1 block",
                OUT_OF_BOUNDS_ATTENTION)
        left = table.not_written()
        if left:
            return write(failed="NotImplementedError", message=f"not written yet: {', '.join(left)}")
        try:
            write(passed=[_check_attention(table, started), _check_q4_1(table, started)])
        except (AssertionError, NotImplementedError) as e:
            write(failed=type(e).__name__, message=str(e))


def _run_cases(table: CpuKernels) -> list[int]:
    """The targeted cases run in a child process on ``table``'s library, so that a crash of the reader's loops
    (an out-of-bounds read, a stack overflow) is an ``AssertionError`` naming the case, and the notebook lives.
    Returns the number of attention and Q4_1 cases; a failure raises what the check raised in the child."""
    code = "import sys; from minivllm.exercises.kernels import _cases_child; _cases_child(*sys.argv[1:])"
    with tempfile.TemporaryDirectory(prefix="minivllm-check-") as tmp:
        log = Path(tmp) / "cases.jsonl"
        log.touch()
        try:
            done = subprocess.run([sys.executable, "-c", code, str(library_path(table)), str(log)],
                                  capture_output=True, text=True, timeout=CASES_TIMEOUT)
        except subprocess.TimeoutExpired:  # subprocess.run killed the child
            done = None
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    if done is not None and (done.stdout.strip() or done.returncode):
        print(done.stdout, end="")  # your loops' own prints (printf debugging)
    last = records[-1] if records else {}
    if "passed" in last:
        return last["passed"]
    if "failed" in last:
        raise (NotImplementedError if last["failed"] == "NotImplementedError" else AssertionError)(last["message"])
    case = last.get("case", "loading your library")
    where = f"{case} ({last['sizes']})" if "sizes" in last else case
    if done is None:
        raise AssertionError(f"your kernel did not finish {where} in {CASES_TIMEOUT} s: an endless loop? (a loop "
                             "over keys or blocks whose index never reaches its end)")
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        raise AssertionError(f"your kernel crashed ({name}) on {where}; the usual cause is "
                             f"{last.get('cause', 'a read or write outside an array')}")
    raise AssertionError(f"the targeted cases stopped on {where} (exit status {done.returncode}): "
                         f"{done.stderr.strip()[-2000:]}")


# -- the live engine -----------------------------------------------------------------------------------------------

def _check_live(table: CpuKernels) -> None:
    from minivllm.exercises.live import chat_prompts, check_live, greedy  # the engine: not the cases' child's import
    from minivllm.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    requests = [(f"r{i}", p, greedy(12)) for i, p in enumerate(chat_prompts(tok, 4, note_words=(30, 50)))]
    options = dict(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256, dtype="float32",
                   device="cpu", enable_chunked_prefill=True, max_prefill_chunk_size=64)
    for quantization in (None, "gguf"):
        extra = {"quantization": quantization, "gguf_activations": "float32"} if quantization else {}  # your loop
        what = "your kernels" + (" with the GGUF's Q4_1 blocks (quantization='gguf')" if quantization else "")
        check_live(what, requests, parts={"kernels": table}, tokenizer=tok, **options, **extra)


def check_kernels(kernels=PART, live: bool = True) -> None:
    """Check your ``attend_tile`` and ``q4_1_block_dot`` (chapter 18): ``kernels`` is your ``kernels_inner.cpp``
    (built here, seconds) or its build (:func:`build_kernels`).

    First, whether both loops are written (a stub's op says "not written
    yet"). Then targeted cases against the PyTorch reference, stopping at the
    first failure with the mistake named: one decode row through a shuffled
    block table, a row whose running maximum grows in every block, rows that
    end inside a block (other keys, then NaN, in the slots after them),
    grouped-query heads, a prefill chunk's causal rows, large scores, then
    random steps of decode rows, chunks and whole prompts (block sizes 1 to
    16, head_dim 8 to 64), then the sizes of other models up to inner.h's
    limits (head_dim 128, blocks of 32 and 128, kMaxHeadDim and
    kMaxBlockSize); for Q4_1, one block with known d, m and quants, up to 8
    rows at once, and the embedded GGUF's own blocks. The cases run in a
    child process: a crash there is an ``AssertionError`` naming the case and
    its sizes, and this process lives. Then, unless
    ``live=False``, SmolLM2 in the live engine with your table, with and
    without ``quantization="gguf"``: exactly the tokens of minivllm's own
    kernels, the block invariants after every step, no leaked block.
    """
    start = time.perf_counter()
    table = own_table(kernels)
    attention, q4_1 = _run_cases(table)  # "not written yet" first
    say(f"check_kernels: {attention} paged-attention cases (the rescale, each row to its own position, the block "
        f"table, grouped-query heads, a chunk's causal rows, large scores, random steps, head_dim up to "
        f"{LIMITS['kMaxHeadDim']} and blocks up to {LIMITS['kMaxBlockSize']} keys) and {q4_1} Q4_1 cases (scale, "
        f"min, nibble order, rows) match the reference (targeted cases, {time.perf_counter() - start:.1f} s).")
    if not live:
        return
    _check_live(table)
    say("check_kernels: your kernels ran SmolLM2 in the live engine with and without the GGUF's blocks, with "
        "exactly minivllm's tokens.")
