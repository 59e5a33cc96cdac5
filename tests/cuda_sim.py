"""tests/cuda_sim.py -- CUDA graphs on a CPU: a capture simulator (test support, not a test file).

What it proves: graphs.CompiledDecoder's CUDA-only code (_record, _run, warmup with every
bucket, biggest first; Staging's pinned buffer and its event) does on a GPU what its CPU
path does, without a GPU. Inside `simulate_cuda()`:

  * kernels.on_cuda says yes, so the decoder takes its CUDA branches on CPU tensors, and
    torch.compile runs with backend="aot_eager", whose aten ops a dispatch mode can see;
  * torch.cuda.CUDAGraph / torch.cuda.graph / synchronize / Event are fakes. A capture
    records every aten op of the step (a TorchDispatchMode with is_infra_mode, without
    which torch.compile(fullgraph=True) finds no compiled frames). Like a real capture it
    leaves nothing behind: the inputs it mutated are restored, what it allocated holds
    garbage. Anything that needs the host raises: .item(), .tolist(), .cpu(), numpy,
    nonzero, boolean-mask indexing, random numbers, a synchronize;
  * replay() re-executes the recorded ops on the SAME tensors, writing each result into
    the tensor the capture allocated for it (a graph's fixed addresses). First it poisons
    what the other graphs of its pool allocated (NaN, or int64 values that fail any
    index): graphs sharing a pool share those bytes, so only static buffers made outside
    any capture may carry values from one replay to the next step.

The simulator is stricter than the CUDA allocator in one way: a graph output that the
caller keeps alive could not be handed to another graph, but it still changes at its own
graph's next replay, so the decoder's contract is the same: results leave through static
buffers. And looser in one: the ops run in Python, one at a time (no timing is real).
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from unittest import mock

import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import graphs
import kernels

Tag = torch.Tag
HOST_METHODS = ("item", "tolist", "cpu", "numpy", "__array__")   # a device tensor's way to the host


class HostSyncError(RuntimeError):
    """Something in a CUDA graph capture needed the host (a real capture fails or records garbage)."""


def _tensors(tree):
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensor arguments an op writes to (its schema's `Tensor(a!)`)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            out += _tensors(value)
    return out


def _refuse_host_sync(func, args, kwargs):
    """Raise for an op that a CUDA graph cannot hold: the host reads its result (.item(), an
    output shape from the data: nonzero, masked_select, boolean indexing) or it draws random numbers."""
    tags = func.tags
    if Tag.data_dependent_output in tags or func is torch.ops.aten.is_nonzero.default:
        raise HostSyncError(f"{func} reads a device value on the host during a CUDA graph capture")
    if Tag.nondeterministic_seeded in tags:
        raise HostSyncError(f"{func} draws random numbers during a CUDA graph capture")
    indexing = func._schema.name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_")
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    if indexing and any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(indices)):
        raise HostSyncError(f"{func} with a boolean mask (a nonzero: a host sync) during a CUDA graph capture")
    if Tag.dynamic_output_shape in tags and not indexing:
        raise HostSyncError(f"{func}: an output shape that depends on the data (a host sync) during a capture")


def poison(t: torch.Tensor):
    """What uninitialised (or another graph's) memory may hold: NaN, or an index out of any range."""
    with torch.inference_mode():
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(torch.iinfo(t.dtype).max // 3)


class AtenMode(TorchDispatchMode):
    """A dispatch mode that sees every aten op, also those of torch.compile(backend="aot_eager")."""
    supports_higher_order_operators = True

    @classmethod
    def is_infra_mode(cls):     # without it, torch.compile(fullgraph=True) finds "no compiled frames"
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):   # aot_eager's functionalized KV write:
            with self:                                            # its plain implementation, op by op
                return func.py_kernels[torch._C.DispatchKey.CompositeExplicitAutograd](*args, **(kwargs or {}))
        return self.op(func, args, kwargs or {})


class Recorder(AtenMode):
    """Records every aten op run while a FakeGraph captures (and runs it, to get its outputs)."""

    def __init__(self, graph: FakeGraph):
        super().__init__()
        self.graph = graph

    def op(self, func, args, kwargs):
        _refuse_host_sync(func, args, kwargs)
        g = self.graph
        for t in _written(func, args, kwargs):       # an input mutated: undo it when the capture ends
            if _storage(t) not in g.allocated and all(t is not s for s, _ in g.saved):
                g.saved.append((t, t.clone()))
        out = func(*args, **kwargs)
        inputs = {_storage(t) for t in _tensors((args, kwargs))}
        fresh = [t for t in _tensors(out) if t.numel() and _storage(t) not in inputs]
        for t in fresh:                              # memory of this graph's pool
            g.allocated[_storage(t)] = t
        g.ops.append((func, args, kwargs, out, fresh))
        return out


class FakeGraph:
    """torch.cuda.CUDAGraph: capture through torch.cuda.graph (simulate_cuda), then replay()."""

    def __init__(self, sim: Simulator):
        self.sim, self.ops, self.allocated, self.saved, self.pool_id = sim, [], {}, [], None

    def pool(self):
        return self.pool_id

    def replay(self):
        if self.sim.capturing is not None:
            raise HostSyncError("a graph replayed during another graph's capture")
        for other in self.sim.graphs:                # the shared pool: another graph may have used these bytes
            if other is not self and other.pool_id == self.pool_id:
                for t in other.allocated.values():
                    poison(t)
        with torch.inference_mode():
            for func, args, kwargs, out, fresh in self.ops:
                new = func(*args, **kwargs)
                for t, n in zip(_tensors(out), _tensors(new)):
                    if any(t is f for f in fresh):
                        t.copy_(n)                   # the same address as at capture
        self.sim.replays += 1


class Simulator:
    """State of one simulate_cuda() block: the graphs made, replays, synchronizations, events."""

    def __init__(self):
        self.graphs: list[FakeGraph] = []
        self.capturing: FakeGraph | None = None
        self.replays = self.syncs = 0
        self.events: list[tuple[str, int]] = []      # ("record" | "synchronize", event id) in call order
        self.event_ids = itertools.count()

    def new_graph(self):
        graph = FakeGraph(self)
        self.graphs.append(graph)
        return graph

    @contextlib.contextmanager
    def capture(self, graph: FakeGraph, pool=None, stream=None, capture_error_mode="global"):
        """torch.cuda.graph(graph, pool=...): records; leaves the inputs as they were, its memory garbage."""
        if self.capturing is not None:
            raise HostSyncError("nested CUDA graph capture")
        graph.pool_id = pool if pool is not None else object()
        self.capturing, compiled = graph, counters["stats"]["unique_graphs"]
        try:
            with Recorder(graph):
                yield graph
            if counters["stats"]["unique_graphs"] != compiled:   # a real capture would record the compiler's work
                raise HostSyncError("torch.compile compiled a graph during a CUDA graph capture (warm up first)")
        finally:
            self.capturing = None
            with torch.inference_mode():
                for t, before in reversed(graph.saved):  # a capture runs nothing: undo its writes
                    t.copy_(before)
                for t in graph.allocated.values():
                    poison(t)
            graph.saved = []

    def synchronize(self, device=None):
        if self.capturing is not None:
            raise HostSyncError("torch.cuda.synchronize() during a CUDA graph capture")
        self.syncs += 1

    def event(self, *args, **kwargs):
        sim, ident = self, next(self.event_ids)

        class FakeEvent:
            def record(self, stream=None):
                sim.events.append(("record", ident))

            def synchronize(self):
                sim.events.append(("synchronize", ident))
        return FakeEvent()

    def host_method(self, name):
        original = getattr(torch.Tensor, name)

        def guarded(t, *args, **kwargs):
            if self.capturing is not None:
                raise HostSyncError(f"Tensor.{name}() during a CUDA graph capture (a device-to-host sync)")
            return original(t, *args, **kwargs)
        return guarded


def _no_pin(original):
    def empty(*args, pin_memory=False, **kwargs):     # no pinned memory without CUDA: the flag is checked
        return original(*args, **kwargs)
    return empty


@contextlib.contextmanager
def simulate_cuda(backend: str = "aot_eager"):
    """Run kernels.py's and graphs.py's CUDA paths on CPU tensors; yields the Simulator (graphs, replays, events)."""
    sim = Simulator()
    patches = [mock.patch.object(kernels, "on_cuda", lambda device: True),
               mock.patch.object(graphs, "on_cuda", lambda device: True),
               mock.patch.object(graphs, "BACKEND", backend),
               mock.patch.object(torch.cuda, "CUDAGraph", sim.new_graph),
               mock.patch.object(torch.cuda, "graph", sim.capture),
               mock.patch.object(torch.cuda, "synchronize", sim.synchronize),
               mock.patch.object(torch.cuda, "Event", sim.event),
               mock.patch.object(torch, "empty", _no_pin(torch.empty))]
    patches += [mock.patch.object(torch.Tensor, name, sim.host_method(name)) for name in HOST_METHODS]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield sim


class MemoryMeter(AtenMode):
    """torch.cuda's allocator counters for CPU tensors (memory_allocated, max_memory_allocated,
    reset_peak_memory_stats): the bytes of the storages aten ops create while it is active and
    that are still alive. Sees what backend="aot_eager" runs, not inductor's C++ kernels."""

    def __init__(self):
        super().__init__()
        self.allocated = self.peak = 0
        self.live: set[int] = set()

    def op(self, func, args, kwargs):
        out = func(*args, **kwargs)
        inputs = {_storage(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            storage, key = t.untyped_storage(), _storage(t)
            if t.numel() and key not in inputs and key not in self.live:
                self.live.add(key)
                self.allocated += storage.nbytes()
                self.peak = max(self.peak, self.allocated)
                weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int):
        self.live.discard(key)
        self.allocated -= nbytes

    def memory_allocated(self, device=None) -> int:
        return self.allocated

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device=None):
        self.peak = self.allocated

    def empty_cache(self):
        """Nothing is cached: freed CPU memory goes back at once."""
