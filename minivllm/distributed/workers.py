"""The ranks of a tensor-parallel engine: starting them, the workers' step loop, failure and shutdown (chapter 15).

Rank 0 is the engine's own process: it runs the scheduler and the block
manager, broadcasts each step (:mod:`minivllm.distributed.protocol`), runs
its shard of the forward and samples. Ranks 1..tp-1 are worker processes
started with ``torch.multiprocessing`` (spawn, so they work from Jupyter
and Colab), which load their shard, build their KV pool (their KV heads
only) and run every step rank 0 sends until it sends SHUTDOWN.

The ranks meet on a ``TCPStore`` that rank 0 opens on 127.0.0.1 at a free
port (listening there only, and their gloo sockets bound to loopback:
:mod:`minivllm.distributed.rendezvous`), or through ``env://`` when ``torchrun`` started every rank (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``), so the same engine runs across machines.
The forward's collectives use gloo on the CPU and NCCL on CUDA; the step
broadcasts use a second, gloo group of CPU tensors, on which an idle worker
may wait for as long as rank 0 lives.

No wait of rank 0 is unbounded: the rendezvous times out after
:data:`TIMEOUT`, every collective of the forward after the config's
``collective_timeout`` (a rank that is stopped or stuck). A worker that dies
closes its sockets, so rank 0's next collective fails at once; rank 0 then names the rank and its exit code (and
its traceback, when it had one) in a :class:`WorkerError`, kills the other
workers and closes its groups. Workers also leave when rank 0's process is
gone (a watchdog thread), so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.config import EngineConfig, check, resolve, resolve_function
from minivllm.distributed import protocol
from minivllm.distributed.rendezvous import LOOPBACK, loopback_gloo, loopback_store
from minivllm.model_runner import ModelRunner
from minivllm.models import TensorParallelGroup, load_config, load_model_shard
from minivllm.models.parallel import valid_tensor_parallel_sizes, weight_bytes

__all__ = ["TIMEOUT", "WorkerError", "Workers", "check_tensor_parallel_size", "start_workers", "torchrun_rank",
           "memory_report", "run_on_ranks", "watch_parent", "name_process", "stop_process"]

TIMEOUT = datetime.timedelta(seconds=300)  # rank 0's longest wait: the rendezvous, one collective
IDLE = datetime.timedelta(days=365)  # a worker waiting for rank 0's next step (it leaves when rank 0 is gone)
GRACE = 10.0  # seconds a worker gets to leave after SHUTDOWN before it is killed


class WorkerError(RuntimeError):
    """A tensor-parallel rank died or a step's collectives failed; every worker has been shut down."""


def check_tensor_parallel_size(config: EngineConfig) -> None:
    """Refuse a size that does not divide the model's heads, naming the sizes that do (before anything starts)."""
    hf = load_config(config.model)
    sizes = valid_tensor_parallel_sizes(hf)
    allowed = ", ".join(map(str, sizes[:-1])) + (" or " if len(sizes) > 1 else "") + str(sizes[-1])
    check(config.tensor_parallel_size in sizes, "tensor_parallel_size",
          f"{allowed} for {config.model} (a divisor of its {hf.num_attention_heads} query heads, "
          f"{hf.num_key_value_heads} KV heads and MLP width {hf.intermediate_size})", config.tensor_parallel_size)


def torchrun_rank(world: int) -> int | None:
    """This process's rank when ``torchrun`` (any ``env://`` launcher) started it, else None."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return None
    check(int(os.environ["WORLD_SIZE"]) == world, "tensor_parallel_size",
          f"torchrun's WORLD_SIZE ({os.environ['WORLD_SIZE']}) when launched by torchrun", world)
    return int(os.environ["RANK"])


def _device(config: EngineConfig, local_rank: int) -> torch.device:
    return torch.device(f"cuda:{local_rank}") if config.torch_device.type == "cuda" else torch.device("cpu")


def _collective_timeout(config: EngineConfig) -> datetime.timedelta:
    return datetime.timedelta(seconds=config.collective_timeout)


def _threads(world: int) -> int:
    """CPU threads per rank: the cores shared out, so ``tp`` processes do not oversubscribe them."""
    return max(1, len(os.sched_getaffinity(0)) // world)


def _join(rank: int, world: int, device: torch.device, store=None,
          timeout: datetime.timedelta = TIMEOUT) -> tuple[TensorParallelGroup, object]:
    """Join the forward's group (gloo or NCCL; a collective waits at most ``timeout`` for a rank) and the
    step-broadcast group (gloo, idle-tolerant)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    init = {"store": store} if store is not None else {"init_method": "env://"}
    # Spawned ranks share this machine: their gloo sockets bind to loopback (torchrun's follow its own settings).
    with loopback_gloo() if store is not None else contextlib.nullcontext():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **init)
        control = dist.new_group(backend="gloo", timeout=IDLE)
    return TensorParallelGroup(rank, world), control


def memory_report(runner: ModelRunner) -> dict[str, int]:
    """This rank's bytes: split weights, replicated weights (norms), and its KV pools (device and swap)."""
    kv = runner.kv_cache
    pools = [getattr(kv, name, None) for name in ("k", "v", "cpu_k", "cpu_v")]
    kv_bytes = sum(t.numel() * t.element_size() for t in pools if t is not None)
    return {**weight_bytes(runner.model), "kv": kv_bytes}


@dataclass(eq=False)
class Workers:
    """Rank 0's handle on the other ranks: their processes, the groups, liveness, and shutdown."""

    tp: TensorParallelGroup
    control: object
    device: torch.device
    processes: dict = field(default_factory=dict)  # rank -> multiprocessing.Process (empty under torchrun)
    pipes: dict = field(default_factory=dict)  # rank -> the read end of the worker's report pipe
    threads_before: int = 0  # rank 0's torch threads before the engine shared the cores out
    store: object = None  # the TCPStore rank 0 hosts (spawned workers), kept alive with the groups
    timeout: datetime.timedelta = TIMEOUT  # the longest a step's broadcast or collective waits for a rank
    error: str | None = None
    closed: bool = False

    def send(self, msg: protocol.StepMessage) -> None:
        seconds = protocol.send(msg, self.control, self.timeout)
        self.tp.comm_seconds += seconds
        self.tp.broadcast_seconds += seconds

    def start_pools(self, num_blocks: int, num_cpu_blocks: int, own: dict) -> list[dict]:
        """Tell the workers the pool sizes; gather every rank's memory report (rank order)."""
        dist.broadcast(torch.tensor([num_blocks, num_cpu_blocks]), src=0, group=self.control)
        mine = torch.tensor([own["sharded"], own["replicated"], own["kv"]])
        parts = [torch.empty_like(mine) for _ in range(self.tp.size)]
        dist.gather(mine, parts, dst=0, group=self.control)  # the control group: a rank may still be loading
        return [dict(zip(("sharded", "replicated", "kv"), p.tolist())) for p in parts]

    def guard(self, fn):
        """Run rank 0's side of a collective step; on any failure shut every worker down and say why."""
        self.check_health()
        start = time.monotonic()
        try:
            return fn()
        except BaseException as e:
            # a peer that died fails the collective at once, then exits: wait for its exit to name it; a step that
            # waited out the collective timeout has a stopped or stuck rank, which will not exit: no wait
            timed_out = time.monotonic() - start >= self.timeout.total_seconds()
            dead = self.dead_ranks(wait=0.0 if timed_out else 10.0)
            reason = self.describe(dead) if dead else f"a tensor-parallel step failed on rank 0 ({type(e).__name__}: {e})"
            if isinstance(e, Exception):
                self.fail(reason, e)
            self.shutdown(graceful=False, error=reason)
            raise

    def check_health(self) -> None:
        """Raise :class:`WorkerError` if the group is shut down or a rank has died (then shut the others down)."""
        if self.closed:
            raise WorkerError(f"the tensor-parallel workers are shut down ({self.error or 'shutdown() was called'})")
        dead = self.dead_ranks(wait=0.0)
        if dead:
            self.fail(self.describe(dead))

    def dead_ranks(self, wait: float) -> list[int]:
        """Ranks whose process has exited, waiting up to ``wait`` seconds for one to."""
        deadline = time.monotonic() + wait
        while True:
            dead = [r for r, p in self.processes.items() if p.exitcode is not None]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def describe(self, dead: list[int]) -> str:
        parts = []
        for rank in dead:
            code = self.processes[rank].exitcode
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            parts.append(f"rank {rank} (pid {self.processes[rank].pid}) died ({how}{self.last_error(rank)})")
        return "tensor-parallel worker " + "; worker ".join(parts)

    def last_error(self, rank: int) -> str:
        """The last line of the traceback the worker reported, if it had time to report one."""
        conn, text = self.pipes.get(rank), ""
        try:
            while conn is not None and conn.poll(0):
                kind, value = conn.recv()
                text = value.strip().splitlines()[-1] if kind == "error" else text
        except (EOFError, OSError):
            pass
        return f", after {text}" if text else ""

    def fail(self, reason: str, cause: BaseException | None = None):
        self.shutdown(graceful=False, error=reason)
        raise WorkerError(f"{reason}; the engine shut the other ranks down") from cause

    def shutdown(self, graceful: bool = True, error: str | None = None) -> None:
        """Stop every worker (SHUTDOWN, then a kill after :data:`GRACE` seconds) and leave the groups. Idempotent."""
        if self.closed:
            return
        self.closed, self.error = True, error
        if graceful:
            try:
                self.send(protocol.StepMessage(protocol.SHUTDOWN))
            except Exception:  # a worker already gone: the kills below finish the job
                graceful = False
        for p in self.processes.values():
            stop_process(p, GRACE if graceful else 0)
        for conn in self.pipes.values():
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.threads_before:
            torch.set_num_threads(self.threads_before)


def stop_process(p, grace: float) -> None:
    """Give a worker process ``grace`` seconds to leave, then kill it and reap it (bounded)."""
    p.join(grace)
    if p.exitcode is None:
        p.kill()
        p.join(GRACE)


def start_workers(config: EngineConfig) -> Workers:
    """Start ranks 1..tp-1 (or, under torchrun, meet them) and join both groups as rank 0.

    Under torchrun a process of rank > 0 never returns from here: it serves
    rank 0's steps and exits when rank 0 shuts down.
    """
    check_tensor_parallel_size(config)
    world = config.tensor_parallel_size
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already running in this process "
                           "(another tensor-parallel engine?): shut it down first")
    rank = torchrun_rank(world)
    if rank is None:
        return _spawn(config, world)
    device = _device(config, int(os.environ.get("LOCAL_RANK", rank)))
    tp, control = _join(rank, world, device, timeout=_collective_timeout(config))
    if rank != 0:
        serve(config, tp, control, device)
        raise SystemExit(0)
    return Workers(tp, control, device, timeout=_collective_timeout(config))


def _spawn(config: EngineConfig, world: int) -> Workers:
    """Rank 0 of a single-machine group: a TCPStore on a free port, then ``world - 1`` spawned workers."""
    store = loopback_store(world, TIMEOUT)
    ctx = mp.get_context("spawn")
    threads = _threads(world) if config.torch_device.type == "cpu" else torch.get_num_threads()
    handle = Workers(TensorParallelGroup(0, world), None, _device(config, 0), threads_before=torch.get_num_threads(),
                     timeout=_collective_timeout(config))
    try:
        for rank in range(1, world):
            read, write = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, args=(rank, world, store.port, config, threads, write),
                            name=f"minivllm-tp-rank{rank}", daemon=True)
            p.start()
            write.close()
            handle.processes[rank], handle.pipes[rank] = p, read
        _wait_for_hellos(handle)
        torch.set_num_threads(threads)
        handle.tp, handle.control = _join(0, world, handle.device, store, _collective_timeout(config))
        handle.store = store
    except BaseException:
        handle.shutdown(graceful=False)
        raise
    return handle


def _wait_for_hellos(handle: Workers) -> None:
    """Every worker has started Python and imported minivllm (a worker that dies here is named at once)."""
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    waiting = set(handle.processes)
    while waiting:
        for rank in list(waiting):
            if handle.pipes[rank].poll(0.05):
                kind, value = handle.pipes[rank].recv()
                if kind == "error":
                    raise WorkerError(f"tensor-parallel worker rank {rank} failed to start: {value}")
                waiting.discard(rank)
            elif handle.processes[rank].exitcode is not None:
                raise WorkerError(handle.describe([rank]) + " while starting")
        if time.monotonic() > deadline:
            raise WorkerError(f"tensor-parallel workers {sorted(waiting)} did not start within {TIMEOUT}")


def worker_main(rank: int, world: int, port: int, config: EngineConfig, threads: int, conn) -> None:
    """A spawned rank: join rank 0's store, load the shard, serve steps; report a traceback if anything fails."""
    watch_parent(os.getppid(), "minivllm-tp-watchdog")
    name_process(f"mvllm-tp-rank{rank}")
    try:
        torch.set_num_threads(threads)
        conn.send(("hello", os.getpid()))
        store = dist.TCPStore(LOOPBACK, port, world, is_master=False, timeout=TIMEOUT)
        device = _device(config, rank)
        tp, control = _join(rank, world, device, store, _collective_timeout(config))
        serve(config, tp, control, device)
    except BaseException:
        print(f"minivllm tensor-parallel worker rank {rank}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:  # rank 0 is gone
            pass
        conn.close()
        os._exit(1)  # not sys.exit: torch.distributed's teardown, its peers gone, can abort and hide the exit code
    conn.close()


def name_process(name: str) -> None:
    """Give this process a name ``ps`` and ``/proc/PID/comm`` show (Linux; at most 15 characters), else nothing."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def watch_parent(parent: int, name: str) -> None:
    """Leave at once if the process that spawned this worker (rank 0, or a disaggregated front) is gone."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name=name, daemon=True).start()


@torch.inference_mode()
def serve(config: EngineConfig, tp: TensorParallelGroup, control, device: torch.device) -> None:
    """A worker's life: load its shard, build its KV pool, run rank 0's steps until SHUTDOWN."""
    model = load_model_shard(config.model, tp, device, config.torch_dtype, config.pack_weights,
                             resolve_function(config.shard_weight, "shard_weight"), config.kernels)
    sizes = torch.empty(2, dtype=torch.long)
    dist.broadcast(sizes, src=0, group=control)
    runner = ModelRunner(
        model, int(sizes[0]), config.block_size, int(sizes[1]), resolve(config.attention_backend)
    )
    report = memory_report(runner)
    dist.gather(
        torch.tensor([report["sharded"], report["replicated"], report["kv"]]),
        None,
        dst=0,
        group=control,
    )
    while True:
        msg = protocol.receive(control)
        if msg.op == protocol.SHUTDOWN:
            break
        runner.copy_blocks(msg)
        if msg.inputs is not None:
            runner.forward_inputs(msg.inputs)
    dist.destroy_process_group()


def _run_rank(rank: int, world: int, port: int, fn, args, threads: int, conn) -> None:
    """One rank of :func:`run_on_ranks`: join the group, run ``fn``, send back its result."""
    try:
        torch.set_num_threads(threads)
        store = dist.TCPStore(LOOPBACK, port, world, is_master=False, timeout=TIMEOUT)
        tp, _ = _join(rank, world, torch.device("cpu"), store)
        conn.send(("ok", fn(tp, *args)))
        dist.destroy_process_group()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_on_ranks(fn, world: int, *args, timeout: float = 120.0) -> list:
    """Run ``fn(tp_group, *args)`` on ``world`` spawned CPU ranks joined by gloo; their results, in rank order.

    Every rank is a subprocess (this process only hosts the store), so it
    works from a notebook; ``fn`` must be importable (defined in a module).
    """
    store = loopback_store(world, TIMEOUT)
    ctx, pipes, procs = mp.get_context("spawn"), [], []
    try:
        for rank in range(world):
            read, write = ctx.Pipe(duplex=False)
            procs.append(ctx.Process(target=_run_rank, args=(rank, world, store.port, fn, args, _threads(world), write),
                                     daemon=True))
            procs[-1].start()
            write.close()
            pipes.append(read)
        results = []
        for rank, conn in enumerate(pipes):
            if not conn.poll(timeout):
                raise WorkerError(f"rank {rank} of run_on_ranks gave no result within {timeout} s")
            try:
                kind, value = conn.recv()
            except EOFError:  # it died before it could answer
                kind, value = "error", f"the process ended (exit code {procs[rank].join(GRACE) or procs[rank].exitcode})"
            if kind == "error":
                raise WorkerError(f"rank {rank} of run_on_ranks failed:\n{value}")
            results.append(value)
        return results
    finally:
        for p in procs:
            p.join(GRACE)
            if p.exitcode is None:
                p.kill()
                p.join()
        for conn in pipes:
            conn.close()
