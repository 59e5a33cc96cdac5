"""tests/triton_check.py -- the Triton kernels (kernels.paged_decode, kernels.int8_matmul) against
their references, in float32 (exact dot products: ieee) and, on CUDA, bf16.

Run by tests/test_kernels.py and tests/test_quantize.py: in-process on CUDA; on a CPU through
Triton's interpreter, which must be switched on before Triton decorates the kernels, so in a
subprocess: `TRITON_INTERPRET=1 python tests/triton_check.py NAME` prints one line per failure.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402
import quantize  # noqa: E402


def paged_decode(device: str) -> list[str]:
    """Ragged decode and verification batches, GQA groups 1-4, block sizes 8-16, a sliding window,
    one split and several: launch_paged_decode equals paged_attention_in_place (float32 arithmetic)."""
    failures, g = [], torch.Generator().manual_seed(0)
    for B, Q, H, n_kv, d, bs, W, window, splits in [(3, 1, 8, 2, 16, 16, 4, 0, 1), (3, 1, 8, 2, 16, 16, 8, 0, 3),
                                                     (2, 3, 6, 2, 32, 8, 8, 0, 2), (2, 2, 4, 4, 16, 16, 8, 20, 4),
                                                     (4, 1, 9, 3, 64, 16, 4, 0, None), (5, 1, 8, 8, 16, 16, 16, 0, 7)]:
        blocks = B * W + 1
        k, v = (torch.randn(1, blocks, bs, n_kv, d, generator=g).to(device) for _ in "kv")
        tables = torch.randperm(blocks, generator=g)[:B * W].view(B, W).to(device)   # scattered pages
        last = torch.randint(Q - 1, W * bs, (B,), generator=g)
        q_pos = (last[:, None] - Q + 1 + torch.arange(Q)).to(device)                   # [B, Q]
        q = torch.randn(B, Q, H, d, generator=g).to(device)
        view = type("Pool", (), {"blocks": lambda self, layer, ids: (k[layer][ids], v[layer][ids]),
                                 "sliding_window": window or None})()
        ref = kernels.paged_attention_in_place(q, view, 0, tables, q_pos)
        dtypes = (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,)
        for dtype in dtypes:
            out = kernels.launch_paged_decode(q.to(dtype), k.to(dtype), v.to(dtype), tables, q_pos, window, splits)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            bound = 1e-5 if dtype == torch.float32 else 1e-2
            if not err <= bound:
                failures.append(f"paged_decode B={B} Q={Q} H={H} n_kv={n_kv} d={d} bs={bs} window={window} "
                                f"splits={splits} {dtype}: relative error {err:.2e} > {bound}")
    return failures


def int8_matmul(device: str) -> list[str]:
    """Decode (1-16 rows) and prefill-sized (17-64 rows) tiles, both operand orders, ragged N and K:
    the kernel equals x @ dequantized(w)^T (float32 arithmetic)."""
    failures, g = [], torch.Generator().manual_seed(1)
    for M, N, K in [(1, 48, 64), (5, 100, 300), (16, 64, 128), (20, 64, 130), (64, 33, 512)]:
        w, x = torch.randn(N, K, generator=g).to(device), torch.randn(M, K, generator=g).to(device)
        q, scale = quantize.quantize_int8(w)
        ref = (x @ q.float().t()) * scale
        tiles = [(16, 512, 0, 4), (64, 64, 1, 4), (32, 128, 0, 8), (16, 64, 1, 4)]
        for tile in tiles + ([None] if device == "cuda" else []):       # None: autotuned (timing needs a GPU)
            y = kernels.launch_int8_matmul(x, q, scale, tile)
            err = ((y - ref).norm() / ref.norm()).item()
            if not err <= 1e-5:
                failures.append(f"int8_matmul M={M} N={N} K={K} tile={tile}: relative error {err:.2e}")
        if device != "cuda":          # no timing here, but the autotuner's pruning, called as Triton calls it
            tuner, y = kernels._int8_matmul_kernel, torch.empty(M, N, device=device)
            tuner.nargs = dict(zip(tuner.arg_names, (x, q, scale, y, M, N, K, K, K, N)))
            for block_m in (16, 64):
                try:
                    if not tuner.prune_configs({"BLOCK_M": block_m}):
                        failures.append(f"int8_matmul BLOCK_M={block_m}: every tile pruned")
                except Exception as e:   # noqa: BLE001 (triton 3.6 passes BLOCK_M in kwargs, not nargs)
                    failures.append(f"int8_matmul autotune pruning, BLOCK_M={block_m}: {e!r}")
    return failures


CHECKS = {"paged_decode": paged_decode, "int8_matmul": int8_matmul}


def run(name: str) -> list[str]:
    """The failures of check `name`: in-process on CUDA, else in Triton's interpreter (a subprocess);
    skipped where neither can run."""
    import importlib.util
    import subprocess

    import pytest
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the Triton kernels need the triton package (on CUDA installs it comes with torch)")
    if torch.cuda.is_available():
        return CHECKS[name]("cuda")
    r = subprocess.run([sys.executable, os.path.abspath(__file__), name], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    if "only 0-dimensional arrays" in r.stderr:     # triton 3.6's interpreter with numpy >= 2.4
        pytest.skip("Triton's interpreter (triton 3.6) fails with numpy >= 2.4: pip install 'numpy<2.4'")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("done"), f"{name} did not run:\n{r.stderr[-3000:]}"
    return [line for line in r.stdout.splitlines() if line != "done"]

if __name__ == "__main__":
    for line in CHECKS[sys.argv[1]]("cpu"):
        print(line)
    print("done")
