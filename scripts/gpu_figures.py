"""
scripts/gpu_figures.py -- what only a GPU shows, in one prepared run that writes as it goes.

    python scripts/gpu_figures.py STAGE --out DIR [--preset llama-3.1-8b]

Stages (each its own process in scripts/gpu_run.sh, so that a CUDA error or an
out-of-memory in one leaves the others running):

  probe    the card, its memory, copy bandwidth (bytes read + written), bf16 matmul
           TFLOP/s on random data, and, at the engine's own attention shapes, which
           SDPA backends run, their time and bf16 error against float32 math
  decode   LLM(compile=True) at the preset's shapes in bf16 (CUDA graphs): compile time,
           batch-1 decode in gpt-fast's format (tok/s, GB/s), the batching curve, one
           eager step for comparison, and a torch.profiler table of one compiled step
  int8     the same batch-1 decode with int8 weight-only linears (--baseline: then bf16's, same run)
  int4     the same with int4 group-wise weights, and the profiler table of its compiled step
  continuous  bench's continuous-vs-static workload, every forward timed by kind

Every stage merges its figures into DIR/figures.json as soon as it has them
(a run cut short keeps what it measured) and prints a short summary.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def save(out: str, key: str, value) -> None:
    """Merge {key: value} into out/figures.json now."""
    path = os.path.join(out, "figures.json")
    data = json.load(open(path)) if os.path.exists(path) else {}
    data[key] = value
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    print(f"[{key}] {json.dumps(value, default=str)[:1500]}", flush=True)


def cuda_ms(fn, iters: int = 20, samples: int = 5) -> float:
    """Median ms of one fn() call, timed with CUDA events over batches of calls (a CPU dry run: the clock)."""
    fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


def graph_ms(fn, iters: int = 20, samples: int = 5) -> float:
    """Median ms of one fn() call, replayed from a CUDA graph of `iters` calls: the GPU's time alone,
    without the host's launch cost (which, for kernels of a few microseconds, is what events time)."""
    if not torch.cuda.is_available():
        return cuda_ms(fn, iters, samples)
    fn()                                                   # compile, autotune: never inside a capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return cuda_ms(graph.replay, iters=1, samples=samples) / iters


# --- probe ---------------------------------------------------------------------
def stage_probe(args):
    import triton
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    save(args.out, "device", {"name": p.name, "total_GiB": total / 2**30, "free_GiB": free / 2**30,
                              "sms": p.multi_processor_count, "torch": torch.__version__,
                              "cuda": torch.version.cuda, "triton": triton.__version__,
                              "date": time.strftime("%Y-%m-%d")})
    n = (1 << 30) // 4                                   # 1 GiB of float32: far past the 50-60 MB L2
    a, b = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    ms = cuda_ms(lambda: b.copy_(a), iters=10)
    bw = 2 * n * 4 / (ms / 1e3)
    a = b = None                                         # free them
    m = 8192
    x, y = (torch.randn(m, m, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms_mm = cuda_ms(lambda: x @ y, iters=10)
    save(args.out, "machine", {"copy_GBps": bw / 1e9, "bf16_matmul_TFLOPs": 2 * m**3 / (ms_mm / 1e3) / 1e12})
    x = y = None
    save(args.out, "sdpa", sdpa_backends())


def sdpa_backends():
    """The engine's eager attention (kernels.grouped_attention: GQA heads folded into queries, a
    boolean mask) at its own shapes, under each backend alone: does it run, how fast, and its
    bf16 error against float32 math attention on the same inputs."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import kernels
    rows = []
    shapes = {"8B prefill 1x512": (32, 8, 128, 1, 512, 512), "8B decode 64x2048": (32, 8, 128, 64, 1, 2048),
              "135M prefill 1x512": (9, 3, 64, 1, 512, 512), "135M decode 64x2048": (9, 3, 64, 64, 1, 2048)}
    for name, (H, n_kv, d, B, Q, T) in shapes.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, Q, H, d, device="cuda", generator=g)
        k, v = (torch.randn(B, T, n_kv, d, device="cuda", generator=g).transpose(1, 2) for _ in range(2))
        pos = torch.arange(T - Q, T, device="cuda")
        visible = (torch.arange(T, device="cuda")[None, :] <= pos[:, None])[None].expand(B, Q, T)
        with sdpa_kernel([SDPBackend.MATH]):
            ref = kernels.grouped_attention(q.double(), k.double(), v.double(), visible).float()
        row = {"shape": name}
        for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                   SDPBackend.MATH, None):
            label = be.name if be is not None else "default"
            qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
            try:
                with sdpa_kernel([be]) if be is not None else contextlib.nullcontext():
                    out = kernels.grouped_attention(qb, kb, vb, visible)
                    ms = cuda_ms(lambda: kernels.grouped_attention(qb, kb, vb, visible), iters=5, samples=3)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                row[label] = {"ms": round(ms, 4), "rel_err_bf16": err}
            except RuntimeError as e:
                row[label] = f"refused: {str(e).splitlines()[0][:120]}"
        rows.append(row)
    _ = F
    return rows


# --- decode --------------------------------------------------------------------
def engine(args, **kw):
    from engine import LLM
    t0 = time.perf_counter()
    llm = LLM(f"random:{args.preset}", device=args.device, dtype="bfloat16", compile=True,
              max_num_seqs=args.max_num_seqs, kv_cache_bytes=int(args.pool_gib * 2**30),
              quantization=args.tag.strip("_") or None, **kw)
    return llm, time.perf_counter() - t0


def start_decoding(llm, batch: int, context: int, steps: int) -> list[str]:
    """bench's own (experiments/common.py): the requests stepped until each decodes."""
    from experiments.common import start_decoding as bench_start_decoding
    return bench_start_decoding(llm, batch, context, steps)


def decode_steps(llm, batch: int, context: int, steps: int) -> dict:
    """Median engine step (schedule + compiled step + sample) and median graph replay alone, at
    `batch` sequences decoding past ~`context` tokens."""
    from graphs import bucket
    ids = start_decoding(llm, batch, context, steps + 8)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(3):
        llm.step()
    sync()
    times = []
    for _ in range(4):                     # runs of steps back to back: overlap hides the host between them
        t0 = time.perf_counter()
        for _ in range(steps // 4):
            llm.step()
        sync()
        times.append((time.perf_counter() - t0) / (steps // 4))
    d, longest = llm.decoder, max(len(s.token_ids) for s in llm.scheduler.running)
    key = (1, bucket(batch, d.batch_sizes), bucket(longest // llm.block_manager.block_size + 1, d.widths))
    replay_ms = cuda_ms(d.graphs[key].replay if key in d.graphs else lambda: d._run(key), iters=10, samples=5)
    for rid in ids:
        llm.abort(rid)
    step = statistics.median(times)
    return {"batch": batch, "context": context, "step_ms": step * 1e3, "replay_ms": replay_ms, "bucket": key,
            "tok_s": batch / step}


def weight_bytes(llm) -> int:
    from quantize import decode_weight_bytes
    return decode_weight_bytes(llm.model)


def stage_decode(args):
    from cache import kv_cache_bytes
    llm, build_s = engine(args)
    W, cfg = weight_bytes(llm), llm.config
    save(args.out, f"{args.tag}build", {"preset": args.preset, "build_s": build_s, "compile_s": llm.compile_seconds,
                                        "graphs": len(llm.decoder.graphs), "weight_GB": W / 1e9,
                                        "mem_GiB": torch.cuda.memory_allocated() / 2**30})
    r = decode_steps(llm, 1, args.context, 64)
    kv = kv_cache_bytes(cfg, torch.bfloat16, args.context + 40)
    r.update(weights_GBps=W * r["tok_s"] / 1e9, with_kv_GBps=(W + kv) * r["tok_s"] / 1e9,
             replay_GBps=(W + kv) / (r["replay_ms"] / 1e3) / 1e9)
    save(args.out, f"{args.tag}batch1", r)
    if args.tag:                                  # int8, int4: batch 1 and a small batch only
        save(args.out, f"{args.tag}batch8", decode_steps(llm, min(8, args.max_num_seqs), args.context, 16))
        profile(llm, args)
        if args.baseline:                         # bf16 batch 1 in the same run: the ratio's baseline
            del llm
            torch.cuda.empty_cache()
            args.tag, (llm, _) = "", engine(argparse.Namespace(**{**vars(args), "tag": ""}))
            save(args.out, "bf16_batch1", decode_steps(llm, 1, args.context, 64))
        return
    curve = []
    for B in [b for b in [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256] if b <= args.max_num_seqs]:
        curve.append(decode_steps(llm, B, 512, 12))
        save(args.out, "batching", curve)
    decoder, llm.decoder = llm.decoder, None             # the eager step, once: the lesson of compiling
    save(args.out, "eager_batch1", decode_steps_eager(llm, args.context))
    llm.decoder = decoder
    profile(llm, args)


def decode_steps_eager(llm, context):
    ids = start_decoding(llm, 1, context, 20)
    for _ in range(2):
        llm.step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(8):
        llm.step()
    sync()
    for rid in ids:
        llm.abort(rid)
    return {"step_ms": (time.perf_counter() - t0) / 8 * 1e3}


def profile(llm, args):
    """One compiled step, NOT replayed from its graph (the profiler sees each kernel): CUDA time
    per kernel, summed by name, into profile.txt."""
    from torch.profiler import ProfilerActivity
    from graphs import bucket
    d, cuda = llm.decoder, torch.cuda.is_available()
    key = (1, 1, bucket(-(-(args.context + 64) // llm.block_manager.block_size), d.widths))
    step = d.scratch_step(key)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.inference_mode():
        step()
        sync()
        with torch.profiler.profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
            for _ in range(3):
                step()
            sync()
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=40,
                                      max_name_column_width=90)
    with open(os.path.join(args.out, f"profile{'_' + args.tag.strip('_') if args.tag else ''}.txt"), "w") as f:
        f.write(f"bucket {key}, 3 steps, {args.preset} bf16\n{table}\n")
    print(table[:6000], flush=True)


# --- continuous -------------------------------------------------------------------
def stage_continuous(args):
    """Where the continuous-vs-static run's time goes (bench's workload, 16 seats): every forward
    timed (synchronized) by kind, decode-only or mixed (a prefill chunk beside decodes: a rows
    graph, or the eager model past the largest rows bucket), with its prefill tokens."""
    from types import SimpleNamespace

    from experiments.common import seats, workload
    from sampler import SamplingParams
    llm, _ = engine(args)
    b = SimpleNamespace(sizes=lambda table: SimpleNamespace(**table["gpu"]))
    prompts, lengths = workload(b, llm.config.vocab_size)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    forward, steps = llm._forward, []

    def timed(batch, rows):
        sync()
        t0, eager = time.perf_counter(), llm.stats["eager_steps"]
        out = forward(batch, rows)
        sync()
        steps.append((max(it.count for it in batch) > 1, sum(it.count for it in batch if it.count > 1),
                      len(batch), time.perf_counter() - t0, llm.stats["eager_steps"] - eager))
        return out
    llm._forward, result = timed, {}
    with seats(llm, 16):
        llm.generate([prompts[0]], params[0])                                   # warm-up
        for name, groups in (("static", [range(i, i + 16) for i in range(0, len(prompts), 16)]),
                             ("continuous", [range(len(prompts))])):
            steps.clear()
            t0 = time.perf_counter()
            for g in groups:
                llm.generate([prompts[i] for i in g], [params[i] for i in g])
            wall = time.perf_counter() - t0
            kinds = {kind: [s for s in steps if s[0] == mixed] for kind, mixed in (("decode", False), ("mixed", True))}
            result[name] = {"wall_s": wall, "forward_s": sum(s[3] for s in steps), **{
                kind: {"steps": len(v), "eager_steps": sum(s[4] for s in v),
                       "seconds": sum(s[3] for s in v), "prefill_tokens": sum(s[1] for s in v),
                       "median_ms": 1e3 * statistics.median([s[3] for s in v]) if v else None,
                       "max_ms": 1e3 * max([s[3] for s in v], default=0)} for kind, v in kinds.items()}}
            save(args.out, f"continuous_{name}", result[name])
    llm._forward = forward


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["probe", "decode", "int8", "int4", "continuous"])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--pool-gib", type=float, default=8)
    ap.add_argument("--baseline", action="store_true", help="int8, int4: then bf16 batch 1 in the "
                    "same run")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script's logic (tiny preset)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    args.tag = ""
    if args.stage == "probe":
        stage_probe(args)
    elif args.stage == "decode":
        stage_decode(args)
    elif args.stage == "continuous":
        stage_continuous(args)
    else:                                        # int8, int4: quantized weights, batch 1 and 8
        args.tag = f"{args.stage}_"
        stage_decode(args)


if __name__ == "__main__":
    main()
