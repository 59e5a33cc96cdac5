"""
kv-cache -- the KV cache turns O(T^2) token passes into O(T).

Claim (lecture): without a cache, each new token re-runs the whole sequence (model.generate,
the baseline, timed in the same run on the same weights); with it, each step runs one token
against the cached K and V. So the speedup grows with the output length, and the greedy tokens
are the same (exactly, in float32). On a GPU the cached side is the compiled engine a user runs;
the naive side is the dense path, eager by nature.
"""
from __future__ import annotations

from model import generate
from sampler import SamplingParams
from support.timing import timed

from experiments.common import (LogitTap, agreement, eval_text, exact, figure, float32_gaps, naive_rows,
                                prefix_caching, table, tokens_cell, tokens_header)
from experiments.plan import Phase, decode, naive, naive_bytes, prefill

NAME = "kv-cache"
# lengths: output tokens after a 32-token prompt; reps: timed runs of each (the long ones warm themselves)
WORKLOAD = {"cpu": dict(lengths=[32, 128, 256], reps=[3, 2, 1], engine={}),
            "cpu-quick": dict(lengths=[8, 16], reps=[1, 1], engine={}),
            "gpu": dict(lengths=[64, 256, 1024], reps=[3, 1, 1], engine={}),
            "gpu-quick": dict(lengths=[64, 512], reps=[1, 1], engine={})}
PROMPT = 32


def run(b):
    w = b.sizes(WORKLOAD)
    llm = b.llm(**w.engine)
    prompt = llm.tokenizer.encode(eval_text())[:PROMPT]
    rows, fig = [], {"prompt_tokens": len(prompt), "dtype": str(llm.dtype).replace("torch.", ""), "lengths": [],
                     "compiled": llm.decoder is not None}
    for n, reps in zip(w.lengths, w.reps):
        b.progress(f"kv-cache: {n} tokens, naive")
        t_naive, naive_ids = timed(lambda: generate(llm.model, prompt, n), reps, 1 if n <= 64 else 0, b.sync)
        b.progress(f"kv-cache: {n} tokens, cached")
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        with prefix_caching(llm, False):       # every cached run computes its prompt, as the naive one does
            t_cache, out = timed(lambda: llm.generate([prompt], params)[0], reps, int(reps > 1), b.sync)
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
        naive_out = naive_rows(llm.model, prompt, n)
        with LogitTap(llm) as tap, prefix_caching(llm, False):
            out = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        gaps = float32_gaps(llm.model, [(prompt + naive_out[0], naive_out[1]), (prompt + out.token_ids, tap.rows(out))])
        fig["max_logit_diff_vs_float32"] = {"tokens": n, "naive": gaps[0], "cached": gaps[1]}
        text += (f"\n\n{fig['dtype']}: the two paths round differently, so their greedy tokens part after a few; "
                 "the column counts the tokens they share up to the first divergence. Largest |logit - float32 "
                 f"logit| over {n} tokens (same weights, same tokens): naive {gaps[0]:.3g}, KV cache {gaps[1]:.3g}.")
    return fig, text


def plan(s):
    w = s.sizes(WORKLOAD)
    o = s.options(**w.engine)
    work = []
    for n, reps in zip(w.lengths, w.reps):
        cached = reps + (reps > 1)
        work += [naive(o, reps + (n <= 64), PROMPT, PROMPT + n), decode(o, cached * n, 1, PROMPT + n),
                 prefill(o, cached * PROMPT, PROMPT)]
    longest = PROMPT + max(w.lengths)
    return [Phase([o], work, context=longest, extra=naive_bytes(o, longest))]


def plot(r: dict):
    fig, (ax,) = figure(r, "The KV cache: recomputing the sequence costs more per token the longer it gets")
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
