"""
batching -- batching is the most important serving optimization: the latency/throughput knee.

Claim (lecture): a decode step reads every weight once whatever the batch, so while it is
memory-bound adding sequences is nearly free: the step time stays flat and tokens/s grow ~B;
once the sequences' KV bytes (or FLOPs) catch up with the weights, the step time grows and each
extra sequence costs every user latency. The baseline is batch 1, in the same run; each point
is drawn against its roofline bound. On a GPU: the compiled engine, batches 1-64 at a 512-token
context (the weights dominate: tokens/s grow ~B), and again at 2k tokens, where the KV bytes of
64 sequences reach the 8B weights' and the step time turns up (the knee).
"""
from __future__ import annotations

from model import model_flops_per_token
from quantize import decode_weight_bytes

from experiments.common import decode_step_seconds, figure, table
from experiments.plan import Phase, decode, prefill

NAME = "batching"
WORKLOAD = {"cpu": dict(batches=[1, 2, 4, 8, 16, 32, 64], context=128, long=None, steps=10, engine={}),
            "cpu-quick": dict(batches=[1, 2, 4], context=16, long=None, steps=3, engine={}),
            "gpu": dict(batches=[1, 2, 4, 8, 16, 32, 48, 64], context=512, long=2048, steps=10, engine={}),
            "gpu-quick": dict(batches=[1, 4, 16, 64], context=512, long=2048, steps=5, engine={})}
SLACK = 80            # tokens per sequence beyond context + timed steps: the warm-up steps, a partly filled block


def run(b):
    w = b.sizes(WORKLOAD)
    llm = b.llm(**w.engine)
    W, kv = decode_weight_bytes(llm.model), llm.cache.bytes_per_token
    fig = {"weight_bytes": W, "kv_bytes_per_token": kv, "dtype": str(llm.dtype)[6:],
           "compiled": llm.decoder is not None, **curve(b, llm, w, w.context)}
    text = f"Decode steps at a {w.context}-token context ({'compiled' if fig['compiled'] else 'eager'}).\n\n"
    text += fig.pop("table") + summary(fig)
    if w.long:                              # the KV bytes' knee: the same batches at a long context
        fig["long"] = curve(b, llm, w, w.long)
        text += f"\n\nAt a {w.long}-token context:\n\n" + fig["long"].pop("table") + summary(fig["long"])
    return fig, text


def curve(b, llm, w, context: int) -> dict:
    """Step time and tokens/s at each batch that the pool holds at `context`, against the roofline."""
    per_seq = context + w.steps + SLACK     # "up to the memory limit": no more sequences than the pool holds
    fits = llm.block_manager.num_blocks * llm.block_manager.block_size // per_seq
    bw, flops = b.bandwidth(), b.flops(llm.dtype)
    W, kv = decode_weight_bytes(llm.model), llm.cache.bytes_per_token
    flop_tok = model_flops_per_token(llm.config, context)
    rows, points = [], []
    for B in [B for B in w.batches if B <= fits]:
        b.progress(f"batching: batch {B} at {context} tokens")
        t = decode_step_seconds(b, llm, B, context, w.steps)
        # The roofline of this step: B sequences share one read of the weights,
        # each reads its own context's KV; or the FLOPs, if they take longer.
        bound = max((W + kv * context * B) / bw, flop_tok * B / flops)
        rows.append([B, t * 1e3, B / t, bound * 1e3, bound / t])
        points.append({"batch": B, "step_ms": t * 1e3, "tokens_per_s": B / t, "bound_ms": bound * 1e3})
    base = points[0]["step_ms"]             # the knee: the first batch whose step takes twice batch 1's
    return {"context": context, "points": points,
            "knee_batch": next((p["batch"] for p in points if p["step_ms"] >= 2 * base), None),
            "throughput_gain_max_vs_1": points[-1]["tokens_per_s"] / points[0]["tokens_per_s"],
            "table": table(["batch", "step (ms)", "tokens/s", "roofline step (ms)", "fraction of roofline"], rows)}


def summary(c: dict) -> str:
    knee = c["knee_batch"]
    return (f"\n\nThroughput at batch {c['points'][-1]['batch']} is {c['throughput_gain_max_vs_1']:.1f}x batch 1; " +
            (f"the step time doubles (the knee) at batch {knee}." if knee else
             "the step time never doubled: no knee up to this batch."))


def plan(s):
    w = s.sizes(WORKLOAD)
    o = s.options(**w.engine)
    contexts = [w.context] + ([w.long] if w.long else [])
    return [Phase([o], [prefill(o, sum(w.batches) * c, c / 2) for c in contexts] +
                  [decode(o, w.steps + 3, B, c) for c in contexts for B in w.batches],
                  context=max(contexts) + w.steps + SLACK)]


def plot(r: dict):
    fig, (a1, a2) = figure(r, "Batching: tokens/s grow with the batch while the step time stays flat, "
                              "until the knee", ncols=2)
    pts, knee = r["points"], r.get("knee_batch")
    B = [p["batch"] for p in pts]
    a1.plot(B, [p["tokens_per_s"] for p in pts], "o-", label=f"measured, {r['context']}-token context")
    a2.plot(B, [p["step_ms"] for p in pts], "o-", label=f"decode step, {r['context']}-token context")
    a2.plot(B, [p["bound_ms"] for p in pts], "k--", label="roofline bound")
    if "long" in r:                          # the long context: where the KV bytes make the knee
        lp, knee = r["long"]["points"], r["long"]["knee_batch"]
        LB = [p["batch"] for p in lp]
        a1.plot(LB, [p["tokens_per_s"] for p in lp], "s-", color="C2", label=f"{r['long']['context']}-token context")
        a2.plot(LB, [p["step_ms"] for p in lp], "s-", color="C2", label=f"decode step, {r['long']['context']}-token")
        a2.plot(LB, [p["bound_ms"] for p in lp], ":", color="k", label="its roofline bound")
    for ax in (a1, a2):
        if knee is not None:
            ax.axvline(knee, color="C3", ls=":", label=f"knee: step time doubled at batch {knee}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(B, [str(x) for x in B])
        ax.set_xlabel("batch (sequences decoding)")
        ax.legend(fontsize=8)
    a1.set_ylabel("output tokens/s")
    a2.set_ylabel("decode step (ms)")
    if knee is None:
        a2.set_title(f"no knee up to batch {B[-1]}", fontsize=9)
    return fig
