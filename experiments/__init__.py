"""
experiments/ -- bench.py's experiments, one file each, in the order a run takes them.

Every file opens with the lecture's claim it checks and the baseline it measures in the
same run, then its WORKLOAD (one row per scale: "cpu", "cpu-quick", "gpu", "gpu-quick"),
then `run(b) -> (figures, table)`, `plan(scale) -> [Phase]` (experiments/plan.py: the
memory and time it needs, computed without running) and, where a picture says more than
the table, `plot(results) -> Figure`, drawn from the results dict alone.

  overhead              the engine's step next to the bare forward pass
  roofline              bandwidth and matmul roofs; decode steps and a prefill under them
  kv-cache              naive generation (recompute everything) vs the KV cache
  batching              decode step time and tokens/s from batch 1 up: the knee
  continuous-vs-static  a heterogeneous workload, static groups vs continuous batching
  prefix                a long shared system prompt, prefix caching off vs on
  structured            half the batch under a JSON schema (grammar masks) vs none: tokens/s, validity
  speculative           n-gram (or --draft) drafts at k = 1..8: acceptance, speedup, prediction
  quantization          float, fp8, int8, LLM.int8(), int4, AWQ (and int8 KV): bytes, tokens/s, perplexity
  compile               the eager step (host-bound on a GPU) vs the compiled one, and the compile time
  peer                  Hugging Face transformers' generate on the same workload and weights
  serving               users over HTTP at rising Poisson rates: throughput, TTFT, TPOT, the knee
  tensor-parallel       decode split over N processes, and the lecture's arithmetic for 8B and 70B
  kv-compression        MHA vs GQA vs MQA bytes per token and batch per budget; a sliding window
  pruning               prune.py: 0.7x the parameters by calibration importance, distilled; speed, perplexity

Shared helpers: common.py. The plan: plan.py. The lecture's configurator (bench.py --configure,
no run): configure.py. The GPU self-check (--check): check.py. The
command line: cli.py.
"""
import os

from experiments import (batching, compiled, continuous_vs_static, kv_cache, kv_compression, overhead, peer,
                         prefix, pruning, quantization, roofline, serving, speculative_decoding,
                         structured, tensor_parallel)

EXPERIMENTS = {m.NAME: m for m in (overhead, roofline, kv_cache, batching, continuous_vs_static, prefix,
                                   structured, speculative_decoding, quantization, compiled, peer, serving, tensor_parallel,
                                   kv_compression, pruning)}
PLOTS = {name: m.plot for name, m in EXPERIMENTS.items() if hasattr(m, "plot")}


def write_plot(name: str, r: dict, folder: str) -> str | None:
    """Draw experiment `name`'s picture from its results into folder/name.png; its path (None: no picture)."""
    if name not in PLOTS or "error" in r or "skipped" in r:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.png")
    PLOTS[name](r).savefig(path, dpi=110)
    return path
