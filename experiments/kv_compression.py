"""
kv-compression -- at long contexts the cache, not the weights, fills memory and the step.

Claim (lecture, chapter 6): KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes.
MHA caches a K/V pair per query head, GQA one per group, MQA one for all; CLA one per group of layers;
MLA one latent (r + R values a token and layer, no factor 2; here DeepSeek-V2's r = 4 d, R = d / 2). At
the same budget fewer bytes hold proportionally more sequences, and a decode step reads fewer. A window
(Mistral) gives the blocks behind it back: O(window) blocks, not O(length); a global layer every N keeps
1 / N of them. Baseline: the MHA variant of the same body (`random:<preset>:kv_heads=N`: every other
tensor the same), in the same run, one variant at a time; and full attention for the window.
"""
from __future__ import annotations

import contextlib
import io
import math

from cache import BlockManager, kv_cache_bytes
from engine import EngineConfig, make_kv_pool
from quantize import decode_weight_bytes
from sampler import SamplingParams
from support.checkpoint import RANDOM_PREFIX, parse_random_path

from experiments.common import TINY_MODEL, engine_step_seconds, figure, model_config, start_decoding, table
from experiments.plan import Phase, decode, prefill
from experiments.published import LONG_CONTEXT, published_kv_arithmetic

NAME = "kv-compression"
LECTURE_PRESET, BLOCK = "llama-3.2-1b", 16   # 32 query heads: MHA 32, GQA-8, MQA 1
# body: the preset timed; batch sequences of `context` tokens make the budget (MHA's); window/tokens: the
# window curves of the tiny model (eager). A GPU times the lecture's body compiled, one variant at a time.
WORKLOAD = {
    "cpu": dict(body="smollm2-135m", batch=4, context=1024, steps=10, window=64, tokens=1024, lecture=(4, 1024)),
    "cpu-quick": dict(body="smollm2-tiny", batch=4, context=1024, steps=8, window=32, tokens=128, lecture=(4, 128)),
    "gpu": dict(body=LECTURE_PRESET, batch=8, context=4096, steps=10, window=64, tokens=1024, lecture=(8, 4096),
                variants=("MHA", "GQA-8", "MLA")),   # ranked by KV bytes; MQA, CLA: counted, not timed (the limit)
    "gpu-quick": dict(body=LECTURE_PRESET, batch=8, context=4096, steps=5, window=64, tokens=1024, lecture=(8, 4096),
                      variants=("MHA", "MQA"))}     # the smoke run on a GPU: the two ends, one compile fewer
def body(s, w) -> str:
    """--model's preset if it is a "random:" one, else the workload's."""
    return parse_random_path(s.path)[0] if s.path.startswith(RANDOM_PREFIX) and s.path == s.quality_path else w.body


def variants(preset: str) -> list:
    """[(name, "random:" path)]: MHA (a KV head per query head), the published GQA, MQA (one), the
    published GQA with cross-layer attention (CLA-2: pairs of layers share one K/V layer), and MLA
    on the same query heads and FFN (a latent of r = 4 head_dim, DeepSeek-V2's 512 for 128)."""
    cfg, _ = model_config(RANDOM_PREFIX + preset)
    names = {1: "MQA", cfg.n_heads: "MHA"}
    heads = [(names.get(kv, f"GQA-{kv}"), f"{RANDOM_PREFIX}{preset}:kv_heads={kv}")
             for kv in sorted({cfg.n_heads, cfg.n_kv_heads, 1}, reverse=True)]
    gqa = names.get(cfg.n_kv_heads, f"GQA-{cfg.n_kv_heads}")
    return heads + [(f"{gqa} + CLA-2", f"{RANDOM_PREFIX}{preset}:kv_heads={cfg.n_kv_heads}:cla_share=2"),
                    ("MLA", f"{RANDOM_PREFIX}{preset}:kv_lora_rank={4 * cfg.head_dim}")]


def budget(preset: str, dtype, batch: int, context: int) -> int:
    """The fixed KV budget: `batch` sequences of `context` tokens of the preset's MHA variant + the null block."""
    blocks = batch * math.ceil(context / BLOCK) + 1        # + 1: a compiled engine keeps a null block
    return kv_cache_bytes(model_config(variants(preset)[0][1])[0], dtype, blocks * BLOCK)


def fit_batch(bm: BlockManager, context: int) -> int:
    """The most sequences of `context` tokens a pool holds, by the engine's own block accounting (admitted
    one by one as the scheduler admits them: can_append, then reserve); then all given back."""
    n = 0                            # negative sequence ids never collide with the engine's own
    while bm.allocate(-1 - n, []) == 0 and bm.can_append(-1 - n, 0, context):
        bm.reserve(-1 - n, 0, context)
        n += 1
    for i in range(n + 1):           # the n that fit, and the one that did not
        bm.free(-1 - i)
    return n


def kv_row(name, path, cfg, dtype, cache, bm, context) -> dict:
    """A variant's bytes per token (the lecture's formula, written out; and the pool allocated) and its fit."""
    tokens = cache.num_blocks * cache.block_size
    values = cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.kv_lora_rank else 2 * cfg.n_kv_heads * cfg.head_dim
    return {"name": name, "model": path, "kv_heads": cfg.n_kv_heads, "cla_share": cfg.cla_share,
            "kv_lora_rank": cfg.kv_lora_rank, "values_per_token_per_layer": values,   # MLA: r + R, one latent
            "kv_bytes_per_token": cfg.kv_layers * values * dtype.itemsize,
            "pool_bytes": cache.total_bytes, "pool_tokens": tokens, "pool_bytes_per_token": cache.total_bytes / tokens,
            "pool_blocks": bm.num_blocks, "fit_batch": fit_batch(bm, context)}


def accounting(b, preset: str, batch: int, context: int) -> list:
    """The lecture-scale rows, no weights needed: each variant's pool as the engine makes it
    (engine.make_kv_pool, on the device) for the fixed budget, and its block manager."""
    rows, dtype = [], b.torch_dtype
    for name, path in variants(preset):
        cfg, _ = model_config(path)
        with contextlib.redirect_stdout(io.StringIO()):
            cache, blocks = make_kv_pool(cfg, EngineConfig(device=b.device, dtype=dtype, block_size=BLOCK,
                                                           kv_cache_bytes=budget(preset, dtype, batch, context)))
        rows.append(kv_row(name, path, cfg, dtype, cache, BlockManager(blocks, BLOCK, False), context))
    return rows


def timed_engines(s, w) -> list:
    """[(name, options)]: the variants timed, one engine each, the same KV budget (MHA's batch x context)."""
    pool = budget(body(s, w), s.dtype, w.batch, w.context)
    return [(n, s.options(p, max_num_seqs=w.batch, kv_cache_bytes=pool)) for n, p in variants(body(s, w))
            if n in getattr(w, "variants", [n])]


def timed_variant(b, name, opts, w) -> dict:
    """One variant as an engine with the fixed budget: its pool and fit, then decode steps of `batch`
    sequences (what MHA holds) near `context` tokens, and the step's bytes: every weight once, each
    sequence's whole KV cache."""
    ctx = w.context - w.steps - 8          # the warm-up and timed steps keep every sequence within `context`
    b.progress(f"kv-compression: {name}, prefill of {w.batch} x {ctx} tokens, then decode steps")
    llm = b.llm(**opts)
    row = kv_row(name, opts["path"], llm.config, llm.dtype, llm.cache, llm.block_manager, w.context)
    ids = start_decoding(llm, w.batch, ctx, w.steps)
    t = engine_step_seconds(b, llm, w.steps)
    W, kv_step = decode_weight_bytes(llm.model), row["kv_bytes_per_token"] * ctx * w.batch
    row.update(step_ms=t * 1e3, weight_bytes=W, kv_bytes_per_step=kv_step, kv_share=kv_step / (W + kv_step),
               bound_ms=(W + kv_step) / b.bandwidth() * 1e3, preemptions=llm.scheduler.num_preemptions,
               compiled=llm.decoder is not None)
    for rid in ids:
        llm.abort(rid)
    return row


def window_paths(window: int) -> list:
    """[(key, path)]: full attention, a window on every layer, a window on every layer but each 2nd."""
    local = f"{TINY_MODEL}:sliding_window={window}"
    return [("full", TINY_MODEL), ("windowed", local), ("local_global", f"{local}:global_every=2")]


def held_blocks(bm, cfg) -> float:
    """KV blocks in use, in blocks of every layer (local + global: each manager's by its layers)."""
    used = lambda m: m.num_blocks - m.num_free_blocks - (m.null_block is not None)   # noqa: E731
    local = cfg.n_layers - cfg.kv_layers if cfg.global_every else 0
    return (used(bm) * (cfg.n_layers - local) + (used(bm.local) * local if local else 0)) / cfg.n_layers


def window_curves(b, window: int, tokens: int) -> dict:
    """KV blocks in use against generated length (one sequence, a 1-token prompt, greedy), read from the
    engine's block managers after every step: full attention, a window of `window`, local + global."""
    out = {"model": TINY_MODEL, "window": window, "block_size": BLOCK, "tokens": tokens,
           "window_bound_blocks": math.ceil(window / BLOCK) + 1, "source": "the engine (LLM.step)"}
    for key, path in window_paths(window):
        b.progress(f"kv-compression: {tokens} tokens, {key} attention")
        llm = b.llm(path=path, max_num_seqs=1, compile=False, pool_tokens=tokens + 64, block_size=BLOCK)
        seq = llm.requests[llm.add_request([1], SamplingParams(max_tokens=tokens + 1, ignore_eos=True))].seqs[0]
        out[key] = {"tokens": [], "blocks": []}
        while not any(o.finished for o in llm.step()):   # the last step finishes it and frees its blocks
            out[key]["tokens"].append(seq.num_computed)
            out[key]["blocks"].append(held_blocks(llm.block_manager, llm.config))
    return out


def run(b):
    w = b.sizes(WORKLOAD)
    preset = body(b.scale, w)
    timed = [timed_variant(b, name, opts, w) for name, opts in timed_engines(b.scale, w)]
    same = preset == LECTURE_PRESET and len(timed) == len(variants(preset))
    lec_batch, lec_context = (w.batch, w.context) if same else w.lecture
    fig = {"dtype": str(b.torch_dtype)[6:], "block_size": BLOCK, "lecture_preset": LECTURE_PRESET,
           "lecture_batch": lec_batch, "lecture_context": lec_context,
           "lecture_budget_bytes": budget(LECTURE_PRESET, b.torch_dtype, lec_batch, lec_context),
           "lecture": timed if same else accounting(b, LECTURE_PRESET, lec_batch, lec_context),
           "timed_preset": preset, "batch": w.batch, "context": w.context, "timed_context": w.context - w.steps - 8,
           "steps": w.steps, "timed_budget_bytes": budget(preset, b.torch_dtype, w.batch, w.context), "timed": timed,
           "published": published_kv_arithmetic(), "sliding_window": window_curves(b, w.window, w.tokens)}
    for rows in (fig["lecture"], timed):
        for r in rows:                     # the lesson's ratios, against the first (MHA) row
            r["bytes_vs_mha"] = rows[0]["kv_bytes_per_token"] / r["kv_bytes_per_token"]
            r["fit_vs_mha"] = r["fit_batch"] / rows[0]["fit_batch"]
    return fig, text(fig)


def text(r: dict) -> str:
    B, C, dtype, w = r["batch"], r["context"], r["dtype"], r["sliding_window"]
    head = ["attention", "values/token/layer", "KV B/token (formula)", "B/token of the allocated pool"]
    lecture = "" if r["lecture"] == r["timed"] else (
        f"The lecture's shapes, {r['lecture_preset']}, {dtype} (no weights needed): each variant's pool as the engine "
        f"allocates it for a budget of {r['lecture_budget_bytes'] / 2**20:.0f} MiB ({r['lecture_batch']} MHA sequences "
        f"of {r['lecture_context']} tokens), filled by its block manager.\n\n" +
        table(head + ["MHA / this", f"sequences of {r['lecture_context']} tokens that fit"],
              [[x["name"], x["values_per_token_per_layer"], x["kv_bytes_per_token"],
                f"{x['pool_bytes_per_token']:.10g}", x["bytes_vs_mha"], x["fit_batch"]] for x in r["lecture"]]) + "\n\n")
    timed = [[x["name"], x["values_per_token_per_layer"], x["kv_bytes_per_token"], f"{x['pool_bytes_per_token']:.10g}", x["fit_batch"],
              x["step_ms"], x["bound_ms"], x["weight_bytes"] / 1e6, x["kv_bytes_per_step"] / 1e6, f"{x['kv_share']:.0%}"]
             for x in r["timed"]]
    pub = [[x["model"], x["attention"], x["values_per_token_per_layer"], f"{x['bytes_per_token'] / 1024:,.4g}",
            x["kv_bytes_at_context"] / 1e9, x["reduction"]] for x in r["published"]]
    win = w["windowed"]["blocks"]
    return (lecture + f"Timed: {r['timed_preset']}'s body with each attention, {dtype}, one engine at a time, a budget "
            f"of {r['timed_budget_bytes'] / 2**20:.3g} MiB ({B} MHA sequences of {C} tokens); decode steps of {B} "
            f"sequences at a {r['timed_context']}-token context. Bound = (weights + the batch's KV) / bandwidth.\n\n" +
            table(head + [f"sequences of {C} tokens that fit", "decode step (ms)", "bound (ms)", "weights MB/step",
                          "KV MB/step", "KV share of the bytes"], timed) +
            f"\n\nThe lecture's arithmetic for published models (bf16), one sequence of {LONG_CONTEXT:,} tokens:\n\n" +
            table(["model", "attention", "values/token/layer", "KiB/token", f"GB at {LONG_CONTEXT // 1024}k tokens",
                   "reduction"], pub) +
            f"\n\nSliding window: one sequence generating {w['tokens']} tokens in blocks of {w['block_size']}, "
            f"{w['source']}. Full attention holds {w['full']['blocks'][-1]:g} blocks at the end; a window of "
            f"{w['window']} at most {max(win):g} (bound ceil(W / block size) + 1 = {w['window_bound_blocks']}), "
            f"{win[-1]:g} at the end; a window on the first layer and a global second one (global_every=2: "
            f"two pools) {w['local_global']['blocks'][-1]:g} blocks of both layers at the end.")


def plan(s):
    w = s.sizes(WORKLOAD)
    phases = [Phase([o], [prefill(o, w.batch * w.context, w.context / 2), decode(o, w.steps + 2, w.batch, w.context)],
                    context=w.context) for _, o in timed_engines(s, w)]
    tiny = [s.options(p, max_num_seqs=1, compile=False, pool_tokens=w.tokens + 64, block_size=BLOCK)
            for _, p in window_paths(w.window)]
    return phases + [Phase([o], [decode(o, w.tokens, 1, w.tokens)], context=w.tokens + 64) for o in tiny]


def plot(r: dict):
    lec, tim, w = r["lecture"], r["timed"], r["sliding_window"]
    heads = lambda rows: " | ".join(str(x["kv_heads"]) for x in rows)                  # noqa: E731
    models = ([f"{r['lecture_preset']} (kv_heads {heads(lec)})"] + ([] if lec == tim else
              [f"{r['timed_preset']} (kv_heads {heads(tim)})"]) + [f"{w['model'][7:]} (window {w['window']})"])
    fig, (a1, a2, a3) = figure({**r, "models": models}, "KV compression: fewer KV heads, fewer bytes per token "
                               "and more sequences per budget; a window caps the blocks, a global layer keeps a share",
                               ncols=3)
    # the allocated pool's bytes per token (log scale: MHA to MQA spans the query-head count)
    a1.bar([x["name"] for x in lec], [x["pool_bytes_per_token"] / 1024 for x in lec], color="C0")
    for i, x in enumerate(lec):
        a1.annotate(f"{x['kv_bytes_per_token'] / 1024:.4g} KiB\nfits {x['fit_batch']}",
                    (i, x["pool_bytes_per_token"] / 1024), textcoords="offset points", xytext=(0, 3), ha="center")
    a1.set(yscale="log", ylabel="KV cache KiB per token", xlabel=f"attention ({r['dtype']})")
    a1.set_title(f"{r['lecture_preset']}: KV bytes per token and sequences of {r['lecture_context']} tokens that fit "
                 "the budget", fontsize=9)
    a1.margins(y=0.25)
    names = [x["name"] for x in tim]
    a2.bar(names, [x["step_ms"] for x in tim], color="C1", label="decode step, measured")
    a2.plot(names, [x["bound_ms"] for x in tim], "k_", ms=30, mew=2, ls="none", label="bound: bytes / bandwidth")
    for i, x in enumerate(tim):
        a2.annotate(f"KV {x['kv_share']:.0%} of bytes", (i, x["step_ms"]), textcoords="offset points", xytext=(0, 3),
                    ha="center", fontsize=8)
    a2.set(ylabel="decode step (ms)", xlabel=f"attention ({r['timed_preset']})", ylim=(0, 1.15 * max(x["step_ms"] for x in tim)))
    a2.set_title(f"batch {r['batch']} at a {r['timed_context']}-token context", fontsize=9)
    a2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=2)   # below: no bar hidden
    a3.plot(w["full"]["tokens"], w["full"]["blocks"], "-", color="C0", label="full attention")
    for key, color, label in (("windowed", "C3", f"window W = {w['window']}"),   # (no local_global before
                              ("local_global", "C2", "local + global: layer 2 of 2 global")):   # 2026-11-28)
        if key in w:
            a3.plot(w[key]["tokens"], w[key]["blocks"], "-", color=color, label=label)
    a3.axhline(w["window_bound_blocks"], color="grey", ls=":", lw=1,
               label=f"ceil(W / {w['block_size']}) + 1 = {w['window_bound_blocks']} blocks")
    a3.set(xlabel="tokens generated (1-token prompt)", ylabel=f"KV blocks in use (of {w['block_size']} tokens)")
    a3.set_title("one sequence: O(length) against O(window)", fontsize=9)
    a3.legend(fontsize=8, loc="upper left")
    return fig
