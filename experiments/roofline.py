"""
roofline -- prefill is compute-bound, decode is memory-bound.

Claim (lecture): a decode step must read every weight and each sequence's KV cache once, so it
cannot beat (weight bytes + KV bytes) / bandwidth; its arithmetic intensity (FLOPs per byte)
grows ~ with the batch, while a prefill of T tokens does T tokens of FLOPs per weight read and
sits under the compute roof. The baselines are the machine's own roofs, measured in the same
run: the copy bandwidth and a big matmul's FLOP/s. FLOPs per token: model.model_flops_per_token
(the assignment "roofline").
"""
from __future__ import annotations

import random

from model import model_flops_per_token
from quantize import decode_weight_bytes
from sampler import SamplingParams

from experiments.common import decode_step_seconds, figure, prefix_caching, table
from experiments.plan import Phase, decode, prefill

NAME = "roofline"
WORKLOAD = {"cpu": dict(batches=[1, 4, 16], context=512, steps=10, prefills=5, engine={}),
            "cpu-quick": dict(batches=[1, 4], context=32, steps=3, prefills=2, engine={}),
            "gpu": dict(batches=[1, 4, 16, 64], context=512, steps=10, prefills=5, engine={}),
            "gpu-quick": dict(batches=[1, 8, 64], context=512, steps=5, prefills=3, engine={})}
INTENSITY_BATCHES = (1, 4, 16, 64, 256)      # the arithmetic-intensity table: the formula only


def run(b):
    w = b.sizes(WORKLOAD)
    llm = b.llm(**w.engine)
    cfg, bw, flops = llm.config, b.bandwidth(), b.flops(llm.dtype)
    W, kv = decode_weight_bytes(llm.model), llm.cache.bytes_per_token
    flop_tok, ctx = model_flops_per_token(cfg, w.context), w.context
    decode_bound = (W + kv * ctx) / bw             # batch 1: every weight and the context's KV, read once
    points = []
    for B in w.batches:
        b.progress(f"roofline: decode step at batch {B}")
        t = decode_step_seconds(b, llm, B, ctx, w.steps)
        step_flops, step_bytes = flop_tok * B, W + kv * ctx * B
        points.append({"batch": B, "step_ms": t * 1e3, "flops_per_byte": step_flops / step_bytes,
                       "attained_flops_per_s": step_flops / t,
                       "bound_ms": max(step_bytes / bw, step_flops / flops) * 1e3})
    b.progress("roofline: prefill")
    # A fresh random prompt each time and no prefix caching: every timed prefill computes all of it.
    rng = random.Random(0)
    prompt = lambda: [rng.randrange(10, cfg.vocab_size) for _ in range(ctx)]   # noqa: E731
    with prefix_caching(llm, False):
        pre = b.timeit(lambda: llm.generate([prompt()], SamplingParams(max_tokens=1)), w.prefills)
    # Prefill does `context` tokens per weight read: FLOPs dominate (or the weight read, if longer).
    prefill_bound = max(flop_tok * ctx / flops, W / bw)
    rows = []
    for B in INTENSITY_BATCHES:
        # B sequences share one read of the weights but each reads its own KV cache:
        # intensity grows ~B until the KV bytes dominate the weights.
        step_flops, step_bytes = flop_tok * B, W + kv * ctx * B
        t = max(step_bytes / bw, step_flops / flops)
        rows.append([B, step_flops / step_bytes, "memory" if step_bytes / bw >= step_flops / flops else "compute",
                     t * 1e3, B / t])
    fig = {"bandwidth_GBps": bw / 1e9, "matmul_TFLOPs": flops / 1e12, "weight_bytes": W,
           "dtype": str(llm.dtype).replace("torch.", ""), "compiled": llm.decoder is not None,
           "kv_bytes_per_token": kv, "context": ctx, "flops_per_token": flop_tok,
           "decode_bound_ms": decode_bound * 1e3, "decode_measured_ms": points[0]["step_ms"],
           "decode_fraction_of_roofline": decode_bound * 1e3 / points[0]["step_ms"], "decode_points": points,
           "prefill_tokens": ctx, "prefill_bound_ms": prefill_bound * 1e3, "prefill_measured_ms": pre * 1e3,
           "prefill_fraction_of_roofline": prefill_bound / pre,
           # the prefill reads the weights once and writes ctx tokens of KV for flop_tok * ctx FLOPs
           "prefill_point": {"flops_per_byte": flop_tok * ctx / (W + kv * ctx),
                             "attained_flops_per_s": flop_tok * ctx / pre},
           "machine_balance_flops_per_byte": flops / bw,
           "intensity": [{"batch": r[0], "flops_per_byte": r[1], "bound_by": r[2], "bound_ms": r[3]} for r in rows]}
    measured = [[f"decode, batch {p['batch']}, {ctx}-token context", p["bound_ms"], p["step_ms"],
                 p["bound_ms"] / p["step_ms"], p["flops_per_byte"], p["attained_flops_per_s"] / 1e9] for p in points]
    measured.append([f"prefill of {ctx} tokens", prefill_bound * 1e3, pre * 1e3, prefill_bound / pre,
                     fig["prefill_point"]["flops_per_byte"], fig["prefill_point"]["attained_flops_per_s"] / 1e9])
    text = (f"Device: {bw / 1e9:.1f} GB/s copy bandwidth, {flops / 1e12:.2f} TFLOP/s matmul ({llm.dtype}); "
            f"machine balance {flops / bw:.0f} FLOP/byte. Decode steps {'compiled' if fig['compiled'] else 'eager'}.\n"
            f"Weights read per decode step {W / 1e6:.1f} MB, KV cache {kv} B/token.\n\n" +
            table(["step", "bound (ms)", "measured (ms)", "fraction of roofline", "FLOP/byte", "attained GFLOP/s"],
                  measured) +
            "\n\nArithmetic intensity of a decode step (FLOPs per byte ~ batch size):\n\n" +
            table(["batch", "FLOP/byte", "bound by", "bound step (ms)", "bound tokens/s"], rows))
    return fig, text


def plan(s):
    w = s.sizes(WORKLOAD)
    o = s.options(**w.engine)
    return [Phase([o], [prefill(o, (sum(w.batches) + w.prefills + 1) * w.context, w.context)] +
                  [decode(o, w.steps + 2, B, w.context) for B in w.batches], context=w.context + w.steps + 66)]


def plot(r: dict):
    fig, (ax,) = figure(r, "The roofline: decode sits on the bandwidth slope, prefill under the compute roof")
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
