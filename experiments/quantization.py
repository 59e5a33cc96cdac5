"""
quantization -- the lecture's table: fewer bytes per weight, fewer bytes per step, at a perplexity cost.

Claim (lecture): decode reads every weight each step, so fewer bytes per weight make a memory-bound
step faster: fp8 and int8 weights are half of bf16's bytes, int4 a quarter (plus a scale and a zero
point per group); LLM.int8() keeps int8 weights but also rounds the activations (its outlier columns
aside), and fp8-dynamic rounds them to fp8 (fp8 x fp8 products), AWQ is int4 with activation-aware
scales. The rows: float, fp8, fp8 weights + activations, int8, llm.int8, int4, awq
(on a CPU also an int8 KV cache). Baseline: the float engine (the run's dtype; on a CPU bf16 too, the fair
question there being what a format adds over bf16 activations), timed in the same run. Bytes are
given as a factor of the same weights in bf16 and in float32. On a GPU every row but llm.int8 (its
outlier columns change per call: no CUDA graph) is compiled, and int8 and int4 run kernels that read
their small bytes (Triton's int8 product, torch's int4 tinygemm), so the bytes show as time;
eagerly on a CPU each format's dequantized copy costs more than it saves. Perplexity is a quality
figure: on the default model's trained weights (the same settings), never random ones, on the
shipped evaluation text (AWQ calibrates on another shipped text, support/calibration_text.txt).
The outlier line: the share of each kind of linear's input columns LLM.int8() multiplies in float.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F

from cache import AttentionContext
from quantize import decode_weight_bytes

from experiments.common import NEEDS_DEFAULT_MODEL, decode_step_seconds, eval_text, figure, table, trained
from experiments.plan import Phase, decode, prefill

NAME = "quantization"
INT8, INT8_KV = dict(quantization="int8"), dict(quantization="int8", kv_cache_dtype="int8")
FP8, FP8_DYNAMIC, INT4, AWQ = (dict(quantization=q) for q in ("fp8", "fp8-dynamic", "int4", "awq"))
LLM_INT8 = dict(quantization="llm.int8", compile=False)   # its outlier columns vary: no CUDA graph
FORMATS = [("fp8 weights", FP8), ("fp8 weights + activations", FP8_DYNAMIC), ("int8 weights", INT8),
           ("llm.int8", LLM_INT8), ("int4 weights", INT4), ("awq int4 weights", AWQ)]
# configs: (name, engine options); the float row runs on the run's standard engine ({}); the int8 ones
# beside it with seats for `big` (their own pool; on a GPU the standard one stays built for what follows)
WORKLOAD = {"cpu": dict(big=16, context=128, steps=10, tokens=100000,
                        configs=[("float", {}), ("bfloat16", dict(dtype="bfloat16")), *FORMATS,
                                 ("int8 weights + int8 KV", INT8_KV)]),
            "cpu-quick": dict(big=4, context=16, steps=3, tokens=128,
                              configs=[("float", {}), ("bfloat16", dict(dtype="bfloat16")), *FORMATS,
                                       ("int8 weights + int8 KV", INT8_KV)]),
            # GPU: AWQ decodes through int4's product on int4's bytes (its scales are folded into the
            # norms), so its speed is int4's by construction: its row times nothing and reports int4's,
            # with its own perplexity (one compile and an 8B calibration fewer)
            "gpu": dict(big=16, context=512, steps=10, tokens=100000, configs=[("float", {}), *FORMATS],
                        same_speed={"awq int4 weights": "int4 weights"}),
            "gpu-quick": dict(big=16, context=512, steps=5, tokens=100000,
                              configs=[("float", {}), ("int4 weights", INT4)])}


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


@torch.inference_mode()
def outlier_columns(model: torch.nn.Module, token_ids: list[int], window: int = 512) -> dict:
    """LLM.int8()'s outliers in each kind of linear (qkv_proj, ..., lm_head), over one dense pass of `window`
    tokens: {kind: (share of input columns holding a |value| > OUTLIER in the window, share of the values
    above it: a decode step's single row sends about that share of columns through the float product)},
    each the mean over the layers."""
    from quantize import OUTLIER
    seen = {}

    def keep(kind):
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float().abs() > OUTLIER
            seen.setdefault(kind, []).append((x.any(0).float().mean().item(), x.float().mean().item()))
        return hook
    hooks = [m.register_forward_pre_hook(keep(n.rsplit(".", 1)[-1])) for n, m in model.named_modules()
             if hasattr(m, "in_features")]
    ids = torch.tensor(token_ids[:window], device=next(model.parameters()).device)
    model(ids, torch.arange(len(ids), device=ids.device))
    for h in hooks:
        h.remove()
    return {k: tuple(sum(x) / len(v) for x in zip(*v)) for k, v in seen.items()}


def one_config(b, w, name, opts, timed: dict | None = None) -> dict:
    """A config's bytes and decode tokens/s at batch 1 and `big` (or, given `timed`, that row's: the
    same product on the same bytes), then its perplexity."""
    if timed is None:
        llm = b.llm(**opts)
        t1 = decode_step_seconds(b, llm, 1, w.context, w.steps)
        tb = decode_step_seconds(b, llm, w.big, w.context, w.steps)
        c = {"name": name, "dtype": str(llm.dtype)[6:], "weight_bytes": decode_weight_bytes(llm.model),
             "kv_bytes_per_token": llm.cache.bytes_per_token, "compiled": llm.decoder is not None,
             "tokens_per_s_batch1": 1 / t1, f"tokens_per_s_batch{w.big}": w.big / tb, "perplexity": None}
    else:
        llm, c = None, {**{k: v for k, v in timed.items() if not k.startswith(("perplexity", "outlier"))},
                        "name": name, "timed_as": timed["name"], "perplexity": None}
    if trained(b.quality_path):
        if b.quality_path != b.path or llm is None:   # the same settings on the quality model, eager (untimed)
            del llm
            q = {k: v for k, v in opts.items() if k in ("dtype", "quantization", "kv_cache_dtype")}
            llm = b.llm(path=b.quality_path, max_num_seqs=1, compile=False, pool_tokens=4096, share=False, **q)
        ids = llm.tokenizer.encode(eval_text())[:w.tokens]
        c["perplexity"], c["perplexity_tokens"] = paged_perplexity(llm, ids), len(ids)   # the int8 KV cache counts
        if name == "float":
            c["outlier_columns"] = outlier_columns(llm.model, ids)
    return c


def run(b):
    w = b.sizes(WORKLOAD)
    fig = {"configs": [], "quality_model": b.quality_path}
    same = getattr(w, "same_speed", {})
    for name, opts in configs(b.scale, w):
        b.progress(f"quantization: {name}")
        timed = next((c for c in fig["configs"] if c["name"] == same.get(name)), None)
        try:
            fig["configs"].append(one_config(b, w, name, opts, timed))
        except Exception as e:        # noqa: BLE001 (one format failing, a GPU kernel say, keeps the rest)
            if name == "float":
                raise
            fig.setdefault("failed", {})[name] = f"{type(e).__name__}: {e}"[:300]
            print(f"bench: quantization: {name} FAILED: {e!r}", file=sys.stderr, flush=True)
    base = fig["configs"][0]
    params = base["weight_bytes"] / torch.finfo(getattr(torch, base["dtype"])).bits * 8   # values, about
    for c in fig["configs"]:
        c["speedup_batch1"] = c["tokens_per_s_batch1"] / base["tokens_per_s_batch1"]
        c["perplexity_change"] = None if c["perplexity"] is None else c["perplexity"] / base["perplexity"] - 1
        c["bytes_vs_bf16"], c["bytes_vs_float32"] = c["weight_bytes"] / (2 * params), c["weight_bytes"] / (4 * params)
    rows = [[c["name"], c["dtype"], c["weight_bytes"] / 1e6, f"{c['bytes_vs_bf16']:.2f}x", f"{c['bytes_vs_float32']:.3f}x",
             c["kv_bytes_per_token"], c["tokens_per_s_batch1"], f"{c['speedup_batch1']:.2f}x",
             c[f"tokens_per_s_batch{w.big}"], c["perplexity"] or "needs the default model",
             "" if c["perplexity_change"] is None else f"{100 * c['perplexity_change']:+.1f}%"] for c in fig["configs"]]
    if base["perplexity"] is None:
        said = f"Perplexity {NEEDS_DEFAULT_MODEL}."
    else:
        where = "" if b.quality_path == b.path else f" of {os.path.basename(b.quality_path)} (the same settings)"
        said = (f"Perplexity{where} on the shipped evaluation text ({base['perplexity_tokens']} tokens) through the "
                "engine's paged path. LLM.int8() outlier columns (|x| > 6) per kind of linear, in a 512-token "
                "window / in one token's row: " + ", ".join(f"{k} {100 * a:.2f}% / {100 * t:.3f}%" for k, (a, t)
                                                            in base["outlier_columns"].items()) + ".")
    said += "".join(f" {c['name']}: the speed of {c['timed_as']} (the same product on the same bytes; "
                    "not timed again)." for c in fig["configs"] if "timed_as" in c)
    said += "".join(f" **{name} FAILED** (no row): {error}." for name, error in fig.get("failed", {}).items())
    return fig, (f"Decode steps at a {w.context}-token context. {said}\n\n" +
                 table(["weights", "activations", "weight MB/step", "vs bf16", "vs float32", "KV B/token",
                        "tokens/s batch 1", "vs float", f"tokens/s batch {w.big}", "perplexity", "vs float"], rows))


def plan(s):
    w, phases = s.sizes(WORKLOAD), []
    for name, o in configs(s, w):
        if name in getattr(w, "same_speed", {}):
            continue                                 # timed as another row: nothing built
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
        if ppl:
            ax.annotate(f"{ppl:.3g}", (x, c["tokens_per_s_batch1"]), textcoords="offset points", xytext=(6, -12),
                        fontsize=8, color=f"C{i}")
    ax.plot([], [], "ko", label="circles: batch 1")
    ax.plot([], [], "ks", label=f"squares: batch {key.removeprefix('tokens_per_s_batch')}")
    ax.set(xlabel="weight bytes read per decode step (MB)", ylabel="decode tokens/s")
    ax.set_xlim(0, max(c["weight_bytes"] for c in cfgs) / 1e6 * 1.1)
    ax.set_ylim(0, max(max(c["tokens_per_s_batch1"], c[key]) for c in cfgs) * 1.15)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=2)
    return fig
