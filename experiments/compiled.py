"""
compile -- the eager step is bound by the host; the compiled step by its bytes.

Claim (lecture, kernels.py): an eager decode step launches hundreds of small kernels, a few
microseconds of Python and CUDA launch each: on a GPU the device idles and the step costs the
host's time whatever the batch. torch.compile fuses the block's kernels and CUDA graphs replay
the whole step in one launch, so the compiled step approaches its roofline; the tokens stay the
same (exactly, in float32). Baseline: the eager engine on the same weights, in the same run
(the one place a run times it on a GPU: every other experiment times the compiled engine). On a
CPU compiling gains little: there the lesson is the compile time and the exactness.
"""
from __future__ import annotations

import torch

from graphs import dynamic, layer_cache, size_oblivious
from kernels import batched_paged_attention, paged_attention_in_place
from quantize import decode_weight_bytes
from sampler import SamplingParams
from support.timing import device_sync, median_seconds

from experiments.common import (LogitTap, agreement, decode_step_seconds, eval_text, exact, float32_gaps,
                                prefix_caching, table)
from experiments.plan import Phase, decode, prefill

NAME = "compile"
# The smoke run compiles batch 1 only: each compiled graph costs ~20 s cold on a 2-core CPU
# (batch 1 and batch > 1 are two graphs there, see graphs.py). On a GPU: the standard engine.
WORKLOAD = {"cpu": dict(batches=[1, 16], context=128, steps=10, check=32, engine=dict(max_num_seqs=16)),
            "cpu-quick": dict(batches=[1], context=16, steps=3, check=8, engine=dict(max_num_seqs=1)),
            "gpu": dict(batches=[1, 16], context=512, steps=10, check=32, engine={}),
            "gpu-quick": dict(batches=[1, 16], context=512, steps=5, check=16, engine={})}


_compiled_attention = None


def attention_bandwidth(cache, n_heads: int, batch: int, context: int, repeats: int = 5) -> dict:
    """Achieved bandwidth of one layer's decode attention, kernels.py's two: the compiled in-place
    attention and the eager gather + SDPA (batched_paged_attention). `batch` sequences of `context`
    tokens over distinct random blocks of the pool (cycling if it is too small), one query each.
    Bytes = the K and V bytes those tokens occupy (an int8 cache's scales included): what an attention
    that reads every byte once must read."""
    global _compiled_attention
    if _compiled_attention is None:
        _compiled_attention = torch.compile(paged_attention_in_place, fullgraph=True)
    device, width, gen = cache.k.device, -(-context // cache.block_size), torch.Generator().manual_seed(0)
    blocks = torch.randperm(cache.num_blocks, generator=gen).repeat(-(-batch * width // cache.num_blocks))
    tables = blocks[:batch * width].view(batch, width).to(device)
    q = torch.randn(batch, 1, n_heads, cache.k.shape[-1], generator=gen).to(device, cache.dtype)
    q_pos = torch.full((batch, 1), context - 1, device=device)
    dynamic(q, 0), dynamic(tables, 0, 1), dynamic(q_pos, 0)
    sync, one = device_sync(device), layer_cache(cache, 0)          # as the compiled step reads a layer
    with torch.inference_mode(), size_oblivious():
        t_fused = median_seconds(lambda: _compiled_attention(q, one, 0, tables, q_pos), repeats, sync=sync)
        t_gather = median_seconds(lambda: batched_paged_attention(q, cache, 0, tables, q_pos[:, 0] + 1), repeats,
                                  sync=sync)
    nbytes = batch * context * cache.bytes_per_token // cache.k.shape[0]     # one layer's share
    return {"bytes": nbytes, "in_place_s": t_fused, "in_place_GBps": nbytes / t_fused / 1e9,
            "gather_s": t_gather, "gather_GBps": nbytes / t_gather / 1e9}


def compare(comp, eager, prompt, params) -> tuple[dict, str]:
    """The compiled engine's greedy tokens against the eager engine's: equal in float32; in bf16
    shared up to the first divergence, and each path's largest |logit - float32 logit|."""
    runs = []
    for llm in (eager, comp):
        with LogitTap(llm) as tap, prefix_caching(llm, False):
            out = llm.generate([prompt], params)[0]
        runs.append((out, tap.rows(out)))
    (ref, ref_rows), (out, rows) = runs
    if exact(comp.dtype):
        same = out.token_ids == ref.token_ids
        return {"same_tokens": same}, f"Greedy tokens of the compiled engine equal the eager engine's: {same}."
    gaps = float32_gaps(eager.model, [(prompt + ref.token_ids, ref_rows), (prompt + out.token_ids, rows)])
    fig = {"shared_tokens": agreement(out.token_ids, ref.token_ids), "tokens_compared": len(ref.token_ids),
           "max_logit_diff_vs_float32": {"eager": gaps[0], "compiled": gaps[1]}}
    return fig, (f"{str(comp.dtype)[6:]}: the compiled engine's greedy tokens follow the eager engine's for "
                 f"{fig['shared_tokens']}/{len(ref.token_ids)} tokens (fused kernels round differently); largest "
                 f"|logit - float32 logit| on their own tokens: eager {gaps[0]:.3g}, compiled {gaps[1]:.3g}.")


def eager_options(s, w) -> dict:
    """The baseline's engine: eager, beside the compiled one, a pool for its own sequences only."""
    return s.options(compile=False, share=False, max_num_seqs=max(w.batches),
                     pool_tokens=max(w.batches) * (w.context + w.steps + w.check + 80))


def run(b):
    w = b.sizes(WORKLOAD)
    # The compiled engine first (on a GPU the run's shared one: built once, ~40 s at 8B); the eager
    # engine beside it, on the same weights.
    b.progress("compile: compiling (warm-up of every bucket)")
    comp = b.llm(compile=True, **w.engine)
    b.progress("compile: compiled")
    c = {B: decode_step_seconds(b, comp, B, w.context, w.steps) for B in w.batches}
    # Split the gain in two: the same engine with its decoder switched off runs eagerly on the
    # re-laid-out weights, isolating the layout from compilation.
    decoder, comp.decoder = comp.decoder, None
    try:
        l1 = decode_step_seconds(b, comp, 1, w.context, w.steps)
    finally:
        comp.decoder = decoder
    eager = b.llm(**eager_options(b.scale, w))
    b.progress("compile: eager")
    e = {B: decode_step_seconds(b, eager, B, w.context, w.steps) for B in w.batches}
    prompt = eager.tokenizer.encode(eval_text())[:w.context]
    compared, said = compare(comp, eager, prompt, SamplingParams(max_tokens=w.check, ignore_eos=True))
    W = decode_weight_bytes(comp.model)        # the batch-1 roofline, as in the roofline experiment
    bound = (W + comp.cache.bytes_per_token * w.context) / b.bandwidth()
    fig = {"compile_seconds": comp.compile_seconds, "weight_layout": comp.weight_layout, "batches": w.batches,
           "context": w.context, "weight_bytes": W, "eager_layout_ms_batch1": l1 * 1e3,
           "roofline_ms_batch1": bound * 1e3, "compiled_fraction_of_roofline": bound / c[1],
           "eager_fraction_of_roofline": bound / e[1], "dtype": str(comp.dtype)[6:], **compared}
    for B in w.batches:
        fig.update({f"eager_ms_batch{B}": e[B] * 1e3, f"compiled_ms_batch{B}": c[B] * 1e3,
                    f"speedup_batch{B}": e[B] / c[B]})
    rows = [["eager"] + [e[B] * 1e3 for B in w.batches],
            [f"eager, {comp.weight_layout} weight layout", l1 * 1e3] + [""] * (len(w.batches) - 1),
            ["compiled (+ layout)"] + [c[B] * 1e3 for B in w.batches], ["speedup"] + [e[B] / c[B] for B in w.batches]]
    text = (table(["decode step"] + [f"batch {B} (ms)" for B in w.batches], rows) +
            f"\n\nWeight layout chosen by measurement: {comp.weight_layout}. Compiling every bucket took "
            f"{comp.compile_seconds:.1f} s. Batch 1 roofline {bound * 1e3:.2f} ms: the compiled step runs at "
            f"{bound / c[1]:.0%} of it, the eager one at {bound / e[1]:.0%}. " + said)
    return fig, text


def plan(s):
    w = s.sizes(WORKLOAD)
    comp, eager = s.options(compile=True, **w.engine), eager_options(s, w)
    steps = lambda o: [decode(o, w.steps + 3, B, w.context) for B in w.batches] + [  # noqa: E731
        decode(o, w.check, 1, w.context), prefill(o, (len(w.batches) + 1) * w.context, w.context / 2)]
    return [Phase([comp], steps(comp) + [decode(s.options(compile=False, **w.engine), w.steps + 3, 1, w.context)],
                  context=w.context + w.check + 80),
            Phase([comp, eager], steps(eager), context=w.context + w.check + 80)]
