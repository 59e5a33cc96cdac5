"""
scripts/gpu_kernels.py -- the decode kernels alone, at Llama-3.1-8B's shapes, against what they replace.

    python scripts/gpu_kernels.py --out DIR        # a CUDA GPU; writes DIR/kernels.json as it goes

  attention  kernels.launch_paged_decode (Triton, pages read where they lie) over block sizes of keys,
             splits and warps, against SDPA's fused kernels on the same keys stored densely (the same
             bytes, no paging): microseconds and KV GB/s (bytes it must read / time), bf16 error
  int4       torch's tinygemm int4 kernel (Int4Linear's decode on CUDA), against cuBLAS on the bf16 weight
  int8       kernels.launch_int8_matmul (Triton) over tile shapes, against cuBLAS on the bf16 weight
             (2 bytes a weight) and on the int8 weight converted first: microseconds and weight GB/s

Inputs rotate through copies larger than the L2 cache, so that timings are of HBM, not of the cache.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_figures import graph_ms  # noqa: E402  (scripts/ is on the path when run as a script)

import kernels  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402


DEV = "cpu" if os.environ.get("TRITON_INTERPRET") else "cuda"   # cpu: a dry run of the logic (tiny sizes)
DRY = DEV == "cpu"


def rotating(make, nbytes_each: int, at_least: int = 256 << 20 if not DRY else 1):
    """Copies of an input, enough to overflow the L2 cache; returns a function giving the next one."""
    copies = [make() for _ in range(max(1, math.ceil(at_least / max(nbytes_each, 1))))]
    it = itertools.cycle(copies)
    return lambda: next(it)


def attention(out: dict, save):
    H, n_kv, d, bs = (8, 2, 16, 16) if DRY else (32, 8, 128, 16)
    rows = []
    for B, ctx in [(1, 40), (2, 100)] if DRY else [(1, 256), (1, 2048), (1, 8192), (8, 2048), (64, 576), (64, 2048)]:
        W = 1 << math.ceil(math.log2(-(-ctx // bs)))                 # the engine's width bucket
        blocks = B * W + 1
        kv_bytes = 2 * B * ctx * n_kv * d * 2
        k, v = (torch.randn(1, blocks, bs, n_kv, d, device=DEV, dtype=torch.bfloat16) for _ in "kv")
        tables = torch.randperm(blocks - 1, device=DEV)[:B * W].view(B, W)
        q_pos = torch.full((B, 1), ctx - 1, device=DEV)
        q = torch.randn(B, 1, H, d, device=DEV, dtype=torch.bfloat16)
        ref = kernels.paged_attention_in_place(q.float(), type("C", (), {
            "blocks": lambda self, layer, ids: (k[layer][ids].float(), v[layer][ids].float()),
            "sliding_window": None})(), 0, tables, q_pos)
        row = {"B": B, "ctx": ctx, "W": W}
        for splits in [None, 1, 2, 4, 8, 16, 32]:
            label = f"triton splits={splits or 'auto'}"
            try:
                fn = lambda: kernels.launch_paged_decode(q, k, v, tables, q_pos, 0, splits)   # noqa: E731
                o = fn()
                ms = graph_ms(fn, iters=20, samples=5)
                err = ((o.float() - ref).norm() / ref.norm()).item()
                row[label] = {"us": ms * 1e3, "GBps": kv_bytes / ms / 1e6, "err": err}
            except Exception as e:  # noqa: BLE001
                row[label] = repr(e)[:200]
        # SDPA on the same keys stored densely [B, n_kv, T, d]: the bar for a fused kernel on these bytes
        kd, vd = (torch.randn(B, n_kv, ctx, d, device=DEV, dtype=torch.bfloat16) for _ in "kv")
        qd = q.view(B, n_kv, H // n_kv, d)
        for be in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            try:
                with sdpa_kernel([be]):
                    ms = graph_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd), iters=20, samples=5)
                row[f"sdpa dense {be.name}"] = {"us": ms * 1e3, "GBps": kv_bytes / ms / 1e6}
            except Exception as e:  # noqa: BLE001
                row[f"sdpa dense {be.name}"] = repr(e)[:120]
        best = min((key for key in row if key.startswith("triton") and isinstance(row[key], dict)),
                   key=lambda key: row[key]["us"], default=None)
        row["best"] = best
        rows.append(row)
        save("attention", rows)
        k = v = kd = vd = None                          # free the pool before the next shape
        torch.cuda.empty_cache()
    out["attention"] = rows


def inductor_int8_product():
    """quantize.QuantLinear._fused's product (the int8 weight converted inside the reduction's
    loads) under torch.compile with coordinate-descent tuning (gpt-fast's and torchao's int8 decode),
    issue 42's rival to the Triton kernel."""
    import torch._inductor.config as inductor_config
    inductor_config.coordinate_descent_tuning = True

    def product(x, w, scale):                                   # [M, K], [N, K] int8, [N] -> [M, N]
        return ((w.to(x.dtype)[:, None, :] * x[None, :, :]).sum(-1) * scale[:, None]).t()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(product, dynamic=False)


def int8(out: dict, save):
    rows = []
    try:
        w = torch.randint(-127, 127, (64, 64), device=DEV, dtype=torch.int8)
        torch._weight_int8pack_mm(torch.randn(1, 64, device=DEV, dtype=torch.bfloat16), w,
                                  torch.ones(64, device=DEV, dtype=torch.bfloat16))
        save("weight_int8pack_mm_cuda", "available")
    except Exception as e:  # noqa: BLE001
        save("weight_int8pack_mm_cuda", repr(e)[:200])
    # 8B's linears as model.py has them: q/k/v stacked, o, gate/up stacked, down, the LM head
    shapes = [(48, 64)] if DRY else [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    fused = inductor_int8_product()
    for (N, K), M in itertools.product(shapes, [1, 20] if DRY else [1, 8, 32, 64]):
        wq = rotating(lambda: torch.randint(-127, 128, (N, K), device=DEV, dtype=torch.int8), N * K)
        wb = rotating(lambda: torch.randn(N, K, device=DEV, dtype=torch.bfloat16), 2 * N * K)
        scale = torch.rand(N, device=DEV, dtype=torch.bfloat16) / 100
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        w0 = wq()
        ref = (x.float() @ w0.float().t()) * scale.float()
        row = {"N": N, "K": K, "M": M}
        ms = graph_ms(lambda: F.linear(x, wb()), iters=20, samples=5)
        row["bf16 cublas"] = {"us": ms * 1e3, "GBps": 2 * N * K / ms / 1e6}
        ms = graph_ms(lambda: F.linear(x, wq().to(x.dtype)) * scale, iters=20, samples=5)
        row["int8 converted"] = {"us": ms * 1e3, "GBps": N * K / ms / 1e6}
        try:
            ms = graph_ms(lambda: torch._weight_int8pack_mm(x, wq(), scale), iters=20, samples=5)
            row["weight_int8pack_mm"] = {"us": ms * 1e3, "GBps": N * K / ms / 1e6}
        except Exception as e:  # noqa: BLE001
            row["weight_int8pack_mm"] = repr(e)[:120]
        try:                    # Int8Linear._fused's product, compiled as gpt-fast compiles it
            y = fused(x, w0, scale)
            ms = graph_ms(lambda: fused(x, wq(), scale), iters=20, samples=5)
            row["inductor fused"] = {"us": ms * 1e3, "GBps": N * K / ms / 1e6,
                                     "err": ((y.float() - ref).norm() / ref.norm()).item()}
        except Exception as e:  # noqa: BLE001
            row["inductor fused"] = repr(e)[:200]
        for tile in [None] + [(n, k, wf, warps) for wf in (0, 1) for n, k, warps in
                              ((16, 512, 4), (32, 256, 4), (64, 256, 4), (64, 512, 8), (64, 64, 4), (64, 128, 4))]:
            if M > 16 and tile is not None and tile[1] > 128:
                continue
            try:
                y = kernels.launch_int8_matmul(x, w0, scale, tile)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                ms = graph_ms(lambda: kernels.launch_int8_matmul(x, wq(), scale, tile), iters=20, samples=5)
                row[f"triton {tile or 'autotuned'}"] = {"us": ms * 1e3, "GBps": N * K / ms / 1e6, "err": err}
            except Exception as e:  # noqa: BLE001
                row[f"triton {tile or 'autotuned'}"] = repr(e)[:200]
        row["best"] = min((key for key in row if key.startswith("triton") and isinstance(row[key], dict)),
                          key=lambda key: row[key]["us"], default=None)
        rows.append(row)
        save("int8", rows)
        torch.cuda.empty_cache()


def inductor_int4_product(group: int):
    """Int4Linear._fused's product under torch.compile with coordinate-descent tuning: the nibbles
    unpacked and scaled inside the reduction's loads, no float weight written. tinygemm's rival
    (it streamed 8B's int4 weights at 28% of an H200's copy bandwidth, 2026-11-28)."""
    import torch._inductor.config as inductor_config
    inductor_config.coordinate_descent_tuning = True

    def product(x, packed, scale, zero):   # [M, K], [N, K / 2] uint8, [N, G] fp16, [N, G] uint8 -> [M, N]
        N = packed.shape[0]
        q = torch.stack((packed & 15, packed >> 4), -1).view(N, -1, group)           # [N, G, group]
        w = (q.to(x.dtype) - zero[..., None].to(x.dtype)) * scale[..., None].to(x.dtype)
        return (w.view(N, 1, -1) * x[None, :, :]).sum(-1).t()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(product, dynamic=False)


def int4(out: dict, save):
    """torch's tinygemm int4 kernel (_weight_int4pack_mm: quantize.Int4Linear's decode on CUDA, as
    torchao's and gpt-fast's), group 128, and the inductor-fused product, against cuBLAS on the
    bf16 weight."""
    rows, group = [], 32 if DRY else 128
    fused = inductor_int4_product(group)
    # 8B's linears as model.py has them: q/k/v stacked, o, gate/up stacked, down, the LM head
    shapes = [(48, 64)] if DRY else [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    for (N, K), M in itertools.product(shapes, [1, 20] if DRY else [1, 8]):
        nbytes = N * K // 2 + 3 * N * K // group                      # levels, float16 scale, uint8 zero
        make = lambda: torch.randint(0, 256, (N, K // 2), device=DEV, dtype=torch.uint8)   # noqa: E731
        wq, wb = rotating(make, nbytes), rotating(lambda: torch.randn(N, K, device=DEV, dtype=torch.bfloat16), 2 * N * K)
        scale = (torch.rand(N, K // group, device=DEV) / 50 + 1e-3).half()
        zero = torch.randint(0, 16, (N, K // group), device=DEV, dtype=torch.uint8)
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        w0 = wq()
        levels = torch.stack((w0 & 15, w0 >> 4), -1).view(N, K).float()
        dense = ((levels.view(N, -1, group) - zero[..., None].float()) * scale[..., None].float()).view(N, K)
        ref = x.float() @ dense.t()
        row = {"N": N, "K": K, "M": M, "bytes": nbytes}
        ms = graph_ms(lambda: F.linear(x, wb()), iters=20, samples=5)
        row["bf16 cublas"] = {"us": ms * 1e3, "GBps": 2 * N * K / ms / 1e6}
        try:      # tinygemm: column 2j in the HIGH nibble, w = (q - 8) * scale + zero, [K / group, N, 2] bf16
            packed = torch._convert_weight_to_int4pack((w0 >> 4) | (w0 << 4), 8)
            sz = torch.stack((scale.t(), ((8 - zero.float()) * scale.float()).t()), -1).to(torch.bfloat16)
            y = torch._weight_int4pack_mm(x, packed, group, sz.contiguous())
            packs = rotating(lambda: torch._convert_weight_to_int4pack(make(), 8), nbytes)
            ms = graph_ms(lambda: torch._weight_int4pack_mm(x, packs(), group, sz), iters=20, samples=5)
            row["tinygemm"] = {"us": ms * 1e3, "GBps": nbytes / ms / 1e6,
                               "err": ((y.float() - ref).norm() / ref.norm()).item()}
        except Exception as e:  # noqa: BLE001
            row["tinygemm"] = repr(e)[:200]
        try:
            y = fused(x, w0, scale, zero)
            ms = graph_ms(lambda: fused(x, wq(), scale, zero), iters=20, samples=5)
            row["inductor fused"] = {"us": ms * 1e3, "GBps": nbytes / ms / 1e6,
                                     "err": ((y.float() - ref).norm() / ref.norm()).item()}
        except Exception as e:  # noqa: BLE001
            row["inductor fused"] = repr(e)[:200]
        rows.append(row)
        save("int4", rows)
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--only", default="attention,int8")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = {}

    def save(key, value):
        data[key] = value
        with open(os.path.join(args.out, "kernels.json"), "w") as f:
            json.dump(data, f, indent=1)
    for name in args.only.split(","):
        {"attention": attention, "int8": int8, "int4": int4}[name](data, save)
    for r in data.get("attention", []):
        b = r["best"]
        print(f"attention B={r['B']} ctx={r['ctx']}: best {b} {r[b]['us']:.1f} us {r[b]['GBps']:.0f} GB/s "
              f"err {r[b]['err']:.1e}; sdpa dense " + ", ".join(
                  f"{k[11:]} {v['us']:.1f} us" for k, v in r.items() if k.startswith("sdpa") and isinstance(v, dict)))
    for r in data.get("int8", []):
        b = r["best"]
        print(f"int8 {r['N']}x{r['K']} M={r['M']}: best {b} {r[b]['us']:.1f} us {r[b]['GBps']:.0f} GB/s; "
              f"autotuned {r['triton autotuned']['us'] if isinstance(r['triton autotuned'], dict) else '-'} us; "
              f"bf16 cublas {r['bf16 cublas']['us']:.1f} us; converted {r['int8 converted']['us']:.1f} us")
    for r in data.get("int4", []):
        said = [f"{k} " + (f"{t['us']:.1f} us {t['GBps']:.0f} GB/s err {t['err']:.1e}" if isinstance(t, dict)
                           else t[:80]) for k, t in r.items() if k in ("tinygemm", "inductor fused")]
        print(f"int4 {r['N']}x{r['K']} M={r['M']}: bf16 cublas {r['bf16 cublas']['us']:.1f} us; " + "; ".join(said))


if __name__ == "__main__":
    main()
