"""
overhead -- the engine's own work around the forward pass.

Claim (lecture: "a step costs its forward pass"): scheduling, building the inputs, sampling,
detokenizing and emitting outputs are small next to the model's forward pass, once the model
is big enough to matter; the baseline, timed in the same run alternately with the step, is
the bare forward pass of the same batch. `tiny` (2 layers, 64 dims, the real 49k-token
vocabulary) has a nearly free forward pass: its step time is the engine's work.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from experiments.common import TINY_MODEL, start_decoding, table
from experiments.plan import Phase, decode, prefill

NAME = "overhead"
# engine: {} is the run's standard engine (a GPU's compiled one, shared); tiny runs eagerly on a GPU:
# its compile would cost more than its whole measurement.
WORKLOAD = {"cpu": dict(batches=[1, 4, 16, 64, 256], context=32, steps=20,
                        engine=dict(max_num_seqs=256, pool_tokens=256 * 60)),
            "cpu-quick": dict(batches=[1, 4], context=8, steps=20, engine=dict(max_num_seqs=4, pool_tokens=4 * 36)),
            "gpu": dict(batches=[1, 4, 16, 64], context=32, steps=20, engine={}),
            "gpu-quick": dict(batches=[1, 64], context=32, steps=20, engine={})}


def engines(s):
    """[(name, options)]: tiny, then the timing model (unless it is tiny)."""
    w = s.sizes(WORKLOAD)
    tiny = s.options(TINY_MODEL, compile=False, max_num_seqs=max(w.batches),
                     pool_tokens=max(w.batches) * (w.context + w.steps + 8))
    return [("tiny", tiny)] + ([] if s.path == TINY_MODEL else [(os.path.basename(s.path), s.options(**w.engine))])


def _bare_forward(llm):
    """The forward pass of the engine's next decode step alone, as a function: its inputs built now,
    outside any clock; no scheduling, sampling or detokenizing (compiled: the decoder's step)."""
    seqs = llm.scheduler.running
    for s in seqs:                                 # room for the token the step will feed (idempotent)
        llm.block_manager.reserve(s.seq_id, s.num_computed, 1)
    # a token still on the device (overlap: PENDING) is fed as 0: a step's time is not its values'
    hb = llm.inputs.host([(s.seq_id, [max(s.token_ids[-1], 0)], s.num_computed) for s in seqs])
    if llm.decoder is not None:
        return lambda: llm.decoder(hb.input_ids, hb.positions, hb.slot_mapping, llm.inputs.tables[hb.rows])
    x, pos, ctx = llm.inputs.device(hb, llm.cache)
    return lambda: llm.model(x, pos, ctx)          # writes the slots the step then writes with the same values


def step_and_forward_seconds(b, llm, batch: int, context: int, steps: int) -> dict:
    """The engine's decode step and the bare forward pass of the same batch, timed alternately, so a
    shared machine's noise hits both alike. Medians, and the fastest runs (noise only adds time)."""
    ids = start_decoding(llm, batch, context, steps)
    times = {"step": [], "forward": []}
    for i in range(steps + 2):                     # the first two are warm-up
        with torch.inference_mode():
            run = _bare_forward(llm)
            for name, fn in (("forward", run), ("step", llm.step)):
                b.sync()
                t0 = time.perf_counter()
                fn()
                b.sync()
                if i >= 2:
                    times[name].append(time.perf_counter() - t0)
    for rid in ids:
        llm.abort(rid)
    return {f"{k}_{stat.__name__}": stat(v) for k, v in times.items() for stat in (statistics.median, min)}


def run(b):
    w = b.sizes(WORKLOAD)
    rows, fig = [], {"context": w.context, "points": []}
    for name, opts in engines(b.scale):
        llm = b.llm(**opts)
        for B in w.batches:
            b.progress(f"overhead: {name}, batch {B}")
            t = step_and_forward_seconds(b, llm, B, w.context, w.steps)
            step, fwd = t["step_median"], t["forward_median"]
            p = {"model": name, "batch": B, "step_ms": step * 1e3, "forward_ms": fwd * 1e3,
                 "step_min_ms": t["step_min"] * 1e3, "forward_min_ms": t["forward_min"] * 1e3,
                 "overhead_ms": (step - fwd) * 1e3, "overhead_fraction": max(0.0, step - fwd) / step}
            fig["points"].append(p)
            rows.append([name, B, p["step_ms"], p["forward_ms"], p["overhead_ms"], f"{p['overhead_fraction']:.0%}"])
        del llm
    text = (f"Greedy decode at a {w.context}-token context. `tiny` is a random 2-layer, 64-dim Llama with the real "
            "49152-token vocabulary: its forward pass is nearly free, so its step time is the engine's own "
            "work (scheduling, input building, sampling, detokenizing, outputs).\n\n" +
            table(["model", "batch", "engine step (ms)", "forward pass (ms)", "engine overhead (ms)",
                   "overhead share"], rows))
    return fig, text


def plan(s):
    w = s.sizes(WORKLOAD)
    return [Phase([o], [prefill(o, B * w.context, w.context) for B in w.batches] +
                  [decode(o, 2 * (w.steps + 2), B, w.context) for B in w.batches], context=w.context + w.steps + 8)
            for _, o in engines(s)]
