"""What rank 0 sends the other ranks each step: two broadcasts of CPU int64 tensors (chapter 15).

A step is the block copies the scheduler ordered (a fork's copy on write,
swap-outs, swap-ins) and/or the flat token batch of the forward
(:class:`~minivllm.model_runner.StepInputs`). Rank 0 broadcasts a fixed
header of :data:`HEADER` integers (the operation and the length of every
list), then, if any list is non-empty, one flat int64 tensor holding all the
lists end to end. Every rank decodes the same lists and builds its own
tensors and attention metadata from them with the same code.

Why a broadcast of two tensors: it goes over ``torch.distributed``, so it
works the same on one machine or across several (shared memory would not);
it needs no pickling (``broadcast_object_list`` pickles and sends two
tensors anyway); and it runs on a gloo group of CPU tensors, so with NCCL
for the forward's collectives the bookkeeping never touches the GPU stream.
The per-step cost is measured in chapter 15.
"""

from __future__ import annotations

import datetime
import itertools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minivllm.model_runner import StepInputs

__all__ = ["STEP", "SHUTDOWN", "HEADER", "StepMessage", "encode", "decode", "send", "receive"]

STEP, SHUTDOWN = 1, 2
HEADER = 8  # op, tokens, sequences, block-table entries, sampled rows, copies, swap-outs, swap-ins


@dataclass
class StepMessage:
    """One broadcast: block copies to make on every rank, then (if ``inputs``) a forward to run."""

    op: int = STEP
    inputs: StepInputs | None = None
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    offload: tuple = ()  # no CPU tier under tensor parallelism (the config refuses it): ModelRunner.copy_blocks reads these
    restore: tuple = ()


def _flat_pairs(pairs) -> list[int]:
    return [x for pair in pairs for x in pair]


def encode(msg: StepMessage) -> tuple[torch.Tensor, torch.Tensor]:
    """The header and the flat payload of a message (CPU int64)."""
    s = msg.inputs or StepInputs([], [], [], [], [], [], [])
    tables = [b for table in s.block_tables for b in table]
    header = [msg.op, len(s.token_ids), len(s.context_lens), len(tables), len(s.logits_rows),
              len(msg.copies), len(msg.swap_out), len(msg.swap_in)]
    payload = (s.token_ids + s.positions + s.slot_mapping + s.context_lens + s.query_lens
               + [len(t) for t in s.block_tables] + tables + s.logits_rows
               + _flat_pairs(msg.copies) + _flat_pairs(msg.swap_out) + _flat_pairs(msg.swap_in))
    return torch.tensor(header, dtype=torch.long), torch.tensor(payload, dtype=torch.long)


def _pairs(flat: list[int]) -> list[tuple[int, int]]:
    return list(zip(flat[0::2], flat[1::2]))


def decode(header: torch.Tensor, payload: torch.Tensor) -> StepMessage:
    """The message :func:`encode` made: the lists cut back out of the payload."""
    op, tokens, seqs, entries, rows, copies, swap_out, swap_in = header.tolist()
    values = iter(payload.tolist())
    take = lambda n: [next(values) for _ in range(n)]  # noqa: E731
    ids, positions, slot_mapping = take(tokens), take(tokens), take(tokens)
    context_lens, query_lens, table_lens = take(seqs), take(seqs), take(seqs)
    flat_tables = take(entries)
    starts = [0, *itertools.accumulate(table_lens)]
    tables = [flat_tables[a:a + n] for a, n in zip(starts, table_lens)]
    inputs = StepInputs(ids, positions, slot_mapping, tables, context_lens, query_lens, take(rows)) if tokens else None
    return StepMessage(op, inputs, _pairs(take(2 * copies)), _pairs(take(2 * swap_out)), _pairs(take(2 * swap_in)))


def send(msg: StepMessage, group, timeout: datetime.timedelta | None = None) -> float:
    """Rank 0: broadcast ``msg`` to every rank of ``group`` (each part waits at most ``timeout`` for a rank that
    is not receiving: gloo sends only once the receiver is there); returns the seconds it took."""
    start = time.perf_counter()
    header, payload = encode(msg)
    for part in (header, payload) if payload.numel() else (header,):
        work = dist.broadcast(part, src=0, group=group, async_op=True)
        work.wait() if timeout is None else work.wait(timeout)
    return time.perf_counter() - start


def receive(group) -> StepMessage:
    """The other ranks: wait for rank 0's next message (as long as rank 0 lives)."""
    header = torch.empty(HEADER, dtype=torch.long)
    dist.broadcast(header, src=0, group=group)
    size = (3 * header[1] + 3 * header[2] + header[3] + header[4] + 2 * header[5:].sum()).item()
    payload = torch.empty(size, dtype=torch.long)
    if size:
        dist.broadcast(payload, src=0, group=group)
    return decode(header, payload)
