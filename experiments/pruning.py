"""
pruning -- the lecture's last row: fewer parameters decode faster; distillation buys the quality back.

Claim (lecture, chapter 8; Minitron): rank attention groups, MLP channels and layers by their
activations on calibration text, cut the lowest, then distill from the original (KL on its
logits): "0.5x model size, 2x latency, < 5% drop, training needed". Baseline: the original model
in the same run: its parameters, batch-1 decode step (the engine, compiled where the run compiles)
and perplexity on the evaluation text, which neither the scores nor the distillation ever see
(they read the calibration text and text the original writes itself).
"""
from __future__ import annotations

import tempfile
import time

import prune
from model import fused_rows, load_model
from support.calibration import calibration_ids
from support.checkpoint import tokenizer_path, write_checkpoint
from tokenizer import Tokenizer

from experiments.common import decode_step_seconds, eval_text, figure, table, trained
from experiments.plan import Phase, Work, decode

NAME = "pruning"
ENGINE = dict(max_num_seqs=1, compile=False)   # eager: a 135M model's step is its launches either way
# target: the parameters kept; depth: the cut's share as whole layers; texts x tokens: the
# original's own samples to distill on; steps, lr: AdamW on the KL; context: the timed decode
WORKLOAD = {
    "cpu": dict(target=0.7, depth=0.5, texts=96, tokens=128, steps=300, lr=1e-4, context=128, timed=16),
    "cpu-quick": dict(target=0.7, depth=0.5, texts=2, tokens=16, steps=2, lr=1e-4, context=32, timed=4),
    "gpu": dict(target=0.7, depth=0.5, texts=96, tokens=128, steps=300, lr=1e-4, context=128, timed=16),
    "gpu-quick": dict(target=0.7, depth=0.5, texts=8, tokens=64, steps=20, lr=1e-4, context=128, timed=8)}


def run(b):
    from experiments.quantization import perplexity
    w, path = b.sizes(WORKLOAD), b.note(b.quality_path)
    teacher, cfg = load_model(path, device=b.device)     # float32: distillation trains in it
    tok = Tokenizer.from_pretrained(tokenizer_path(path))
    ev, calib = tok.encode(eval_text()), calibration_ids(tok, 1024)
    shape = prune.target_shape(cfg, w.target, w.depth)
    student = prune.cut(teacher, prune.importance(teacher, calib), shape)
    fig = {"model": path, "trained": trained(path), "target": w.target, "depth_share": w.depth,
           "params": prune.n_params(cfg), "pruned_params": prune.n_params(shape),
           "layers": [cfg.n_layers, shape.n_layers], "ffn_dim": [cfg.ffn_dim, shape.ffn_dim],
           "perplexity": {"original": perplexity(teacher, ev), "cut": perplexity(student, ev)}}
    t0 = time.perf_counter()
    texts = prune.teacher_texts(b.llm(path=path, share=False, **{**ENGINE, "max_num_seqs": 16}), w.texts, w.tokens)
    fig["generate_seconds"], t0 = time.perf_counter() - t0, time.perf_counter()
    fig["losses"] = prune.distill(student, teacher, texts, w.steps, w.lr, log=b.progress)
    fig["distill_seconds"] = time.perf_counter() - t0
    fig["distill_tokens"] = w.steps * sum(map(len, texts)) / len(texts)
    p = fig["perplexity"]
    p["distilled"] = perplexity(student, ev)
    lost = p["cut"] - p["original"]
    fig["recovered"] = (p["cut"] - p["distilled"]) / lost if lost > 0 else None
    with tempfile.TemporaryDirectory() as d:               # the engine loads what prune.py writes
        write_checkpoint(student.state_dict(), shape, fused_rows(shape), d, source=path)
        for key, model in (("original", path), ("pruned", d)):
            b.progress(f"pruning: batch-1 decode, the {key} model")
            llm = b.llm(path=model, share=False, **ENGINE)
            fig[f"{key}_step_ms"] = decode_step_seconds(b, llm, 1, w.context, w.timed) * 1e3
            del llm
    fig["speedup"] = fig["original_step_ms"] / fig["pruned_step_ms"]
    fig["param_ratio"] = fig["pruned_params"] / fig["params"]
    return fig, text(fig)


def text(r: dict) -> str:
    p, note = r["perplexity"], "" if r["trained"] else " (random weights: perplexity means nothing here)"
    rec = "n/a" if r["recovered"] is None else f"{r['recovered']:.0%}"
    rows = [["original", f"{r['params'] / 1e6:.1f}M", r["layers"][0], r["ffn_dim"][0], p["original"],
             r["original_step_ms"], 1.0],
            ["cut (scores only)", f"{r['pruned_params'] / 1e6:.1f}M", r["layers"][1], r["ffn_dim"][1], p["cut"],
             r["pruned_step_ms"], r["speedup"]],
            [f"cut + {len(r['losses'])} distillation steps", f"{r['pruned_params'] / 1e6:.1f}M", r["layers"][1],
             r["ffn_dim"][1], p["distilled"], r["pruned_step_ms"], r["speedup"]]]
    return (f"Model: {r['model']}{note}. Target {r['target']:.0%} of the parameters, {r['depth_share']:.0%} of "
            f"the cut as whole layers; scores on the calibration text; distilled on "
            f"{r['distill_tokens']:,.0f} tokens the original wrote ({r['generate_seconds']:.0f} s to write, "
            f"{r['distill_seconds']:.0f} s to distill).\n\n" +
            table(["model", "parameters", "layers", "MLP channels", "perplexity (eval text)",
                   "batch-1 step (ms)", "speedup"], rows) +
            f"\n\n{r['param_ratio']:.2f}x the parameters, {r['speedup']:.2f}x the batch-1 speed; distillation "
            f"recovered {rec} of the perplexity the cut lost (KL {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}).")


def plan(s):
    w = s.sizes(WORKLOAD)
    o = {**s.options(s.quality_path, **ENGINE), "share": False}
    write = decode({**o, "max_num_seqs": 16}, w.tokens, 16, w.tokens)   # the original's samples
    train = Work("seconds", None, w.steps * (0.05 if s.gpu else 1.5))   # a step: ~1.5 s on 2 cores
    return [Phase([o], [write, train]), Phase([o], [decode(o, w.timed + 2, 1, w.context)], context=w.context),
            Phase([o], [decode(o, w.timed + 2, 1, w.context)], context=w.context)]


def plot(r: dict):
    fig, (a1, a2) = figure({**r, "models": [r["model"]]}, "Pruning + distillation: fewer parameters, "
                           "faster decode; distillation recovers the quality the cut lost", ncols=2)
    names = ["original", "cut", "distilled"]
    a1.bar(names, [r["perplexity"][n] for n in names], color=["C0", "C3", "C2"])
    a1.set(xlabel="model", ylabel="perplexity on the evaluation text (lower is better)",
           title=f"{r['param_ratio']:.2f}x the parameters, {r['speedup']:.2f}x the batch-1 speed")
    a2.plot(range(1, len(r["losses"]) + 1), r["losses"], color="C2")
    a2.set(xlabel="distillation step", ylabel="KL(original || pruned) per token", title="distillation")
    return fig
