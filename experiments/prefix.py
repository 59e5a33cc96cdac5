"""
prefix -- a shared system prompt is computed once: prefix caching.

Claim (lecture): the KV cache of a prompt's full blocks is a function of their tokens, so
requests that share a long system prompt can share its blocks (hashed as a chain, cache.py)
and skip its prefill: the time to first token falls, and so does the batch's time. Baseline:
the same requests on the same engine with prefix caching off, measured first (off registers
nothing, so the run with caching on cannot profit from it, and vice versa).
"""
from __future__ import annotations

import math
import time

from sampler import SamplingParams

from experiments.common import eval_text, prefix_caching, seats, table
from experiments.continuous_vs_static import latency_stats
from experiments.plan import Phase, decode, prefill

NAME = "prefix"
WORKLOAD = {"cpu": dict(requests=16, system=512, out=8, engine={}),
            "cpu-quick": dict(requests=4, system=48, out=4, engine={}),
            "gpu": dict(requests=16, system=2048, out=8, engine={}),
            "gpu-quick": dict(requests=8, system=2048, out=8, engine={})}


def run(b):
    w = b.sizes(WORKLOAD)
    llm, rows, fig = b.llm(**w.engine), [], {}
    # The shipped text, repeated to the system prompt's length; the questions differ.
    text = llm.tokenizer.encode(eval_text())
    system = (text * math.ceil(w.system / len(text)))[:w.system]
    prompts = [system + llm.tokenizer.encode(f" Question {i}: what happens next?") for i in range(w.requests + 1)]
    params, bm = SamplingParams(max_tokens=w.out, ignore_eos=True), llm.block_manager
    for caching in (False, True):
        with prefix_caching(llm, caching), seats(llm, w.requests):
            # The system prompt is seen once first, as in a chat service that has been
            # running: with caching its full blocks are now in the pool's hash table.
            llm.generate([prompts[0]], params)
            hits0, queries0 = bm.prefix_hits, bm.prefix_queries
            b.progress(f"prefix: caching {'on' if caching else 'off'}")
            t0 = time.perf_counter()
            outs = llm.generate(prompts[1:], params)
            stats = latency_stats(outs, t0, time.perf_counter() - t0)
        queries = bm.prefix_queries - queries0
        hit_rate = (bm.prefix_hits - hits0) / queries if queries else 0.0
        cached = sum(o.metrics.cached_tokens for o in outs) / sum(o.metrics.prompt_tokens for o in outs)
        key = "on" if caching else "off"
        fig[key] = {**stats, "block_hit_rate": hit_rate, "cached_prompt_fraction": cached}
        rows.append([key, stats["ttft_mean_s"], stats["seconds"], hit_rate, cached])
    # What the block structure predicts: a prompt reuses the full blocks of the system prompt it
    # shares (tests/test_bench.py checks the measured fractions against it).
    fig.update(system_prompt_tokens=len(system), block_size=bm.block_size, prompt_tokens=[len(p) for p in prompts[1:]])
    fig["ttft_speedup"] = fig["off"]["ttft_mean_s"] / fig["on"]["ttft_mean_s"]
    fig["time_speedup"] = fig["off"]["seconds"] / fig["on"]["seconds"]
    text = (f"{w.requests} requests sharing a {len(system)}-token system prompt, {w.out} output tokens each.\n\n" +
            table(["prefix caching", "mean TTFT (s)", "total (s)", "block hit rate", "prompt tokens cached"], rows) +
            f"\n\nPrefix caching: TTFT {fig['ttft_speedup']:.2f}x faster, the batch {fig['time_speedup']:.2f}x faster.")
    return fig, text


def plan(s):
    w = s.sizes(WORKLOAD)
    o, n = s.options(**w.engine), w.requests + 1
    # off: every prompt prefilled; on: the first whole, the others their questions (~16 tokens)
    return [Phase([o], [prefill(o, n * w.system + 2 * w.system + n * 16, w.system / 2),
                        decode(o, 4 * w.out, w.requests, w.system)], context=w.system + 16 + w.out)]
