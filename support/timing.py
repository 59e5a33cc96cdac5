"""
support/timing.py -- the one median timer, and the one choice the engine makes by timing.

What it protects: a figure that means what it says. Timing a function on a
shared machine goes wrong in three quiet ways, each handled once here:
  * the first call pays for allocator growth, lazy initialisation and (with
    torch.compile) compilation: warm-up calls run first, untimed;
  * GPU work is asynchronous: without a synchronization after each call the
    clock measures the launch, not the work (`sync`, e.g. device_sync(device));
  * another process or a page fault makes one run slow: the MEDIAN is
    reported, which one outlier cannot move, not the mean.

Used by every measurement of bench.py, and by the engine while it is built:
choose_weight_layout (the one choice it makes by timing) and step_memory (the
bytes a compiled step needs beside the KV pool). Imports nothing of the tour.
"""
from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def device_sync(device):
    """A function that waits for `device`'s queued work (a no-op off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":  # pragma: no cover (CUDA)
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def timed(fn, repeats: int = 7, warmup: int = 1, sync=None):
    """(median seconds of fn() over `repeats` calls after `warmup` untimed ones,
    the last call's result): a long run timed once is also the run whose
    result the caller checks."""
    sync = sync or (lambda: None)
    result = None
    for _ in range(warmup):
        result = fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def median_seconds(fn, repeats: int = 7, warmup: int = 1, sync=None) -> float:
    """Median seconds of fn() (see timed)."""
    return timed(fn, repeats, warmup, sync)[0]


# ----------------------------------------------------------------------------
# Weight layout: read the weights at the machine's bandwidth
# ----------------------------------------------------------------------------
# Decode is memory-bound: a batch-1 linear layer runs at the speed it streams
# its weight. On this project's 2-core CPU, F.linear with the usual [out, in]
# weight read the 49152x576 LM head at ~12 GB/s (many short dot products),
# with the weight stored [in, out] at ~27 GB/s (long contiguous rows scaled by
# x[i]; a copy: ~33 GB/s): the decode step went from 59 to 48 ms. cuBLAS has
# no such gap, so the layout is chosen by measuring both on the device. It is
# a property of the machine's BLAS, not of inference: hence here, not a lesson.

def choose_weight_layout(model: nn.Module) -> str:
    """Time a batch-1 F.linear through the model's largest linear layer with its
    weight stored both ways; if [in, out] is more than 10% faster, store every
    nn.Linear's weight that way, in place: the same [out, in] matrix to
    F.linear (which multiplies by its transpose, now a contiguous [in, out]
    run), another memory layout, so nothing on the step's path changes. A tied
    LM head gets its own copy; int8 layers are left alone (their kernel wants
    [out, in]). Returns "transposed" or "default".
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        return "default"
    w = max(linears, key=lambda m: m.weight.numel()).weight.detach()
    x, sync = torch.randn(1, w.shape[1], device=w.device, dtype=w.dtype), device_sync(w.device)
    w_in_out = w.t().contiguous().t()                           # [out, in] values, stored [in, out]
    t_default = median_seconds(functools.partial(F.linear, x, w), sync=sync)
    t_transposed = median_seconds(functools.partial(F.linear, x, w_in_out), sync=sync)
    del w, w_in_out                                                # the timed copies: free them now
    if t_transposed > 0.9 * t_default:
        return "default"
    # One layer at a time: each old weight is freed as its copy replaces it (nothing else may hold
    # it), so the peak is the weights plus ONE layer, never two copies of the model (8B: 16 GB).
    for m in linears:
        m.weight = nn.Parameter(m.weight.detach().t().contiguous().t(), requires_grad=False)
    return "transposed"


# ----------------------------------------------------------------------------
# Memory: what a step needs beside the KV pool, measured before the pool is sized
# ----------------------------------------------------------------------------
def step_memory(make_step, device, graphs: bool, memory=torch.cuda) -> int:
    """Device bytes to leave free beside the KV pool for one kind of step (vLLM's and nano-vllm's
    profile run). make_step() allocates what the step keeps (its static buffers) and returns the
    step; the step runs once (compiling), then again while `memory` (torch.cuda's allocator
    counters, or a test's stub) reads its peak. The static buffers count once and the step's
    temporaries once more with CUDA graphs: their shared pool keeps that much for good, and
    the eager steps beside them need their own. The probe's memory goes back to the device
    (empty_cache), so that a free-memory reading after it sees it."""
    before = memory.memory_allocated(device)
    step = make_step()
    with torch.inference_mode():
        step()
        memory.reset_peak_memory_stats(device)
        static = memory.memory_allocated(device)
        step()
        temporaries = memory.max_memory_allocated(device) - static
    del step
    memory.empty_cache()
    return static - before + temporaries * (2 if graphs else 1)
