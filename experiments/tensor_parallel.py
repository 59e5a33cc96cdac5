"""
tensor-parallel -- split every layer over N devices: 1/N of the bytes each, two all-reduces a layer.

Claim (lecture, parallel.py): column-parallel q/k/v/gate/up and row-parallel o/down need two
all-reduces per layer, 2 * layers * tokens * dim * bytes per step, for 1/N of the weights and of
the KV cache per device; the greedy tokens stay those of one device (exactly, in float32).
Baseline: N = 1, the same model through the same group code, in the same run. With fewer than
two GPUs the lesson is measured on the host CPU (gloo), on a small model (never a lecture-scale
one: each rank would hold a float32 copy); the lecture's arithmetic covers 8B and 70B on 1-8 GPUs.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import math
import os
import random

import torch

from cache import AttentionContext, BlockManager, kv_cache_bytes
from parallel import (NVLINK_H100_SXM, PCIE_GEN5_X16, TensorParallelError, TensorParallelGroup,
                      check_tensor_parallel, tensor_parallel_cost)
from quantize import decode_weight_bytes
from support.checkpoint import RANDOM_PREFIX

from experiments.common import agreement, exact, model_config, table
from experiments.plan import Phase, seconds

NAME = "tensor-parallel"
WORKLOAD = {"cpu": dict(sizes=[1, 2, 3], batch=8, context=128, steps=10),
            "cpu-quick": dict(sizes=[1, 2], batch=4, context=16, steps=3),
            "gpu": dict(sizes=[1, 2, 3], batch=8, context=128, steps=10),
            "gpu-quick": dict(sizes=[1, 2], batch=4, context=128, steps=3)}
CPU_MAX_PARAMS = 500e6        # on the host CPU: a model this small or random:smollm2-135m
ARITHMETIC_TOKENS, TP_GPU_BYTES = 64, 80e9    # the arithmetic: a decode step of 64 sequences; "fits" one H100
GROUP_S = 10.0                # the plan's allowance per N on the host CPU: start N - 1 processes, load, prefill,
#                               12 steps of 135M (assumed: a 2-core VM took 3 s for N = 1, 2 of a tiny model)


def where(b):
    """(device, model, dtype) of the measurement: N GPUs for N ranks, else the host CPU."""
    if b.device.type == "cuda" and torch.cuda.device_count() >= 2:      # pragma: no cover (2 GPUs)
        return b.device, b.path, b.torch_dtype
    path = b.quality_path if b.device.type == "cuda" else b.path
    if model_config(path)[1] > CPU_MAX_PARAMS:
        path = RANDOM_PREFIX + "smollm2-135m"
    return torch.device("cpu"), path, torch.float32


def tp_decode(b, group, batch: int, context: int, steps: int) -> dict:
    """Greedy decode of `batch` random prompts through the group's paged caches: a prefill and a warm-up
    step untimed, then `steps` timed steps with the collectives counted and timed (parallel.Collectives)."""
    bs, vocab = 16, group.full_config.vocab_size
    blocks = batch * math.ceil((context + steps + 2) / bs)
    group.allocate_cache(blocks, bs)
    bm, rng = BlockManager(blocks, bs, enable_prefix_caching=False), random.Random(0)
    seqs = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    fed = [0] * batch                                  # tokens of each sequence already in the cache
    for i, s in enumerate(seqs):
        bm.allocate(i, s)

    def step():                                        # every rank runs its slice on the same tokens
        for i, s in enumerate(seqs):
            bm.reserve(i, fed[i], len(s) - fed[i])
        work = [(i, s[fed[i]:], fed[i]) for i, s in enumerate(seqs)]
        last = [r - 1 for r in itertools.accumulate(len(w[1]) for w in work)]
        x, pos, ctx = AttentionContext.build(group.cache, bm, work, last, group.device)
        for i, token in enumerate(group.forward(x, pos, ctx).argmax(-1).tolist()):
            fed[i] = len(seqs[i])
            seqs[i].append(token)
    step(), step()
    comm = group.comm
    comm.reset()
    comm.timing = True
    try:
        t = b.timeit(step, steps, warmup=0)
    finally:
        comm.timing = False
    return {"step_ms": t * 1e3, "allreduce_ms": comm.seconds / steps * 1e3, "collectives_per_step": comm.calls / steps,
            "comm_bytes_per_step": comm.bytes / steps, "tokens": [s[context:] for s in seqs]}


def measured(b) -> dict:
    """Step time and communication at each N that divides the model and fits the devices."""
    w, (device, path, dtype) = b.sizes(WORKLOAD), where(b)
    cfg, _ = model_config(path)
    points, ref, threads = [], None, torch.get_num_threads()
    # On a CPU a rank is a "device" of a fixed number of cores, as a GPU is, whatever N: cores // (the
    # largest N) threads each (a step waits for its slowest rank; more threads than cores stall every step).
    rank_threads = max(1, (os.cpu_count() or 1) // max(w.sizes))
    for N in w.sizes:
        try:
            check_tensor_parallel(cfg, N, device.type)
        except ValueError as e:                    # heads, KV heads, FFN or vocabulary do not divide, or no GPUs
            points.append({"world_size": N, "skipped": str(e)})
            continue
        b.progress(f"tensor-parallel: N = {N} on {device.type}")
        if device.type == "cpu":
            torch.set_num_threads(rank_threads)
        try:
            with contextlib.redirect_stdout(io.StringIO()), \
                    TensorParallelGroup(b.note(path), N, device=device, dtype=dtype) as group:
                p = {"world_size": N, **tp_decode(b, group, w.batch, w.context, w.steps),
                     "weight_bytes_per_rank": decode_weight_bytes(group.model),
                     "kv_bytes_per_token_per_rank": kv_cache_bytes(group.config, dtype)}
        except TensorParallelError as e:           # e.g. a machine that cannot start worker processes
            if N == 1:
                raise
            points.append({"world_size": N, "skipped": f"the group failed: {e}"})
            continue
        finally:
            torch.set_num_threads(threads)
        tokens = p.pop("tokens")
        ref = tokens if ref is None else ref       # N = 1 comes first: every N must decode its tokens
        p["shared_tokens_with_n1"] = sum(agreement(t, r) for t, r in zip(tokens, ref))
        p["tokens_compared"] = sum(map(len, ref))
        if exact(dtype):                           # bf16: split sums round differently, tokens drift
            p["same_tokens_as_n1"] = tokens == ref
        points.append(p)
    return {"device": str(device), "model": str(path), "dtype": str(dtype)[6:],
            "rank0_threads": rank_threads if device.type == "cpu" else None, "batch": w.batch,
            "context": w.context, "steps": w.steps, "layers": cfg.n_layers, "dim": cfg.dim,
            "vocab_size": cfg.vocab_size, "points": points}


def arithmetic(tokens: int) -> list:
    """parallel.tensor_parallel_cost for Llama-3.1 8B and 70B (meta-device shapes) on 1-8 GPUs, bf16,
    one decode step of `tokens` sequences, over NVLink and over PCIe."""
    rows = []
    for name in ("llama-3.1-8b", "llama-3.1-70b"):
        cfg, _ = model_config(RANDOM_PREFIX + name)
        for N in (1, 2, 4, 8):
            nv = tensor_parallel_cost(cfg, N, tokens, torch.bfloat16, link_bytes_per_s=NVLINK_H100_SXM)
            pcie = tensor_parallel_cost(cfg, N, tokens, torch.bfloat16, link_bytes_per_s=PCIE_GEN5_X16)
            rest = TP_GPU_BYTES - nv["weight_bytes_per_rank"]
            rows.append({"model": name, **{k: nv[k] for k in (
                "world_size", "tokens", "weight_bytes_per_rank", "kv_bytes_per_token_per_rank", "allreduce_calls",
                "allreduce_bytes", "ring_bytes_per_rank", "weight_read_seconds")},
                "allreduce_seconds_nvlink": nv["allreduce_seconds"],
                "allreduce_seconds_pcie": pcie["allreduce_seconds"], "fits_80GB": rest > 0,
                "kv_tokens_in_rest_of_80GB": max(0, int(rest // nv["kv_bytes_per_token_per_rank"]))})
    return rows


def run(b):
    m, arith = measured(b), arithmetic(ARITHMETIC_TOKENS)
    fig = {"measured": m, "arithmetic": arith, "nvlink_bytes_per_s": NVLINK_H100_SXM, "pcie_bytes_per_s": PCIE_GEN5_X16}
    base = next(p["step_ms"] for p in m["points"] if p["world_size"] == 1)
    rows = [[p["world_size"], "skipped: " + p["skipped"]] + [""] * 7 if "skipped" in p else
            [p["world_size"], p["step_ms"], base / p["step_ms"], p["allreduce_ms"],
             f"{p['allreduce_ms'] / p['step_ms']:.0%}", p["collectives_per_step"],
             # the latency of one collective: on CPU with gloo it, not the bytes, sets the cost
             p["allreduce_ms"] / p["collectives_per_step"] * 1e3 if p["collectives_per_step"] else "",
             p["weight_bytes_per_rank"] / 1e6,
             p.get("same_tokens_as_n1", f"{p['shared_tokens_with_n1']}/{p['tokens_compared']}")] for p in m["points"]]
    arows = [[r["model"], r["world_size"], r["weight_bytes_per_rank"] / 1e9, "yes" if r["fits_80GB"] else "no",
              r["kv_bytes_per_token_per_rank"] / 1024, r["kv_tokens_in_rest_of_80GB"], r["allreduce_bytes"] / 1e6,
              r["allreduce_seconds_nvlink"] * 1e6, r["allreduce_seconds_pcie"] * 1e6, r["weight_read_seconds"] * 1e6]
             for r in arith]
    threads = f", {m['rank0_threads']} thread(s) per rank" if m["rank0_threads"] else ""
    return fig, (
        f"Measured on {m['device']}{threads} ({os.path.basename(m['model'])}, {m['dtype']}): greedy decode steps of "
        f"{m['batch']} sequences at a {m['context']}-token context through parallel.TensorParallelGroup (rank 0 plus "
        "N-1 worker processes; gloo on a CPU, NCCL on GPUs). Collectives per step: 2 all-reduces per layer, the "
        "embedding's, and the logits' all-gather.\n\n" +
        table(["N", "step (ms)", "speedup vs N=1", "collectives (ms/step)", "share of step", "collectives/step",
               "µs per collective", "weight MB/rank",
               "same tokens as N=1" if m["dtype"] == "float32" else "tokens shared with N=1 (to 1st divergence)"],
              rows) +
        f"\n\nThe arithmetic (parallel.tensor_parallel_cost) for one decode step of {ARITHMETIC_TOKENS} sequences in "
        "bf16: all-reduce payload = 2 x layers x batch x dim x 2 bytes; a ring moves 2 (N-1)/N of it through each "
        f"GPU's link (NVLink {NVLINK_H100_SXM / 1e9:.0f} GB/s, PCIe 5.0 x16 {PCIE_GEN5_X16 / 1e9:.0f} GB/s per "
        "direction), plus a latency per call (2 x layers calls per step) not counted here; beside it the step's "
        "weight read per GPU at H100 HBM3's 3.35 TB/s.\n\n" +
        table(["model", "GPUs", "weights/GPU (GB)", "fits 80 GB", "KV/token/GPU (KiB)", "KV tokens in the rest",
               "all-reduce/step (MB)", "NVLink (µs)", "PCIe (µs)", "weight read (µs)"], arows))


def plan(s):
    """One GPU: the measurement runs on the host CPU (no device memory), an allowance per N."""
    return [Phase([], [seconds(GROUP_S * len(s.sizes(WORKLOAD).sizes))])]
