"""The ownership rule of the KV handoff, and the handshake's check (chapter 16): :class:`KVHandoff`.

The prefill worker holds a finished prompt's blocks while their KV travels to
the decode worker. :meth:`KVHandoff.transfer` says when they are freed: on
the ack (``ACK_OWNED``: the decode worker holds its copy; ``ACK_EMPTY``: the
request was aborted in flight and it kept nothing), or when the link fails
(no ack within ``kv_transfer_timeout``, or a dead peer), and then the request
fails. :meth:`KVHandoff.check_fingerprints` refuses, when the workers meet, a
peer whose KV blocks would mean something else. It is an extension point
(``EngineConfig.kv_handoff_cls``, exercise 16); the link itself (the signed
headers, the KV, the ack) stays :mod:`minivllm.disaggregation.link`'s.
"""

from __future__ import annotations

from minivllm.disaggregation.link import LinkError
from minivllm.kv_transfer import check_fingerprints

__all__ = ["KVHandoff"]


class KVHandoff:
    """minivllm's rule: the blocks stay held until the decode worker answers, and are freed exactly once."""

    def transfer(self, request_id: str, send, release, fail) -> int | None:
        """Hand ``request_id``'s held KV to the decode worker; returns the ack, or None if the transfer failed.

        ``send()`` posts the header, sends the KV and waits for the ack; it
        returns ACK_OWNED or ACK_EMPTY, or raises :class:`LinkError` (no ack
        within the timeout, or the peer is gone). ``release()`` frees the
        blocks held for the request, ``fail(error)`` ends it with
        finish_reason "error".
        """
        try:
            ack = send()
        except LinkError as e:  # nobody else will ever free them, and nobody will decode the request
            release()
            fail(e)
            return None
        release()  # owned: the decode worker has its copy; empty: it kept nothing (aborted in flight)
        return ack

    def check_fingerprints(self, prefill: dict, decode: dict) -> None:
        """Refuse two workers whose KV layouts differ, naming the first field that does (a ValueError)."""
        check_fingerprints(prefill, decode)
