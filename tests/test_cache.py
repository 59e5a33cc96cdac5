"""Assignment: cache.py -- the paged KV cache.

To pass, implement:
  * kv_cache_bytes: 2 * layers * kv_heads * head_dim * bytes per token, and a
    KVCache whose real allocation matches it;
  * paged_attention / AttentionContext.attend: write the new k, v into their
    slots, then let each query attend to its own sequence's cached tokens at
    positions <= its own. It must equal dense causal attention (PyTorch's
    SDPA) for every block size, ragged batch, cached prefix and query length;
  * BlockManager: free list, reference counts, block tables, slot mapping,
    prefix caching with chained hashes and LRU eviction, copy-on-write forks,
    truncation; loud errors on misuse;
  * sliding-window attention (Mistral), with model.in_window: a query at position
    p sees p-W+1..p only, and reserve() frees the blocks wholly before the window
    of its first new position (their table entries point at the null block), so
    a sequence holds <= ceil(W / block_size) + 1 blocks however long it runs.
"""
import random

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config, tiny_model

from cache import AttentionContext, BlockManager, KVCache, kv_cache_bytes, num_blocks_for_budget, paged_attention
from model import read_config


# ------------------------------------------------------------ memory accounting

@pytest.mark.assignment("kv-cache-bytes")
def test_bytes_per_token_formula_and_real_allocation():
    cfg = tiny_config(n_layers=3, n_kv_heads=2, head_dim=16)
    assert kv_cache_bytes(cfg, torch.float32) == 2 * 3 * 2 * 16 * 4, \
        "bytes per token = 2 (K and V) * layers * kv_heads * head_dim * dtype bytes"
    assert kv_cache_bytes(cfg, torch.bfloat16, num_tokens=10) == 2 * 3 * 2 * 16 * 2 * 10, \
        "kv_cache_bytes scales with the dtype's size and with num_tokens"
    # every float dtype at its own width (the dtype's bits / 8, whole bytes: an int, never a float)
    for dtype, width in ((torch.float64, 8), (torch.float16, 2), (torch.float8_e4m3fn, 1)):
        got = kv_cache_bytes(cfg, dtype, num_tokens=3)
        assert got == 2 * 3 * 2 * 16 * width * 3 and type(got) is int, \
            f"{dtype}: {got!r} bytes for 3 tokens, expected the int {2 * 3 * 2 * 16 * width * 3}"
    cache = KVCache(cfg, num_blocks=7, block_size=16, device="cpu", dtype=torch.float32)
    assert cache.total_bytes == kv_cache_bytes(cfg, torch.float32, 7 * 16), \
        "a KVCache allocates exactly kv_cache_bytes for its num_blocks * block_size tokens"
    # cross-layer attention (layers share K/V in pairs) and local + global layers keep fewer K/V
    # layers: 2 * 4 layers / 2, and 6 layers of which every 3rd is global
    cla, lg = tiny_config(n_layers=4, cla_share=2), tiny_config(n_layers=6, sliding_window=8, global_every=3)
    assert kv_cache_bytes(cla, torch.float32) == 2 * 2 * 2 * 16 * 4, "CLA-2: only the layers with K/V count"
    odd = tiny_config(n_layers=5, cla_share=2)          # groups (0, 1), (2, 3), (4): 3 layers hold K/V
    assert kv_cache_bytes(odd, torch.float32) == 2 * 3 * 2 * 16 * 4 == \
        KVCache(odd, 1, 1, "cpu", torch.float32).total_bytes, "CLA-2 over 5 layers: the last group counts too"
    assert kv_cache_bytes(lg, torch.float32) == 2 * 2 * 2 * 16 * 4, "global_every=3: the global layers count"
    budget = 10_000
    n = num_blocks_for_budget(kv_cache_bytes(cfg, torch.float32), 16, budget)
    assert n * 16 * kv_cache_bytes(cfg, torch.float32) <= budget < (n + 1) * 16 * kv_cache_bytes(cfg, torch.float32), \
        "num_blocks_for_budget: the most whole blocks the byte budget holds"


@pytest.mark.assignment("kv-cache-bytes")
def test_smollm2_kv_bytes(real_model):
    # the lecture's example: 2 * 30 layers * 3 kv heads * 64 dims * 4 bytes
    assert kv_cache_bytes(real_model.config, torch.float32) == 46080, \
        "SmolLM2: 2 * 30 layers * 3 KV heads * 64 dims * 4 bytes = 46,080 bytes per token"


# --------------------------------------------------- paged attention vs SDPA

def sdpa_reference(q, k, v, window=None):
    """Dense causal attention over a whole sequence, K/V heads repeated per group. With a
    window, an explicit band mask: query i sees key j iff i - window < j <= i (Mistral's)."""
    G, N = q.shape[1] // k.shape[1], q.shape[0]
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    mask = None if window is None else (j <= i) & (i - j < window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(G, 1).transpose(0, 1),
                                         v.repeat_interleave(G, 1).transpose(0, 1), attn_mask=mask,
                                         is_causal=window is None)
    return out.transpose(0, 1)


def paged_step(seqs, block_size, n_heads, n_kv, d=8, seed=0, window=None):
    """seqs: list of (cached_len, query_len). Fill the cache with the first
    cached_len tokens of each sequence at randomly placed physical blocks,
    then run one attention step over the query tokens of all sequences.
    With a window, the step frees the blocks out of it: their entries point at
    the null block, filled here with large junk that only the mask hides."""
    g = torch.Generator().manual_seed(seed)
    cfg = tiny_config(n_layers=1, n_heads=n_heads, n_kv_heads=n_kv, head_dim=d, sliding_window=window)
    total_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    cache = KVCache(cfg, total_blocks, block_size, "cpu", torch.float32)
    bm = BlockManager(total_blocks, block_size, enable_prefix_caching=False, sliding_window=window)
    bm.free_blocks = type(bm.free_blocks).fromkeys(b for b in torch.randperm(total_blocks, generator=g).tolist()
                                                   if b != bm.null_block)                     # scatter blocks
    if window:
        cache.k[:, bm.null_block], cache.v[:, bm.null_block] = 100.0, -100.0
    full = []
    qs, ks, vs, slots = [], [], [], []
    for i, (cached, n_q) in enumerate(seqs):
        T = cached + n_q
        q, k, v = (torch.randn(T, h, d, generator=g) for h in (n_heads, n_kv, n_kv))
        full.append(sdpa_reference(q, k, v, window)[cached:])
        bm.allocate(i, list(range(T)))
        if cached:
            old = torch.tensor(bm.append_slots(i, 0, cached))
            cache.write(0, old, k[:cached], v[:cached])
        slots += bm.append_slots(i, cached, n_q)
        qs.append(q[cached:]), ks.append(k[cached:]), vs.append(v[cached:])
    width = max(len(t) for t in bm.tables.values())
    tables = torch.tensor([bm.tables[i] + [0] * (width - len(bm.tables[i])) for i in range(len(seqs))])
    ctx = AttentionContext(cache, torch.tensor(slots), tables, [c + n for c, n in seqs], [n for _, n in seqs])
    out = ctx.attend(0, torch.cat(qs), torch.cat(ks), torch.cat(vs))
    freed = sum(t.count(bm.null_block) for t in bm.tables.values()) if window else 0
    return out, torch.cat(full), freed


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (6, 2), (8, 2)])   # GQA groups 1, 3, 4
@pytest.mark.assignment("paged-attention")
@pytest.mark.needs("kv-cache-bytes", "block-allocation")
def test_paged_attention_equals_sdpa(block_size, n_heads, n_kv):
    seqs = [(0, 37),            # whole prompt, no prefix
            (16, 1),            # decode after a prefix ending on a block boundary
            (21, 1),            # decode after a prefix ending mid-block
            (32, 5),            # k+1 = 5 verification tokens after a boundary
            (45, 5),            # ... and mid-block
            (7, 30),            # a prefill chunk after a cached prefix
            (0, 1)]             # a one-token prompt
    out, ref, _ = paged_step(seqs, block_size, n_heads, n_kv)
    assert torch.allclose(out, ref, atol=1e-5), f"max err {(out - ref).abs().max():.2e}"


@pytest.mark.assignment("paged-attention")
@pytest.mark.needs("kv-cache-bytes", "block-allocation")
def test_paged_attention_reads_a_v_narrower_than_k():
    """MLA's latent cache reads V as the first r values of K's r + R (cache.LatentCache): the
    output is as wide as V. A cache whose V is the first half of K stands in for it."""
    class Narrow(KVCache):
        def blocks(self, layer, block_ids):
            k, _ = super().blocks(layer, block_ids)
            return k, k[..., :k.shape[-1] // 2]
    g = torch.Generator().manual_seed(3)
    cfg = tiny_config(n_layers=1, n_heads=4, n_kv_heads=1, head_dim=8)
    cache, bm = Narrow(cfg, 4, 4, "cpu", torch.float32), BlockManager(4, 4, enable_prefix_caching=False)
    q, k = torch.randn(10, 4, 8, generator=g), torch.randn(10, 1, 8, generator=g)
    bm.allocate(0, list(range(10)))
    cache.write(0, torch.tensor(bm.append_slots(0, 0, 10)), k, k)
    out = paged_attention(q, cache, 0, torch.tensor([bm.tables[0]]), [10], [10])
    assert out.shape == (10, 4, 4) and torch.allclose(out, sdpa_reference(q, k, k[..., :4]), atol=1e-5), \
        "paged attention with V of width 4 under K of width 8: [N, H, 4], as SDPA"


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.assignment("paged-attention")
@pytest.mark.needs("kv-cache-bytes")
def test_paged_attention_over_a_bf16_pool_rounds_once(d):
    """A bf16 pool: scores and softmax in float32, the output rounded to bf16 once, so it is within
    one bf16 rounding (2^-8 of the largest value) of the same attention in float64 on the same inputs.
    At d = 128 the scale 1/sqrt(d) is not a power of two: q * scale rounded to bf16 before the
    float32 product errs 0.022 (measured; the bound 0.011, the right order 0.007)."""
    g = torch.Generator().manual_seed(0)
    cache = KVCache(tiny_config(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=d), 8, 16, "cpu", torch.bfloat16)
    k, v, q = (torch.randn(*shape, generator=g) * 3 for shape in ((100, 2, d), (100, 2, d), (1, 4, d)))
    k, v, q = k.bfloat16(), (v / 3).bfloat16(), q.bfloat16()
    cache.write(0, torch.arange(100), k, v)
    out = paged_attention(q, cache, 0, torch.arange(7)[None], [100], [1])
    assert out.dtype == torch.bfloat16, "the output has the query's dtype (o_proj's weights are bf16)"
    out = out[0].double()
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    ref = torch.einsum("hk,khd->hd", (torch.einsum("hd,khd->hk", q[0].double(), kk) * d ** -0.5).softmax(-1), vv)
    assert (out - ref).abs().max() <= ref.abs().max() * 2 ** -8, \
        f"d {d}: bf16 error {(out - ref).abs().max():.4f}: scale, scores and softmax in float32, round once"


@pytest.mark.assignment("paged-attention")
@pytest.mark.needs("kv-cache-bytes", "block-allocation")
def test_paged_attention_masks_before_the_softmax_and_builds_on_the_queries_device():
    """A key a query may not see weighs exactly 0 however large its score: masked to -inf BEFORE the
    softmax. (A softmax over every key, then masked and renormalized, lets one huge invisible score
    underflow every visible weight to 0: 0 / 0 = NaN.) Here a 12-token chunk's last key is 1000 x its
    first query. Then the same call on the "meta" device: every tensor the function makes (positions,
    masks) must be made on the queries' device, or a CUDA run fails on a device mismatch."""
    g, T = torch.Generator().manual_seed(5), 12
    cfg = tiny_config(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8)
    cache, bm = KVCache(cfg, 8, 4, "cpu", torch.float32), BlockManager(8, 4, enable_prefix_caching=False)
    q, k, v = (torch.randn(T, h, 8, generator=g) for h in (4, 2, 2))
    k[-1] = 1000 * q[0, ::2]                    # query 0 (heads 0, 2 read KV heads 0, 1) may not see key 11
    bm.allocate(0, list(range(T)))
    cache.write(0, torch.tensor(bm.append_slots(0, 0, T)), k, v)
    tables = torch.tensor([bm.tables[0]])
    out = paged_attention(q, cache, 0, tables, [T], [T])
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
                                         v.repeat_interleave(2, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    assert torch.isfinite(out).all() and torch.allclose(out, ref, atol=1e-5), \
        "a huge score of a key in the future changed the past: mask with -inf before the softmax"
    meta = KVCache(cfg, 8, 4, "meta", torch.float32)
    out = paged_attention(q.to("meta"), meta, 0, tables.to("meta"), [T], [T])
    assert out.device.type == "meta" and out.shape == (T, 4, 8), "paged_attention on the meta device"


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.assignment("paged-attention")
@pytest.mark.needs("kv-cache-bytes", "block-allocation")
def test_paged_attention_takes_the_callers_scale_and_window(window, monkeypatch):
    """MLA passes its own scale (1/sqrt(nope + rope), not 1/sqrt(d)); a window only narrows the
    causal mask (and-ed, never or-ed, never instead). in_window is sliding-window's assignment,
    so the test's own band rule stands in for it, and no block is freed (sliding-window's too)."""
    import cache as cache_module
    monkeypatch.setattr(cache_module, "in_window", lambda q_pos, k_pos, w: k_pos[None, :] > q_pos[:, None] - w)
    g, T, cached, scale = torch.Generator().manual_seed(3), 19, 11, 0.37
    cfg = tiny_config(n_layers=1, n_heads=6, n_kv_heads=2, head_dim=8, sliding_window=window)
    cache, bm = KVCache(cfg, 16, 4, "cpu", torch.float32), BlockManager(16, 4, enable_prefix_caching=False)
    q, k, v = (torch.randn(T, h, 8, generator=g) for h in (6, 2, 2))
    bm.allocate(0, list(range(T)))
    cache.write(0, torch.tensor(bm.append_slots(0, 0, cached)), k[:cached], v[:cached])
    ctx = AttentionContext(cache, torch.tensor(bm.append_slots(0, cached, T - cached)), torch.tensor([bm.tables[0]]),
                           [T], [T - cached])
    out = ctx.attend(0, q[cached:], k[cached:], v[cached:], scale)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = (j <= i) & ((i - j < window) if window else True)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
                                         v.repeat_interleave(3, 1).transpose(0, 1), attn_mask=mask, scale=scale)
    assert torch.allclose(out, ref.transpose(0, 1)[cached:], atol=1e-5), \
        f"scale {scale}, window {window}: paged attention != SDPA with that scale and mask"


@pytest.mark.assignment("paged-attention")
@pytest.mark.needs("kv-cache-bytes", "block-allocation")
def test_paged_attention_random_ragged_batches():
    rng = random.Random(0)
    for trial in range(20):
        seqs = [(rng.randint(0, 60), rng.randint(1, 20)) for _ in range(rng.randint(1, 6))]
        out, ref, _ = paged_step(seqs, rng.choice([1, 2, 16, 32]), 6, rng.choice([1, 2, 3, 6]), seed=trial)
        assert torch.allclose(out, ref, atol=1e-5), f"trial {trial} {seqs}"


@pytest.mark.needs("block-allocation", "copy-on-write")
def test_build_flattens_a_step_into_one_batch():
    """AttentionContext.build (cache.flatten_step): the work of several
    sequences as one flat batch, each token's slot read from its block table
    (slot = block * block_size + offset, the slot append_slots returns too),
    and the copies a fork asked for made before anything is written."""
    bm, cache = BlockManager(12, 4), KVCache(tiny_config(), 12, 4, "cpu", torch.float32)
    for sid, n in ((0, 6), (1, 9)):
        bm.allocate(sid, [])
        bm.append_slots(sid, 0, n)
    cache.k[:, bm.tables[1][2]] = 7.0
    bm.fork(1, 2)
    work = [(0, [5, 6], 6), (2, [8], 9), (1, [9, 10, 11], 9)]
    slots = [slot for sid, toks, start in work for slot in bm.append_slots(sid, start, len(toks))]
    assert bm.pending_copies, "seq 2 writes into the block it shares with seq 1: a copy is pending"
    ids, pos, ctx = AttentionContext.build(cache, bm, work, [1, 2, 5], "cpu")
    assert ids.tolist() == [5, 6, 8, 9, 10, 11] and pos.tolist() == [6, 7, 9, 9, 10, 11]
    assert ctx.slot_mapping.tolist() == slots, "slot = block_id * block_size + offset"
    assert ctx.seq_lens == [8, 10, 12] and ctx.query_lens == [2, 1, 3] and ctx.logits_indices.tolist() == [1, 2, 5]
    assert ctx.block_tables.tolist() == [bm.tables[0] + [0], bm.tables[2], bm.tables[1]], "padded with block 0"
    assert not bm.pending_copies and (cache.k[:, bm.tables[2][2]] == 7.0).all(), "the copy ran before the step"


# ------------------------------------------- the real model through the cache

def run_chunks(model, chunks, ids, block_size=16):
    """Feed one sequence through the paged cache chunk by chunk; return all logits."""
    cache = KVCache(model.config, 64, block_size, "cpu", torch.float32)
    bm = BlockManager(64, block_size)
    bm.allocate(0, ids)
    done, logits = 0, []
    for n in chunks:
        slots = bm.append_slots(0, done, n)
        table = torch.tensor([bm.tables[0]])
        ctx = AttentionContext(cache, torch.tensor(slots), table, [done + n], [n])
        logits.append(model(torch.tensor(ids[done:done + n]), torch.arange(done, done + n), ctx))
        done += n
    return torch.cat(logits)


@pytest.mark.assignment("paged-attention")
@pytest.mark.needs("model", "kv-cache-bytes", "block-allocation", "prefix-caching")
def test_real_model_through_cache_equals_dense(real_model, real_tokenizer):
    ids = real_tokenizer.encode("The paged KV cache stores keys and values in blocks, like pages of "
                                "virtual memory, so that nothing is wasted and prefixes are shared. " * 2)
    dense = real_model(torch.tensor(ids), torch.arange(len(ids)))
    varied = [5, 11, 1, 16, 3]                     # chunks of varied size, crossing block edges
    varied.append(len(ids) - sum(varied))
    for chunks in ([1] * len(ids), varied, [len(ids)]):
        paged = run_chunks(real_model, chunks, ids)
        assert (paged - dense).abs().max() < 1e-4, f"chunks {chunks}"
        assert torch.equal(paged.argmax(-1), dense.argmax(-1)), \
            f"chunks {chunks}: paged greedy tokens must equal the dense model's"


# ------------------------------------------------------------ block manager

@pytest.mark.assignment("copy-on-write")
@pytest.mark.needs("block-allocation", "prefix-caching")
def test_scripted_allocate_append_fork_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate(1, list(range(10))) == 0, "an empty prefix cache gives no hit"  # nothing cached yet
    assert bm.append_slots(1, 0, 10) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], \
        "slot = block * block_size + offset, blocks taken from the front of the free list"
    assert bm.tables[1] == [0, 1, 2] and bm.num_free_blocks == 5, "10 tokens in blocks of 4 take exactly 3 blocks"
    bm.cache_full_blocks(1, list(range(10)), 10)                  # blocks 0, 1 are full
    assert bm.num_cached_blocks == 2, "only full blocks are registered in the prefix cache"
    bm.fork(1, 2)
    assert bm.ref_count[:3] == [2, 2, 2] and bm.num_free_blocks == 5, \
        "a fork shares every block: ref counts up, nothing copied"
    assert bm.hashed[2] == bm.hashed[1], "the child resumes registration where the parent stands"
    # seq 2 writes position 10: its last block (2) is shared -> private copy (block 3)
    assert bm.append_slots(2, 10, 1) == [3 * 4 + 2], "writing into a shared block goes to a fresh private copy"
    assert bm.pending_copies == [(2, 3)] and bm.tables[2] == [0, 1, 3], \
        "copy-on-write records (shared block, copy) and puts the copy in the writer's table"
    assert bm.ref_count[:4] == [2, 2, 1, 1], "the copy has ref count 1; the shared block loses the writer's reference"
    # seq 1 writes position 10 too: block 2 is now its own, no copy
    assert bm.append_slots(1, 10, 3) == [10, 11, 16], \
        "a block held alone is written in place; a new block opens only when needed"  # fills block 2, opens block 4
    assert bm.pending_copies == [(2, 3)] and bm.tables[1] == [0, 1, 2, 4], \
        "no copy for a block the sequence holds alone"
    bm.free(1)
    assert bm.ref_count[:5] == [1, 1, 0, 1, 0], "free drops one reference per block; blocks still shared stay held"
    bm.free(2)
    assert bm.num_free_blocks == 8 and bm.ref_count == [0] * 8, \
        "after every sequence is freed every block is free, ref count 0"
    bm.check_invariants()


@pytest.mark.assignment("prefix-caching")
@pytest.mark.needs("block-allocation")
def test_prefix_hits_reuse_the_same_physical_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 111))                                # 11 tokens: 2 full blocks + 3
    bm.allocate(1, prompt)
    bm.append_slots(1, 0, 11)
    bm.cache_full_blocks(1, prompt, 11)
    first_two = bm.tables[1][:2]
    # same first 8 tokens, different tail -> 8 tokens cached, same blocks
    assert bm.allocate(2, prompt[:8] + [7, 7, 7, 7, 7]) == 8, \
        "a prompt sharing two full blocks hits their 8 cached tokens"
    assert bm.tables[2] == first_two and bm.ref_count[first_two[0]] == 2, \
        "a prefix hit reuses the same physical blocks and adds a reference"
    # a different first block breaks the chain even if the second block matches
    assert bm.allocate(3, [0] + prompt[1:]) == 0, \
        "hashes are chained: a different first block misses even where later blocks match"
    assert bm.allocate(5, prompt[:4] + [0] * 4 + prompt[4:8] + [1]) == 4 and bm.tables[5] == first_two[:1], \
        "the lookup stops at the first miss: a cached block after a gap is not a prefix (its K/V sit " \
        "at other positions)"
    # after everybody leaves, the blocks stay cached and a newcomer still hits them
    for s in (1, 2, 3, 5):
        bm.free(s)
    assert bm.num_free_blocks == 16, "freed blocks return to the free list even while cached"
    assert bm.allocate(4, prompt) == 8 and bm.tables[4] == first_two, \
        "freed blocks stay in the prefix cache until reused: a newcomer still hits them"
    # the hit rate counts the blocks found: 2 for seq 2, 1 for seq 5, 2 for seq 4, none for 1 and 3
    assert bm.prefix_hits == 5 and bm.prefix_queries >= 9, (bm.prefix_hits, bm.prefix_queries)
    bm.check_invariants()


@pytest.mark.assignment("prefix-caching")
@pytest.mark.needs("block-allocation")
def test_blocks_registered_over_several_steps_chain_like_a_prompt():
    """cache_full_blocks resumes where it stopped: a block filled by decoding,
    several steps after the prompt, must chain onto the prompt's blocks, so a
    later request with the same tokens finds them all."""
    bm = BlockManager(num_blocks=16, block_size=4)
    toks = list(range(50, 56))                                    # 6 tokens: 1 full block
    bm.allocate(1, toks)
    bm.append_slots(1, 0, 6)
    bm.cache_full_blocks(1, toks, 6)
    assert bm.num_cached_blocks == 1, "the prompt's one full block is registered"
    for t in range(56, 63):                                       # decode 7 tokens, one step each
        bm.append_slots(1, len(toks), 1)
        toks.append(t)
        bm.cache_full_blocks(1, toks, len(toks))
    assert bm.num_cached_blocks == 3, \
        "blocks filled by decoding are registered as they fill"  # 13 tokens: 3 full blocks
    assert bm.allocate(2, toks + [99]) == 12 and bm.tables[2] == bm.tables[1][:3], \
        "decode-filled blocks chain onto the prompt's: the same tokens later hit all 3"
    bm.check_invariants()


def share(bm, parent: int, child: int):
    """A fork's bookkeeping, written out (fork itself is copy-on-write's work): the child's table is
    the parent's, each block one reference more, registration resuming where the parent's stands."""
    bm.tables[child], bm.hashed[child] = list(bm.tables[parent]), bm.hashed[parent]
    for b in bm.tables[child]:
        bm.ref_count[b] += 1


@pytest.mark.assignment("prefix-caching")
@pytest.mark.needs("block-allocation")
def test_every_registered_block_chains_onto_the_tokens_before_it():
    """A block's key is (hash, parent hash, tokens), its parent the key of the block before it in the
    table, whoever registered that one. Two sequences share a prefilled prompt (n = 2: shared before
    either registers); the first registers the shared blocks, then each decodes into a block of its
    own: every key must chain along its table, so only the same tokens after the same prefix hit."""
    bm = BlockManager(num_blocks=32, block_size=2)
    toks = {1: [1, 2, 3, 4, 5, 6]}
    bm.allocate(1, toks[1])
    bm.append_slots(1, 0, 6)
    share(bm, 1, 2)
    toks[2] = list(toks[1])
    bm.cache_full_blocks(1, toks[1], 6)                  # seq 1 registers the three shared blocks
    for seq, new in ((2, [7, 8]), (1, [9, 9])):          # seq 2's new block follows blocks it did not register
        bm.append_slots(seq, 6, 2)
        toks[seq] += new
        bm.cache_full_blocks(seq, toks[seq], 8)
    for seq, table in bm.tables.items():
        parent = None
        for i, block in enumerate(table):
            assert block in bm.block_key, f"seq {seq}: full computed block {i} is not registered"
            h, p, tokens = bm.block_key[block]
            assert (p, tokens) == (parent, tuple(toks[seq][2 * i:2 * i + 2])), \
                f"seq {seq}, block {i}: key {(p, tokens)} does not chain onto the block before it"
            parent = h
    assert bm.allocate(3, [7, 8, 9]) == 0, "tokens 7, 8 hit only after the prompt they followed"
    assert bm.allocate(4, toks[2] + [0]) == 8 and bm.tables[4] == bm.tables[2], \
        "the child's whole sequence hits: its own block chains onto the shared ones"
    bm.check_invariants()


@pytest.mark.assignment("prefix-caching")
@pytest.mark.needs("block-allocation")
def test_hash_collisions_are_never_hits():
    """A hash names a prefix only probably: a lookup must compare the stored
    parent and tokens, or two different prompts would share a block."""
    bm = BlockManager(num_blocks=8, block_size=4)
    bm._key = lambda parent, tokens: 12345                        # every block collides
    a = [1, 2, 3, 4, 5]
    bm.allocate(1, a)
    bm.append_slots(1, 0, 5)
    bm.cache_full_blocks(1, a, 5)
    assert bm.allocate(2, [9, 9, 9, 9, 9]) == 0, "a colliding hash with other tokens is a miss"
    assert bm.allocate(3, a) == 4, "the genuine prefix still hits"
    bm.check_invariants()
    bm = BlockManager(num_blocks=8, block_size=4)
    bm._key = lambda parent, tokens: hash(tokens)                 # blind to the parent: same tokens collide
    b = [7] * 4 + [1] * 4 + [0]
    bm.allocate(1, b)
    bm.append_slots(1, 0, 9)
    bm.cache_full_blocks(1, b, 9)
    assert bm.allocate(2, [1] * 4 + [5]) == 0, "the same tokens after another prefix are a miss: the parent counts"


@pytest.mark.assignment("prefix-caching")
@pytest.mark.needs("block-allocation")
def test_allocate_without_prefix_cache_reads_no_entry_but_still_registers():
    """A request that needs every prompt position's logits (prompt_logprobs) skips the
    lookup: fresh blocks, no query or hit counted; its own full blocks still serve others."""
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(20, 31))                                  # 11 tokens: 2 full blocks + 3
    bm.allocate(1, prompt)
    bm.append_slots(1, 0, 11)
    bm.cache_full_blocks(1, prompt, 11)
    queries, hits = bm.prefix_queries, bm.prefix_hits
    assert bm.allocate(2, prompt, use_prefix_cache=False) == 0 and bm.tables[2] == [], \
        "use_prefix_cache=False: no lookup, 0 cached tokens, an empty table"
    assert (bm.prefix_queries, bm.prefix_hits) == (queries, hits), "a skipped lookup counts no prefix query and no hit"
    bm.append_slots(2, 0, 11)
    assert not set(bm.tables[2]) & set(bm.tables[1]), "fresh blocks, not the cached ones"
    other = list(range(40, 51))                                   # a prompt nobody cached yet
    assert bm.allocate(3, other, use_prefix_cache=False) == 0, "use_prefix_cache=False returns 0 cached tokens"
    bm.append_slots(3, 0, 11)
    bm.cache_full_blocks(3, other, 11)                            # registration is unchanged
    assert bm.allocate(4, other) == 8 and bm.tables[4] == bm.tables[3][:2], \
        "a request that skipped the lookup still registers its full blocks for others"
    bm.check_invariants()


@pytest.mark.assignment("prefix-caching")
@pytest.mark.needs("block-allocation")
def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))                                       # exactly 2 full blocks
    bm.allocate(1, prompt)
    bm.append_slots(1, 0, 8)
    bm.cache_full_blocks(1, prompt, 8)
    assert bm.allocate(2, prompt) == 4, "the last block is recomputed so its last token gets logits"


@pytest.mark.assignment("block-allocation")
def test_the_free_list_is_least_recently_used_and_a_table_goes_back_tail_first():
    """Without the prefix cache, what block-allocation alone decides: _take_free hands out the
    LEAST recently used free block (the front of free_blocks) with ref count 1; _release puts a
    block whose count reaches 0 at the back (the most recently used end); free() gives a table
    back tail first; reserve() grows a table to exactly ceil(tokens / block_size) blocks; a slot is
    block * block_size + offset; and a block handed out again leaves the prefix cache (its
    contents are about to be overwritten)."""
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    assert list(bm.free_blocks) == [0, 1, 2, 3, 4, 5] and bm.ref_count == [0] * 6, \
        "a new manager: every block free in order 0..n-1, every ref count 0"
    bm.allocate(1, [1] * 9)
    slots = bm.append_slots(1, 0, 9)
    assert bm.tables[1] == [0, 1, 2], "9 tokens in blocks of 4: exactly 3 blocks, the least recently used"
    assert slots == [b * 4 + o for b in (0, 1, 2) for o in range(4)][:9], "slot = block * block_size + offset"
    assert bm.append_slots(1, 9, 3) == [9, 10, 11] and bm.tables[1] == [0, 1, 2], \
        "positions 9..11 fill the third block: no fourth block until a token needs it"
    assert bm.ref_count[:3] == [1, 1, 1], "a block taken has ref count 1"
    bm.allocate(2, [2] * 4)
    bm.append_slots(2, 0, 4)
    assert bm.tables[2] == [3], "the next least recently used block"
    bm.free(1)
    assert list(bm.free_blocks) == [4, 5, 2, 1, 0], "released to the back, the table's tail first"
    bm.allocate(3, [3] * 4)
    bm.append_slots(3, 0, 4)
    assert bm.tables[3] == [4], "the block never used is older than any released one"
    bm.block_key[5] = (7, None, (9, 9, 9, 9))           # as if block 5 held a cached prefix
    bm.cached[7] = 5
    bm.allocate(4, [4] * 4)
    bm.append_slots(4, 0, 4)
    assert bm.tables[4] == [5] and 7 not in bm.cached and 5 not in bm.block_key, \
        "a block handed out again must leave the prefix cache: a lookup would find other tokens"
    bm.check_invariants()
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    bm.allocate(1, [1] * 3)
    bm.append_slots(1, 0, 3)
    bm.changed.clear()
    assert bm.append_slots(1, 3, 3) == [3, 4, 5] and bm.tables[1] == [0, 1], \
        "from mid-block across a boundary: each position in its own block at its own offset"
    assert bm.changed == {1}, "a table that grew is reported (graphs.StepInputs rebuilds its row from `changed`)"


@pytest.mark.assignment("prefix-caching")
def test_eviction_is_least_recently_used():
    bm = BlockManager(num_blocks=4, block_size=2)
    for seq, prompt in [(1, [1, 1, 9]), (2, [2, 2, 9]), (3, [3, 3, 9])]:
        bm.allocate(seq, prompt)
        bm.append_slots(seq, 0, 2)          # only the full block
        bm.cache_full_blocks(seq, prompt, 2)
    bm.free(2), bm.free(1), bm.free(3)      # release order: 2, then 1, then 3
    assert bm.num_cached_blocks == 3, "freed full blocks stay cached until their block is reused"
    # A newcomer needing 2 blocks takes the never-used block, then the least recently freed (seq 2's).
    bm.allocate(4, [5, 5, 5, 5])
    bm.append_slots(4, 0, 4)
    assert bm.allocate(5, [2, 2, 9]) == 0, "seq 2's block was evicted first"
    assert bm.allocate(6, [1, 1, 9]) == 2 and bm.allocate(7, [3, 3, 9]) == 2, \
        "the more recently freed cached blocks survive eviction"
    bm.check_invariants()


@pytest.mark.assignment("prefix-caching")
def test_freed_table_is_evicted_tail_first():
    """free gives a table back tail first, so its LAST blocks are reused
    first and a later request sharing the start of the prompt still finds
    it: each newcomer block evicts one more block from the end."""
    prompt = list(range(10, 18))                                  # 4 full blocks of 2
    for taken in range(1, 4):
        bm = BlockManager(num_blocks=4, block_size=2)
        bm.allocate(1, prompt)
        bm.append_slots(1, 0, 8)
        bm.cache_full_blocks(1, prompt, 8)
        bm.free(1)
        bm.allocate(2, [0] * (2 * taken))
        bm.append_slots(2, 0, 2 * taken)                          # evicts `taken` blocks
        # the lookup may reuse 3 blocks (the last token is always computed); the
        # newcomer evicted the last `taken` of the 4, so 4 - taken lead the prompt
        assert bm.allocate(3, prompt) == 2 * min(3, 4 - taken), f"{taken} blocks taken: a head block was evicted"
        bm.check_invariants()


@pytest.mark.assignment("copy-on-write")
@pytest.mark.needs("block-allocation", "prefix-caching")
def test_randomized_operations_keep_invariants_and_free_everything():
    rng = random.Random(1)
    bm = BlockManager(num_blocks=40, block_size=4)
    lens = {}                                   # seq -> tokens computed
    toks = {}
    next_id = 0
    for step in range(4000):
        op = rng.random()
        if op < 0.3:                            # admit with a prompt from a few shared prefixes
            prompt = [rng.randint(0, 2)] * rng.randint(1, 4) + [rng.randint(0, 5) for _ in range(rng.randint(1, 12))]
            cached = bm.allocate(next_id, prompt)
            if bm.can_append(next_id, cached, len(prompt) - cached):
                bm.append_slots(next_id, cached, len(prompt) - cached)
                bm.cache_full_blocks(next_id, prompt, len(prompt))
                lens[next_id], toks[next_id] = len(prompt), prompt
            else:
                bm.free(next_id)
            next_id += 1
        elif op < 0.6 and lens:                 # decode a few tokens
            s = rng.choice(list(lens))
            n = rng.randint(1, 5)
            if bm.can_append(s, lens[s], n):
                bm.append_slots(s, lens[s], n)
                toks[s] += [rng.randint(0, 5) for _ in range(n)]
                lens[s] += n
                bm.cache_full_blocks(s, toks[s], lens[s])
        elif op < 0.7 and lens:                 # fork
            s = rng.choice(list(lens))
            bm.fork(s, next_id)
            lens[next_id], toks[next_id] = lens[s], list(toks[s])
            next_id += 1
        elif op < 0.8 and lens:                 # speculative rollback
            s = rng.choice(list(lens))
            keep = rng.randint(1, lens[s])
            bm.truncate(s, keep)
            lens[s], toks[s] = keep, toks[s][:keep]
        elif lens:                              # finish
            s = rng.choice(list(lens))
            bm.free(s)
            del lens[s], toks[s]
        bm.check_invariants()
        assert bm.num_free_blocks + len({b for t in bm.tables.values() for b in t}) == bm.num_blocks, \
            "every block is either free or in some table: free + used = the pool"
    for s in list(lens):
        bm.free(s)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and all(c == 0 for c in bm.ref_count), \
        "after freeing every sequence: every block free, every ref count 0"


@pytest.mark.assignment("copy-on-write")
@pytest.mark.needs("block-allocation")
def test_a_fork_counts_every_entry_of_the_table():
    """A table may name one block in several entries: a sliding window points every entry it freed
    at the null block, and each entry holds a reference. A fork adds one per entry; freeing both
    sequences then gives back exactly what they held. (The window's freeing is sliding-window's work:
    written out here.)"""
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    bm.null_block = bm._take_free()
    bm.allocate(1, list(range(8)))
    bm.append_slots(1, 0, 8)
    table = bm.tables[1]
    for i in range(2):                                   # the window left positions 0-3 behind
        bm._release(table[i])
        table[i] = bm.null_block
        bm.ref_count[bm.null_block] += 1
    bm.check_invariants()
    bm.fork(1, 2)
    assert bm.ref_count[bm.null_block] == 5, "the null block: its own reference and 2 entries in each table"
    bm.check_invariants()
    bm.free(1)
    bm.free(2)
    assert bm.ref_count[bm.null_block] == 1 and bm.num_free_blocks == 7, "all but the null block free"
    bm.check_invariants()


@pytest.mark.assignment("copy-on-write")
@pytest.mark.needs("kv-cache-bytes", "block-allocation", "prefix-caching")
def test_copy_on_write_copies_once_and_keeps_the_data(real_model):
    cfg = real_model.config
    cache = KVCache(cfg, 8, 4, "cpu", torch.float32)
    bm = BlockManager(8, 4)
    bm.allocate(1, list(range(6)))
    slots = torch.tensor(bm.append_slots(1, 0, 6))
    k = torch.randn(6, cfg.n_kv_heads, cfg.head_dim)
    for layer in range(cfg.n_layers):
        cache.write(layer, slots, k * layer, -k * layer)
    bm.changed.clear()
    bm.fork(1, 2)
    bm.fork(1, 3)
    assert bm.pending_copies == [] and bm.changed == {2, 3}, \
        "forking copies nothing, and each child is a new table graphs.StepInputs must hear of"
    bm.changed.clear()
    bm.append_slots(2, 6, 1)
    assert bm.changed == {2}, "a copy-on-write changes sequence 2's table: graphs.StepInputs must hear of it"
    bm.append_slots(2, 7, 1)                  # second write into its private block: no new copy
    bm.append_slots(3, 6, 3)                  # crosses into a new block: copies only the partial one
    assert [src for src, _ in bm.pending_copies] == [1, 1], "exactly one copy per writer, of the shared partial block"
    for src, dst in bm.pending_copies:
        cache.copy_block(src, dst)
        assert torch.equal(cache.k[:, dst, :2], cache.k[:, src, :2]) and torch.equal(cache.v[:, dst], cache.v[:, src]), \
            "a copy holds its source block's K and V"
    assert bm.tables[1][0] == bm.tables[2][0] == bm.tables[3][0], "full blocks stay shared"
    # a write over SEVERAL shared blocks (a chunk fed again after a fork) copies every one of them
    bm.pending_copies.clear()
    bm.fork(1, 4)
    shared = list(bm.tables[4])
    bm.reserve(4, 0, 8)
    assert [src for src, _ in bm.pending_copies] == shared, \
        f"writing positions 0-7 over shared blocks {shared}: copies {bm.pending_copies}, expected one of each"
    assert all(bm.ref_count[b] == 1 and b not in shared for b in bm.tables[4]), \
        "the writer's blocks are private after the copies"


@pytest.mark.assignment("block-allocation")
def test_free_reports_the_table_and_cancels_copies_into_its_blocks():
    """free: the table reported changed (graphs.StepInputs' rows follow `changed`), no state
    kept for the sequence (a server runs for days), and a pending copy INTO one of its blocks
    cancelled (copy-on-write's, before an abort: the block may be someone else's by then).
    The copies are set by hand here: forks are copy-on-write's assignment."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)    # (prefix-caching's)
    for sid, n in ((1, 6), (3, 2)):
        bm.allocate(sid, list(range(n)))
        bm.append_slots(sid, 0, n)
    first, mine, other = bm.tables[1][0], bm.tables[1][-1], bm.tables[3][0]
    bm.pending_copies = [(other, first), (other, mine), (first, other)]     # two in a row into the table
    bm.changed.clear()
    bm.free(1)
    assert bm.pending_copies == [(first, other)], \
        "a copy into a block given back must never run (each of them); a copy OUT of one still does " \
        "(its data stays until the block is taken again, after this step's copies)"
    assert bm.changed == {1} and 1 not in bm.hashed and 1 not in bm.tables, \
        "free reports the table changed and keeps nothing of the sequence"
    bm.check_invariants()
    # a table behind a sliding window: entries that point at the null block hold a reference each
    # (set by hand as the window leaves them: freeing them is sliding-window's assignment)
    win = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, sliding_window=4)
    win.allocate(5, list(range(12)))
    win.tables[5] = [win.null_block, win.null_block, win._take_free()]
    win.ref_count[win.null_block] += 2
    win.free(5)
    assert win.ref_count[win.null_block] == 1, \
        f"the null block holds {win.ref_count[win.null_block]} references after free (1: the manager's own): " \
        "release every entry of the table, null ones included"
    win.check_invariants()


@pytest.mark.needs("block-allocation", "copy-on-write")
def test_freeing_a_sequence_drops_its_pending_copies():
    """A copy-on-write copy into a block that was given back (the request was
    aborted before the step ran) must never run: the block may hold someone
    else's data by then."""
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1, list(range(6)))
    bm.append_slots(1, 0, 6)
    bm.fork(1, 2)
    bm.append_slots(2, 6, 1)                  # the shared partial block is copied for seq 2
    assert len(bm.pending_copies) == 1
    bm.free(2)
    assert bm.pending_copies == [], "the copy's destination went back to the pool"
    bm.check_invariants()


@pytest.mark.needs("block-allocation", "prefix-caching")
def test_truncate_frees_trailing_blocks_and_uncaches_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    toks = list(range(13))
    bm.allocate(1, toks)
    bm.append_slots(1, 0, 13)
    bm.cache_full_blocks(1, toks, 13)          # blocks 0..2 full
    bm.truncate(1, 6)                          # keep block 0 and half of block 1
    assert bm.tables[1] == [0, 1] and bm.num_free_blocks == 6
    assert bm.num_cached_blocks == 1, "only the still-full first block stays in the prefix cache"
    bm.check_invariants()


# ------------------------------------------------------- sliding window (Mistral)

@pytest.mark.parametrize("window", [1, 3, 16, 21])
@pytest.mark.assignment("sliding-window")
@pytest.mark.needs("paged-attention", "kv-cache-bytes", "block-allocation")
def test_paged_windowed_attention_equals_band_masked_sdpa(window):
    """Each query sees its last W positions only, through tables whose freed
    entries point at the null block (full of junk here: the mask must hide it)."""
    seqs = [(0, 37), (16, 1), (21, 1), (32, 5), (45, 5), (7, 30), (0, 1), (60, 3)]
    for block_size in (1, 4, 16):
        out, ref, freed = paged_step(seqs, block_size, 6, 2, seed=window, window=window)
        assert torch.allclose(out, ref, atol=1e-5), f"W={window}, bs={block_size}: {(out - ref).abs().max():.2e}"
        assert freed > 0 or block_size > 60 - window, "the step must have freed blocks out of the window"
    no_window, _, _ = paged_step(seqs, 4, 6, 2, seed=window)
    assert not torch.allclose(out, no_window, atol=1e-3), "a window must change what a query sees"


def live_blocks(bm, sid):
    """Indices of a table's blocks still held: the freed ones (the null block) must be a prefix."""
    table = bm.tables[sid]
    live = [i for i, b in enumerate(table) if b != bm.null_block]
    assert live == list(range(len(table) - len(live), len(table))), f"freed entries are not a prefix: {table}"
    return live


@pytest.mark.assignment("sliding-window")
@pytest.mark.needs("block-allocation", "prefix-caching")
def test_window_holds_a_long_sequence_in_a_bounded_number_of_blocks():
    """W = 256 over 4,096 tokens in blocks of 16, decoding one token per step as the
    engine does (reserve, then register the full blocks): at most ceil(W / 16) + 1 = 17
    blocks, in a pool of exactly 17 (+ the null block), while every position the next
    query sees is still held. Without a window the same pool is full at 272 tokens."""
    W, bs, L = 256, 16, 4096
    bm = BlockManager(17 + 1, bs, sliding_window=W)
    toks = [7] * 40                                                # a 40-token prompt in one chunk
    bm.allocate(0, toks)
    bm.append_slots(0, 0, 40)
    bm.cache_full_blocks(0, toks, 40)
    most = 0
    while len(toks) < L:
        start = len(toks)
        bm.changed.clear()
        bm.append_slots(0, start, 1)
        if (start - W + 1) % bs == 0 and start > W:                  # a block fell out of the window
            assert bm.changed == {0}, f"position {start}: a freed entry changes the table (graphs.StepInputs)"
        toks.append(start % 97)
        bm.cache_full_blocks(0, toks, len(toks))
        live = live_blocks(bm, 0)
        most = max(most, len(live))
        assert live[0] <= max(0, start - W + 1) // bs, f"position {start}: a block it sees was freed"
        assert live[0] >= (start - W + 1) // bs, f"position {start}: a block out of the window is still held"
        if start % 500 == 0:
            bm.check_invariants()
    assert most == 17 and len(bm.tables[0]) == L // bs, "the table keeps its logical length; 17 blocks held"
    assert bm.null_block not in bm.free_blocks and bm.null_block not in bm.cached.values(), \
        "the null block is never free and never registered in the prefix cache"
    bm.check_invariants()
    bm.free(0)
    bm.check_invariants()
    assert bm.num_free_blocks == 17, "every block back; the null block stays the manager's"
    plain = BlockManager(17, bs)
    plain.allocate(0, [])
    with pytest.raises(RuntimeError, match="no free blocks"):
        for start in range(L):
            plain.append_slots(0, start, 1)
    assert start == 17 * bs, "without a window a pool of 17 blocks of 16 is full at 272 tokens"


@pytest.mark.assignment("sliding-window")
@pytest.mark.needs("block-allocation", "prefix-caching")
def test_the_null_block_never_enters_the_prefix_cache():
    """The window frees a registered block, another sequence takes it, and registration goes on:
    the freed entry (the null block now) is never keyed as a prefix, or a later prompt with the
    same first tokens would 'hit' the null block and read someone else's K/V there."""
    bm, toks = BlockManager(6, 4, sliding_window=8), list(range(100, 140))   # 5 blocks + the null
    bm.allocate(1, toks[:12])
    bm.append_slots(1, 0, 12)
    bm.cache_full_blocks(1, toks, 12)                       # three full blocks, registered
    bm.allocate(2, [7] * 4)
    bm.append_slots(2, 0, 4)
    bm.append_slots(1, 12, 1)                               # the window frees seq 1's first block ...
    bm.append_slots(2, 4, 1)                                # ... and seq 2 takes it (its key evicted)
    bm.cache_full_blocks(1, toks, 13)
    assert bm.null_block not in bm.cached.values() and bm.null_block not in bm.block_key, \
        "the null block was registered in the prefix cache"
    bm.free(2)
    assert bm.allocate(3, toks[:6]) == 0 and bm.null_block not in bm.tables[3], \
        "a prompt sharing the freed block's tokens must miss, not hit the null block"
    bm.check_invariants()


@pytest.mark.assignment("sliding-window")
@pytest.mark.needs("block-allocation", "prefix-caching", "copy-on-write")
def test_window_with_fork_rollback_preemption_and_prefix_cache():
    """n > 1 forks share freed entries and live blocks alike; a shared block goes back when
    its last holder's window leaves it; rollback and preemption give back exactly what is
    held; freed full blocks stay in the prefix cache, and a newcomer's hits are freed again
    by its first step. The null block is never registered, even when registration lags."""
    for bad in (0, -8, 2.5, "8"):
        with pytest.raises(ValueError, match="sliding_window"):
            BlockManager(40, 4, sliding_window=bad)
    W, bs = 8, 4
    bm = BlockManager(40, bs, sliding_window=W)
    null = bm.null_block
    prompt = list(range(100, 122))                                 # 22 tokens: 5 full blocks + 2
    bm.allocate(1, prompt)
    bm.append_slots(1, 0, 22)
    bm.cache_full_blocks(1, prompt, 22)
    assert null not in bm.tables[1], "the prompt's queries (positions 0..21) see all of it"
    bm.fork(1, 2)
    first = bm.tables[1][:3]
    bm.changed.clear()
    bm.append_slots(1, 22, 1)                                      # position 22 sees 15..22: blocks 0-2 out
    assert bm.tables[1][:3] == [null] * 3 and 1 in bm.changed, "freed entries point at the null block"
    assert all(bm.ref_count[b] == 1 for b in first), "still held by the child"
    assert len(bm.pending_copies) == 1, "the parent wrote into the shared partial block: copy-on-write"
    bm.append_slots(2, 22, 1)                                      # the child's first step
    assert all(bm.ref_count[b] == 0 and b in bm.free_blocks for b in first) and len(bm.pending_copies) == 1, \
        "a block leaves with its last holder's window: back to the free list, no new copy"
    assert bm.num_cached_blocks == 5, "freed full blocks stay in the prefix cache"
    bm.check_invariants()
    bm.append_slots(1, 23, 5)                                      # verify 4 drafts at 23..27 ...
    bm.truncate(1, 25)                                             # ... and keep 2 (speculative rollback)
    assert live_blocks(bm, 1) == [4, 5, 6] and bm.tables[1][:4] == [null] * 4, \
        "a rollback keeps the kept positions' live blocks; freed entries stay the null block"
    bm.check_invariants()
    bm.free(1)                                                     # preemption: back go the live blocks
    bm.free(2)
    bm.check_invariants()
    assert bm.num_free_blocks == 39 and bm.ref_count[null] == 1, \
        "preemption frees every live block; only the null block stays held"
    assert bm.allocate(3, prompt) == 20, "the chain of freed, still cached blocks is a hit"
    bm.append_slots(3, 20, 2)                                      # its first step frees its dead hits again
    assert bm.tables[3][:3] == [null] * 3, "a newcomer's first step frees its prefix hits that lie before its window"
    bm.check_invariants()
    lag = BlockManager(16, 4, sliding_window=4)
    toks = list(range(40))
    lag.allocate(0, toks[:1])
    for p in range(40):                                            # no registration between the steps
        lag.append_slots(0, p, 1)
    lag.cache_full_blocks(0, toks, 40)
    assert lag.num_cached_blocks == 0 and null not in lag.block_key, "a chain through a freed block is lost"
    lag.check_invariants()


@pytest.mark.assignment("sliding-window")
@pytest.mark.needs("block-allocation", "prefix-caching", "copy-on-write")
def test_window_random_operations_keep_every_visible_position():
    """Seeded random admissions (with prefix hits), prefill chunks, decodes, verify steps
    with rollback, forks, preemptions and finishes under a window: after each, the
    bookkeeping holds, every position the next query sees reads back its own K/V (a
    shadow pool written through the slots handed out), and each sequence holds at most
    ceil((W - 1 + its last step's tokens) / block_size) + 1 blocks."""
    rng = random.Random(3)
    W, bs, pool = 6, 4, 40
    bm, kv = BlockManager(pool, bs, sliding_window=W), ShadowKV(pool, bs)
    seqs, ids = {}, iter(range(10**6))
    ops = dict.fromkeys(["admit", "step", "rollback", "fork", "free", "freed"], 0)
    for _ in range(1500):
        op, live = rng.random(), list(seqs)
        if op < 0.15 or not live:
            tokens = [rng.randrange(3) for _ in range(rng.randint(2, 30))]
            sid = next(ids)
            hit = bm.allocate(sid, tokens)
            seqs[sid] = {"tokens": tokens, "computed": hit, "last": 0}
            ops["admit"] += 1
        elif op < 0.75:                                            # one step: a chunk, a decode or a verify
            sid = rng.choice(live)
            s = seqs[sid]
            if s["computed"] == len(s["tokens"]):
                s["tokens"] += [rng.randrange(3) for _ in range(rng.choice([1, 1, 4]))]
            start, count = s["computed"], rng.randint(1, min(8, len(s["tokens"]) - s["computed"]))
            if not bm.can_append(sid, start, count):
                bm.free(sid)                                       # preempted; it never comes back here
                del seqs[sid]
                continue
            slots = bm.append_slots(sid, start, count)
            for src, dst in bm.pending_copies:
                kv.copy(src, dst)
            bm.pending_copies.clear()
            for p, slot in zip(range(start, start + count), slots):
                kv.write(slot, tuple(s["tokens"][:p + 1]))
            s["computed"], s["last"] = start + count, count
            if count > 1 and rng.random() < 0.3:                   # a verify step keeps >= 1 of its tokens
                keep = rng.randint(start + 1, start + count)
                bm.truncate(sid, keep)
                s["tokens"], s["computed"] = s["tokens"][:keep], keep
                ops["rollback"] += 1
            if rng.random() < 0.9:                                 # the engine registers after every step
                bm.cache_full_blocks(sid, s["tokens"], s["computed"])
            ops["step"] += 1
        elif op < 0.85:
            sid, child = rng.choice(live), next(ids)
            bm.fork(sid, child)
            seqs[child] = {**seqs[sid], "tokens": list(seqs[sid]["tokens"])}
            ops["fork"] += 1
        else:
            sid = rng.choice(live)
            bm.free(sid)
            del seqs[sid]
            ops["free"] += 1
        bm.check_invariants()
        for sid, s in seqs.items():
            table, c = bm.tables[sid], s["computed"]
            seen = range(max(0, c - W + 1), c)                     # what the query at position c will see
            assert all(kv.slots[table[p // bs]][p % bs] == tuple(s["tokens"][:p + 1]) for p in seen), \
                f"sequence {sid} lost a position its next query sees"
            assert len(live_blocks(bm, sid)) <= -(-(W - 1 + max(1, s["last"])) // bs) + 1, \
                f"sequence {sid} holds more blocks than its window and last step need"
            ops["freed"] += table.count(bm.null_block)
    for sid in list(seqs):
        bm.free(sid)
    bm.check_invariants()
    assert bm.num_free_blocks == pool - 1 and bm.ref_count[bm.null_block] == 1, "nothing leaked"
    assert min(ops.values()) > 0, f"the random run missed an operation: {ops}"


@pytest.mark.assignment("sliding-window")
@pytest.mark.needs("model", "paged-attention", "kv-cache-bytes", "block-allocation", "prefix-caching")
def test_windowed_model_through_a_small_pool_equals_dense_windowed_reference():
    """A tiny windowed model runs a 24-token prompt in chunks of 8, then decodes greedily
    to 100 tokens through the paged cache, in a pool of ceil((W - 1 + 8) / bs) + 1 blocks
    (+ the null block): its greedy tokens are the dense windowed reference's (the model
    without a cache) and its logits match it."""
    W, bs, prompt_len, total = 10, 4, 24, 100
    model = tiny_model(seed=1, sliding_window=W)
    blocks = -(-(W - 1 + 8) // bs) + 1
    cache = KVCache(model.config, blocks + 1, bs, "cpu", torch.float32)
    bm = BlockManager(blocks + 1, bs, sliding_window=W)
    ids = torch.randint(0, 512, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    bm.allocate(0, ids)
    step_logits, done = [], 0
    while len(ids) < total:
        count = min(8, len(ids) - done)
        bm.reserve(0, done, count)
        x, pos, ctx = AttentionContext.build(cache, bm, [(0, ids[done:done + count], done)], [count - 1], "cpu")
        logits = model(x, pos, ctx)[-1]
        done += count
        if done == len(ids):
            step_logits.append(logits)
            ids.append(int(logits.argmax()))
    dense = model(torch.tensor(ids), torch.arange(total))
    assert ids[prompt_len:] == dense[prompt_len - 1:-1].argmax(-1).tolist(), "greedy tokens differ"
    assert (torch.stack(step_logits) - dense[prompt_len - 1:-1]).abs().max() < 1e-4, \
        "paged windowed logits must match the dense windowed reference"
    unwindowed = tiny_model(seed=1)(torch.tensor(ids), torch.arange(total))
    assert not torch.allclose(unwindowed, dense, atol=1e-2), "the window must matter"


@pytest.mark.needs("kv-cache-bytes")
def test_kv_heads_presets_scale_the_bytes_per_token():
    """The lecture's GQA arithmetic on presets: MHA / GQA-8 = 4 and GQA-8 / MQA = 8."""
    mha, gqa, mqa = (kv_cache_bytes(read_config(f"random:llama-3.2-1b{o}"), torch.bfloat16)
                     for o in (":kv_heads=32", "", ":seed=1:kv_heads=1"))
    assert mha / gqa == 4.0 and gqa / mqa == 8.0 and mqa == 2 * 16 * 64 * 2


# ------------------------------------------------------------------- misuse

@pytest.mark.assignment("block-allocation")
@pytest.mark.needs("kv-cache-bytes")
def test_misuse_fails_loudly():
    """A reserve the pool cannot hold raises and changes nothing; freeing twice, allocating a
    sequence twice and a block size that is not a positive int raise, naming the rule."""
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    bm.allocate(1, [1, 2, 3])
    bm.append_slots(1, 0, 3)
    with pytest.raises(RuntimeError, match="no free blocks"):
        bm.append_slots(1, 3, 10)              # 13 tokens > 2 blocks of 4
    assert bm.tables[1] == [0] and bm.num_free_blocks == 1, "a failed append changes nothing"
    bm.free(1)
    with pytest.raises(ValueError, match="freed twice"):
        bm.free(1)
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate(2, [1]), bm.allocate(2, [1])
    for bad in (0, -4, 2.5, "16"):
        with pytest.raises(ValueError, match="block_size"):
            BlockManager(4, bad)
        with pytest.raises(ValueError, match="block_size"):
            num_blocks_for_budget(100, bad, 10**6)
    with pytest.raises(ValueError, match="too small"):
        KVCache(tiny_config(), num_blocks_for_budget(1000, 16, 100), 16, "cpu", torch.float32)


# ---- paths the rest of this file does not reach

class ShadowKV:
    """What the KV pool would hold, slot by slot, written as the engine writes
    it: the K/V of position p depend on every token up to p, so a slot holds
    the whole prefix tokens[:p + 1] it was computed from (None: never written).
    Copy-on-write copies a block's slots. Independent of the BlockManager: it
    only sees the slots the manager hands out and the copies it asks for."""

    def __init__(self, num_blocks, block_size):
        self.bs = block_size
        self.slots = [[None] * block_size for _ in range(num_blocks)]

    def copy(self, src, dst):
        self.slots[dst] = list(self.slots[src])

    def write(self, slot, prefix):
        self.slots[slot // self.bs][slot % self.bs] = prefix

    def holds(self, table, tokens, upto):
        """Positions [0, upto) of a sequence read back its own prefixes through its table."""
        return all(self.slots[table[p // self.bs]][p % self.bs] == tuple(tokens[:p + 1]) for p in range(upto))


def check_block_manager(bm, kv, seqs):
    """The invariants, computed here from the manager's public state."""
    pool = bm.num_blocks
    refs = [0] * pool
    for sid, table in bm.tables.items():
        assert len(set(table)) == len(table), f"sequence {sid}'s table repeats a block: {table}"
        for b in table:
            refs[b] += 1
    assert list(bm.ref_count) == refs, "a reference count differs from the number of tables holding the block"
    free = list(bm.free_blocks)
    assert len(set(free)) == len(free), "a block is twice in the free list"
    assert set(free) == {b for b in range(pool) if refs[b] == 0}, "the free list is not exactly the unused blocks"
    assert bm.num_free_blocks + sum(r > 0 for r in refs) == pool, "free + used blocks must be the whole pool"
    held = {}
    for h, b in bm.cached.items():            # every cached hash: a full block holding one consistent prefix
        slots = kv.slots[b]
        assert None not in slots, f"prefix cache entry {h} points at block {b}, which is not full"
        assert all(len(slots[j]) == len(slots[0]) + j and slots[j][:len(slots[0])] == slots[0]
                   for j in range(1, bm.block_size)), f"cached block {b} holds tokens of different prefixes"
        assert len(slots[-1]) % bm.block_size == 0, f"cached block {b} does not end on a block boundary"
        assert slots[-1] not in held, f"blocks {held.get(slots[-1])} and {b} are cached for the same prefix"
        held[slots[-1]] = b
    for sid, s in seqs.items():               # every sequence reads back its own tokens' K/V
        assert kv.holds(bm.tables[sid], s["tokens"], s["computed"]), \
            f"sequence {sid}'s blocks do not hold the K/V of its own first {s['computed']} tokens"


@pytest.mark.assignment("copy-on-write")
@pytest.mark.needs("block-allocation", "prefix-caching")
def test_block_manager_against_a_model_of_the_pool():
    """Seeded random allocate / append (prefill chunks, decodes) / fork /
    truncate / free / preempt / cache_full_blocks / prefix lookups, 3000 of
    them, the way the engine drives the manager. After every operation:
    reference counts equal table references, free + used = the pool, the free
    list keeps least-recently-used order (taken from the front, given back at
    the end, a table tail first), every cached hash names a full block with
    that content, every sequence's blocks hold its own tokens' K/V (a shadow
    pool written through the slots handed out, copy-on-write copies
    included), prefix hits are sound and find every prefix registered once
    and still held; after freeing everything nothing leaks."""
    rng = random.Random(7)
    bs, pool = 4, 48
    bm, kv = BlockManager(num_blocks=pool, block_size=bs), ShadowKV(pool, bs)
    seqs, waiting = {}, []                    # live: sid -> {"tokens", "computed"}; preempted token lists
    registered, ever = {}, {}                 # block -> prefix registered by cache_full_blocks; prefix -> times
    stems = [[rng.randrange(30) for _ in range(rng.randint(0, 13))] for _ in range(4)]
    ids = iter(range(10**9))
    counts = dict.fromkeys(["admit", "step", "fork", "truncate", "free", "preempt", "probe", "abort", "hit"], 0)

    def forget(blocks):
        for b in blocks:
            registered.pop(b, None)

    def lookup(sid, tokens):
        """allocate, checked: hits are whole blocks, leave the last token, hold
        this prompt's K/V, and reach at least every leading prefix registered
        exactly once whose block still holds it."""
        free_before = list(bm.free_blocks)
        hit = bm.allocate(sid, tokens)
        table = bm.tables[sid]
        assert hit % bs == 0 and hit == len(table) * bs and hit < len(tokens), \
            f"allocate({len(tokens)} tokens) returned {hit} cached tokens over {len(table)} blocks"
        assert kv.holds(table, tokens, hit), "a prefix hit returned a block holding other tokens' K/V"
        live = set(registered.values())
        want = 0
        while want < (len(tokens) - 1) // bs:
            p = tuple(tokens[:(want + 1) * bs])
            if ever.get(p) != 1 or p not in live:
                break
            want += 1
        assert hit >= want * bs, f"a prompt whose first {want} blocks are cached found only {hit // bs}"
        assert list(bm.free_blocks) == [b for b in free_before if b not in table], \
            "a hit must take its block out of the free list and leave the others' order alone"
        counts["hit"] += hit // bs
        return hit

    def feed(sid, count, run=True):
        """Reserve slots for the next `count` tokens; then (the step running)
        copy-on-write, write their K/V, register the full blocks."""
        s = seqs[sid]
        start, table_before = s["computed"], list(bm.tables[sid])
        shared = {i for i in range(start // bs, min(len(table_before), -(-(start + count) // bs)))
                  if bm.ref_count[table_before[i]] > 1}
        free_before = list(bm.free_blocks)
        slots = bm.append_slots(sid, start, count)
        table = bm.tables[sid]
        assert len(table) == max(len(table_before), -(-(start + count) // bs)), "the table grows by what it needs"
        fresh = [table[i] for i in shared] + table[len(table_before):]
        assert sorted(fresh) == sorted(free_before[:len(fresh)]), "new blocks come from the least recently used end"
        assert list(bm.free_blocks) == free_before[len(fresh):], \
            "blocks are taken from the front of the free list; the rest keep their order"
        assert [i for i in range(len(table_before)) if table[i] != table_before[i]] == sorted(shared), \
            "exactly the shared blocks written to get a private copy"
        assert sorted(bm.pending_copies) == sorted((table_before[i], table[i]) for i in shared), \
            "pending_copies must list (shared block, its private copy) for every block copied on write"
        assert slots == [table[p // bs] * bs + p % bs for p in range(start, start + count)], \
            "slot = block * block_size + offset for each new position"
        forget(fresh)
        if not run:
            return
        for src, dst in bm.pending_copies:        # the engine: copies first, then the new K/V
            kv.copy(src, dst)
        bm.pending_copies.clear()
        for p, slot in zip(range(start, start + count), slots):
            forget([table[p // bs]])              # its content changes: it no longer names the old prefix
            kv.write(slot, tuple(s["tokens"][:p + 1]))
        s["computed"] += count
        if rng.random() < 0.85:                   # the engine registers after every step (skipped now and then)
            bm.cache_full_blocks(sid, s["tokens"], s["computed"])
            for i in range(s["computed"] // bs):
                b = table[i]
                if b not in registered:
                    registered[b] = p = tuple(s["tokens"][:(i + 1) * bs])
                    ever[p] = ever.get(p, 0) + 1

    def release(sid, how):
        """free() (finish, abort, preempt): the table goes back tail first."""
        table, free_before = list(bm.tables[sid]), list(bm.free_blocks)
        bm.free(sid)
        del seqs[sid]
        back = [b for b in reversed(table) if bm.ref_count[b] == 0]
        assert list(bm.free_blocks) == free_before + back, \
            f"{how}: blocks go back at the most recently used end, the table's tail first"

    for step in range(3000):
        op = rng.random()
        live = list(seqs)
        if op < 0.2 or not live:                                          # admit (or re-admit a preempted one)
            tokens = waiting.pop(0) if waiting and rng.random() < 0.5 else \
                rng.choice(stems) + [rng.randrange(30) for _ in range(rng.randint(1, 12))]
            sid = next(ids)
            hit = lookup(sid, tokens)
            seqs[sid] = {"tokens": list(tokens), "computed": hit}
            chunk = rng.randint(1, len(tokens) - hit)
            if bm.can_append(sid, hit, chunk):
                feed(sid, chunk)
                counts["admit"] += 1
            else:                                                         # no room: back to waiting, as the scheduler does
                release(sid, "refused admission")
        elif op < 0.55:                                                   # one step: a prefill chunk or a decode
            sid = rng.choice(live)
            s = seqs[sid]
            if s["computed"] == len(s["tokens"]):                         # decode: 1 token, or 1 + drafts
                s["tokens"] += [rng.randrange(30) for _ in range(rng.choice([1, 1, 1, 3]))]
            count = rng.randint(1, len(s["tokens"]) - s["computed"])
            if bm.can_append(sid, s["computed"], count):
                feed(sid, count)
                counts["step"] += 1
            else:                                                         # the pool is full: preempt the newest
                victim = max(live)
                waiting.insert(0, seqs[victim]["tokens"])
                release(victim, "preempt")
                counts["preempt"] += 1
        elif op < 0.63:                                                   # fork (n > 1 after the prompt)
            sid, child = rng.choice(live), next(ids)
            before = list(bm.free_blocks)
            bm.fork(sid, child)
            assert bm.tables[child] == bm.tables[sid] and list(bm.free_blocks) == before, "a fork copies nothing"
            assert bm.pending_copies == [], \
                "a fork schedules no copy: copy-on-write copies only when a shared block is written"
            seqs[child] = {"tokens": list(seqs[sid]["tokens"]), "computed": seqs[sid]["computed"]}
            counts["fork"] += 1
        elif op < 0.73:                                                   # speculative rollback
            sid = rng.choice(live)
            s = seqs[sid]
            if s["computed"] == 0:
                continue
            keep = rng.randint(max(1, s["computed"] - 7), s["computed"])
            table = list(bm.tables[sid])
            bm.truncate(sid, keep)
            assert bm.tables[sid] == table[:-(-keep // bs)], "truncate keeps the blocks of the first tokens"
            forget(table[-(-keep // bs):])           # dropped blocks held rejected drafts: uncached
            if keep % bs and bm.ref_count[table[keep // bs]] == 1:
                forget([table[keep // bs]])           # a block now partly valid for its only owner: uncached
            s["tokens"], s["computed"] = s["tokens"][:keep], keep       # the rejected drafts are gone
            counts["truncate"] += 1
        elif op < 0.83:                                                   # finish
            release(rng.choice(live), "free")
            counts["free"] += 1
        elif op < 0.88:                                                   # preempt by recompute
            sid = rng.choice(live)
            waiting.insert(0, seqs[sid]["tokens"])
            release(sid, "preempt")
            counts["preempt"] += 1
        elif op < 0.97:                                                   # prefix lookup of a running prefix
            sid = rng.choice(live)
            s = seqs[sid]
            probe = next(ids)
            lookup(probe, s["tokens"][:s["computed"]] + [rng.randrange(30)])
            bm.free(probe)
            counts["probe"] += 1
        else:                                                             # aborted after its slots were reserved
            sid = rng.choice(live)
            s = seqs[sid]
            if s["computed"] < len(s["tokens"]) and bm.can_append(sid, s["computed"], 1):
                feed(sid, 1, run=False)
                release(sid, "abort")
                assert bm.pending_copies == [], "a copy into a block given back must never run"
                counts["abort"] += 1
        check_block_manager(bm, kv, seqs)
    for sid in list(seqs):
        release(sid, "free")
    check_block_manager(bm, kv, seqs)
    assert bm.num_free_blocks == pool and not any(bm.ref_count) and not bm.tables and not bm.pending_copies, \
        "blocks leaked after every sequence was freed"
    assert min(counts.values()) > 0, f"the random run missed an operation: {counts}"


@pytest.mark.assignment("block-allocation")
def test_more_misuse_fails_loudly_and_changes_nothing():
    """A pool of no blocks, forking into a sequence that already has blocks,
    and taking a block from an empty free list (the scheduler's job to
    prevent) each raise with a message saying what went wrong, and a refused
    fork leaves the tables and counts as they were."""
    with pytest.raises(ValueError, match="no blocks"):
        BlockManager(num_blocks=0, block_size=4)
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    bm.allocate(1, [1, 2, 3])
    bm.append_slots(1, 0, 3)
    bm.allocate(2, [4])
    bm.append_slots(2, 0, 1)
    with pytest.raises(ValueError, match="sequence 2 already has blocks"):
        bm.fork(1, 2)
    assert bm.tables == {1: [0], 2: [1]} and bm.ref_count == [1, 1], "a refused fork must change nothing"
    with pytest.raises(RuntimeError, match="out of blocks"):
        bm._take_free()


# ---- cross-layer attention (CLA): a way to count bytes per token

@pytest.mark.needs("engine", "sliding-window")
def test_cross_layer_attention_caches_one_layer_in_s_and_stays_exact():
    """random:<preset>:cla_share=2: the second layer of each pair has q alone and reads the first
    one's K/V; the pool holds half the layers (half the bytes per token, exactly, and twice the
    tokens in the same budget); the paged engine (chunked prefill, prefix cache, a pool small
    enough to preempt) gives the dense CLA model's greedy tokens (the compiled step:
    test_graphs.py's aot_eager test); options out of range are refused by name."""
    from helpers import assert_no_leak, run_staggered

    from engine import LLM
    from model import generate, load_model
    from sampler import SamplingParams
    model, cfg = load_model("random:smollm2-tiny:cla_share=2")
    plain, plain_cfg = load_model("random:smollm2-tiny")
    assert (cfg.kv_layers, plain_cfg.kv_layers) == (1, 2), "S = 2: one K/V layer per two layers"
    assert model.layers[1].self_attn.qkv_proj.weight.shape[0] == cfg.n_heads * cfg.head_dim, "a sharing layer: q only"
    assert 2 * kv_cache_bytes(cfg, torch.float32) == kv_cache_bytes(plain_cfg, torch.float32), "half the bytes per token"
    prompts = [[5, 6, 7, 8] * 4, list(range(100, 130)), [42] * 7, [9, 8, 7, 6, 5]]
    dense = [generate(model, p, 16) for p in prompts]
    assert dense != [generate(plain, p, 16) for p in prompts], "sharing K/V must change what the model computes"
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts)
    llm = LLM("random:smollm2-tiny:cla_share=2", kv_cache_bytes=14 * 4 * 256, block_size=4, max_num_seqs=3,
              max_num_batched_tokens=8)
    assert run_staggered(llm, prompts, params) == dense, "the paged CLA engine differs from the dense model"
    assert llm.scheduler.num_preemptions > 0, "the pool was meant to preempt"
    assert_no_leak(llm)
    same = dict(kv_cache_bytes=1 << 16, block_size=16)
    assert LLM("random:smollm2-tiny:cla_share=2", **same).block_manager.num_blocks == \
        2 * LLM("random:smollm2-tiny", **same).block_manager.num_blocks, "twice the tokens in the same budget"
    with pytest.raises(ValueError, match="cla_share"):
        read_config("random:smollm2-tiny:cla_share=0")


# ---- multi-head latent attention (MLA): another way to count bytes per token

def _tokens_that_fit(path: str, budget: int) -> int:
    """Tokens the block manager hands out, 1,024-token sequences one after another, from the pool a
    bf16 byte budget sizes for the model at `path` (its config alone: no weight is made)."""
    cfg = read_config(path)
    bm = BlockManager(num_blocks_for_budget(kv_cache_bytes(cfg, torch.bfloat16), 16, budget), 16,
                      enable_prefix_caching=False)
    seq = 0
    while bm.num_free_blocks * 16 >= 1024:
        bm.allocate(seq, [seq] * 1024)
        bm.reserve(seq, 0, 1024)
        seq += 1
    return seq * 1024


@pytest.mark.needs("kv-cache-bytes", "block-allocation")
def test_mla_caches_one_latent_per_token_and_layer():
    """MLA's bytes per token = layers * (r + R) * bytes, no factor 2 (one latent serves K and V):
    DeepSeek-V2-Lite's attention in bf16, 27 * (512 + 64) * 2 = 31,104 B; a LatentCache allocates
    exactly that. On Llama-3.1-8B's body, MLA (r = 512) lets the block manager hand out >= 14x the
    tokens of the same body with MHA (32 KV heads) in the same budget (8,192 / 576 = 14.2x)."""
    from cache import LatentCache, new_kv_cache
    cfg = read_config("random:deepseek-v2-lite-attn")
    assert kv_cache_bytes(cfg, torch.bfloat16) == 27 * 576 * 2 == 31_104, "layers * (r + R) * 2 bytes"
    tiny = read_config("random:deepseek-mla-tiny")
    cache = new_kv_cache(tiny, 5, 16, "cpu", torch.float32)
    assert isinstance(cache, LatentCache) and cache.total_bytes == kv_cache_bytes(tiny, torch.float32, 5 * 16), \
        "a LatentCache allocates exactly kv_cache_bytes (one pool: V is a view of K's first r values)"
    mha, mla = (_tokens_that_fit(f"random:llama-3.1-8b:{o}", 2 << 30) for o in ("kv_heads=32", "kv_lora_rank=512"))
    assert mla >= 14 * mha, f"MLA holds {mla} tokens, MHA {mha}: {mla / mha:.1f}x, the lecture's 14x"


@pytest.mark.timeout(300)
@pytest.mark.needs("engine", "mla-absorb", "model")
def test_mla_engine_gives_the_naive_models_tokens():
    """random:deepseek-mla-tiny (MLA with low-rank queries): the paged engine (latents only in the
    pool, absorbed attention; chunked prefill, a shared prefix from the cache, a pool small enough to
    preempt, requests joining at different steps) gives the naive dense model's greedy tokens, and
    gives back every block. An int8 KV cache and tensor parallelism are refused by name."""
    from helpers import assert_no_leak, run_staggered

    from engine import LLM
    from model import generate, load_model
    from sampler import SamplingParams
    from support.checks import check_tensor_parallel
    model, cfg = load_model("random:deepseek-mla-tiny")
    prompts = [[5, 6, 7, 8] * 4, list(range(100, 130)), [5, 6, 7, 8] * 4 + [9, 10], [9, 8, 7, 6, 5]]
    dense = [generate(model, p, 16) for p in prompts]
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts)
    per_token = kv_cache_bytes(cfg, torch.float32)
    llm = LLM("random:deepseek-mla-tiny", kv_cache_bytes=14 * 4 * per_token, block_size=4, max_num_seqs=3,
              max_num_batched_tokens=8)
    assert run_staggered(llm, prompts, params) == dense, "the paged MLA engine differs from the naive dense model"
    assert llm.scheduler.num_preemptions > 0, "the pool was meant to preempt"
    assert llm.block_manager.prefix_hits > 0, "the third prompt was meant to reuse the first one's blocks"
    assert_no_leak(llm)
    with pytest.raises(ValueError, match="int8"):
        LLM("random:deepseek-mla-tiny", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="tensor parallelism"):
        check_tensor_parallel(cfg, 2)


def _local_global_checkpoint(tmp_path, window: int, every: int, n_layers: int = 6, **overrides):
    """A tiny Llama of n_layers with a window W on its local layers and a global one every N (written
    as a checkpoint directory: config.json gains sliding_window and global_every); and the model."""
    import json

    from helpers import save_checkpoint
    model = tiny_model(seed=3, n_layers=n_layers, sliding_window=window, global_every=every, **overrides)
    save_checkpoint(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "sliding_window": window, "global_every": every}))
    return str(tmp_path), model


@pytest.mark.timeout(300)
@pytest.mark.needs("engine", "sliding-window", "model")
def test_local_and_global_layers_give_the_dense_models_tokens(tmp_path):
    """global_every = 3 over 6 layers, window 8 (layers 2 and 5 global, the others local): two pools and
    two block managers (cache.HybridCache, HybridBlockManager). The paged engine (chunked prefill,
    preemption, a prefix from the cache, n = 2 forks writing a shared block, requests joining at
    different steps; n-gram speculation) gives the dense model's greedy tokens, each layer masked by its
    own window, and gives back every block of both pools. The dense model is not the all-local or the
    all-global one. compile=True and an int8 KV cache are refused by name."""
    from helpers import run_staggered

    from engine import LLM
    from model import generate
    from sampler import SamplingParams
    path, model = _local_global_checkpoint(tmp_path, window=8, every=3)
    assert [model.config.window_of(i) for i in range(6)] == [8, 8, None, 8, 8, None], "Gemma's (i + 1) % N"
    ids, pos = torch.tensor(list(range(5, 45))), torch.arange(40)
    logits = model(ids, pos)
    for every, window in ((0, 8), (0, None)):    # all local, all global: different models
        model.config.global_every, model.config.sliding_window = every, window
        other = type(model)(model.config)
        other.load_state_dict(model.state_dict())
        assert not torch.allclose(other(ids, pos), logits), "the test would not see a wrong window"
    model.config.global_every, model.config.sliding_window = 3, 8
    prompts = [[5, 6, 7, 8] * 5, list(range(100, 130)), [5, 6, 7, 8] * 5 + [9, 10], [9, 8, 7, 6, 5]]
    dense = [generate(model, p, 20) for p in prompts]
    local_pool = (1 + 3 * (2 + 2) + 2) * 4 * 4 * 256      # blocks (cache.local_pool) x 4 tokens x 4 layers
    llm = LLM(path, block_size=4, max_num_seqs=3, max_num_batched_tokens=8,
              kv_cache_bytes=local_pool + 14 * 4 * kv_cache_bytes(model.config, torch.float32))
    params = [SamplingParams(max_tokens=20, ignore_eos=True)] * len(prompts)
    assert run_staggered(llm, prompts, params) == dense, "the paged local + global engine differs from the dense model"
    assert llm.scheduler.num_preemptions > 0, "the pool was meant to preempt"
    assert llm.block_manager.prefix_hits > 0, "the third prompt was meant to reuse the first one's blocks"
    forked = llm.generate([prompts[3]], SamplingParams(n=2, max_tokens=20, ignore_eos=True))[0]
    assert [s.token_ids for s in forked.outputs] == [dense[3]] * 2, "n = 2: both samples greedy"
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.local.num_free_blocks == bm.local.num_blocks - 1, "leak"
    bm.check_invariants()
    spec = LLM(path, block_size=4, speculative="ngram", num_speculative_tokens=3)   # rollback in both pools
    assert [o.token_ids for o in spec.generate(prompts, params)] == dense, "n-gram speculation changed a token"
    for bad in (dict(compile=True), dict(kv_cache_dtype="int8")):
        with pytest.raises(ValueError, match="global_every"):
            LLM(path, **bad)


@pytest.mark.timeout(300)
@pytest.mark.needs("engine", "sliding-window", "model")
def test_local_and_global_layers_hold_a_window_per_local_layer(tmp_path):
    """One sequence at 4,096 tokens, window 64, a global layer every 3 of 6: the two block managers hold
    (1/N + (N-1)/N * W/4096) of full attention's KV (2 layers x 256 blocks + 4 x 4 blocks of 6 x 256),
    what all-local would hold is 4 blocks a layer; bytes per token count the global layers alone, so the
    same budget holds N = 3x the tokens of full attention (less the local layers' pool)."""
    from engine import LLM
    from sampler import SamplingParams
    path, _ = _local_global_checkpoint(tmp_path, window=64, every=3, max_seq_len=4200)
    llm = LLM(path, block_size=16, max_num_seqs=1, max_num_batched_tokens=512, enable_prefix_caching=False,
              kv_cache_bytes=4 << 20)
    cfg = llm.config
    assert (cfg.kv_layers, kv_cache_bytes(cfg, torch.float32)) == (2, 2 * 2 * cfg.n_kv_heads * cfg.head_dim * 4)
    llm.add_request([3 + i % 500 for i in range(4095)], SamplingParams(max_tokens=3, ignore_eos=True))
    held = None
    while llm.has_unfinished_requests():
        llm.step()
        bm = llm.block_manager
        for sid, table in bm.tables.items():
            if len(table) == 256 and llm.scheduler.running[0].num_computed == 4096:    # 4,096 in cache
                local = sum(b != bm.local.null_block for b in bm.local.tables[sid])
                held = (len(table), local)
    assert held == (256, 4), f"full and local blocks held at 4,096 tokens: {held}"
    ratio = (2 * held[0] + 4 * held[1]) / (6 * 256)
    assert ratio <= 1 / 3 + 2 / 3 * 64 / 4096, f"{ratio:.4f} of full attention's KV blocks"
    full_per_token = 2 * 6 * cfg.n_kv_heads * cfg.head_dim * 4
    assert llm.block_manager.num_blocks * 16 >= 2.5 * ((4 << 20) // full_per_token), "~3x the tokens"
