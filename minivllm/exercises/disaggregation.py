"""Chapter 16, prefill/decode disaggregation: the check of the reader's KV handoff, a class with
``transfer(request_id, send, release, fail)`` (when the prefill worker frees a transfer's blocks) and
``check_fingerprints(prefill, decode)`` (the handshake's refusal), on fakes of each outcome of a transfer,
through the real signed handshake, and then inside the live disaggregated engine (``kv_handoff_cls``).
"""

from __future__ import annotations

import copy
import datetime
import json
import re
import threading
import time

import torch.distributed as dist

from minivllm.disaggregation.front import ROLES
from minivllm.disaggregation.link import ACK_EMPTY, ACK_OWNED, DECODE, PREFILL, KVLink, LinkError, presence_store
from minivllm.distributed.rendezvous import Signer, loopback_store
from minivllm.engine import LLM
from minivllm.exercises._common import require_written, say
from minivllm.exercises.live import _reference, chat_prompts, greedy, spawnable
from minivllm.kv_transfer import FINGERPRINT_FIELDS
from minivllm.models import load_tokenizer

__all__ = ["check_kv_handoff", "FINGERPRINT", "METHODS"]

METHODS = ("transfer", "check_fingerprints")  # what exercise 16 writes

# what fingerprint() gives for SmolLM2 in float32, and for each field another engine's value
FINGERPRINT = {"model": "smollm2-135m", "dtype": "float32", "layers": 30, "kv_heads": 3, "head_dim": 64,
               "block_size": 16}
OTHER = {"model": "my-smollm2-finetune", "dtype": "bfloat16", "layers": 32, "kv_heads": 5, "head_dim": 32,
         "block_size": 8}
WHY = {
    "model": "two checkpoints can share every shape (a fine-tune has its base model's): the decode worker would go "
             "on from another model's KV, and write nonsense without any error",
    "dtype": "the decode worker would convert the bfloat16 KV into its float32 pool without a word (start_decode "
             "copies with .to()): rounded values, tokens that differ from one engine's, other bytes per token",
    "layers": "the KV carries one slice per layer: a pool with another number of layers cannot hold it",
    "kv_heads": "every token's K and V hold one vector per KV head: another head count is another shape",
    "head_dim": "every KV head's vector has head_dim values: another head_dim is another shape",
    "block_size": "the KV travels in whole blocks: the prefill's 16-token blocks are two of the decode's 8-token "
                  "blocks, so the block tables would not line up",
}
TIMEOUT = LinkError("KV link epoch 0: waiting for the ack failed (Timed out waiting 3000ms for recv operation)")
DEAD_PEER = LinkError("KV link epoch 0: sending the KV failed (Connection closed by peer [127.0.0.1]:41234)")
OUTCOMES = [  # (what the decode worker does, what send() gives)
    ("acknowledges the KV (ACK_OWNED: it holds its copy now)", ACK_OWNED),
    ("answers with an empty ack (ACK_EMPTY: the request was aborted while its KV was in flight, and it kept "
     "nothing)", ACK_EMPTY),
    ("never answers (send() raises LinkError after kv_transfer_timeout)", TIMEOUT),
    ("dies in the middle of the send (send() raises LinkError: its socket closed)", DEAD_PEER),
]
LIVE_TIMEOUT = 3.0  # kv_transfer_timeout of the live engine (the fault sleeps twice as long)
LIVE_WAIT = 90.0  # seconds a live request may take before the check calls it stuck


class _Transfer:
    """One transfer as the handoff sees it: ``send`` answers as the decode worker would; every call is recorded."""

    def __init__(self, outcome):
        self.outcome, self.held, self.events, self.errors = outcome, True, [], []

    def send(self):
        self.events.append("send" if self.held else "send after release")
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def release(self) -> int:
        self.events.append("release")
        freed, self.held = (3 if self.held else 0), False
        return freed

    def fail(self, error) -> None:
        self.events.append("fail")
        self.errors.append(error)

    def count(self, event: str) -> int:
        return sum(e.startswith(event) for e in self.events)


def _run_transfer(handoff, outcome, what: str) -> tuple[_Transfer, object]:
    t = _Transfer(outcome)
    try:
        got = handoff.transfer("r1", t.send, t.release, t.fail)
    except LinkError as e:
        raise AssertionError(f"{what}: transfer let the LinkError out ({e}); a timeout or a dead peer is one of the "
                             "transfer's outcomes, not a crash (the prefill worker would die of it): catch it, free "
                             "the blocks and fail the request") from None
    except Exception as e:
        raise AssertionError(f"{what}: transfer raised {type(e).__name__}: {e}") from e
    return t, got


def _blocks_rule(t: _Transfer, outcome, what: str) -> None:
    """The blocks: held while the KV travels, freed exactly once afterwards, whatever the outcome."""
    sends = t.count("send")
    if sends != 1:
        raise AssertionError(f"{what}: send() was called {sends} times; call it once: " + (
            "without it the KV never leaves and the request never gets past its first token" if sends == 0 else
            "a second send posts a second header for the same request"))
    if "send after release" in t.events:
        raise AssertionError(f"{what}: the blocks were freed before the decode worker acknowledged them (release() "
                             "came before send() returned); until the ack the KV is still on its way (a decode worker "
                             "that reads the blocks in place, over RDMA, would read freed blocks that another request "
                             "may already hold), and if the send then fails the blocks are freed a second time: "
                             "free them only once send() has returned the ack or raised")
    releases = t.count("release")
    if releases == 0:
        after = ("the ack: the decode worker holds its copy now, so the prefill side's blocks are yours to free"
                 if outcome == ACK_OWNED else
                 "an empty ack: the decode worker kept nothing and will never take them, so free them"
                 if outcome == ACK_EMPTY else
                 "the failed transfer: no ack will ever come (the front restarts the decode worker), so nothing "
                 "else frees them")
        raise AssertionError(f"{what}: the blocks are still held after {after} (release()); every such transfer "
                             "leaks its prompt's blocks until the prefill worker's pool is full")
    if releases > 1:
        raise AssertionError(f"{what}: release() was called {releases} times for one transfer: free the blocks "
                             "exactly once (freeing a block twice hands it to two owners; here the second call "
                             "found nothing held)")


def _outcome_rule(t: _Transfer, outcome, got, what: str) -> None:
    """What the request becomes: the decode worker's (the ack, returned) or failed (fail, None)."""
    failed = isinstance(outcome, Exception)
    fails = t.count("fail")
    if not failed and fails:
        raise AssertionError(f"{what}: fail() was called, but the transfer " + (
            "succeeded" if outcome == ACK_OWNED else "ended normally: an empty ack answers the front's abort, it is "
                                                     "not an error") + "; call fail() only when send() raised")
    if failed and fails != 1:
        raise AssertionError(f"{what}: fail() was called {fails} times; call it once: " + (
            "without it nobody tells the front the request ended, so it waits forever" if fails == 0 else
            "one request, one failure"))
    if failed and t.events.index("fail") < t.events.index("release"):
        raise AssertionError(f"{what}: fail() came before release(): the request's error message says whether the "
                             "prefill worker's blocks are free, and when fail() was called they were still held; "
                             "free them first (release()), then fail(error), so the request ends with nothing held")
    if failed and str(outcome) not in str(t.errors[0]):
        raise AssertionError(f"{what}: fail({t.errors[0]!r}): pass the LinkError itself (its text says what went "
                             "wrong: a timeout or a dead peer; the request's error message quotes it)")
    if failed and got is not None:
        raise AssertionError(f"{what}: transfer returned {got!r}; the transfer failed, so there is no ack: return "
                             "None")
    if not failed and (got != outcome or isinstance(got, bool)):
        names = {ACK_OWNED: "ACK_OWNED", ACK_EMPTY: "ACK_EMPTY"}
        hint = ("an empty ack treated as owned: the decode worker kept nothing, and the front must not count the "
                "request as the decode worker's" if outcome == ACK_EMPTY and got == ACK_OWNED else
                "return the ack send() returned")
        raise AssertionError(f"{what}: transfer returned {got!r}, expected {names[outcome]} ({outcome}); {hint}")


def _check_transfer(handoff) -> int:
    for does, outcome in OUTCOMES:
        what = f"transfer('r1', send, release, fail) when the decode worker {does}"
        t, got = _run_transfer(handoff, outcome, what)
        _blocks_rule(t, outcome, what)
        _outcome_rule(t, outcome, got, what)
    return len(OUTCOMES)


def _call_check(handoff, prefill: dict, decode: dict, what: str) -> Exception | None:
    """The reader's check_fingerprints called: its ValueError (a refusal), or None; anything else fails the check."""
    try:
        handoff.check_fingerprints(prefill, decode)
    except ValueError as e:
        return e
    except Exception as e:
        raise AssertionError(f"{what}: check_fingerprints raised {type(e).__name__}: {e}; refuse with a ValueError "
                             "(minivllm.config.check raises one): the worker turns a ValueError into the engine's "
                             "refusal to start, naming the field (an assert also vanishes under python -O)") from e
    return None


def _named(message: str, field: str) -> bool:
    return re.search(rf"\b{field}\b", message) is not None


def _check_refusals(handoff) -> int:
    """Equal fingerprints (fresh copies, keys in another order) pass; one field changed, on either side, is refused
    with a ValueError that names that field and no other."""
    same = json.loads(json.dumps(dict(reversed(list(FINGERPRINT.items())))))  # what arrives through the store
    refused = _call_check(handoff, copy.deepcopy(FINGERPRINT), same, "two equal fingerprints")
    if refused is not None:
        raise AssertionError(f"check_fingerprints refused two equal fingerprints ({FINGERPRINT}; the decode worker's "
                             f"came through JSON, in another key order): {refused}; compare each field's values with "
                             "==, whatever the order of the keys")
    cases = 1
    for field in FINGERPRINT_FIELDS:
        for side in ("decode", "prefill"):
            changed = {**FINGERPRINT, field: OTHER[field]}
            prefill, decode = (FINGERPRINT, changed) if side == "decode" else (changed, FINGERPRINT)
            what = f"the {side} worker's {field} is {OTHER[field]!r}, the other's {FINGERPRINT[field]!r}"
            refused = _call_check(handoff, dict(prefill), dict(decode), what)
            if refused is None:
                raise AssertionError(f"check_fingerprints accepted two workers whose KV layouts differ: {what}; "
                                     f"{WHY[field]}")
            others = [f for f in FINGERPRINT_FIELDS if f != field and _named(str(refused), f)]
            if not _named(str(refused), field) or others:
                raise AssertionError(f"{what}: refused with {str(refused)!r}, which does not name {field!r}"
                                     + (f" alone (it names {others} too)" if others else "")
                                     + "; name the field that differs, so whoever starts the two engines knows "
                                       "which option to change")
            cases += 1
    return cases


def _check_handshake(handoff, field: str = "block_size") -> None:
    """The real handshake (signed JSON through a loopback TCPStore, both sides at once) calls the reader's check."""
    timeout = datetime.timedelta(seconds=20)
    server, signer = loopback_store(None, timeout), Signer()
    fingerprints = {PREFILL: FINGERPRINT, DECODE: {**FINGERPRINT, field: OTHER[field]}}
    results = {}

    def meet(rank: int) -> None:
        store = dist.PrefixStore("epoch0/", presence_store(server.port, 20.0))
        link = KVLink(store, None, rank, 0, timeout, signer)
        try:
            link.handshake(fingerprints[rank], 20.0, handoff.check_fingerprints)
            results[rank] = None
        except Exception as e:  # noqa: BLE001 (reported below, per side)
            results[rank] = e

    threads = [threading.Thread(target=meet, args=(rank,), daemon=True) for rank in ROLES]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for rank, name in ROLES.items():
        got = results.get(rank, "no answer within 30 s")
        if not isinstance(got, ValueError) or not _named(str(got), field):
            raise AssertionError(f"the handshake of two workers whose {field} differs ({FINGERPRINT[field]} and "
                                 f"{OTHER[field]}), signed through the store as the workers do: the {name} side "
                                 f"got {got!r}, expected your check's ValueError naming {field}")


def _requests(n: int = 4, max_tokens: int = 8):
    prompts = chat_prompts(load_tokenizer("tiny-random"), n, note_words=(20, 40))
    return [(f"r{i}", p, greedy(max_tokens)) for i, p in enumerate(prompts)]


def _finish(engine, rids: set[str], what: str) -> dict:
    """Step the front until every request in ``rids`` finished (bounded); their last outputs."""
    last, deadline = {}, time.monotonic() + LIVE_WAIT
    while set(last) != rids:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: requests {sorted(rids - set(last))} did not finish within {LIVE_WAIT:.0f} "
                                 "s: they hang (a transfer that neither returned an ack nor failed its request)")
        for out in engine.step():
            if out.finished and out.request_id in rids:
                last[out.request_id] = out
    return last


def _assert_clean(engine, when: str) -> None:
    """Both workers: block invariants, nothing held or unfinished, every block free."""
    for name, s in engine.worker_stats(timeout=LIVE_WAIT).items():
        if s["invariants"] != "ok":
            raise AssertionError(f"{when}: the {name} worker's blocks are inconsistent: {s['invariants']}")
        if s["held"]:
            raise AssertionError(f"{when}: the {name} worker still holds the blocks of {s['held']} request(s): a "
                                 "transfer that never freed them (a leak)")
        used = s["engine"].num_used_blocks
        if used or s["unfinished"]:
            raise AssertionError(f"{when}: the {name} worker has {s['unfinished']} unfinished requests and {used} "
                                 "blocks in use (a leak)")


def _check_live(cls) -> str:
    options = dict(device="cpu", dtype="float32", num_blocks=96, block_size=16)
    requests = _requests()
    expected, _, _ = _reference("tiny-random", options, requests)  # one engine, one process
    what = "your handoff in the live disaggregated engine (tiny-random)"
    with LLM("tiny-random", disaggregated=True, kv_handoff_cls=spawnable(cls, "your handoff class"),
             kv_transfer_timeout=LIVE_TIMEOUT, **options) as llm:
        engine = llm.engine
        used = {ROLES[r]: i.get("handoff") for r, i in engine.info.items()}
        if set(used.values()) != {cls.__name__}:
            raise AssertionError(f"{what}: the workers run the handoffs {used}, not {cls.__name__}")
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        outs = _finish(engine, {rid for rid, _, _ in requests}, what)
        for rid, want in expected.items():
            out = outs[rid]
            if out.error or out.outputs[0].token_ids != want:
                busy = (f" (on a very busy machine a transfer can miss the {LIVE_TIMEOUT:.0f} s timeout: if your "
                        "targeted cases passed, run the check again)") if "Timed out" in (out.error or "") else ""
                raise AssertionError(f"{what}: request {rid} " + (f"failed: {out.error}{busy}" if out.error else
                                     f"gave {out.outputs[0].token_ids}, one engine {want}"))
        _assert_clean(engine, f"{what}, after {len(requests)} requests")
        engine.inject_fault("decode", "decode:before_ack", 2 * LIVE_TIMEOUT)  # silent past the timeout
        engine.add_request("slow-ack", requests[0][1], requests[0][2])
        out = _finish(engine, {"slow-ack"}, f"{what}, no ack within kv_transfer_timeout")["slow-ack"]
        if out.outputs[0].finish_reason != "error" or "freed the request's blocks" not in (out.error or ""):
            raise AssertionError(f"{what}: a request whose ack never came ended with finish_reason "
                                 f"{out.outputs[0].finish_reason!r} and error {out.error!r}; expected 'error', with "
                                 "the prefill worker's blocks freed")
        _assert_clean(engine, f"{what}, after a transfer that timed out (the decode worker restarted)")
    return f"{len(requests)} requests, then one without an ack within {LIVE_TIMEOUT:.0f} s"


def check_kv_handoff(cls, live: bool = True) -> None:
    """Check a KV handoff class: ``transfer(request_id, send, release, fail)`` and ``check_fingerprints(prefill,
    decode)`` (chapter 16).

    First ``transfer`` against a fake of each outcome (an ack, an empty ack,
    a timeout, a dead peer): the blocks stay held until send() returns or
    raises and are freed exactly once, a failed transfer fails its request,
    the ack is returned. Then ``check_fingerprints`` on equal fingerprints and
    on each field changed on either side, and once through the real signed
    handshake; the first failure stops the check. Then, unless
    ``live=False``, the live disaggregated engine (``kv_handoff_cls=cls``,
    tiny-random) must give one engine's greedy tokens with no block left
    held or used in either worker, also after a transfer whose ack never
    comes (the request fails, its blocks freed). A class that does not define
    both methods itself is "not written yet".
    """
    require_written(cls, METHODS)
    handoff = cls()
    outcomes = _check_transfer(handoff)
    fields = _check_refusals(handoff)
    _check_handshake(handoff)
    say(f"check_kv_handoff: the blocks are held until the ack and freed once on each of {outcomes} outcomes (ack, "
          f"empty ack, timeout, dead peer), a failed transfer fails its request, and {fields} fingerprint pairs are "
          "accepted or refused by the field that differs (also through the signed handshake).")
    if not live:
        return
    done = _check_live(cls)
    say(f"check_kv_handoff: the live disaggregated engine with your handoff ({done}) gave one engine's greedy "
          "tokens, failed the timed-out request with its blocks freed, and left no block held or used in either "
          "worker.")
