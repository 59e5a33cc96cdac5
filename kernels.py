"""
kernels.py -- compiled decode paths: make each decode step cost only its bytes.

The lesson: the roofline of a decode step is

    step time >= (weight bytes + KV cache bytes read) / memory bandwidth

and at batch 1 a small model is far from it for reasons that are not bytes:
  * on a GPU a step is hundreds of tiny kernel launches (30 layers x norms,
    projections, RoPE, attention, ...), each ~5 us of CPU-side overhead, while
    the whole step's bytes take less time than that. CUDA graphs record the
    step once and replay it with a single launch;
  * the reference paged attention (cache.py) loops over sequences in Python;
  * small elementwise ops (RMSNorm, RoPE, SiLU * up) each read and write
    their tensor again; fusing them removes the round trips.

The vectorized attention below removes the loop; torch.compile does the
rest from the same Python: it fuses elementwise ops (inductor), and with
mode="reduce-overhead" it runs the compiled step as a CUDA graph. That mode
is the one CUDA-specific line of this file; everything else runs, and is
tested, on CPU. Measured on an H100 (README): the eager decode step of
SmolLM2-135M took 38 ms at batch 1, all of it host overhead; compiled, 3.3 ms.

A CUDA graph replays fixed shapes, so the engine pads each decode batch to a
bucket of sizes (1, 2, 4, 8, 16, then multiples of 16) and each block table
to a power-of-two width: one recorded graph per (batch, width) bucket, all
recorded at start-up (warm-up), never in the middle of serving. Padded rows
are real rows of the graph: they write their k, v into a scratch block that
no sequence owns, so they never touch a real sequence's cache. Inductor
itself compiles batch size and width as symbolic sizes, so the compiled
code is shared by every bucket (plus one specialization for batch 1): the
compile cost does not grow with the number of buckets.

Place in the data flow: in LLM.step(), a batch in which every sequence feeds
exactly one token (pure decode) goes through decode_step() below, or through
CompiledDecoder when LLM(compile=True); prefill and verification steps use
the reference paged attention through cache.AttentionContext. All end in
Transformer.forward(..., ctx): this file only supplies another ctx whose
attend() is vectorized.
"""
from __future__ import annotations

import itertools
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------
# Vectorized paged attention for decode (and small verify) batches
# ----------------------------------------------------------------------------


def paged_decode_attention(q, cache, layer: int, block_tables, seq_lens):
    """Every sequence has the same number Q of new queries (1 for decode).

    q: [B*Q, H, d], block_tables: [B, M], seq_lens: [B] tensor (tokens in
    cache, including the Q new ones). Same result as cache.paged_attention,
    without its Python loop: one gather of every sequence's blocks, one
    masked softmax. Keys past a sequence's length (padding of its block
    table) are masked out, so a table may be padded with any block id.
    """
    B, M = block_tables.shape
    Q, (H, d) = q.shape[0] // B, q.shape[1:]
    k, v = cache.blocks(layer, block_tables)                  # [B, M, bs, n_kv, d]
    n_kv, T = k.shape[-2], M * k.shape[2]
    k, v = k.reshape(B, T, n_kv, d), v.reshape(B, T, n_kv, d)  # [B, T, n_kv, d]
    qg = q.view(B, Q, n_kv, H // n_kv, d)                      # [B, Q, n_kv, G, d]: GQA by grouping
    scores = torch.einsum("bqhgd,bthd->bhgqt", qg, k).float() / math.sqrt(d)   # [B, n_kv, G, Q, T]
    # query i of sequence b sits at position seq_lens[b] - Q + i and sees keys 0..that position
    q_pos = seq_lens[:, None] - Q + torch.arange(Q, device=q.device)           # [B, Q]
    visible = torch.arange(T, device=q.device)[None, None, :] <= q_pos[:, :, None]   # [B, Q, T]
    probs = scores.masked_fill(~visible[:, None, None], float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhgqt,bthd->bqhgd", probs.to(v.dtype), v)              # [B, Q, n_kv, G, d]
    return out.reshape(B * Q, H, d)


class DecodeContext:
    """The ctx Transformer.forward gets on the compiled path (cf. cache.AttentionContext)."""

    def __init__(self, cache, slot_mapping, block_tables, seq_lens):
        self.cache, self.slot_mapping = cache, slot_mapping
        self.block_tables, self.seq_lens = block_tables, seq_lens
        self.logits_indices = None          # decode: every row samples

    def attend(self, layer: int, q, k, v):
        self.cache.write(layer, self.slot_mapping, k, v)     # write first: a token sees itself
        return paged_decode_attention(q, self.cache, layer, self.block_tables, self.seq_lens)


def decode_step(model, cache, tokens, positions, slots, tables):
    """One eager decode step (one new token per sequence) through the
    vectorized attention: the engine's decode path when not compiled.
    Tables are padded with their own first block (masked out by seq_lens)."""
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=cache.k.device)   # noqa: E731
    width = max(map(len, tables))
    ctx = DecodeContext(cache, as_tensor(slots), as_tensor([t + t[:1] * (width - len(t)) for t in tables]),
                        as_tensor([p + 1 for p in positions]))
    return model(as_tensor(tokens), as_tensor(positions), ctx)                        # [B, V]


# ----------------------------------------------------------------------------
# Weight layout: read the weights at the machine's bandwidth
# ----------------------------------------------------------------------------
# At batch 1 every linear layer is a matrix-vector product, and its speed is
# the speed at which the BLAS library streams the weight. Measured on this
# project's 2-core CPU (bench.py reproduces it): F.linear with the usual
# [out, in] weight read the 49152x576 LM head at ~12 GB/s, while x @ W with
# W stored [in, out] read it at ~27 GB/s, next to the ~33 GB/s of a plain
# copy; the whole decode step went from 59 ms to 48 ms. With [out, in] each
# output is a separate short dot product (576 values); with [in, out] the
# kernel adds up rows of W scaled by x[i], long contiguous runs that vectorize
# and split across cores. A GPU's cuBLAS has no such gap, so the layout is
# chosen by measuring both on the device, not by the device's name.

class TransposedLinear(nn.Module):
    """nn.Linear with its weight stored [in, out]: y = x @ W_t (+ bias)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous())   # [in, out]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x):
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def _median_seconds(fn, repeats: int = 7) -> float:
    fn()                                                    # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2]


def choose_weight_layout(model: nn.Module) -> str:
    """Time a batch-1 product through the model's largest linear layer both
    ways; if [in, out] is more than 10% faster, store every nn.Linear that way
    (in place). Returns "transposed" or "default". Int8 layers are left alone
    (their kernel wants [out, in]). A tied LM head gets its own transposed copy.
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        return "default"
    big = max(linears, key=lambda m: m.weight.numel())
    w = big.weight.detach()
    x, w_t = torch.randn(1, w.shape[1], device=w.device, dtype=w.dtype), w.t().contiguous()
    sync = torch.cuda.synchronize if w.is_cuda else (lambda: None)
    t_default = _median_seconds(lambda: (F.linear(x, w), sync()))
    t_transposed = _median_seconds(lambda: (x @ w_t, sync()))
    del w_t
    if t_transposed > 0.9 * t_default:
        return "default"
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, TransposedLinear(child))
    return "transposed"


# ----------------------------------------------------------------------------
# The compiled decode step with batch and width buckets
# ----------------------------------------------------------------------------

def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to the first that holds max_num_seqs."""
    sizes = []
    for s in itertools.chain((1, 2, 4, 8), itertools.count(16, 16)):
        sizes.append(s)
        if s >= max_num_seqs:
            return sizes


def width_buckets(max_blocks: int) -> list[int]:
    """Block-table widths: powers of two from 2 (a size-1 dimension would get
    a graph of its own) up to the first that holds max_blocks."""
    sizes = [2]
    while sizes[-1] < max_blocks:
        sizes.append(2 * sizes[-1])
    return sizes


def bucket(n: int, sizes: list[int]) -> int:
    """The smallest bucket that holds n."""
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


class CompiledDecoder:
    """Runs pure decode steps through torch.compile with padded, bucketed shapes.

    cache must have one block more than the block manager hands out: block
    `scratch_block` is where padded rows write.
    """

    def __init__(self, model, cache, max_num_seqs: int, max_blocks_per_seq: int, scratch_block: int):
        self.model, self.cache, self.scratch_block = model, cache, scratch_block
        self.batch_sizes = batch_buckets(max_num_seqs)
        self.widths = width_buckets(max_blocks_per_seq)
        self.device = cache.k.device
        # Enough cached graphs for every bucket; dynamo's default limit is 8.
        limit = len(self.batch_sizes) * len(self.widths) + 8
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, limit)
        # The pool's shape never changes, and CUDA graphs may update it in place
        # only if its address never changes either: say both to the compiler.
        for t in vars(cache).values():
            if isinstance(t, torch.Tensor):
                torch._dynamo.mark_static(t)
                torch._dynamo.mark_static_address(t)
        mode = "reduce-overhead" if self.device.type == "cuda" else None   # CUDA graphs: the one CUDA line
        self._compiled = torch.compile(self._step, mode=mode, fullgraph=True)

    def _step(self, input_ids, positions, slot_mapping, block_tables, seq_lens):
        ctx = DecodeContext(self.cache, slot_mapping, block_tables, seq_lens)
        return self.model(input_ids, positions, ctx)                    # [B_pad, V]

    def __call__(self, tokens, positions, slots, tables):
        """One decode step for B sequences: their last token, its position and
        slot, and their block tables. Returns logits [B, V]."""
        B, width = len(tokens), max(map(len, tables))
        inputs = self._pad(tokens, positions, slots, tables, bucket(B, self.batch_sizes), bucket(width, self.widths))
        return self._run(*inputs)[:B].clone()   # clone: a CUDA graph reuses its output buffer next replay

    def _pad(self, tokens, positions, slots, tables, Bp, W):
        """Inputs padded to Bp rows and W table columns. A padded row is token
        0 at position 0, written to the scratch slot, attending only to itself
        (seq_len 1) through a table of scratch blocks."""
        pad, scratch_slot = Bp - len(tokens), self.scratch_block * self.cache.block_size
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)   # noqa: E731
        return (as_tensor(tokens + [0] * pad),                                          # input_ids [Bp]
                as_tensor(positions + [0] * pad),                                       # positions [Bp]
                as_tensor(slots + [scratch_slot] * pad),                                # slot_mapping [Bp]
                as_tensor([t + [self.scratch_block] * (W - len(t)) for t in tables]
                          + [[self.scratch_block] * W] * pad),                          # block_tables [Bp, W]
                as_tensor([p + 1 for p in positions] + [1] * pad))                      # seq_lens [Bp]

    def _run(self, input_ids, positions, slot_mapping, block_tables, seq_lens):
        # Batch size and table width are symbolic in the compiled code, so one
        # graph serves every bucket (B = 1 is specialized: a size-1 dimension
        # always is). Buckets still matter: a CUDA graph is recorded per
        # distinct shape, and padding bounds their number.
        for t in (input_ids, positions, slot_mapping, block_tables, seq_lens):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(block_tables, 1)
        return self._compiled(input_ids, positions, slot_mapping, block_tables, seq_lens)

    @torch.inference_mode()                   # as LLM.step runs (grad mode is guarded on)
    def warmup(self) -> float:
        """Compile every (batch, width) bucket now, on scratch rows only. Returns seconds."""
        t0 = time.perf_counter()
        for B in self.batch_sizes:
            for W in self.widths:
                for _ in range(2 if self.device.type == "cuda" else 1):   # CUDA graphs record on a rerun
                    self._run(*self._pad([], [], [], [], B, W))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0
