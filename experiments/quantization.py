"""
quantization -- fewer bytes per weight, fewer bytes per step, more tokens/s.

Claim (lecture): decode reads every weight each step, so int8 weights (half of bf16's bytes, a
quarter of float32's) make a memory-bound step faster, for a small perplexity cost; an int8 KV
cache halves the cache's bytes again. Baseline: the float engine (the run's dtype; on a CPU
bf16 too, the fair question there being what int8 adds over bf16 activations), timed in the same
run. On a GPU every row is compiled: the int8 -> bf16 conversion then happens in registers
inside the matmul (quantize.py), so the halved bytes show as time. Perplexity is a quality
figure: on the default model's trained weights (the same settings), never random ones.
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from cache import AttentionContext
from quantize import decode_weight_bytes

from experiments.common import NEEDS_DEFAULT_MODEL, decode_step_seconds, eval_text, figure, table, trained
from experiments.plan import Phase, decode, prefill

NAME = "quantization"
INT8, INT8_KV = dict(quantization="int8"), dict(quantization="int8", kv_cache_dtype="int8")
# configs: (name, engine options); the float row runs on the run's standard engine ({}); the int8 ones
# beside it with seats for `big` (their own pool; on a GPU the standard one stays built for what follows)
WORKLOAD = {"cpu": dict(big=16, context=128, steps=10, tokens=100000,
                        configs=[("float", {}), ("bfloat16", dict(dtype="bfloat16")), ("int8 weights", INT8),
                                 ("int8 weights + int8 KV", INT8_KV)]),
            "cpu-quick": dict(big=4, context=16, steps=3, tokens=128,
                              configs=[("float", {}), ("bfloat16", dict(dtype="bfloat16")), ("int8 weights", INT8),
                                       ("int8 weights + int8 KV", INT8_KV)]),
            "gpu": dict(big=16, context=512, steps=10, tokens=100000,
                        configs=[("float", {}), ("int8 weights", INT8), ("int8 weights + int8 KV", INT8_KV)]),
            "gpu-quick": dict(big=16, context=512, steps=5, tokens=100000,
                              configs=[("float", {}), ("int8 weights", INT8)])}


def configs(s, w) -> list:
    """[(name, timing engine options)]. A CPU run in bf16 (--dtype) has no separate bf16 row."""
    rows = [(n, kw) for n, kw in w.configs if n != "bfloat16" or s.dtype_arg in ("auto", "float32")]
    seats = dict(max_num_seqs=w.big, pool_tokens=2 * w.big * (w.context + w.steps + 80), share=False)
    return [(n, s.options(**(kw if n == "float" else {**kw, **seats}))) for n, kw in rows]


@torch.inference_mode()
def perplexity(model: torch.nn.Module, token_ids: list[int], window: int = 512) -> float:
    """exp(mean negative log-likelihood) of each token given the ones before it, through the dense
    path in windows of `window` predicted tokens. Lower is better; a uniform guess over V scores V."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    device, nll, count = next(model.parameters()).device, 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = torch.tensor(token_ids[start:start + window + 1], device=device)   # window + 1 tokens
        logits = model(chunk[:-1], torch.arange(len(chunk) - 1, device=device))     # [T, V]
        nll += F.cross_entropy(logits.float(), chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)


@torch.inference_mode()
def paged_perplexity(llm, ids: list[int], chunk: int = 256) -> float:
    """Perplexity through the engine's own path: paged KV cache (int8 if so configured), chunked
    prefill, every position's logits (LLM.step keeps only the last: its steps, done by hand here;
    sequence id -1 never collides with the engine's own, which count from 0)."""
    bm, sid, nll = llm.block_manager, -1, 0.0
    bm.allocate(sid, [])
    for start in range(0, len(ids) - 1, chunk):
        toks = ids[start:min(start + chunk, len(ids) - 1)]
        bm.reserve(sid, start, len(toks))
        x, pos, ctx = AttentionContext.build(llm.cache, bm, [(sid, toks, start)], list(range(len(toks))), llm.device)
        target = torch.tensor(ids[start + 1:start + 1 + len(toks)], device=llm.device)
        nll += F.cross_entropy(llm.model(x, pos, ctx).float(), target, reduction="sum").item()
    bm.free(sid)
    return math.exp(nll / (len(ids) - 1))


def one_config(b, w, name, opts) -> dict:
    """A config's bytes and decode tokens/s at batch 1 and `big`, then its perplexity."""
    llm = b.llm(**opts)
    t1 = decode_step_seconds(b, llm, 1, w.context, w.steps)
    tb = decode_step_seconds(b, llm, w.big, w.context, w.steps)
    c = {"name": name, "dtype": str(llm.dtype)[6:], "weight_bytes": decode_weight_bytes(llm.model),
         "kv_bytes_per_token": llm.cache.bytes_per_token, "compiled": llm.decoder is not None,
         "tokens_per_s_batch1": 1 / t1, f"tokens_per_s_batch{w.big}": w.big / tb, "perplexity": None}
    if trained(b.quality_path):
        if b.quality_path != b.path:          # the same settings on the quality model, eager (no step is timed)
            del llm
            q = {k: v for k, v in opts.items() if k in ("dtype", "quantization", "kv_cache_dtype")}
            llm = b.llm(path=b.quality_path, max_num_seqs=1, compile=False, pool_tokens=4096, share=False, **q)
        ids = llm.tokenizer.encode(eval_text())[:w.tokens]
        c["perplexity"], c["perplexity_tokens"] = paged_perplexity(llm, ids), len(ids)   # the int8 KV cache counts
    return c


def run(b):
    w = b.sizes(WORKLOAD)
    fig = {"configs": [], "quality_model": b.quality_path}
    for name, opts in configs(b.scale, w):
        b.progress(f"quantization: {name}")
        fig["configs"].append(one_config(b, w, name, opts))
    base = fig["configs"][0]
    for c in fig["configs"]:
        c["speedup_batch1"] = c["tokens_per_s_batch1"] / base["tokens_per_s_batch1"]
        c["perplexity_change"] = None if c["perplexity"] is None else c["perplexity"] / base["perplexity"] - 1
    rows = [[c["name"], c["dtype"], c["weight_bytes"] / 1e6, c["kv_bytes_per_token"], c["tokens_per_s_batch1"],
             c[f"tokens_per_s_batch{w.big}"], c["perplexity"] or "needs the default model"] for c in fig["configs"]]
    if base["perplexity"] is None:
        said = f"Perplexity {NEEDS_DEFAULT_MODEL}."
    else:
        where = "" if b.quality_path == b.path else f" of {os.path.basename(b.quality_path)} (the same settings)"
        said = (f"Perplexity{where} on the shipped evaluation text ({base['perplexity_tokens']} tokens) through the "
                "engine's paged path.")
    return fig, (f"Decode steps at a {w.context}-token context. {said}\n\n" +
                 table(["weights", "activations", "weight MB/step", "KV B/token", "tokens/s batch 1",
                        f"tokens/s batch {w.big}", "perplexity"], rows))


def plan(s):
    w, phases = s.sizes(WORKLOAD), []
    for name, o in configs(s, w):
        work = [prefill(o, (1 + w.big) * w.context, w.context / 2), decode(o, 2 * (w.steps + 3), 1, w.context),
                decode(o, w.steps + 3, w.big, w.context)]
        # the float row on the kept standard engine, each int8 row beside it (the standard one stays built)
        phases.append(Phase([o] if name == "float" else [s.options(), o], work, context=w.context + w.steps + 80))
    return phases


def plot(r: dict):
    fig, (ax,) = figure(r, "Quantization: fewer weight bytes per step, more tokens/s, at a perplexity cost")
    cfgs = r["configs"]
    key = next(k for k in cfgs[0] if k.startswith("tokens_per_s_batch") and k != "tokens_per_s_batch1")
    for i, c in enumerate(cfgs):        # one colour per configuration, its perplexity in the legend
        x, ppl = c["weight_bytes"] / 1e6, c.get("perplexity")
        ax.plot([x, x], [c["tokens_per_s_batch1"], c[key]], "-", color=f"C{i}", alpha=0.4)
        ax.plot([x], [c["tokens_per_s_batch1"]], "o", ms=8, color=f"C{i}",
                label=f"{c['name']} ({c['dtype']}): " + (f"perplexity {ppl:.4g}" if ppl else "random weights"))
        ax.plot([x], [c[key]], "s", ms=8, color=f"C{i}")
    ax.plot([], [], "ko", label="circles: batch 1")
    ax.plot([], [], "ks", label=f"squares: batch {key.removeprefix('tokens_per_s_batch')}")
    ax.set(xlabel="weight bytes read per decode step (MB)", ylabel="decode tokens/s")
    ax.set_xlim(0, max(c["weight_bytes"] for c in cfgs) / 1e6 * 1.1)
    ax.set_ylim(0, max(max(c["tokens_per_s_batch1"], c[key]) for c in cfgs) * 1.15)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=2)
    return fig
