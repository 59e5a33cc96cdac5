"""Assignment: bench.py -- every lesson measured against its baseline.

To pass, `python bench.py --quick --json PATH` must run every experiment on a
tiny model and write each figure the experiments promise: positive, finite,
speedups equal to the ratio of the times measured in the same run, and the
exactness checks (same tokens with and without the KV cache, with and
without speculation) true.
"""
import json
import math
import os

import pytest
from conftest import save_checkpoint, tiny_model

import bench

# The results fixture runs every experiment through the whole engine.
pytestmark = pytest.mark.needs("engine", "model", "sampler", "ngram-drafter", "int8", "paged-attention", "roofline")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    # dim divisible by the heads, so that transformers (if installed) can load it for the peer run
    path = save_checkpoint(tiny_model(seed=0, vocab_size=49152, max_seq_len=2048, dim=96), d / "model")
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
        return json.load(f)


def positive(x, name):
    assert isinstance(x, (int, float)) and math.isfinite(x) and x > 0, f"{name} = {x!r} is not a positive number"


def test_meta_and_every_experiment_present(results):
    assert set(bench.EXPERIMENTS) <= set(results), f"missing: {set(bench.EXPERIMENTS) - set(results)}"
    meta = results["meta"]
    assert meta["device"] and meta["torch"] and meta["date"] and meta["dtype"] and meta["quick"] is True


@pytest.mark.assignment("roofline")
def test_roofline(results):
    r = results["roofline"]
    for k in ("bandwidth_GBps", "matmul_TFLOPs", "weight_bytes", "kv_bytes_per_token", "decode_bound_ms",
              "decode_measured_ms", "prefill_bound_ms", "prefill_measured_ms"):
        positive(r[k], k)
    assert r["decode_fraction_of_roofline"] == pytest.approx(r["decode_bound_ms"] / r["decode_measured_ms"])
    intensities = [p["flops_per_byte"] for p in r["intensity"]]
    assert intensities == sorted(intensities), "arithmetic intensity must grow with batch size"


def test_kv_cache(results):
    for p in results["kv-cache"]["lengths"]:
        positive(p["naive_ms_per_token"], "naive"), positive(p["cached_ms_per_token"], "cached")
        assert p["speedup"] == pytest.approx(p["naive_ms_per_token"] / p["cached_ms_per_token"])
        assert p["same_tokens"], "the KV cache changed the greedy tokens"


def test_batching(results):
    pts = results["batching"]["points"]
    assert [p["batch"] for p in pts] == [1, 2, 4]
    for p in pts:
        positive(p["step_ms"], "step_ms"), positive(p["bound_ms"], "bound_ms")
        assert p["tokens_per_s"] == pytest.approx(p["batch"] / p["step_ms"] * 1e3)


def test_continuous_vs_static(results):
    r = results["continuous-vs-static"]
    for mode in ("static", "continuous"):
        for k in ("tokens_per_s", "ttft_mean_s", "ttft_p90_s", "tpot_mean_ms", "seconds"):
            positive(r[mode][k], f"{mode}.{k}")
    assert r["throughput_speedup"] == pytest.approx(r["continuous"]["tokens_per_s"] / r["static"]["tokens_per_s"])


def test_prefix(results):
    r = results["prefix"]
    assert r["off"]["block_hit_rate"] == 0 and r["on"]["block_hit_rate"] > 0.5
    assert r["on"]["cached_prompt_fraction"] > 0.5
    assert r["ttft_speedup"] == pytest.approx(r["off"]["ttft_mean_s"] / r["on"]["ttft_mean_s"])


def test_speculative(results):
    runs = results["speculative"]["runs"]
    assert {(r["workload"], r["k"]) for r in runs} == {(w, k) for w in ("copy-heavy", "open-ended") for k in (1, 4)}
    for r in runs:
        assert 0 <= r["alpha"] <= 1
        positive(r["speedup"], "speedup"), positive(r["predicted_speedup"], "predicted"), positive(r["tokens_per_pass"], "tpp")
        assert r["same_tokens"], "greedy speculation changed the tokens"


def test_quantization(results):
    cfgs = {c["name"]: c for c in results["quantization"]["configs"]}
    f, q, kv = cfgs["float"], cfgs["int8 weights"], cfgs["int8 weights + int8 KV"]
    for c in cfgs.values():
        for k in ("weight_bytes", "kv_bytes_per_token", "tokens_per_s_batch1", "perplexity"):
            positive(c[k], f"{c['name']}.{k}")
    assert q["weight_bytes"] < 0.3 * f["weight_bytes"], "int8 weights should be ~1/4 of float32"
    assert kv["kv_bytes_per_token"] < q["kv_bytes_per_token"], "the int8 KV cache should be smaller"


def test_compile(results):
    r = results["compile"]
    for k in ("compile_seconds", "eager_ms_batch1", "compiled_ms_batch1", "eager_ms_batch4", "compiled_ms_batch4"):
        positive(r[k], k)
    assert r["speedup_batch1"] == pytest.approx(r["eager_ms_batch1"] / r["compiled_ms_batch1"])
    assert r["weight_layout"] in ("default", "transposed")


def test_peer(results):
    r = results["peer"]
    if "skipped" not in r:     # only where transformers is installed
        positive(r["transformers_tokens_per_s"], "transformers"), positive(r["nanoinfer_tokens_per_s"], "ours")
        assert r["speedup"] == pytest.approx(r["nanoinfer_tokens_per_s"] / r["transformers_tokens_per_s"])


def test_unknown_experiment_is_refused():
    with pytest.raises(SystemExit):
        bench.main(["--only", "nonsense"])
