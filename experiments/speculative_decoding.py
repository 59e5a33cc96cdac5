"""
speculative -- draft k tokens cheaply, verify them in one pass of the big model.

Claim (lecture): with acceptance a per draft token, a verify pass yields (1 - a^(k+1)) / (1 - a)
tokens on average, so the speedup over plain decoding is that over the cost of one verify pass
relative to a decode pass; greedy speculation never changes the tokens. Baseline: plain greedy
decoding of the same prompts, timed in the same run. Two ends of the acceptance rate: asked to
repeat a passage, prompt-lookup (n-gram) drafts are right; a story has nothing to look up.
Acceptance is a quality figure: it needs trained weights (the default model), never random ones.
"""
from __future__ import annotations

import os

from sampler import SamplingParams

from experiments.common import (NEEDS_DEFAULT_MODEL, LogitTap, agreement, eval_text, exact, figure, float32_gaps,
                                table, tokens_cell, tokens_header, trained)
from experiments.plan import Phase, decode, prefill

NAME = "speculative"
# Eager engines everywhere: a compiled engine per k would cost a compile each on a GPU.
WORKLOAD = {"cpu": dict(ks=[1, 2, 4, 8], out=128, reps=2, words=120),
            "cpu-quick": dict(ks=[1, 4], out=16, reps=1, words=30),
            "gpu": dict(ks=[1, 2, 4, 8], out=64, reps=2, words=120),
            "gpu-quick": dict(ks=[1, 4], out=64, reps=1, words=120)}
ENGINE = dict(max_num_seqs=1, compile=False, pool_tokens=4096, share=False)   # beside the run's kept engine


def prompts(llm, words: int) -> dict:
    tok, passage = llm.tokenizer, " ".join(eval_text().split()[:words])
    asks = {"copy-heavy": f"Repeat the following text exactly, word for word:\n\n{passage}",
            "open-ended": "Write a short story about a lighthouse keeper and a storm."}
    return {name: tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True) for name, t in asks.items()}


def one_run(b, llm, prompt, params, reps: int, k: int, plain) -> dict:
    """Time one drafter setting on one prompt against the plain run `plain` = (seconds, output, steps)."""
    t_plain, ref, plain_steps = plain
    t_spec = b.timeit(lambda: llm.generate([prompt], params), reps)
    s0 = dict(llm.stats)
    with LogitTap(llm) as tap:                   # the untimed run: its rows are compared with float32 in bf16
        o = llm.generate([prompt], params)[0]
    steps, drafted = llm.stats["steps"] - s0["steps"], llm.stats["draft_tokens"] - s0["draft_tokens"]
    alpha = (llm.stats["accepted_tokens"] - s0["accepted_tokens"]) / drafted if drafted else 0.0
    pass_cost = (t_spec / steps) / (t_plain / plain_steps)      # k+1 query tokens cost more than 1, past memory-bound
    expected = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
    run = {"k": k, "alpha": alpha, "tokens": len(o.token_ids), "passes": steps,
           "tokens_per_pass": len(o.token_ids) / steps, "pass_cost_ratio": pass_cost,
           "speedup": t_plain / t_spec,
           "predicted_speedup": expected / pass_cost * (len(o.token_ids) / len(ref.token_ids)),
           "shared_tokens": agreement(o.token_ids, ref.token_ids), "cell": tokens_cell(llm.dtype, o.token_ids,
                                                                                     ref.token_ids)}
    if exact(llm.dtype):
        run["same_tokens"] = o.token_ids == ref.token_ids
    else:
        run["max_logit_diff_vs_float32"] = float32_gaps(llm.model, [(prompt + o.token_ids, tap.rows(o))])[0]
    return run


def plain_runs(b, w, params) -> tuple:
    """The baseline: plain greedy decoding of each prompt, timed; its output and its steps."""
    llm, plain = b.llm(path=b.quality_path, **ENGINE), {}
    asks, fig = prompts(llm, w.words), {"dtype": str(llm.dtype)[6:], "runs": []}
    for name, prompt in asks.items():
        b.progress(f"speculative: {name}, plain")
        t_plain = b.timeit(lambda: llm.generate([prompt], params), w.reps)
        steps0 = llm.stats["steps"]
        with LogitTap(llm) as tap:
            ref = llm.generate([prompt], params)[0]
        plain[name] = (t_plain, ref, llm.stats["steps"] - steps0)
        if not exact(llm.dtype):                 # the plain path's own rounding, for comparison
            fig.setdefault("plain_max_logit_diff_vs_float32", {})[name] = float32_gaps(
                llm.model, [(prompt + ref.token_ids, tap.rows(ref))])[0]
    return asks, plain, fig, llm.dtype


def run(b):
    if not trained(b.quality_path):
        return {"skipped": NEEDS_DEFAULT_MODEL}, f"Skipped: acceptance {NEEDS_DEFAULT_MODEL}."
    w = b.sizes(WORKLOAD)
    params = SamplingParams(max_tokens=w.out)
    asks, plain, fig, dtype = plain_runs(b, w, params)
    for drafter in ["ngram"] + ([b.args.draft] if getattr(b.args, "draft", None) else []):
        for k in w.ks:
            # One engine per (drafter, k), running both workloads: engines cost seconds to build.
            llm = b.llm(path=b.quality_path, speculative=drafter, num_speculative_tokens=k, **ENGINE)
            for name, prompt in asks.items():
                b.progress(f"speculative: {name}, {os.path.basename(drafter)}, k={k}")
                run = one_run(b, llm, prompt, params, w.reps, k, plain[name])
                fig["runs"].append({"workload": name, "drafter": os.path.basename(drafter), **run})
            del llm
    fig["runs"].sort(key=lambda r: (list(asks).index(r["workload"]), r["drafter"], r["k"]))
    gap = [] if exact(dtype) else ["max |logit diff| vs float32"]
    rows = [[r["workload"], r["drafter"], r["k"], r["alpha"], r["tokens_per_pass"], r["pass_cost_ratio"],
             r["speedup"], r["predicted_speedup"], r.pop("cell")] + ([r["max_logit_diff_vs_float32"]] if gap else [])
            for r in fig["runs"]]
    text = (f"Greedy, {w.out} new tokens, batch 1. Predicted speedup = (1 - a^(k+1)) / (1 - a) tokens per "
            "pass / measured cost of a verify pass relative to a decode pass.\n\n" +
            table(["workload", "drafter", "k", "acceptance a", "tokens/pass", "pass cost", "speedup",
                   "predicted", tokens_header(dtype, "same tokens")] + gap, rows))
    if gap:
        text += (f"\n\n{fig['dtype']}: the tokens column counts those shared with plain decoding up to the first "
                 "divergence (a verify pass of k+1 tokens rounds differently from k+1 decode steps); the last column "
                 "is each run's largest |logit - float32 logit| on its own tokens; plain decoding's: " +
                 ", ".join(f"{n} {g:.3g}" for n, g in fig["plain_max_logit_diff_vs_float32"].items()) + ".")
    return fig, text


def plan(s):
    if not trained(s.quality_path):
        return []
    w = s.sizes(WORKLOAD)
    base = s.options(s.quality_path, **ENGINE)
    # every timed run + its warm-up + the tapped run; a verify pass yields 1 to k + 1 tokens: ~half of k + 1
    runs = 2 * (w.reps + 2)
    phases = [Phase([base], [decode(base, runs * w.out, 1, 512), prefill(base, runs * 512, 256)], context=512)]
    for k in w.ks:
        o = s.options(s.quality_path, speculative="ngram", num_speculative_tokens=k, **ENGINE)
        phases.append(Phase([o], [decode(o, runs * w.out / max(1, (k + 1) / 2), 1, 512, k + 1),
                                  prefill(o, runs * 512, 256)], context=512))
    return phases


def plot(r: dict):
    import statistics
    fig, (ax,) = figure(r, "Speculative decoding pays when drafts are accepted: measured and predicted speedup")
    groups = {}
    for run in r["runs"]:
        groups.setdefault((run["workload"], run["drafter"]), []).append(run)
    for i, ((name, drafter), runs) in enumerate(groups.items()):
        k, alpha = [x["k"] for x in runs], statistics.mean(x["alpha"] for x in runs)
        ax.plot(k, [x["speedup"] for x in runs], "o-", color=f"C{i}",
                label=f"{name}, {drafter}: measured (mean acceptance {alpha:.2f})")
        ax.plot(k, [x["predicted_speedup"] for x in runs], "--", color=f"C{i}",
                label=f"{name}, {drafter}: predicted from acceptance and verify cost")
    ax.axhline(1.0, color="grey", lw=1, label="plain decoding")
    ax.set(xlabel="draft tokens per verify pass (k)", ylabel="speedup over plain decoding (x)")
    ax.set_xticks(sorted({x["k"] for x in r["runs"]}))
    ax.legend(fontsize=7)
    return fig
