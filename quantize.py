"""
quantize.py -- the quantization chapter: fewer bytes per weight, fewer bytes per step.

The lesson: decode is memory-bound. A small-batch step reads every weight once for ~2 FLOPs
per weight per sequence: step time ~ (weight bytes + KV bytes) / memory bandwidth, so halving
the bytes per value halves the step. Four formats, each a drop-in nn.Linear:

  * int8 weight-only (Int8Linear): integers and one float scale per output row (absmax)
        scale[o] = max_i |W[o, i]| / 127        q[o, i] = round(W[o, i] / scale[o])
        y[o]     = sum_i x[i] * W[o, i]  ~=  scale[o] * sum_i x[i] * q[o, i]
    (the scale factors out of the sum); each weight errs by <= scale / 2.
  * fp8 e4m3 (Fp8Linear): per-row scales, float values (3 mantissa bits: a relative error);
    Fp8DynamicLinear rounds the activations to fp8 too, and multiplies fp8 by fp8.
  * int4 group-wise (Int4Linear): two weights per byte. 16 levels are too few for a whole
    row, so each GROUP of inputs has its own scale and zero point: ~0.13x float32's bytes.
  * LLM.int8() (LLMInt8Linear): int8 weights AND int8 activations, int8 x int8 -> int32.

Activations carry OUTLIERS: a few input channels are 10-100x larger than the rest, in every
token. Two answers. LLM.int8() multiplies the columns of x above OUTLIER (6.0) in floating
point, the rest in int8 with a scale (and zero point) per row of x, which outliers would set.
AWQ (awq_scale) keeps weights int4 but protects the ones those channels multiply: input
channel i of W scaled up by s_i, x down by 1/s_i (folded into the RMSNorm or linear before:
the same function in full precision), gives them more of the 16 levels; s = mean|x|^alpha.

Embeddings stay in floating point (a lookup reads N rows); a tied LM head becomes a quantized
copy. LLM(quantization=...) calls quantize_model() after load_model(); LLM(kv_cache_dtype=
"int8") makes an Int8KVCache. experiments/quantization.py measures bytes, speed, perplexity.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from cache import KVCache, new_kv_cache, store_rows
from kernels import INT8_KERNEL_ROWS, int8_matmul
from support import checks
from support.gpu import tinygemm_layout, triton

QMAX = 127   # symmetric: [-127, 127], so -q is always representable


# --- The quantizer -----------------------------------------------------------
def quantize_int8(w: torch.Tensor, dim: int = -1):
    """Symmetric absmax int8 along `dim`: w ~= q * scale. Returns q (int8, w's shape) and scale
    (float32, without `dim`); an all-zero slice gets scale 1, so nothing divides by 0."""
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


class QuantLinear(nn.Module):
    """What every format shares: the shape, a float bias, and forward = F.linear on the weight
    it stands for (dequantized(dtype) [out, in]). Eagerly that is a float copy, written then
    read back: MORE bytes than bf16. Compiled decode reads the small format itself."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x):
        few = torch.compiler.is_compiling() and x.numel() <= FUSED_ROWS * self.in_features
        y = self._fused(x) if few else F.linear(x, self.dequantized(x.dtype))
        return y if self.bias is None else y + self.bias

    def _fused(self, x):  # pragma: no cover (compiled code only: see the docstring's last line)
        """gpt-fast's decode product, ONE kernel once compiled: as multiply + sum, unpacking and
        scaling happen in the reduction's load, in registers (no float weight is written). Output
        [out, rows]: rows sharing a weight row are neighbours, so it is loaded once. For a few
        rows only (no tensor cores). Eagerly it would materialize [out, rows, in]."""
        rows = x.reshape(-1, self.in_features)                                       # [R, in]
        y = (self.dequantized(x.dtype)[:, None, :] * rows[None, :, :]).sum(-1)        # [out, R]
        return y.t().view(*x.shape[:-1], self.out_features)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class Int8Linear(QuantLinear):
    """int8 weight [out, in], a scale per output row; forward = (x @ q^T) * scale (+ bias): on
    CUDA kernels.int8_matmul (Triton); on CPU in bf16 torch._weight_int8pack_mm (reads the int8
    weight); compiled, _fused; else F.linear on the converted weight."""
    kind = "int8"
    scale_dtype = None     # the model's: bf16 kernels want bf16 scales (no conversion per call)

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        q, scale = quantize_int8(linear.weight)
        self.register_buffer("weight", q)          # [out, in] int8: 1 byte per value
        self.register_buffer("scale", scale.to(self.scale_dtype or linear.weight.dtype))  # [out]

    def forward(self, x):
        """x [..., in] -> (x @ q^T) * scale (+ bias) [..., out] in x's dtype, by the paths above."""
        # assignment: int8
        if (x.device.type == "cuda" and triton is not None
                and x.numel() <= INT8_KERNEL_ROWS * self.in_features):
            y = int8_matmul(x, self.weight, self.scale)      # converted in registers
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

    def dequantized(self, dtype):
        return dequantize_int8(self.weight, self.scale, dtype=dtype)


# --- fp8 e4m3: a float with 3 mantissa bits, one scale per output row ---------------------
FP8_MAX = 448.0    # the largest float8_e4m3fn: (1 + 6/8) * 2^8


def quantize_fp8(w: torch.Tensor):
    """Per row of w [N, K]: scale = absmax / 448 (1 for a zero row), q = w / scale rounded to
    the nearest e4m3. Returns q [N, K] float8_e4m3fn, scale [N] float32."""
    absmax = w.detach().abs().amax(-1, keepdim=True).float()
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.squeeze(-1)


class Fp8Linear(QuantLinear):
    """fp8 weight [out, in] and a float32 scale per row, upcast in the matmul. Its error is
    relative: small weights keep digits that int8's fixed step rounds off."""
    kind = "fp8 e4m3"

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        q, scale = quantize_fp8(linear.weight)
        self.register_buffer("weight", q)                          # [out, in] float8_e4m3fn
        self.register_buffer("scale", scale)                       # [out] float32

    def dequantized(self, dtype):
        return self.weight.to(dtype) * self.scale[:, None].to(dtype)


class Fp8DynamicLinear(Fp8Linear):
    """fp8 x fp8 ("W8A8"): x too is rounded to e4m3 per call, a scale per token (row), and the
    product runs on fp8 operands, both scales applied to its float32 sums (torch._scaled_mm: on
    an H100 the fp8 tensor cores, twice bf16's rate; prefill's compute halves, not only bytes)."""
    kind = "fp8 e4m3 weights and activations"

    def forward(self, x):
        rows = x.reshape(-1, self.in_features)                                     # [R, in]
        pad = -len(rows) % 16 if x.is_cuda else 0         # CUDA's fp8 GEMM: rows in 16s
        xq, xs = quantize_fp8(F.pad(rows, (0, 0, 0, pad)))                         # [R', in], [R']
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs[:, None], scale_b=self.scale[None, :],
                             out_dtype=torch.bfloat16 if x.is_cuda else x.dtype)  # [R', out]
        y = y[:len(rows)].to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


# --- int4 group-wise: two weights per byte, a scale and a zero point per group ------------
def int4_group(k: int) -> int:
    """Inputs per int4 group for rows of k: 128, or the largest of 64, 32 dividing k, else k."""
    return next(g for g in (128, 64, 32, k) if k % g == 0)


def quantize_int4(w: torch.Tensor, group: int):
    """Asymmetric int4 per `group` consecutive inputs of each row of w [N, K]: w ~= (q - zero) *
    scale, q in [0, 15]; the range [min, max] widened to hold 0 (zero stands for it exactly);
    scale = (max - min) / 15 >= 1e-5, rounded to float16 BEFORE q is computed with it. Returns
    q [N, K] uint8 (pack_int4 halves it), scale [N, K // group] float16, zero (same) uint8."""
    # assignment: int4
    N, K = w.shape
    g = w.detach().float().reshape(N, K // group, group)                       # [N, G, group]
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)                  # [N, G]
    scale = ((hi - lo) / 15).clamp(min=1e-5).half()                            # as stored
    zero = torch.round(-lo / scale.float()).clamp(0, 15)                       # [N, G]
    q = (torch.round(g / scale.float()[..., None]) + zero[..., None]).clamp(0, 15)
    return q.to(torch.uint8).reshape(N, K), scale, zero.to(torch.uint8)
    # end assignment


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two levels a byte: [N, K] (0..15) -> [N, K // 2] uint8, column 2j in the low nibble."""
    # assignment: int4
    return q[:, 0::2] | (q[:, 1::2] << 4)
    # end assignment


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: [N, K // 2] uint8 -> [N, K] levels 0..15."""
    # assignment: int4
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    # end assignment


def dequantize_int4(q, scale, zero, dtype=torch.float32):
    """The weight [N, K] that levels q [N, K] stand for: (q - zero) * scale, per group."""
    # assignment: int4
    N, G = scale.shape
    w = (q.reshape(N, G, -1).to(dtype) - zero[..., None].to(dtype)) * scale[..., None].to(dtype)
    return w.reshape(N, -1)                                                    # [N, K]
    # end assignment


class Int4Linear(QuantLinear):
    """int4 weight [out, in // 2] uint8, a float16 scale and a uint8 zero per group [out, in //
    group]: 64 + 3 bytes per 128 weights (0.13x float32). On CUDA in bf16, decode runs torch's
    int4 kernel (tinygemm, as gpt-fast and torchao) on the same levels in its own tiled layout."""

    def __init__(self, linear: nn.Linear, group: int | None = None):
        super().__init__(linear)
        self.group = group or int4_group(self.in_features)
        self.kind = f"int4, group={self.group}"
        q, scale, zero = quantize_int4(linear.weight, self.group)
        self.register_buffer("weight", pack_int4(q))               # [out, in // 2] uint8
        self.register_buffer("scale", scale)                       # [out, in // group] float16
        self.register_buffer("zero", zero)                         # [out, in // group] uint8
        self.tiled = tinygemm_layout(self.weight, scale, zero, self.group, linear.weight.dtype)

    def forward(self, x):
        if (self.tiled is not None and x.is_cuda and x.dtype == torch.bfloat16
                and x.numel() <= INT8_KERNEL_ROWS * self.in_features):   # decode: the kernel reads
            y = torch._weight_int4pack_mm(x.reshape(-1, self.in_features), self.tiled[0],   # the
                                          self.group, self.tiled[1])       # levels, never a float W
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return super().forward(x)

    def dequantized(self, dtype):
        return dequantize_int4(unpack_int4(self.weight), self.scale, self.zero, dtype)


# --- LLM.int8(): int8 x int8 products, the outlier columns in floating point --------------
OUTLIER = 6.0    # |x| above this marks an input column as an outlier (the paper's threshold)


class LLMInt8Linear(Int8Linear):
    """int8 weight [out, in] with a scale per row AND int8 activations. Per call, the input
    columns where any row of x exceeds OUTLIER go through the float product; each row of the rest
    is int8 with a scale and a zero point (the paper's zeropoint variant: its [min, max] onto all
    256 levels; absmax leaves a one-signed row half of them: SmolLM2 +3.4% perplexity, not +0.7%),
    int8 x int8 -> int32 exactly, times both scales. (Columns vary per call: no CUDA graph.)"""
    kind = "llm.int8"
    scale_dtype = torch.float32     # as the paper's (a bf16 scale errs up to 0.4%, a whole row)

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)                                   # int8 weight, scale per row
        self.register_buffer("row_sum", self.weight.sum(1, dtype=torch.int32))   # [out]: for z

    def forward(self, x):
        rows = x.reshape(-1, self.in_features)                                     # [R, in]
        cols = (rows.abs() > OUTLIER).any(0).nonzero().squeeze(1)                  # [C]
        rest = rows.index_fill(1, cols, 0).float()                                 # [R, in]
        lo, hi = rest.amin(1).clamp(max=0), rest.amax(1).clamp(min=0)              # [R], 0 inside
        s = ((hi - lo) / 255).clamp(min=1e-12)            # x ~= s * (xq - z), xq in -128..127
        z = -128 - torch.round(lo / s)                    # an integer: x = 0 is exactly xq = z
        xq = (torch.round(rest / s[:, None]) + z[:, None]).clamp(-128, 127).to(torch.int8)
        pad = max(0, 17 - len(xq)) if x.is_cuda else 0     # CUDA's int8 GEMM: > 16 rows
        acc = torch._int_mm(F.pad(xq, (0, 0, 0, pad)), self.weight.t())[:len(xq)]  # [R, out]
        acc -= z.int()[:, None] * self.row_sum[None, :]   # sum_i (xq_i - z) q_i, in int32
        y = (acc.float() * s[:, None] * self.scale[None, :]).to(x.dtype)
        w_out = dequantize_int8(self.weight[:, cols], self.scale, dtype=x.dtype)
        y = (y + F.linear(rows[:, cols], w_out)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


# --- AWQ: scale the channels that carry large activations up before int4 -----------------
AWQ_GRID = 20    # alpha in 0, 0.05, ..., 0.95 (the paper's grid)
AWQ_ROWS = 256   # output rows the search errs on (evenly spaced): a sample, for a CPU's speed


def awq_search(x: torch.Tensor, weight: torch.Tensor, group: int):
    """AWQ's scales for the linears that read x [T, K] (calibration rows), weight [N, K] their
    rows stacked: per input channel s = mean_t |x[t]|^alpha (sqrt(max(s) * min(s)) = 1), for the
    alpha of the grid whose int4 layer (W * s quantized, then / s: what the folded model
    computes) errs least on x (mean squared output error). Returns (s [K] float32, alpha)."""
    # assignment: awq
    x, weight = x.float(), weight.float()
    mean, ref = x.abs().mean(0), x @ weight.t()                         # [K], [T, N]
    best = (float("inf"), None, None)
    for alpha in [i / AWQ_GRID for i in range(AWQ_GRID)]:
        s = mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        w = dequantize_int4(*quantize_int4(weight * s, group)) / s         # [N, K]
        err = (x @ w.t() - ref).pow(2).mean().item()
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]
    # end assignment


@torch.no_grad()
def awq_scale(model: nn.Module, calibration: list[int]) -> list[float]:
    """Fold AWQ's scales into the float `model`, the same function: per group of linears that
    read one input (seen in one forward pass over the calibration token ids: q/k/v, gate/up,
    down, the LM head), W[:, i] *= s_i and its producer (an RMSNorm's weight, or up's row i
    for down_proj; model.py's MLP has no bias) /= s_i. Not o_proj: under GQA its input
    channels are V's rows, shared by query heads. Returns the alphas."""
    # (producer, the linear reading it): q/k/v and gate/up are fused, one linear per input
    groups = []
    for blk in model.layers:
        a, m = blk.self_attn, blk.mlp
        up = SimpleNamespace(weight=m.gate_up_proj.weight.chunk(2)[1])    # up's rows (a view)
        groups += [(blk.input_layernorm, a.qkv_proj),
                   (blk.post_attention_layernorm, m.gate_up_proj), (up, m.down_proj)]
    if model.lm_head.weight is model.embed_tokens.weight:   # tied: the head scales a copy
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.clone(), requires_grad=False)
    groups.append((model.norm, model.lm_head))
    seen, ids = {}, torch.tensor(calibration, device=next(model.parameters()).device)
    hooks = [lin.register_forward_pre_hook(lambda mod, args: seen.__setitem__(mod, args[0]))
             for _, lin in groups]
    model(ids, torch.arange(len(ids), device=ids.device))
    for h in hooks:
        h.remove()
    alphas = []
    for producer, lin in groups:
        x, w = seen[lin].reshape(-1, lin.in_features), lin.weight                  # [T, K], [N, K]
        s, alpha = awq_search(x, w[::max(1, len(w) // AWQ_ROWS)], int4_group(w.shape[1]))
        w.mul_(s.to(w.dtype))
        producer.weight.div_((s[:, None] if producer.weight.dim() == 2 else s).to(x.dtype))
        alphas.append(alpha)
    return alphas


FORMATS = {"int8": Int8Linear, "fp8": Fp8Linear, "fp8-dynamic": Fp8DynamicLinear,
           "llm.int8": LLMInt8Linear, "int4": Int4Linear, "awq": Int4Linear}


def quantize_model(model: nn.Module, method: str = "int8", calibration=None) -> nn.Module:
    """Swap every nn.Linear for its `method` layer (FORMATS) in place, one at a time (the peak:
    the float model + one layer). "awq" first folds scales calibrated on `calibration` ids."""
    checks.check_quantize(method, FORMATS, any(isinstance(m, QuantLinear) for m in model.modules()),
                          calibration)
    if method == "awq":
        awq_scale(model, calibration)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, FORMATS[method](child))
    return model


def decode_weight_bytes(model: nn.Module) -> int:
    """Weight bytes one decode step reads: every parameter and buffer of every layer (a shared
    one, like a tied head, once), but the embedding table (a lookup reads N rows)."""
    tensors = {t.data_ptr(): t.numel() * t.element_size() for m in model.modules()
               if next(m.children(), None) is None and not isinstance(m, nn.Embedding)
               for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
    return sum(tensors.values())


# --- The int8 KV cache -------------------------------------------------------
def int8_kv_cache_bytes(cfg, num_tokens: int = 1) -> int:
    """2 (K, V) * layers * kv_heads * (head_dim int8 values + one float32 scale) * tokens."""
    return 2 * cfg.kv_layers * cfg.n_kv_heads * (cfg.head_dim + 4) * num_tokens


class Int8KVCache(KVCache):
    """int8 K, V [L, blocks, block_size, n_kv, d] and float32 scales [L, blocks, block_size,
    n_kv], one per token and head. Only write (quantize) and blocks (dequantize) differ: paged
    attention reads through blocks() unchanged; total_bytes and copy_block walk pools()."""
    storage_dtype = torch.int8

    def __init__(self, cfg, num_blocks: int, block_size: int, device, dtype):
        super().__init__(cfg, num_blocks, block_size, device, dtype)         # int8 K, V
        self.k_scale = torch.zeros(self.k.shape[:-1], device=device)        # [L, blocks, bs, n_kv]
        self.v_scale = torch.zeros_like(self.k_scale)
        self.bytes_per_token = int8_kv_cache_bytes(cfg)

    def write(self, layer: int, slots, k, v):
        """Quantize each new token's k, v [N, n_kv, d] per (token, head), then store."""
        for values, store, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            q, scale = quantize_int8(values)                        # [N, n_kv, d], [N, n_kv]
            store_rows(store[layer], slots, q)
            store_rows(scales[layer], slots, scale)

    def blocks(self, layer: int, block_ids):                       # K, V: [*S, bs, n_kv, d]
        return tuple(dequantize_int8(t[layer][block_ids], s[layer][block_ids], dtype=self.dtype)
                     for t, s in ((self.k, self.k_scale), (self.v, self.v_scale)))


def make_kv_cache(cfg, num_blocks: int, block_size: int, kv_cache_dtype, device, dtype,
                  local_blocks: int = 0) -> KVCache:
    """The one place a KV pool is made: the model's dtype (None: K and V, MLA's latents, or
    local + global layers' two pools) or int8."""
    checks.check_kv_cache_dtype(kv_cache_dtype, cfg)
    if kv_cache_dtype == "int8":
        return Int8KVCache(cfg, num_blocks, block_size, device, dtype)
    return new_kv_cache(cfg, num_blocks, block_size, device, dtype, local_blocks)
