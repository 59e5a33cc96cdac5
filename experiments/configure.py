"""
experiments/configure.py -- the lecture's inference-system configurator (chapter 7's showcase):
a model's shape, a batch, a context and a card in; memory, TTFT, the decode step and tokens/s out.

    python bench.py --configure                                   # the lecture's 13B on an H100
    python bench.py --configure --model random:llama-3.1-70b:kv_lora_rank=512 --gpu h200 --gpus 2 \\
                    --context 32768 --batch 16 --json out.json    # "a 70B with MLA on two H200s"

Claim (lecture): from two roofs of the card and the model's shape alone,
    memory      = weights (params x bytes a parameter) + KV (bytes per token x context x batch)
    decode step = max(memory / bandwidth, 2 x params x batch / FLOP/s)   (every byte read once)
    TTFT        = max(2 x params x prompt / FLOP/s, weights / bandwidth) (prefill: compute-bound)
    tokens/s    = batch / decode step (x (1 - a^(k+1)) / (1 - a) with k drafts at acceptance a)
and "real systems are within 80% of these numbers". Beside that bound, the same quantities for
THIS engine: the step = weights / (BW e_w) + KV / (BW e_kv) + 2 P B / (FLOP/s e_f), the three
efficiencies fit by least squares to a committed batching sweep on the card (its first context;
docs/RESULTS.md holds the fit to every point). No model is built and no GPU is needed.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
from types import SimpleNamespace

import numpy as np
import torch

from cache import kv_cache_bytes
from quantize import int8_kv_cache_bytes
from support.checks import check_kv_cache_dtype

from experiments.common import figure, table
from experiments.plan import CARDS, Card, _weight_bytes, model_config

GB, ROOT = 1e9, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The lecture's card: an H100 SXM's datasheet (80 GB, 3.35 TB/s, 989 TFLOP/s dense bf16).
LECTURE_CARD = Card(80 * GB, 3.35e12, 989e12, "H100 SXM (datasheet): 80 GB, 3.35 TB/s, 989 TFLOP/s")
# This 2-core VM as its committed run measured it (results/cpu-2026-11-26.json: roofline, 1 thread).
CPU_CARD = Card(23 * GB, 13.71e9, 0.1905e12, "this CPU VM: 23 GB, 13.7 GB/s, 0.19 TFLOP/s (measured, 1 thread)")
ALL_CARDS = {"h100": LECTURE_CARD, **CARDS, "cpu": CPU_CARD}
# The committed run each card's calibration comes from (a card without one borrows the H100's).
RUNS = {"h100": "results/h100-2026-11-26.json", "h100-80gb": "results/h100-2026-11-26.json",
        "cpu": "results/cpu-2026-11-26.json"}
BYTES_PER_PARAM = {None: 2.0, "int8": 1.0, "fp8": 1.0, "int4": 0.5 + 4 / 128}   # int4: fp16 scale + zero
SERVING_SHARE = 0.9          # this engine's KV pool: 90% of the memory the weights leave (EngineConfig)


@dataclasses.dataclass
class Shape:
    """What the formulas need of a model: bytes of the weights (all of them, and those a decode
    step reads: not the embedding table of an untied head), matmul parameters (2 FLOPs each a
    token) and KV bytes per token of context (the KV chapter's four ways included)."""
    label: str
    weight_bytes: float
    decode_bytes: float
    matmul_params: float
    kv_per_token: float
    window: int | None = None

    def kv_bytes(self, batch: int, context: int) -> float:     # a window keeps the last W tokens
        return self.kv_per_token * batch * min(context, self.window or context)


def shape_of(args) -> Shape:
    """--model PATH|random:PRESET (counted on the meta device, quantized as asked), else the raw
    shape: --params, --layers, --kv-heads, --head-dim [--mla-rank r] [--cla-share S] [--window W]."""
    cfg = SimpleNamespace(kv_layers=-(-args.layers // args.cla_share), n_kv_heads=args.kv_heads,  # CLA: 1 in S
                          head_dim=args.head_dim, kv_lora_rank=args.mla_rank, qk_rope_head_dim=args.mla_rope)
    if args.model:
        cfg, params = model_config(args.model)
    check_kv_cache_dtype(args.kv_cache_dtype, cfg)          # the engine's refusal (int8 latents: none)
    kv = int8_kv_cache_bytes(cfg) if args.kv_cache_dtype == "int8" else kv_cache_bytes(cfg, torch.bfloat16)
    if not args.model:
        W = args.params * BYTES_PER_PARAM[args.quantization]
        return Shape(f"{args.params / 1e9:g}B parameters", W, W, args.params, kv, args.window)
    weights = _weight_bytes(args.model, torch.bfloat16, args.quantization)
    table = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim     # untied: a decode reads N rows of it
    return Shape(args.model, weights, weights - 2 * table, params - table, kv, cfg.sliding_window)


@dataclasses.dataclass
class Efficiency:
    """This engine on a card: the fractions of its roofs it reaches, fit to a committed run."""
    weights: float
    kv: float
    compute: float
    prefill: float
    bandwidth: float        # the run's own measured roofs (a datasheet's are not what it saw)
    flops: float
    source: str


def sweep(path: str):
    """A committed run, its batching sweep as a Shape, and (context, batch, step_ms) of every point."""
    with open(os.path.join(ROOT, path)) as f:
        run = json.load(f)
    b, W = run["batching"], run["batching"]["weight_bytes"]
    shape = Shape(path, W, W, W / torch.finfo(getattr(torch, b["dtype"])).bits * 8, b["kv_bytes_per_token"])
    pts = [(b["context"], p["batch"], p["step_ms"]) for p in b["points"]]
    return run, shape, pts + [(b["long"]["context"], p["batch"], p["step_ms"]) for p in b.get("long", {}).get("points", [])]


def calibrate(path: str) -> Efficiency:
    """Least squares over the sweep's first context: step = weights / (BW e_w) + KV / (BW e_kv) + 2 P B /
    (FLOP/s e_f), with the run's own measured roofs."""
    run, shape, pts = sweep(path)
    b, r = run["batching"], run["roofline"]
    bw, flops = r["bandwidth_GBps"] * GB, r["matmul_TFLOPs"] * 1e12
    first = [(c, B, t) for c, B, t in pts if c == b["context"]]
    X = [[shape.decode_bytes / bw, shape.kv_bytes(B, c) / bw, 2 * shape.matmul_params * B / flops] for c, B, _ in first]
    inv = np.linalg.lstsq(np.array(X), np.array([t / 1e3 for *_, t in first]), rcond=None)[0]
    return Efficiency(*(1 / inv), r["prefill_fraction_of_roofline"], bw, flops,
                      f"{path} ({b['meta']['device']}, {b['meta']['date'][:10]})")


def held_to(path: str, card: Card, eff: Efficiency) -> list[dict]:
    """Every point of a committed batching sweep against this engine's predicted step (RESULTS.md)."""
    _, shape, pts = sweep(path)
    rows = [(c, B, t, predict(shape, card, B, c, 1, 0, 0.0, eff)["decode_ms"]) for c, B, t in pts]
    return [{"context": c, "batch": B, "measured_ms": t, "predicted_ms": p, "error": p / t - 1} for c, B, t, p in rows]


def predict(shape: Shape, card: Card, batch: int, context: int, prompt: int, k: int, a: float,
            eff: Efficiency | None = None) -> dict:
    """The lecture's numbers (eff None: every roof reached, all memory for KV) or this engine's."""
    bw, fl = (card.bandwidth, card.flops) if eff is None else (eff.bandwidth, eff.flops)
    e = eff or Efficiency(1, 1, 1, 1, bw, fl, "the roofline")
    per_pass = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1   # tokens a verify pass yields
    kv = shape.kv_bytes(batch, context)
    read, cost = (shape.weight_bytes if eff is None else shape.decode_bytes), shape.matmul_params
    if eff is None:       # max(memory, compute): the lecture's roofline
        step = max((read + kv) / bw, 2 * cost * batch * (k + 1) / fl)
    else:                 # this engine: the fitted terms add up
        step = read / (bw * e.weights) + kv / (bw * e.kv) + 2 * cost * batch * (k + 1) / (fl * e.compute)
    ttft = max(2 * cost * prompt / (fl * e.prefill), read / (bw * e.weights))
    free = (card.memory - shape.weight_bytes) * (1 if eff is None else SERVING_SHARE)
    return {"memory_gb": (shape.weight_bytes + kv) / GB, "weights_gb": shape.weight_bytes / GB, "kv_gb": kv / GB,
            "decode_ms": step * 1e3, "ttft_ms": ttft * 1e3, "tokens_per_s": batch * per_pass / step,
            "tokens_per_s_per_user": per_pass / step, "tokens_per_pass": per_pass,
            "max_batch": max(0, int(free // shape.kv_bytes(1, context))), "fits": shape.weight_bytes + kv <= card.memory}


def knee(shape: Shape, card: Card, context: int) -> float | None:
    """The batch where the bound's compute time reaches its memory time: 2PB/F = (W + B kv)/BW."""
    slope = 2 * shape.matmul_params / card.flops - shape.kv_bytes(1, context) / card.bandwidth
    return shape.weight_bytes / card.bandwidth / slope if slope > 0 else None   # None: KV grows as fast


def configure(args) -> dict:
    name, base = args.gpu, ALL_CARDS[args.gpu]
    card = Card((args.memory * GB if args.memory else base.memory) * args.gpus,
                (args.bandwidth * 1e12 if args.bandwidth else base.bandwidth) * args.gpus,
                (args.flops * 1e12 if args.flops else base.flops) * args.gpus, base.source)
    shape, run = shape_of(args), RUNS.get(name, RUNS["h100"])
    eff = calibrate(run)
    if name not in RUNS or args.bandwidth or args.flops or args.gpus > 1:   # borrowed: on this card's roofs
        eff = dataclasses.replace(eff, bandwidth=card.bandwidth, flops=card.flops,
                                  source=eff.source + f", its efficiencies on {args.gpus} x {name}'s roofs")
    w = (args.batch, args.context, args.prompt, args.spec_k, args.acceptance)
    return {"meta": {"device": card.source, "model": shape.label, "date": datetime.date.today().isoformat()},
            "inputs": {k: v for k, v in vars(args).items() if k not in ("json", "plots")},
            "model": shape.label, "card": f"{args.gpus} x {card.source}" if args.gpus > 1 else card.source,
            "memory_capacity_gb": card.memory / GB, "knee_batch": knee(shape, card, args.context),
            "bound": predict(shape, card, *w), "calibrated": {**predict(shape, card, *w, eff), "run": eff.source,
                                                             "efficiency": dataclasses.asdict(eff)},
            "curve": [{"batch": B, "bound_ms": predict(shape, card, B, *w[1:])["decode_ms"],
                       "calibrated_ms": predict(shape, card, B, *w[1:], eff)["decode_ms"]}
                      for B in [2 ** i for i in range(11)]]}


ROWS = [("weights (GB)", "weights_gb"), ("KV cache (GB)", "kv_gb"), ("memory (GB)", "memory_gb"),
        ("largest batch that fits", "max_batch"), ("TTFT (ms)", "ttft_ms"), ("decode step (ms)", "decode_ms"),
        ("tokens/s per user", "tokens_per_s_per_user"), ("tokens/s in all", "tokens_per_s"),
        ("tokens per verify pass", "tokens_per_pass")]


def text(r: dict) -> str:
    b, c = r["bound"], r["calibrated"]
    rows = [[label, b[k], c[k]] for label, k in ROWS]
    i, e = r["inputs"], c["efficiency"]
    knee_b = f"{r['knee_batch']:.0f}" if r["knee_batch"] else "none (the KV grows as fast as the compute)"
    return (f"Configurator: {r['model']} on {r['card']}; batch {i['batch']}, context {i['context']}, "
            f"prompt {i['prompt']}, {i['spec_k']} drafts at acceptance {i['acceptance']}.\n\n"
            + table(["", "bound (the lecture)", "this engine (calibrated)"], rows) +
            f"\n\n{'Fits' if b['fits'] else 'Does NOT fit'} in {r['memory_capacity_gb']:.0f} GB. Knee of the bound "
            f"(compute time = memory time): batch {knee_b}. Calibrated on {c['run']}: weights streamed at "
            f"{e['weights']:.0%} of the copy bandwidth, KV at {e['kv']:.0%}, each sequence's matmuls at "
            f"{e['compute']:.0%} of the matmul roof; this engine's decode step is {b['decode_ms'] / c['decode_ms']:.0%} of the bound's speed "
            f"(the lecture: real systems within 80%). Tensor parallelism counts N cards' roofs, not the all-reduces.\n")


def plot(r: dict):
    fig, (a1, a2) = figure(r, "Configurator: what a model needs of a card (the lecture's bound, and this engine)", 2)
    b, cap = r["bound"], r["memory_capacity_gb"]
    a1.bar(["memory"], [b["weights_gb"]], label="weights")
    a1.bar(["memory"], [b["kv_gb"]], bottom=[b["weights_gb"]], label=f"KV at batch {r['inputs']['batch']}")
    a1.axhline(cap, color="k", ls="--", label=f"capacity {cap:.0f} GB")
    a1.set_ylabel("GB")
    a1.legend(fontsize=8)
    B = [p["batch"] for p in r["curve"]]
    a2.plot(B, [p["bound_ms"] / p["batch"] for p in r["curve"]], "k--", label="bound")
    a2.plot(B, [p["calibrated_ms"] / p["batch"] for p in r["curve"]], "o-", label="this engine (calibrated)")
    if r["knee_batch"]:
        a2.axvline(r["knee_batch"], color="C3", ls=":", label=f"knee: batch {r['knee_batch']:.0f}")
    a2.axvline(max(1, b["max_batch"]), color="C2", ls="-.", label=f"largest batch that fits: {b['max_batch']}")
    a2.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode time per token (ms)")
    a2.legend(fontsize=8)
    return fig


def parse(argv):
    ap = argparse.ArgumentParser(prog="bench.py --configure", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="PATH or random:PRESET[:options] (else the raw shape below)")
    for flag, default, kind, doc in (
            ("--params", 13e9, float, "parameters"), ("--layers", 40, int, ""), ("--kv-heads", 40, int, ""),
            ("--head-dim", 128, int, ""), ("--mla-rank", 0, int, "MLA latent r (0: none)"),
            ("--mla-rope", 64, int, "MLA's shared RoPE key R"), ("--cla-share", 1, int, "layers per K/V layer"),
            ("--window", None, int, "sliding window W"), ("--batch", 32, int, ""), ("--context", 2048, int, ""),
            ("--prompt", 512, int, "prompt tokens, for TTFT"), ("--spec-k", 0, int, "drafts per verify pass"),
            ("--acceptance", 0.0, float, "each draft's acceptance rate a"), ("--gpus", 1, int, "cards (TP)"),
            ("--bandwidth", None, float, "TB/s"), ("--flops", None, float, "TFLOP/s"), ("--memory", None, float, "GB")):
        ap.add_argument(flag, default=default, type=kind, help=doc or None)
    ap.add_argument("--quantization", default=None, choices=[q for q in BYTES_PER_PARAM if q])
    ap.add_argument("--kv-cache-dtype", default=None, choices=["int8"])
    ap.add_argument("--gpu", default="h100", choices=list(ALL_CARDS), help="h100: the lecture's datasheet card")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plots", default=None, help="folder for configure.png")
    args = ap.parse_args(argv)
    if min(args.batch, args.context, args.gpus, args.layers, args.cla_share) < 1 or not 0 <= args.acceptance <= 1:
        ap.error("batch, context, gpus, layers and cla-share must be >= 1, acceptance in [0, 1]")
    return args


def main(argv) -> dict:
    args = parse(argv)
    try:
        r = configure(args)
    except ValueError as e:              # a shape the engine refuses: say so, no traceback
        raise SystemExit(f"bench.py --configure: {e}") from None
    print(text(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    if args.plots:
        os.makedirs(args.plots, exist_ok=True)
        plot(r).savefig(os.path.join(args.plots, "configure.png"), dpi=110)
    return r
