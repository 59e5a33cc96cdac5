"""
kernels.py -- the fast path: every engine step costs its bytes and FLOPs, not its bookkeeping.

The lesson: the roofline of a decode step is

    step time >= (weight bytes + KV cache bytes read) / memory bandwidth

and an engine is far from it for reasons that are not bytes:
  * Python per sequence: a loop over the batch in attention, or in building
    the step's inputs, costs microseconds per sequence per layer; at batch
    256 that alone exceeds the whole step's bytes;
  * host-device traffic: every small tensor made from a Python list is a
    separate copy (and on a GPU a separate synchronization point);
  * on a GPU a step is hundreds of tiny kernel launches (30 layers x norms,
    projections, RoPE, attention, ...), each ~5 us of CPU-side overhead,
    while the whole step's bytes take less time than that. CUDA graphs record
    the step once and replay it with a single launch;
  * small elementwise ops (RMSNorm, RoPE, SiLU * up) each read and write
    their tensor again; fusing them removes the round trips.

This file removes them in that order:
  1. batched_paged_attention: one padded, masked attention for a whole group
     of sequences over their paged KV cache; StepContext runs every step kind
     (prefill chunks, decodes, k+1-token verifications, mixed) as a handful of
     such groups, one per padded query length -- never a loop over sequences.
     cache.paged_attention stays the readable reference the tests hold it to.
  2. StepInputs: a step's inputs built with numpy from arrays kept across
     steps (each sequence's block table is copied only when it changes), sent
     to the device in ONE copy from pinned memory.
  3. paged_attention_in_place: the compiled path's attention. The eager one
     copies every sequence's blocks into a padded tensor for SDPA (each
     cached byte written and read again, per layer per step); written as
     products and sums instead, the gather fuses into inductor's reduction
     kernels, which read the paged cache where it lies: each byte once.
  4. CompiledDecoder: decode and verification steps (Q = 1, or k + 1 tokens
     per sequence) through torch.compile. Compiled ONCE: one transformer
     block (all layers run the same graph) and the LM head, with batch,
     query length and table width symbolic; Transformer.forward's own code
     drives them. On CUDA each padded bucket is recorded as one CUDA graph,
     so a step is one input copy and one replay. Measured on this project's
     2-core CPU: LLM(compile=True) of the default model started in 287 s
     (README; 375-383 s on a loaded machine), now in 15 s with one thread
     (20-27 s with two, loaded), 4 s from a warm inductor cache. Before, the
     whole 30-block step was compiled twice (86 s, then 120 s: batch 1 was
     a graph of its own) and each of 72 buckets ran once (~180 s). On an H100 the whole-step
     compile with CUDA graphs took 3.3 ms per batch-1 step against 38 ms
     eager (README); the present design is not measured on a GPU yet.

Why buckets: a CUDA graph replays fixed shapes and addresses, so the engine
pads each step to a bucket of batch sizes (1, 2, 4, 8, 16, then multiples of
16), block-table widths (powers of two) and query lengths (1, k + 1); every
bucket is recorded at start-up (warm-up), never in the middle of serving.
Padded rows are real rows of the graph: they write their k, v into a
scratch block that no sequence owns, so they never touch a real sequence's
cache. On CPU there is nothing to record; the same padded code runs.

Place in the data flow (LLM.step, scheduler.py): after Scheduler.schedule,
StepInputs turns the scheduled work into (input_ids, positions, StepContext);
Transformer.forward(..., ctx) calls ctx.attend(layer, q, k, v) in every
layer. With LLM(compile=True), a step whose sequences each feed at most k + 1
tokens (decodes, verifications) goes through CompiledDecoder instead.
"""
from __future__ import annotations

import copy
import functools
import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.fx.experimental._config
import torch.nn.functional as F

# ----------------------------------------------------------------------------
# Batched paged attention: a group of sequences at once
# ----------------------------------------------------------------------------


def batched_paged_attention(q, cache, layer: int, block_tables, seq_lens, query_lens=None):
    """Each of B sequences has up to Q new queries; all attend at once.

    q: [B, Q, H, d] (sequence b's queries first, padding after), block_tables:
    [B, W], seq_lens: [B] tokens in cache including the new ones, query_lens:
    [B] real queries per sequence (None: all Q). Query i of sequence b sits
    at position seq_lens[b] - query_lens[b] + i and sees keys 0..position.
    Padded queries (i >= query_lens[b]) are given the last real position, so
    their softmax stays finite; the caller drops their output. Keys past a
    sequence's length (padding of its block table) are masked out, so a
    table may be padded with any valid block id. Returns [B, Q, H, d].

    The gather makes each sequence's paged K, V one padded [T, n_kv, d] run;
    then it is exactly the masked softmax(q k^T / sqrt(d)) v of cache.py's
    reference, computed by PyTorch's fused attention (one kernel for scores,
    mask, softmax and the weighted sum; enable_gqa: query head h reads KV head
    h // G, the grouping of the reference, without copying K, V per head).
    """
    # assignment: decode-attention
    B, Q, H, d = q.shape
    k, v = cache.blocks(layer, block_tables)                  # [B, W, bs, n_kv, d]: one gather
    n_kv, T = k.shape[-2], block_tables.shape[1] * k.shape[2]
    k, v = k.view(B, T, n_kv, d).transpose(1, 2), v.view(B, T, n_kv, d).transpose(1, 2)   # [B, n_kv, T, d]
    i = torch.arange(Q, device=q.device)
    if query_lens is None:
        q_pos = seq_lens[:, None] - Q + i                                        # [B, Q]
    else:
        q_pos = seq_lens[:, None] - query_lens[:, None] + i
        q_pos = torch.minimum(q_pos, seq_lens[:, None] - 1)                      # padding: last real position
    visible = torch.arange(T, device=q.device)[None, None, :] <= q_pos[:, :, None]   # [B, Q, T]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible[:, None],
                                         enable_gqa=True)                        # [B, H, Q, d]
    return out.transpose(1, 2)
    # end assignment


@dataclass
class QueryGroup:
    """Sequences whose queries are padded to one length Q (a power of two).

    index[Bg, Q]     row of the flat batch each padded query comes from; padding
                     points at row N, a dummy row past the real ones. None: the
                     group is the whole batch in order (every sequence has Q).
    block_tables[Bg, W], seq_lens[Bg], query_lens[Bg] as batched_paged_attention.
    """
    index: torch.Tensor | None
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor | None


class StepContext:
    """The `ctx` Transformer.forward gets from the engine (cf. cache.AttentionContext).

    Why groups: padding every sequence to the longest query of the step would
    multiply a mixed step's attention work by up to the batch size (a 2000-token
    prefill chunk next to 63 decodes); padding within a power-of-two length
    class wastes at most 2x, and a step has only a few classes (decode: one).
    """

    def __init__(self, cache, slot_mapping, groups: list[QueryGroup], logits_indices=None):
        self.cache, self.slot_mapping, self.groups = cache, slot_mapping, groups
        self.logits_indices = logits_indices      # rows that need logits (None: all)

    def attend(self, layer: int, q, k, v):
        self.cache.write(layer, self.slot_mapping, k, v)         # write first: a token sees itself
        N, H, d = q.shape
        if len(self.groups) == 1 and self.groups[0].index is None:   # decode: no gather, no scatter
            g = self.groups[0]
            B = g.block_tables.shape[0]
            out = batched_paged_attention(q.view(B, N // B, H, d), self.cache, layer, g.block_tables,
                                          g.seq_lens, g.query_lens)
            return out.reshape(N, H, d)
        qx = torch.cat([q, q.new_zeros(1, H, d)])                # row N: where padded queries read and write
        out = torch.empty_like(qx)
        for g in self.groups:                                    # a few length classes, not sequences
            o = batched_paged_attention(qx[g.index], self.cache, layer, g.block_tables, g.seq_lens,
                                        g.query_lens)            # [Bg, Q, H, d]
            out[g.index.flatten()] = o.flatten(0, 1)
        return out[:N]


def decode_step(model, cache, tokens, positions, slots, tables):
    """One eager decode step (one new token per sequence) from Python lists:
    a convenience for tests and experiments; the engine uses StepInputs.
    Tables are padded with their own first block (masked out by seq_lens)."""
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=cache.k.device)   # noqa: E731
    width = max(map(len, tables))
    group = QueryGroup(None, as_tensor([t + t[:1] * (width - len(t)) for t in tables]),
                       as_tensor([p + 1 for p in positions]), None)
    return model(as_tensor(tokens), as_tensor(positions), StepContext(cache, as_tensor(slots), [group]))


# ----------------------------------------------------------------------------
# The compiled path's attention: the paged cache read where it lies
# ----------------------------------------------------------------------------

def paged_attention_in_place(q, cache, layer: int, block_tables, q_pos):
    """batched_paged_attention's function, written for torch.compile.

    q: [B, Q, H, d]; block_tables: [B, W]; q_pos: [B, Q], the position of
    each query, which sees keys 0..q_pos (padded queries repeat a real one's
    position). Returns [B, Q, H, d], computed in float32 like the reference.

    Why another formulation: batched_paged_attention hands SDPA, an opaque
    kernel, K and V as tensors, so the gather through the block tables must
    first COPY every sequence's blocks into a padded [B, T, n_kv, d] tensor:
    per layer per step it writes, and SDPA reads back, as many bytes as the
    batch's whole context. Here the same gather (cache.blocks) feeds nothing
    but elementwise products and sums, which inductor fuses into two reduction
    kernels that load K and V through the block table themselves: each cached
    byte is read once, and the copy never exists. The int8 cache's
    dequantization (inside cache.blocks) fuses into the same loads. Run
    eagerly, these lines do materialize the gather and a [B, Q, T, H, d]
    product: they are for the compiler (the eager engine keeps SDPA).
    """
    B, Q, H, d = q.shape
    k, v = cache.blocks(layer, block_tables)                       # [B, W, bs, n_kv, d]: fused loads
    n_kv, T = k.shape[3], k.shape[1] * k.shape[2]
    k = k.reshape(B, 1, T, n_kv, 1, d).float()
    v = v.reshape(B, 1, T, n_kv, 1, d).float()
    qg = q.reshape(B, Q, 1, n_kv, H // n_kv, d).float()          # GQA: G query heads per KV head
    # Scores [B, Q, T, n_kv, G]: G innermost, so the G heads that share a K
    # row are neighbours in one kernel and the row is loaded once for them.
    scores = (qg * k).sum(-1) / math.sqrt(d)
    visible = torch.arange(T, device=q.device)[None, None, :] <= q_pos[:, :, None]   # [B, Q, T]
    visible = visible[..., None, None]                                               # [B, Q, T, 1, 1]
    p = scores.masked_fill(~visible, float("-inf")).softmax(dim=2)
    # Masked keys get weight exactly 0, but 0 * NaN is NaN: a block past a
    # sequence's end may hold anything (a padded table column, a stale block),
    # so its values are zeroed in the same fused load rather than trusted.
    out = torch.where(visible[..., None], p[..., None] * v, 0.0).sum(2)             # [B, Q, n_kv, G, d]
    return out.reshape(B, Q, H, d).to(q.dtype)


_compiled_attention = None


def attention_bandwidth(cache, n_heads: int, batch: int, context: int, repeats: int = 5) -> dict:
    """Achieved bandwidth of one layer's decode attention (bench.py calls it).

    `batch` sequences of `context` tokens each, over distinct random blocks of
    the pool (cycling through the pool if it is too small), one query each.
    Bytes = the K and V bytes those tokens occupy in the cache (scales
    included for an int8 cache): what an attention that reads every byte
    once must read. Returns seconds and GB/s for the compiled in-place
    attention and for the eager gather + SDPA (batched_paged_attention).
    """
    global _compiled_attention
    if _compiled_attention is None:
        _compiled_attention = torch.compile(paged_attention_in_place, fullgraph=True)
    device, bs = cache.k.device, cache.block_size
    width = -(-context // bs)
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randperm(cache.num_blocks, generator=gen).repeat(-(-batch * width // cache.num_blocks))
    tables = blocks[:batch * width].view(batch, width).to(device)
    dtype = getattr(cache, "dtype", cache.k.dtype)                   # an int8 cache computes in its model's dtype
    q = torch.randn(batch, 1, n_heads, cache.k.shape[-1], generator=gen).to(device, dtype)
    q_pos = torch.full((batch, 1), context - 1, device=device)
    seq_lens = q_pos[:, 0] + 1
    dynamic(q, 0), dynamic(tables, 0, 1), dynamic(q_pos, 0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    one = layer_cache(cache, 0)                                      # as the compiled step reads a layer
    with torch.inference_mode(), size_oblivious():
        t_fused = _median_seconds(lambda: (_compiled_attention(q, one, 0, tables, q_pos), sync()), repeats)
        t_gather = _median_seconds(lambda: (batched_paged_attention(q, cache, 0, tables, seq_lens), sync()), repeats)
    nbytes = batch * context * cache.bytes_per_token // cache.k.shape[0]     # one layer's share
    return {"bytes": nbytes, "in_place_s": t_fused, "in_place_GBps": nbytes / t_fused / 1e9,
            "gather_s": t_gather, "gather_GBps": nbytes / t_gather / 1e9}


# ----------------------------------------------------------------------------
# Step inputs: numpy on the host, one copy to the device
# ----------------------------------------------------------------------------

def next_pow2(x):
    """Elementwise smallest power of two >= x (x >= 1), for numpy int arrays."""
    return 1 << np.ceil(np.log2(np.maximum(x, 1))).astype(np.int64)


class Staging:
    """Send many small int64 arrays to the device as ONE copy.

    Each torch.tensor(list) on a GPU is its own host-to-device copy, and a copy
    from ordinary (pageable) memory makes the host wait for it. Concatenating
    all of a step's arrays into one pinned buffer turns that into one
    asynchronous copy; the device tensors are views of the one copy. The
    buffer is reused next step, which is safe because the engine waits for
    each step's sampled tokens (one synchronization) before building the next.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.buf = torch.empty(1 << 16, dtype=torch.int64, pin_memory=self.pinned)

    def send(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if total > self.buf.numel():
            self.buf = torch.empty(2 * total, dtype=torch.int64, pin_memory=self.pinned)
        host = self.buf[:total]
        if total:
            np.concatenate([np.asarray(a, dtype=np.int64).ravel() for a in arrays], out=host.numpy())
        dev = host.to(self.device, non_blocking=True, copy=True)         # one copy
        return [t.view(a.shape) for t, a in zip(dev.split(sizes), arrays)]


@dataclass
class HostBatch:
    """One step's inputs on the host (numpy int64): N tokens of B sequences."""
    input_ids: np.ndarray      # [N]
    positions: np.ndarray      # [N]
    slot_mapping: np.ndarray   # [N]
    rows: np.ndarray           # [B] each sequence's row in StepInputs.tables
    seq_lens: np.ndarray       # [B] tokens in cache after this step
    query_lens: np.ndarray     # [B] tokens fed this step
    logits_rows: np.ndarray | None   # [R] rows that need logits (None: all)


class StepInputs:
    """Builds each step's model inputs from arrays kept across steps.

    Every running sequence owns a row of `tables`, a numpy copy of its block
    table. The BlockManager records which sequences' tables changed (a new
    block every block_size tokens, a copy-on-write, a truncation, a free), and
    only those rows are rewritten: the host work of a step is O(batch), not
    O(total blocks). Slots are computed from the rows, not kept per token.
    """

    def __init__(self, block_manager, device):
        self.bm, self.bs = block_manager, block_manager.block_size
        block_manager.changed = set(block_manager.tables)     # from now on, tell us what changes
        self.staging = Staging(device)
        self.tables = np.zeros((16, 8), dtype=np.int64)       # [rows, width], grown on demand
        self.row_of: dict[int, int] = {}
        self.free_rows = list(range(15, -1, -1))

    def _refresh_tables(self):
        for seq_id in self.bm.changed:
            table = self.bm.tables.get(seq_id)
            if table is None:                                 # freed: its row is reusable
                row = self.row_of.pop(seq_id, None)
                if row is not None:
                    self.free_rows.append(row)
                continue
            if seq_id not in self.row_of:
                if not self.free_rows:                        # double the rows
                    n = len(self.tables)
                    self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
                    self.free_rows = list(range(2 * n - 1, n - 1, -1))
                self.row_of[seq_id] = self.free_rows.pop()
            if len(table) > self.tables.shape[1]:             # double the width
                wider = np.zeros((len(self.tables), 2 * max(len(table), self.tables.shape[1])), np.int64)
                wider[:, :self.tables.shape[1]] = self.tables
                self.tables = wider
            self.tables[self.row_of[seq_id], :len(table)] = table
        self.bm.changed.clear()

    def host(self, work, logits_rows=None) -> HostBatch:
        """work: (seq_id, token ids fed, first position) per sequence, in batch order."""
        self._refresh_tables()
        ids = []
        for _, tokens, _ in work:
            ids += tokens
        rows = np.array([self.row_of[w[0]] for w in work], dtype=np.int64)
        starts = np.array([w[2] for w in work], dtype=np.int64)
        counts = np.array([len(w[1]) for w in work], dtype=np.int64)
        first_row = np.cumsum(counts) - counts                        # where each sequence starts in [N]
        N = int(counts.sum())
        positions = np.repeat(starts - first_row, counts) + np.arange(N)
        token_rows = np.repeat(rows, counts)
        # slot = block_id * block_size + offset, block_id from the sequence's table
        slots = self.tables[token_rows, positions // self.bs] * self.bs + positions % self.bs
        return HostBatch(np.array(ids, dtype=np.int64), positions, slots, rows, starts + counts, counts,
                         None if logits_rows is None else np.asarray(logits_rows, dtype=np.int64))

    def groups(self, hb: HostBatch):
        """Split the batch into query-length classes: [(index or None, tables, seq_lens, query_lens)]."""
        qcls = next_pow2(hb.query_lens)
        N, first = len(hb.input_ids), np.cumsum(hb.query_lens) - hb.query_lens
        widths = -(-hb.seq_lens // self.bs)                          # blocks each sequence uses
        out = []
        for Q in np.unique(qcls):
            m = np.nonzero(qcls == Q)[0]
            tables = self.tables[hb.rows[m], :widths[m].max()]
            if len(m) == len(qcls) and (hb.query_lens == Q).all():   # the whole batch, uniform: no gather
                out.append((None, tables, hb.seq_lens, None))
                continue
            idx = first[m, None] + np.arange(Q)[None, :]             # [Bg, Q]
            idx = np.where(np.arange(Q)[None, :] < hb.query_lens[m, None], idx, N)
            out.append((idx, tables, hb.seq_lens[m], hb.query_lens[m]))
        return out

    def device(self, hb: HostBatch, cache):
        """HostBatch -> (input_ids, positions, StepContext) on the device, in one copy."""
        groups = self.groups(hb)
        arrays = [hb.input_ids, hb.positions, hb.slot_mapping]
        if hb.logits_rows is not None:
            arrays.append(hb.logits_rows)
        for g in groups:
            arrays += [a for a in g if a is not None]
        t = iter(self.staging.send(arrays))
        input_ids, positions, slots = next(t), next(t), next(t)
        logits_indices = next(t) if hb.logits_rows is not None else None
        ctx_groups = [QueryGroup(*(None if a is None else next(t) for a in g)) for g in groups]
        return input_ids, positions, StepContext(cache, slots, ctx_groups, logits_indices)


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
# The compiled step: one block compiled once, a CUDA graph per bucket
# ----------------------------------------------------------------------------

def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to the first that holds max_num_seqs."""
    sizes = []
    for s in itertools.chain((1, 2, 4, 8), itertools.count(16, 16)):
        sizes.append(s)
        if s >= max_num_seqs:
            return sizes


def width_buckets(max_blocks: int) -> list[int]:
    """Block-table widths: powers of two from 2 up to the first that holds max_blocks."""
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


def dynamic(t, *dims):
    """Tell torch.compile, before it first sees t, that these dimensions vary
    from call to call: it then compiles one graph with symbolic sizes instead
    of one graph per size (and a second one when a size first changes)."""
    for dim in dims:
        torch._dynamo.maybe_mark_dynamic(t, dim)
    return t


def size_oblivious():
    """Compile symbolic sizes without special-casing 1. By default a size-1
    dimension is a constant in the graph (1 broadcasts, so the code differs),
    which made batch 1 a second full compilation. Here the graph compiled
    for "any size" also serves 1: every size is matched exactly, none broadcast."""
    return torch.fx.experimental._config.patch(backed_size_oblivious=True)


def layer_cache(cache, layer: int):
    """A cache object of the same class holding only `layer`, as its layer 0.

    Its tensors are views of the pool ([layer:layer + 1], no copy). Every
    block's compiled call then reads "layer 0" of an object with the same
    shapes: one graph serves all layers. A layer index in the traced code
    would be a constant, and a different constant is a different graph."""
    view = copy.copy(cache)
    for name, t in vars(cache).items():
        if isinstance(t, torch.Tensor):
            setattr(view, name, t[layer:layer + 1])
    return view


class LayerContext:
    """The ctx one compiled block sees: its layer's cache, the step's tables.

    slot_mapping [B*Q], block_tables [B, W], q_pos [B, Q]: padded as in
    CompiledDecoder._pad. attend() ignores the layer index the model passes
    (see layer_cache): self.cache holds just this layer."""

    def __init__(self, cache, slot_mapping, block_tables, q_pos):
        self.cache, self.slot_mapping, self.block_tables, self.q_pos = cache, slot_mapping, block_tables, q_pos

    def attend(self, layer: int, q, k, v):  # pragma: no cover (runs only inside torch.compile's trace)
        self.cache.write(0, self.slot_mapping, k, v)                  # write first: a token sees itself
        B, Q = self.q_pos.shape
        out = paged_attention_in_place(q.view(B, Q, *q.shape[1:]), self.cache, 0, self.block_tables, self.q_pos)
        return out.flatten(0, 1)                                       # [B*Q, H, d]


class StepLayers:
    """The ctx Transformer.forward gets on the compiled path: one LayerContext
    per layer (CompiledModel hands each block its own); every row gets logits."""

    def __init__(self, layers: list[LayerContext]):
        self.layers, self.logits_indices = layers, None


def _block(block, x, cos, sin, ctx):  # pragma: no cover (compiled: the region torch.compile sees, one block)
    return block(x, cos, sin, ctx)


def _head(lm_head, x):  # pragma: no cover (compiled: the LM head; int8 fuses there too)
    return lm_head(x)


class CompiledModel:
    """What Transformer.forward reads from `self`, with every block and the
    LM head replaced by a call of the ONE compiled graph for them.

    Regional compilation: the decoder is 30 identical blocks, and compiling
    the whole step traced, lowered and generated code for all 30 (the
    figures are in the file's docstring). Compiling one block and reusing it
    costs one block's compilation whatever the depth. Transformer.forward's own code runs the step (embedding, RoPE
    angles, final norm, the loop over blocks), so the compiled path cannot
    drift from model.py. What it gives up: fusion across block boundaries
    (a residual add with the next norm), and a guard check per block per
    call (microseconds; on CUDA the recorded graph replays without them).
    """

    def __init__(self, model):
        self.config, self.inv_freq = model.config, model.inv_freq
        self.embed_tokens, self.norm = model.embed_tokens, model.norm
        # Each model and dtype compiled in one process (tests, bench.py) adds variants
        # to these two functions' caches; dynamo's default limit is 8.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        block, head = torch.compile(_block, fullgraph=True), torch.compile(_head, fullgraph=True)
        self.layers = [functools.partial(self._run_block, block, i, b) for i, b in enumerate(model.layers)]
        self.lm_head = lambda x: head(model.lm_head, dynamic(x, 0))

    @staticmethod
    def _run_block(compiled, i, block, x, cos, sin, ctx: StepLayers):
        return compiled(block, dynamic(x, 0), dynamic(cos, 0), dynamic(sin, 0), ctx.layers[i])


class CompiledDecoder:
    """Decode and verification steps through torch.compile, padded to buckets.

    A step feeds Q tokens for each of B sequences (decode: Q = 1; verifying
    k drafts: Q = k + 1, shorter rows padded) over block tables W wide.
    Padding to buckets bounds the distinct (Q, B, W): on CUDA each is
    recorded once as a CUDA graph (at warm-up, never while serving) and a
    step is one copy of its inputs and one graph replay. The compiled code
    itself is one graph with symbolic sizes, so compiling costs the same
    whatever the number of buckets.

    cache must have one block more than the block manager hands out: block
    `scratch_block` is where padded rows and padded queries write.
    """

    def __init__(self, model, cache, max_num_seqs: int, max_blocks_per_seq: int, scratch_block: int,
                 query_sizes=(1,)):
        self.model, self.cache, self.scratch_block = model, cache, scratch_block
        self.batch_sizes, self.widths = batch_buckets(max_num_seqs), width_buckets(max_blocks_per_seq)
        self.query_sizes = sorted(set(query_sizes) | {1})
        self.device = cache.k.device
        self.cuda = self.device.type == "cuda"
        self.regions = CompiledModel(model)
        self.layer_caches = [layer_cache(cache, i) for i in range(model.config.n_layers)]
        rows = self.batch_sizes[-1] * self.query_sizes[-1]
        # Static inputs and output: a CUDA graph reads and writes fixed addresses,
        # so every bucket's step uses a prefix of these (on CPU too: one code path).
        long = dict(dtype=torch.long, device=self.device)
        self.ids, self.positions, self.slots = (torch.zeros(rows, **long) for _ in range(3))
        self.tables = torch.zeros(self.batch_sizes[-1] * self.widths[-1], **long)
        self.logits = torch.zeros(rows, model.config.vocab_size, device=self.device)
        self.host = torch.zeros(3 * rows + self.tables.numel(), dtype=torch.long, pin_memory=self.cuda)
        self.contexts, self.graphs, self.pool = {}, {}, None
        self.steps = {Q: 0 for Q in self.query_sizes}        # steps run per query size (tests, bench)
        self.warm = False

    def fits(self, query_lens) -> bool:
        """Can a step with these per-sequence query lengths run here?"""
        return len(query_lens) <= self.batch_sizes[-1] and max(query_lens) <= self.query_sizes[-1]

    def __call__(self, tokens, positions, slots, tables, query_lens=None, logits_rows=None):
        """One step from the flat batch (numpy or lists): tokens, positions and
        slots [N], each sequence's block table (rows of an array, or lists),
        query_lens [B] (None: one token each), logits_rows: rows of the flat
        batch that need logits (None: all). Returns logits [rows, V]."""
        tokens, positions, slots = (np.asarray(a, dtype=np.int64) for a in (tokens, positions, slots))
        qlens = np.ones(len(tokens), np.int64) if query_lens is None else np.asarray(query_lens, np.int64)
        if isinstance(tables, list):
            rows = np.full((len(tables), max(map(len, tables))), self.scratch_block, dtype=np.int64)
            for i, t in enumerate(tables):
                rows[i, :len(t)] = t
            tables = rows
        last = positions[np.cumsum(qlens) - 1]                            # each sequence's last position
        key = (bucket(int(qlens.max()), self.query_sizes), bucket(len(qlens), self.batch_sizes),
               bucket(int(last.max()) // self.cache.block_size + 1, self.widths))
        prow = self._load(key, tokens, positions, slots, tables, qlens)
        self._run(key)
        self.steps[key[0]] += 1
        if logits_rows is not None:
            prow = prow[np.asarray(logits_rows, dtype=np.int64)]
        return self.logits[torch.from_numpy(prow).to(self.device)]    # a copy: the next step overwrites

    def _load(self, key, tokens, positions, slots, tables, qlens):
        """Pad the step to bucket key = (Q, B, W), put it into the static
        inputs (ONE host-to-device copy) and return where each of the N real
        rows lands in the padded [B * Q] rows. Padded queries of a real
        sequence repeat its last query's position (so their softmax is
        finite) and write their k, v into the scratch slot; padded sequences
        are token 0 at position 0 over a table of scratch blocks. Table
        columns past a sequence's length hold any valid block: masked."""
        Q, Bp, W = key
        B, scratch = len(qlens), self.scratch_block * self.cache.block_size
        i = np.arange(Q)[None, :]
        real = i < qlens[:, None]                                             # [B, Q]
        src = (np.cumsum(qlens) - qlens)[:, None] + np.minimum(i, qlens[:, None] - 1)   # flat row of each query
        ids, pos, slot = np.zeros((Bp, Q), np.int64), np.zeros((Bp, Q), np.int64), np.full((Bp, Q), scratch)
        if B:
            ids[:B], pos[:B] = np.where(real, tokens[src], 0), positions[src]
            slot[:B] = np.where(real, slots[src], scratch)
        table = np.full((Bp, W), self.scratch_block, dtype=np.int64)
        w = min(W, tables.shape[1])
        table[:B, :w] = tables[:, :w]
        n = Bp * Q
        host = self.host[:3 * n + Bp * W]
        np.concatenate([ids.ravel(), pos.ravel(), slot.ravel(), table.ravel()], out=host.numpy())
        dev = host.to(self.device, non_blocking=True)         # one copy (a no-op on CPU) ...
        for static, part in zip((self.ids, self.positions, self.slots, self.tables),
                                dev.split([n, n, n, Bp * W])):
            static[:part.numel()].copy_(part)                   # ... then into the graph's fixed addresses
        return (np.arange(B)[:, None] * Q + i)[real]

    def _bucket(self, key):
        """The static inputs of bucket (Q, B, W) and its per-layer contexts (made once)."""
        if key not in self.contexts:
            Q, B, W = key
            n = B * Q
            q_pos = dynamic(self.positions[:n].view(B, Q), 0, 1)        # a query's position bounds its keys
            tables = dynamic(self.tables[:B * W].view(B, W), 0, 1)
            slots = dynamic(self.slots[:n], 0)
            ctx = StepLayers([LayerContext(c, slots, tables, q_pos) for c in self.layer_caches])
            self.contexts[key] = (self.ids[:n], self.positions[:n], ctx)
        return self.contexts[key]

    def _forward(self, key):
        """The step itself: Transformer.forward's code over the compiled blocks."""
        ids, positions, ctx = self._bucket(key)
        with size_oblivious():
            logits = type(self.model).forward(self.regions, ids, positions, ctx)    # [B*Q, V]
        self.logits[:len(ids)].copy_(logits)

    def _run(self, key):
        if key in self.graphs:
            self.graphs[key].replay()  # pragma: no cover (CUDA graphs)
        else:
            self._forward(key)

    def _record(self, key):  # pragma: no cover (CUDA graphs)
        """CUDA: record bucket `key`'s step as a CUDA graph. By hand rather than
        with mode="reduce-overhead": that mode records per compiled region,
        and with one region per block a step would be 31 replays, each with
        its Python bookkeeping; here the whole step, eager parts included, is
        ONE graph. All graphs share one memory pool: they never run at once."""
        self._forward(key)                                   # compiles (first bucket) and warms up
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._forward(key)
        self.pool = graph.pool()
        self.graphs[key] = graph

    def warmup_buckets(self) -> list[tuple]:
        """The (Q, B, W) run at warm-up. CUDA: every one (each is a graph to
        record), biggest first so that the shared memory pool fits them all.
        CPU: for each Q, the smallest and biggest batch at the narrowest width
        and batch 1 at the widest. The graph has symbolic sizes and its guards
        only relate them (N = B * Q), except int8's row-count threshold
        (quantize.py), whose two sides the extremes reach; every bucket would
        cost minutes here (a batch-64 step alone takes about a second).
        """
        if self.cuda:  # pragma: no cover (CUDA: every bucket is a graph)
            keys = itertools.product(self.query_sizes, self.batch_sizes, self.widths)
            return sorted(keys, key=lambda k: -k[0] * k[1] * k[2])
        lo, hi = self.widths[0], self.widths[-1]
        return [k for Q in self.query_sizes for k in ((Q, 1, lo), (Q, self.batch_sizes[-1], lo), (Q, 1, hi))]

    @torch.inference_mode()                   # as LLM.step runs (grad mode is guarded on)
    def warmup(self) -> float:
        """Compile (and on CUDA record) every bucket now, on scratch rows only.
        Called again (serve.py does, from its engine thread), it only replays
        the recorded graphs. Returns seconds."""
        t0 = time.perf_counter()
        if self.warm:
            for graph in self.graphs.values():
                graph.replay()  # pragma: no cover (CUDA graphs)
        else:
            empty = np.zeros(0, dtype=np.int64)
            for key in self.warmup_buckets():
                self._load(key, empty, empty, empty, np.zeros((0, 1), np.int64), empty)
                if self.cuda:  # pragma: no cover (CUDA graphs)
                    self._record(key)
                else:
                    self._forward(key)
            self.warm = True
        if self.cuda:  # pragma: no cover (CUDA)
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0
