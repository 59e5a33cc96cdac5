"""
cache.py -- the KV cache as virtual memory (PagedAttention).

The lesson: caching every earlier token's keys and values makes a decode step O(T) instead of
O(T^2), and makes the cache THE state of inference:

    KV bytes per token = 2 (K and V) * layers * kv_heads * head_dim * bytes_per_value

SmolLM2-135M in float32: 2 * 30 * 3 * 64 * 4 = 46,080 bytes, so a 2048-token sequence holds
94 MB: the cache, not the 540 MB of weights, limits how many sequences fit at once. Each way to
shrink it changes one factor: fewer kv_heads (GQA, MQA: model.py), fewer layers holding K/V
(cross-layer attention, cla_share S: the layers of a group read the first one's: layers / S),
fewer tokens (a sliding window, below).

PagedAttention keeps it in blocks of `block_size` tokens anywhere in one pool: a block table
per sequence maps logical block i -> physical block id, like an OS page table. No memory waits
for lengths never reached; sequences with the same leading tokens share blocks (prefix
caching); n samples of a prompt share its blocks until one writes into a shared one
(copy-on-write); a sliding window (Mistral) gives back the blocks no query can see any more.

Place in the data flow (one engine step, engine.py): BlockManager.reserve gives the new tokens
blocks, flatten_step their input_ids, positions and slots; in each layer ctx.attend (an
AttentionContext) writes the new k, v into their slots (KVCache.write), then runs
paged_attention, the one attention for prefill (cached prefix or not), chunked prefill,
decode (1 query) and draft verification (k + 1 queries).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from model import in_window
from support.checks import check_block_pool, check_local_global, check_positive_ints


# --- Memory accounting: the lecture's formula, used to size the pool ----------
def kv_cache_bytes(cfg, dtype, num_tokens: int = 1) -> int:
    """2 * layers * kv_heads * head_dim * bytes_per_value * tokens, the layers those that hold
    K/V: cfg.kv_layers (every layer; 1 in S with cross-layer attention, cfg.cla_share = S).
    MLA (cfg.kv_lora_rank = r): layers * (r + R) * bytes_per_value * tokens, no factor 2."""
    if cfg.kv_lora_rank:            # one latent and one shared RoPE key: K and V of all heads
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return cfg.kv_layers * latent * (torch.finfo(dtype).bits // 8) * num_tokens
    # assignment: kv-cache-bytes
    bytes_per_value = torch.finfo(dtype).bits // 8
    return 2 * cfg.kv_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_value * num_tokens
    # end assignment


def num_blocks_for_budget(bytes_per_token: int, block_size: int, budget_bytes: int) -> int:
    """How many blocks of `block_size` tokens fit in `budget_bytes`."""
    check_positive_ints(block_size=block_size)
    # assignment: kv-cache-bytes
    return int(budget_bytes // (bytes_per_token * block_size))
    # end assignment


# --- KVCache: the storage ------------------------------------------------------
class KVCache:
    """K and V of every layer: [layers, num_blocks, block_size, n_kv_heads, head_dim]. A token's
    slot, block_id * block_size + offset, is a row of a layer's pool viewed as [slots, n_kv, d]."""
    storage_dtype = None       # K, V in the model's dtype (Int8KVCache: int8; blocks() gives dtype)
    triton_decode = True       # kernels.paged_decode reads this layout (int8, MLA: not yet)

    def __init__(self, cfg, num_blocks: int, block_size: int, device, dtype):
        if num_blocks < 1:
            raise ValueError("the KV cache budget is too small for a single block")
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        # sliding_window: Mistral's W or None (attention masks by it)
        self.sliding_window, self.bytes_per_token = cfg.sliding_window, kv_cache_bytes(cfg, dtype)
        self.allocate(cfg, device, self.storage_dtype or dtype)

    def allocate(self, cfg, device, dtype):
        shape = (cfg.kv_layers, self.num_blocks, self.block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def pools(self) -> list[torch.Tensor]:
        """K, V (and an int8 cache's scales): each [layers, num_blocks, block_size, ...]."""
        return [t for t in vars(self).values() if isinstance(t, torch.Tensor)]

    # the bytes allocated: tests check them against the formula
    total_bytes = property(lambda self: sum(t.numel() * t.element_size() for t in self.pools()))

    def write(self, layer: int, slots, k, v):
        """Store the new tokens' k, v [N, n_kv, d] at their slots [N]."""
        store_rows(self.k[layer], slots, k)
        store_rows(self.v[layer], slots, v)

    def blocks(self, layer: int, block_ids):
        """K, V of the given blocks (any index shape S): [*S, block_size, n_kv, d].
        The one read path: quantize.Int8KVCache overrides it to dequantize."""
        return self.k[layer][block_ids], self.v[layer][block_ids]

    def copy_block(self, src: int, dst: int):
        """Copy-on-write: duplicate a physical block in every layer."""
        for t in self.pools():
            t[:, dst] = t[:, src]


class LatentCache(KVCache):
    """MLA's cache (model.LatentAttention): ONE vector per token and layer, [normed latent c (r
    values) ; rotated shared key k_R (R)], a single KV head of r + R values: K is all of it, V its
    first r values, a view. One pool, no factor 2: [layers, blocks, block_size, 1, r + R]."""
    triton_decode = False

    def allocate(self, cfg, device, dtype):
        self.r = cfg.kv_lora_rank
        shape = (cfg.kv_layers, self.num_blocks, self.block_size, 1, self.r + cfg.qk_rope_head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)

    def write(self, layer: int, slots, k, v):     # k [N, 1, r + R] (v None: it is part of k)
        store_rows(self.k[layer], slots, k)

    def blocks(self, layer: int, block_ids):      # one gather for K and V: [*S, bs, 1, r + R], r
        k = self.k[layer][block_ids]
        return k, k[..., :self.r]


def new_kv_cache(cfg, num_blocks: int, block_size: int, device, dtype, local_blocks: int = 0):
    """The pool cfg's attention reads: MLA's latents, K and V, or two pools (HybridCache)."""
    if cfg.global_every:                      # local + global layers: local_blocks for the local
        return HybridCache(cfg, num_blocks, local_blocks, block_size, device, dtype)
    kind = LatentCache if cfg.kv_lora_rank else KVCache
    return kind(cfg, num_blocks, block_size, device, dtype)


# KVCache.write's in-place write, a custom op that declares what it mutates: torch.compile
# (graphs.py) functionalizes in-place updates, so a bare index_copy_ would copy the whole pool.
@torch.library.custom_op("nanoinfer::store_rows", mutates_args=("dst",))
def store_rows(dst: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """dst viewed as rows [num_slots, *src.shape[1:]]: dst[slots[i]] = src[i]."""
    dst.view(-1, *src.shape[1:]).index_copy_(0, slots, src)


store_rows.register_fake(lambda dst, slots, src: None)   # for the compiler: it returns nothing


# --- Reference paged attention -------------------------------------------------
def paged_attention(q, cache: KVCache, layer: int, block_tables, seq_lens, query_lens,
                    scale: float | None = None):
    """Each sequence's new queries attend over its own paged KV. q: [N, H, d], the B sequences'
    queries end to end: sequence b owns the LAST query_lens[b] of its seq_lens[b] tokens (all
    cached). Query i of b sits at p = seq_lens[b] - query_lens[b] + i and sees 0..p (p-W+1..p
    with a sliding window: the null blocks before, masked). Returns [N, H, dv] (dv: V's width,
    d but for MLA's latent); scores times scale (None: 1/sqrt(d)). A loop; kernels.py vectorizes."""
    # assignment: paged-attention
    N, H, d = q.shape
    n_kv, scale = cache.k.shape[-2], d ** -0.5 if scale is None else scale
    outs, start = [], 0
    for b, (seq_len, n_q) in enumerate(zip(seq_lens, query_lens)):
        n_blocks = math.ceil(seq_len / cache.block_size)
        k, v = cache.blocks(layer, block_tables[b, :n_blocks])    # [n_blocks, bs, n_kv, d]
        k, v = k.flatten(0, 1)[:seq_len], v.flatten(0, 1)[:seq_len]           # [T, n_kv, d]
        qg = q[start:start + n_q].view(n_q, n_kv, H // n_kv, d)              # [n_q, n_kv, G, d]
        scores = torch.einsum("qhgd,khd->hgqk", qg.float(), k.float()) * scale
        # scores: [n_kv, G, n_q, T]
        q_pos = torch.arange(seq_len - n_q, seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]    # [n_q, T]
        if cache.sliding_window:                                     # Mistral: the last W only
            k_pos = torch.arange(seq_len, device=q.device)
            visible &= in_window(q_pos, k_pos, cache.sliding_window)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        o = torch.einsum("hgqk,khd->qhgd", probs, v.float())                # [n_q, n_kv, G, dv]
        outs.append(o.reshape(n_q, H, -1).to(q.dtype))
        start += n_q
    return torch.cat(outs)
    # end assignment


def apply_pending_copies(cache: KVCache, block_manager: "BlockManager"):
    """Copy-on-write: copy the blocks the manager asked for, before anyone writes."""
    for src, dst in block_manager.pending_copies:
        cache.copy_block(src, dst)
    block_manager.pending_copies.clear()


@dataclass
class AttentionContext:
    """The `ctx` Transformer.forward gets for one step: what attention needs. The
    lengths are Python lists: the reference loop reads them with no device sync."""
    cache: KVCache
    slot_mapping: torch.Tensor         # [N] where each new token's k, v go
    block_tables: torch.Tensor         # [B, M] physical block ids per sequence (padded)
    seq_lens: list                     # [B] tokens in cache after this step
    query_lens: list                   # [B] new tokens in this step
    logits_indices: torch.Tensor | None = None   # [R] rows that need logits (None: all)

    def attend(self, layer: int, q, k, v, scale: float | None = None):
        if k is not None:                                   # CLA: a sharing layer only reads
            self.cache.write(layer, self.slot_mapping, k, v)   # write first: a token sees itself
        return paged_attention(q, self.cache, layer, self.block_tables, self.seq_lens,
                               self.query_lens, scale)

    @classmethod
    def build(cls, cache: KVCache, block_manager: "BlockManager", work, logits_rows, device):
        """input_ids[N], positions[N] and a context for `work` (as flatten_step's): the
        simple builder (tests, bench.py); the engine's fast one is graphs.StepInputs."""
        apply_pending_copies(cache, block_manager)
        tables = pad_sequence([torch.tensor(block_manager.tables[sid]) for sid, *_ in work],
                              batch_first=True)                                # [B, W]
        ids, positions, slots, query_lens, seq_lens = flatten_step(
            work, tables.numpy(), np.arange(len(work)), block_manager.block_size)
        on_device = functools.partial(torch.as_tensor, device=device)
        ctx = cls(cache, on_device(slots), tables.to(device), seq_lens.tolist(),
                  query_lens.tolist(), torch.tensor(logits_rows, device=device, dtype=torch.long))
        return on_device(ids), on_device(positions), ctx


# --- One step's work as one flat batch (AttentionContext.build, graphs.StepInputs)
class Work(NamedTuple):
    """One sequence's part of a step (a plain (seq_id, tokens, start, ...) tuple does as well)."""
    seq_id: int
    tokens: list[int]       # the token ids it feeds: a prefill chunk, or 1 (+ drafts)
    start: int              # the position of the first of them


def flatten_step(work, tables: np.ndarray, rows: np.ndarray, block_size: int):
    """The scheduled work (a Work per sequence) as the model's flat batch of N tokens (numpy
    int64, no Python loop over tokens); tables[rows[b]] is work[b]'s block table. Returns
    input_ids[N], positions[N], slot_mapping[N], query_lens[B] (tokens fed) and seq_lens[B]
    (tokens in cache after the step)."""
    query_lens = np.array([len(tokens) for _, tokens, *_ in work], dtype=np.int64)
    starts = np.array([start for _, _, start, *_ in work], dtype=np.int64)
    N = int(query_lens.sum())
    first = np.cumsum(query_lens) - query_lens                        # each sequence's start in [N]
    positions = np.repeat(starts - first, query_lens) + np.arange(N)   # start_b, start_b + 1, ...
    token_rows = np.repeat(rows, query_lens)                          # each token's row of `tables`
    slots = tables[token_rows, positions // block_size] * block_size + positions % block_size
    fed = itertools.chain.from_iterable(tokens for _, tokens, *_ in work)
    return np.fromiter(fed, np.int64, N), positions, slots, query_lens, starts + query_lens


# --- BlockManager: the page table, free list, prefix cache and copy-on-write ---
class BlockManager:
    """Hands out physical blocks to sequences; knows nothing of tensors. A full block's
    prefix-cache key is hash((parent block's key, its token ids)): chaining makes the key
    name the whole prefix, not just the block; collisions are caught by comparing tokens."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window=None):
        check_block_pool(num_blocks, block_size, sliding_window)   # support/checks.py
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks             # sequences using each block (0: free)
        self.free_blocks = OrderedDict.fromkeys(range(num_blocks))   # least recently used first
        self.tables: dict[int, list[int]] = {}        # seq -> block table (logical -> physical)
        self.block_key: dict[int, tuple] = {}        # block -> (hash, parent hash, tokens)
        self.cached: dict[int, int] = {}             # prefix cache: hash of a full block -> block
        self.pending_copies: list[tuple[int, int]] = []   # (src, dst) copy-on-write for the engine
        self.prefix_hits = self.prefix_queries = 0   # in blocks, for the hit rate
        # seq -> (leading blocks in the prefix cache, hash of the last): cache_full_blocks resumes
        self.hashed: dict[int, tuple[int, int | None]] = {}
        self.changed: set[int] = set()   # tables changed: graphs.StepInputs refreshes (and empties)
        # reserve() points entries freed by a sliding window at the null block (held, never written)
        self.sliding_window = sliding_window
        self.null_block = self._take_free() if sliding_window else None

    num_free_blocks = property(lambda self: len(self.free_blocks))
    num_cached_blocks = property(lambda self: len(self.cached))

    # -- low level: take and release physical blocks ----------------------------
    def _take_free(self) -> int:
        """Pop the least recently used free block; forget any prefix it held."""
        if not self.free_blocks:
            raise RuntimeError("KV cache out of blocks (the scheduler should have checked)")
        # assignment: block-allocation
        block, _ = self.free_blocks.popitem(last=False)
        self._forget(block)                         # evicted from the prefix cache
        self.ref_count[block] = 1
        return block
        # end assignment

    def _release(self, block: int):
        """One reference fewer; at ref count 0 the block goes to the BACK of free_blocks (the most
        recently used end: evicted last, so a freed prefix stays cached longest)."""
        # assignment: block-allocation
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0, f"block {block} freed more often than taken"
        if self.ref_count[block] == 0:
            self.free_blocks[block] = None          # most recently used end: evicted last
        # end assignment

    def _key(self, parent_hash, tokens) -> int:
        return hash((parent_hash, tuple(tokens)))

    # -- per sequence --------------------------------------------------------------
    def allocate(self, seq_id: int, token_ids: list[int], use_prefix_cache: bool = True) -> int:
        """Start a block table for a new (or re-admitted) sequence, reusing every leading FULL block
        in the prefix cache; return how many tokens that computed (never the last: the engine needs
        its logits). use_prefix_cache=False (prompt logprobs need every position) reads none."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        table = []
        if self.enable_prefix_caching and use_prefix_cache:
            # assignment: prefix-caching
            bs, parent = self.block_size, None
            for i in range((len(token_ids) - 1) // bs):
                tokens = tuple(token_ids[i * bs:(i + 1) * bs])
                h = self._key(parent, tokens)
                block = self.cached.get(h)
                self.prefix_queries += 1
                if block is None or self.block_key[block][1:] != (parent, tokens):
                    break                            # miss (or a hash collision)
                if self.ref_count[block] == 0:
                    del self.free_blocks[block]      # revive a cached free block
                self.ref_count[block] += 1
                table.append(block)
                self.prefix_hits += 1
                parent = h
            # end assignment
        self.tables[seq_id] = table
        self.hashed[seq_id] = (len(table), parent if table else None)   # hits: registered already
        self.changed.add(seq_id)
        return len(table) * self.block_size

    def can_append(self, seq_id: int, start: int, count: int) -> bool:
        """Are there free blocks for reserve(seq_id, start, count) now?"""
        table, bs = self.tables[seq_id], self.block_size
        end_block = math.ceil((start + count) / bs)
        shared = sum(self.ref_count[b] > 1 for b in table[start // bs:end_block])     # to copy
        # a window: reserve first gives back the blocks behind it (newest first, to a null block)
        behind = (start - self.sliding_window + 1) // bs if self.sliding_window else 0
        freed = sum(self.ref_count[b] == 1 for b in itertools.takewhile(
            lambda b: b != self.null_block, reversed(table[:max(behind, 0)])))
        return max(0, end_block - len(table)) + shared <= len(self.free_blocks) + freed

    def reserve(self, seq_id: int, start: int, count: int):
        """Make room for positions [start, start + count): new blocks at the end of the table,
        and a private copy of each shared block written (copy-on-write: see pending_copies)."""
        table, bs = self.tables[seq_id], self.block_size
        # No query from `start` on sees a position < start - W + 1: free the blocks wholly before.
        if self.sliding_window:
            # assignment: sliding-window
            for i in reversed(range((start - self.sliding_window + 1) // bs)):    # newest first
                if table[i] == self.null_block:
                    break                              # freed before, as is every block before
                self._release(table[i])
                table[i] = self.null_block             # each entry holds a reference, as any
                self.ref_count[self.null_block] += 1
                self.changed.add(seq_id)
            # end assignment
        if not self.can_append(seq_id, start, count):
            raise RuntimeError(f"sequence {seq_id}: the KV pool has no free blocks for {count} "
                               f"more tokens ({len(self.free_blocks)} free of {self.num_blocks})")
        for i in range(start // bs, min(len(table), math.ceil((start + count) / bs))):
            if self.ref_count[table[i]] > 1:         # shared block about to be written
                # assignment: copy-on-write
                new = self._take_free()
                self.pending_copies.append((table[i], new))
                self._release(table[i])
                table[i] = new
                self.changed.add(seq_id)
                # end assignment
            elif table[i] in self.block_key:
                self._forget(table[i])   # kept by truncate() while shared, now rewritten in place
        # assignment: block-allocation
        while len(table) * bs < start + count:
            table.append(self._take_free())
            self.changed.add(seq_id)
        # end assignment

    def append_slots(self, seq_id: int, start: int, count: int) -> list[int]:
        """reserve(), then each new token's slot (the engine's fast path: flatten_step)."""
        self.reserve(seq_id, start, count)
        table, bs = self.tables[seq_id], self.block_size
        # assignment: block-allocation
        return [table[p // bs] * bs + p % bs for p in range(start, start + count)]
        # end assignment

    def cache_full_blocks(self, seq_id: int, token_ids: list[int], num_computed: int):
        """After a step: register newly full, computed blocks in the prefix cache: O(new blocks)."""
        unregistered = self.tables[seq_id][self.hashed.get(seq_id, (0,))[0]:]
        if not self.enable_prefix_caching or self.null_block in unregistered:
            return      # (or the window freed a block before it was registered: the chain is lost)
        # assignment: prefix-caching
        table, bs = self.tables[seq_id], self.block_size
        done, parent = self.hashed.get(seq_id, (0, None))
        for i in range(done, num_computed // bs):
            block = table[i]
            if block not in self.block_key:
                tokens = tuple(token_ids[i * bs:(i + 1) * bs])
                h = self._key(parent, tokens)
                self.block_key[block] = (h, parent, tokens)
                self.cached.setdefault(h, block)     # first copy wins; duplicates stay private
            parent = self.block_key[block][0]
        self.hashed[seq_id] = (max(done, num_computed // bs), parent)
        # end assignment

    def fork(self, parent_id: int, child_id: int):
        """The child shares every block of the parent; nothing is copied now."""
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        # assignment: copy-on-write
        self.tables[child_id] = list(self.tables[parent_id])
        for b in self.tables[child_id]:
            self.ref_count[b] += 1
        self.hashed[child_id] = self.hashed.get(parent_id, (0, None))
        self.changed.add(child_id)
        # end assignment

    def truncate(self, seq_id: int, num_tokens: int):
        """Keep only the blocks of the first num_tokens tokens (rollback of rejected drafts)."""
        table, keep = self.tables[seq_id], math.ceil(num_tokens / self.block_size)
        for block in reversed(table[keep:]):
            self._forget(block)                     # it held rejected drafts: not a valid prefix
            self._release(block)
        del table[keep:]
        if num_tokens % self.block_size and table and self.ref_count[table[-1]] == 1:
            self._forget(table[-1])                 # now only partly valid: no longer a full block
        full = num_tokens // self.block_size
        if self.hashed.get(seq_id, (0, None))[0] > full:   # registered past the cut: re-derive
            key = self.block_key.get(table[full - 1]) if full else None
            self.hashed[seq_id] = (full, key[0]) if key else (0, None)
        self.changed.add(seq_id)

    def _forget(self, block: int):
        """Drop a block from the prefix cache (it is being reused or rewritten)."""
        key = self.block_key.pop(block, None)
        if key is not None and self.cached.get(key[0]) == block:
            del self.cached[key[0]]

    def free(self, seq_id: int):
        """Give back all of a sequence's blocks (they stay cached if full)."""
        if seq_id not in self.tables:
            raise ValueError(f"sequence {seq_id} has no blocks (freed twice?)")
        # assignment: block-allocation
        # tail first: evicted before the head, which a later request is likelier to share
        table = self.tables.pop(seq_id)
        for block in reversed(table):
            self._release(block)
        # never copy into a block given back
        self.pending_copies = [(s, d) for s, d in self.pending_copies if d not in table]
        self.hashed.pop(seq_id, None)
        self.changed.add(seq_id)
        # end assignment

    def check_invariants(self):
        """Consistency of the bookkeeping; tests call this after every operation."""
        counts = Counter([b for table in self.tables.values() for b in table] + [self.null_block])
        assert [counts[b] for b in range(self.num_blocks)] == self.ref_count, \
            "ref counts disagree with the tables"
        assert set(self.free_blocks) == {b for b in range(self.num_blocks) if not self.ref_count[b]}
        assert all(self.block_key[b][0] == h for h, b in self.cached.items())


# --- Local layers with a global one every N: two pools, two block managers ----------
# Only the global layers' K/V live as long as a sequence (bytes per token: L / N layers), the local
# ones a window per seat: one pool cannot free a block for some layers and keep it for others.
def local_pool(cfg, c, dtype) -> tuple[int, int]:
    """(blocks, bytes) of the local layers' pool (c: EngineConfig), never out before the seats and
    the token budget: per seat W's blocks + 2; a step's tokens; the null block. (0, 0): none."""
    if not cfg.global_every:
        return 0, 0
    check_local_global(cfg, c)
    cdiv = lambda a: -(-a // c.block_size)                                   # noqa: E731
    blocks = 1 + c.max_num_seqs * (cdiv(cfg.sliding_window) + 2) + cdiv(c.max_num_batched_tokens)
    local = dataclasses.replace(cfg, n_layers=cfg.n_layers - cfg.kv_layers, global_every=0)
    return blocks, blocks * c.block_size * kv_cache_bytes(local, dtype)


class HybridCache(KVCache):
    """The global layers' K/V in `full`, the local ones' in `local`; where[i]: (0 full / 1 local,
    layer i's index there). copy_block: a local block's id offset by num_blocks."""

    def __init__(self, cfg, num_blocks: int, local_blocks: int, block_size: int, device, dtype):
        glob = [i for i in range(cfg.n_layers) if cfg.window_of(i) is None]
        loc = [i for i in range(cfg.n_layers) if i not in glob]
        part = lambda layers, window: dataclasses.replace(   # noqa: E731 (a pool's own config)
            cfg, n_layers=len(layers), global_every=0, sliding_window=window)
        self.full = KVCache(part(glob, None), num_blocks, block_size, device, dtype)
        self.local = KVCache(part(loc, cfg.sliding_window), local_blocks, block_size, device, dtype)
        self.where = {i: (0, glob.index(i)) if i in glob else (1, loc.index(i)) for i in loc + glob}
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.sliding_window, self.bytes_per_token = cfg.sliding_window, self.full.bytes_per_token

    def pools(self) -> list[torch.Tensor]:                   # (total_bytes sums them)
        return self.full.pools() + self.local.pools()

    def copy_block(self, src: int, dst: int):
        pool, off = (self.local, self.num_blocks) if src >= self.num_blocks else (self.full, 0)
        pool.copy_block(src - off, dst - off)


class HybridBlockManager(BlockManager):
    """Itself the global layers' manager (every block a sequence filled), `local` the windowed
    layers' (it frees what falls behind the window); each call made on both. The scheduler reads
    the global tables and free blocks (the local pool is sized never to run out first)."""

    def __init__(self, num_blocks: int, local_blocks: int, block_size: int, prefix: bool, window):
        super().__init__(num_blocks, block_size, prefix)
        self.local = BlockManager(local_blocks, block_size, prefix, window)

    def allocate(self, seq_id: int, token_ids: list[int], use_prefix_cache: bool = True) -> int:
        """A cached prefix counts if BOTH pools hold it (the local hits bound the global lookup)."""
        hit = self.local.allocate(seq_id, token_ids, use_prefix_cache)
        full_hit = super().allocate(seq_id, token_ids[:hit + 1], use_prefix_cache)
        if full_hit < hit:
            self.local.truncate(seq_id, full_hit)
        return full_hit

    def can_append(self, *args) -> bool:                 # (seq_id, start, count): both have room
        return super().can_append(*args) and self.local.can_append(*args)

    def reserve(self, seq_id: int, start: int, count: int):
        super().reserve(seq_id, start, count)
        self.local.reserve(seq_id, start, count)          # its copies: ids offset by num_blocks
        copies, self.local.pending_copies = self.local.pending_copies, []
        self.pending_copies += [(s + self.num_blocks, d + self.num_blocks) for s, d in copies]

    def free(self, seq_id: int):
        gone = {b + self.num_blocks for b in self.local.tables.get(seq_id, ())}
        super().free(seq_id)
        self.local.free(seq_id)
        self.pending_copies = [(s, d) for s, d in self.pending_copies if d not in gone]

    def _both(method: str):                       # the calls both managers make alike
        def call(self, *args):
            getattr(BlockManager, method)(self, *args)
            getattr(self.local, method)(*args)
        return call

    cache_full_blocks, fork, truncate, check_invariants = map(
        _both, ("cache_full_blocks", "fork", "truncate", "check_invariants"))
