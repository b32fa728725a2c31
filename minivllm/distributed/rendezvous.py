"""Where the processes of one launch meet, and how they know each other's messages (chapters 15 and 16).

Three rules, each closing a hole a hostile local process could use:

- **Loopback only.** ``TCPStore("127.0.0.1", ...)`` names the address its
  *clients* dial; its server listens on every interface all the same. So
  :func:`loopback_store` binds a socket to 127.0.0.1 itself and hands the store
  that socket. Gloo binds its own sockets to the address the machine's
  hostname resolves to (often a LAN address): :func:`gloo_device` and
  :func:`loopback_gloo` pin it to the loopback interface.
- **Data, not code.** What travels through the store is JSON, never a pickle
  (``pickle.loads`` on bytes from a socket runs whatever the sender chose).
- **Signed.** Every value is signed with HMAC-SHA256 under a random secret made
  per launch (:class:`Signer`); the secret reaches the workers through their
  spawn arguments (an anonymous pipe), never through a socket. A value without
  the right signature is refused.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import json
import os
import secrets
import socket

import torch.distributed as dist

__all__ = ["LOOPBACK", "loopback_store", "gloo_device", "loopback_interface", "loopback_gloo", "Signer",
           "BadSignature"]

LOOPBACK = "127.0.0.1"


def loopback_store(world_size: int | None, timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore server listening on 127.0.0.1 only, at a free port (``store.port``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return dist.TCPStore(LOOPBACK, port, world_size, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())  # the store owns the listening socket from here


def gloo_device():
    """Gloo's transport device on the loopback address (for a ``ProcessGroupGloo`` built by hand)."""
    return dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)


def loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), names[0] if names else "lo")


@contextlib.contextmanager
def loopback_gloo():
    """Gloo groups created inside bind to the loopback interface (``init_process_group`` takes no device)."""
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = before


class BadSignature(ValueError):
    """A value in the store that this launch did not write (or that was changed): it is refused, never read."""


class Signer:
    """JSON values signed with HMAC-SHA256 under one launch's secret: ``pack`` to store, ``unpack`` to read."""

    def __init__(self, secret: bytes | None = None):
        self.secret = secrets.token_bytes(32) if secret is None else bytes(secret)

    def _tag(self, key: str, body: bytes) -> str:
        return hmac.new(self.secret, key.encode() + b"\0" + body, hashlib.sha256).hexdigest()

    def pack(self, key: str, value) -> bytes:
        """``value`` (JSON data) as the bytes to store under ``key``: its signature, a newline, the JSON."""
        body = json.dumps(value, separators=(",", ":")).encode()
        return self._tag(key, body).encode() + b"\n" + body

    def unpack(self, key: str, data: bytes):
        """The value stored under ``key``; :class:`BadSignature` unless this launch's secret signed it there."""
        tag, sep, body = bytes(data).partition(b"\n")
        if not sep or not hmac.compare_digest(tag, self._tag(key, body).encode()):
            raise BadSignature(f"the value under {key!r} is not signed by this launch: refused")
        return json.loads(body)
