"""
bench.py -- measuring it all: every lesson of the lecture as a number on your machine.

Each experiment measures a baseline and the technique in the same run (the
machines are shared and noisy: only ratios measured side by side mean
anything), takes medians over repeats with warm-up excluded, and prints the
bound the lecture predicts next to the measurement:

  overhead              the engine's step next to the bare forward pass: what scheduling,
                        sampling and detokenizing cost (a tiny model, and the bench's model)
  roofline              memory bandwidth and matmul throughput of the device; the decode
                        bound (weight bytes + KV bytes) / bandwidth; arithmetic intensity ~ batch
  kv-cache              naive generation (recompute everything) vs the KV cache
  batching              decode step time and tokens/s from batch 1 up: the latency/throughput knee
  continuous-vs-static  a heterogeneous workload, static groups vs continuous batching
  prefix                a long shared system prompt with prefix caching on vs off
  speculative           n-gram (or --draft model) drafts at k = 1..8: acceptance, speedup, prediction
  quantization          float vs int8 weights (and int8 KV): bytes, tokens/s, perplexity
  compile               eager vs torch.compile'd decode step, and the compile time
  peer                  Hugging Face transformers' generate on the same workload and weights (if installed)
  serving               users over HTTP: Poisson arrivals at rising request rates against serve.py,
                        half streaming; throughput, TTFT and TPOT p50/p99, the rate where latency turns up
  tensor-parallel       decode steps with the model split over N processes (measured: step time and
                        all-reduce time), and the lecture's arithmetic for 8B and 70B on 1-8 GPUs
  kv-compression        MHA vs GQA vs MQA of one preset (random:<preset>:kv_heads=N): KV bytes per token
                        (formula and allocated pool), the batch a fixed budget holds, the decode step and
                        its KV share; published models' arithmetic (GQA, MLA, a 4k window); and KV blocks
                        in use against length, full attention vs a sliding window

    python bench.py                      # everything, best device (see "The scale" below)
    python bench.py --quick              # a smoke run of every experiment (1-2 min on a 2-core CPU,
                                         # torch.compile's first build included)
    python bench.py --only batching,compile --json results.json
    python bench.py --model random:llama-3.1-8b --only overhead,serving,tensor-parallel
    python bench.py --check              # on a GPU, FIRST: a verdict per GPU path in <= 3 minutes
    python bench.py --check --device cpu --model random:smollm2-tiny   # its dry run (CI, < 30 s)

Pictures. Every experiment where a picture says more than its table
(roofline, batching, kv-cache, speculative, serving, quantization,
kv-compression) writes a PNG titled with its lesson, the device, the model
and the date: into the folder beside --json (results/x.json -> results/x/),
or --plots DIR, or ./bench-plots; --no-plots writes none. They are drawn
from the results dict alone (plot_* below), so a results file can be
re-plotted without a model.

Honest comparisons. In float32 every path of this engine gives exactly the
dense path's greedy tokens, and the tables say "same tokens". In bf16 each
path rounds differently, so two correct paths drift apart after a few tokens
and "same tokens" would read False everywhere: there the tables give the
tokens two paths share up to their first divergence, and each path's largest
|logit difference| from float32 arithmetic on the same weights and tokens.

Isolation. An experiment that raises reports its error in its table and its
JSON entry, and the next one runs; the exit status says whether any failed.

The scale. A GPU is wasted on a 135M model (a decode step reads 0.27 GB:
the GPU idles), so on a GPU with no --model the TIMING experiments run on
the largest "random:" preset (model.py: published shapes, random weights)
that fits comfortably in free memory (Llama-3.1-8B on an 80 GB card), while
the QUALITY figures (perplexity, speculative acceptance) use the real default
model: random weights have no quality to measure. --model sets both. On a CPU,
and with --quick, both are the default model. Every figure from random
weights says so, in its table and in the JSON ("random weights, published shapes").

Tables print as Markdown (paste them into the README); --json writes every
figure with the device, dtype, torch version, date and the models used, and
merges into an existing results file (rerunning one experiment replaces only
its entry; a file that is not bench results is refused, never overwritten).
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime
import functools
import gc
import http.client
import io
import itertools
import json
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
import traceback

import torch
import torch.nn.functional as F

import kernels
from cache import AttentionContext, BlockManager, kv_cache_bytes
from model import default_model_path, generate, load_model
from parallel import (NVLINK_H100_SXM, PCIE_GEN5_X16, TensorParallelError, TensorParallelGroup,
                      check_tensor_parallel, tensor_parallel_cost)
from kernels import batched_paged_attention, dynamic, layer_cache, paged_attention_in_place, size_oblivious
from quantize import FUSED_ROWS, Int8KVCache, Int8Linear, decode_weight_bytes, quantize_model
from scheduler import LLM, SamplingParams, make_kv_pool
from serve import make_server
from support.checkpoint import PRESETS, RANDOM_PREFIX, parse_random_path
from support.checks import resolve_device_dtype
from support.timing import device_sync, median_seconds, timed

# ----------------------------------------------------------------------------
# The scale: which model the timing experiments run on
# ----------------------------------------------------------------------------

# The published presets, largest first (model.py's "tiny" ones are not real shapes).
LECTURE_PRESETS = ("llama-3.1-70b", "llama-3.1-8b", "llama-3.2-3b", "llama-3.2-1b", "smollm2-135m")
UNPUBLISHED_PRESETS = ("tiny", "smollm2-tiny")
TINY_MODEL = "random:smollm2-tiny"   # model.py preset: 2 layers, dim 64, the real vocabulary

# The batching experiment on a GPU runs the issue's goal case, batch 64 at a
# 2k-token context: its KV pool (64 x ~2.1k tokens; 18 GB at 8B shapes) is
# the largest any experiment asks for, so the model picker reserves it.
GPU_BATCH, GPU_CONTEXT = 64, 2048
GPU_POOL = 8 << 30                   # the other experiments' pool on a GPU (65k tokens at 8B shapes)
CPU_POOL = 1 << 30

# The full GPU run is designed for <= 10 minutes on one H100 with the 8B
# timing model in bf16 and the 135M default model for quality. Estimates (not
# measured here: this was written on a CPU), from 16 GB of weights per step
# (>= 5.4 ms at ~3 TB/s; ~15 ms assumed for an eager step at batch <= 16):
#   roofline              ~15 s  12 decode steps at each of batch 1, 4, 16, 64; 6 prefills of 512 tokens
#   kv-cache              ~45 s  naive 1024 tokens = 1024 dense passes (~16 s), cached (~15 s), once each
#   batching              ~20 s  prefills of up to 64 x 2048 tokens (~5 s at batch 64), 12 steps per batch
#   continuous-vs-static  ~30 s  64 requests of <= 256 tokens on 16 seats, twice
#   prefix                ~10 s  2 x 17 prompts with a 2048-token shared system prompt, 8 tokens out
#   speculative           ~40 s  (135M) 2 workloads x (plain + 4 k) x 2 runs x 128 tokens
#   quantization          ~40 s  3 configs x (8B engine + quantize, 24 steps) + 135M perplexity
#   compile              ~100 s  5 batch buckets; the compile issue's goal is <= 60 s (206 s for the 135M
#                                model before it: then the run takes ~11 minutes)
#   peer                  ~45 s  transformers' copy of the 8B, 4 static groups x <= 256 steps
#   overhead              ~20 s  tiny + 8B at batch 1..256, 22 steps and 22 forward passes each
#   serving               ~60 s  32 users all at once (~5 s), then Poisson at 1/4..3/2 of that capacity
#   tensor-parallel       ~30 s  one GPU: N = 1, 3 on the host CPU with gloo (135M); arithmetic instant
#   kv-compression        ~60 s  three 1B engines held at once (2.5 GB of weights + a 4.3 GB pool each), 8 x 4k
#                                prefills, 12 steps each; 2 x 4096 steps of the tiny model (engine overhead)
# Sum ~520 s, plus engine start-ups (random weights are made on the device: < 1 s each).


@functools.lru_cache(maxsize=None)
def model_config(path: str):
    """A model's config and parameter count, from the meta device (nothing allocated or read)."""
    model, cfg = load_model(path, device="meta")
    return cfg, sum(p.numel() for p in model.parameters())   # a tied head is one parameter, counted once


def weights_label(path: str) -> str:
    """What a figure's weights are: the README and the JSON say it wherever weights are random."""
    if str(path).startswith(RANDOM_PREFIX):
        name = parse_random_path(path)[0]
        return "random weights, " + ("made-up shapes" if name in UNPUBLISHED_PRESETS else "published shapes")
    return "checkpoint weights"


def pick_timing_model(free_bytes: int, dtype: torch.dtype):
    """The largest published preset that fits comfortably in `free_bytes`: (path or None, why).

    Comfortably = twice the weights (the peer experiment holds transformers'
    copy beside the engine's, and an experiment's next engine is built while
    its last is still referenced) + the largest KV pool asked for (two
    default pools, or the batching experiment's), + 10% and 2 GiB for
    activations, logits, CUDA graphs and the allocator's slack."""
    bpv = torch.finfo(dtype).bits // 8
    for name in LECTURE_PRESETS:
        cfg, params = model_config(RANDOM_PREFIX + name)
        weights = params * bpv
        pool = max(2 * GPU_POOL, kv_cache_bytes(cfg, dtype, GPU_BATCH * (GPU_CONTEXT + 96)))
        need = int(1.1 * (2 * weights + pool)) + (2 << 30)
        if need <= free_bytes:
            return RANDOM_PREFIX + name, (f"{name}: 2 x {weights / 1e9:.1f} GB of weights + {pool / 1e9:.1f} GB "
                                          f"of KV pool + headroom = {need / 1e9:.0f} GB of {free_bytes / 1e9:.0f} "
                                          "GB free")
    return None, f"no preset fits in {free_bytes / 1e9:.0f} GB free"


# ----------------------------------------------------------------------------
# Helpers: quiet engines, timing, tables
# ----------------------------------------------------------------------------


class Bench:
    """The run's settings and the helpers every experiment shares."""

    def __init__(self, args):
        self.args, self.quick = args, args.quick
        self.device = torch.device(args.device if args.device != "auto" else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = args.dtype
        self.torch_dtype = resolve_device_dtype(self.device, args.dtype, None)[1]
        # Two models: `path` for the timing experiments, `quality_path` for the
        # figures that need trained weights. Both the same unless a GPU run picks
        # a lecture-scale preset for timing (see the module docstring).
        self.quality_path = args.model or default_model_path()
        self.path, self.scale = self.quality_path, "--model" if args.model else "the default model"
        if args.model is None and self.device.type == "cuda" and not self.quick:  # pragma: no cover (CUDA)
            picked, why = pick_timing_model(torch.cuda.mem_get_info(self.device)[0], self.torch_dtype)
            self.path, self.scale = picked or self.path, why
        self.machine = {}                      # bandwidth and FLOP/s, measured once
        self.used = {}                         # models the current experiment ran: path -> weights label

    def q(self, full, quick, gpu=None):
        """The full run's setting, the smoke run's, or (a full run on a GPU, if given) the lecture-scale one."""
        if self.quick:
            return quick
        return gpu if gpu is not None and self.device.type == "cuda" else full

    def note(self, path):
        """Record that the current experiment's figures come from `path`'s weights."""
        self.used[str(path)] = weights_label(path)
        return path

    def pool_bytes(self, path, tokens: int) -> int:
        """A KV pool holding `tokens` tokens of `path`'s model (the lecture's formula), +10% and 4096 tokens
        for partly filled blocks."""
        cfg, _ = model_config(str(path))
        return int(1.1 * kv_cache_bytes(cfg, self.torch_dtype, tokens)) + kv_cache_bytes(cfg, self.torch_dtype, 4096)

    def llm(self, path=None, **kw):
        """An engine on the bench's timing model (or `path`) and device, without its start-up chatter."""
        kw.setdefault("device", str(self.device))
        kw.setdefault("dtype", self.dtype)
        # A fixed pool, not "most of the free memory": experiments hold two engines
        # at once. The smoke run's is small: zeroing 1 GiB costs ~1 s per engine here.
        kw.setdefault("kv_cache_bytes", GPU_POOL if self.device.type == "cuda" else self.q(CPU_POOL, CPU_POOL // 8))
        gc.collect()                       # engines hold reference cycles: free the last one's pool first
        if self.device.type == "cuda":  # pragma: no cover (CUDA)
            torch.cuda.empty_cache()
        with contextlib.redirect_stdout(io.StringIO()):
            return LLM(self.note(path or self.path), **kw)

    def sync(self):
        device_sync(self.device)()

    def timeit(self, fn, repeats: int, warmup: int = 1) -> float:
        """Median seconds of fn() over repeats, after warm-up calls, synchronized
        with the bench's device (support/timing.py: why each of those)."""
        return median_seconds(fn, repeats, warmup, sync=self.sync)

    @staticmethod
    def progress(msg: str):
        """One line, rewritten in place, on a terminal's stderr (the tables stay clean)."""
        if sys.stderr.isatty():
            sys.stderr.write("\r  " + msg[:110].ljust(110))
            sys.stderr.flush()

    @staticmethod
    def done():
        if sys.stderr.isatty():
            sys.stderr.write("\r" + " " * 114 + "\r")

    def bandwidth(self) -> float:
        """Bytes/s of a large copy, counting bytes read + written."""
        if "bandwidth" not in self.machine:
            # Far larger than any cache (256 MB), so the copy streams from DRAM/HBM:
            # this is the denominator of the decode roofline.
            n = self.q(256, 32) * 2**20 // 4
            a, b = torch.randn(n, device=self.device), torch.empty(n, device=self.device)
            t = batch_seconds(lambda: b.copy_(a), self.device, calls=self.q(20, 4), samples=self.q(5, 3))
            self.machine["bandwidth"] = 2 * a.numel() * 4 / t
        return self.machine["bandwidth"]

    def flops(self, dtype) -> float:
        """FLOP/s of a square matmul in the engine's dtype."""
        if "flops" not in self.machine:
            # A big square matmul is the most compute-bound op there is: its rate
            # is the ceiling prefill can approach (the other roofline).
            n = self.q(4096 if self.device.type == "cuda" else 1024, 256)
            a = torch.randn(n, n, device=self.device, dtype=dtype)
            t = batch_seconds(lambda: a @ a, self.device, calls=self.q(10, 2), samples=self.q(5, 3))
            self.machine["flops"] = 2 * n**3 / t
        return self.machine["flops"]


def batch_seconds(fn, device, calls: int, samples: int) -> float:
    """Median seconds of ONE fn() call, each of `samples` samples timing `calls` calls back to back.

    Why a batch: a ~0.2 ms GPU copy timed alone pays a host synchronization and
    the clock's granularity every time (5-10% of it), so the bandwidth reads low
    and every "fraction of roofline" high. On CUDA, events recorded on the stream
    around each batch time the device itself, and the host waits once, at the end;
    on a CPU the clock brackets `calls` calls."""
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
    """A Markdown table; floats get 3 significant digits."""
    def fmt(x):        # 3 significant digits: the noise of a shared machine is larger than that
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1e5 else f"{x:.3e}"
        return str(x)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def percentile(xs, p: float):
    """The nearest-rank p-th percentile (p in [0, 100]): a value that occurred.
    Of fewer than 100 values, p99 is the largest: say so where it is printed."""
    xs = sorted(xs)
    return xs[max(0, min(len(xs) - 1, math.ceil(p / 100 * len(xs)) - 1))] if xs else float("nan")


def start_decoding(llm, batch: int, context: int, steps: int) -> list[str]:
    """Add `batch` requests of `context` random tokens and step until every
    one has its first token (prefill done, maybe chunked): from then on each
    step is a pure decode of `batch` tokens. A request that fails (the engine
    isolates it) raises here, or the loop would wait for it forever."""
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
    """Median time of one engine step with `batch` sequences decoding at
    ~`context` tokens each (prefill done first, not timed)."""
    # Random token ids are fine here: a step's cost depends on how many tokens
    # and how much context, never on which tokens (and ignore_eos keeps every
    # sequence alive for the whole measurement).
    ids = start_decoding(llm, batch, context, steps)
    t = b.timeit(llm.step, steps, warmup=2)   # every timed step is a pure decode of `batch` tokens
    for rid in ids:                           # give the blocks back for the next measurement
        llm.abort(rid)
    return t


def model_flops_per_token(cfg, context: int) -> float:
    """2 FLOPs per weight of every matmul, plus attention's QK^T and PV over the context."""
    # assignment: roofline
    d, h, kv, hd, f = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    # q, k, v, o projections + gate, up, down (each 2 * in * out), then attention:
    # QK^T and PV are each 2 * H * head_dim FLOPs per cached token.
    per_layer = 2 * (d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f) + 4 * h * hd * context
    return cfg.n_layers * per_layer + 2 * d * cfg.vocab_size
    # end assignment


# ----------------------------------------------------------------------------
# Comparing two paths: exact in float32, honest in bf16
# ----------------------------------------------------------------------------
# In float32 every path of this engine (KV cache, compiled, speculative, split over
# N devices) gives exactly the dense path's greedy tokens: tests/ proves it, and a
# table says "same tokens: True". In bf16 each path rounds differently (another
# summation order, another kernel), so two correct paths part after a few tokens
# and "same tokens" reads False in every row: no information. There two paths are
# compared by the greedy tokens they share up to the first divergence, and each
# path by its largest |logit difference| from float32 arithmetic on the same
# weights and the same tokens: bf16's rounding shows as ~0.1, a wrong path as ~1-10.

def exact(dtype) -> bool:
    """Whether two correct paths must give the same greedy tokens (float32 only)."""
    return dtype == torch.float32


def agreement(a, b) -> int:
    """How many leading tokens two greedy outputs share: the position of the first divergence."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tokens_cell(dtype, a, ref):
    """A table's comparison of output `a` with `ref`: exact equality in float32, else "shared/total"."""
    return a == ref if exact(dtype) else f"{agreement(a, ref)}/{len(ref)}"


def tokens_header(dtype, what: str = "same tokens") -> str:
    return what if exact(dtype) else "tokens shared (to 1st divergence)"


class LogitTap:
    """While active, records the logits an engine's steps return (LLM._forward), row by row:
    [(request id, position, first position fed that step, tokens fed up to the row, logits)].
    A row predicts the token after `position`; a row behind a rejected draft was conditioned
    on a token the output does not keep, and `rows()` drops it."""

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

    def rows(self, out) -> dict:
        """{position: logits} of one finished output, only rows conditioned on its own tokens."""
        seq = list(out.prompt_token_ids) + list(out.token_ids)
        return {p: row for rid, p, start, fed, row in self.seen if rid == out.request_id and seq[start:p + 1] == fed}


def naive_rows(model, prompt, n: int):
    """(tokens, {position: logits}) of model.generate's naive greedy run: each step's last row."""
    rows = {}
    hook = model.register_forward_hook(lambda m, args, out: rows.__setitem__(len(args[0]) - 1, out[-1].float().cpu()))
    try:
        tokens = generate(model, prompt, n)
    finally:
        hook.remove()
    return tokens, rows


@contextlib.contextmanager
def float32_weights(model):
    """The model's weights and buffers upcast to float32 in place, cast back afterwards
    (bf16 -> fp32 -> bf16 is exact). Not on an engine that recorded CUDA graphs: their
    addresses would change."""
    old = [(t, t.dtype) for t in itertools.chain(model.parameters(), model.buffers()) if t.is_floating_point()]
    for t, _ in old:
        t.data = t.data.float()
    try:
        yield model
    finally:
        for t, dtype in old:
            t.data = t.data.to(dtype)


@torch.inference_mode()
def float32_gaps(model, paths) -> list:
    """Each path's largest |logit - float32 logit|: paths = [(tokens, {position: logits})], the float32
    logits from one dense pass of `model` (weights upcast) over the path's own tokens."""
    device, gaps = next(model.parameters()).device, []
    with float32_weights(model):
        for tokens, rows in paths:
            if not rows:
                gaps.append(float("nan"))
                continue
            ids = torch.tensor(tokens[:max(rows) + 1], device=device)
            ref = model(ids, torch.arange(len(ids), device=device)).float()          # [T, V]
            pos = sorted(rows)
            gaps.append((torch.stack([rows[p] for p in pos]) - ref[pos].cpu()).abs().max().item())
    return gaps


# ----------------------------------------------------------------------------
# Quality: perplexity on a fixed English text, dense and through the engine
# ----------------------------------------------------------------------------

EVAL_TEXT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "fixtures", "eval_text.txt")


def eval_text() -> str:
    """The evaluation text: English prose written for this project, shipped
    with it, so the figure is the same on every machine and offline."""
    with open(EVAL_TEXT_PATH, encoding="utf-8") as f:
        return f.read()


@torch.inference_mode()
def perplexity(model: torch.nn.Module, token_ids: list[int], window: int = 512) -> float:
    """exp(mean negative log-likelihood) of each token given the ones before it.

    The text is cut into windows of `window` predicted tokens, each run through
    the dense path (no cache); every token after the first is predicted once.
    Lower is better; a uniform guess over V tokens scores V.
    """
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = torch.tensor(token_ids[start:start + window + 1], device=device)   # window + 1 tokens
        logits = model(chunk[:-1], torch.arange(len(chunk) - 1, device=device))     # [T, V]
        nll += F.cross_entropy(logits.float(), chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)


@torch.inference_mode()
def paged_perplexity(llm, ids: list[int], chunk: int = 256) -> float:
    """Perplexity through the engine's own path: paged KV cache (int8 if so
    configured), chunked prefill, every position's logits."""
    # The same steps LLM.step takes for a prefill, done by hand so that every
    # position's logits come back (the engine keeps only the last). Sequence
    # id -1 never collides with the engine's own ids, which count from 0.
    bm, sid, nll = llm.block_manager, -1, 0.0
    bm.allocate(sid, [])
    for start in range(0, len(ids) - 1, chunk):
        toks = ids[start:min(start + chunk, len(ids) - 1)]
        bm.reserve(sid, start, len(toks))
        x, pos, ctx = AttentionContext.build(llm.cache, bm, [(sid, toks, start)], list(range(len(toks))), llm.device)
        logits = llm.model(x, pos, ctx)
        target = torch.tensor(ids[start + 1:start + 1 + len(toks)], device=llm.device)
        nll += F.cross_entropy(logits.float(), target, reduction="sum").item()
    bm.free(sid)
    return math.exp(nll / (len(ids) - 1))


def workload(b: Bench, vocab: int, seed: int = 0):
    """The heterogeneous workload: prompt and output lengths from a wide,
    skewed (log-uniform) distribution, fixed seed."""
    # Log-uniform: as many short requests as long ones per factor of two, the
    # mix that makes static batching wait for its longest member.
    rng = random.Random(seed)
    n, lo, hi = b.q(64, 8), b.q(16, 4), b.q(256, 32)
    draw = lambda: int(math.exp(rng.uniform(math.log(lo), math.log(hi))))   # noqa: E731
    prompts = [[rng.randrange(vocab) for _ in range(draw())] for _ in range(n)]
    return prompts, [draw() for _ in range(n)]


# ----------------------------------------------------------------------------
# The experiments
# ----------------------------------------------------------------------------


def _bare_forward(llm):
    """The forward pass of the engine's next decode step alone, as a function:
    its inputs built now, outside any clock; no scheduling, sampling or detokenizing."""
    seqs = llm.scheduler.running
    for s in seqs:                                 # room for the token the step will feed (idempotent)
        llm.block_manager.reserve(s.seq_id, s.num_computed, 1)
    hb = llm.inputs.host([(s.seq_id, s.token_ids[-1:], s.num_computed) for s in seqs])
    if llm.decoder is not None:
        return lambda: llm.decoder(hb.input_ids, hb.positions, hb.slot_mapping, llm.inputs.tables[hb.rows])
    x, pos, ctx = llm.inputs.device(hb, llm.cache)
    return lambda: llm.model(x, pos, ctx)          # writes the slots the step then writes with the same values


def step_and_forward_seconds(b: Bench, llm, batch: int, context: int, steps: int) -> dict:
    """The engine's decode step and the bare forward pass of the same batch,
    timed alternately (the pass of the batch as it stands, then the step that
    runs it), so both see the same machine: a shared machine's noise hits them
    alike. The gap between them is the engine's own work. Returns the medians
    and the fastest runs (noise only adds time: the fastest is the best estimate)."""
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


def exp_overhead(b: Bench):
    """The engine's work around the forward pass, next to the pass itself."""
    context, steps = b.q(32, 8), 20     # steps of these models cost milliseconds: 20 even in a smoke run
    batches = b.q([1, 4, 16, 64, 256], [1, 4])
    models = [("tiny", TINY_MODEL)] + ([] if b.path == TINY_MODEL else [(os.path.basename(b.path), b.path)])
    rows, fig = [], {"context": context, "points": []}
    for name, path in models:
        # The pool from the model's own KV bytes per token: every sequence holds its
        # context, the warm-up and timed steps, and the forward pass's extra token.
        pool = b.pool_bytes(path, max(batches) * (context + steps + 8))
        llm = b.llm(path=path, max_num_seqs=max(batches), kv_cache_bytes=pool)
        for B in batches:
            b.progress(f"overhead: {name}, batch {B}")
            t = step_and_forward_seconds(b, llm, B, context, steps)
            step, fwd = t["step_median"], t["forward_median"]
            p = {"model": name, "batch": B, "step_ms": step * 1e3, "forward_ms": fwd * 1e3,
                 "step_min_ms": t["step_min"] * 1e3, "forward_min_ms": t["forward_min"] * 1e3,
                 "overhead_ms": (step - fwd) * 1e3, "overhead_fraction": max(0.0, step - fwd) / step}
            fig["points"].append(p)
            rows.append([name, B, p["step_ms"], p["forward_ms"], p["overhead_ms"], f"{p['overhead_fraction']:.0%}"])
        del llm
    text = (f"Greedy decode at a {context}-token context. `tiny` is a random 2-layer, 64-dim Llama with the real "
            "49152-token vocabulary: its forward pass is nearly free, so its step time is the engine's own "
            "work (scheduling, input building, sampling, detokenizing, outputs).\n\n" +
            table(["model", "batch", "engine step (ms)", "forward pass (ms)", "engine overhead (ms)",
                   "overhead share"], rows))
    return fig, text


def _roofline_points(b: Bench, llm, batches, context: int, W: int, kv: int, flop_tok: float) -> list:
    """Measured decode steps at each batch, as roofline points: arithmetic intensity
    (the step's FLOPs over its bytes: every weight once, each sequence's KV) and the
    FLOP/s the step attained."""
    points = []
    for B in batches:
        b.progress(f"roofline: decode step at batch {B}")
        t = decode_step_seconds(b, llm, B, context, b.q(10, 3))
        step_flops, step_bytes = flop_tok * B, W + kv * context * B
        points.append({"batch": B, "step_ms": t * 1e3, "flops_per_byte": step_flops / step_bytes,
                       "attained_flops_per_s": step_flops / t, "bound_ms": max(step_bytes / b.bandwidth(),
                                                                               step_flops / b.flops(llm.dtype)) * 1e3})
    return points


def exp_roofline(b: Bench):
    context, batches = b.q(512, 32), b.q([1, 4, 16], [1, 4], gpu=[1, 4, 16, 64])
    # No prefix caching: the prefill is timed on the same prompt again and again,
    # and every run must compute all of it.
    llm = b.llm(max_num_seqs=max(batches), enable_prefix_caching=False,
                kv_cache_bytes=b.pool_bytes(b.path, max(batches) * (context + 96)))
    cfg, bw = llm.config, b.bandwidth()
    flops = b.flops(llm.dtype)
    W, kv = decode_weight_bytes(llm.model), llm.cache.bytes_per_token
    flop_tok = model_flops_per_token(cfg, context)
    # The lecture's decode bound: a batch-1 step must read every weight and the
    # sequence's whole KV cache once, so it cannot beat bytes / bandwidth.
    decode_bound = (W + kv * context) / bw
    points = _roofline_points(b, llm, batches, context, W, kv, flop_tok)
    decode = points[0]["step_ms"] / 1e3
    b.progress("roofline: prefill")
    prompt = list(range(10, 10 + context))
    prefill = b.timeit(lambda: llm.generate([prompt], SamplingParams(max_tokens=1)), b.q(5, 2))
    # Prefill does `context` tokens per weight read: FLOPs dominate, so its bound
    # is the compute time (or the weight read, if that were longer).
    prefill_bound = max(flop_tok * context / flops, W / bw)
    rows = []
    for B in (1, 4, 16, 64, 256):
        # B sequences share one read of the weights but each reads its own KV
        # cache: intensity grows ~B until the KV bytes dominate the weights.
        step_flops, step_bytes = flop_tok * B, W + kv * context * B
        t = max(step_bytes / bw, step_flops / flops)
        rows.append([B, step_flops / step_bytes, "memory" if step_bytes / bw >= step_flops / flops else "compute",
                     t * 1e3, B / t])
    fig = {"bandwidth_GBps": bw / 1e9, "matmul_TFLOPs": flops / 1e12, "weight_bytes": W,
           "dtype": str(llm.dtype).replace("torch.", ""),
           "kv_bytes_per_token": kv, "context": context, "flops_per_token": flop_tok,
           "decode_bound_ms": decode_bound * 1e3, "decode_measured_ms": decode * 1e3,
           "decode_fraction_of_roofline": decode_bound / decode, "decode_points": points,
           "prefill_tokens": context, "prefill_bound_ms": prefill_bound * 1e3, "prefill_measured_ms": prefill * 1e3,
           "prefill_fraction_of_roofline": prefill_bound / prefill,
           # prefill reads the weights once and writes `context` tokens of KV for flop_tok * context FLOPs
           "prefill_point": {"flops_per_byte": flop_tok * context / (W + kv * context),
                             "attained_flops_per_s": flop_tok * context / prefill},
           "machine_balance_flops_per_byte": flops / bw,
           "intensity": [{"batch": r[0], "flops_per_byte": r[1], "bound_by": r[2], "bound_ms": r[3]} for r in rows]}
    measured = [[f"decode, batch {p['batch']}, {context}-token context", p["bound_ms"], p["step_ms"],
                 p["bound_ms"] / p["step_ms"], p["flops_per_byte"], p["attained_flops_per_s"] / 1e9] for p in points]
    measured.append([f"prefill of {context} tokens", prefill_bound * 1e3, prefill * 1e3, prefill_bound / prefill,
                     fig["prefill_point"]["flops_per_byte"], fig["prefill_point"]["attained_flops_per_s"] / 1e9])
    text = (f"Device: {bw / 1e9:.1f} GB/s copy bandwidth, {flops / 1e12:.2f} TFLOP/s matmul "
            f"({llm.dtype}); machine balance {flops / bw:.0f} FLOP/byte.\n"
            f"Weights read per decode step {W / 1e6:.1f} MB, KV cache {kv} B/token.\n\n" +
            table(["step", "bound (ms)", "measured (ms)", "fraction of roofline", "FLOP/byte", "attained GFLOP/s"],
                  measured) +
            "\n\nArithmetic intensity of a decode step (FLOPs per byte ~ batch size):\n\n" +
            table(["batch", "FLOP/byte", "bound by", "bound step (ms)", "bound tokens/s"], rows))
    return fig, text


def exp_kv_cache(b: Bench):
    # No prefix caching: every cached run must compute its prompt too, as the naive one does.
    llm = b.llm(max_num_seqs=1, enable_prefix_caching=False)
    prompt = llm.tokenizer.encode(eval_text())[:32]
    rows, fig = [], {"prompt_tokens": len(prompt), "dtype": str(llm.dtype).replace("torch.", ""), "lengths": []}
    # Naive generation re-runs the whole sequence every step (O(T^2) token
    # passes); with the cache each step is one token (O(T)). So the speedup
    # must grow with the output length, and the tokens must be the same.
    # (A GPU goes to 1024 tokens, the goal's length; the long runs are timed once:
    # they take seconds to minutes and warm themselves.)
    for n in b.q([32, 128, 256], [8, 16], gpu=[64, 256, 1024]):
        reps = b.q(3, 1, gpu=3 if n < 256 else 1)
        b.progress(f"kv-cache: {n} tokens, naive")
        t_naive, naive_ids = timed(lambda: generate(llm.model, prompt, n), reps, 0 if n > 64 else 1, b.sync)
        b.progress(f"kv-cache: {n} tokens, cached")
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        t_cache, out = timed(lambda: llm.generate([prompt], params)[0], reps, 1 if reps > 1 else 0, b.sync)
        p = {"tokens": n, "naive_ms_per_token": t_naive / n * 1e3, "cached_ms_per_token": t_cache / n * 1e3,
             "speedup": t_naive / t_cache, "naive_tokens": len(naive_ids), "cached_tokens": len(out.token_ids),
             "shared_tokens": agreement(out.token_ids, naive_ids)}
        if exact(llm.dtype):
            p["same_tokens"] = out.token_ids == naive_ids
        fig["lengths"].append(p)
        rows.append([n, t_naive / n * 1e3, t_cache / n * 1e3, t_naive / t_cache,
                     tokens_cell(llm.dtype, out.token_ids, naive_ids)])
    text = table(["output tokens", "naive ms/token", "KV cache ms/token", "speedup", tokens_header(llm.dtype)], rows)
    if not exact(llm.dtype):
        # Each path's rounding, measured on a short untimed run: both paths against float32.
        n = fig["lengths"][0]["tokens"]
        naive = naive_rows(llm.model, prompt, n)
        with LogitTap(llm) as tap:
            out = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        cached = (prompt + out.token_ids, tap.rows(out))
        gaps = float32_gaps(llm.model, [(prompt + naive[0], naive[1]), cached])
        fig["max_logit_diff_vs_float32"] = {"tokens": n, "naive": gaps[0], "cached": gaps[1]}
        text += (f"\n\n{fig['dtype']}: the two paths round differently, so their greedy tokens part after a few; "
                 "the column counts the tokens they share up to the first divergence. Largest |logit - float32 "
                 f"logit| over {n} tokens (same weights, same tokens): naive {gaps[0]:.3g}, KV cache {gaps[1]:.3g}.")
    return fig, text


def exp_batching(b: Bench):
    # A GPU runs the lecture-scale case (batch 64 at a 2k context: the KV bytes
    # of the batch reach the weights' at 8B shapes); a CPU a short context.
    max_b = b.q(64, 4, gpu=GPU_BATCH)
    context, steps = b.q(128, 16, gpu=GPU_CONTEXT), b.q(10, 3)
    # "Up to the memory limit": the pool holds max_b sequences of context + timed
    # steps + warm-up and slack, and no more sequences are asked for than it holds.
    per_seq = context + steps + 80
    llm = b.llm(max_num_seqs=max_b, kv_cache_bytes=b.pool_bytes(b.path, max_b * per_seq))
    max_b = min(max_b, llm.block_manager.num_blocks * llm.block_manager.block_size // per_seq)
    bw, flops = b.bandwidth(), b.flops(llm.dtype)
    W, kv, flop_tok = decode_weight_bytes(llm.model), llm.cache.bytes_per_token, model_flops_per_token(llm.config, context)
    rows, B = [], 1
    fig = {"context": context, "weight_bytes": W, "kv_bytes_per_token": kv, "dtype": str(llm.dtype)[6:], "points": []}
    while B <= max_b:
        b.progress(f"batching: batch {B}")
        t = decode_step_seconds(b, llm, B, context, steps)
        # The roofline of this step: B sequences share one read of the weights,
        # each reads its own context's KV; or the FLOPs, if they take longer.
        bound = max((W + kv * context * B) / bw, flop_tok * B / flops)
        rows.append([B, t * 1e3, B / t, bound * 1e3, bound / t])
        fig["points"].append({"batch": B, "step_ms": t * 1e3, "tokens_per_s": B / t, "bound_ms": bound * 1e3})
        B *= 2
    # The knee: while decode is memory-bound, adding sequences is nearly free
    # (the step time stays flat, tokens/s grows ~B); once the step time has
    # doubled, each extra sequence costs latency for everyone.
    base = fig["points"][0]["step_ms"]
    knee = next((p["batch"] for p in fig["points"] if p["step_ms"] >= 2 * base), None)
    fig["knee_batch"] = knee
    fig["throughput_gain_max_vs_1"] = fig["points"][-1]["tokens_per_s"] / fig["points"][0]["tokens_per_s"]
    text = f"Decode steps at a {context}-token context.\n\n"
    text += table(["batch", "step (ms)", "tokens/s", "roofline step (ms)", "fraction of roofline"], rows)
    text += (f"\n\nThroughput at batch {fig['points'][-1]['batch']} is {fig['throughput_gain_max_vs_1']:.1f}x "
             f"batch 1; " + (f"the step time doubles (the knee) at batch {knee}." if knee else
                             "the step time never doubled: no knee up to this batch."))
    return fig, text


def _latency_stats(outs, t0, total_s):
    """Throughput and the two latencies a user feels: time to first token
    (queueing + prefill, measured from t0, when every request arrived) and
    time per output token after the first (the decode step of the whole batch)."""
    ttft = sorted(o.metrics.first_token_time - t0 for o in outs)
    tpot = [(o.metrics.finish_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
            for o in outs if len(o.token_ids) > 1]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"requests": len(outs), "output_tokens": tokens, "tokens_per_s": tokens / total_s,
            "ttft_mean_s": statistics.mean(ttft),
            "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))], "tpot_mean_ms": statistics.mean(tpot) * 1e3,
            "seconds": total_s}


def exp_continuous_vs_static(b: Bench):
    B = b.q(16, 4)
    llm = b.llm(max_num_seqs=B)
    prompts, lengths = workload(b, llm.config.vocab_size)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate([prompts[0]], params[0])                                   # warm-up
    # Both runs use the same engine with the same seat count B; the only
    # difference is when a seat may be refilled: at the end of the group
    # (static) or at the very next step (continuous).
    b.progress("continuous-vs-static: static groups")
    t0, outs = time.perf_counter(), []
    for i in range(0, len(prompts), B):                                     # a group runs to completion
        outs += llm.generate(prompts[i:i + B], params[i:i + B])
    static = _latency_stats(outs, t0, time.perf_counter() - t0)
    b.progress("continuous-vs-static: continuous")
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    cont = _latency_stats(outs, t0, time.perf_counter() - t0)
    fig = {"requests": len(prompts), "batch": B, "static": static, "continuous": cont,
           "throughput_speedup": cont["tokens_per_s"] / static["tokens_per_s"]}
    rows = [[name, r["tokens_per_s"], r["ttft_mean_s"], r["ttft_p90_s"], r["tpot_mean_ms"]]
            for name, r in (("static", static), ("continuous", cont))]
    text = (f"{len(prompts)} requests, prompt and output lengths log-uniform in [{b.q(16, 4)}, {b.q(256, 32)}], "
            f"all arriving at t=0, batch {B}.\n\n" +
            table(["batching", "output tokens/s", "mean TTFT (s)", "p90 TTFT (s)", "mean TPOT (ms)"], rows) +
            f"\n\nContinuous batching: {fig['throughput_speedup']:.2f}x the throughput of static batching.")
    return fig, text


def exp_prefix(b: Bench):
    n, out = b.q(16, 4), b.q(8, 4)
    rows, fig = [], {}
    for caching in (False, True):
        # A fresh engine each time, so the "off" run cannot profit from blocks
        # the "on" run cached and vice versa.
        llm = b.llm(enable_prefix_caching=caching, max_num_seqs=n)
        # A GPU gets the goal's 2k-token system prompt (the shipped text, repeated to length).
        length, text = b.q(512, 48, gpu=2048), llm.tokenizer.encode(eval_text())
        system = (text * math.ceil(length / len(text)))[:length]
        prompts = [system + llm.tokenizer.encode(f" Question {i}: what happens next?") for i in range(n + 1)]
        params = SamplingParams(max_tokens=out, ignore_eos=True)
        # The system prompt is seen once first, as in a chat service that has been
        # running: with caching its full blocks are now in the pool's hash table.
        llm.generate([prompts[0]], params)
        hits0, queries0 = llm.block_manager.prefix_hits, llm.block_manager.prefix_queries
        b.progress(f"prefix: caching {'on' if caching else 'off'}")
        t0 = time.perf_counter()
        outs = llm.generate(prompts[1:], params)
        total = time.perf_counter() - t0
        stats = _latency_stats(outs, t0, total)
        queries = llm.block_manager.prefix_queries - queries0
        hit_rate = (llm.block_manager.prefix_hits - hits0) / queries if queries else 0.0
        cached = sum(o.metrics.cached_tokens for o in outs) / sum(o.metrics.prompt_tokens for o in outs)
        key = "on" if caching else "off"
        fig[key] = {**stats, "block_hit_rate": hit_rate, "cached_prompt_fraction": cached}
        rows.append([key, stats["ttft_mean_s"], stats["seconds"], hit_rate, cached])
    # What the block structure predicts: a prompt reuses the full blocks of the
    # system prompt it shares (tests/test_bench.py checks the measured fractions against it).
    fig.update(system_prompt_tokens=len(system), block_size=llm.block_manager.block_size,
               prompt_tokens=[len(p) for p in prompts[1:]])
    fig["ttft_speedup"] = fig["off"]["ttft_mean_s"] / fig["on"]["ttft_mean_s"]
    fig["time_speedup"] = fig["off"]["seconds"] / fig["on"]["seconds"]
    text = (f"{n} requests sharing a {len(system)}-token system prompt, {out} output tokens each.\n\n" +
            table(["prefix caching", "mean TTFT (s)", "total (s)", "block hit rate", "prompt tokens cached"], rows) +
            f"\n\nPrefix caching: TTFT {fig['ttft_speedup']:.2f}x faster, the batch {fig['time_speedup']:.2f}x faster.")
    return fig, text


def _spec_prompts(llm, b: Bench):
    # Two ends of the acceptance rate: asked to repeat a passage, the answer is
    # in the prompt and prompt-lookup drafts are right; a story has nothing to
    # look up, so the drafts are mostly rejected and only cost verify work.
    tok = llm.tokenizer
    passage = " ".join(eval_text().split()[:b.q(120, 30)])
    asks = {"copy-heavy": f"Repeat the following text exactly, word for word:\n\n{passage}",
            "open-ended": "Write a short story about a lighthouse keeper and a storm."}
    return {name: tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
            for name, text in asks.items()}


def _spec_run(b: Bench, llm, prompt, params, k: int, plain) -> dict:
    """Time one drafter setting on one prompt against the plain run `plain` = (seconds, output, steps)."""
    t_plain, ref, plain_steps = plain
    t_spec = b.timeit(lambda: llm.generate([prompt], params), b.q(3, 1, gpu=2))
    s0 = dict(llm.stats)
    with LogitTap(llm) as tap:                   # (the untimed run: its rows are compared with float32 in bf16)
        o = llm.generate([prompt], params)[0]
    steps = llm.stats["steps"] - s0["steps"]
    drafted = llm.stats["draft_tokens"] - s0["draft_tokens"]
    alpha = (llm.stats["accepted_tokens"] - s0["accepted_tokens"]) / drafted if drafted else 0.0
    # The lecture's model: with acceptance a per draft token, a pass yields
    # (1 - a^(k+1)) / (1 - a) tokens on average; the speedup is that over
    # what one pass costs relative to a plain decode pass (k+1 query
    # tokens cost more than 1 once a step is not purely memory-bound).
    pass_cost = (t_spec / steps) / (t_plain / plain_steps)
    expected = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
    predicted = expected / pass_cost * (len(o.token_ids) / len(ref.token_ids))
    run = {"k": k, "alpha": alpha, "tokens": len(o.token_ids), "passes": steps,
           "tokens_per_pass": len(o.token_ids) / steps, "pass_cost_ratio": pass_cost,
           "speedup": t_plain / t_spec, "predicted_speedup": predicted,
           "shared_tokens": agreement(o.token_ids, ref.token_ids), "cell": tokens_cell(llm.dtype, o.token_ids,
                                                                                     ref.token_ids)}
    if exact(llm.dtype):
        run["same_tokens"] = o.token_ids == ref.token_ids
    else:
        run["max_logit_diff_vs_float32"] = float32_gaps(llm.model, [(prompt + o.token_ids, tap.rows(o))])[0]
    return run


def exp_speculative(b: Bench):
    # Acceptance is a quality figure (how often the model agrees with the
    # drafts), so this runs on the real model, never on random weights.
    drafters = ["ngram"] + ([b.args.draft] if b.args.draft else [])
    out = b.q(128, 16)
    params = SamplingParams(max_tokens=out)
    base_llm = b.llm(path=b.quality_path, max_num_seqs=1)
    prompts, dtype = _spec_prompts(base_llm, b), base_llm.dtype
    plain, fig = {}, {"dtype": str(dtype).replace("torch.", ""), "runs": []}
    for wname, prompt in prompts.items():
        b.progress(f"speculative: {wname}, plain")
        t_plain = b.timeit(lambda: base_llm.generate([prompt], params), b.q(3, 1, gpu=2))
        steps0 = base_llm.stats["steps"]
        with LogitTap(base_llm) as tap:
            ref = base_llm.generate([prompt], params)[0]
        plain[wname] = (t_plain, ref, base_llm.stats["steps"] - steps0)
        if not exact(dtype):                        # the plain path's own rounding, for comparison
            fig.setdefault("plain_max_logit_diff_vs_float32", {})[wname] = float32_gaps(
                base_llm.model, [(prompt + ref.token_ids, tap.rows(ref))])[0]
    del base_llm
    for drafter in drafters:
        for k in b.q([1, 2, 4, 6, 8], [1, 4], gpu=[1, 2, 4, 8]):
            # One engine per (drafter, k), running both workloads: engines cost seconds to build.
            llm = b.llm(path=b.quality_path, max_num_seqs=1, speculative=drafter, num_speculative_tokens=k)
            for wname, prompt in prompts.items():
                b.progress(f"speculative: {wname}, {os.path.basename(drafter)}, k={k}")
                run = _spec_run(b, llm, prompt, params, k, plain[wname])
                fig["runs"].append({"workload": wname, "drafter": os.path.basename(drafter), **run})
            del llm
    fig["runs"].sort(key=lambda r: (list(prompts).index(r["workload"]), r["drafter"], r["k"]))
    gap = [] if exact(dtype) else ["max |logit diff| vs float32"]
    rows = [[r["workload"], r["drafter"], r["k"], r["alpha"], r["tokens_per_pass"], r["pass_cost_ratio"],
             r["speedup"], r["predicted_speedup"], r.pop("cell")] + ([r["max_logit_diff_vs_float32"]] if gap else [])
            for r in fig["runs"]]
    text = (f"Greedy, {out} new tokens, batch 1. Predicted speedup = (1 - a^(k+1)) / (1 - a) tokens per "
            "pass / measured cost of a verify pass relative to a decode pass.\n\n" +
            table(["workload", "drafter", "k", "acceptance a", "tokens/pass", "pass cost", "speedup",
                   "predicted", tokens_header(dtype, "same tokens")] + gap, rows))
    if gap:
        text += (f"\n\n{fig['dtype']}: the tokens column counts those shared with plain decoding up to the first "
                 "divergence (a verify pass of k+1 tokens rounds differently from k+1 decode steps); the last column "
                 "is each run's largest |logit - float32 logit| on its own tokens; plain decoding's: " +
                 ", ".join(f"{w} {g:.3g}" for w, g in fig["plain_max_logit_diff_vs_float32"].items()) + ".")
    return fig, text


def exp_quantization(b: Bench):
    # Float is the baseline; on CPU bf16 is added, because int8 there runs with
    # bf16 activations and the fair question is what int8 adds over bf16.
    configs = [("float", {})]
    if b.device.type == "cpu" and b.dtype in ("auto", "float32"):
        configs.append(("bfloat16", {"dtype": "bfloat16"}))
    configs += [("int8 weights", {"quantization": "int8"}),
                ("int8 weights + int8 KV", {"quantization": "int8", "kv_cache_dtype": "int8"})]
    # Batch 1 is where bytes per step rule (int8 should win most); at a large
    # batch the step leans toward compute and the int8 kernels' cost shows.
    big, context = b.q(16, 4), b.q(128, 16)
    ids, rows, fig = None, [], {"configs": [], "quality_model": b.quality_path}
    for name, kw in configs:
        b.progress(f"quantization: {name}")
        llm = b.llm(max_num_seqs=big, **kw)
        t1 = decode_step_seconds(b, llm, 1, context, b.q(10, 3))
        tb = decode_step_seconds(b, llm, big, context, b.q(10, 3))
        c = {"name": name, "dtype": str(llm.dtype).replace("torch.", ""), "weight_bytes": decode_weight_bytes(llm.model),
             "kv_bytes_per_token": llm.cache.bytes_per_token, "tokens_per_s_batch1": 1 / t1,
             f"tokens_per_s_batch{big}": big / tb}
        # Perplexity is quality: measured on the real model with the same settings
        # (the same engine when the timing model is the real one).
        if b.quality_path != b.path:
            del llm
            llm = b.llm(path=b.quality_path, max_num_seqs=1, **kw)
        if ids is None:
            ids = llm.tokenizer.encode(eval_text())[:b.q(100000, 128)]
        c["perplexity"] = paged_perplexity(llm, ids)  # through the paged path, so the int8 KV cache counts too
        del llm
        fig["configs"].append(c)
        rows.append([name, c["dtype"], c["weight_bytes"] / 1e6, c["kv_bytes_per_token"], 1 / t1, big / tb,
                     c["perplexity"]])
    base = fig["configs"][0]
    for c in fig["configs"]:
        c["speedup_batch1"] = c["tokens_per_s_batch1"] / base["tokens_per_s_batch1"]
        c["perplexity_change"] = c["perplexity"] / base["perplexity"] - 1
    where = "" if b.quality_path == b.path else f" of {os.path.basename(b.quality_path)} (the same settings)"
    text = (f"Perplexity{where} on the shipped evaluation text ({len(ids)} tokens) through the engine's paged "
            "path.\n\n" + table(["weights", "activations", "weight MB/step", "KV B/token", "tokens/s batch 1",
                                  f"tokens/s batch {big}", "perplexity"], rows))
    return fig, text


_compiled_attention = None


def attention_bandwidth(cache, n_heads: int, batch: int, context: int, repeats: int = 5) -> dict:
    """Achieved bandwidth of one layer's decode attention (kernels.py's two).

    `batch` sequences of `context` tokens each, over distinct random blocks of
    the pool (cycling through the pool if it is too small), one query each.
    Bytes = the K and V bytes those tokens occupy in the cache (scales
    included for an int8 cache): what an attention that reads every byte
    once must read. Returns seconds and GB/s for the compiled in-place
    attention and for the eager gather + SDPA (batched_paged_attention).
    """
    global _compiled_attention
    if _compiled_attention is None:
        _compiled_attention = torch.compile(paged_attention_in_place, fullgraph=True)
    device, bs = cache.k.device, cache.block_size
    width = -(-context // bs)
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randperm(cache.num_blocks, generator=gen).repeat(-(-batch * width // cache.num_blocks))
    tables = blocks[:batch * width].view(batch, width).to(device)
    q = torch.randn(batch, 1, n_heads, cache.k.shape[-1], generator=gen).to(device, cache.dtype)
    q_pos = torch.full((batch, 1), context - 1, device=device)
    seq_lens = q_pos[:, 0] + 1
    dynamic(q, 0), dynamic(tables, 0, 1), dynamic(q_pos, 0)
    sync, one = device_sync(device), layer_cache(cache, 0)          # as the compiled step reads a layer
    with torch.inference_mode(), size_oblivious():
        t_fused = median_seconds(lambda: _compiled_attention(q, one, 0, tables, q_pos), repeats, sync=sync)
        t_gather = median_seconds(lambda: batched_paged_attention(q, cache, 0, tables, seq_lens), repeats, sync=sync)
    nbytes = batch * context * cache.bytes_per_token // cache.k.shape[0]     # one layer's share
    return {"bytes": nbytes, "in_place_s": t_fused, "in_place_GBps": nbytes / t_fused / 1e9,
            "gather_s": t_gather, "gather_GBps": nbytes / t_gather / 1e9}


def _compare_compiled(comp, prompt, eager_out, eager_rows, check) -> tuple[dict, str]:
    """The compiled engine's greedy tokens against the eager engine's: equal in float32; in
    bf16, shared up to the first divergence, and each path's largest |logit - float32 logit|."""
    with LogitTap(comp) as tap:
        out = comp.generate([prompt], check)[0]
    ref, dtype = eager_out.token_ids, comp.dtype
    if exact(dtype):
        same = out.token_ids == ref
        return {"same_tokens": same}, f"Greedy tokens of the compiled engine equal the eager engine's: {same}."
    # comp.model's weights are cast to float32 and back for the reference: its recorded CUDA
    # graphs then point at freed storage, so this runs last, when the engine is done.
    gaps = float32_gaps(comp.model, [(prompt + ref, eager_rows), (prompt + out.token_ids, tap.rows(out))])
    fig = {"shared_tokens": agreement(out.token_ids, ref), "tokens_compared": len(ref),
           "max_logit_diff_vs_float32": {"eager": gaps[0], "compiled": gaps[1]}}
    return fig, (f"{str(dtype).replace('torch.', '')}: the compiled engine's greedy tokens follow the eager "
                 f"engine's for {fig['shared_tokens']}/{len(ref)} tokens (fused kernels round differently); "
                 f"largest |logit - float32 logit| on their own tokens: eager {gaps[0]:.3g}, compiled {gaps[1]:.3g}.")


def exp_compile(b: Bench):
    # The smoke run compiles batch 1 only: each compiled graph costs ~20 s cold on
    # a 2-core CPU (batch 1 and batch > 1 are two graphs, see kernels.py).
    big, context, steps = b.q(16, 1), b.q(128, 16), b.q(10, 3)
    sizes = sorted({1, big})
    eager = b.llm(max_num_seqs=big)
    b.progress("compile: eager")
    e = {B: decode_step_seconds(b, eager, B, context, steps) for B in sizes}
    # The exactness check of the compiled path: the same greedy tokens (bit-exact in float32;
    # in bf16 fused and unfused roundings may differ after a few tokens: see _compare_compiled).
    prompt = eager.tokenizer.encode(eval_text())[:context]
    check = SamplingParams(max_tokens=b.q(32, 8), ignore_eos=True)
    with LogitTap(eager) as tap:
        ref = eager.generate([prompt], check)[0]
    ref_rows = tap.rows(ref)
    del eager
    b.progress("compile: compiling (warm-up of every bucket)")
    # Construction compiles and warms up every bucket; that one-off cost is
    # reported on its own (compile_seconds) and kept out of the step times.
    comp = b.llm(max_num_seqs=big, compile=True)
    b.progress("compile: compiled")
    c = {B: decode_step_seconds(b, comp, B, context, steps) for B in sizes}
    # Split the gain in two: the same engine with its decoder switched off runs
    # eagerly on the re-laid-out weights, isolating the layout from compilation.
    decoder, comp.decoder = comp.decoder, None
    l1 = decode_step_seconds(b, comp, 1, context, steps)
    comp.decoder = decoder
    # Compare the compiled batch-1 step with the same roofline as exp_roofline.
    W = decode_weight_bytes(comp.model)
    bound = (W + comp.cache.bytes_per_token * context) / b.bandwidth()
    fig = {"compile_seconds": comp.compile_seconds, "weight_layout": comp.weight_layout, "batches": sizes,
           "context": context, "weight_bytes": W, "eager_layout_ms_batch1": l1 * 1e3,
           "roofline_ms_batch1": bound * 1e3, "compiled_fraction_of_roofline": bound / c[1],
           "dtype": str(comp.dtype).replace("torch.", "")}
    for B in sizes:
        fig.update({f"eager_ms_batch{B}": e[B] * 1e3, f"compiled_ms_batch{B}": c[B] * 1e3,
                    f"speedup_batch{B}": e[B] / c[B]})
    compared, said = _compare_compiled(comp, prompt, ref, ref_rows, check)
    fig.update(compared)
    rows = [["eager"] + [e[B] * 1e3 for B in sizes],
            [f"eager, {comp.weight_layout} weight layout", l1 * 1e3] + [""] * (len(sizes) - 1),
            ["compiled (+ layout)"] + [c[B] * 1e3 for B in sizes], ["speedup"] + [e[B] / c[B] for B in sizes]]
    text = (table(["decode step"] + [f"batch {B} (ms)" for B in sizes], rows) +
            f"\n\nWeight layout chosen by measurement: {comp.weight_layout}. "
            f"Compiling every bucket took {comp.compile_seconds:.1f} s. Batch 1 roofline "
            f"{bound * 1e3:.2f} ms: compiled decode runs at {bound / c[1]:.0%} of it. " + said)
    return fig, text


def hf_llama(llm, path: str):
    """transformers' LlamaForCausalLM with the config of `path` and the engine's own weights.

    Built from the engine's state dict rather than read from disk, so a
    "random:" preset works too and both engines hold the same values (model.py
    keeps Hugging Face's parameter names: only the "model." prefix differs).
    Raises ValueError if the two disagree on any tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if str(path).startswith(RANDOM_PREFIX):
        config = LlamaConfig(**PRESETS[parse_random_path(path)[0]])
    else:
        config = LlamaConfig.from_pretrained(path)
    old = torch.get_default_dtype()
    torch.set_default_dtype(llm.dtype)        # made in the engine's dtype: never a float32 copy of an 8B model
    try:
        with torch.device(llm.device):
            hf = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    ours = {("" if k == "lm_head.weight" else "model.") + k: v for k, v in llm.model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(ours, strict=False)
    if missing or unexpected:
        raise ValueError(f"transformers' Llama and nanoinfer's disagree: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def exp_peer(b: Bench):
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed"}, "Skipped: transformers is not installed."
    B = b.q(16, 8)         # the smoke run: one static group (transformers' generate costs ~50 ms a step here)
    llm = b.llm(max_num_seqs=B)
    prompts, lengths = workload(b, llm.config.vocab_size)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    b.progress("peer: nanoinfer")
    llm.generate([prompts[0]], params[0])
    t0 = time.perf_counter()
    ours = _latency_stats(llm.generate(prompts, params), t0, time.perf_counter() - t0)
    try:
        hf = hf_llama(llm, b.path)
    except Exception as e:                        # e.g. a shape transformers' config refuses
        return ({"skipped": f"transformers cannot build {b.path}: {e!r}"},
                f"Skipped: transformers cannot build the model ({e!r}).")
    # What a user without a serving engine would write: batches of B run to the
    # longest request's length (generate has no continuous batching), padded on
    # the left so every row's last token is a real one.
    pad = 0
    t0, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), B):
        b.progress(f"peer: transformers, group {i // B + 1}")
        group, want = prompts[i:i + B], lengths[i:i + B]
        width = max(map(len, group))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=llm.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=llm.device)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(want), min_new_tokens=max(want),
                        do_sample=False, pad_token_id=pad)
        tokens += sum(want)                       # only the tokens each request asked for count
    hf_s = time.perf_counter() - t0
    fig = {"requests": len(prompts), "nanoinfer_tokens": ours["output_tokens"], "transformers_tokens": tokens,
           "nanoinfer_tokens_per_s": ours["tokens_per_s"], "transformers_tokens_per_s": tokens / hf_s,
           "speedup": ours["tokens_per_s"] / (tokens / hf_s)}
    text = table(["engine", "output tokens/s"], [["nanoinfer (continuous batching)", ours["tokens_per_s"]],
                                                  [f"transformers generate (static batches of {B})", tokens / hf_s]])
    return fig, text + f"\n\nnanoinfer: {fig['speedup']:.2f}x the throughput of transformers' generate."


# ----------------------------------------------------------------------------
# Serving: users over HTTP (vLLM's benchmark_serving, in miniature)
# ----------------------------------------------------------------------------
# The offline experiments hand the engine every request at t = 0. Users arrive
# one by one: at a low rate each finds an idle engine (fast first token, small
# batches, low throughput); as the rate nears what the engine can sustain,
# batches grow (throughput up) and requests start to queue (first tokens late).
# Past that rate the queue grows without bound. The knee is where latency
# turns up: the lecture's latency/throughput trade-off as users feel it.

# The knee: the first rate at which the streaming users' p99 time to first token is
# over twice the lowest rate's. (A non-streaming user's wait is the whole answer:
# its length says more about it than the load does.)
KNEE_FACTOR = 2.0


def _http_request(host: str, port: int, body: dict, timeout: float) -> dict:
    """One request as its user sees it: when it was sent, when text first arrived,
    when the last text arrived, when it ended, and the tokens it got."""
    rec = {"stream": body["stream"], "ok": False, "tokens": 0, "first": None, "last": None}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        rec["sent"] = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec["error"] = f"HTTP {resp.status}: {resp.read()[:200]!r}"
        elif body["stream"]:
            for line in resp:                    # server-sent events: "data: {json}", blank lines between
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = chunk["error"]["message"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    rec["last"] = time.perf_counter()
                    rec["first"] = rec["first"] or rec["last"]      # TTFT: the first chunk with text
                if chunk.get("usage"):
                    rec["tokens"] = chunk["usage"]["completion_tokens"]
        else:                                    # the user sees nothing before the whole answer
            rec["tokens"] = json.loads(resp.read())["usage"]["completion_tokens"]
            rec["first"] = rec["last"] = time.perf_counter()
        rec["end"] = time.perf_counter()
        rec["ok"] = "error" not in rec and rec["first"] is not None
    except (OSError, ValueError, KeyError) as e:   # refused, reset, timed out, or a malformed answer
        rec["error"] = repr(e)
    finally:
        conn.close()
    return rec


def _serving_stats(recs: list, bodies: list, start: float) -> dict:
    """A rate's figures from its requests' records (p99 of < 100 requests is their maximum).

    TTFT and TPOT are the streaming users' (the first chunk with text; then
    (last - first text) / (tokens - 1), the decode step they see); a
    non-streaming user sees nothing before the whole answer, its latency."""
    done = [r for r in recs if r is not None and r["ok"]]
    stream = [r for r in done if r["stream"]]
    seconds = max([r["end"] for r in done], default=start) - start
    ttft = [r["first"] - r["sent"] for r in stream]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in stream if r["tokens"] > 1]
    latency = [r["end"] - r["sent"] for r in done if not r["stream"]]
    tokens = sum(r["tokens"] for r in done)
    return {"requests": len(bodies), "completed": len(done), "streaming": sum(x["stream"] for x in bodies),
            "requested_tokens": sum(x["max_tokens"] for x in bodies), "output_tokens": tokens,
            "seconds": seconds, "requests_per_s": len(done) / seconds if seconds else 0.0,
            "output_tokens_per_s": tokens / seconds if seconds else 0.0,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50) * 1e3, "tpot_p99_ms": percentile(tpot, 99) * 1e3,
            "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
            "e2e_max_s": max((r["end"] - r["sent"] for r in done), default=0.0),
            "ttft_le_e2e": all(r["sent"] <= r["first"] <= r["end"] for r in done),
            "errors": [r["error"] for r in recs if r is not None and "error" in r][:5]}


def _load_run(b: Bench, addr, vocab: int, n: int, rate: float, seed: int, limit_s: float) -> dict:
    """n requests from the workload (seed), arriving as a Poisson process of `rate`
    per second (math.inf: all at once), half of them streaming; one thread per user."""
    prompts, lengths = workload(b, vocab, seed=seed)
    # A streaming user asks for the usage chunk (OpenAI's stream_options), which counts its tokens.
    bodies = [{"prompt": p, "max_tokens": m, "temperature": 0.0, "ignore_eos": True, "stream": i % 2 == 0,
               **({"stream_options": {"include_usage": True}} if i % 2 == 0 else {})}
              for i, (p, m) in enumerate(zip(prompts[:n], lengths[:n]))]
    # Poisson arrivals: independent exponential gaps of mean 1 / rate, seeded.
    rng = random.Random(seed)
    gaps = [0.0] + [0.0 if rate == math.inf else rng.expovariate(rate) for _ in bodies[1:]]
    offsets = list(itertools.accumulate(gaps))
    recs = [None] * len(bodies)
    start = time.perf_counter() + 0.05           # every thread exists before the first send
    deadline = start + offsets[-1] + limit_s

    def user(i):
        time.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        recs[i] = _http_request(*addr, bodies[i], timeout=max(1.0, deadline - time.perf_counter()))
    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:                            # bounded: a request still running at the deadline failed
        t.join(max(0.0, deadline - time.perf_counter()))
    return {"rate_per_s": None if rate == math.inf else rate, "seed": seed,
            **_serving_stats(recs, bodies, start)}


def _serving_runs(b: Bench, srv, llm, n: int) -> tuple[list, float]:
    """The all-at-once run first (it measures the capacity), then Poisson rates at fractions of it."""
    addr, vocab, limit = srv.server_address[:2], llm.config.vocab_size, b.q(600, 120)
    _http_request(*addr, {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0, "stream": True,
                          "stream_options": {"include_usage": True}}, limit)                           # warm-up
    b.progress("serving: all at once")
    burst = _load_run(b, addr, vocab, n, math.inf, seed=1, limit_s=limit)
    capacity = burst["requests_per_s"]      # what the engine sustains with every user waiting
    runs = []
    # A run at rate f x capacity lasts ~1/f of the burst: the CPU run skips the slowest, 0.25x.
    for i, f in enumerate(b.q((0.5, 1.0, 1.5), (0.5,), gpu=(0.25, 0.5, 0.75, 1.0, 1.5))):
        b.progress(f"serving: Poisson arrivals at {f:.2f} x capacity")
        runs.append({"fraction_of_capacity": f, **_load_run(b, addr, vocab, n, f * capacity, 2 + i, limit)})
    return runs + [{"fraction_of_capacity": None, **burst}], capacity


def exp_serving(b: Bench):
    # Seats for half the users: a burst queues, as it does on a loaded server
    # (with a seat for everyone nobody ever waits for one, and no knee shows).
    n = b.q(16, 6, gpu=32)
    llm = b.llm(max_num_seqs=n // 2)
    # In-process: the server's threads and the users' share this process (and its
    # GIL) with the engine thread; the users' work is small (a JSON parse per chunk).
    srv = make_server(llm, "127.0.0.1", 0, max_waiting=1024)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        runs, capacity = _serving_runs(b, srv, llm, n)
    finally:
        srv.shutdown()
        srv.server_close()
        srv.engine.stop()
    bm = llm.block_manager
    base = runs[0]["ttft_p99_s"]
    knee = next((r for r in runs[1:] if r["ttft_p99_s"] > KNEE_FACTOR * base), None)
    fig = {"capacity_requests_per_s": capacity, "seats": n // 2, "knee_factor": KNEE_FACTOR, "runs": runs,
           "knee_rate_per_s": None if knee is None else knee["rate_per_s"], "knee_all_at_once": knee is runs[-1],
           "kv_blocks_free": bm.num_free_blocks, "kv_blocks_total": bm.num_blocks,
           "pool_all_free": bm.num_free_blocks == bm.num_blocks}
    rows = [["all at once" if r["rate_per_s"] is None else f"{r['rate_per_s']:.3g} ({r['fraction_of_capacity']:g}x)",
             f"{r['completed']}/{r['requests']}", r["requests_per_s"], r["output_tokens_per_s"], r["ttft_p50_s"],
             r["ttft_p99_s"], r["tpot_p50_ms"], r["tpot_p99_ms"], r["latency_p50_s"], r["latency_p99_s"]]
            for r in runs]
    knee_text = (f"none: p99 TTFT stayed within {KNEE_FACTOR:g}x of the lowest rate's" if knee is None else
                 "all at once" if knee is runs[-1] else f"{knee['rate_per_s']:.3g} requests/s "
                 f"({knee['fraction_of_capacity']:g}x capacity)")
    text = (f"{n} users per rate, half streaming (SSE), over HTTP on loopback, {n // 2} seats in the batch; prompt "
            "and output lengths from the continuous-vs-static workload (a fresh draw per rate). Poisson arrivals at "
            f"fractions of the capacity measured by sending all at once ({capacity:.3g} requests/s). TTFT: the first "
            "streamed chunk with text; TPOT: (last - first text) / (tokens - 1), streaming users; latency: the whole "
            f"answer, the other users. p99 of {n // 2} values is their maximum.\n\n" +
            table(["arrival rate (req/s)", "completed", "req/s", "output tokens/s", "TTFT p50 (s)", "TTFT p99 (s)",
                   "TPOT p50 (ms)", "TPOT p99 (ms)", "latency p50 (s)", "latency p99 (s)"], rows) +
            f"\n\nThe knee (p99 TTFT over {KNEE_FACTOR:g}x the lowest rate's): {knee_text}. After shutdown "
            f"{bm.num_free_blocks}/{bm.num_blocks} KV blocks are free.")
    return fig, text


# ----------------------------------------------------------------------------
# Tensor parallelism: measured here, and the lecture's arithmetic at scale
# ----------------------------------------------------------------------------

def _tp_decode(b: Bench, group, batch: int, context: int, steps: int) -> dict:
    """Greedy decode of `batch` random prompts through the group's paged caches:
    a prefill and a warm-up step untimed, then `steps` timed steps with the
    collectives counted and timed (parallel.Collectives)."""
    bs, vocab = 16, group.full_config.vocab_size
    blocks = batch * math.ceil((context + steps + 2) / bs)
    group.allocate_cache(blocks, bs)
    bm = BlockManager(blocks, bs, enable_prefix_caching=False)
    rng = random.Random(0)
    seqs = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    fed = [0] * batch                                  # tokens of each sequence already in the cache
    for i, s in enumerate(seqs):
        bm.allocate(i, s)

    def step():                                        # every rank runs its slice on the same tokens
        for i, s in enumerate(seqs):
            bm.reserve(i, fed[i], len(s) - fed[i])
        work = [(i, s[fed[i]:], fed[i]) for i, s in enumerate(seqs)]
        last = [r - 1 for r in itertools.accumulate(len(w[1]) for w in work)]
        x, pos, ctx = AttentionContext.build(group.cache, bm, work, last, group.device)
        for i, token in enumerate(group.forward(x, pos, ctx).argmax(-1).tolist()):
            fed[i] = len(seqs[i])
            seqs[i].append(token)
    step(), step()
    comm = group.comm
    comm.reset()
    comm.timing = True
    try:
        t = b.timeit(step, steps, warmup=0)
    finally:
        comm.timing = False
    return {"step_ms": t * 1e3, "allreduce_ms": comm.seconds / steps * 1e3, "collectives_per_step": comm.calls / steps,
            "comm_bytes_per_step": comm.bytes / steps, "tokens": [s[context:] for s in seqs]}


def _tp_measured(b: Bench):
    """Step time and communication at each N that divides the model and fits the devices."""
    gpus = torch.cuda.device_count() if b.device.type == "cuda" else 0
    # A GPU run needs N GPUs for N ranks; with fewer than 2 the lesson is measured on
    # the host CPU with gloo, on the real (small) model: collectives cost latency there.
    device = b.device if gpus >= 2 else torch.device("cpu")
    path = b.path if device.type == b.device.type else b.quality_path
    dtype = b.torch_dtype if device.type == b.device.type else torch.float32
    cfg, _ = model_config(str(path))
    batch, context, steps = b.q(8, 4), b.q(128, 16), b.q(10, 3)
    points, ref, threads = [], None, torch.get_num_threads()
    # (Every rank loads the whole checkpoint before keeping its slice, parallel.load_shard:
    # N = 3 at most keeps that within the host's memory.)
    sizes = b.q([1, 2, 3], [1, 2])
    # On a CPU a rank is a "device" of a fixed number of cores, as a GPU is, whatever N:
    # cores // (the largest N) threads each (a worker takes cores // N, parallel.py, and a
    # step waits for its slowest rank). More threads than cores would stall every step:
    # measured here, 2 threads for N = 1 on 2 shared cores made a step 6x slower than 1.
    rank_threads = max(1, (os.cpu_count() or 1) // max(sizes))
    for N in sizes:
        try:
            check_tensor_parallel(cfg, N, device.type)
        except ValueError as e:                    # heads, KV heads, FFN or vocabulary do not divide, or no GPUs
            points.append({"world_size": N, "skipped": str(e)})
            continue
        b.progress(f"tensor-parallel: N = {N} on {device.type}")
        if device.type == "cpu":
            torch.set_num_threads(rank_threads)
        try:
            with contextlib.redirect_stdout(io.StringIO()), \
                    TensorParallelGroup(b.note(path), N, device=device, dtype=dtype) as group:
                p = {"world_size": N, **_tp_decode(b, group, batch, context, steps),
                     "weight_bytes_per_rank": decode_weight_bytes(group.model),
                     "kv_bytes_per_token_per_rank": kv_cache_bytes(group.config, dtype)}
        except TensorParallelError as e:           # e.g. a machine that cannot start worker processes:
            if N == 1:                             # the other figures of a long run are worth keeping
                raise
            points.append({"world_size": N, "skipped": f"the group failed: {e}"})
            continue
        finally:
            torch.set_num_threads(threads)
        tokens = p.pop("tokens")
        ref = tokens if ref is None else ref       # N = 1 comes first: every N must decode its tokens
        p["shared_tokens_with_n1"] = sum(agreement(t, r) for t, r in zip(tokens, ref))   # each to its 1st divergence
        p["tokens_compared"] = sum(map(len, ref))
        if exact(dtype):                           # bf16: split sums round differently, tokens drift
            p["same_tokens_as_n1"] = tokens == ref
        points.append(p)
    return {"device": str(device), "model": str(path), "dtype": str(dtype).replace("torch.", ""),
            "rank0_threads": rank_threads if device.type == "cpu" else None, "batch": batch,
            "context": context, "steps": steps, "layers": cfg.n_layers, "dim": cfg.dim, "vocab_size": cfg.vocab_size,
            "points": points}


TP_GPU_BYTES = 80e9      # one H100's memory: what "fits" means in the arithmetic table


def _tp_arithmetic(tokens: int) -> list:
    """parallel.tensor_parallel_cost for Llama-3.1 8B and 70B (meta-device shapes) on 1-8 GPUs, bf16,
    one decode step of `tokens` sequences, over NVLink and over PCIe."""
    rows = []
    for name in ("llama-3.1-8b", "llama-3.1-70b"):
        cfg, _ = model_config(RANDOM_PREFIX + name)
        for N in (1, 2, 4, 8):
            nv = tensor_parallel_cost(cfg, N, tokens, torch.bfloat16, link_bytes_per_s=NVLINK_H100_SXM)
            pcie = tensor_parallel_cost(cfg, N, tokens, torch.bfloat16, link_bytes_per_s=PCIE_GEN5_X16)
            rest = TP_GPU_BYTES - nv["weight_bytes_per_rank"]
            rows.append({"model": name, **{k: nv[k] for k in (
                "world_size", "tokens", "weight_bytes_per_rank", "kv_bytes_per_token_per_rank", "allreduce_calls",
                "allreduce_bytes", "ring_bytes_per_rank", "weight_read_seconds")},
                "allreduce_seconds_nvlink": nv["allreduce_seconds"],
                "allreduce_seconds_pcie": pcie["allreduce_seconds"], "fits_80GB": rest > 0,
                "kv_tokens_in_rest_of_80GB": max(0, int(rest // nv["kv_bytes_per_token_per_rank"]))})
    return rows


def exp_tensor_parallel(b: Bench):
    m = _tp_measured(b)
    arith = _tp_arithmetic(GPU_BATCH)
    fig = {"measured": m, "arithmetic": arith, "nvlink_bytes_per_s": NVLINK_H100_SXM, "pcie_bytes_per_s": PCIE_GEN5_X16}
    base = next(p["step_ms"] for p in m["points"] if p["world_size"] == 1)
    rows = [[p["world_size"], "skipped: " + p["skipped"]] + [""] * 7 if "skipped" in p else
            [p["world_size"], p["step_ms"], base / p["step_ms"], p["allreduce_ms"],
             f"{p['allreduce_ms'] / p['step_ms']:.0%}", p["collectives_per_step"],
             # the latency of one collective: on CPU with gloo it, not the bytes, sets the cost
             p["allreduce_ms"] / p["collectives_per_step"] * 1e3 if p["collectives_per_step"] else "",
             p["weight_bytes_per_rank"] / 1e6,
             p.get("same_tokens_as_n1", f"{p['shared_tokens_with_n1']}/{p['tokens_compared']}")] for p in m["points"]]
    arows = [[r["model"], r["world_size"], r["weight_bytes_per_rank"] / 1e9, "yes" if r["fits_80GB"] else "no",
              r["kv_bytes_per_token_per_rank"] / 1024, r["kv_tokens_in_rest_of_80GB"], r["allreduce_bytes"] / 1e6,
              r["allreduce_seconds_nvlink"] * 1e6, r["allreduce_seconds_pcie"] * 1e6, r["weight_read_seconds"] * 1e6]
             for r in arith]
    threads = f", {m['rank0_threads']} thread(s) per rank" if m["rank0_threads"] else ""
    text = (f"Measured on {m['device']}{threads} ({os.path.basename(m['model'])}, {m['dtype']}): greedy decode steps of "
            f"{m['batch']} sequences at a {m['context']}-token context through parallel.TensorParallelGroup "
            "(rank 0 plus N-1 worker processes; gloo on a CPU, NCCL on GPUs). Collectives per step: 2 all-reduces "
            "per layer, the embedding's, and the logits' all-gather.\n\n" +
            table(["N", "step (ms)", "speedup vs N=1", "collectives (ms/step)", "share of step", "collectives/step",
                   "µs per collective", "weight MB/rank",
                   "same tokens as N=1" if m["dtype"] == "float32" else "tokens shared with N=1 (to 1st divergence)"],
                  rows) +
            f"\n\nThe arithmetic (parallel.tensor_parallel_cost) for one decode step of {GPU_BATCH} sequences in "
            "bf16: all-reduce payload = 2 x layers x batch x dim x 2 bytes; a ring moves 2 (N-1)/N of it through "
            f"each GPU's link (NVLink {NVLINK_H100_SXM / 1e9:.0f} GB/s, PCIe 5.0 x16 {PCIE_GEN5_X16 / 1e9:.0f} GB/s "
            "per direction), plus a latency per call (2 x layers calls per step) not counted here; beside it the "
            "step's weight read per GPU at H100 HBM3's 3.35 TB/s.\n\n" +
            table(["model", "GPUs", "weights/GPU (GB)", "fits 80 GB", "KV/token/GPU (KiB)", "KV tokens in the rest",
                   "all-reduce/step (MB)", "NVLink (µs)", "PCIe (µs)", "weight read (µs)"], arows))
    return fig, text


# ----------------------------------------------------------------------------
# KV compression: fewer KV heads, and a sliding window (the lecture's chapter 6)
# ----------------------------------------------------------------------------
# At long contexts the cache, not the weights, fills the memory and the decode step:
#   KV bytes per token = 2 (K and V) * layers * kv_heads * head_dim * bytes per value.
# MHA caches K and V of every query head, GQA one pair per group of query heads, MQA one
# pair for all: `random:<preset>:kv_heads=N` is the same body (every other tensor the same)
# with N KV heads. A sliding window (Mistral) bounds what a query sees, so the block manager
# gives back the blocks behind it: the cache becomes O(window) instead of O(length).

KV_LECTURE_PRESET = "llama-3.2-1b"   # 32 query heads: MHA = 32 KV heads, GQA-8 as published, MQA = 1
KV_BLOCK = 16                        # the engine's default block size
LONG_CONTEXT = 128 * 1024            # the published models' arithmetic: KV bytes at a 128k-token context

# The lecture's arithmetic for published models, bf16 (2 bytes per value):
# (model, attention, layers, values cached per token per layer, window or None). Shapes from:
#   Llama-2-70B: Touvron et al. 2023, "Llama 2" (arXiv:2307.09288), and meta-llama/Llama-2-70b-hf's
#     config.json: 80 layers, 64 query heads of 128 dims, 8 KV heads; "MHA" is that body with 64 KV heads.
#   DeepSeek-V2: DeepSeek-AI 2024 (arXiv:2405.04434), section 2.1 and appendix B: 60 layers, 128 heads of
#     128 dims; MLA caches the compressed latent c_KV (d_c = 512) and the shared RoPE key (d_h^R = 64):
#     576 values per token per layer, against 2 x 128 x 128 for MHA over its 128 heads.
#   Mistral-7B-v0.1: Jiang et al. 2023 (arXiv:2310.06825) and its config.json: 32 layers, 8 KV heads of
#     128 dims, sliding_window 4096 in every layer (a local layer holds at most its last 4096 tokens).
PUBLISHED_KV = [("Llama-2-70B", "MHA (64 KV heads)", 80, 2 * 64 * 128, None),
                ("Llama-2-70B", "GQA-8 (published)", 80, 2 * 8 * 128, None),
                ("DeepSeek-V2", "MHA (128 heads x 128 dims)", 60, 2 * 128 * 128, None),
                ("DeepSeek-V2", "MLA (published): 512 latent + 64 RoPE", 60, 576, None),
                ("Mistral-7B", "GQA-8, full attention", 32, 2 * 8 * 128, None),
                ("Mistral-7B", "GQA-8, 4k window (published)", 32, 2 * 8 * 128, 4096)]


def kv_variants(preset: str) -> list:
    """[(name, kv_heads)] of a preset: MHA (a KV head per query head), its published GQA, MQA (one)."""
    cfg, _ = model_config(RANDOM_PREFIX + preset)
    names = {1: "MQA", cfg.n_heads: "MHA"}
    return [(names.get(kv, f"GQA-{kv}"), kv) for kv in sorted({cfg.n_heads, cfg.n_kv_heads, 1}, reverse=True)]


def fit_batch(bm: BlockManager, context: int) -> int:
    """The most sequences of `context` tokens a pool holds, by the engine's own block accounting:
    admitted one by one as the scheduler admits them (can_append, then reserve) until the next one
    does not fit; then all given back."""
    n = 0
    while True:
        sid = -1 - n                         # negative ids never collide with the engine's own
        bm.allocate(sid, [])
        if not bm.can_append(sid, 0, context):
            bm.free(sid)
            break
        bm.reserve(sid, 0, context)
        n += 1
    for i in range(n):
        bm.free(-1 - i)
    return n


def _kv_budget(b: Bench, preset: str, batch: int, context: int) -> int:
    """The fixed KV budget: exactly `batch` sequences of `context` tokens of the preset's MHA variant."""
    cfg, _ = model_config(f"{RANDOM_PREFIX}{preset}:kv_heads={kv_variants(preset)[0][1]}")
    return kv_cache_bytes(cfg, b.torch_dtype, batch * math.ceil(context / KV_BLOCK) * KV_BLOCK)


def _kv_row(name: str, cfg, dtype, cache, bm: BlockManager, context: int) -> dict:
    """A variant's bytes per token (the formula, and the pool actually allocated) and the batch that fits."""
    tokens = cache.num_blocks * cache.block_size
    return {"name": name, "kv_heads": cfg.n_kv_heads,
            # the lecture's formula, written out: K and V, every layer, every KV head, head_dim values each
            "kv_bytes_per_token": 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype.itemsize,
            "pool_bytes": cache.total_bytes, "pool_tokens": tokens, "pool_bytes_per_token": cache.total_bytes / tokens,
            "pool_blocks": bm.num_blocks, "fit_batch": fit_batch(bm, context)}


def _kv_accounting(b: Bench, preset: str, batch: int, context: int) -> list:
    """The lecture-scale rows, no weights needed: each variant's pool as the engine makes it
    (scheduler.make_kv_pool, allocated on the device) for the fixed budget, and its block manager."""
    rows, budget = [], _kv_budget(b, preset, batch, context)
    for name, kv in kv_variants(preset):
        cfg, _ = model_config(f"{RANDOM_PREFIX}{preset}:kv_heads={kv}")
        with contextlib.redirect_stdout(io.StringIO()):
            cache, blocks = make_kv_pool(cfg, b.torch_dtype, b.device, KV_BLOCK, budget, None, 0)
        rows.append({**_kv_row(name, cfg, b.torch_dtype, cache, BlockManager(blocks, KV_BLOCK, False), context),
                     "model": f"{RANDOM_PREFIX}{preset}:kv_heads={kv}"})
        del cache
    return rows


def _kv_timed(b: Bench, preset: str, batch: int, context: int, steps: int) -> list:
    """Each variant as an engine with the fixed budget: its pool and fitting batch, then decode steps
    of `batch` sequences (what the MHA variant holds) near `context` tokens, and the step's bytes.
    The engines' steps are timed in turn, so a shared machine's noise hits every variant alike."""
    rows, engines, budget, bw = [], [], _kv_budget(b, preset, batch, context), b.bandwidth()
    ctx = context - steps - 8            # the warm-up and timed steps keep every sequence within `context`
    for name, kv in kv_variants(preset):
        path = f"{RANDOM_PREFIX}{preset}:kv_heads={kv}"
        b.progress(f"kv-compression: {name}, prefill of {batch} x {ctx} tokens")
        llm = b.llm(path=path, max_num_seqs=batch, kv_cache_bytes=budget)
        rows.append({**_kv_row(name, llm.config, llm.dtype, llm.cache, llm.block_manager, context), "model": path})
        engines.append((llm, start_decoding(llm, batch, ctx, steps), []))
    for i in range(steps + 2):           # the first two rounds are warm-up
        b.progress(f"kv-compression: decode steps at batch {batch}, round {i + 1}")
        for llm, _, times in engines:
            b.sync()
            t0 = time.perf_counter()
            llm.step()
            b.sync()
            times.append(time.perf_counter() - t0)
    for row, (llm, ids, times) in zip(rows, engines):
        # A decode step reads every weight once and each sequence's whole KV cache.
        W, kv_step = decode_weight_bytes(llm.model), row["kv_bytes_per_token"] * ctx * batch
        row.update(step_ms=statistics.median(times[2:]) * 1e3, weight_bytes=W, kv_bytes_per_step=kv_step,
                   kv_share=kv_step / (W + kv_step), bound_ms=(W + kv_step) / bw * 1e3,
                   preemptions=llm.scheduler.num_preemptions)
        for rid in ids:
            llm.abort(rid)
    return rows


def published_kv_arithmetic(context: int = LONG_CONTEXT) -> list:
    """PUBLISHED_KV in bytes, bf16: per token, and the cache of one sequence of `context` tokens
    (a window caps the tokens held at its width)."""
    rows = []
    for model, attention, layers, values, window in PUBLISHED_KV:
        per_token = layers * values * 2
        held = context if window is None else min(context, window)
        rows.append({"model": model, "attention": attention, "layers": layers, "values_per_token_per_layer": values,
                     "window": window, "bytes_per_token": per_token, "context": context,
                     "tokens_held": held, "kv_bytes_at_context": per_token * held})
    for r in rows:                       # against the first (uncompressed) row of the same model
        first = next(x for x in rows if x["model"] == r["model"])
        r["reduction"] = first["kv_bytes_at_context"] / r["kv_bytes_at_context"]
    return rows


def blocks_in_use(bm: BlockManager) -> int:
    """Blocks holding a sequence's K/V; the null block (what freed entries point at) holds none."""
    return bm.num_blocks - bm.num_free_blocks - (bm.null_block is not None)


def _engine_curve(llm, tokens: int) -> tuple[list, list]:
    """One sequence (a 1-token prompt) generating `tokens` tokens, greedy: after every step, the
    tokens in its cache and the blocks in use, read from the engine's block manager."""
    rid = llm.add_request([1], SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    seq, xs, ys = llm.requests[rid].seqs[0], [], []
    while True:
        outs = llm.step()
        if any(o.finished for o in outs):    # the last step finishes it and frees its blocks
            return xs, ys
        xs.append(seq.num_computed)
        ys.append(blocks_in_use(llm.block_manager))


def _scheduler_like_curve(num_blocks: int, window: int, tokens: int) -> tuple[list, list]:
    """The same sequence through a BlockManager with the window, driven as the scheduler drives it:
    step k reserves the slot of the token at position k - 1, then registers its full blocks."""
    bm, ids, xs, ys = BlockManager(num_blocks, KV_BLOCK, sliding_window=window), [1], [], []
    bm.allocate(0, ids)
    for k in range(1, tokens + 1):
        bm.reserve(0, k - 1, 1)
        ids.append(2 + k % 100)              # the token the step samples (which one does not matter)
        bm.cache_full_blocks(0, ids, k)
        xs.append(k)
        ys.append(blocks_in_use(bm))
    bm.free(0)
    return xs, ys


def _window_curves(b: Bench, window: int, tokens: int) -> dict:
    """KV blocks in use against generated length: full attention, then a window of `window`."""
    out = {"model": TINY_MODEL, "window": window, "block_size": KV_BLOCK, "tokens": tokens,
           "window_bound_blocks": math.ceil(window / KV_BLOCK) + 1}
    for key, path in (("full", TINY_MODEL), ("windowed", f"{TINY_MODEL}:sliding_window={window}")):
        b.progress(f"kv-compression: {tokens} tokens, {key} attention")
        llm = b.llm(path=path, max_num_seqs=1, kv_cache_bytes=b.pool_bytes(path, tokens + 64), block_size=KV_BLOCK)
        bm = llm.block_manager
        if key == "windowed" and getattr(bm, "sliding_window", None) != window:
            xs, ys = _scheduler_like_curve(bm.num_blocks, window, tokens)   # LLM does not give its BlockManager W
            out[key + "_source"] = "a BlockManager with the window, driven as the scheduler drives it"
        else:
            xs, ys = _engine_curve(llm, tokens)
            out[key + "_source"] = "the engine (LLM.step), its block manager read after every step"
        out[key] = {"tokens": xs, "blocks": ys}
        del llm
    return out


def _kv_body(b: Bench) -> str:
    """The preset whose MHA / GQA / MQA variants are timed: --model's if it is a "random:" preset; else
    the lecture's size on a GPU, and shapes a CPU runs in seconds (the smoke run: the smallest)."""
    if b.args.model and str(b.args.model).startswith(RANDOM_PREFIX):
        return parse_random_path(b.args.model)[0]
    return b.q("smollm2-135m", "smollm2-tiny", gpu=KV_LECTURE_PRESET)


def exp_kv_compression(b: Bench):
    body = _kv_body(b)
    # Timed: a context long enough that MHA's KV is a real share of a step's bytes (on the smoke run's
    # tiny shapes a quarter: their 49k-token vocabulary is most of the weights), a budget of `batch` of them.
    batch, context, steps = b.q(4, 4, gpu=8), b.q(1024, 1024, gpu=4096), b.q(10, 8)
    timed = _kv_timed(b, body, batch, context, steps)
    # The lecture's shapes need no weights for the accounting: the same budget rule on the pool the engine
    # would allocate (1 GiB, 128 MiB on the smoke run, in float32 on a CPU). On a GPU the timed preset is
    # the lecture's, and these are its rows.
    same = body == KV_LECTURE_PRESET
    lec_batch, lec_context = (batch, context) if same else (4, b.q(1024, 128))
    lecture = timed if same else _kv_accounting(b, KV_LECTURE_PRESET, lec_batch, lec_context)
    fig = {"dtype": str(b.torch_dtype).replace("torch.", ""), "block_size": KV_BLOCK,
           "lecture_preset": KV_LECTURE_PRESET, "lecture_batch": lec_batch, "lecture_context": lec_context,
           "lecture_budget_bytes": _kv_budget(b, KV_LECTURE_PRESET, lec_batch, lec_context), "lecture": lecture,
           "timed_preset": body, "batch": batch, "context": context, "timed_context": context - steps - 8,
           "steps": steps, "timed_budget_bytes": _kv_budget(b, body, batch, context), "timed": timed,
           "published": published_kv_arithmetic(),
           "sliding_window": _window_curves(b, b.q(256, 64), b.q(4096, 512))}
    for rows in (lecture, timed):
        for r in rows:                   # the lesson's ratios, against the MHA row
            r["bytes_vs_mha"] = rows[0]["kv_bytes_per_token"] / r["kv_bytes_per_token"]
            r["fit_vs_mha"] = r["fit_batch"] / rows[0]["fit_batch"]
    return fig, _kv_text(fig)


def _kv_text(r: dict) -> str:
    """The tables of exp_kv_compression's figures."""
    B, C, bs, dtype, w = r["batch"], r["context"], r["block_size"], r["dtype"], r["sliding_window"]
    lecture = "" if r["lecture"] == r["timed"] else (
        f"The lecture's shapes, {r['lecture_preset']}, {dtype} (no weights needed): each variant's pool as the "
        f"engine allocates it for a budget of {r['lecture_budget_bytes'] / 2**20:.0f} MiB ({r['lecture_batch']} "
        f"MHA sequences of {r['lecture_context']} tokens), filled by its block manager.\n\n" +
        table(["attention", "KV heads", "KV B/token (formula)", "B/token of the allocated pool", "MHA / this",
               f"sequences of {r['lecture_context']} tokens that fit"],
              [[x["name"], x["kv_heads"], x["kv_bytes_per_token"], f"{x['pool_bytes_per_token']:.10g}",
                x["bytes_vs_mha"], x["fit_batch"]] for x in r["lecture"]]) + "\n\n")
    timed = [[x["name"], x["kv_heads"], x["kv_bytes_per_token"], f"{x['pool_bytes_per_token']:.10g}", x["fit_batch"],
              x["step_ms"], x["bound_ms"], x["weight_bytes"] / 1e6, x["kv_bytes_per_step"] / 1e6,
              f"{x['kv_share']:.0%}"] for x in r["timed"]]
    pub = [[x["model"], x["attention"], x["values_per_token_per_layer"], f"{x['bytes_per_token'] / 1024:,.4g}",
            x["kv_bytes_at_context"] / 1e9, x["reduction"]] for x in r["published"]]
    win = w["windowed"]["blocks"]
    return (lecture + f"Timed: {r['timed_preset']} with each KV-head count, {dtype}, a budget of "
            f"{r['timed_budget_bytes'] / 2**20:.3g} MiB ({B} MHA sequences of {C} tokens); decode steps of {B} "
            f"sequences at a {r['timed_context']}-token context, which every variant holds. A step reads every "
            "weight once and each sequence's KV cache; bound = those bytes / the copy bandwidth.\n\n" +
            table(["attention", "KV heads", "KV B/token (formula)", "B/token of the pool", f"sequences of {C} "
                   "tokens that fit", "decode step (ms)", "bound (ms)", "weights MB/step", "KV MB/step",
                   "KV share of the bytes"], timed) +
            f"\n\nThe lecture's arithmetic for published models (bf16), one sequence of {LONG_CONTEXT:,} tokens:"
            "\n\n" + table(["model", "attention", "values/token/layer", "KiB/token",
                             f"GB at {LONG_CONTEXT // 1024}k tokens", "reduction"], pub) +
            f"\n\nSliding window: one sequence generating {w['tokens']} tokens in blocks of {bs} (full attention: "
            f"{w['full_source']}; the window: {w['windowed_source']}). Full attention holds "
            f"{w['full']['blocks'][-1]} blocks at the end; a window of {w['window']} at most {max(win)} "
            f"(bound ceil(W / block size) + 1 = {w['window_bound_blocks']}), {win[-1]} at the end.")


# ----------------------------------------------------------------------------
# Pictures: the lecture's plots, drawn from an experiment's results dict alone
# ----------------------------------------------------------------------------
# Each plot_<experiment>(r) takes what --json holds for that experiment (its
# "meta" included) and returns a matplotlib Figure on the Agg canvas (no display,
# no pyplot state); write_plot saves it. Nothing here runs a model, so a results
# file from a GPU can be re-plotted anywhere. A new experiment adds its function
# to PLOTS.

def _figure(r: dict, lesson: str, ncols: int = 1):
    """A Figure titled with the lesson, then the device, model and date of the run; its axes."""
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


def plot_roofline(r: dict):
    fig, (ax,) = _figure(r, "The roofline: decode sits on the bandwidth slope, prefill under the compute roof")
    bw, peak = r["bandwidth_GBps"] * 1e9, r["matmul_TFLOPs"] * 1e12
    pts, pre, balance = r["decode_points"], r["prefill_point"], r["machine_balance_flops_per_byte"]
    xs = [p["flops_per_byte"] for p in pts] + [pre["flops_per_byte"], balance]
    lo, hi = min(xs) / 4, max(xs) * 4
    # Attainable FLOP/s = min(bandwidth x intensity, peak): a slope, then a flat roof at the balance point.
    ax.plot([lo, balance, hi], [bw * lo, peak, peak], "k-", lw=2, label="roofline (measured copy bandwidth and matmul)")
    ax.axvline(balance, color="grey", ls=":", lw=1, label=f"machine balance {balance:.3g} FLOP/byte")
    ax.plot([p["flops_per_byte"] for p in pts], [p["attained_flops_per_s"] for p in pts], "o-", color="C0",
            label=f"decode step, measured ({r['context']}-token context)")
    for p in pts:
        ax.annotate(f"batch {p['batch']}", (p["flops_per_byte"], p["attained_flops_per_s"]),
                    textcoords="offset points", xytext=(5, -12), fontsize=8)
    ax.plot([pre["flops_per_byte"]], [pre["attained_flops_per_s"]], "s", color="C3", ms=8,
            label=f"prefill of {r['prefill_tokens']} tokens, measured")
    ax.annotate(f"{bw / 1e9:.3g} GB/s", (lo * 2, bw * lo * 2), textcoords="offset points", xytext=(-10, 8),
                fontsize=8, ha="right")
    ax.text(hi / 1.3, peak * 1.1, f"{peak / 1e12:.3g} TFLOP/s", ha="right", fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="attainable FLOP/s")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=2)   # below: no point hidden
    return fig


def plot_batching(r: dict):
    fig, (a1, a2) = _figure(r, "Batching: tokens/s grow with the batch while the step time stays flat, "
                               "until the knee", ncols=2)
    pts, knee = r["points"], r.get("knee_batch")
    B = [p["batch"] for p in pts]
    a1.plot(B, [p["tokens_per_s"] for p in pts], "o-", label="measured")
    a2.plot(B, [p["step_ms"] for p in pts], "o-", label="decode step, measured")
    a2.plot(B, [p["bound_ms"] for p in pts], "k--", label="roofline bound")
    for ax in (a1, a2):
        if knee is not None:
            ax.axvline(knee, color="C3", ls=":", label=f"knee: step time doubled at batch {knee}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(B, [str(x) for x in B])
        ax.set_xlabel(f"batch (sequences decoding, {r['context']}-token context)")
        ax.legend(fontsize=8)
    a1.set_ylabel("output tokens/s")
    a2.set_ylabel("decode step (ms)")
    if knee is None:
        a2.set_title(f"no knee up to batch {B[-1]}", fontsize=9)
    return fig


def plot_kv_cache(r: dict):
    fig, (ax,) = _figure(r, "The KV cache: recomputing the sequence costs more per token the longer it gets")
    n = [p["tokens"] for p in r["lengths"]]
    ax.plot(n, [p["naive_ms_per_token"] for p in r["lengths"]], "o-", label="naive: the whole sequence every step")
    ax.plot(n, [p["cached_ms_per_token"] for p in r["lengths"]], "s-", label="KV cache: one token per step")
    for p in r["lengths"]:
        ax.annotate(f"cache {p['speedup']:.3g}x faster", (p["tokens"], p["naive_ms_per_token"]),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set(xlabel=f"output tokens (after a {r['prompt_tokens']}-token prompt)", ylabel="ms per output token")
    ax.set_ylim(0, 1.15 * max(max(p["naive_ms_per_token"], p["cached_ms_per_token"]) for p in r["lengths"]))
    ax.margins(x=0.12)                               # room for the labels of the first and last points
    ax.legend(fontsize=8)
    return fig


def plot_speculative(r: dict):
    fig, (ax,) = _figure(r, "Speculative decoding pays when drafts are accepted: measured and predicted speedup")
    groups = {}
    for run in r["runs"]:
        groups.setdefault((run["workload"], run["drafter"]), []).append(run)
    for i, ((workload, drafter), runs) in enumerate(groups.items()):
        k = [x["k"] for x in runs]
        alpha = statistics.mean(x["alpha"] for x in runs)
        ax.plot(k, [x["speedup"] for x in runs], "o-", color=f"C{i}",
                label=f"{workload}, {drafter}: measured (mean acceptance {alpha:.2f})")
        ax.plot(k, [x["predicted_speedup"] for x in runs], "--", color=f"C{i}",
                label=f"{workload}, {drafter}: predicted from acceptance and verify cost")
    ax.axhline(1.0, color="grey", lw=1, label="plain decoding")
    ax.set(xlabel="draft tokens per verify pass (k)", ylabel="speedup over plain decoding (x)")
    ax.set_xticks(sorted({x["k"] for x in r["runs"]}))
    ax.legend(fontsize=7)
    return fig


def plot_serving(r: dict):
    fig, (ax,) = _figure(r, "Serving: time to first token turns up as arrivals reach capacity (the knee)")
    poisson = [x for x in r["runs"] if x["rate_per_s"] is not None]
    burst = [x for x in r["runs"] if x["rate_per_s"] is None]
    # "All at once" has no rate: drawn to the right of the highest one, and labelled.
    far = 1.3 * max([x["rate_per_s"] for x in poisson] + [r["capacity_requests_per_s"]])
    runs, xs = poisson + burst, [x["rate_per_s"] for x in poisson] + [far] * len(burst)
    ax.plot(xs, [x["ttft_p50_s"] for x in runs], "o-", label="TTFT p50")
    ax.plot(xs, [x["ttft_p99_s"] for x in runs], "s-", label="TTFT p99")
    ax.set(xlabel="arrival rate (requests/s, Poisson)", ylabel="time to first token (s)")
    ax.set_xticks(xs, [f"{x:.3g}" for x in xs[:len(poisson)]] + ["all at once"] * len(burst))
    ax.axvline(r["capacity_requests_per_s"], color="grey", ls=":", label="capacity (all at once)")
    if r.get("knee_rate_per_s") is not None or r.get("knee_all_at_once"):
        knee = far if r.get("knee_all_at_once") else r["knee_rate_per_s"]
        ax.axvline(knee, color="C3", ls="--", label=f"knee: p99 TTFT > {r['knee_factor']:g}x the lowest rate's")
    tw = ax.twinx()
    tw.plot(xs, [x["output_tokens_per_s"] for x in runs], "^:", color="C2", label="throughput")
    tw.set_ylabel("output tokens/s")
    ax.legend(*[a + b for a, b in zip(ax.get_legend_handles_labels(), tw.get_legend_handles_labels())],
              fontsize=8, loc="upper left")
    return fig


def plot_quantization(r: dict):
    fig, (ax,) = _figure(r, "Quantization: fewer weight bytes per step, more tokens/s, at a perplexity cost")
    cfgs = r["configs"]
    key = next(k for k in cfgs[0] if k.startswith("tokens_per_s_batch") and k != "tokens_per_s_batch1")
    big = key.removeprefix("tokens_per_s_batch")
    for i, c in enumerate(cfgs):        # one colour per configuration, its perplexity in the legend
        x = c["weight_bytes"] / 1e6
        ax.plot([x, x], [c["tokens_per_s_batch1"], c[key]], "-", color=f"C{i}", alpha=0.4)
        ax.plot([x], [c["tokens_per_s_batch1"]], "o", ms=8, color=f"C{i}",
                label=f"{c['name']} ({c['dtype']}): perplexity {c['perplexity']:.4g}")
        ax.plot([x], [c[key]], "s", ms=8, color=f"C{i}")
    ax.plot([], [], "ko", label="circles: batch 1")
    ax.plot([], [], "ks", label=f"squares: batch {big}")
    ax.set(xlabel="weight bytes read per decode step (MB)", ylabel="decode tokens/s")
    ax.set_xlim(0, max(c["weight_bytes"] for c in cfgs) / 1e6 * 1.1)
    ax.set_ylim(0, max(max(c["tokens_per_s_batch1"], c[key]) for c in cfgs) * 1.15)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=2)
    return fig


def plot_kv_compression(r: dict):
    lec, tim, w = r["lecture"], r["timed"], r["sliding_window"]
    heads = lambda rows: " | ".join(str(x["kv_heads"]) for x in rows)                  # noqa: E731
    models = ([f"{r['lecture_preset']} (kv_heads {heads(lec)})"] +
              ([] if lec == tim else [f"{r['timed_preset']} (kv_heads {heads(tim)})"]) +
              [f"{w['model'].removeprefix(RANDOM_PREFIX)} (window {w['window']})"])
    fig, (a1, a2, a3) = _figure({**r, "models": models}, "KV compression: fewer KV heads, fewer bytes per token "
                                "and more sequences per budget; a sliding window caps the blocks", ncols=3)
    names = [x["name"] for x in lec]
    # The allocated pool's bytes per token (log scale: MHA to MQA spans the query-head count)
    a1.bar(names, [x["pool_bytes_per_token"] / 1024 for x in lec], color="C0", label="allocated pool")
    for i, x in enumerate(lec):
        a1.annotate(f"{x['kv_bytes_per_token'] / 1024:.4g} KiB\nfits {x['fit_batch']}",
                    (i, x["pool_bytes_per_token"] / 1024), textcoords="offset points", xytext=(0, 3), ha="center",
                    fontsize=8)
    a1.set(yscale="log", ylabel="KV cache KiB per token", title=f"{r['lecture_preset']}: KV bytes per token and "
           f"sequences of {r['lecture_context']} tokens that fit the budget", xlabel=f"attention ({r['dtype']})")
    a1.title.set_fontsize(9)
    a1.margins(y=0.25)
    names = [x["name"] for x in tim]
    a2.bar(names, [x["step_ms"] for x in tim], color="C1", label="decode step, measured")
    a2.plot(names, [x["bound_ms"] for x in tim], "k_", ms=30, mew=2, ls="none", label="bound: bytes / bandwidth")
    for i, x in enumerate(tim):
        a2.annotate(f"KV {x['kv_share']:.0%} of bytes", (i, x["step_ms"]), textcoords="offset points", xytext=(0, 3),
                    ha="center", fontsize=8)
    a2.set(ylabel="decode step (ms)", xlabel=f"attention ({r['timed_preset']})",
           title=f"batch {r['batch']} at a {r['timed_context']}-token context")
    a2.title.set_fontsize(9)
    a2.set_ylim(0, 1.15 * max(x["step_ms"] for x in tim))
    a2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=2)   # below: no bar hidden
    a3.plot(w["full"]["tokens"], w["full"]["blocks"], "-", color="C0", label="full attention")
    a3.plot(w["windowed"]["tokens"], w["windowed"]["blocks"], "-", color="C3", label=f"window W = {w['window']}")
    a3.axhline(w["window_bound_blocks"], color="grey", ls=":", lw=1,
               label=f"ceil(W / {w['block_size']}) + 1 = {w['window_bound_blocks']} blocks")
    a3.set(xlabel="tokens generated (1-token prompt)", ylabel=f"KV blocks in use (of {w['block_size']} tokens)",
           title="one sequence: O(length) against O(window)")
    a3.title.set_fontsize(9)
    a3.legend(fontsize=8, loc="upper left")
    return fig


PLOTS = {"roofline": plot_roofline, "batching": plot_batching, "kv-cache": plot_kv_cache,
         "speculative": plot_speculative, "serving": plot_serving, "quantization": plot_quantization,
         "kv-compression": plot_kv_compression}


def plots_dir(args) -> str | None:
    """Where the pictures go: --plots, else beside --json (results/x.json -> results/x/), else ./bench-plots."""
    if args.no_plots:
        return None
    if args.plots:
        return args.plots
    return os.path.splitext(args.json)[0] if args.json else "bench-plots"


def write_plot(name: str, r: dict, folder: str) -> str | None:
    """Draw experiment `name`'s picture from its results into folder/name.png; its path (None: no picture)."""
    if name not in PLOTS or "error" in r or "skipped" in r:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.png")
    PLOTS[name](r).savefig(path, dpi=110)
    return path


# ----------------------------------------------------------------------------
# --check: a verdict per GPU path, the first thing to run on a GPU
# ----------------------------------------------------------------------------
# The GPU code of this project is developed without a GPU (tests/ prove it on CPU,
# with a CUDA-graph capture simulator). `python bench.py --check` is where a GPU
# user finds out, in <= 3 minutes, whether each GPU path does what the CPU
# evidence says: paste its table into a bug report. `--check --device cpu` is
# its dry run (CI): the same table, the paths that need CUDA "skipped: CPU".

PASS, FAIL = "pass", "FAIL"


def _check_prompts(llm) -> list:
    """Four prompts of different lengths (one block, a few, a partial one): a batch of 4."""
    ids = llm.tokenizer.encode(eval_text())
    return [ids[:7], ids[40:80], ids[100:113], ids[200:300]]


FLOAT32_REL_TOL = 1e-3   # float32 paths differ by reassociation (~1e-5 of the largest logit); a bug by O(1)


def _same_greedy(ref, ref_tap: LogitTap, outs, tap: LogitTap) -> tuple[str, str]:
    """Verdict on a float32 path that must give the reference's greedy tokens and logits.
    Logits on the same tokens may differ by float32 rounding only (FLOAT32_REL_TOL of the
    row's largest); tokens may part only on a near tie: where they do, the reference's two
    best logits are closer than twice the paths' difference there (either order is right)."""
    errors = [o.error for o in list(ref) + list(outs) if o.error]
    if errors:
        return FAIL, f"a request failed: {errors[0]}"
    gap, parted, tie = 0.0, None, None
    for i, (r, o) in enumerate(zip(ref, outs)):
        n = agreement(o.token_ids, r.token_ids)
        a, c, first = ref_tap.rows(r), tap.rows(o), len(r.prompt_token_ids) - 1   # row `first` predicts token 0
        diffs = {p: ((a[p] - c[p]).abs().max() / a[p].abs().max()).item() for p in a.keys() & c.keys()
                 if p <= first + n}                                  # the rows with the same context
        gap = max([gap] + list(diffs.values()))
        if parted is None and not n == len(r.token_ids) == len(o.token_ids):
            top2, d = a[first + n].topk(2).values if first + n in a else None, diffs.get(first + n)
            margin = None if top2 is None else ((top2[0] - top2[1]) / a[first + n].abs().max()).item()
            if margin is not None and d is not None and margin <= 2 * d:
                tie = f"; prompt {i} parts at token {n} on a near tie (margin {margin:.2g} of the largest logit)"
            else:
                parted = f"prompt {i}: the tokens part after {n} of {len(r.token_ids)} (no near tie there)"
    n_tok = sum(len(r.token_ids) for r in ref)
    said = f"{len(ref)} prompts, {n_tok} greedy tokens; largest logit difference {gap:.2g} of the row's largest"
    if parted or gap > FLOAT32_REL_TOL:
        return FAIL, "; ".join(x for x in (parted, said) if x) + f" (float32 rounding: < {FLOAT32_REL_TOL:g})"
    return PASS, said + (tie or "; tokens equal")


def check_compiled(b: Bench):
    if b.device.type != "cuda":
        return "skipped: CPU", "CUDA graphs need a GPU (tests/test_kernels.py runs the compiled step on CPU)"
    kw = dict(path=b.quality_path, dtype="float32", max_num_seqs=4, kv_cache_bytes=b.pool_bytes(b.quality_path, 2048))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    eager = b.llm(**kw)
    prompts = _check_prompts(eager)
    with LogitTap(eager) as ref_tap:
        ref = eager.generate(prompts, params)
    del eager
    comp = b.llm(compile=True, **kw)
    with LogitTap(comp) as tap:
        outs = comp.generate(prompts, params)
    graphs, steps = len(getattr(comp.decoder, "graphs", {})), comp.decoder.steps.get(1, 0)
    verdict, detail = _same_greedy(ref, ref_tap, outs, tap)
    if not graphs or not steps:
        return FAIL, f"{graphs} CUDA graphs recorded, {steps} compiled decode steps run; {detail}"
    return verdict, f"{graphs} CUDA graphs recorded in {comp.compile_seconds:.0f} s, {steps} replayed steps; {detail}"


def check_int8_fused(b: Bench):
    """Every distinct int8 layer shape: torch.compile's fused int8 product (Int8Linear._fused,
    <= FUSED_ROWS rows) against the same layer run eagerly (convert, then F.linear)."""
    model = quantize_model(load_model(b.quality_path, device=b.device, dtype=torch.float32)[0])
    layers = {}
    for m in model.modules():
        if isinstance(m, Int8Linear):
            layers.setdefault((m.in_features, m.out_features), m)
    # On a CPU, bf16 activations take another kernel (_weight_int8pack_mm), and each compile
    # costs seconds: the dry run compiles the smallest and the largest layer in float32 only.
    cuda = b.device.type == "cuda"
    shapes = sorted(layers, key=lambda s: s[0] * s[1])
    shapes = shapes if cuda else [shapes[0], shapes[-1]]
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    worst, gen = {}, torch.Generator().manual_seed(0)
    for dtype in [torch.float32] + ([torch.bfloat16] if cuda else []):
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7      # reassociated sums: a few ulps of the output
        for shape in shapes:
            layer, fused = layers[shape], torch.compile(layers[shape], fullgraph=True)
            for rows in (FUSED_ROWS, 1):          # symbolic rows, size 1 included: one compile per layer and dtype
                x = dynamic(torch.randn(rows, shape[0], generator=gen).to(b.device, dtype), 0)
                with torch.inference_mode(), size_oblivious():
                    want, got = layer(x).float(), fused(x).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                worst[(str(dtype), shape)] = max(err, worst.get((str(dtype), shape), 0.0))
                if not err <= tol:
                    return FAIL, (f"{dtype}, layer {shape[0]}->{shape[1]}, {rows} rows: fused differs by "
                                  f"{err:.3g} (> {tol:g})")
    dtypes = ", ".join(sorted({k[0].replace("torch.", "") for k in worst}))
    return PASS, (f"{len(shapes)} layer shapes x rows 1 and {FUSED_ROWS}, {dtypes}: largest difference "
                  f"{max(worst.values()):.2g} of the output's largest value")


def check_int8_kv(b: Bench):
    """Real K, V (a prefill of the evaluation text through the float cache) written into an int8
    cache and read back: every value within half a quantization step of its (token, head), plus
    the dtype's own rounding of the dequantized value."""
    llm = b.llm(path=b.quality_path, max_num_seqs=1, enable_prefix_caching=False,
                kv_cache_bytes=b.pool_bytes(b.quality_path, 1024))
    ids = llm.tokenizer.encode(eval_text())[:min(b.q(512, 128), llm.max_len - 1)]
    out = llm.generate([ids], SamplingParams(max_tokens=1))[0]
    if out.error:
        return FAIL, f"the prefill failed: {out.error}"
    cache, dtype = llm.cache, llm.dtype
    q8 = Int8KVCache(llm.config, cache.num_blocks, cache.block_size, b.device, dtype)
    slots, blocks = torch.arange(cache.num_blocks * cache.block_size, device=b.device), \
        torch.arange(cache.num_blocks, device=b.device)
    worst, eps = 0.0, torch.finfo(dtype).eps
    for layer in range(llm.config.n_layers):
        x = cache.k[layer].flatten(0, 1), cache.v[layer].flatten(0, 1)           # [slots, n_kv, d]
        q8.write(layer, slots, *x)
        for orig, back in zip(x, q8.blocks(layer, blocks)):
            orig, back = orig.float(), back.flatten(0, 1).float()
            half_step = orig.abs().amax(-1, keepdim=True) / 127 / 2             # scale / 2 per (token, head)
            bound = half_step * (1 + 1e-4) + 2 * eps * (orig.abs() + half_step)
            worst = max(worst, ((back - orig).abs() / bound.clamp_min(1e-30)).max().item())
    filled = int((cache.k[0].flatten(0, 1).abs().amax((-1, -2)) > 0).sum())
    verdict = PASS if worst <= 1.0 else FAIL
    return verdict, (f"{filled} tokens x {llm.config.n_layers} layers x {llm.config.n_kv_heads} KV heads, K and V: "
                     f"the largest error is {worst:.4f} x the bound (half a step + {str(dtype)[6:]} rounding)")


def check_tensor_parallel_nccl(b: Bench):
    if b.device.type != "cuda":
        return "skipped: CPU", "NCCL needs GPUs (tests/test_parallel.py runs N = 2 and 3 with gloo on CPU)"
    if torch.cuda.device_count() < 2:
        return "skipped: needs 2 GPUs", f"{torch.cuda.device_count()} GPU visible"
    path = b.quality_path
    try:
        check_tensor_parallel(model_config(path)[0], 2, "cuda")
    except ValueError:                 # e.g. SmolLM2's 9 heads: a published shape that splits in two
        path = RANDOM_PREFIX + "llama-3.2-1b"
    kw = dict(path=path, dtype="float32", max_num_seqs=4, kv_cache_bytes=b.pool_bytes(path, 2048))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    one = b.llm(**kw)
    prompts = _check_prompts(one)
    with LogitTap(one) as ref_tap:
        ref = one.generate(prompts, params)
    del one
    two = b.llm(tensor_parallel_size=2, **kw)
    try:
        with LogitTap(two) as tap:
            outs = two.generate(prompts, params)
    finally:
        two.close()
    verdict, detail = _same_greedy(ref, ref_tap, outs, tap)
    return verdict, f"{os.path.basename(path)}, N = 2 over NCCL against N = 1: {detail}"


def check_graph_memory(b: Bench):
    """The compiled engine with the pool it sizes itself (kv_cache_bytes=None, what a user
    gets), then its largest bucket: every seat decoding at the longest context, after a full
    prefill chunk at that context. Nothing may run out of memory, and the replays may not
    reserve memory beyond what the engine held once built and warmed up."""
    if b.device.type != "cuda":
        return "skipped: CPU", "CUDA graphs and their memory pool exist on a GPU only"
    llm = b.llm(path=b.quality_path, dtype="float32", max_num_seqs=8, compile=True, kv_cache_bytes=None)
    dev, gib = b.device, 2 ** 30
    total, built = torch.cuda.get_device_properties(dev).total_memory, torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    B, steps = llm.scheduler.max_num_seqs, 4
    context = min(llm.max_len - steps - 70, llm.block_manager.num_blocks * llm.block_manager.block_size // B - 80)
    ids = start_decoding(llm, B, context, steps)      # prefill chunks at up to `context` keys, untimed
    prefilled, before = torch.cuda.max_memory_reserved(dev), torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    replays = llm.decoder.steps.get(1, 0)
    for _ in range(steps):
        llm.step()                                    # pure decodes of B sequences: the widest bucket
    torch.cuda.synchronize(dev)
    decoding, replays = torch.cuda.max_memory_reserved(dev), llm.decoder.steps.get(1, 0) - replays
    for rid in ids:
        llm.abort(rid)
    detail = (f"{len(llm.decoder.graphs)} graphs; {B} sequences x {context} tokens; reserved {built / gib:.1f} GiB "
              f"once built, {prefilled / gib:.1f} GiB at peak while prefilling, {decoding / gib:.1f} GiB while "
              f"decoding, of {total / gib:.1f} GiB")
    budget = getattr(llm, "memory_budget", None)      # what the engine planned, where it says so
    if budget is not None:
        detail += f"; the engine's budget: {budget}"
    if not replays:
        return FAIL, "no compiled decode step ran; " + detail
    grew = decoding - before
    detail += f"; decoding grew the reservation by {grew / 2**20:.0f} MiB"
    return (PASS if grew <= 64 * 2 ** 20 else FAIL), detail


def check_sdpa(b: Bench):
    """The eager engine's attention (prefill chunks, mixed steps, decodes) with SDPA's math backend
    disabled: a call that would fall back to it raises (kernels.STRICT_SDPA, and sdpa_kernel here)."""
    if b.device.type != "cuda":
        return "skipped: CPU", "SDPA's fused backends (flash, memory-efficient, cuDNN) are CUDA kernels"
    from torch.nn.attention import SDPBackend, sdpa_kernel
    fused = [getattr(SDPBackend, n) for n in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
             if hasattr(SDPBackend, n)]
    # max_num_batched_tokens 64: prompts are prefilled in chunks next to other sequences' decodes
    llm = b.llm(path=b.quality_path, max_num_seqs=4, max_num_batched_tokens=64,
                kv_cache_bytes=b.pool_bytes(b.quality_path, 2048))
    strict = getattr(kernels, "STRICT_SDPA", None)
    try:
        if strict is not None:
            kernels.STRICT_SDPA = True
        with sdpa_kernel(fused):
            outs = llm.generate(_check_prompts(llm), SamplingParams(max_tokens=8, ignore_eos=True))
    finally:
        if strict is not None:
            kernels.STRICT_SDPA = strict
    note = "" if strict is not None else " (kernels.STRICT_SDPA absent: sdpa_kernel alone)"
    errors = [o.error for o in outs if o.error]
    if errors:
        return FAIL, f"{llm.dtype}: {errors[0]}{note}"
    return PASS, f"{llm.dtype}: chunked prefills, mixed steps and decodes ran on {len(fused)} fused backends only{note}"


CHECKS = {"compiled + CUDA graphs = eager (float32, real model)": check_compiled,
          "int8 fused = unfused": check_int8_fused,
          "int8 KV cache within its bound": check_int8_kv,
          "tensor parallel (NCCL) N = 2 = N = 1": check_tensor_parallel_nccl,
          "CUDA-graph memory fits as budgeted": check_graph_memory,
          "SDPA reaches a fused backend": check_sdpa}


def run_checks(b: Bench) -> tuple[dict, str]:
    """Every check in isolation (one that raises is a FAIL with its error): (results, table)."""
    results = {}
    for i, (name, fn) in enumerate(CHECKS.items(), 1):
        print(f"bench: check [{i}/{len(CHECKS)}] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            verdict, detail = fn(b)
        except Exception as e:                       # noqa: BLE001 (a verdict, whatever went wrong)
            where = traceback.extract_tb(e.__traceback__)[-1]
            verdict, detail = FAIL, f"{type(e).__name__}: {e} (at {os.path.basename(where.filename)}:{where.lineno})"
        gc.collect()
        if b.device.type == "cuda":  # pragma: no cover (CUDA)
            torch.cuda.empty_cache()
        results[name] = {"verdict": verdict, "detail": detail, "seconds": time.perf_counter() - t0}
    rows = [[name, r["verdict"], f"{r['seconds']:.0f}", r["detail"]] for name, r in results.items()]
    count = {v: sum(r["verdict"].startswith(v) for r in results.values()) for v in (PASS, FAIL, "skipped")}
    return results, (table(["path", "verdict", "seconds", "detail"], rows) +
                     f"\n\n{count[PASS]} pass, {count[FAIL]} FAIL, {count['skipped']} skipped. Paste this table, with "
                     "the lines above it, into any report about nanoinfer on this machine.")


EXPERIMENTS = {"overhead": exp_overhead, "roofline": exp_roofline, "kv-cache": exp_kv_cache, "batching": exp_batching,
               "continuous-vs-static": exp_continuous_vs_static, "prefix": exp_prefix,
               "speculative": exp_speculative, "quantization": exp_quantization, "compile": exp_compile,
               "peer": exp_peer, "serving": exp_serving, "tensor-parallel": exp_tensor_parallel,
               "kv-compression": exp_kv_compression}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--model", default=None, help="checkpoint directory or random:<preset> for every experiment "
                    "(default: the embedded SmolLM2-135M-Instruct; on a GPU, timing on the largest preset that fits)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--only", default=None, help="comma-separated experiments: " + ",".join(EXPERIMENTS))
    ap.add_argument("--quick", action="store_true", help="a smoke run of every experiment")
    ap.add_argument("--json", default=None, help="write every figure to this file (merged into it if it exists)")
    ap.add_argument("--draft", default=None, help="a draft model directory for the speculative experiment")
    ap.add_argument("--plots", default=None, help="folder for the pictures (default: beside --json, results/x.json "
                    "-> results/x/; without --json ./bench-plots)")
    ap.add_argument("--no-plots", action="store_true", help="write no pictures")
    ap.add_argument("--check", action="store_true", help="a verdict per GPU path (<= 3 min on one GPU): run it "
                    "first on a GPU and report its output; --device cpu is its dry run")
    ap.add_argument("--strict-sdpa", action="store_true", help="an SDPA call that would fall back to the slow math "
                    "backend raises instead (kernels.STRICT_SDPA)")
    return ap, ap.parse_args(argv)


@contextlib.contextmanager
def strict_sdpa(b: Bench):
    """--strict-sdpa: kernels.STRICT_SDPA on for the run; where kernels.py lacks it, the run inside
    sdpa_kernel on CUDA (the math backend off: a fallback raises)."""
    old = getattr(kernels, "STRICT_SDPA", None)
    if old is not None:
        kernels.STRICT_SDPA = True
        try:
            yield
        finally:
            kernels.STRICT_SDPA = old
        return
    print("bench: kernels.STRICT_SDPA does not exist: the run is wrapped in sdpa_kernel instead", file=sys.stderr)
    if b.device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel  # pragma: no cover (CUDA)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):  # pragma: no cover (CUDA)
        yield


def run_experiment(b: Bench, name: str) -> tuple[dict, str]:
    """One experiment in isolation: one that raises reports its error (in its table and its JSON
    entry) and frees what it held, and the next experiment runs."""
    try:
        return EXPERIMENTS[name](b)
    except Exception as e:                           # noqa: BLE001 (KeyboardInterrupt still stops the run)
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        return ({"error": f"{type(e).__name__}: {e}", "traceback": tb},
                f"**Failed**: {type(e).__name__}: {e} (the traceback is in the JSON and on stderr).")
    finally:
        b.done()
        gc.collect()                                 # the failed experiment's engines hold memory
        if b.device.type == "cuda":  # pragma: no cover (CUDA)
            torch.cuda.empty_cache()


def main(argv=None):
    ap, args = parse_args(argv)
    names = list(EXPERIMENTS) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        ap.error(f"unknown experiment(s) {unknown}; choose from {list(EXPERIMENTS)}")
    # --json merges: each experiment is stored under its name with the meta of the
    # run that measured it, so rerunning one experiment replaces only its entry
    # (a long GPU run's other results survive a quick rerun into the same file).
    # Read first: a file that is not bench results stops the run before any work.
    results = load_results(args.json) if args.json else {}
    b = Bench(args)
    # Everything that makes a figure reproducible travels with it in the JSON.
    meta = {"device": torch.cuda.get_device_name(b.device) if b.device.type == "cuda" else
            f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
            "dtype": args.dtype, "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "model": b.path, "timing_model": b.path, "quality_model": b.quality_path, "scale": b.scale,
            "quick": args.quick,
            "command": " ".join(["python", "bench.py"] + list(sys.argv[1:] if argv is None else argv))}
    print(f"# nanoinfer bench\n\n{meta['device']}, torch {meta['torch']}, dtype {args.dtype}, {meta['date']}\n"
          f"Timing model {b.path} ({weights_label(b.path)}; {b.scale}); "
          f"quality model {os.path.basename(b.quality_path)} ({weights_label(b.quality_path)}).")
    results["meta"] = meta                 # the latest run
    with strict_sdpa(b) if args.strict_sdpa else contextlib.nullcontext():
        if args.check:
            checks, text = run_checks(b)
            results["check"] = {"checks": checks, "meta": meta}
            print(f"\n## check\n\n{text}\n", flush=True)
            save_results(args.json, results)
        else:
            run_all(b, names, results, meta, plots_dir(args))
    return results


def run_all(b: Bench, names: list, results: dict, meta: dict, folder: str | None):
    """The experiments one after another (they never share the machine), each saved and drawn when done."""
    start = time.perf_counter()
    for i, name in enumerate(names, 1):
        print(f"bench: [{i}/{len(names)}] {name} ... (elapsed {time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)
        t0, b.used = time.perf_counter(), {}
        fig, text = run_experiment(b, name)
        fig["wall_seconds"] = time.perf_counter() - t0
        fig["models"], fig["meta"] = dict(b.used), meta     # which weights every figure came from
        if folder:
            try:
                fig["plot"] = write_plot(name, fig, folder)
            except Exception as e:                   # noqa: BLE001 (a picture never costs the figures)
                fig["plot_error"] = f"{type(e).__name__}: {e}"
        results[name] = fig
        models = "; ".join(f"{p} ({label})" for p, label in b.used.items())
        picture = f"\n\nPicture: {fig['plot']}" if fig.get("plot") else ""
        print(f"\n## {name}\n\n" + (f"Model: {models}.\n\n" if models else "") + f"{text}{picture}\n", flush=True)
        print(f"bench: [{i}/{len(names)}] {name} {'FAILED' if 'error' in fig else 'done'} in "
              f"{fig['wall_seconds']:.0f} s", file=sys.stderr, flush=True)
        save_results(b.args.json, results)           # after every experiment: a cut-short run keeps what it measured
    failed = [n for n in names if "error" in results[n]]
    if failed:
        print(f"bench: {len(failed)} experiment(s) failed: {', '.join(failed)}", file=sys.stderr, flush=True)


def save_results(path: str | None, results: dict):
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, path)              # atomic: a crash mid-write never leaves half a file


def failed(results: dict) -> bool:
    """Whether an experiment or a check of THIS run (not one merged from the file) failed: the exit status."""
    mine = [r for k, r in results.items() if k != "meta" and isinstance(r, dict) and r.get("meta") is results["meta"]]
    return any("error" in r for r in mine) or any(c["verdict"] == FAIL for r in mine
                                                  for c in r.get("checks", {}).values())


def load_results(path: str) -> dict:
    """The results already in `path` (none if it does not exist). A file that
    is not a bench result (not JSON, not an object, or an object without the
    "meta" every bench file has) is never overwritten: SystemExit instead."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench.py: {path} exists but cannot be read as bench results ({e}); "
                         "refusing to overwrite it: move it away or choose another --json file") from None
    if not isinstance(old, dict) or (old and not isinstance(old.get("meta"), dict)):
        raise SystemExit(f"bench.py: {path} is not a bench results file (no \"meta\" object); "
                         "refusing to overwrite it: move it away or choose another --json file")
    return old


if __name__ == "__main__":
    sys.exit(1 if failed(main()) else 0)
