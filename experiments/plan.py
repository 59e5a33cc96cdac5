"""
experiments/plan.py -- what a run will need, before it runs: device memory and time per experiment.

A run's Scale (below: GPU or CPU, --quick or not, the timing and quality models) picks one row of
every experiment's WORKLOAD. Each experiment declares the engines it builds as data (Scale.options:
model, dtype, seats, KV pool, compile; the same dict Bench.llm builds its engine from) and the work
it does on them (decode steps at a batch and context, prefill tokens, naive passes), as
`plan(scale) -> [Phase]`. From that alone, with no model built and no GPU (the weights are counted
on the meta device):

  peak memory = max over phases of  the engines alive together (weights + KV pool + compiled
                graphs' reserve) + the largest transient of the phase (an eager prefill's
                mask, scores and SDPA's float copy; the naive path's recompute; extras)
  time        = the work's steps x their roofline step time on the card, floored by what the
                host needs to launch an eager step, + a build and compile allowance per engine

The constants are measurements, each with its source below; the plan is a plan, not a promise:
`python bench.py` prints it first, then what each experiment took.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from cache import kv_cache_bytes
from model import load_model, model_flops_per_token, random_weights
from quantize import int8_kv_cache_bytes, quantize_model
from support.checkpoint import RANDOM_PREFIX
from support.checks import resolve_device_dtype

GiB = 2**30


@dataclass(frozen=True)
class Scale:
    """Where and how big a run is: the four rows of every experiment's WORKLOAD are
    "cpu", "cpu-quick" (the smoke run), "gpu" (the lecture's scale) and "gpu-quick"
    (the lecture's scale, fewer points). `path` times, `quality_path` (trained weights,
    where there are any) scores perplexity and speculative acceptance."""
    gpu: bool
    quick: bool
    path: str
    quality_path: str
    dtype_arg: str = "auto"                 # --dtype: "auto" lets each engine choose (int8: bf16 activations)
    device_arg: str | None = None           # --device when it names one ("cuda:1"); else "cuda" or "cpu"

    @property
    def device(self) -> str:
        return self.device_arg or ("cuda" if self.gpu else "cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The timing engine's dtype: "auto" is bf16 on a GPU, float32 on a CPU (support/checks.py)."""
        return resolve_device_dtype(self.device, self.dtype_arg, None)[1]

    @property
    def key(self) -> str:
        return ("gpu" if self.gpu else "cpu") + ("-quick" if self.quick else "")

    def sizes(self, workload: dict) -> SimpleNamespace:
        return SimpleNamespace(**workload[self.key])

    def options(self, path=None, **kw) -> dict:
        """An engine's options, every default resolved: the one place where the bench
        (Bench.llm builds from it) and the plan (memory() reads it) agree on what an engine holds.
        The run's standard engine (no kw): 64 seats, prefix caching, compiled on a GPU,
        a KV pool of STANDARD_POOL_TOKENS there (its batching experiment's 64 x 2k
        tokens), a fixed 1 GiB (128 MiB in the smoke run) on a CPU."""
        path = str(path or self.path)
        kw.setdefault("compile", self.gpu)
        kw.setdefault("max_num_seqs", 64)
        if "pool_tokens" in kw:                  # a pool for this many tokens of the model's own KV
            kw["kv_cache_bytes"] = pool_bytes(path, self.dtype, kw.pop("pool_tokens"))
        kw.setdefault("kv_cache_bytes", pool_bytes(path, self.dtype, STANDARD_POOL_TOKENS) if self.gpu else
                      CPU_POOL // (8 if self.quick else 1))
        return {"path": path, "device": self.device, "dtype": self.dtype_arg, **kw}


STANDARD_POOL_TOKENS = 64 * (2048 + 128)   # GPU: 64 sequences of 2k tokens + their timed steps (8B: 17 GiB)
CPU_POOL = 1 << 30


def model_config(path: str):
    """A model's config and parameter count, from the meta device (nothing allocated or read)."""
    return _model_config(str(path))


@functools.lru_cache(maxsize=None)
def _model_config(path: str):
    model, cfg = load_model(path, device="meta")
    return cfg, sum(p.numel() for p in model.parameters())   # a tied head is one parameter, counted once


def pool_bytes(path, dtype, tokens: int) -> int:
    """A KV pool holding `tokens` tokens of `path`'s model (the lecture's formula), +10% and 4096
    tokens for partly filled blocks."""
    cfg, _ = model_config(path)
    return int(1.1 * kv_cache_bytes(cfg, dtype, tokens)) + kv_cache_bytes(cfg, dtype, 4096)


@dataclass(frozen=True)
class Card:
    memory: float          # bytes an engine may use (the card's, less the CUDA context's ~1 GiB)
    bandwidth: float       # copy bandwidth, bytes read + written per second
    flops: float           # dense bf16 matmul FLOP/s
    source: str


# Measured on an H200 with torch 2.11 (2026-11-26): copy 4,249 GB/s, bf16 8192^3 matmul 750 TFLOP/s.
# An H100 SXM is the same chip with HBM3: bench.py measured 2,989 GB/s and 801 TFLOP/s on an H100
# 80GB HBM3 (2026-11-26; datasheet 3.35 TB/s), planned with the H200's matmul. L4 and A100 from their datasheets (300 GB/s, 121 TFLOP/s; 1.9 TB/s
# copy, 312 TFLOP/s).
CARDS = {"h100-80gb": Card(78 * GiB, 3.0e12, 750e12, "H100 SXM 80GB: 3.0 TB/s copy (measured), 750 TFLOP/s"),
         "h200": Card(139 * GiB, 4.249e12, 750e12, "H200 141GB: 4,249 GB/s copy, 750 TFLOP/s (measured)"),
         "l4-24gb": Card(22 * GiB, 300e9, 121e12, "L4 24GB: 300 GB/s, 121 TFLOP/s (datasheet)"),
         "a100-80gb": Card(78 * GiB, 1.9e12, 312e12, "A100 80GB: 1.9 TB/s copy, 312 TFLOP/s (datasheet)")}

# Time constants, from the H200 run of random:llama-3.1-8b in bf16 (LLM(compile=True, max_num_seqs=64,
# kv_cache_bytes=8 GiB), 2026-11-26):
COMPILE_S = 31.5          # compiling the block + recording its 96 CUDA graphs (8 batches x 12 widths);
INT8_COMPILE_S = 47.5     # the int8 engine's compile with its Triton kernel's autotuning (H100, measured);
#                           the other formats are inductor's alone, charged COMPILE_S.
#                           Both are charged to every compiled engine whatever its size (inductor's work
#                           grows with the kernels and graphs, not the weights): an upper bound for small
#                           models, and for a second engine of the same shapes (dynamo's cache may hit).
BUILD_S_PER_GB = 5.5 / 16.06  # the rest of the 37 s: making 16 GB of weights and the pool (at least 1 s)
WEIGHT_FRACTION = 3.78 / 6.09  # the batch-1 graph replay took 6.09 ms against 3.78 ms of weight bytes
HOST_S = 0.67e-3          # the compiled step's host work beside its replay (6.76 - 6.09 ms)
ATTENTION_FRACTION = 0.052   # batch 1 -> 64 at a 512 context added 19.3 ms for 4.2 GB more KV: 219 GB/s
EAGER_LAYER_S = 29.3e-3 / 32  # the eager step at batch 1: 29.3 ms on the H100 (24.2 on the H200), the host
#                               launching 32 layers' kernels
PREFILL_FRACTION = 0.5    # of the matmul roof, for prefill chunks (assumed: the H100's 512-token prefill,
#                           34.7 ms, sat on the eager floor above, not on the roof)


@dataclass
class Phase:
    """Engines alive together (Scale.options dicts; "share": False for one the bench does not
    keep), the work done on them (Work), the longest sequence (its transients) and extra bytes."""
    engines: list
    work: list = field(default_factory=list)
    context: int = 0
    extra: int = 0


@dataclass(frozen=True)
class Work:
    kind: str              # "decode" | "prefill" | "naive" | "seconds"
    engine: dict | None
    count: float           # steps, tokens, passes or seconds
    batch: int = 1
    context: int = 0
    query: int = 1         # tokens per sequence per step (a verify pass: k + 1)


def decode(o, steps, batch, context, query=1):
    return Work("decode", o, steps, batch, context, query)


def prefill(o, tokens, context):
    return Work("prefill", o, tokens, 1, context)


def naive(o, runs, first, last):
    """`runs` x model.generate: dense passes over sequences of first, first + 1, ..., last - 1 tokens."""
    return Work("naive", o, runs, first, last)


def seconds(s):
    return Work("seconds", None, s)


def weight_bytes(o) -> int:
    """Bytes of an engine's weights, counted on the meta device (int8: quantized there too)."""
    return _weight_bytes(o["path"], _dtype(o), o.get("quantization"))


def _dtype(o) -> torch.dtype:
    return resolve_device_dtype(o["device"], o["dtype"], o.get("quantization"))[1]


_WEIGHTS: dict = {}


def _weight_bytes(path, dtype, quantization) -> int:
    key = (path, dtype, quantization)
    if key not in _WEIGHTS:
        if not quantization:
            _WEIGHTS[key] = _meta_bytes(load_model(path, device="meta", dtype=dtype)[0])
        else:   # quantized on the meta device, 1 and 2 groups of layers deep (every group of cla_share
            # layers has one shape; one layer without CLA): fast, exact
            cfg = load_model(path, device="meta", dtype=dtype)[1]
            S = cfg.cla_share
            one, two = (_meta_bytes(quantize_model(_meta_model(cfg, n, dtype), "int4" if quantization == "awq"
                                                   else quantization)) for n in (S, 2 * S))   # awq: int4's
            _WEIGHTS[key] = one + (-(-cfg.n_layers // S) - 1) * (two - one)
    return _WEIGHTS[key]


def _meta_model(cfg, n_layers: int, dtype):
    return random_weights(dataclasses.replace(cfg, n_layers=n_layers), device="meta", dtype=dtype)[0]


def _meta_bytes(model) -> int:
    unique = {id(t): t for t in list(model.parameters()) + list(model.buffers())}   # a tied head once
    return sum(t.nbytes for t in unique.values())


def memory(o, context: int) -> dict:
    """The device bytes of one engine, by part, with sequences of up to `context` tokens."""
    cfg, _ = model_config(o["path"])
    dtype, dt = _dtype(o), _dtype(o).itemsize
    per_token = int8_kv_cache_bytes(cfg) if o.get("kv_cache_dtype") == "int8" else kv_cache_bytes(cfg, dtype)
    bs, seats = o.get("block_size", 16), o["max_num_seqs"]
    blocks = int(o["kv_cache_bytes"] // (per_token * bs))
    G, n_kv, d, V = cfg.n_heads // cfg.n_kv_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    if cfg.kv_lora_rank:            # MLA, absorbed: H queries and one KV head of r + R values each
        d = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    acts = lambda rows: rows * (3 * cfg.ffn_dim + 3 * cfg.dim + (cfg.n_heads + 2 * n_kv) * d) * dt  # noqa: E731
    # An eager prefill chunk of C tokens at T keys (kernels.grouped_attention): the visible mask
    # [C, T] and its [C*G, T] copy per query head group, SDPA's float copy of it in the dtype, the
    # [n_kv, C*G, T] float32 scores a math fallback writes, one layer's gathered K and V, the
    # chunk's activations, the sampled rows' logits.
    C, T = min(o.get("max_num_batched_tokens", 2048), context), context
    eager = C * G * T * (2 + dt + 4 * n_kv) + T * 2 * n_kv * d * dt + acts(C) + seats * V * (dt + 4)
    # An eager decode of every seat: each sequence's K and V of one layer, gathered.
    eager = max(eager, seats * T * 2 * n_kv * d * dt + acts(seats) + seats * V * (dt + 4))
    graphs = 0
    if o.get("compile"):
        # The static logits [rows, V] in float32 and the graphs' pool: the largest bucket's activations,
        # its head's output, and (an upper bound: inductor fuses the softmax into its reductions) one
        # float32 score per query head per key of the widest table.
        rows = seats * (o.get("num_speculative_tokens", 0) + 1 if o.get("speculative") else 1)
        width = 2 ** math.ceil(math.log2(max(2, -(-min(cfg.max_seq_len, blocks * bs) // bs)))) * bs
        graphs = rows * V * 4 + acts(rows) + rows * V * (dt + 4) + rows * cfg.n_heads * width * 4
    weights = weight_bytes(o)
    built = weights if not o.get("quantization") else max(weights, _weight_bytes(o["path"], dtype, None))
    return {"weights": weights, "pool": (blocks + 1) * bs * per_token, "graphs": graphs, "transient": eager,
            "build_peak": built}


def naive_bytes(o, T: int) -> int:
    """The dense path over T tokens (model.dense_causal_attention, then every row's logits): float32
    q, k, v; the [H, T, T] float32 scores, masked and softmaxed (three alive at once); the causal
    mask; logits [T, V] in the dtype and in float32; one layer's MLP activations."""
    cfg, _ = model_config(o["path"])
    dt = _dtype(o).itemsize
    return (T * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * 4 + 12 * cfg.n_heads * T * T + T * T
            + T * cfg.vocab_size * (dt + 4) + 3 * T * cfg.ffn_dim * dt)


def engine_bytes(o, context: int) -> tuple[int, int]:
    """(bytes an engine holds while used or built, whichever is larger; its largest transient)."""
    p = memory(o, max(1, context))
    return max(p["weights"] + p["pool"] + p["graphs"], p["build_peak"]), p["transient"]


def work_seconds(card: Card, w: Work) -> float:
    """A piece of work at the card's roofline, floored by the host's launches where steps run eagerly."""
    if w.kind == "seconds":
        return w.count
    o, (cfg, _) = w.engine, model_config(w.engine["path"])
    W, per_token = weight_bytes(o), kv_cache_bytes(cfg, _dtype(o))
    flops = lambda tokens, ctx: tokens * model_flops_per_token(cfg, ctx) / (card.flops * PREFILL_FRACTION)  # noqa
    eager = cfg.n_layers * EAGER_LAYER_S
    if w.kind == "decode":
        t = W / (card.bandwidth * WEIGHT_FRACTION) + w.batch * w.context * per_token / (
            card.bandwidth * ATTENTION_FRACTION)
        t = max(t, flops(w.batch * w.query, w.context))
        return w.count * (t + HOST_S if o.get("compile") else max(t, eager))
    if w.kind == "prefill":       # chunks of the step's token budget, each at least an eager step's launches
        chunks = math.ceil(w.count / o.get("max_num_batched_tokens", 2048))
        return flops(w.count, w.context) + chunks * max(eager, W / card.bandwidth)
    # naive: each pass over t tokens computes t tokens' FLOPs (context t / 2 on average) or launches a step
    return w.count * sum(max(eager, flops(t, t / 2) + W / card.bandwidth) for t in range(w.batch, w.context))


def build_seconds(o) -> float:
    """An engine's start-up: its weights and pool made on the device, its compile if any."""
    t = max(1.0, weight_bytes(o) / 1e9 * BUILD_S_PER_GB)
    if o.get("compile"):
        t += INT8_COMPILE_S if o.get("quantization") == "int8" else COMPILE_S   # int8: Triton autotunes
    return t


def plan_run(modules: dict, scale: Scale, card: Card | None) -> list[dict]:
    """[{name, peak, seconds, built}] for the experiments in run order, the bench's engine sharing
    simulated (Bench.llm): a shared engine equal to the one kept is not built again; a different one
    frees it first; a private one ("share": False) is built beside it, so the kept engine counts in
    that phase's memory. card=None: memory only."""
    rows, kept = [], None
    for name, module in modules.items():
        built, secs, peak = [], 0.0, 0
        for ph in module.plan(scale):
            alive = []
            for o in ph.engines:
                key = {k: v for k, v in o.items() if k != "share"}
                if key != kept and key not in built:
                    built.append(key)
                    secs += build_seconds(o) if card else 0.0
                if o.get("share", True):
                    kept = key                     # the old kept engine is freed first
                alive += [key] if key not in alive else []
            alive += [kept] if kept is not None and kept not in alive else []
            held = [engine_bytes(o, ph.context) for o in alive]
            peak = max(peak, sum(h for h, _ in held) + max([t for _, t in held], default=0) + ph.extra)
            secs += sum(work_seconds(card, w) for w in ph.work) if card else 0.0
        rows.append({"name": name, "peak": peak, "seconds": secs, "built": len(built)})
    return rows


LECTURE_PRESETS = ("llama-3.1-70b", "llama-3.1-8b", "llama-3.2-3b", "llama-3.2-1b", "smollm2-135m")


def pick_timing_model(modules: dict, scale: Scale, free_bytes: float) -> tuple[str | None, str]:
    """The largest published preset whose planned run fits in `free_bytes`, every experiment's
    peak at most 90% of it (the allocator's fragmentation, the CUDA context's growth): (path, why)."""
    for name in LECTURE_PRESETS:
        s = Scale(scale.gpu, scale.quick, RANDOM_PREFIX + name, scale.quality_path, scale.dtype_arg, scale.device_arg)
        peak = max(r["peak"] for r in plan_run(modules, s, None))
        if peak <= 0.9 * free_bytes:
            return s.path, f"{name}: planned peak {peak / 1e9:.1f} GB of {free_bytes / 1e9:.0f} GB"
    return None, f"no preset's run fits in {free_bytes / 1e9:.0f} GB"


def describe(plans: dict, this: str, card_name: str, card: Card, gpu: bool) -> str:
    """The plan of this run (plans[this] = (rows, scale, why)) as a table, and on a GPU the totals of the
    full run, --quick and --check (a CPU run gets its peak memory only: the time constants are a GPU's)."""
    rows, scale, why = plans[this]
    model, why = (scale.quality_path, "the default model's shapes") if this == "check" else (scale.path, why)
    head = ["experiment", "peak device memory (GB)", "engines built"] + ["planned time (s)"] * gpu
    body = "\n".join(f"| {r['name']} | {r['peak'] / 1e9:.1f} | {r['built']} |" + (f" {r['seconds']:.0f} |" * gpu)
                     for r in rows)
    text = (f"Plan on {card_name}{f' ({card.source})' if gpu else ''}; model {model} ({why}):\n\n| " +
            " | ".join(head) + " |\n|" + "---|" * len(head) + "\n" + body)
    if not gpu:
        return text + "\n\n(Time is planned for GPUs: python bench.py --plan --gpu NAME.)"
    minutes = {m: sum(r["seconds"] for r in rows) / 60 for m, (rows, _, _) in plans.items()}
    return text + (f"\n\nPlanned on {card_name}: full run {minutes['full']:.1f} min, --quick {minutes['quick']:.1f} "
                   f"min, --check {minutes['check']:.1f} min (experiments/plan.py: counted steps x their roofline "
                   "step time, floored by the host's launches, + build and compile allowances).")


def card_for(device) -> tuple[str, Card]:  # pragma: no cover (CUDA)
    """This GPU as a Card: its name, the memory free now, and its speeds from CARDS by name (another
    GPU: an H100's, said so)."""
    name, free = torch.cuda.get_device_name(device), torch.cuda.mem_get_info(device)[0]
    key = next((k for k in CARDS if k.split("-")[0].upper() in name.upper()), None)
    c = CARDS[key or "h100-80gb"]
    return name, Card(free, c.bandwidth, c.flops, (c.source if key else "an H100's speeds assumed") +
                      f"; {free / 1e9:.0f} GB free")
