"""
graphs.py -- the compiled step: every engine step costs its bytes and FLOPs, not its bookkeeping.

The lesson: with attention vectorized (kernels.py), what is left between a decode step and its
roofline is the host's work, removed here in turn:
  * one host-device copy (on a GPU, one synchronization) per small tensor -> StepInputs: the
    inputs built with numpy (cache.flatten_step) from block-table arrays kept across steps, sent
    to the device in ONE copy (Staging);
  * kernel launches (hundreds a GPU step, ~5 us of CPU each), unfused elementwise ops ->
    CompiledDecoder: torch.compile of ONE transformer block (all layers share its graph) and the
    LM head; on CUDA each padded bucket is ONE CUDA graph;
  * the step that admits a request (a prefill chunk beside the running decodes: continuous
    batching's own step) -> "rows": every token is a row of its own, with its own position and
    its sequence's block table. Only attention knows which sequence a row belongs to, and since
    a step writes all its K/V before any row attends, a chunk's token t sees tokens 0..t of its
    sequence exactly as a decode would: a mixed step is a decode step of N rows, so it replays a
    graph too (selective batching, taken to its end).

Place in the data flow (LLM.step, engine.py): StepInputs builds every step's inputs; with
LLM(compile=True), every step of up to MAX_ROWS tokens runs in CompiledDecoder.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.fx.experimental._config
import torch.nn as nn

from cache import BlockManager, HybridBlockManager, HybridCache, flatten_step
from kernels import QueryGroup, StepContext, on_cuda, paged_attention_in_place, paged_decode
from support.gpu import triton

# torch.compile's backend (tests/cuda_sim.py: "aot_eager", whose aten ops it sees).
BACKEND = "inductor"


# --- Step inputs: numpy on the host, one copy to the device --------------------
def query_rows(first, query_lens, Q: int):
    """[B, Q] flat-batch row of each sequence's query i (padding repeats the last real row)
    and [B, Q] mask of the real ones. first[B]: each sequence's first query's row."""
    i = np.arange(Q)[None, :]
    return first[:, None] + np.minimum(i, query_lens[:, None] - 1), i < query_lens[:, None]


class Staging:
    """Many small int64 arrays to the device as ONE asynchronous copy from one pinned buffer
    (each torch.tensor(list) is its own copy, from pageable memory a synchronous one)."""

    def __init__(self, device):
        self.device, self.cuda = torch.device(device), on_cuda(device)
        self.event = torch.cuda.Event() if self.cuda else None
        self.buf = torch.empty(1 << 16, dtype=torch.int64, pin_memory=self.cuda)  # async DMA

    def send(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        total = sum(sizes := [a.size for a in arrays])
        if self.event is not None:
            self.event.synchronize()  # the last copy out, if in flight, would send the new values
        if total > self.buf.numel():
            self.buf = torch.empty(2 * total, dtype=torch.int64, pin_memory=self.cuda)
        host = self.buf[:total]
        if total:
            np.concatenate([np.asarray(a, np.int64).ravel() for a in arrays], out=host.numpy())
        dev = host.to(self.device, non_blocking=True, copy=True)         # one copy
        if self.event is not None:
            self.event.record()                           # ... which the next send waits for
        return [t if a.ndim == 1 else t.view(a.shape) for t, a in zip(dev.split(sizes), arrays)]


@dataclass
class HostBatch:
    """One step's inputs on the host (numpy int64): N tokens of B sequences."""
    input_ids: np.ndarray      # [N]
    positions: np.ndarray      # [N]
    slot_mapping: np.ndarray   # [N]
    query_lens: np.ndarray     # [B] tokens fed this step
    seq_lens: np.ndarray       # [B] tokens in cache after this step
    rows: np.ndarray           # [B] each sequence's row in StepInputs.tables
    logits_rows: np.ndarray | None   # [R] rows that need logits (None: all)


class StepInputs:
    """Builds each step's model inputs from arrays kept across steps. Every running sequence owns
    a row of `tables`, a numpy copy of its block table; only the rows the BlockManager reports
    changed are rewritten: O(batch) a step, not O(blocks)."""

    def __init__(self, block_manager, device):
        self.bm, self.bs = block_manager, block_manager.block_size
        block_manager.changed = set(block_manager.tables)     # from now on, tell us what changes
        self.staging = Staging(device)
        self.tables = np.zeros((16, 8), dtype=np.int64)       # [rows, width], grown on demand
        # seq -> its row of tables; the rows of freed sequences, for reuse
        self.row_of, self.free_rows = {}, []

    def _refresh_tables(self):
        for seq_id in self.bm.changed:
            table = self.bm.tables.get(seq_id)
            if table is None:                                 # freed: its row is reusable
                if seq_id in self.row_of:
                    self.free_rows.append(self.row_of.pop(seq_id))
                continue
            if seq_id not in self.row_of:                 # rows in use are 0..n-1 when none is free
                self.row_of[seq_id] = self.free_rows.pop() if self.free_rows else len(self.row_of)
            row, n, (R, W) = self.row_of[seq_id], len(table), self.tables.shape
            if row >= R or n > W:                        # grow by doubling: amortized O(1) per step
                grow = [(0, 2 * max(row, R) - R), (0, 2 * max(n, W) - W)]       # zeros, after
                self.tables = np.pad(self.tables, grow)
            self.tables[row, :n] = table
        self.bm.changed.clear()

    def host(self, work, logits_rows=None) -> HostBatch:
        """work: a cache.Work (seq_id, tokens fed, first position) per sequence, in batch order."""
        self._refresh_tables()
        rows = np.array([self.row_of[seq_id] for seq_id, *_ in work], dtype=np.int64)
        return HostBatch(*flatten_step(work, self.tables, rows, self.bs), rows,
                         None if logits_rows is None else np.asarray(logits_rows, dtype=np.int64))

    def groups(self, hb: HostBatch):
        """The batch's query-length classes: [(index or None, tables, seq_lens, query_lens)]."""
        qcls = 1 << np.ceil(np.log2(hb.query_lens)).astype(np.int64)     # next power of two
        N, first = len(hb.input_ids), np.cumsum(hb.query_lens) - hb.query_lens
        widths = -(-hb.seq_lens // self.bs)                          # blocks each sequence uses
        out = []
        for Q in np.unique(qcls):
            m = np.nonzero(qcls == Q)[0]
            tables = self.tables[hb.rows[m], :widths[m].max()]
            if len(m) == len(qcls) and (hb.query_lens == Q).all():      # uniform batch: no gather
                return [(None, tables, hb.seq_lens, None)]
            idx, real = query_rows(first[m], hb.query_lens[m], Q)    # [Bg, Q]
            out.append((np.where(real, idx, N), tables, hb.seq_lens[m], hb.query_lens[m]))
        return out

    def device(self, hb: HostBatch, cache):
        """HostBatch -> (input_ids, positions, StepContext) on the device, in one copy."""
        host = [(hb.input_ids, hb.positions, hb.slot_mapping, hb.logits_rows), *self.groups(hb)]
        t = iter(self.staging.send([a for g in host for a in g if a is not None]))   # None: stays
        (ids, pos, slots, rows), *groups = ([a if a is None else next(t) for a in g] for g in host)
        return ids, pos, StepContext(cache, slots, [QueryGroup(*g) for g in groups], rows)


class HybridContext:
    """One step over both pools: layer i attends through its pool's context (HybridInputs)."""

    def __init__(self, contexts, where: dict):
        self.contexts, self.where, self.logits_indices = contexts, where, contexts[0].logits_indices

    def attend(self, layer: int, q, k, v, scale=None):
        group, index = self.where[layer]
        return self.contexts[group].attend(index, q, k, v, scale)


class HybridInputs:
    """Local + global layers (cache.HybridBlockManager): a StepInputs per block manager, and one
    context that sends each layer to its pool's (cache.HybridContext). Eager steps only."""
    tables = None                             # the compiled step's (refused: support/checks.py)

    def __init__(self, block_manager, device):
        self.full = StepInputs(block_manager, device)         # itself the global layers'
        self.local = StepInputs(block_manager.local, device)

    def host(self, work, logits_rows=None) -> HostBatch:
        self.local_batch = self.local.host(work, logits_rows)    # the same tokens, its own slots
        return self.full.host(work, logits_rows)

    def device(self, hb: HostBatch, cache):
        input_ids, positions, full = self.full.device(hb, cache.full)
        local = self.local.device(self.local_batch, cache.local)[2]
        return input_ids, positions, HybridContext((full, local), cache.where)


def new_block_manager(cache, num_blocks: int, prefix_caching: bool, window):
    """The engine's block manager for its pool `cache` (a HybridCache: one per group)."""
    if isinstance(cache, HybridCache):
        return HybridBlockManager(num_blocks, cache.local.num_blocks, cache.block_size,
                                  prefix_caching, window)
    return BlockManager(num_blocks, cache.block_size, prefix_caching, window)


def step_inputs(block_manager, device):
    """The engine's input builder for its block manager."""
    hybrid = isinstance(block_manager, HybridBlockManager)
    return (HybridInputs if hybrid else StepInputs)(block_manager, device)


# --- The compiled step: one block compiled once, a CUDA graph per bucket ------
# A mixed step runs as rows (one per token) up to this many: the scheduler's chunks beside a full
# batch of decodes. Longer steps are compute-bound prefills: there the eager model's launches are
# a small share of the step, and its attention reads each cached block once per chunk, not once
# per token.
MAX_ROWS = 512
# A row repeats its sequence's block table, so a bucket's table is rows x width entries: row
# buckets whose table would exceed this run eagerly (a long-context prefill), never recorded.
MAX_ROW_TABLE = 1 << 18


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to the first that holds max_num_seqs."""
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sizes[:sizes.index(bucket(max_num_seqs, sizes)) + 1]


def row_buckets(max_num_seqs: int, max_rows: int) -> list[int]:
    """The Q = 1 buckets (decodes, and mixed steps as rows): the batch buckets, continued to 64
    rows, then multiples of 64 up to the first that holds max_rows (padding wastes at most a
    third of a step's rows past 128)."""
    small = batch_buckets(max(max_num_seqs, min(max_rows, 64)))
    return small + [n for n in range(128, max_rows + 64, 64) if n > small[-1]]


def width_buckets(max_blocks: int) -> list[int]:
    """Block-table widths: powers of two from 2 up to the first that holds max_blocks."""
    return [2 ** i for i in range(1, max(1, math.ceil(math.log2(max_blocks))) + 1)]


def bucket(n: int, sizes: list[int]) -> int:
    """The smallest bucket that holds n."""
    if n > sizes[-1]:
        raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")
    return next(s for s in sizes if s >= n)


def dynamic(t, *dims):
    """Tell torch.compile, before it first sees t, that these dims vary: one symbolic graph."""
    torch._dynamo.maybe_mark_dynamic(t, dims)
    return t


def size_oblivious():
    """Compile symbolic sizes without special-casing 1 (else batch 1 is a second graph)."""
    return torch.fx.experimental._config.patch(backed_size_oblivious=True)


def layer_cache(cache, layer: int):
    """A cache of the same class holding only `layer` (views, no copy) as its layer 0: one graph
    serves all layers (a layer index would be a trace constant) and any pool size."""
    view = copy.copy(cache)
    for name, t in vars(cache).items():
        if isinstance(t, torch.Tensor):
            setattr(view, name, dynamic(t[layer:layer + 1], 1))
    return view


class LayerContext:
    """The ctx one compiled block sees: its layer's cache (layer_cache: attend() ignores
    the model's layer index), slot_mapping [B*Q], block_tables [B, W], q_pos [B, Q]."""

    def __init__(self, cache, slot_mapping, block_tables, q_pos):
        self.cache, self.slot_mapping = cache, slot_mapping
        self.block_tables, self.q_pos = block_tables, q_pos

    def attend(self, layer: int, q, k, v, scale=None):  # pragma: no cover (torch.compile's trace)
        # Write first (a token sees itself) into the layer's whole [1, ...] pool (`:`, not 0): the
        # graph INPUT the op mutates. AOTAutograd rebuilds a mutated view OF an input from the
        # offset seen in tracing (layer 0's), unguarded: other layers' writes would hit a copy.
        if k is not None:                       # CLA: a sharing layer reads the first one's
            self.cache.write(slice(None), self.slot_mapping, k, v)
        q = q.view(*self.q_pos.shape, *q.shape[1:])                            # [B, Q, H, d]
        # CUDA, Triton, a cache the kernel reads (not int8, not MLA's latents): one kernel
        if q.device.type == "cuda" and triton is not None and self.cache.triton_decode:
            out = paged_decode(q, self.cache.k, self.cache.v, self.block_tables, self.q_pos,
                               self.cache.sliding_window or 0)
        else:
            out = paged_attention_in_place(q, self.cache, 0, self.block_tables, self.q_pos, scale)
        return out.flatten(0, 1)                                       # [B*Q, H, dv]


def _block(block, x, cos, sin, ctx):  # pragma: no cover (compiled: torch.compile's region, a block)
    return block(x, cos, sin, ctx)


def _head(lm_head, x):  # pragma: no cover (compiled: the LM head; int8 fuses there too)
    return lm_head(x)


class CompiledRegion(nn.Module):
    """A module of the model (`module`, a block or the LM head) as a call of the ONE compiled
    graph of its kind, its own weights passed in: a weight is a graph input, so every layer
    shares the block's graph. i: the layer of a block."""

    def __init__(self, compiled, module: nn.Module, i: int | None = None):
        super().__init__()
        self.compiled, self.module, self.i = compiled, module, i


class CompiledBlock(CompiledRegion):
    """Layer i of the model as a call of the ONE compiled graph of a block. ctx.layers[i]: the
    context of its layer (LayerContext, over its layer's cache)."""

    def forward(self, x, cos, sin, ctx):
        return self.compiled(self.module, dynamic(x, 0), dynamic(cos, 0), dynamic(sin, 0),
                             ctx.layers[self.i])


class CompiledHead(CompiledRegion):
    """The LM head as a call of its compiled graph (int8's conversion fuses there too)."""

    def forward(self, x):
        return self.compiled(self.module, dynamic(x, 0))


def compiled_regions(model: nn.Module) -> nn.Module:
    """The model (a shallow copy: the same weights) with every block and the LM head replaced by
    a call of the ONE compiled graph for them: calling it runs model.py's own forward (no drift).
    Regional compilation: one block costs one block's compile whatever the depth; it gives up
    fusion across blocks and pays a guard check per block per call."""
    # Each model and dtype compiled in one process adds variants; dynamo's default limit is 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # Inductor's coalescing analysis (torch 2.11-2.13) asserts on this block's dynamic shapes at
    # Llama-3.1-8B's width on CUDA ("failed to set ranges", an H200); it only picks tilings.
    opts = {"options": {"triton.coalesce_tiling_analysis": False}} if BACKEND == "inductor" else {}
    block, head = (torch.compile(f, fullgraph=True, backend=BACKEND, **opts)
                   for f in (_block, _head))
    regions = copy.copy(model)
    regions._modules = dict(model._modules)       # its own table of submodules, not the model's
    regions.layers = nn.ModuleList(CompiledBlock(block, b, i) for i, b in enumerate(model.layers))
    regions.lm_head = CompiledHead(head, model.lm_head)
    return regions


class CompiledDecoder:
    """Every step of up to max_rows tokens through torch.compile, padded to buckets. Two layouts:
    "queries": Q tokens for each of B sequences (decode: Q = 1; verifying k drafts: Q = k + 1,
    shorter rows padded), each sequence's keys read once for its Q queries; "rows" (a step with a
    prefill chunk): every token a row of its own (Q = 1, B = N), repeating its sequence's block
    table. Why buckets: a CUDA graph replays fixed shapes and addresses, so a step is padded to a
    (Q, B, W) bucket recorded at warm-up: one input copy and one replay. One graph with symbolic
    sizes serves all buckets (CPU runs the same padded code). Padded rows and queries write into
    `scratch_block`, one more than the block manager hands out."""

    def __init__(self, model, cache, max_num_seqs: int, max_blocks_per_seq: int, scratch_block: int,
                 query_sizes=(1,), max_rows: int = MAX_ROWS):
        self.model, self.cache, self.scratch_block = model, cache, scratch_block
        self.batch_sizes = batch_buckets(max_num_seqs)
        self.row_sizes = row_buckets(max_num_seqs, max_rows)          # the Q = 1 buckets
        self.widths = width_buckets(max_blocks_per_seq)
        self.query_sizes = sorted(set(query_sizes) | {1})
        self.device, self.cuda = cache.k.device, on_cuda(cache.k.device)
        self.regions = compiled_regions(model)
        # one view per MODEL layer, of the cache layer it reads (CLA: S layers share one)
        self.layer_caches = [layer_cache(cache, block.self_attn.kv_layer) for block in model.layers]
        # logits: every row of a "queries" bucket; a bigger bucket gathers this many rows first
        self.max_logits = self.batch_sizes[-1] * self.query_sizes[-1]
        rows = max(self.max_logits, self.row_sizes[-1])
        # Static inputs and output at fixed addresses, for CUDA graphs: each bucket uses a prefix.
        long = dict(dtype=torch.long, device=self.device)
        table = max(self.batch_sizes[-1] * self.widths[-1], MAX_ROW_TABLE)     # [B, W] entries
        self.ids, self.positions, self.slots, self.logits_rows, self.tables = (
            torch.zeros(n, **long) for n in (rows, rows, rows, self.max_logits, table))
        self.logits = torch.zeros(self.max_logits, model.config.vocab_size, device=self.device)
        self.staging = Staging(self.device)
        self.keys = set(self.buckets())                     # every bucket a step can use
        self.contexts, self.graphs, self.pool = {}, {}, None
        # steps run per query size (tests, bench), and of them the mixed steps, run as rows
        self.steps, self.row_steps = {Q: 0 for Q in self.query_sizes}, 0

    def layout(self, query_lens, seq_lens, n_logits: int) -> str | None:
        """How a step runs here: "queries" (every sequence feeds <= Q tokens), "rows" (a mixed
        step: each token a row), or None (too big: the caller runs it eagerly). seq_lens: tokens
        in cache after the step; n_logits: rows that need logits."""
        if len(query_lens) <= self.batch_sizes[-1] and max(query_lens) <= self.query_sizes[-1]:
            return "queries"
        N, W = int(sum(query_lens)), int(max(seq_lens) - 1) // self.cache.block_size + 1
        if N > self.row_sizes[-1] or n_logits > self.max_logits:
            return None
        key = (1, bucket(N, self.row_sizes), bucket(W, self.widths))
        return "rows" if key in self.keys else None     # else its table is too big: eager

    def __call__(self, tokens, positions, slots, tables, query_lens=None, logits_rows=None,
                 layout=None, pending=None):
        """One step: tokens, positions, slots [N], tables [B, W] (padded with any valid block),
        query_lens [B] (None: one each), logits_rows (None: all), layout (None: self.layout's),
        pending (rows, src, next_ids): tokens[rows] are next_ids[src], on the device (engine.py's
        overlap; Q = 1 buckets only). Returns logits [rows, V]."""
        tokens, positions, slots, tables = (np.asarray(a, dtype=np.int64)
                                            for a in (tokens, positions, slots, tables))
        qlens = np.asarray([1] * len(tokens) if query_lens is None else query_lens, np.int64)
        layout = layout or self.layout(qlens, positions[np.cumsum(qlens) - 1] + 1,
                                       len(tokens if logits_rows is None else logits_rows))
        if layout is None:
            raise ValueError(f"a step of {len(tokens)} tokens fits no bucket: run it eagerly")
        if layout == "rows":                     # token i: its own row, its sequence's table
            tables, qlens = np.repeat(tables, qlens, axis=0), np.ones(len(tokens), np.int64)
            self.row_steps += 1
        Q = bucket(int(qlens.max()), self.query_sizes)        # W: blocks up to the last position
        key = (Q, bucket(len(qlens), self.row_sizes if Q == 1 else self.batch_sizes),
               bucket(int(positions.max()) // self.cache.block_size + 1, self.widths))
        prow = self._load(key, tokens, positions, slots, tables, qlens, logits_rows, pending)
        self._run(key)
        self.steps[key[0]] += 1
        return self.logits[prow]   # a copy (next step overwrites); prow is on the device: no wait

    def _load(self, key, tokens, positions, slots, tables, qlens, logits_rows=None, pending=None):
        """Pad the flat batch to bucket key = (Q, B, W) in the static inputs (ONE copy; padding
        writes only the scratch block); return the rows of self.logits that hold the real
        queries' logits (logits_rows'), in that copy too: its own would wait for the replay.
        pending: the rows whose token the last step sampled, copied in from the device."""
        (Q, Bp, W), B, scratch = key, len(qlens), self.scratch_block * self.cache.block_size
        src, real = query_rows(np.cumsum(qlens) - qlens, qlens, Q)            # [B, Q] each
        prow = np.flatnonzero(real)[slice(None) if logits_rows is None else logits_rows]   # [R]
        (ids, pos), slot = np.zeros((2, Bp, Q), np.int64), np.full((Bp, Q), scratch)
        ids[:B], pos[:B] = np.where(real, tokens[src], 0), positions[src]
        slot[:B] = np.where(real, slots[src], scratch)
        table = np.full((Bp, W), self.scratch_block, dtype=np.int64)
        table[:B, :tables.shape[1]] = tables[:, :W]
        gather = np.zeros(self.max_logits, np.int64)    # a big bucket: its LM head's rows, first
        if Q * Bp > self.max_logits:
            gather[:len(prow)], prow = prow, np.arange(len(prow))
        rows, src, next_ids = pending or (np.zeros(0, np.int64),) * 3
        arrays = (ids, pos, slot, table, gather, prow, rows, src)
        *parts, prow, rows, src = self.staging.send([np.asarray(a).ravel() for a in arrays])
        for static, part in zip((self.ids, self.positions, self.slots, self.tables,
                                 self.logits_rows), parts):
            static[:part.numel()].copy_(part)            # ... then into the graph's fixed addresses
        if pending is not None:                  # Q = 1: flat row i is padded row i
            assert Q == 1, "a token sampled on the device feeds a Q = 1 bucket"
            self.ids[rows] = next_ids[src]
        return prow

    def _bucket(self, key):
        """The static inputs of bucket (Q, B, W) and its per-layer contexts (made once)."""
        if key not in self.contexts:
            (Q, B, W), n = key, key[0] * key[1]
            # q_pos: each query's position, which bounds its keys
            q_pos, slots = dynamic(self.positions[:n].view(B, Q), 0, 1), dynamic(self.slots[:n], 0)
            tables = dynamic(self.tables[:B * W].view(B, W), 0, 1)
            layers = [LayerContext(c, slots, tables, q_pos) for c in self.layer_caches]
            # all rows get logits, or (more rows than the logits buffer) the gathered ones
            gather = self.logits_rows if n > self.max_logits else None
            ctx = SimpleNamespace(layers=layers, logits_indices=gather)
            self.contexts[key] = (self.ids[:n], self.positions[:n], ctx)
        return self.contexts[key]

    def _forward(self, key):
        """The step itself: Transformer.forward's code over the compiled blocks."""
        ids, positions, ctx = self._bucket(key)
        with size_oblivious():
            logits = self.regions(ids, positions, ctx)                           # [rows, V]
        self.logits[:len(logits)].copy_(logits)

    def _run(self, key):
        """Run bucket `key` on what its static inputs hold: its CUDA graph's replay, or the step."""
        self.graphs[key].replay() if key in self.graphs else self._forward(key)

    def _record(self, key):
        """CUDA: record bucket `key`'s whole step, eager parts included, as ONE graph (not
        one per region as mode="reduce-overhead"), in a pool shared by all buckets."""
        self._forward(key)                                   # compiles (first bucket) and warms up
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._forward(key)
        self.pool, self.graphs[key] = graph.pool(), graph

    def buckets(self) -> list[tuple]:
        """Every (Q, B, W) a step can use: Q = 1 over the row buckets (a row bucket past the
        batch only where its table fits MAX_ROW_TABLE), Q > 1 over the batch buckets."""
        return [(Q, B, W) for Q in self.query_sizes
                for B in (self.row_sizes if Q == 1 else self.batch_sizes) for W in self.widths
                if B <= self.batch_sizes[-1] or B * W <= MAX_ROW_TABLE]

    def warmup_buckets(self) -> list[tuple]:
        """The (Q, B, W) run at warm-up. CUDA: all, biggest first so the shared pool fits them. CPU,
        per Q: batch 1 and max, narrowest; batch 1, widest; the most rows: all guards crossed."""
        if self.cuda:
            return sorted(self.buckets(), key=lambda k: -k[0] * k[1] * k[2])
        lo, hi = self.widths[0], self.widths[-1]
        return [k for Q in self.query_sizes
                for k in ((Q, 1, lo), (Q, self.batch_sizes[-1], lo), (Q, 1, hi))] + \
            [(1, self.row_sizes[-1], lo)]

    def load_scratch(self, key):
        """Load bucket `key`'s static inputs with no real row (writes go to the scratch block)."""
        none = np.zeros(0, np.int64)
        self._load(key, none, none, none, np.zeros((0, 1), np.int64), none)

    def scratch_step(self, key=None):
        """Bucket `key`'s step on scratch rows; no key: the steps of the buckets that need the most
        memory (what step_memory's budget must hold): the most queries at the widest table, the
        most rows (their activations)."""
        keys = [key] if key else [(self.query_sizes[-1], self.batch_sizes[-1], self.widths[-1]),
                                  max(self.buckets(), key=lambda k: (k[0] * k[1], k[2]))]

        def step():
            for key in keys:
                self.load_scratch(key)
                self._forward(key)
        return step

    @torch.inference_mode()                   # as LLM.step runs (grad mode is guarded on)
    def warmup(self) -> float:
        """Compile (and on CUDA record) every bucket now, on scratch rows only; seconds. On a rerun
        (serve.py) scratch rows are reloaded first: the last step's slots are in others' blocks."""
        t0 = time.perf_counter()
        for key in self.warmup_buckets():
            self.load_scratch(key)
            (self._record if self.cuda and key not in self.graphs else self._run)(key)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0
