"""The KV link between the prefill and the decode worker: a two-rank ``torch.distributed`` group (chapter 16).

Rank 0 is the prefill worker, rank 1 the decode worker. They meet on the
front's ``TCPStore`` (127.0.0.1, a free port) under one prefix per *epoch*:
when the front restarts a worker, both sides form a fresh group under the
next epoch, so nothing of a dead peer's group is reused.

What is small goes through the store: each side's fingerprint (the
handshake) and one header per transfer (request id, prompt, sampling
params, first token, the seeded generator's state, the payload's shape)
under ``xfer/<k>``, which the decode worker polls for between its steps (a
gloo receive cannot be polled). Both are JSON signed with the launch's
secret (:class:`~minivllm.distributed.rendezvous.Signer`): the store is a
socket, so nothing read from it is unpickled, and a value this launch did
not sign (forged, or an earlier epoch's) is refused: :class:`BadSignature`,
which the worker reports in one line before both sides form the link again
under a new epoch. What is large, the prompt's KV (:func:`minivllm.kv_transfer.kv_bytes`
of it), goes over the group as one tensor, and the decode worker answers
over the group with one integer: :data:`ACK_OWNED` (it holds the copy now)
or :data:`ACK_EMPTY` (the request was aborted; nothing kept). Every wait is
bounded by the link's timeout; a peer that dies closes its socket, so the
other side's send or receive fails at once.

The group is gloo, on CPU tensors (a CUDA pool is staged through host
memory), bound to the loopback interface. NCCL would need the two workers on two GPUs; it is not built here.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minivllm.distributed.rendezvous import LOOPBACK, BadSignature, Signer, gloo_device
from minivllm.kv_transfer import check_fingerprints

__all__ = ["PREFILL", "DECODE", "ACK_OWNED", "ACK_EMPTY", "LinkError", "BadSignature", "KVLink", "open_link",
           "presence_store"]

PREFILL, DECODE = 0, 1  # ranks
ACK_OWNED, ACK_EMPTY = 1, 0


class LinkError(RuntimeError):
    """The peer did not answer in time or its process is gone: the link must be formed again."""


@dataclass(eq=False)
class KVLink:
    """One side of an epoch's two-rank group, with its transfer counters."""

    store: object
    group: object
    rank: int
    epoch: int
    timeout: datetime.timedelta
    signer: Signer
    next_key: int = 0  # the next transfer's index (sent, on the prefill side; expected, on the decode side)
    bytes_sent: int = 0
    bytes_received: int = 0
    transfers: int = 0
    empty_acks: int = 0

    def handshake(self, fingerprint: dict, timeout: float, check=check_fingerprints) -> None:
        """Swap fingerprints through the store; ``check(prefill, decode)`` refuses a different KV layout.

        Only a value signed by this launch reaches ``check`` (the handoff's, chapter 16's exercise)."""
        mine, other = f"fingerprint{self.rank}", f"fingerprint{1 - self.rank}"
        self.store.set(mine, self.signer.pack(self._signed(mine), fingerprint))
        self.store.wait([other], datetime.timedelta(seconds=timeout))
        theirs = self.signer.unpack(self._signed(other), self.store.get(other))
        prefill, decode = (fingerprint, theirs) if self.rank == PREFILL else (theirs, fingerprint)
        check(prefill, decode)

    def _signed(self, key: str) -> str:
        """What a value's signature covers: its key and the epoch (a value from an earlier epoch is refused)."""
        return f"epoch{self.epoch}/{key}"

    def _wait(self, op, what: str) -> None:
        """Start ``op`` (a send or receive) and wait for it, at most the link's timeout."""
        try:
            op().wait(self.timeout)
        except RuntimeError as e:
            raise LinkError(f"KV link epoch {self.epoch}: {what} failed ({str(e).splitlines()[0][:200]})") from e

    def send_kv(self, header: dict, kv: torch.Tensor, posted=lambda: None) -> int:
        """Prefill side: post the header, send the KV, wait for the ack; returns it (ACK_OWNED or ACK_EMPTY).

        ``posted`` runs between the header and the KV (the tests inject a crash there).
        """
        k, self.next_key = self.next_key, self.next_key + 1
        payload = kv.detach().to("cpu").contiguous()
        header = {**header, "shape": tuple(payload.shape), "dtype": str(payload.dtype).removeprefix("torch.")}
        ack = torch.zeros(1, dtype=torch.long)
        self.store.set(f"xfer/{k}", self.signer.pack(self._signed(f"xfer/{k}"), header))
        posted()
        self._wait(lambda: self.group.send([payload], DECODE, k), "sending the KV")
        self.bytes_sent += payload.numel() * payload.element_size()
        self._wait(lambda: self.group.recv([ack], DECODE, k), "waiting for the ack")
        self.transfers += 1
        self.empty_acks += int(ack) == ACK_EMPTY
        return int(ack)

    def poll_kv(self) -> tuple[int, dict, torch.Tensor] | None:
        """Decode side: the next transfer (its index, header and KV), or None if none was posted yet.

        A header this launch did not sign raises :class:`BadSignature` (the link cannot be trusted any more)."""
        k = self.next_key
        if not self.store.check([f"xfer/{k}"]):
            return None
        data = self.store.get(f"xfer/{k}")
        self.store.delete_key(f"xfer/{k}")
        header = self.signer.unpack(self._signed(f"xfer/{k}"), data)  # BadSignature: the link is formed again
        self.next_key += 1
        kv = torch.empty(header["shape"], dtype=getattr(torch, header["dtype"]))
        self._wait(lambda: self.group.recv([kv], PREFILL, k), "receiving the KV")
        self.bytes_received += kv.numel() * kv.element_size()
        return k, header, kv

    def ack(self, k: int, value: int) -> None:
        """Decode side: tell the prefill worker whether it now owns transfer ``k``'s copy."""
        self._wait(lambda: self.group.send([torch.tensor([value], dtype=torch.long)], PREFILL, k), "acknowledging")
        self.transfers += 1
        self.empty_acks += value == ACK_EMPTY

    def counters(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received, "transfers": self.transfers,
                "empty_acks": self.empty_acks, "epoch": self.epoch}


def presence_store(port: int, timeout: float):
    """A client of the front's store, where each side of an epoch says it is there before they form the group."""
    return dist.TCPStore(LOOPBACK, port, None, False, timeout=datetime.timedelta(seconds=timeout))


def open_link(port: int, rank: int, epoch: int, join_timeout: float, timeout: float, secret: bytes) -> KVLink:
    """Join epoch ``epoch``'s two-rank gloo group on the front's store (both on 127.0.0.1).

    The peer may take ``join_timeout`` seconds to arrive (a restarted worker
    loads its model first); each transfer's send, receive and ack then waits
    at most ``timeout`` seconds. ``secret`` signs and checks what goes
    through the store.
    """
    join = datetime.timedelta(seconds=join_timeout)
    store = dist.TCPStore(LOOPBACK, port, None, False, timeout=join)
    prefixed = dist.PrefixStore(f"epoch{epoch}/", store)
    options = dist.ProcessGroupGloo._Options()
    options._devices, options._timeout = [gloo_device()], join
    group = dist.ProcessGroupGloo(prefixed, rank, 2, options)
    return KVLink(prefixed, group, rank, epoch, datetime.timedelta(seconds=timeout), Signer(secret))
