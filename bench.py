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

    python bench.py                      # everything, best device (see "The scale" below)
    python bench.py --quick              # a smoke run of every experiment (1-2 min on a 2-core CPU,
                                         # torch.compile's first build included)
    python bench.py --only batching,compile --json results.json
    python bench.py --model random:llama-3.1-8b --only overhead,serving,tensor-parallel

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

import torch
import torch.nn.functional as F

from cache import AttentionContext, BlockManager, kv_cache_bytes
from model import default_model_path, generate, load_model
from parallel import (NVLINK_H100_SXM, PCIE_GEN5_X16, TensorParallelError, TensorParallelGroup,
                      check_tensor_parallel, tensor_parallel_cost)
from kernels import batched_paged_attention, dynamic, layer_cache, paged_attention_in_place, size_oblivious
from quantize import decode_weight_bytes
from scheduler import LLM, SamplingParams
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

# The batching experiment on a GPU runs the goal case, batch 64 at a
# 2k-token context: its KV pool (64 x ~2.1k tokens; 18 GB at 8B shapes) is
# the largest any experiment asks for, so the model picker reserves it.
GPU_BATCH, GPU_CONTEXT = 64, 2048
GPU_POOL = 8 << 30                   # the other experiments' pool on a GPU (65k tokens at 8B shapes)
CPU_POOL = 1 << 30

# The full GPU run is designed for <= 10 minutes on one H100 with the 8B
# timing model in bf16 and the 135M default model for quality. Estimates (not
# measured here: this was written on a CPU), from 16 GB of weights per step
# (>= 5.4 ms at ~3 TB/s; ~15 ms assumed for an eager step at batch <= 16):
#   roofline              ~10 s  12 decode steps, 6 prefills of 512 tokens
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
# Sum ~460 s, plus engine start-ups (random weights are made on the device: < 1 s each).


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
            self.machine["bandwidth"] = 2 * a.numel() * 4 / self.timeit(lambda: b.copy_(a), self.q(10, 3))
        return self.machine["bandwidth"]

    def flops(self, dtype) -> float:
        """FLOP/s of a square matmul in the engine's dtype."""
        if "flops" not in self.machine:
            # A big square matmul is the most compute-bound op there is: its rate
            # is the ceiling prefill can approach (the other roofline).
            n = self.q(4096 if self.device.type == "cuda" else 1024, 256)
            a = torch.randn(n, n, device=self.device, dtype=dtype)
            self.machine["flops"] = 2 * n**3 / self.timeit(lambda: a @ a, self.q(10, 3))
        return self.machine["flops"]


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


def exp_roofline(b: Bench):
    # No prefix caching: the prefill is timed on the same prompt again and again,
    # and every run must compute all of it.
    llm = b.llm(max_num_seqs=1, enable_prefix_caching=False)
    cfg, bw = llm.config, b.bandwidth()
    flops = b.flops(llm.dtype)
    W, kv = decode_weight_bytes(llm.model), llm.cache.bytes_per_token
    context = b.q(512, 32)
    flop_tok = model_flops_per_token(cfg, context)
    # The lecture's decode bound: a batch-1 step must read every weight and the
    # sequence's whole KV cache once, so it cannot beat bytes / bandwidth.
    decode_bound = (W + kv * context) / bw
    b.progress("roofline: decode step at batch 1")
    decode = decode_step_seconds(b, llm, 1, context, b.q(10, 3))
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
           "kv_bytes_per_token": kv, "context": context, "flops_per_token": flop_tok,
           "decode_bound_ms": decode_bound * 1e3, "decode_measured_ms": decode * 1e3,
           "decode_fraction_of_roofline": decode_bound / decode,
           "prefill_tokens": context, "prefill_bound_ms": prefill_bound * 1e3, "prefill_measured_ms": prefill * 1e3,
           "prefill_fraction_of_roofline": prefill_bound / prefill,
           "machine_balance_flops_per_byte": flops / bw,
           "intensity": [{"batch": r[0], "flops_per_byte": r[1], "bound_by": r[2], "bound_ms": r[3]} for r in rows]}
    text = (f"Device: {bw / 1e9:.1f} GB/s copy bandwidth, {flops / 1e12:.2f} TFLOP/s matmul "
            f"({llm.dtype}); machine balance {flops / bw:.0f} FLOP/byte.\n"
            f"Weights read per decode step {W / 1e6:.1f} MB, KV cache {kv} B/token.\n\n" +
            table(["step", "bound (ms)", "measured (ms)", "fraction of roofline"],
                  [[f"decode, batch 1, {context}-token context", decode_bound * 1e3, decode * 1e3, decode_bound / decode],
                   [f"prefill of {context} tokens", prefill_bound * 1e3, prefill * 1e3, prefill_bound / prefill]]) +
            "\n\nArithmetic intensity of a decode step (FLOPs per byte ~ batch size):\n\n" +
            table(["batch", "FLOP/byte", "bound by", "bound step (ms)", "bound tokens/s"], rows))
    return fig, text


def exp_kv_cache(b: Bench):
    # No prefix caching: every cached run must compute its prompt too, as the naive one does.
    llm = b.llm(max_num_seqs=1, enable_prefix_caching=False)
    prompt = llm.tokenizer.encode(eval_text())[:32]
    rows, fig = [], {"prompt_tokens": len(prompt), "lengths": []}
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
        same = out.token_ids == naive_ids
        rows.append([n, t_naive / n * 1e3, t_cache / n * 1e3, t_naive / t_cache, same])
        fig["lengths"].append({"tokens": n, "naive_ms_per_token": t_naive / n * 1e3,
                               "cached_ms_per_token": t_cache / n * 1e3, "speedup": t_naive / t_cache,
                               "naive_tokens": len(naive_ids), "cached_tokens": len(out.token_ids),
                               "same_tokens": same})
    return fig, table(["output tokens", "naive ms/token", "KV cache ms/token", "speedup", "same tokens"], rows)


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
    rows, fig, B = [], {"context": context, "weight_bytes": W, "kv_bytes_per_token": kv, "points": []}, 1
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
    return {"k": k, "alpha": alpha, "tokens": len(o.token_ids), "passes": steps,
            "tokens_per_pass": len(o.token_ids) / steps, "pass_cost_ratio": pass_cost,
            "speedup": t_plain / t_spec, "predicted_speedup": predicted, "same_tokens": o.token_ids == ref.token_ids}


def exp_speculative(b: Bench):
    # Acceptance is a quality figure (how often the model agrees with the
    # drafts), so this runs on the real model, never on random weights.
    drafters = ["ngram"] + ([b.args.draft] if b.args.draft else [])
    out = b.q(128, 16)
    params = SamplingParams(max_tokens=out)
    base_llm = b.llm(path=b.quality_path, max_num_seqs=1)
    prompts = _spec_prompts(base_llm, b)
    plain = {}
    for wname, prompt in prompts.items():
        b.progress(f"speculative: {wname}, plain")
        t_plain = b.timeit(lambda: base_llm.generate([prompt], params), b.q(3, 1, gpu=2))
        steps0 = base_llm.stats["steps"]
        ref = base_llm.generate([prompt], params)[0]
        plain[wname] = (t_plain, ref, base_llm.stats["steps"] - steps0)
    del base_llm
    fig = {"runs": []}
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
    rows = [[r["workload"], r["drafter"], r["k"], r["alpha"], r["tokens_per_pass"], r["pass_cost_ratio"],
             r["speedup"], r["predicted_speedup"], r["same_tokens"]] for r in fig["runs"]]
    text = (f"Greedy, {out} new tokens, batch 1. Predicted speedup = (1 - a^(k+1)) / (1 - a) tokens per "
            "pass / measured cost of a verify pass relative to a decode pass.\n\n" +
            table(["workload", "drafter", "k", "acceptance a", "tokens/pass", "pass cost", "speedup",
                   "predicted", "same tokens"], rows))
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


def exp_compile(b: Bench):
    # The smoke run compiles batch 1 only: each compiled graph costs ~20 s cold on
    # a 2-core CPU (batch 1 and batch > 1 are two graphs, see kernels.py).
    big, context, steps = b.q(16, 1), b.q(128, 16), b.q(10, 3)
    sizes = sorted({1, big})
    eager = b.llm(max_num_seqs=big)
    b.progress("compile: eager")
    e = {B: decode_step_seconds(b, eager, B, context, steps) for B in sizes}
    # The exactness check of the compiled path: the same greedy tokens (bit-exact in float32;
    # in bf16 fused and unfused roundings may differ after a few tokens).
    prompt = eager.tokenizer.encode(eval_text())[:context]
    check = SamplingParams(max_tokens=b.q(32, 8), ignore_eos=True)
    ref = eager.generate([prompt], check)[0].token_ids
    del eager
    b.progress("compile: compiling (warm-up of every bucket)")
    # Construction compiles and warms up every bucket; that one-off cost is
    # reported on its own (compile_seconds) and kept out of the step times.
    comp = b.llm(max_num_seqs=big, compile=True)
    b.progress("compile: compiled")
    c = {B: decode_step_seconds(b, comp, B, context, steps) for B in sizes}
    same = comp.generate([prompt], check)[0].token_ids == ref
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
           "same_tokens": same, "dtype": str(comp.dtype).replace("torch.", "")}
    for B in sizes:
        fig.update({f"eager_ms_batch{B}": e[B] * 1e3, f"compiled_ms_batch{B}": c[B] * 1e3,
                    f"speedup_batch{B}": e[B] / c[B]})
    rows = [["eager"] + [e[B] * 1e3 for B in sizes],
            [f"eager, {comp.weight_layout} weight layout", l1 * 1e3] + [""] * (len(sizes) - 1),
            ["compiled (+ layout)"] + [c[B] * 1e3 for B in sizes], ["speedup"] + [e[B] / c[B] for B in sizes]]
    text = (table(["decode step"] + [f"batch {B} (ms)" for B in sizes], rows) +
            f"\n\nWeight layout chosen by measurement: {comp.weight_layout}. "
            f"Compiling every bucket took {comp.compile_seconds:.1f} s. Batch 1 roofline "
            f"{bound * 1e3:.2f} ms: compiled decode runs at {bound / c[1]:.0%} of it. Greedy tokens of the "
            f"compiled engine equal the eager engine's: {same}.")
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
    bodies = [{"prompt": p, "max_tokens": m, "temperature": 0.0, "ignore_eos": True, "stream": i % 2 == 0}
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
    _http_request(*addr, {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0, "stream": True}, limit)  # warm-up
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
             p["weight_bytes_per_rank"] / 1e6, p["same_tokens_as_n1"]] for p in m["points"]]
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
                   "µs per collective", "weight MB/rank", "same tokens as N=1"], rows) +
            f"\n\nThe arithmetic (parallel.tensor_parallel_cost) for one decode step of {GPU_BATCH} sequences in "
            "bf16: all-reduce payload = 2 x layers x batch x dim x 2 bytes; a ring moves 2 (N-1)/N of it through "
            f"each GPU's link (NVLink {NVLINK_H100_SXM / 1e9:.0f} GB/s, PCIe 5.0 x16 {PCIE_GEN5_X16 / 1e9:.0f} GB/s "
            "per direction), plus a latency per call (2 x layers calls per step) not counted here; beside it the "
            "step's weight read per GPU at H100 HBM3's 3.35 TB/s.\n\n" +
            table(["model", "GPUs", "weights/GPU (GB)", "fits 80 GB", "KV/token/GPU (KiB)", "KV tokens in the rest",
                   "all-reduce/step (MB)", "NVLink (µs)", "PCIe (µs)", "weight read (µs)"], arows))
    return fig, text


EXPERIMENTS = {"overhead": exp_overhead, "roofline": exp_roofline, "kv-cache": exp_kv_cache, "batching": exp_batching,
               "continuous-vs-static": exp_continuous_vs_static, "prefix": exp_prefix,
               "speculative": exp_speculative, "quantization": exp_quantization, "compile": exp_compile,
               "peer": exp_peer, "serving": exp_serving, "tensor-parallel": exp_tensor_parallel}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--model", default=None, help="checkpoint directory or random:<preset> for every experiment "
                    "(default: the embedded SmolLM2-135M-Instruct; on a GPU, timing on the largest preset that fits)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--only", default=None, help="comma-separated experiments: " + ",".join(EXPERIMENTS))
    ap.add_argument("--quick", action="store_true", help="a smoke run of every experiment")
    ap.add_argument("--json", default=None, help="write every figure to this file (merged into it if it exists)")
    ap.add_argument("--draft", default=None, help="a draft model directory for the speculative experiment")
    args = ap.parse_args(argv)
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
    start = time.perf_counter()
    for i, name in enumerate(names, 1):    # one after another: experiments never share a machine with each other
        print(f"bench: [{i}/{len(names)}] {name} ... (elapsed {time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)
        t0, b.used = time.perf_counter(), {}
        fig, text = EXPERIMENTS[name](b)
        b.done()
        fig["wall_seconds"] = time.perf_counter() - t0
        fig["models"], fig["meta"] = dict(b.used), meta     # which weights every figure came from
        results[name] = fig
        models = "; ".join(f"{p} ({label})" for p, label in b.used.items())
        print(f"\n## {name}\n\n" + (f"Model: {models}.\n\n" if models else "") + f"{text}\n", flush=True)
        print(f"bench: [{i}/{len(names)}] {name} done in {fig['wall_seconds']:.0f} s", file=sys.stderr, flush=True)
        if args.json:                      # after every experiment: a cut-short run keeps what it measured
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(results, f, indent=1)
            os.replace(tmp, args.json)     # atomic: a crash mid-write never leaves half a file
    return results


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
    main()
