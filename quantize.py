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
        if x.device.type == "cpu" and x.dtype == torch.bfloat16:
            y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight, self.scale.to(x.dtype))
            y = y.view(*x.shape[:-1], self.out_features)
        elif torch.compiler.is_compiling() and x.numel() <= FUSED_ROWS * self.in_features:
            y = self._fused(x)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias
        # end assignment

    def _fused(self, x):  # pragma: no cover (compiled code only: see the last line of the docstring)
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
        raise ValueError("the model is already quantized; load a fresh float model to quantize it again")
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
        self.k_scale = torch.zeros(self.k.shape[:-1], device=device, dtype=torch.float32)   # [L, blocks, bs, n_kv]
        self.v_scale = torch.zeros_like(self.k_scale)
        self.bytes_per_token = int8_kv_cache_bytes(cfg)

    def write(self, layer: int, slots, k, v):
        """Quantize each new token's k, v [N, n_kv, d] per (token, head), then store."""
        for values, store, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            q, scale = quantize_int8(values)                        # [N, n_kv, d], [N, n_kv]
            store_rows(store[layer], slots, q)
            store_rows(scales[layer], slots, scale)

    def blocks(self, layer: int, block_ids):
        k = dequantize_int8(self.k[layer][block_ids], self.k_scale[layer][block_ids], dtype=self.dtype)
        v = dequantize_int8(self.v[layer][block_ids], self.v_scale[layer][block_ids], dtype=self.dtype)
        return k, v                                                  # [*S, bs, n_kv, d]


def make_kv_cache(cfg, num_blocks: int, block_size: int, kv_cache_dtype, device, dtype) -> KVCache:
    """The one place a KV pool is made: the model's dtype (None) or int8."""
    if kv_cache_dtype not in (None, "int8"):
        raise ValueError(f"kv_cache_dtype must be None (the model's dtype) or 'int8', got {kv_cache_dtype!r}")
    return (Int8KVCache if kv_cache_dtype == "int8" else KVCache)(cfg, num_blocks, block_size, device, dtype)
