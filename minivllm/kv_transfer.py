"""Moving a prefilled request's KV between two engines: read, hold, write, start decoding (chapter 16).

The engine-level half of prefill/decode disaggregation
(:mod:`minivllm.disaggregation` is the process half). On the prefill side a
request runs its prompt with ``max_tokens=1``; when it finishes, a
:func:`holding_scheduler` keeps its blocks (a holder sequence owns them) until
the transfer is acknowledged, then :func:`release` frees them. :func:`read_kv`
copies those blocks out of the pool. On the decode side :func:`start_decode`
allocates blocks, writes the KV and puts the request straight into the
running batch with its first token, so its next step is a decode.

The bytes of one transfer are :func:`kv_bytes`: ``2 x layers x KV heads x
head dim x dtype bytes x tokens``, the tokens rounded up to whole blocks. A
:func:`fingerprint` of the KV layout must match on both sides
(:func:`check_fingerprints` names the first field that differs).
"""

from __future__ import annotations

import dataclasses

import torch

from minivllm.config import cdiv, check
from minivllm.detokenizer import OutputText
from minivllm.engine import LLMEngine, Request
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceStatus

__all__ = ["FINGERPRINT_FIELDS", "fingerprint", "check_fingerprints", "kv_bytes", "holding_scheduler", "held",
           "release", "read_kv", "start_decode", "first_delta", "params_to_json", "params_from_json",
           "generator_state"]

FINGERPRINT_FIELDS = ("model", "dtype", "layers", "kv_heads", "head_dim", "block_size")
HOLD = (SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_STOPPED)  # ends whose KV is still good


def fingerprint(engine: LLMEngine) -> dict:
    """What must match for one engine's KV blocks to mean the same in another's pool."""
    c, kv = engine.model.config, engine.runner.kv_cache
    return {"model": engine.config.model, "dtype": str(kv.k.dtype).removeprefix("torch."),
            "layers": c.num_hidden_layers, "kv_heads": c.num_key_value_heads, "head_dim": engine.model.head_dim,
            "block_size": engine.config.block_size}


def check_fingerprints(mine: dict, theirs: dict) -> None:
    """Refuse a peer whose KV layout differs, naming the first field that does."""
    for name in FINGERPRINT_FIELDS:
        check(mine[name] == theirs[name], name, f"the same on the prefill and decode workers ({mine[name]!r})",
              theirs[name])


def kv_bytes(fp: dict, num_tokens: int, element_size: int) -> int:
    """Bytes of a prompt's KV: 2 (K and V) x layers x KV heads x head dim x dtype bytes x tokens in whole blocks."""
    tokens = cdiv(num_tokens, fp["block_size"]) * fp["block_size"]
    return 2 * fp["layers"] * fp["kv_heads"] * fp["head_dim"] * element_size * tokens


def holding_scheduler(base: type) -> type:
    """``base`` with one change: a sequence that ends normally leaves its blocks to a holder (the prefill side)."""

    class Holding(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.held: dict[str, Sequence] = {}  # request id -> the holder of its blocks until the ack

        @property
        def sequences(self) -> list[Sequence]:
            return super().sequences + list(self.held.values())

        def finish(self, seq: Sequence, status: SequenceStatus) -> None:
            if status in HOLD and seq.block_table and seq.index == 0:
                holder = Sequence(seq.request_id, seq.prompt_token_ids, seq.params)
                for block in seq.block_table:
                    self.block_manager.claim(block)
                holder.block_table, holder.cached_token_count = list(seq.block_table), seq.cached_token_count
                holder.generator = seq.generator  # a seeded request's random state goes on with it
                self.held[seq.request_id] = holder
            super().finish(seq, status)

    Holding.__name__ = Holding.__qualname__ = f"Holding{base.__name__}"
    return Holding


def held(engine: LLMEngine) -> dict[str, Sequence]:
    """The prefill side's held requests (request id -> holder), empty for an engine that does not hold."""
    return getattr(engine.scheduler, "held", {})


def release(engine: LLMEngine, request_id: str) -> int:
    """Free the blocks held for ``request_id`` (after the ack, a timeout or an abort); returns how many."""
    with engine.lock:
        holder = held(engine).pop(request_id, None)
        if holder is None:
            return 0
        n = len(holder.block_table)
        engine.block_manager.free(holder)
        return n


def read_kv(engine: LLMEngine, request_id: str) -> torch.Tensor:
    """A copy of the held request's KV: ``[2, layers, blocks, block_size, kv_heads, head_dim]`` (K then V)."""
    with engine.lock:
        holder = held(engine)[request_id]
        kv = engine.runner.kv_cache
        ids = torch.tensor(holder.block_table, dtype=torch.long, device=kv.k.device)
        return torch.stack([kv.k[:, ids], kv.v[:, ids]])


def params_to_json(params: SamplingParams) -> dict:
    """A request's sampling params as JSON data (what travels between processes: never a pickle)."""
    return dataclasses.asdict(params)


def params_from_json(data: dict) -> SamplingParams:
    """:func:`params_to_json`'s data back as validated ``SamplingParams`` (a ValueError names a bad field)."""
    check(isinstance(data, dict), "params", "a JSON object of SamplingParams fields", type(data).__name__)
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    check(set(data) <= fields, "params", f"fields among {sorted(fields)}", sorted(set(data) - fields))
    return SamplingParams(**data)


def generator_state(engine: LLMEngine, request_id: str) -> str | None:
    """The held request's seeded generator state (hex), so the decode side draws what one engine would."""
    g = held(engine)[request_id].generator
    return None if g is None else g.get_state().numpy().tobytes().hex()


def start_decode(engine: LLMEngine, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 first_token: int, kv: torch.Tensor, generator: str | None = None) -> bool:
    """Admit a prefilled request: blocks, its KV written, its first token appended, RUNNING. False: no blocks now.

    ``generator``: the prefill side's seeded generator state after the first token (:func:`generator_state`)."""
    with engine.lock:
        text, ids = engine.validate_request(request_id, list(prompt_ids), params)
        check(kv.shape[2] == engine.config.blocks_for(len(ids)), "kv", f"{engine.config.blocks_for(len(ids))} "
              f"blocks for a {len(ids)}-token prompt", tuple(kv.shape))
        seq = Sequence(request_id, ids, params.clone())
        if generator is not None:
            seq.generator = torch.Generator(device=engine.runner.device)
            seq.generator.set_state(torch.frombuffer(bytearray.fromhex(generator), dtype=torch.uint8))
        elif params.seed is not None:
            seq.generator = torch.Generator(device=engine.runner.device).manual_seed(params.seed)
        if not engine.block_manager.allocate(seq, len(ids)):
            return False
        pool = engine.runner.kv_cache
        blocks = torch.tensor(seq.block_table, dtype=torch.long, device=pool.k.device)
        pool.k[:, blocks], pool.v[:, blocks] = kv[0].to(pool.k), kv[1].to(pool.v)
        _enter_running(engine, seq, first_token, text)
        return True


def _enter_running(engine: LLMEngine, seq: Sequence, first_token: int, text: str | None) -> None:
    """The engine's records of a request whose prompt KV is written and whose first token is known."""
    seq.cached_token_count = seq.metrics.num_prefilled_tokens = seq.num_prompt_tokens
    seq.output_token_ids.append(first_token)
    seq.metrics.first_scheduled_time = seq.metrics.first_token_time = seq.metrics.arrival_time
    seq.metrics.token_times.append(seq.metrics.arrival_time)
    seq.metrics.num_output_tokens = 1
    seq.status = SequenceStatus.RUNNING
    engine.block_manager.register_computed_blocks(seq)
    out = OutputText(engine.tokenizer, seq.prompt_token_ids, seq.params.stop, seq.params.include_stop_str_in_output,
                     engine.detokenizer_cls)
    out.add([first_token])
    out.delta(False)  # the front has already sent this text, with the first token
    engine.requests[seq.request_id] = Request(seq.request_id, text, seq.prompt_token_ids, [seq], [out])
    engine.scheduler.running.append(seq)


def first_delta(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams, first_token: int) -> str:
    """The text the first token shows while the request goes on (what :func:`start_decode` counts as sent)."""
    out = OutputText(engine.tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output,
                     engine.detokenizer_cls)
    out.add([first_token])
    return out.delta(False)
