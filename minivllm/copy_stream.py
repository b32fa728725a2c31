"""Swap copies between the device KV pool and pinned host memory, off the compute stream (chapters 10 and 12).

On CUDA a swap copies each block of each layer with an asynchronous copy
(``non_blocking=True`` from or to pinned memory, a ``cudaMemcpyAsync``) on a
side stream, and two waits order it against the compute stream, which runs
the forwards:

1. the side stream first waits for the compute stream: the blocks' keys and
   values were written by forwards queued before the swap;
2. the compute stream then waits for the copy's event before its next
   kernel. This is the rule that keeps a swapped-out block safe: the scheduler
   may hand that block to another sequence in the very step that swaps it
   out, and the step's forward writes into it only after the event, when the
   copy has read it. A swapped-in block is likewise read only once it has
   arrived.

The host never waits: both waits are between streams, so scheduling the next
step overlaps the copies. On the CPU a swap is an ordinary synchronous copy.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["BlockCopier"]


class BlockCopier:
    """Runs a swap's block copies on ``side_stream`` and makes ``compute_stream`` wait for them (see module doc).

    On CUDA both streams default to a new side stream and the device's
    current stream; tests pass stand-ins that record the calls, which runs
    the same ordering code on the CPU. Without either it is synchronous
    (``asynchronous`` is False) and :meth:`swap` is never called.
    """

    def __init__(self, device: torch.device, side_stream=None, compute_stream=None):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.side_stream = side_stream if side_stream is not None else (torch.cuda.Stream(self.device) if cuda else None)
        self.compute_stream = compute_stream
        self.asynchronous = self.side_stream is not None
        self.last_event = None  # the event of the latest swap: a block it copies is reused only after it

    def _compute(self):
        return self.compute_stream if self.compute_stream is not None else torch.cuda.current_stream(self.device)

    def _on_side_stream(self):
        if isinstance(self.side_stream, torch.cuda.Stream):
            return torch.cuda.stream(self.side_stream)
        return contextlib.nullcontext()

    def swap(self, pools, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        """Copy whole blocks of every ``(device pool, cpu pool)``: ``(device, cpu)`` pairs out or ``(cpu, device)`` in.

        Pools are ``[layers, blocks, ...]``; each layer's block is one
        contiguous run, so every copy is a single asynchronous memcpy.
        """
        compute = self._compute()
        self.side_stream.wait_stream(compute)  # rule 1: the keys were written by earlier forwards
        with self._on_side_stream():
            for dev, cpu in pools:
                for layer in range(dev.shape[0]):
                    for src, dst in pairs:
                        if to_cpu:
                            cpu[layer, dst].copy_(dev[layer, src], non_blocking=True)
                        else:
                            dev[layer, dst].copy_(cpu[layer, src], non_blocking=True)
            event = self.side_stream.record_event()
        compute.wait_event(event)  # rule 2: nothing after this swap touches its blocks before the copies end
        self.last_event = event
