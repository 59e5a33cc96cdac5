"""
experiments/check.py -- `python bench.py --check`: a verdict per GPU path, the first thing to run on a GPU.

The GPU code of this project is developed without a GPU (tests/ prove it on CPU, with a
CUDA-graph capture simulator). The check is where a GPU user finds out, in <= 3 minutes, whether
each GPU path does what the CPU evidence says: paste its table into a bug report. Every verdict
is printed and saved (--json) as it finishes, so a run cut short keeps what it found; each
engine is freed before the next is built. It runs on the default model's shapes (its random-
weight preset when the default model is not installed). `--check --device cpu` is its dry run
(CI): the same table, the paths that need CUDA "skipped: CPU".
"""
from __future__ import annotations

import math
import os
import sys
import time
import traceback

import torch

import kernels
from graphs import dynamic, size_oblivious
from model import load_model
from quantize import FUSED_ROWS, Int8KVCache, QuantLinear, quantize_model
from sampler import SamplingParams
from support.checkpoint import RANDOM_PREFIX
from support.checks import check_tensor_parallel

from experiments.common import LogitTap, agreement, eval_text, model_config, prefix_caching, start_decoding, table
from experiments.plan import Phase, decode, prefill, seconds

PASS, FAIL = "pass", "FAIL"
FLOAT32_REL_TOL = 1e-3   # float32 paths differ by reassociation (~1e-5 of the largest logit); a bug by O(1)
BF16_SDPA_TOL = 1e-2     # bf16 SDPA vs float32 math, measured on an H200 (torch 2.11): efficient and cuDNN
#                          3.3e-3 to 3.7e-3, math 3.1e-3 (bf16's own rounding); flash refuses the mask
GRAPH_CONTEXT = 4096     # the graph-memory check's longest sequence: a long context every card fits
INT8_COMPILE_S = 3.0     # the plan's allowance per int8 layer shape and dtype compiled (assumed)


def check_prompts(llm) -> list:
    """Four prompts of different lengths (one block, a few, a partial one): a batch of 4."""
    ids = llm.tokenizer.encode(eval_text())
    return [ids[:7], ids[40:80], ids[100:113], ids[200:300]]


def same_greedy(ref, ref_tap: LogitTap, outs, tap: LogitTap) -> tuple[str, str]:
    """Verdict on a float32 path that must give the reference's greedy tokens and logits. Logits on the
    same tokens may differ by float32 rounding only (FLOAT32_REL_TOL of the row's largest); tokens may
    part only on a near tie: the reference's two best logits closer than twice the paths' difference."""
    errors = [o.error for o in list(ref) + list(outs) if o.error]
    if errors:
        return FAIL, f"a request failed: {errors[0]}"
    gap, parted, tie = 0.0, None, None
    for i, (r, o) in enumerate(zip(ref, outs)):
        n = agreement(o.token_ids, r.token_ids)
        a, c, first = ref_tap.rows(r), tap.rows(o), len(r.prompt_token_ids) - 1   # row `first` predicts token 0
        diffs = {p: ((a[p] - c[p]).abs().max() / a[p].abs().max()).item() for p in a.keys() & c.keys()
                 if p <= first + n}                                  # the rows with the same context
        gap = max([gap] + list(diffs.values()))
        if parted is None and not n == len(r.token_ids) == len(o.token_ids):
            top2, d = a[first + n].topk(2).values if first + n in a else None, diffs.get(first + n)
            margin = None if top2 is None else ((top2[0] - top2[1]) / a[first + n].abs().max()).item()
            if margin is not None and d is not None and margin <= 2 * d:
                tie = f"; prompt {i} parts at token {n} on a near tie (margin {margin:.2g} of the largest logit)"
            else:
                parted = f"prompt {i}: the tokens part after {n} of {len(r.token_ids)} (no near tie there)"
    said = (f"{len(ref)} prompts, {sum(len(r.token_ids) for r in ref)} greedy tokens; largest logit difference "
            f"{gap:.2g} of the row's largest")
    if parted or gap > FLOAT32_REL_TOL:
        return FAIL, "; ".join(x for x in (parted, said) if x) + f" (float32 rounding: < {FLOAT32_REL_TOL:g})"
    return PASS, said + (tie or "; tokens equal")


def reference(b, **kw):
    """The eager float32 engine's greedy tokens and logits on the check prompts; the engine freed after."""
    llm = b.llm(**kw)
    prompts = check_prompts(llm)
    with LogitTap(llm) as tap:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    del llm
    b.release()
    return prompts, outs, tap


def check_compiled(b):
    if b.device.type != "cuda":
        return "skipped: CPU", "CUDA graphs need a GPU (tests/test_graphs.py runs the compiled step on CPU)"
    kw = dict(path=b.quality_path, dtype="float32", max_num_seqs=4, pool_tokens=2048)
    prompts, ref, ref_tap = reference(b, compile=False, **kw)
    comp = b.llm(compile=True, **kw)
    with LogitTap(comp) as tap:
        outs = comp.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    graphs, steps = len(getattr(comp.decoder, "graphs", {})), comp.decoder.steps.get(1, 0)
    verdict, detail = same_greedy(ref, ref_tap, outs, tap)
    if not graphs or not steps:
        return FAIL, f"{graphs} CUDA graphs recorded, {steps} compiled decode steps run; {detail}"
    return verdict, f"{graphs} CUDA graphs recorded in {comp.compile_seconds:.0f} s, {steps} replayed steps; {detail}"


def quantized_layers(path, device, method) -> dict:
    """{(in, out): a `method` layer of that shape} of the model quantized (float32 weights)."""
    model = quantize_model(load_model(path, device=device, dtype=torch.float32)[0], method)
    layers = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            layers.setdefault((m.in_features, m.out_features), m)
    return layers


def check_int8_fused(b):
    """Every distinct int8 and int4 layer shape, eagerly and through torch.compile (rows 1 and
    FUSED_ROWS), against x @ dequantized(w)^T in float64. On CUDA both run the kernels that read the
    small bytes (int8: kernels.int8_matmul, Triton; int4 in bf16: torch's tinygemm); on a CPU, the
    compiled fused reduction and the eager product."""
    cuda, worst, gen = b.device.type == "cuda", {}, torch.Generator().manual_seed(0)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for method in ("int8", "int4"):
        layers = quantized_layers(b.quality_path, b.device, method)
        # On a CPU, bf16 activations take another kernel (_weight_int8pack_mm), and each compile
        # costs seconds: the dry run compiles the smallest and the largest layer in float32 only.
        shapes = sorted(layers, key=lambda s: s[0] * s[1])
        shapes = shapes if cuda else [shapes[0], shapes[-1]][:2 if method == "int8" else 1]
        for dtype in [torch.float32] + ([torch.bfloat16] if cuda else []):
            tol = 1e-5 if dtype == torch.float32 else 2 ** -7    # bf16: x and the output rounded
            for shape in shapes:
                layer, fused = layers[shape], torch.compile(layers[shape], fullgraph=True)
                w = layer.dequantized(torch.float64)                 # the dequantized weight
                for rows in (FUSED_ROWS, 1):  # symbolic rows, 1 included: one compile a layer, dtype
                    x = dynamic(torch.randn(rows, shape[0], generator=gen).to(b.device, dtype), 0)
                    want = x.double() @ w.t()
                    with torch.inference_mode(), size_oblivious():
                        got = {"eager": layer(x), "compiled": fused(x)}
                    for how, y in got.items():
                        err = ((y.double() - want).abs().max() / want.abs().max()).item()
                        key = (method, str(dtype), shape)
                        worst[key] = max(err, worst.get(key, 0.0))
                        if not err <= tol:
                            return FAIL, (f"{method}, {dtype}, layer {shape[0]}->{shape[1]}, {rows} rows, "
                                          f"{how}: differs from the dequantized product by {err:.3g} "
                                          f"(> {tol:g})")
    dtypes = ", ".join(sorted({k[1].replace("torch.", "") for k in worst}))
    return PASS, (f"{len(worst)} (format, dtype, layer shape) x rows 1 and {FUSED_ROWS}, eager and compiled, "
                  f"{dtypes}: largest difference from the dequantized product {max(worst.values()):.2g} of "
                  "the output's largest value")


def check_int8_kv(b):
    """Real K, V (a prefill of the evaluation text through the float cache) written into an int8 cache
    and read back: every value within half a quantization step of its (token, head), plus the dtype's
    own rounding of the dequantized value."""
    llm = b.llm(path=b.quality_path, compile=False, max_num_seqs=1, pool_tokens=1024)
    ids = llm.tokenizer.encode(eval_text())[:min(128 if b.quick else 512, llm.max_len - 1)]
    with prefix_caching(llm, False):
        out = llm.generate([ids], SamplingParams(max_tokens=1))[0]
    if out.error:
        return FAIL, f"the prefill failed: {out.error}"
    cache, dtype = llm.cache, llm.dtype
    q8 = Int8KVCache(llm.config, cache.num_blocks, cache.block_size, b.device, dtype)
    slots, blocks = torch.arange(cache.num_blocks * cache.block_size, device=b.device), \
        torch.arange(cache.num_blocks, device=b.device)
    worst, eps = 0.0, torch.finfo(dtype).eps
    for layer in range(llm.config.n_layers):
        x = cache.k[layer].flatten(0, 1), cache.v[layer].flatten(0, 1)           # [slots, n_kv, d]
        q8.write(layer, slots, *x)
        for orig, back in zip(x, q8.blocks(layer, blocks)):
            orig, back = orig.float(), back.flatten(0, 1).float()
            half_step = orig.abs().amax(-1, keepdim=True) / 127 / 2             # scale / 2 per (token, head)
            bound = half_step * (1 + 1e-4) + 2 * eps * (orig.abs() + half_step)
            worst = max(worst, ((back - orig).abs() / bound.clamp_min(1e-30)).max().item())
    filled = int((cache.k[0].flatten(0, 1).abs().amax((-1, -2)) > 0).sum())
    return (PASS if worst <= 1.0 else FAIL), (f"{filled} tokens x {llm.config.n_layers} layers x "
                                              f"{llm.config.n_kv_heads} KV heads, K and V: the largest error is "
                                              f"{worst:.4f} x the bound (half a step + {str(dtype)[6:]} rounding)")


def check_tensor_parallel_nccl(b):
    if b.device.type != "cuda":
        return "skipped: CPU", "NCCL needs GPUs (tests/test_parallel.py runs N = 2 and 3 with gloo on CPU)"
    if torch.cuda.device_count() < 2:
        return "skipped: needs 2 GPUs", f"{torch.cuda.device_count()} GPU visible"
    path = b.quality_path
    try:
        check_tensor_parallel(model_config(path)[0], 2, "cuda")
    except ValueError:                 # e.g. SmolLM2's 9 heads: a published shape that splits in two
        path = RANDOM_PREFIX + "llama-3.2-1b"
    kw = dict(path=path, dtype="float32", compile=False, max_num_seqs=4, pool_tokens=2048)
    prompts, ref, ref_tap = reference(b, **kw)
    two = b.llm(tensor_parallel_size=2, **kw)
    try:
        with LogitTap(two) as tap:
            outs = two.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    finally:
        two.close()
        b.release()
    verdict, detail = same_greedy(ref, ref_tap, outs, tap)
    return verdict, f"{os.path.basename(path)}, N = 2 over NCCL against N = 1: {detail}"


def check_graph_memory(b):
    """The compiled engine with the pool it sizes itself (kv_cache_bytes=None, what a user gets), then
    its largest batch bucket: every seat decoding at a long context (GRAPH_CONTEXT, or what the pool
    and the model hold), after full prefill chunks there. Nothing may run out of memory, and the
    replays may not reserve memory beyond what the engine held once built and warmed up."""
    if b.device.type != "cuda":
        return "skipped: CPU", "CUDA graphs and their memory pool exist on a GPU only"
    b.release()
    llm = b.llm(path=b.quality_path, dtype="float32", max_num_seqs=8, compile=True, kv_cache_bytes=None)
    dev, gib = b.device, 2 ** 30
    total, built = torch.cuda.get_device_properties(dev).total_memory, torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    B, steps, bm = llm.scheduler.max_num_seqs, 4, llm.block_manager
    context = min(GRAPH_CONTEXT, llm.max_len - steps - 70, bm.num_blocks * bm.block_size // B - 80)
    ids = start_decoding(llm, B, context, steps)      # prefill chunks at up to `context` keys, untimed
    prefilled, before = torch.cuda.max_memory_reserved(dev), torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    replays = llm.decoder.steps.get(1, 0)
    for _ in range(steps):
        llm.step()                                    # pure decodes of B sequences: the widest batch bucket
    torch.cuda.synchronize(dev)
    decoding, replays = torch.cuda.max_memory_reserved(dev), llm.decoder.steps.get(1, 0) - replays
    for rid in ids:
        llm.abort(rid)
    detail = (f"{len(llm.decoder.graphs)} graphs; {B} sequences x {context} tokens; reserved {built / gib:.1f} GiB "
              f"once built, {prefilled / gib:.1f} GiB at peak while prefilling, {decoding / gib:.1f} GiB while "
              f"decoding, of {total / gib:.1f} GiB")
    if getattr(llm, "memory_budget", None) is not None:     # what the engine planned, where it says so
        detail += f"; the engine's budget: {llm.memory_budget}"
    if not replays:
        return FAIL, "no compiled decode step ran; " + detail
    grew = decoding - before
    detail += f"; decoding grew the reservation by {grew / 2**20:.0f} MiB"
    return (PASS if grew <= 64 * 2 ** 20 else FAIL), detail


def fused_backends():
    from torch.nn.attention import SDPBackend
    return {n.lower().replace("_attention", ""): getattr(SDPBackend, n)
            for n in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION") if hasattr(SDPBackend, n)}


def check_sdpa(b):
    """The eager engine's attention (prefill chunks, mixed steps, decodes) with SDPA's math backend
    disabled: a call that would fall back to it raises (kernels.STRICT_SDPA, and sdpa_kernel here)."""
    if b.device.type != "cuda":
        return "skipped: CPU", "SDPA's fused backends (flash, memory-efficient, cuDNN) are CUDA kernels"
    from torch.nn.attention import sdpa_kernel
    fused = list(fused_backends().values())
    # max_num_batched_tokens 64: prompts are prefilled in chunks next to other sequences' decodes
    llm = b.llm(path=b.quality_path, compile=False, max_num_seqs=4, max_num_batched_tokens=64, pool_tokens=2048)
    strict, kernels.STRICT_SDPA = kernels.STRICT_SDPA, True
    try:
        with sdpa_kernel(fused):
            outs = llm.generate(check_prompts(llm), SamplingParams(max_tokens=8, ignore_eos=True))
    finally:
        kernels.STRICT_SDPA = strict
    errors = [o.error for o in outs if o.error]
    if errors:
        return FAIL, f"{llm.dtype}: {errors[0]}"
    return PASS, f"{llm.dtype}: chunked prefills, mixed steps and decodes ran on {len(fused)} fused backends only"


def attention_error(attend, cfg, batch: int, queries: int, keys: int, device, seed: int = 0) -> float:
    """|attend(q, k, v, visible) - float32 math attention| / its largest value, on random bf16 q, k, v of
    the model's heads (q [B, Q, H, d], k and v [B, n_kv, T, d]), each sequence's queries its last Q
    positions of a random length: attend gets kernels.grouped_attention's arguments."""
    gen = torch.Generator().manual_seed(seed)
    H, n_kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = torch.randn(batch, queries, H, d, generator=gen).to(device, torch.bfloat16)
    k, v = (torch.randn(batch, n_kv, keys, d, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    lens = torch.randint(queries, keys + 1, (batch,), generator=gen).to(device)
    q_pos = lens[:, None] - queries + torch.arange(queries, device=device)                   # [B, Q]
    visible = torch.arange(keys, device=device)[None, None, :] <= q_pos[:, :, None]          # [B, Q, T]
    got = attend(q, k, v, visible).float()                                                   # [B, H, Q, d]
    kf, vf = (t.float().repeat_interleave(H // n_kv, dim=1) for t in (k, v))                 # [B, H, T, d]
    scores = q.float().transpose(1, 2) @ kf.transpose(-1, -2) / math.sqrt(d)                  # [B, H, Q, T]
    ref = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1) @ vf
    return ((got - ref).abs().max() / ref.abs().max()).item()


def check_sdpa_bf16(b):
    """bf16 numerics of the fused SDPA backend the engine reaches (kernels.grouped_attention, strict: no
    math fallback), against float32 math attention, on the model's own heads: a decode step of 8
    sequences and a 256-query prefill chunk, 1024 keys. Each fused backend alone too (or its refusal)."""
    if b.device.type != "cuda":
        return "skipped: CPU", "SDPA's fused backends are CUDA kernels (the CPU runs float32 here)"
    from torch.nn.attention import sdpa_kernel
    cfg, cases = model_config(b.quality_path)[0], ((8, 1, 1024), (1, 256, 1024))
    strict, kernels.STRICT_SDPA = kernels.STRICT_SDPA, True
    try:
        error = lambda: max(attention_error(kernels.grouped_attention, cfg, *c, b.device) for c in cases)  # noqa
        engine, alone = error(), {}
        for name, backend in fused_backends().items():
            try:
                with sdpa_kernel([backend]):
                    alone[name] = f"{error():.2g}"
            except RuntimeError:
                alone[name] = "refuses"
    finally:
        kernels.STRICT_SDPA = strict
    detail = (f"H {cfg.n_heads}, {cfg.n_kv_heads} KV heads of {cfg.head_dim}: relative error {engine:.2g} "
              f"(tolerance {BF16_SDPA_TOL:g}); each backend alone: " + ", ".join(f"{k} {v}" for k, v in alone.items()))
    return (PASS if engine <= BF16_SDPA_TOL else FAIL), detail


CHECKS = {"compiled + CUDA graphs = eager (float32, real model)": check_compiled,
          "int8, int4 kernels = dequantized product": check_int8_fused,
          "int8 KV cache within its bound": check_int8_kv,
          "tensor parallel (NCCL) N = 2 = N = 1": check_tensor_parallel_nccl,
          "CUDA-graph memory fits as budgeted": check_graph_memory,
          "SDPA reaches a fused backend": check_sdpa,
          "SDPA in bf16 within its rounding of float32": check_sdpa_bf16}


def run_checks(b, save=lambda results: None) -> tuple[dict, str]:
    """Every check in isolation (one that raises is a FAIL with its error), each verdict printed and
    saved (save(results)) as it ends: a run cut short keeps every verdict so far. (results, table)."""
    results = {}
    for i, (name, fn) in enumerate(CHECKS.items(), 1):
        print(f"bench: check [{i}/{len(CHECKS)}] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            verdict, detail = fn(b)
        except Exception as e:                       # noqa: BLE001 (a verdict, whatever went wrong)
            where = traceback.extract_tb(e.__traceback__)[-1]
            verdict, detail = FAIL, f"{type(e).__name__}: {e} (at {os.path.basename(where.filename)}:{where.lineno})"
        b.release()                                  # each engine freed before the next check builds its own
        results[name] = {"verdict": verdict, "detail": detail, "seconds": time.perf_counter() - t0}
        print(f"bench: check [{i}/{len(CHECKS)}] {verdict} in {results[name]['seconds']:.0f} s: {detail}",
              file=sys.stderr, flush=True)
        save(results)
    rows = [[name, r["verdict"], f"{r['seconds']:.0f}", r["detail"]] for name, r in results.items()]
    count = {v: sum(r["verdict"].startswith(v) for r in results.values()) for v in (PASS, FAIL, "skipped")}
    return results, (table(["path", "verdict", "seconds", "detail"], rows) +
                     f"\n\n{count[PASS]} pass, {count[FAIL]} FAIL, {count['skipped']} skipped. Paste this table, with "
                     "the lines above it, into any report about nanoinfer on this machine.")


def plan(s):
    """The time the check takes on one GPU (NCCL skipped): its engines, steps and compiles."""
    q = s.quality_path
    eager = s.options(q, dtype="float32", compile=False, max_num_seqs=4, pool_tokens=2048)
    comp = s.options(q, dtype="float32", compile=True, max_num_seqs=4, pool_tokens=2048)
    graph = s.options(q, dtype="float32", compile=True, max_num_seqs=8, pool_tokens=8 * (GRAPH_CONTEXT + 80))
    cfg, _ = model_config(q)
    shapes = len({(cfg.dim, cfg.n_heads * cfg.head_dim), (cfg.dim, cfg.n_kv_heads * cfg.head_dim),
                  (cfg.n_heads * cfg.head_dim, cfg.dim), (cfg.dim, cfg.ffn_dim), (cfg.ffn_dim, cfg.dim),
                  (cfg.dim, cfg.vocab_size)})
    check = lambda o: [prefill(o, 4 * 60, 60), decode(o, 16, 4, 100)]   # noqa: E731  (the check prompts)
    return [Phase([eager], check(eager), context=300), Phase([comp], check(comp), context=300),
            Phase([], [seconds(2 * shapes * INT8_COMPILE_S)]),
            Phase([eager], [prefill(eager, 512, 256)], context=600),
            Phase([graph], [prefill(graph, 8 * GRAPH_CONTEXT, GRAPH_CONTEXT / 2), decode(graph, 8, 8, GRAPH_CONTEXT)],
                  context=GRAPH_CONTEXT + 80),
            Phase([eager], check(eager), context=300)]
