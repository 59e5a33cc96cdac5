"""
support/workers.py -- the tensor-parallel process runtime (not a lesson).

parallel.py teaches how a model is split over N ranks and what one step
does on each. This file is everything around that which is about PROCESSES:
starting the N-1 workers, the rendezvous, waiting until they have loaded,
joining torchrun's group instead, noticing a worker that died and saying
which one and why, and stopping them all. What it protects, and why:

  * No `if __name__ == "__main__":` guard is needed in the user's script, and
    a script read from stdin (`python - < script.py`) works too. Each worker
    is its own interpreter started as `python -c "<entry>"` (subprocess, the
    way torchrun starts ranks), so nothing re-imports the user's main module
    (torch.multiprocessing's "spawn" does, and then an unguarded script
    starts its engine again inside every worker). The child gets its rank,
    the world size and the rendezvous address in torchrun's environment
    variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the parent's
    sys.path, so every module the parent imports is importable there too.
  * A failure is an error within seconds, never a hang: a worker reports
    "ready" (or its traceback) through the rendezvous store before it joins
    the process group; rank 0 watches the processes while they load and
    before every step (parallel.py's _send does that check with the
    standard library only, so the step path never enters this file).
  * Nothing is left running: close() (also at interpreter exit) tells the
    workers to stop, then terminates and kills what does not; a worker
    ignores Ctrl-C (rank 0 decides) and exits when rank 0's process is gone.

Imports nothing of the tour: parallel.TensorParallelGroup subclasses
WorkerGroup and hands in its load and loop functions (load_shard,
_worker_loop), which a worker imports by name. Also here, because bench.py needs it and a
student does not: the counting and timing of the collectives.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

FOREVER = timedelta(days=3650)   # a worker waits for rank 0's next step as long as the engine idles
SPEC_ENV, SYS_PATH_ENV = "NANOINFER_TP_SPEC", "NANOINFER_TP_SYS_PATH"
# the tour files sit beside support/
TOUR_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TensorParallelError(RuntimeError):
    """A worker died or a collective failed: the group cannot run another step."""


class CollectiveCounters:
    """The counting and timing of parallel.Collectives, for bench.py: set
    comm.timing = True, run steps, read calls, bytes and seconds.

    Eager steps only (torch.compile cannot trace the clock). On CUDA the timer
    synchronizes first, so the time is the collective itself, not the matmuls
    queued before it; on rank 0 it includes waiting for the slowest rank, so
    skew shows up as communication time, which is also what the step pays."""

    def __init__(self):
        self.timing = False
        self.reset()

    def reset(self):
        self.calls, self.bytes, self.seconds = 0, 0, 0.0

    def timed(self, x: torch.Tensor, fn, *args, **kwargs):
        sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += x.numel() * x.element_size()    # this rank's tensor (a ring all-reduce sends
        return out                                  # 2 (N-1)/N of it, an all-gather (N-1) times it)


@dataclasses.dataclass
class WorkerSpec:
    """What every rank needs to load its shard (sent to a worker as JSON in its environment)."""
    path: str
    world_size: int
    device_type: str
    dtype: torch.dtype
    quantization: str | None
    collective_timeout_s: float

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "path": os.fspath(self.path),
                           "dtype": str(self.dtype).removeprefix("torch.")})

    @classmethod
    def from_json(cls, text: str) -> "WorkerSpec":
        d = json.loads(text)
        return cls(**{**d, "dtype": getattr(torch, d["dtype"])})


def check_world_size(world_size, device_type: str = "cpu"):
    """A positive integer, and on CUDA no more ranks than visible GPUs (one GPU per rank)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    if device_type == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs, "
                         f"{torch.cuda.device_count()} visible (CUDA_VISIBLE_DEVICES)")


def device_for(device_type: str, local_rank: int) -> torch.device:
    """Rank r uses cuda:r (cuda:LOCAL_RANK under torchrun), or the CPU."""
    if device_type == "cuda":  # pragma: no cover (CUDA)
        torch.cuda.set_device(local_rank)          # NCCL and new tensors use this GPU
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_groups(spec: WorkerSpec, rank: int, store):
    """Join the process group; return the command group.

    Two groups: the default one (NCCL on CUDA, gloo on CPU) carries the
    all-reduces and has a collective timeout, so a rank that stops answering
    turns into an error instead of a hang. The command group (gloo: it
    carries pickled Python objects through CPU memory) has no practical
    timeout: a worker waits on it for rank 0's next step, however long the
    engine idles. store None: torchrun's environment (env://)."""
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=spec.collective_timeout_s)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=spec.world_size,
                                timeout=timeout)
    elif not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    return dist.new_group(backend="gloo", timeout=FOREVER)


# ----------------------------------------------------------------------------
# A worker's side: a process started by WorkerGroup below
# ----------------------------------------------------------------------------

def _exit_with_parent():
    """A worker whose rank 0 is gone (killed, crashed) exits instead of lingering.
    (A worker waiting in a collective also notices the closed connection;
    this covers one that is still loading.)"""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, name="nanoinfer-tp-parent-watch", daemon=True).start()


def serve_worker(load, loop):
    """Run this process as one worker: load(path, rank, N, device, dtype, quantization)
    its shard, report "ready" (or the traceback) through the store, join the
    process group and loop(model, device, dtype, commands) until rank 0 says stop."""
    spec, rank = WorkerSpec.from_json(os.environ[SPEC_ENV]), int(os.environ["RANK"])
    # Ctrl-C reaches the whole terminal; rank 0 decides
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          spec.world_size, is_master=False,
                          timeout=timedelta(seconds=spec.collective_timeout_s))
    try:
        if spec.device_type == "cpu":              # N processes share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
        device = device_for(spec.device_type, rank)
        model = load(spec.path, rank, spec.world_size, device, spec.dtype, spec.quantization)
        store.set(f"ready/{rank}", "ok")
        loop(model, device, spec.dtype, init_groups(spec, rank, store))
        dist.destroy_process_group()
    except BaseException:
        try:                                       # relay the traceback; rank 0 quotes it
            store.set(f"error/{rank}", traceback.format_exc())
        except Exception:
            pass                                 # rank 0 (the store's host) is gone: nobody to tell
        raise


def worker_command(load, loop) -> list[str]:
    """`python -c ...` (so a user's script needs no __main__ guard): restore the parent's
    sys.path (as multiprocessing's spawn does, so functions of any module the parent imported
    unpickle here), then serve_worker(load, loop), both imported by name from their module."""
    restore = f"import json, os, sys; sys.path[:] = json.loads(os.environ[{SYS_PATH_ENV!r}]); "
    entry = (f"import support.workers, {load.__module__} as m, {loop.__module__} as n; "
             f"support.workers.serve_worker(m.{load.__name__}, n.{loop.__name__})")
    return [sys.executable, "-c", restore + entry]


# ----------------------------------------------------------------------------
# Rank 0's side: start, watch and stop the workers (or join torchrun's group)
# ----------------------------------------------------------------------------

class WorkerGroup:
    """The processes of a tensor-parallel group, seen from rank 0: the base of
    parallel.TensorParallelGroup, which adds what a step does.

    Without torchrun: N-1 workers are started here and rank 0's shard is
    loaded meanwhile (load). Under torchrun (WORLD_SIZE set) every process
    constructs the group: rank 0 returns as the engine; every other rank
    serves rank 0's steps (loop) inside this constructor and then exits the
    process (SystemExit(0)) when rank 0 closes the group. Rank r uses cuda:r
    (cuda:LOCAL_RANK under torchrun), or the CPU.
    After: .model (rank 0's shard), .device, .commands (the command group),
    .procs (subprocess.Popen, rank 1.. in order), .closed, .broken (None or why).
    """

    def __init__(self, spec: WorkerSpec, load, loop, startup_timeout_s: float):
        self.spec, self.world_size, self.dtype = spec, spec.world_size, spec.dtype
        self.procs, self.store, self.commands = [], None, None
        self.closed, self.broken, self.owns_group = False, None, True
        if "WORLD_SIZE" in os.environ:
            self.model = self._join_torchrun(load, loop)
            return
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process (is "
                               "another TensorParallelGroup still open? close() it first)")
        # The rendezvous store lives in this process; port 0 = any free port.
        self.store = dist.TCPStore("127.0.0.1", 0, spec.world_size, is_master=True,
                                   wait_for_workers=False,
                                   timeout=timedelta(seconds=spec.collective_timeout_s))
        atexit.register(self.close)
        try:
            self._start(load, loop)
            self.device = device_for(spec.device_type, 0)
            self.model = load(spec.path, 0, spec.world_size, self.device, spec.dtype,
                              spec.quantization)
            self._wait_ready(startup_timeout_s)                       # they loaded while rank 0 did
            self.commands = init_groups(spec, 0, self.store)
        except BaseException:
            self.close()
            raise

    def _start(self, load, loop):
        # '' (-c, stdin): the cwd
        sys_path = [str(p) or os.getcwd() for p in sys.path] + [TOUR_ROOT]
        env = {**os.environ, SPEC_ENV: self.spec.to_json(), SYS_PATH_ENV: json.dumps(sys_path),
               "WORLD_SIZE": str(self.spec.world_size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(self.store.port)}
        for rank in range(1, self.spec.world_size):
            self.procs.append(subprocess.Popen(worker_command(load, loop), stdin=subprocess.DEVNULL,
                                               env={**env, "RANK": str(rank),
                                                    "LOCAL_RANK": str(rank)}))

    def _join_torchrun(self, load, loop):
        """Under torchrun: join the existing group; ranks other than 0 serve and exit."""
        spec = self.spec
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        if int(os.environ["WORLD_SIZE"]) != spec.world_size:
            raise ValueError(f"tensor_parallel_size={spec.world_size} but torchrun started "
                             f"WORLD_SIZE={os.environ['WORLD_SIZE']} processes")
        self.owns_group = not dist.is_initialized()
        self.device = device_for(spec.device_type, local_rank)
        self.commands = init_groups(spec, rank, None)
        model = load(spec.path, rank, spec.world_size, self.device, spec.dtype, spec.quantization)
        if rank != 0:
            loop(model, self.device, spec.dtype, self.commands)
            dist.destroy_process_group()
            raise SystemExit(0)            # this process existed to serve rank 0; rank 0 has closed
        atexit.register(self.close)
        return model

    def _wait_ready(self, timeout_s: float):
        """Wait until every worker has loaded its shard; name the one that failed."""
        deadline = time.monotonic() + timeout_s
        while not self.store.check([f"ready/{r}" for r in range(1, self.spec.world_size)]):
            if any(p.poll() is not None for p in self.procs):
                raise TensorParallelError(f"a tensor-parallel worker failed to start; "
                                          f"{self.describe()}")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers not ready after {timeout_s} s; "
                                          f"{self.describe()}")
            time.sleep(0.02)

    @property
    def config(self):
        """The per-rank config (heads, KV heads, FFN columns over N): size the KV pool with it."""
        return self.model.config

    @property
    def comm(self):
        """Rank 0's collectives: set comm.timing = True to count and time them (bench.py)."""
        return self.model.tp_comm

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- failures ----------------------------------------------------------------

    def fail(self, error):
        """Raise the group's error: closed, or broken (the ranks are out of step),
        naming each worker's state. error None: a worker was found dead."""
        if self.closed:
            raise TensorParallelError("the tensor-parallel group is closed")
        if self.broken is None:
            self.broken = (f"tensor-parallel group of {self.spec.world_size} failed "
                           f"({type(error).__name__ if error is not None else 'a worker died'}); "
                           f"{self.describe()}; close() it and start a new one")
        if error is not None and not isinstance(error, Exception):
            raise error                     # KeyboardInterrupt and friends stay what they are
        raise TensorParallelError(self.broken) from error

    def describe(self) -> str:
        if not self.procs:
            return "see the other ranks' logs (torchrun)"
        states = []
        for rank, p in enumerate(self.procs, start=1):
            try:
                code = p.wait(timeout=0.2)  # a dying worker: give it a moment to be reaped
            except subprocess.TimeoutExpired:
                states.append(f"rank {rank} (pid {p.pid}) alive")
                continue
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            state = f"rank {rank} (pid {p.pid}) died, {how}"
            if self.store is not None and self.store.check([f"error/{rank}"]):
                state += ": " + self.store.get(f"error/{rank}").decode().strip().splitlines()[-1]
            states.append(state)
        return "workers: " + "; ".join(states)

    # -- shutdown ----------------------------------------------------------------

    def close(self):
        """Stop the workers and leave the process group; no process is left behind."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        # else they may be stuck, or still loading
        told = self.commands is not None and self.broken is None
        if told:
            try:
                dist.broadcast_object_list([("stop",)], src=0, group=self.commands)
            except Exception:
                told = False                # a worker died meanwhile: the loop below ends it
        for p in self.procs:
            for stop, wait_s in ((None, 10 if told else 0), (p.terminate, 5), (p.kill, None)):
                if p.poll() is not None:
                    break
                if stop is not None:
                    stop()
                try:
                    p.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    pass
        if dist.is_initialized():
            if self.owns_group:
                dist.destroy_process_group()
            elif self.commands is not None:
                dist.destroy_process_group(self.commands)
        self.store = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
