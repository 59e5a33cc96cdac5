"""
bench.py -- measuring it all: every lesson of the lecture as a number on your machine.

Each experiment measures a baseline and the technique in the same run (the
machines are shared and noisy: only ratios measured side by side mean
anything), takes medians over repeats with warm-up excluded, and prints the
bound the lecture predicts next to the measurement:

  roofline              memory bandwidth and matmul throughput of the device; the decode
                        bound (weight bytes + KV bytes) / bandwidth; arithmetic intensity ~ batch
  kv-cache              naive generation (recompute everything) vs the KV cache
  batching              decode step time and tokens/s from batch 1 up: the latency/throughput knee
  continuous-vs-static  a heterogeneous workload, static groups vs continuous batching
  prefix                a long shared system prompt with prefix caching on vs off
  speculative           n-gram (or --draft model) drafts at k = 1..8: acceptance, speedup, prediction
  quantization          float vs int8 weights (and int8 KV): bytes, tokens/s, perplexity
  compile               eager vs torch.compile'd decode step, and the compile time
  peer                  Hugging Face transformers' generate on the same workload (if installed)

    python bench.py                      # everything, best device, default model
    python bench.py --quick              # a smoke run of every experiment (2 min on a 2-core CPU,
                                         # plus a few the first time torch.compile builds its code)
    python bench.py --only batching,compile --json results.json
Tables print as Markdown (paste them into the README); --json writes every
figure with the device, dtype, torch version and date.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import json
import math
import os
import platform
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from cache import AttentionContext
from model import default_model_path, generate
from quantize import decode_weight_bytes, eval_text
from scheduler import LLM, SamplingParams

# ----------------------------------------------------------------------------
# Helpers: quiet engines, timing, tables
# ----------------------------------------------------------------------------


class Bench:
    """The run's settings and the helpers every experiment shares."""

    def __init__(self, args):
        self.args, self.quick = args, args.quick
        self.path = args.model or default_model_path()
        self.device = torch.device(args.device if args.device != "auto" else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = args.dtype
        self.machine = {}                      # bandwidth and FLOP/s, measured once

    def q(self, full, quick):
        """The full run's setting, or the smoke run's."""
        return quick if self.quick else full

    def llm(self, path=None, **kw):
        """An engine on the bench's model (or `path`) and device, without its start-up chatter."""
        kw.setdefault("device", str(self.device))
        kw.setdefault("dtype", self.dtype)
        # A fixed pool, not "most of the free memory": experiments hold two engines at once.
        kw.setdefault("kv_cache_bytes", (8 << 30) if self.device.type == "cuda" else (1 << 30))
        gc.collect()                       # engines hold reference cycles: free the last one's pool first
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        with contextlib.redirect_stdout(io.StringIO()):
            return LLM(path or self.path, **kw)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timeit(self, fn, repeats: int, warmup: int = 1) -> float:
        """Median seconds of fn() over repeats, after warm-up calls."""
        # Warm-up first: the first call pays for allocator growth, lazy
        # initialisation and (with torch.compile) compilation, none of which
        # is the steady-state cost we want to compare.
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            self.sync()                     # GPU work is asynchronous: wait for it, or we time the launch
            times.append(time.perf_counter() - t0)
        # The median, not the mean: on a shared machine one slow outlier (another
        # process, a page fault) should not move the figure.
        return statistics.median(times)

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


def decode_step_seconds(b: Bench, llm, batch: int, context: int, steps: int) -> float:
    """Median time of one engine step with `batch` sequences decoding at
    ~`context` tokens each (prefill done first, not timed)."""
    # Random token ids are fine here: a step's cost depends on how many tokens
    # and how much context, never on which tokens (and ignore_eos keeps every
    # sequence alive for the whole measurement).
    rng = random.Random(batch)
    vocab = llm.config.vocab_size
    ids = [llm.add_request([rng.randrange(vocab) for _ in range(context)],
                           SamplingParams(max_tokens=steps + 64, ignore_eos=True)) for _ in range(batch)]
    started = set()
    while len(started) < batch:                           # prefill (maybe chunked) until all decode
        started |= {o.request_id for o in llm.step() if o.outputs[0].token_ids}
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
        slots = bm.append_slots(sid, start, len(toks))
        x, pos, ctx = AttentionContext.build(llm.cache, bm, [(sid, toks, start, slots)],
                                             list(range(len(toks))), llm.device)
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


TINY_MODEL = "random:smollm2-tiny"   # model.py preset: 2 layers, dim 64, the real vocabulary


def forward_seconds(b: Bench, llm, batch: int, context: int, steps: int) -> float:
    """Median time of the bare forward pass of the decode batch that
    decode_step_seconds times: inputs built once, no scheduling, no sampling,
    no detokenizing. The gap to the engine's step is the engine's own work."""
    rng = random.Random(batch)
    ids = [llm.add_request([rng.randrange(llm.config.vocab_size) for _ in range(context)],
                           SamplingParams(max_tokens=8, ignore_eos=True)) for _ in range(batch)]
    while len([s for s in llm.scheduler.running if s.remaining == 1]) < batch:   # prefill, as above
        llm.step()
    seqs = llm.scheduler.running[:batch]
    for s in seqs:                                 # room for the one token each step feeds
        llm.block_manager.reserve(s.seq_id, s.num_computed, 1)
    hb = llm.inputs.host([(s.seq_id, s.token_ids[-1:], s.num_computed) for s in seqs])
    if llm.decoder is not None:
        run = lambda: llm.decoder(hb.input_ids, hb.positions, hb.slot_mapping, llm.inputs.tables[hb.rows])  # noqa
    else:
        x, pos, ctx = llm.inputs.device(hb, llm.cache)
        run = lambda: llm.model(x, pos, ctx)       # noqa: E731  (rewrites the same slots each time)
    with torch.inference_mode():
        t = b.timeit(run, steps, warmup=2)
    for rid in ids:
        llm.abort(rid)
    return t


def exp_overhead(b: Bench):
    """The engine's work around the forward pass, next to the pass itself."""
    context, steps = b.q(32, 8), b.q(20, 3)
    batches = b.q([1, 4, 16, 64, 256], [1, 4])
    models = [("tiny", TINY_MODEL), (os.path.basename(b.path), b.path)]
    rows, fig = [], {"context": context, "points": []}
    for name, path in models:
        # 2 GiB holds 256 sequences of ~120 tokens of the default model in float32
        llm = b.llm(path=path, max_num_seqs=max(batches), kv_cache_bytes=2 << 30)
        for B in batches:
            b.progress(f"overhead: {name}, batch {B}")
            step = decode_step_seconds(b, llm, B, context, steps)
            fwd = forward_seconds(b, llm, B, context, steps)
            p = {"model": name, "batch": B, "step_ms": step * 1e3, "forward_ms": fwd * 1e3,
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
    llm = b.llm(max_num_seqs=1)
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
           "kv_bytes_per_token": kv, "context": context,
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
    llm = b.llm(max_num_seqs=1)
    prompt = llm.tokenizer.encode(eval_text())[:32]
    rows, fig = [], {"lengths": []}
    # Naive generation re-runs the whole sequence every step (O(T^2) token
    # passes); with the cache each step is one token (O(T)). So the speedup
    # must grow with the output length, and the tokens must be the same.
    for n in b.q([32, 128, 256], [8, 16]):
        b.progress(f"kv-cache: {n} tokens, naive")
        # (no warm-up for the long naive runs: they take minutes and warm themselves)
        t_naive = b.timeit(lambda: generate(llm.model, prompt, n), b.q(3, 1), warmup=0 if n > 64 else 1)
        naive_ids = generate(llm.model, prompt, n)
        b.progress(f"kv-cache: {n} tokens, cached")
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        t_cache = b.timeit(lambda: llm.generate([prompt], params), b.q(3, 1))
        same = llm.generate([prompt], params)[0].token_ids == naive_ids
        rows.append([n, t_naive / n * 1e3, t_cache / n * 1e3, t_naive / t_cache, same])
        fig["lengths"].append({"tokens": n, "naive_ms_per_token": t_naive / n * 1e3,
                               "cached_ms_per_token": t_cache / n * 1e3, "speedup": t_naive / t_cache,
                               "same_tokens": same})
    return fig, table(["output tokens", "naive ms/token", "KV cache ms/token", "speedup", "same tokens"], rows)


def exp_batching(b: Bench):
    max_b = b.q(256 if b.device.type == "cuda" else 64, 4)
    context = b.q(128, 16)
    llm = b.llm(max_num_seqs=max_b)
    # "Up to the memory limit": never ask for more sequences than the KV pool holds
    # (context + timed steps + warm-up and slack per sequence).
    per_seq = context + b.q(10, 3) + 80
    max_b = min(max_b, llm.block_manager.num_blocks * llm.block_manager.block_size // per_seq)
    bw, flops = b.bandwidth(), b.flops(llm.dtype)
    W, kv, flop_tok = decode_weight_bytes(llm.model), llm.cache.bytes_per_token, model_flops_per_token(llm.config, context)
    rows, fig, B = [], {"context": context, "points": []}, 1
    while B <= max_b:
        b.progress(f"batching: batch {B}")
        t = decode_step_seconds(b, llm, B, context, b.q(10, 3))
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
    text = table(["batch", "step (ms)", "tokens/s", "roofline step (ms)", "fraction of roofline"], rows)
    text += (f"\n\nThroughput at batch {fig['points'][-1]['batch']} is {fig['throughput_gain_max_vs_1']:.1f}x "
             f"batch 1; the step time doubles (the knee) at batch {knee}.")
    return fig, text


def _latency_stats(outs, t0, total_s):
    """Throughput and the two latencies a user feels: time to first token
    (queueing + prefill, measured from t0, when every request arrived) and
    time per output token after the first (the decode step of the whole batch)."""
    ttft = sorted(o.metrics.first_token_time - t0 for o in outs)
    tpot = [(o.metrics.finish_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
            for o in outs if len(o.token_ids) > 1]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens_per_s": tokens / total_s, "ttft_mean_s": statistics.mean(ttft),
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
        system = llm.tokenizer.encode(eval_text())[:b.q(512, 48)]
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


def exp_speculative(b: Bench):
    drafters = ["ngram"] + ([b.args.draft] if b.args.draft else [])
    out = b.q(128, 16)
    params = SamplingParams(max_tokens=out)
    base_llm = b.llm(max_num_seqs=1)
    prompts = _spec_prompts(base_llm, b)
    rows, fig = [], {"runs": []}
    for wname, prompt in prompts.items():
        b.progress(f"speculative: {wname}, plain")
        t_plain = b.timeit(lambda: base_llm.generate([prompt], params), b.q(3, 1))
        steps0 = base_llm.stats["steps"]
        ref = base_llm.generate([prompt], params)[0]
        plain_steps = base_llm.stats["steps"] - steps0
        for drafter in drafters:
            for k in b.q([1, 2, 4, 6, 8], [1, 4]):
                b.progress(f"speculative: {wname}, {os.path.basename(drafter)}, k={k}")
                llm = b.llm(max_num_seqs=1, speculative=drafter, num_speculative_tokens=k)
                t_spec = b.timeit(lambda: llm.generate([prompt], params), b.q(3, 1))
                s0 = dict(llm.stats)
                o = llm.generate([prompt], params)[0]
                steps = llm.stats["steps"] - s0["steps"]
                drafted = llm.stats["draft_tokens"] - s0["draft_tokens"]
                alpha = (llm.stats["accepted_tokens"] - s0["accepted_tokens"]) / drafted if drafted else 0.0
                per_pass = len(o.token_ids) / steps
                # The lecture's model: with acceptance a per draft token, a pass yields
                # (1 - a^(k+1)) / (1 - a) tokens on average; the speedup is that over
                # what one pass costs relative to a plain decode pass (k+1 query
                # tokens cost more than 1 once a step is not purely memory-bound).
                pass_cost = (t_spec / steps) / (t_plain / plain_steps)
                expected = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
                predicted = expected / pass_cost * (len(o.token_ids) / len(ref.token_ids))
                run = {"workload": wname, "drafter": os.path.basename(drafter), "k": k, "alpha": alpha,
                       "tokens_per_pass": per_pass, "pass_cost_ratio": pass_cost, "speedup": t_plain / t_spec,
                       "predicted_speedup": predicted, "same_tokens": o.token_ids == ref.token_ids}
                fig["runs"].append(run)
                rows.append([wname, run["drafter"], k, alpha, per_pass, pass_cost, t_plain / t_spec, predicted,
                             run["same_tokens"]])
    text = (f"Greedy, {out} new tokens, batch 1. Predicted speedup = (1 - a^(k+1)) / (1 - a) tokens per "
            "pass / measured cost of a verify pass relative to a decode pass.\n\n" +
            table(["workload", "drafter", "k", "acceptance a", "tokens/pass", "pass cost", "speedup",
                   "predicted", "same tokens"], rows))
    return fig, text


def exp_quantization(b: Bench):
    # Float is the baseline; on CPU bf16 is added, because int8 there runs with
    # bf16 activations and the fair question is what int8 adds over bf16.
    ids = None
    configs = [("float", {})]
    if b.device.type == "cpu" and b.dtype in ("auto", "float32"):
        configs.append(("bfloat16", {"dtype": "bfloat16"}))
    configs += [("int8 weights", {"quantization": "int8"}),
                ("int8 weights + int8 KV", {"quantization": "int8", "kv_cache_dtype": "int8"})]
    # Batch 1 is where bytes per step rule (int8 should win most); at a large
    # batch the step leans toward compute and the int8 kernels' cost shows.
    big, context = b.q(16, 4), b.q(128, 16)
    rows, fig = [], {"configs": []}
    for name, kw in configs:
        b.progress(f"quantization: {name}")
        llm = b.llm(max_num_seqs=big, **kw)
        if ids is None:
            ids = llm.tokenizer.encode(eval_text())[:b.q(100000, 128)]
        t1 = decode_step_seconds(b, llm, 1, context, b.q(10, 3))
        tb = decode_step_seconds(b, llm, big, context, b.q(10, 3))
        ppl = paged_perplexity(llm, ids)     # through the paged path, so the int8 KV cache counts too
        c = {"name": name, "dtype": str(llm.dtype).replace("torch.", ""), "weight_bytes": decode_weight_bytes(llm.model),
             "kv_bytes_per_token": llm.cache.bytes_per_token, "tokens_per_s_batch1": 1 / t1,
             f"tokens_per_s_batch{big}": big / tb, "perplexity": ppl}
        fig["configs"].append(c)
        rows.append([name, c["dtype"], c["weight_bytes"] / 1e6, c["kv_bytes_per_token"], 1 / t1, big / tb, ppl])
    base = fig["configs"][0]
    for c in fig["configs"]:
        c["speedup_batch1"] = c["tokens_per_s_batch1"] / base["tokens_per_s_batch1"]
        c["perplexity_change"] = c["perplexity"] / base["perplexity"] - 1
    text = (f"Perplexity on the shipped evaluation text ({len(ids)} tokens) through the engine's paged path.\n\n" +
            table(["weights", "activations", "weight MB/step", "KV B/token", "tokens/s batch 1",
                   f"tokens/s batch {big}", "perplexity"], rows))
    return fig, text


def exp_compile(b: Bench):
    big, context = b.q(16, 4), b.q(128, 16)
    eager = b.llm(max_num_seqs=big)
    rows, fig = [], {}
    b.progress("compile: eager")
    e1, eb = (decode_step_seconds(b, eager, B, context, b.q(10, 3)) for B in (1, big))
    del eager
    b.progress("compile: compiling (warm-up of every bucket)")
    # Construction compiles and warms up every bucket; that one-off cost is
    # reported on its own (compile_seconds) and kept out of the step times.
    comp = b.llm(max_num_seqs=big, compile=True)
    b.progress("compile: compiled")
    c1, cb = (decode_step_seconds(b, comp, B, context, b.q(10, 3)) for B in (1, big))
    # Split the gain in two: the same engine with its decoder switched off runs
    # eagerly on the re-laid-out weights, isolating the layout from compilation.
    decoder, comp.decoder = comp.decoder, None
    l1 = decode_step_seconds(b, comp, 1, context, b.q(10, 3))
    comp.decoder = decoder
    # Compare the compiled batch-1 step with the same roofline as exp_roofline.
    bound = (decode_weight_bytes(comp.model) + comp.cache.bytes_per_token * context) / b.bandwidth()
    fig = {"compile_seconds": comp.compile_seconds, "weight_layout": comp.weight_layout, "eager_ms_batch1": e1 * 1e3, "compiled_ms_batch1": c1 * 1e3,
           "eager_layout_ms_batch1": l1 * 1e3, f"eager_ms_batch{big}": eb * 1e3,
           f"compiled_ms_batch{big}": cb * 1e3, "speedup_batch1": e1 / c1, f"speedup_batch{big}": eb / cb,
           "roofline_ms_batch1": bound * 1e3, "compiled_fraction_of_roofline": bound / c1}
    rows = [["eager", e1 * 1e3, eb * 1e3], [f"eager, {comp.weight_layout} weight layout", l1 * 1e3, None],
            ["compiled (+ layout)", c1 * 1e3, cb * 1e3], ["speedup", e1 / c1, eb / cb]]
    text = (table(["decode step", "batch 1 (ms)", f"batch {big} (ms)"],
                  [[r[0], r[1], "" if r[2] is None else r[2]] for r in rows]) +
            f"\n\nWeight layout chosen by measurement: {comp.weight_layout}. "
            f"Compiling every bucket took {comp.compile_seconds:.1f} s. Batch 1 roofline "
            f"{bound * 1e3:.2f} ms: compiled decode runs at {bound / c1:.0%} of it.")
    return fig, text


def exp_peer(b: Bench):
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        return {"skipped": "transformers is not installed"}, "Skipped: transformers is not installed."
    B = b.q(16, 4)
    llm = b.llm(max_num_seqs=B)
    prompts, lengths = workload(b, llm.config.vocab_size)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    b.progress("peer: nanoinfer")
    llm.generate([prompts[0]], params[0])
    t0 = time.perf_counter()
    ours = _latency_stats(llm.generate(prompts, params), t0, time.perf_counter() - t0)
    try:
        hf = LlamaForCausalLM.from_pretrained(b.path, dtype=llm.dtype).to(llm.device).eval()
    except Exception as e:                        # e.g. a shape transformers' config refuses
        return {"skipped": f"transformers cannot load {b.path}: {e}"}, f"Skipped: transformers cannot load the model ({e})."
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
    fig = {"nanoinfer_tokens_per_s": ours["tokens_per_s"], "transformers_tokens_per_s": tokens / hf_s,
           "speedup": ours["tokens_per_s"] / (tokens / hf_s)}
    text = table(["engine", "output tokens/s"], [["nanoinfer (continuous batching)", ours["tokens_per_s"]],
                                                  [f"transformers generate (static batches of {B})", tokens / hf_s]])
    return fig, text + f"\n\nnanoinfer: {fig['speedup']:.2f}x the throughput of transformers' generate."


EXPERIMENTS = {"overhead": exp_overhead, "roofline": exp_roofline, "kv-cache": exp_kv_cache, "batching": exp_batching,
               "continuous-vs-static": exp_continuous_vs_static, "prefix": exp_prefix,
               "speculative": exp_speculative, "quantization": exp_quantization, "compile": exp_compile,
               "peer": exp_peer}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--only", default=None, help="comma-separated experiments: " + ",".join(EXPERIMENTS))
    ap.add_argument("--quick", action="store_true", help="a smoke run of every experiment")
    ap.add_argument("--json", default=None, help="write every figure to this file")
    ap.add_argument("--draft", default=None, help="a draft model directory for the speculative experiment")
    args = ap.parse_args(argv)
    names = list(EXPERIMENTS) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        ap.error(f"unknown experiment(s) {unknown}; choose from {list(EXPERIMENTS)}")
    b = Bench(args)
    # Everything that makes a figure reproducible travels with it in the JSON.
    meta = {"device": torch.cuda.get_device_name(b.device) if b.device.type == "cuda" else
            f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
            "dtype": args.dtype, "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "model": b.path, "quick": args.quick, "command": " ".join(["python", "bench.py"] + sys.argv[1:])}
    print(f"# nanoinfer bench\n\n{meta['device']}, torch {meta['torch']}, model {os.path.basename(b.path)}, "
          f"dtype {args.dtype}, {meta['date']}")
    # --json merges: each experiment is stored under its name with the meta of the
    # run that measured it, so rerunning one experiment replaces only its entry
    # (a long GPU run's other results survive a quick rerun into the same file).
    results = load_results(args.json) if args.json else {}
    results["meta"] = meta                 # the latest run
    for name in names:          # one after another: experiments never share a machine with each other
        t0 = time.perf_counter()
        fig, text = EXPERIMENTS[name](b)
        b.done()
        fig["wall_seconds"] = time.perf_counter() - t0
        fig["meta"] = meta
        results[name] = fig
        print(f"\n## {name}\n\n{text}\n", flush=True)
        if args.json:                      # after every experiment: a cut-short run keeps what it measured
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(results, f, indent=1)
            os.replace(tmp, args.json)     # atomic: a crash mid-write never leaves half a file
    return results


def load_results(path: str) -> dict:
    """The results already in `path` (none if it does not exist). A file that
    is not a bench result is never overwritten."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench.py: {path} exists but cannot be read as bench results ({e}); "
                         "refusing to overwrite it: move it away or choose another --json file") from None
    if not isinstance(old, dict):
        raise SystemExit(f"bench.py: {path} is not a bench results file; refusing to overwrite it")
    return old


if __name__ == "__main__":
    main()
