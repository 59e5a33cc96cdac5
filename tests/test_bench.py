"""Assignment: bench.py -- every lesson measured against its baseline.

To pass, `python bench.py --quick --json PATH` must run every experiment on a
tiny model and write the figures the experiments promise. The tests check
what must hold whatever the machine's speed (speed itself is never asserted):
each bound equals the lecture's formula over the model's own shapes, each
count equals the workload's, each exactness check holds (same tokens with
and without the KV cache, speculation, compilation, tensor parallelism),
every served request completes and the pool is free afterwards, and --json
merges into a results file but never overwrites anything else.
"""
import argparse
import json
import math
import os
import shutil
import types

import pytest
import torch
from conftest import save_checkpoint, tiny_model

import bench
from bench import eval_text, perplexity
from model import default_model_path
from tokenizer import Tokenizer

# The results fixture runs every experiment through the whole engine.
pytestmark = pytest.mark.needs("engine", "model", "sampler", "ngram-drafter", "int8", "paged-attention", "roofline")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One quick run of every experiment (the slow part of this file), shared by the tests."""
    d = tmp_path_factory.mktemp("bench")
    # dim divisible by the heads, so that transformers (if installed) can load it for the peer run;
    # 6 heads and 2 KV heads split 2 ways for the tensor-parallel run
    model = tiny_model(seed=0, vocab_size=49152, max_seq_len=2048, dim=96)
    path = save_checkpoint(model, d / "model")
    out = d / "results.json"
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(d / "inductor")      # compile from scratch, as CI does
    try:
        bench.main(["--quick", "--model", str(path), "--json", str(out)])
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
    with open(out) as f:
        return types.SimpleNamespace(results=json.load(f), path=str(path), json=out, model=model, cfg=model.config)


@pytest.fixture(scope="module")
def results(run):
    return run.results


# -- the lecture's formulas, written out here from the model's shapes ------------------------------

def linear_shapes(c):
    """(out, in) of every linear layer of a Llama, the LM head included."""
    per_layer = [(c.n_heads * c.head_dim, c.dim), (c.n_kv_heads * c.head_dim, c.dim), (c.n_kv_heads * c.head_dim, c.dim),
                 (c.dim, c.n_heads * c.head_dim), (c.ffn_dim, c.dim), (c.ffn_dim, c.dim), (c.dim, c.ffn_dim)]
    return per_layer * c.n_layers + [(c.vocab_size, c.dim)]


def norm_values(c):
    return c.n_layers * 2 * c.dim + c.dim


def weight_bytes(c, bytes_per_value):
    """Bytes a decode step reads: every linear layer (the tied head is the embedding table, read once) and
    norm; the embedding lookup itself reads only a few rows, so the table is not counted twice."""
    return (sum(o * i for o, i in linear_shapes(c)) + norm_values(c)) * bytes_per_value


def kv_bytes_per_token(c, bytes_per_value, world_size=1):
    return 2 * c.n_layers * (c.n_kv_heads // world_size) * c.head_dim * bytes_per_value


def flops_per_token(c, context):
    """2 FLOPs per weight of every matmul, plus QK^T and PV (2 H d each) over the context."""
    return sum(2 * o * i for o, i in linear_shapes(c)) + c.n_layers * 4 * c.n_heads * c.head_dim * context


def quick_workload(vocab, seed=0):
    """bench.workload as the smoke run draws it."""
    return bench.workload(types.SimpleNamespace(q=lambda full, quick, gpu=None: quick), vocab, seed)


# -- every experiment ---------------------------------------------------------------------------------

def test_meta_and_every_experiment_present(run, results):
    assert set(bench.EXPERIMENTS) <= set(results), f"missing: {set(bench.EXPERIMENTS) - set(results)}"
    meta = results["meta"]
    assert meta["device"] and meta["torch"] == torch.__version__ and meta["date"] and meta["quick"] is True
    # --model sets both models; every figure names the weights it came from
    assert meta["timing_model"] == meta["quality_model"] == run.path
    for name in bench.EXPERIMENTS:
        if "skipped" not in results[name]:
            assert results[name]["models"].get(run.path) == "checkpoint weights", (name, results[name]["models"])
    assert results["overhead"]["models"][bench.TINY_MODEL] == "random weights, made-up shapes"


@pytest.mark.parametrize("shape", ["gqa", "smollm2-135m", "llama-3.1-8b"])
@pytest.mark.assignment("roofline")
def test_flops_per_token_equals_the_sum_over_the_matmuls(shape):
    """model_flops_per_token against the formula written out here from every
    linear layer's (out, in) and attention's 4 H d per cached token, for
    shapes whose heads, KV heads, FFN and vocabulary all differ (so each term
    is seen), at several context lengths."""
    from conftest import tiny_config
    from model import ModelConfig
    from support.checkpoint import PRESETS
    cfg = tiny_config(dim=96, n_heads=6, n_kv_heads=2, head_dim=16, ffn_dim=160, vocab_size=1000) \
        if shape == "gqa" else ModelConfig.from_hf(PRESETS[shape])
    for context in (0, 1, 37, 4096):
        assert bench.model_flops_per_token(cfg, context) == flops_per_token(cfg, context), \
            f"{shape}, context {context}: {bench.model_flops_per_token(cfg, context)} FLOPs, " \
            f"expected {flops_per_token(cfg, context)}"


@pytest.mark.assignment("roofline")
def test_roofline(run, results):
    r, c = results["roofline"], run.cfg
    ctx, bw, flops = r["context"], r["bandwidth_GBps"] * 1e9, r["matmul_TFLOPs"] * 1e12
    W, kv = weight_bytes(c, 4), kv_bytes_per_token(c, 4)
    assert r["weight_bytes"] == W, "weight bytes per step: every linear and norm of the model, in float32"
    assert r["kv_bytes_per_token"] == kv == 2 * 2 * 2 * 16 * 4
    assert r["flops_per_token"] == flops_per_token(c, ctx)
    # decode: read every weight and the context's KV once; prefill: the FLOPs of ctx tokens (or the weight read)
    assert r["decode_bound_ms"] == pytest.approx((W + kv * ctx) / bw * 1e3)
    assert r["prefill_bound_ms"] == pytest.approx(max(flops_per_token(c, ctx) * ctx / flops, W / bw) * 1e3)
    for p in r["intensity"]:
        B = p["batch"]
        assert p["flops_per_byte"] == pytest.approx(flops_per_token(c, ctx) * B / (W + kv * ctx * B))
        assert p["bound_by"] == ("memory" if p["flops_per_byte"] <= flops / bw else "compute")
    assert [p["batch"] for p in r["intensity"]] == [1, 4, 16, 64, 256]


def test_kv_cache(results):
    r = results["kv-cache"]
    assert [p["tokens"] for p in r["lengths"]] == [8, 16]
    for p in r["lengths"]:
        assert p["naive_tokens"] == p["cached_tokens"] == p["tokens"]
        assert p["same_tokens"], "the KV cache changed the greedy tokens"


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


def test_continuous_vs_static(results):
    r = results["continuous-vs-static"]
    prompts, lengths = quick_workload(49152)
    assert r["requests"] == len(prompts) == 8 and r["batch"] == 4
    for mode in ("static", "continuous"):   # ignore_eos: every request gets exactly the tokens it asked for
        assert r[mode]["requests"] == len(prompts) and r[mode]["output_tokens"] == sum(lengths), mode
        assert r[mode]["tokens_per_s"] == pytest.approx(sum(lengths) / r[mode]["seconds"])


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


def test_speculative(results):
    runs = results["speculative"]["runs"]
    assert [(r["workload"], r["k"]) for r in runs] == [(w, k) for w in ("copy-heavy", "open-ended") for k in (1, 4)]
    for r in runs:
        assert r["same_tokens"], "greedy speculation changed the tokens"
        assert 0 <= r["alpha"] <= 1
        # a verify pass emits the accepted drafts plus one token of its own: between 1 and k + 1
        assert 1 <= r["tokens_per_pass"] <= r["k"] + 1 and r["tokens"] <= 16


def test_quantization(run, results):
    c = run.cfg
    cfgs = {x["name"]: x for x in results["quantization"]["configs"]}
    assert list(cfgs) == ["float", "bfloat16", "int8 weights", "int8 weights + int8 KV"]
    assert cfgs["float"]["weight_bytes"] == weight_bytes(c, 4)
    assert cfgs["bfloat16"]["weight_bytes"] == weight_bytes(c, 2)
    # int8: one byte per weight plus a bf16 scale per output row; norms stay bf16; the tied head
    # becomes an int8 copy (the float table stays for the lookup, which reads a few rows)
    int8 = sum(o * i + 2 * o for o, i in linear_shapes(c)) + 2 * norm_values(c)
    for name in ("int8 weights", "int8 weights + int8 KV"):
        assert cfgs[name]["weight_bytes"] == int8
    assert 0.25 < int8 / cfgs["float"]["weight_bytes"] < 0.26, "int8 is ~1/4 of float32, plus the scales"
    assert cfgs["float"]["kv_bytes_per_token"] == kv_bytes_per_token(c, 4)
    assert cfgs["int8 weights"]["kv_bytes_per_token"] == kv_bytes_per_token(c, 2)
    assert cfgs["int8 weights + int8 KV"]["kv_bytes_per_token"] == 2 * c.n_layers * c.n_kv_heads * (c.head_dim + 4)
    # the paged float32 perplexity equals the dense reference on the same tokens
    ids = Tokenizer.from_pretrained(run.path).encode(eval_text())[:128]
    assert cfgs["float"]["perplexity"] == pytest.approx(perplexity(run.model, ids), rel=1e-4)


def test_compile(run, results):
    r = results["compile"]
    assert r["same_tokens"], "the compiled decode step changed the greedy tokens (float32)"
    assert r["batches"] == [1] and r["compile_seconds"] > 0
    assert r["weight_bytes"] == weight_bytes(run.cfg, 4), "a weight layout moves bytes, it never adds any"
    bw = results["roofline"]["bandwidth_GBps"] * 1e9
    assert r["roofline_ms_batch1"] == pytest.approx((r["weight_bytes"] + kv_bytes_per_token(run.cfg, 4) * r["context"])
                                                    / bw * 1e3)


def test_peer(results):
    r = results["peer"]
    try:
        import transformers  # noqa: F401
    except ImportError:
        assert r["skipped"] == "transformers is not installed"
        pytest.skip("peer: transformers is not installed, so nanoinfer was not compared with it")
    assert "skipped" not in r, r["skipped"]
    _, lengths = quick_workload(49152)
    assert r["requests"] == 8 and r["nanoinfer_tokens"] == r["transformers_tokens"] == sum(lengths)


def test_overhead(run, results):
    pts = results["overhead"]["points"]
    assert [(p["model"], p["batch"]) for p in pts] == [(m, B) for m in ("tiny", "model") for B in (1, 4)]
    for p in pts:
        # The bare forward pass is part of the engine's step: the fastest of each is the best
        # estimate of its cost (noise only adds time), so the forward's cannot exceed the step's.
        assert p["forward_min_ms"] <= p["step_min_ms"], p


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


# -- the scale, the labels, and --json --------------------------------------------------------------

def test_scale_picks_the_largest_preset_that_fits():
    # two copies of the weights (the peer's) + the batching pool + headroom
    assert bench.pick_timing_model(80 * 2**30, torch.bfloat16)[0] == "random:llama-3.1-8b"    # H100 80 GB
    assert bench.pick_timing_model(141 * 2**30, torch.bfloat16)[0] == "random:llama-3.1-8b"   # H200: 70B is 141 GB alone
    assert bench.pick_timing_model(40 * 2**30, torch.bfloat16)[0] == "random:llama-3.2-3b"    # A100 40 GB
    assert bench.pick_timing_model(8 * 2**30, torch.bfloat16)[0] is None
    # on a CPU, without --model, both models are the real default one
    b = bench.Bench(argparse.Namespace(model=None, device="cpu", dtype="auto", quick=False))
    assert b.path == b.quality_path == default_model_path()


def test_random_preset_figures_say_so(tmp_path, capsys):
    out = tmp_path / "r.json"
    bench.main(["--quick", "--model", "random:smollm2-tiny", "--only", "roofline", "--json", str(out)])
    r = json.loads(out.read_text())["roofline"]
    assert r["models"] == {"random:smollm2-tiny": "random weights, made-up shapes"}
    assert "Model: random:smollm2-tiny (random weights, made-up shapes)" in capsys.readouterr().out


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
    for name in set(bench.EXPERIMENTS) - {"roofline"}:
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
    assert bench.percentile(xs, 50) == 3.0 and bench.percentile(xs, 99) == 5.0 and bench.percentile(xs, 0) == 1.0
    assert math.isnan(bench.percentile([], 50))


# -- the measurement helpers ---------------------------------------------------------------------------

def test_timer_warms_up_untimed_and_takes_the_median(monkeypatch):
    """support/timing.py, the one timer of bench.py and kernels.py: warm-up
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

