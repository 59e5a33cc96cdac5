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
  3. CompiledDecoder: torch.compile of the pure-decode step over padded batch
     buckets; with mode="reduce-overhead" on CUDA it replays CUDA graphs.
     That mode is the one CUDA-specific line here; everything else runs, and
     is tested, on CPU. Measured on an H100 (README): the eager decode step of
     SmolLM2-135M took 38 ms at batch 1, all of it host overhead; compiled, 3.3 ms.

A CUDA graph replays fixed shapes, so the engine pads each decode batch to a
bucket of sizes (1, 2, 4, 8, 16, then multiples of 16) and each block table
to a power-of-two width: one recorded graph per (batch, width) bucket, all
recorded at start-up (warm-up), never in the middle of serving. Padded rows
are real rows of the graph: they write their k, v into a scratch block that
no sequence owns, so they never touch a real sequence's cache.

Place in the data flow (LLM.step, scheduler.py): after Scheduler.schedule,
StepInputs turns the scheduled work into (input_ids, positions, StepContext);
Transformer.forward(..., ctx) calls ctx.attend(layer, q, k, v) in every
layer. A pure decode step goes through CompiledDecoder when LLM(compile=True).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
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

    @property
    def is_decode(self) -> bool:
        return bool((self.query_lens == 1).all())


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
        self.staging = Staging(self.device)
        mode = "reduce-overhead" if self.device.type == "cuda" else None   # CUDA graphs: the one CUDA line
        self._compiled = torch.compile(self._step, mode=mode, fullgraph=True)

    def _step(self, input_ids, positions, slot_mapping, block_tables, seq_lens):
        ctx = StepContext(self.cache, slot_mapping, [QueryGroup(None, block_tables, seq_lens, None)])
        return self.model(input_ids, positions, ctx)                    # [B_pad, V]

    def __call__(self, tokens, positions, slots, tables):
        """One decode step for B sequences: their last token, its position and
        slot ([B] each), and their block tables (a list of lists, or an array
        [B, >= blocks in use]). Returns logits [B, V]."""
        B = len(tokens)
        width = max(p // self.cache.block_size + 1 for p in positions)   # blocks in use
        if isinstance(tables, list):
            rows = np.full((B, max(map(len, tables))), self.scratch_block, dtype=np.int64)
            for i, t in enumerate(tables):
                rows[i, :len(t)] = t
            tables = rows
        inputs = self._pad(np.asarray(tokens), np.asarray(positions), np.asarray(slots), tables,
                           bucket(B, self.batch_sizes), bucket(width, self.widths))
        return self._run(*self.staging.send(inputs))[:B].clone()   # clone: a CUDA graph reuses its output

    def _pad(self, tokens, positions, slots, tables, Bp, W):
        """Inputs padded to Bp rows and W table columns (numpy). A padded row is
        token 0 at position 0, written to the scratch slot, attending only to
        itself (seq_len 1) through a table of scratch blocks. Table columns a
        sequence does not use hold any block id: seq_lens masks them out."""
        B = len(tokens)
        scratch_slot = self.scratch_block * self.cache.block_size
        padded = np.full((Bp, W), self.scratch_block, dtype=np.int64)       # block_tables [Bp, W]
        w = min(W, tables.shape[1])
        padded[:B, :w] = tables[:, :w]
        pad = lambda x, fill: np.concatenate([np.asarray(x, dtype=np.int64), np.full(Bp - B, fill)])  # noqa: E731
        return [pad(tokens, 0), pad(positions, 0), pad(slots, scratch_slot), padded, pad(positions + 1, 1)]

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
                    empty = np.zeros(0, dtype=np.int64)
                    self._run(*self.staging.send(self._pad(empty, empty, empty, np.zeros((0, 1), np.int64), B, W)))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0
