"""Chapter 16: a reader's KV handoff (transfer, check_fingerprints), plugged in as EngineConfig.kv_handoff_cls."""

import pytest

from minivllm.config import check
from minivllm.disaggregation.handoff import KVHandoff
from minivllm.disaggregation.link import ACK_EMPTY, ACK_OWNED, LinkError
from minivllm.exercises import check_kv_handoff
from minivllm.exercises.disaggregation import _check_live, _check_refusals, _check_transfer
from minivllm.kv_transfer import FINGERPRINT_FIELDS

from exercise_cases import Check


class MyHandoff:
    """The solution notebook's answer."""

    def transfer(self, request_id, send, release, fail):
        try:
            ack = send()
        except LinkError as error:
            release()
            fail(error)
            return None
        release()
        return ack

    def check_fingerprints(self, prefill, decode):
        for name in FINGERPRINT_FIELDS:
            check(prefill[name] == decode[name], name, f"the same on the prefill and decode workers "
                  f"({prefill[name]!r})", decode[name])


class FinallyHandoff(MyHandoff):
    """Another shape: the free in a finally, the failure after it; a hand-written ValueError for the first field that
    differs."""

    def transfer(self, request_id, send, release, fail):
        failed = None
        try:
            return send()
        except LinkError as error:
            failed = error
            return None
        finally:
            release()
            if failed is not None:
                fail(failed)

    def check_fingerprints(self, prefill, decode):
        differ = [k for k in FINGERPRINT_FIELDS if prefill[k] != decode[k]]
        if differ:
            raise ValueError(f"{differ[0]} differs: prefill {prefill[differ[0]]!r}, decode {decode[differ[0]]!r}")


class FailsBeforeFreeing(MyHandoff):
    """The issue's shape: the free in a finally, so fail(error) runs first, while the blocks are still held."""

    def transfer(self, request_id, send, release, fail):
        try:
            return send()
        except LinkError as error:
            fail(error)
            return None
        finally:
            release()


class FreesBeforeSending(MyHandoff):
    """The KV is read out of the pool first, so the blocks look free to go when the header is posted."""

    def transfer(self, request_id, send, release, fail):
        release()
        try:
            return send()
        except LinkError as error:
            release()
            fail(error)
            return None


class KeepsOnTimeout(MyHandoff):
    def transfer(self, request_id, send, release, fail):
        try:
            ack = send()
        except LinkError as error:
            fail(error)
            return None
        release()
        return ack


class FreesTwice(MyHandoff):
    """Frees on the error, then again on the way out."""

    def transfer(self, request_id, send, release, fail):
        ack = None
        try:
            ack = send()
        except LinkError as error:
            release()
            fail(error)
        release()
        return ack


class NeverFails(MyHandoff):
    def transfer(self, request_id, send, release, fail):
        try:
            ack = send()
        except LinkError:
            release()
            return None
        release()
        return ack


class LetsTheErrorOut(MyHandoff):
    def transfer(self, request_id, send, release, fail):
        ack = send()
        release()
        return ack


class EmptyAckAsOwned(MyHandoff):
    def transfer(self, request_id, send, release, fail):
        ack = super().transfer(request_id, send, release, fail)
        return None if ack is None else ACK_OWNED


class KeepsOnEmptyAck(MyHandoff):
    """Frees only when the decode worker took the KV."""

    def transfer(self, request_id, send, release, fail):
        try:
            ack = send()
        except LinkError as error:
            release()
            fail(error)
            return None
        if ack == ACK_OWNED:
            release()
        return ack


class FailsOnEmptyAck(MyHandoff):
    def transfer(self, request_id, send, release, fail):
        ack = super().transfer(request_id, send, release, fail)
        if ack == ACK_EMPTY:
            fail(LinkError("the decode worker refused the KV"))
        return ack


class IgnoresDtype(MyHandoff):
    """The decode worker converts the KV anyway (start_decode copies with .to), so the dtype looks harmless."""

    def check_fingerprints(self, prefill, decode):
        for name in FINGERPRINT_FIELDS:
            if name != "dtype":
                check(prefill[name] == decode[name], name, f"{prefill[name]!r}", decode[name])


class IgnoresModel(MyHandoff):
    """Only the shapes: the KV fits, so it looks fine."""

    def check_fingerprints(self, prefill, decode):
        for name in ("dtype", "layers", "kv_heads", "head_dim", "block_size"):
            check(prefill[name] == decode[name], name, f"{prefill[name]!r}", decode[name])


class IgnoresBlockSize(MyHandoff):
    def check_fingerprints(self, prefill, decode):
        for name in FINGERPRINT_FIELDS[:-1]:
            check(prefill[name] == decode[name], name, f"{prefill[name]!r}", decode[name])


class ComparesKeysOnly(MyHandoff):
    def check_fingerprints(self, prefill, decode):
        check(set(prefill) == set(decode), "fingerprint", f"the fields {sorted(prefill)}", sorted(decode))


class ComparesByIdentity(MyHandoff):
    def check_fingerprints(self, prefill, decode):
        for name in FINGERPRINT_FIELDS:
            check(prefill[name] is decode[name], name, f"{prefill[name]!r}", decode[name])


class NamesNoField(MyHandoff):
    def check_fingerprints(self, prefill, decode):
        if prefill != decode:
            raise ValueError("the prefill and decode workers' fingerprints differ")


class RefusesWithAssert(MyHandoff):
    def check_fingerprints(self, prefill, decode):
        for name in FINGERPRINT_FIELDS:
            assert prefill[name] == decode[name], f"{name} differs"


class LeaksOnTheAck(MyHandoff):
    """Frees only on a failure, never on an ack: what the live run shows on its own (the targeted cases skipped)."""

    def transfer(self, request_id, send, release, fail):
        try:
            return send()
        except LinkError as error:
            release()
            fail(error)
            return None


def test_minivllms_own_handoff_passes_the_targeted_cases():
    """KVHandoff, what the workers run by default (tests/test_disaggregation.py runs it live)."""
    assert _check_transfer(KVHandoff()) == 4 and _check_refusals(KVHandoff()) == 13


def test_the_live_run_sees_a_leak_in_the_workers():
    """The live half on its own: a handoff that never frees on the ack leaves held blocks in the prefill worker."""
    with pytest.raises(AssertionError, match=r"the prefill worker still holds the blocks of 4 request\(s\)"):
        _check_live(LeaksOnTheAck)


CHECKS = [Check("16", check_kv_handoff, [MyHandoff, FinallyHandoff], {
    "fails the request before freeing its blocks": (FailsBeforeFreeing, (
        r"fail\(\) came before release\(\)", "whether the prefill worker's blocks are free", "free them first")),
    "frees before the ack": (FreesBeforeSending, ("freed before the decode worker acknowledged", "ACK_OWNED")),
    "keeps the blocks on a timeout": (KeepsOnTimeout, ("still held after the failed transfer", "leaks",
                                                       "never answers")),
    "frees twice": (FreesTwice, ("release\\(\\) was called 2 times", "exactly once")),
    "never fails the request": (NeverFails, ("fail\\(\\) was called 0 times", "waits forever")),
    "lets the LinkError out": (LetsTheErrorOut, "let the LinkError out"),
    "empty ack as owned": (EmptyAckAsOwned, ("empty ack treated as owned", "returned 1, expected ACK_EMPTY")),
    "keeps the blocks on an empty ack": (KeepsOnEmptyAck, "still held after an empty ack"),
    "fails an aborted request": (FailsOnEmptyAck, ("fail\\(\\) was called", "not\\s+an error")),
    "ignores dtype": (IgnoresDtype, ("accepted two workers", "dtype is 'bfloat16'", "convert")),
    "ignores model": (IgnoresModel, ("accepted two workers", "model is", "fine-tune")),
    "ignores block_size": (IgnoresBlockSize, ("block_size is 8", "block tables")),
    "compares the keys only": (ComparesKeysOnly, "accepted two workers whose KV layouts differ"),
    "compares by identity": (ComparesByIdentity, ("refused two equal fingerprints", "==")),
    "names no field": (NamesNoField, ("does not name 'model'", "name the field that differs")),
    "refuses with assert": (RefusesWithAssert, ("raised AssertionError", "ValueError")),
}, passes="the live disaggregated engine")]
