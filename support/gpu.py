"""support/gpu.py -- Triton where it is installed, stand-ins where it is not.

The Triton kernels of the tour (kernels.py, quantize.py) run on CUDA only. A CPU-only
install (the course machines, CI) may lack the triton package: there the kernels are
still defined, by decorators that keep the plain function, and never launched. Also the
int4 weights' layout for torch's own int4 kernel (tinygemm), made once when a model is
quantized on CUDA.
"""
import torch

try:
    import triton
    import triton.language as tl
    jit, autotune = triton.jit, triton.autotune
except ImportError:  # pragma: no cover (depends on the install)
    triton = tl = None

    def jit(fn):
        return fn

    def autotune(**_):
        return jit


def configs(*shapes, names=("BLOCK_N", "BLOCK_K")) -> list:
    """triton.Config of each (value, ..., num_warps[, num_stages]) tuple ([] without Triton)."""
    if triton is None:  # pragma: no cover (depends on the install)
        return []
    n = len(names)
    return [triton.Config(dict(zip(names, c[:n])), *c[n:]) for c in shapes]


# --- torch's int4 kernel (tinygemm), quantize.Int4Linear's decode on CUDA ------------------
def tinygemm_layout(packed, scale, zero, group: int, dtype):
    """(levels, scales_and_zeros) for torch._weight_int4pack_mm where it runs (CUDA, bf16), else
    None. Its levels: input 2j in the HIGH nibble, tiled; its scales bf16 (ours are float16)."""
    N, K = packed.shape[0], 2 * packed.shape[1]
    tiles = next((t for t in (8, 4, 2) if K % (16 * t) == 0), None)
    if not (packed.is_cuda and dtype == torch.bfloat16 and tiles and N % 8 == 0
            and group in (32, 64, 128, 256) and hasattr(torch, "_convert_weight_to_int4pack")):
        return None
    return (torch._convert_weight_to_int4pack((packed >> 4) | (packed << 4), tiles),
            tinygemm_scales(scale, zero))


def tinygemm_scales(scale, zero):
    """(q - zero) * s as tinygemm's (q - 8) * s + m, m = (8 - zero) * s: [in // group, out, 2]."""
    m = (8 - zero.float()) * scale.float()
    return torch.stack((scale.t().float(), m.t()), -1).to(torch.bfloat16).contiguous()
