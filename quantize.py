"""
quantize.py -- int8: fewer bytes per value, fewer bytes per step.

The lesson: decode is memory-bound. A decode step at small batch reads every weight once
and does ~2 FLOPs per weight per sequence, so its time is

    step time ~ (weight bytes + KV cache bytes) / memory bandwidth

and halving the bytes per value halves the step. Weight-only int8 stores each linear
layer's weight as 8-bit integers plus one float scale per output row
(per-output-channel, symmetric absmax):

    scale[o] = max_i |W[o, i]| / 127        q[o, i] = round(W[o, i] / scale[o])
    y[o]     = sum_i x[i] * W[o, i]  ~=  scale[o] * sum_i x[i] * q[o, i]

The scale factors out of the sum, so the matmul runs on the integers and the
dequantization is one multiply per output. Activations stay in floating point
("weight-only"): they are small at decode time and carry outliers that 8 bits would
clip. The rounding error per weight is at most scale / 2, so one outlier coarsens its
whole row: that is what per-channel (not per-tensor) scales limit.

Every nn.Linear is quantized (q, k, v, o, the MLP's gate/up/down, the LM head). The
token embedding stays in floating point: a lookup reads only N rows per step, not the
whole table. With tied embeddings (SmolLM2) the LM head becomes an int8 copy and the
float table remains for the lookup. The int8 KV cache does the same to the cache: one
float32 scale per (token, head), dequantized when paged attention reads the blocks, so
bytes per token are 2 * layers * kv_heads * (head_dim * 1 + 4).

Place in the data flow: LLM(quantization="int8") calls quantize_model() right after
load_model(); LLM(kv_cache_dtype="int8") builds an Int8KVCache instead of a KVCache.
bench.perplexity() measures what the bytes cost in quality.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cache import KVCache, store_rows
from support.gpu import autotune, configs, jit, tl, triton

QMAX = 127   # symmetric: [-127, 127], so -q is always representable


# --- The quantizer -----------------------------------------------------------
def quantize_int8(w: torch.Tensor, dim: int = -1):
    """Symmetric absmax int8 along `dim`: w ~= q * scale.

    Returns q (int8, w's shape) and scale (float32, w's shape without `dim`).
    An all-zero slice gets scale 1 (q is 0 there anyway) so nothing divides by 0.
    """
    # assignment: int8
    absmax = w.detach().abs().amax(dim=dim, keepdim=True).float()
    scale = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
    q = torch.round(w.float() / scale).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale.squeeze(dim)
    # end assignment


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dim: int = -1, dtype=torch.float32):
    """The float tensor the int8 one stands for: q * scale (broadcast along `dim`)."""
    # assignment: int8
    return q.to(dtype) * scale.unsqueeze(dim).to(dtype)
    # end assignment


def _fitting(cfgs, named_args, **_):
    """Tiles that fit the rows: 64-row tiles (prefill) take short K steps, or x's tile spills
    registers."""
    return [c for c in cfgs if named_args["BLOCK_M"] == 16 or c.kwargs["BLOCK_K"] <= 128]


# Which tile streams a weight fastest depends on its shape and the GPU: Triton times these once
# per (N, K, BLOCK_M) on first use (at the engine's warm-up, before CUDA graphs record) and keeps
# the best. W_FIRST: the weight tile is the product's left operand, read row by row as it is
# stored.
@autotune(configs=configs(*[(n, k, wf, warps) for wf in (0, 1) for n, k, warps in
                            ((16, 512, 4), (32, 256, 4), (32, 512, 4), (64, 256, 4), (64, 512, 8),
                             (32, 64, 4), (64, 64, 4), (64, 128, 4), (128, 64, 8))],
                          names=("BLOCK_N", "BLOCK_K", "W_FIRST")),
          key=["N", "K", "BLOCK_M"], prune_configs_by={"early_config_prune": _fitting})
@jit
def _int8_matmul_kernel(x, w, scale, y, M, N, K, sx, sw, sy, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        W_FIRST: tl.constexpr):  # pragma: no cover (a GPU's kernel)
    """y[M, N] = (x[M, K] @ w[N, K]^T) * scale[N] with int8 w: program (n, m) streams BLOCK_N
    weight rows once, converting each int8 byte to x's dtype in registers (never in memory), and
    multiplies them on the tensor cores (tl.dot) with a BLOCK_M-row tile of x (decode: 1-16 rows,
    padded: the weight bytes, not the FLOPs, set the time)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)                  # y^T: [n, m]
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x + m[None, :] * sx + k[:, None], mask=(m < M)[None, :] & (k < K)[:, None],
                     other=0.0)
        if W_FIRST:                                        # [BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M]
            wt = tl.load(w + n[:, None] * sw + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :],
                         other=0)
            acc += tl.dot(wt.to(xt.dtype), xt,
                          input_precision="ieee" if xt.dtype == tl.float32 else "tf32")
        else:                                                      # (x @ w^T)^T, x the left operand
            wt = tl.load(w + n[None, :] * sw + k[:, None], mask=(n < N)[None, :] & (k < K)[:, None],
                         other=0)
            acc += tl.trans(tl.dot(tl.trans(xt), wt.to(xt.dtype),
                                   input_precision="ieee" if xt.dtype == tl.float32 else "tf32"))
    # dequantize: once per output
    acc *= tl.load(scale + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
    tl.store(y + m[None, :] * sy + n[:, None], acc, mask=(m < M)[None, :] & (n < N)[:, None])


@torch.library.custom_op("nanoinfer::int8_matmul", mutates_args=())
def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(x @ weight^T) * scale for int8 weight [N, K], x [..., K] -> [..., N] in x's dtype: the
    Triton kernel (CUDA; a custom op, so torch.compile and CUDA graphs call it as it is)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return launch_int8_matmul(rows, weight, scale).view(*x.shape[:-1], weight.shape[0])


def launch_int8_matmul(rows, weight, scale, tile: tuple | None = None):
    """The kernel on rows [M, K]: autotuned, or with tile = (BLOCK_N, BLOCK_K, W_FIRST,
    num_warps) given."""
    M, (N, K) = rows.shape[0], weight.shape
    y = torch.empty(M, N, device=rows.device, dtype=rows.dtype)
    BLOCK_M = 16 if M <= 16 else 64       # decode batches: one tile of rows; larger: 64 per program
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, BLOCK_M))    # noqa: E731
    kernel, fixed = (_int8_matmul_kernel, {}) if tile is None else \
        (_int8_matmul_kernel.fn, dict(BLOCK_N=tile[0], BLOCK_K=tile[1], W_FIRST=tile[2],
                                      num_warps=tile[3]))
    kernel[grid](rows, weight, scale, y, M, N, K, rows.stride(0), weight.stride(0), y.stride(0),
                 BLOCK_M=BLOCK_M, **fixed)
    return y


int8_matmul.register_fake(lambda x, weight, scale: x.new_empty(*x.shape[:-1], weight.shape[0]))
# CUDA: up to this many rows through the Triton kernel (decode); more: converted weight
INT8_KERNEL_ROWS = 64


FUSED_ROWS = 8   # compiled int8 products of up to this many rows run as one fused reduction


class Int8Linear(nn.Module):
    """A drop-in nn.Linear with an int8 weight [out, in] and a scale per output row.

    forward computes (x @ q^T) * scale (+ bias), F.linear on the dequantized weight, in
    one of three ways: on CPU with bfloat16 activations, torch._weight_int8pack_mm, a kernel
    that reads the int8 weight directly; under torch.compile with at most FUSED_ROWS rows
    (small-batch decode, the case int8 is for), _fused; otherwise F.linear on the converted
    weight. Eagerly that conversion is a kernel of its own that writes a float copy the
    matmul reads back: more bytes than a bf16 weight, so eager int8 is slower than bf16.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = quantize_int8(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", q)          # [out, in] int8: 1 byte per value
        # [out], in the model's dtype: a bf16 kernel wants bf16 scales, and converting in forward
        # is one more op per layer (one that inductor's lowering of _weight_int8pack_mm refuses).
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x):
        # assignment: int8
        if (x.device.type == "cuda" and triton is not None
                and x.numel() <= INT8_KERNEL_ROWS * self.in_features):
            # the int8 bytes read once, converted in registers
            y = int8_matmul(x, self.weight, self.scale)
        elif x.device.type == "cpu" and x.dtype == torch.bfloat16:
            y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight,
                                          self.scale.to(x.dtype))
            y = y.view(*x.shape[:-1], self.out_features)
        elif torch.compiler.is_compiling() and x.numel() <= FUSED_ROWS * self.in_features:
            y = self._fused(x)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias
        # end assignment

    def _fused(self, x):  # pragma: no cover (compiled code only: see the docstring's last line)
        """gpt-fast's int8 decode: a product the compiler turns into ONE kernel.

        As elementwise multiply + sum, the int8 -> float conversion is part of the
        reduction's load: inductor reads each int8 byte once and converts it in registers
        (no converted weight), a quarter of float32's bytes, half of bf16's. Output
        [out, rows]: rows sharing a weight row are neighbours, so it is loaded once for
        all. Only for a few rows: no tensor cores or BLAS blocking, so many rows make it
        compute-bound. Eagerly it would materialize [out, rows, in]: compiled code only.
        """
        rows = x.reshape(-1, self.in_features)                                       # [R, in]
        y = (self.weight.to(x.dtype)[:, None, :] * rows[None, :, :]).sum(-1)          # [out, R]
        return (y.t() * self.scale.to(x.dtype)).view(*x.shape[:-1], self.out_features)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_model(model: nn.Module, method: str = "int8") -> nn.Module:
    """Swap every nn.Linear of `model` for an Int8Linear, in place, one layer at a time: a
    replaced layer's float weight is freed before the next is quantized, so the peak is the
    float model plus one int8 layer, never two copies of the model."""
    if method != "int8":
        raise ValueError(f"unknown quantization {method!r}; the supported method is 'int8'")
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        raise ValueError("the model is already quantized; load a fresh float model to quantize "
                         "it again")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))
    return model


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer of every layer (a
    tensor shared by two layers, like a tied head, once), except the embedding table, of
    which a lookup reads only the N rows it needs."""
    tensors = {}
    for m in model.modules():
        if next(m.children(), None) is None and not isinstance(m, nn.Embedding):
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
                tensors[t.data_ptr()] = t.numel() * t.element_size()
    return sum(tensors.values())


# --- The int8 KV cache -------------------------------------------------------
def int8_kv_cache_bytes(cfg, num_tokens: int = 1) -> int:
    """2 (K, V) * layers * kv_heads * (head_dim int8 values + one float32 scale) * tokens."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * (cfg.head_dim + 4) * num_tokens


class Int8KVCache(KVCache):
    """KVCache storing int8 K, V [L, blocks, block_size, n_kv, d] and float32 scales
    [L, blocks, block_size, n_kv], one per token and head.

    Only write (quantize) and blocks (dequantize) differ: paged attention in cache.py and
    kernels.py reads through blocks(), so it works unchanged and sees K, V in the model's
    dtype. total_bytes and copy_block cover the scales too: they walk KVCache.pools().
    """
    storage_dtype = torch.int8

    def __init__(self, cfg, num_blocks: int, block_size: int, device, dtype):
        super().__init__(cfg, num_blocks, block_size, device, dtype)         # int8 K, V
        self.k_scale = torch.zeros(self.k.shape[:-1], device=device,
                                   dtype=torch.float32)                      # [L, blocks, bs, n_kv]
        self.v_scale = torch.zeros_like(self.k_scale)
        self.bytes_per_token = int8_kv_cache_bytes(cfg)

    def write(self, layer: int, slots, k, v):
        """Quantize each new token's k, v [N, n_kv, d] per (token, head), then store."""
        for values, store, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            q, scale = quantize_int8(values)                        # [N, n_kv, d], [N, n_kv]
            store_rows(store[layer], slots, q)
            store_rows(scales[layer], slots, scale)

    def blocks(self, layer: int, block_ids):
        k = dequantize_int8(self.k[layer][block_ids], self.k_scale[layer][block_ids],
                            dtype=self.dtype)
        v = dequantize_int8(self.v[layer][block_ids], self.v_scale[layer][block_ids],
                            dtype=self.dtype)
        return k, v                                                  # [*S, bs, n_kv, d]


def make_kv_cache(cfg, num_blocks: int, block_size: int, kv_cache_dtype, device, dtype) -> KVCache:
    """The one place a KV pool is made: the model's dtype (None) or int8."""
    if kv_cache_dtype not in (None, "int8"):
        raise ValueError(f"kv_cache_dtype must be None (the model's dtype) or 'int8', "
                         f"got {kv_cache_dtype!r}")
    return (Int8KVCache if kv_cache_dtype == "int8" else KVCache)(cfg, num_blocks, block_size,
                                                                  device, dtype)
