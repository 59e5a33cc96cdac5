"""scripts/host_overhead.py -- an engine step's host work, apart from its forward pass.

Builds LLM(MODEL, compile=...) on --device, starts `batch` greedy requests decoding, then times
`--steps` decode steps. Each step is split, by wrapping the engine's methods (no profiler), into:
  forward   CompiledDecoder._run (compile) or the model's forward (eager): the "device" part
  schedule  Scheduler.schedule                 sreq  sample_requests
  inputs    LLM._forward less the forward     sample  LLM._launch (the sampler's ops, queued)
  append    LLM._resolve (the fetch, append, detokenize, outputs)   other: the rest of LLM.step
The engine runs with overlap=False (--overlap: True), so that each stage is this step's.
Medians over the steps (microseconds per step); --repeat runs that many rounds (median of the
rounds' medians). --profile: a cProfile of the steps, top functions by cumulative time per step.

On a GPU the forward is asynchronous: compare `total` (the whole step) before/after. Without --sync
the wait for the device lands in the stage that first synchronizes ('append', the fetch); --sync
times the forward to its end.

    python scripts/host_overhead.py --batches 1 8 16 --compile --repeat 3
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")    # a shared 2-core machine: threads only add noise

import torch  # noqa: E402

import engine  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from support.checkpoint import PRESETS  # noqa: E402

STAGES = ("forward", "schedule", "sreq", "inputs", "sample", "append", "other")


class Clock:
    """Accumulates the seconds spent inside wrapped callables, per stage, in the current step."""

    def __init__(self, sync):
        self.t = dict.fromkeys(STAGES, 0.0)
        self.sync = sync

    def wrap(self, stage, fn, sync=False):
        def timed(*a, **k):
            if sync:
                self.sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if sync:
                self.sync()
            self.t[stage] += time.perf_counter() - t0
            return out
        return timed


def instrument(llm, clock, sync_forward):
    """Wrap the step's stages in place (instance attributes; module function for sample_requests)."""
    llm.scheduler.schedule = clock.wrap("schedule", llm.scheduler.schedule)
    llm._launch = clock.wrap("sample", llm._launch)
    llm._resolve = clock.wrap("append", llm._resolve)
    llm._forward = clock.wrap("inputs", llm._forward)     # forward subtracted below
    engine.sample_requests = clock.wrap("sreq", engine.sample_requests)
    if llm.decoder is not None:
        llm.decoder._run = clock.wrap("forward", llm.decoder._run, sync_forward)
    else:
        model = llm.model
        model.forward = clock.wrap("forward", model.forward, sync_forward)


def start(llm, batch, context, steps):
    prompts = [[(7 * i + 13 * j) % 4000 + 100 for j in range(context)] for i in range(batch)]
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    while any(not r.seqs[0].num_output for r in llm.requests.values()):
        llm.step()
    return ids


def measure(llm, clock, batch, context, steps, warmup=10, profile=None):
    ids = start(llm, batch, context, steps + warmup)
    rows = []
    for i in range(steps + warmup):
        for k in clock.t:
            clock.t[k] = 0.0
        if profile is not None and i == warmup:
            profile.enable()
        clock.sync()
        t0 = time.perf_counter()
        llm.step()
        clock.sync()
        total = time.perf_counter() - t0
        if i >= warmup:
            t = dict(clock.t)
            t["inputs"] -= t["forward"]
            t["other"] = total - sum(v for k, v in t.items() if k != "other")
            t["total"], t["host"] = total, total - t["forward"]
            rows.append(t)
    if profile is not None:
        profile.disable()
    for rid in ids:
        llm.abort(rid)
    return {k: statistics.median(r[k] for r in rows) * 1e6 for k in rows[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:smollm2-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sync", action="store_true", help="synchronize around the forward (GPU)")
    ap.add_argument("--overlap", action="store_true", help="the overlapped engine (stages overlap)")
    ap.add_argument("--profile", type=int, default=0, help="cProfile this batch size")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--vocab", type=int, default=0, help="random: presets: this vocabulary size "
                    "(small: the sampler's and LM head's tensor work is ~free, as a GPU's is to "
                    "the host)")
    a = ap.parse_args()
    if a.vocab and a.model.startswith("random:"):
        name = a.model.split(":")[1]
        PRESETS[name] = {**PRESETS[name], "vocab_size": a.vocab}
    torch.manual_seed(0)
    llm = LLM(a.model, device=a.device, dtype=a.dtype, compile=a.compile, overlap=a.overlap,
              max_num_seqs=max(a.batches), kv_cache_bytes=64 << 20 if a.device == "cpu" else None)
    cuda = torch.device(llm.device).type == "cuda"
    clock = Clock(lambda: torch.cuda.synchronize() if cuda else None)
    instrument(llm, clock, a.sync and cuda)
    cols = ("total", "forward", "host") + STAGES[1:]
    print(f"# {a.model} vocab={llm.config.vocab_size} compile={a.compile} device={llm.device} steps={a.steps} (us per step, "
          f"medians; median of {a.repeat} rounds)")
    print("batch " + " ".join(f"{c:>8}" for c in cols))
    for B in a.batches:
        rounds = [measure(llm, clock, B, a.context, a.steps) for _ in range(a.repeat)]
        med = {c: statistics.median(r[c] for r in rounds) for c in cols}
        print(f"{B:5d} " + " ".join(f"{med[c]:8.1f}" for c in cols), flush=True)
    if a.profile:
        prof = cProfile.Profile()
        measure(llm, clock, a.profile, a.context, a.steps, profile=prof)
        print(f"\n# cProfile, batch {a.profile}: cumulative us per step (profiler overhead included)")
        st = pstats.Stats(prof).sort_stats("cumulative")
        for (file, line, name), (cc, nc, tt, ct, _) in sorted(
                st.stats.items(), key=lambda kv: -kv[1][3])[:a.top]:
            where = f"{os.path.basename(file)}:{line}({name})"
            print(f"{ct / a.steps * 1e6:9.1f} cum {tt / a.steps * 1e6:8.1f} self "
                  f"{nc / a.steps:6.1f} calls  {where}")


if __name__ == "__main__":
    main()
