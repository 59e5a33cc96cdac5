"""
kv-cache -- the KV cache turns O(T^2) token passes into O(T).

Claim (lecture): without a cache, each new token re-runs the whole sequence (model.generate,
the baseline, timed in the same run on the same weights); with it, each step runs one token
against the cached K and V. So the speedup grows with the output length, and the greedy tokens
are the same (exactly, in float32). On a GPU the cached side is the compiled engine a user runs;
the naive side is the dense path, eager by nature.

A GPU's decode step costs its weight bytes up to long contexts, so the gap opens slowly: the
second table times ONE step at context T each way (a T-token forward against one cached token
at T), out to the lengths (4k tokens on a GPU) where recomputing costs 10x a cached step.
"""
from __future__ import annotations

import torch

from model import generate
from sampler import SamplingParams
from support.timing import timed

from experiments.common import (LogitTap, agreement, decode_step_seconds, eval_text, exact, figure, float32_gaps,
                                naive_rows, prefix_caching, table, tokens_cell, tokens_header)
from experiments.plan import Phase, decode, naive, naive_bytes, prefill

NAME = "kv-cache"
# lengths: output tokens after a 32-token prompt; reps: timed runs of each (the long ones warm themselves);
# contexts: the T of one step each way (naive: a T-token forward; cached: one token at T)
WORKLOAD = {"cpu": dict(lengths=[32, 128, 256], reps=[3, 2, 1], contexts=[256, 512, 1024], engine={}),
            "cpu-quick": dict(lengths=[8, 16], reps=[1, 1], contexts=[32, 64], engine={}),
            "gpu": dict(lengths=[64, 256, 1024], reps=[3, 1, 1], contexts=[1024, 2048, 4096], engine={}),
            "gpu-quick": dict(lengths=[64, 512], reps=[1, 1], contexts=[1024, 4096], engine={})}
PROMPT = 32
STEP_REPS = 5           # timed steps at each context, each way


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
    fig["contexts"] = [one_step_each_way(b, llm, T) for T in w.contexts]
    text += "\n\nOne step at context T: the naive path's T-token forward against one cached token at T.\n\n" + table(
        ["context T", "naive step (ms)", "KV cache step (ms)", "speedup"],
        [[p["context"], p["naive_ms"], p["cached_ms"], p["speedup"]] for p in fig["contexts"]])
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


def one_step_each_way(b, llm, T: int) -> dict:
    """The cost of the token at position T: recomputed (model.forward over all T + 1 tokens, the
    naive path's every step) or cached (an engine step of one sequence decoding at ~T)."""
    b.progress(f"kv-cache: one step at context {T}")
    ids = torch.randint(0, llm.config.vocab_size, (T + 1,), device=llm.device)
    with torch.inference_mode():
        t_naive, _ = timed(lambda: llm.model(ids, torch.arange(T + 1, device=llm.device)), STEP_REPS, 1, b.sync)
    with prefix_caching(llm, False):
        t_cache = decode_step_seconds(b, llm, 1, T, STEP_REPS)
    return {"context": T, "naive_ms": t_naive * 1e3, "cached_ms": t_cache * 1e3, "speedup": t_naive / t_cache}


def plan(s):
    w = s.sizes(WORKLOAD)
    o = s.options(**w.engine)
    work = []
    for n, reps in zip(w.lengths, w.reps):
        cached = reps + (reps > 1)
        work += [naive(o, reps + (n <= 64), PROMPT, PROMPT + n), decode(o, cached * n, 1, PROMPT + n),
                 prefill(o, cached * PROMPT, PROMPT)]
    for T in w.contexts:              # one forward of T + 1 tokens per run; the engine's prefill, then steps
        work += [naive(o, STEP_REPS + 1, T + 1, T + 1), prefill(o, T, T), decode(o, STEP_REPS + 2, 1, T)]
    longest = max(PROMPT + max(w.lengths), max(w.contexts) + 1)
    return [Phase([o], work, context=longest, extra=naive_bytes(o, longest))]


def plot(r: dict):
    contexts = r.get("contexts") or []
    fig, axes = figure(r, "The KV cache: recomputing the sequence costs more per token the longer it gets",
                       ncols=1 + bool(contexts))
    ax = axes[0]
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
    if contexts:                                     # one step at T: O(T) FLOPs recomputed vs one token
        ax = axes[1]
        T = [p["context"] for p in contexts]
        ax.plot(T, [p["naive_ms"] for p in contexts], "o-", label="naive step: a T-token forward")
        ax.plot(T, [p["cached_ms"] for p in contexts], "s-", label="KV cache step: one token at T")
        for p in contexts:
            ax.annotate(f"{p['speedup']:.3g}x", (p["context"], p["naive_ms"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=8)
        ax.set(xlabel="context T (tokens)", ylabel="ms per step", ylim=(0, 1.15 * max(p["naive_ms"] for p in contexts)))
        ax.margins(x=0.12)
        ax.legend(fontsize=8)
    return fig
