"""
kernels.py -- attention over the paged cache at the speed of its bytes, and the int8 product.

The lesson: a decode step's roofline is (weight bytes + KV bytes read) / memory bandwidth, and
attention is where an engine most easily reads more than that:
  * a Python loop per sequence costs microseconds per sequence per layer ->
    batched_paged_attention + StepContext: any step (prefill chunks, decodes, k+1-token
    verifications, mixed) as a few padded, masked attentions, one per power-of-two query length;
  * the gathered cache copied before attention reads it -> paged_attention_in_place, fused by
    inductor with the gather: each cached byte read once, where it lies;
  * on CUDA, one Triton kernel (_paged_decode_kernel: flash-decoding over pages) does the same in
    one launch; int8 weights become floats in registers, never in memory (_int8_matmul_kernel).

Place in the data flow (LLM.step, engine.py): graphs.StepInputs makes each step's StepContext,
whose attend(layer, q, k, v) every layer calls; the compiled step (graphs.py) calls
paged_attention_in_place or the Triton kernel instead.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from support.gpu import autotune, configs, jit, tl, triton

# True (bench.py --strict-sdpa): on CUDA, SDPA falling back to its math backend raises.
STRICT_SDPA = False


def on_cuda(device) -> bool:
    """Does this run take CUDA's code paths? (tests/cuda_sim.py says yes on a CPU.)"""
    return torch.device(device).type == "cuda"


# --- Batched paged attention: a group of sequences at once ---------------------
def batched_paged_attention(q, cache, layer: int, block_tables, seq_lens, query_lens=None,
                            scale=None):
    """B sequences, up to Q new queries each, attend at once. q: [B, Q, H, d] (real queries
    first), block_tables [B, W], seq_lens [B] (tokens in cache, new ones included), query_lens [B]
    real queries (None: all Q). Query i of b sits at position p = seq_lens[b] - query_lens[b] + i
    and sees keys 0..p (p-W+1..p, W = cache.sliding_window); a padded query gets the last real
    position (a finite softmax, dropped by the caller). Keys past seq_lens are masked: tables may
    be padded with any valid block id. Returns [B, Q, H, dv]: cache.py's masked softmax(q k^T *
    scale) v in PyTorch's fused attention (enable_gqa: query head h reads KV head h // G without
    a copy of K, V per head; on CUDA, or when V is narrower than K (MLA), SDPA has no fused kernel
    for it and would expand K, V per head: grouped_attention)."""
    # assignment: decode-attention
    B, Q, H, d = q.shape
    k, v = cache.blocks(layer, block_tables)                  # [B, W, bs, n_kv, d]: one gather
    n_kv, T = k.shape[-2], block_tables.shape[1] * k.shape[2]
    # k, v: [B, n_kv, T, d] (v: dv)
    k, v = (t.view(B, T, n_kv, t.shape[-1]).transpose(1, 2) for t in (k, v))
    i = torch.arange(Q, device=q.device)
    if query_lens is None:
        q_pos = seq_lens[:, None] - Q + i                                        # [B, Q]
    else:
        q_pos = seq_lens[:, None] - query_lens[:, None] + i
        q_pos = torch.minimum(q_pos, seq_lens[:, None] - 1)            # padding: last real position
    visible = torch.arange(T, device=q.device)[None, None, :] <= q_pos[:, :, None]   # [B, Q, T]
    if cache.sliding_window:            # Mistral: last W only, k > q-W (model.in_window): band mask
        visible &= torch.arange(T, device=q.device) > q_pos[:, :, None] - cache.sliding_window
    if on_cuda(q.device) or v.shape[-1] != d:   # CUDA, or MLA's dv != d: no fused kernel takes it
        out = grouped_attention(q, k, v, visible, scale)
    else:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible[:, None],
                                             enable_gqa=True, scale=scale)
    return out.transpose(1, 2)                                      # [B, H, Q, dv] -> [B, Q, H, dv]
    # end assignment


def grouped_attention(q, k, v, visible, scale=None):
    """batched_paged_attention's SDPA on CUDA, where flash refuses a mask and (torch 2.11) the
    memory-efficient kernel unequal head counts: with both, SDPA silently runs its math backend and
    writes every score to memory. So the G query heads of a KV head become G queries of it: equal
    head counts, a mask row per query, K, V read once per group. q [B, Q, H, d] -> [B, H, Q, d]."""
    (B, Q, H, d), G = q.shape, q.shape[2] // k.shape[1]                       # k, v [B, n_kv, T, d]
    qg = q.reshape(B, Q, -1, G, d).permute(0, 2, 1, 3, 4).reshape(B, -1, Q * G, d)   # row i * G + g
    mask = visible.repeat_interleave(G, dim=1)[:, None]                             # [B, 1, Q*G, T]
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused) if STRICT_SDPA else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [.., Q*G, dv]
    return out.view(B, -1, Q, G, v.shape[-1]).permute(0, 1, 3, 2, 4).reshape(B, H, Q, -1)


@dataclass
class QueryGroup:
    """Sequences whose queries are padded to one length Q (a power of two). index [Bg, Q]: each
    padded query's row of the flat batch (padding: row N, a dummy past the real ones); None: the
    whole batch in order, Q queries each. The rest as batched_paged_attention."""
    index: torch.Tensor | None
    block_tables: torch.Tensor           # [Bg, W]
    seq_lens: torch.Tensor               # [Bg]
    query_lens: torch.Tensor | None      # [Bg]


class StepContext:
    """The `ctx` Transformer.forward gets from the engine (cf. cache.AttentionContext). Why
    groups: padding every query to the step's longest would multiply a mixed step's attention work
    by up to the batch size (a 2000-token prefill chunk next to 63 decodes); within a power-of-two
    length class padding wastes at most 2x (decode: one class)."""

    def __init__(self, cache, slot_mapping, groups: list[QueryGroup], logits_indices=None):
        self.cache, self.slot_mapping, self.groups = cache, slot_mapping, groups
        self.logits_indices = logits_indices      # rows that need logits (None: all)

    def attend(self, layer: int, q, k, v, scale=None):
        if k is not None:                                        # CLA: a sharing layer only reads
            self.cache.write(layer, self.slot_mapping, k, v)     # write first: a token sees itself
        N, H, d = q.shape
        if len(self.groups) == 1 and self.groups[0].index is None:   # decode: no gather, no scatter
            g, B = self.groups[0], self.groups[0].block_tables.shape[0]
            return batched_paged_attention(q.view(B, -1, H, d), self.cache, layer, g.block_tables,
                                           g.seq_lens, g.query_lens, scale).reshape(N, H, -1)
        qx = torch.cat([q, q.new_zeros(1, H, d)])       # row N: where padded queries read and write
        outs = torch.cat([batched_paged_attention(      # a few length classes, not sequences
            qx[g.index], self.cache, layer, g.block_tables, g.seq_lens, g.query_lens, scale
        ).flatten(0, 1) for g in self.groups])                           # each [Bg, Q, H, dv], flat
        index = torch.cat([g.index.flatten() for g in self.groups])     # ... and their rows
        return outs.new_empty(N + 1, H, outs.shape[-1]).index_copy_(0, index, outs)[:N]


# --- The compiled path's attention: the paged cache read where it lies --------
def paged_attention_in_place(q, cache, layer: int, block_tables, q_pos, scale=None):
    """batched_paged_attention's function for torch.compile, in float32. q [B, Q, H, d],
    block_tables [B, W], q_pos [B, Q]: each query's position; it sees keys 0..q_pos (a window: the
    last W). Why: SDPA takes K, V as tensors, so batched_paged_attention first COPIES the blocks
    into a padded [B, T, n_kv, d] tensor, the batch's whole context written and read back per
    layer. Here the gather feeds only products and sums, which inductor fuses into two reductions
    that load K, V through the block table (int8 dequantized there): each cached byte read once.
    Eagerly: a [B, Q, T, H, d] product."""
    B, Q, H, d = q.shape
    k, v = cache.blocks(layer, block_tables)                      # [B, W, bs, n_kv, d]: fused loads
    n_kv, T = k.shape[3], k.shape[1] * k.shape[2]
    k, v = (t.reshape(B, 1, T, n_kv, 1, t.shape[-1]).float() for t in (k, v))   # v: dv wide
    qg = q.reshape(B, Q, 1, n_kv, H // n_kv, d).float()          # GQA: G query heads per KV head
    # G innermost: the G heads sharing a K row are neighbours, so the row is loaded once.
    scores = (qg * k).sum(-1) * (d ** -0.5 if scale is None else scale)   # [B, Q, T, n_kv, G]
    visible = torch.arange(T, device=q.device)[None, None, :] <= q_pos[:, :, None]   # [B, Q, T]
    if cache.sliding_window:                           # Mistral's window (an int: a trace constant)
        visible &= torch.arange(T, device=q.device) > q_pos[:, :, None] - cache.sliding_window
    visible = visible[..., None, None]                                             # [B, Q, T, 1, 1]
    p = scores.masked_fill(~visible, float("-inf")).softmax(dim=2)
    # Masked keys weigh exactly 0, but 0 * NaN is NaN: a block past a sequence's end
    # may hold anything (padding, a stale block), so its values are zeroed, not trusted.
    out = torch.where(visible[..., None], p[..., None] * v, 0.0).sum(2)        # [B, Q, n_kv, G, dv]
    return out.reshape(B, Q, H, -1).to(q.dtype)


# --- On CUDA, the same function as ONE Triton kernel: flash-decoding over pages -------
@jit
def _paged_decode_kernel(q, k, v, tables, q_pos, out, m_out, l_out, scale, window, W, chunk,
                         sq_b, sq_q, sq_h, sk_blk, sk_tok, sk_h, so_s, so_b, so_q, so_h,   # strides
                         Q: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, EXACT: tl.constexpr,
                         ONE_SPLIT: tl.constexpr):  # pragma: no cover (compiled for GPUs by Triton)
    """Program (b, h, s): the Q*G queries of sequence b that share KV head h, against keys
    [s*chunk, (s+1)*chunk) of its pages. Each K, V row is read ONCE, through the block table, for
    all G heads; an online softmax keeps a running max m, sum l and unnormalized output acc. One
    split: the output itself. Several: (acc, m, l) per split, for _combine_splits_kernel."""
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = tl.arange(0, BLOCK_M)                          # row m = query i * G + head g (padded to 16)
    i, real = m // G, m < Q * G
    d = tl.arange(0, D)
    qv = tl.load(q + b * sq_b + i[:, None] * sq_q + (h * G + m % G)[:, None] * sq_h + d[None, :],
                 mask=real[:, None], other=0.0)                                       # [BLOCK_M, D]
    pos = tl.load(q_pos + b * Q + i, mask=real, other=0)                                 # [BLOCK_M]
    last = tl.load(q_pos + b * Q + Q - 1)  # the last query's position (the largest): no key past it
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)      # finite: a row whose tile is all masked adds 0
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    end = tl.minimum(s * chunk + chunk, last + 1)      # this split's keys: [s * chunk, end)
    for start in range(s * chunk, end, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)                                            # key positions
        inside = t < end
        page = tl.load(tables + b * W + t // BS, mask=inside, other=0)
        row = page * sk_blk + (t % BS) * sk_tok + h * sk_h                         # gather: K row t
        kt = tl.load(k + row[:, None] + d[None, :], mask=inside[:, None], other=0.0)  # [BLOCK_T, D]
        vt = tl.load(v + row[:, None] + d[None, :], mask=inside[:, None], other=0.0)
        scores = tl.dot(qv, tl.trans(kt), input_precision="ieee" if EXACT else "tf32") * scale
        seen = (t[None, :] <= pos[:, None]) & inside[None, :]                            # causal
        seen &= (window == 0) | (t[None, :] > pos[:, None] - window)                # sliding window
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)                     # rescale what was summed under the old max
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt,
                                            input_precision="ieee" if EXACT else "tf32")
        m_i = m_new
    o = s * so_s + b * so_b + i * so_q + (h * G + m % G) * so_h    # this split's row of each output
    if ONE_SPLIT:                                       # softmax(q k^T) v, in q's dtype
        tl.store(out + o[:, None] * D + d[None, :], (acc / l_i[:, None]).to(out.dtype.element_ty),
                 mask=real[:, None])
    else:
        tl.store(out + o[:, None] * D + d[None, :], acc, mask=real[:, None])
        tl.store(m_out + o, m_i, mask=real)
        tl.store(l_out + o, l_i, mask=real)


@jit
def _combine_splits_kernel(acc, m, den, out, S, rows, D: tl.constexpr,
                           BLOCK_S: tl.constexpr):  # pragma: no cover (compiled for GPUs by Triton)
    """Row r from its S splits: sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M = max m_s."""
    r, s, d = tl.program_id(0), tl.arange(0, BLOCK_S), tl.arange(0, D)
    ms = tl.load(m + s * rows + r, mask=s < S, other=float("-inf"))                      # [BLOCK_S]
    w = tl.exp(ms - tl.max(ms, axis=0))                                         # each split's share
    ls = tl.load(den + s * rows + r, mask=s < S, other=0.0)
    a = tl.load(acc + (s * rows + r)[:, None] * D + d[None, :], mask=(s < S)[:, None], other=0.0)
    tl.store(out + r * D + d,
             (tl.sum(a * w[:, None], axis=0) / tl.sum(ls * w, axis=0)).to(out.dtype.element_ty))


@torch.library.custom_op("nanoinfer::paged_decode", mutates_args=())
def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
                 q_pos: torch.Tensor, window: int) -> torch.Tensor:
    """paged_attention_in_place's function as Triton kernels (CUDA; a custom op, so torch.compile
    calls it as it is): q [B, Q, H, d], k, v [1, blocks, bs, n_kv, d] (a layer's pool), block_tables
    [B, W], q_pos [B, Q], window (0: none) -> [B, Q, H, d]."""
    return launch_paged_decode(q, k, v, block_tables, q_pos, window)


def launch_paged_decode(q, k, v, block_tables, q_pos, window: int, splits: int | None = None):
    """Flash-decoding: with few (sequence, KV head) pairs to go round (batch 1: n_kv programs), the
    keys are split so that about two programs run per multiprocessor; the splits' (acc, max, sum)
    are combined exactly as one softmax over all the keys. Enough pairs: one split, one kernel."""
    (B, Q, H, d), (bs, n_kv), W = q.shape, k.shape[2:4], block_tables.shape[1]
    BLOCK_T = 64
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        # >= 256 keys a split (triton.cdiv: ceil(a / b) for positive integers, without floats)
        splits = max(1, min(triton.cdiv(2 * sms, B * n_kv), triton.cdiv(W * bs, 256)))
    chunk = triton.cdiv(triton.cdiv(W * bs, splits), BLOCK_T) * BLOCK_T   # per split, whole tiles
    f32 = dict(device=q.device, dtype=torch.float32)              # per split: sum p v, max, sum p
    out = torch.empty_like(q) if splits == 1 else torch.empty(splits, B, Q, H, d, **f32)
    m, den = torch.empty(splits, B, Q, H, **f32), torch.empty(splits, B, Q, H, **f32)
    _paged_decode_kernel[(B, n_kv, splits)](
        q, k, v, block_tables, q_pos, out, m, den, 1 / math.sqrt(d), window, W, chunk,
        *q.stride()[:3], *k.stride()[1:4], *m.stride()[:4],
        Q=Q, G=H // n_kv, D=d, BS=bs, BLOCK_M=max(16, triton.next_power_of_2(Q * H // n_kv)),
        BLOCK_T=BLOCK_T, EXACT=q.dtype == torch.float32, ONE_SPLIT=splits == 1)
    if splits == 1:
        return out
    final, rows = torch.empty_like(q), B * Q * H
    _combine_splits_kernel[(rows,)](out, m, den, final, splits, rows, D=d,
                                    BLOCK_S=triton.next_power_of_2(splits))
    return final


paged_decode.register_fake(lambda q, k, v, block_tables, q_pos, window: torch.empty_like(q))


# --- The int8 weight matmul (quantize.Int8Linear on CUDA) ---------------------------------
def _fitting(cfgs, named_args, **constants):
    """Tiles that fit the rows: 64-row tiles (prefill) take short K steps, or x's tile spills
    registers. (Triton passes the launch's keyword constants, BLOCK_M here, apart.)"""
    rows = {**named_args, **constants}["BLOCK_M"]
    return [c for c in cfgs if rows == 16 or c.kwargs["BLOCK_K"] <= 128]


# Which tile streams a weight fastest depends on its shape and the GPU: Triton times these once per
# (N, K, BLOCK_M) on first use (the engine's warm-up, before CUDA graphs record) and keeps the
# best. W_FIRST: the weight tile is the product's left operand, read row by row as it is stored.
@autotune(configs=configs(*[(n, k, wf, warps) for wf in (0, 1) for n, k, warps in
                            ((16, 512, 4), (32, 256, 4), (32, 512, 4), (64, 256, 4), (64, 512, 8),
                             (32, 64, 4), (64, 64, 4), (64, 128, 4), (128, 64, 8))],
                          names=("BLOCK_N", "BLOCK_K", "W_FIRST")),
          key=["N", "K", "BLOCK_M"], prune_configs_by={"early_config_prune": _fitting})
@jit
def _int8_matmul_kernel(x, w, scale, y, M, N, K, sx, sw, sy, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        W_FIRST: tl.constexpr):  # pragma: no cover (a GPU's kernel)
    """y[M, N] = (x[M, K] @ w[N, K]^T) * scale[N], w int8: program (n, m) streams BLOCK_N weight
    rows once, each byte converted to x's dtype in registers (never in memory), times a BLOCK_M-row
    tile of x on the tensor cores (decode: 1-16 rows, padded: the weight bytes set the time)."""
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
    """The kernel on rows [M, K]: autotuned, or tile = (BLOCK_N, BLOCK_K, W_FIRST, num_warps)."""
    M, (N, K) = rows.shape[0], weight.shape
    y = torch.empty(M, N, device=rows.device, dtype=rows.dtype)
    BLOCK_M = 16 if M <= 16 else 64       # decode batches: one tile of rows; larger: 64 per program
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, BLOCK_M))    # noqa: E731
    kernel, fixed = (_int8_matmul_kernel, {}) if tile is None else \
        (_int8_matmul_kernel.fn, dict(zip(("BLOCK_N", "BLOCK_K", "W_FIRST", "num_warps"), tile)))
    kernel[grid](rows, weight, scale, y, M, N, K, rows.stride(0), weight.stride(0), y.stride(0),
                 BLOCK_M=BLOCK_M, **fixed)
    return y


int8_matmul.register_fake(lambda x, weight, scale: x.new_empty(*x.shape[:-1], weight.shape[0]))
INT8_KERNEL_ROWS = 64  # CUDA: rows up to this through the kernel (decode); more: converted weight

