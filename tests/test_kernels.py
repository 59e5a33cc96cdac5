"""Assignment: kernels.py -- attention over the paged cache, vectorized and compiled.

To pass, implement:
  * batched_paged_attention: the vectorized paged attention for up to Q new
    queries per sequence: one gather through the block tables, a length mask,
    GQA without copying K, V per query head (head h reads KV head h // group). It must equal the
    reference cache.paged_attention on ragged batches, any block size and
    grouping, with block tables padded by garbage ids. On CUDA (kernels.on_cuda) it hands
    k, v and the mask to grouped_attention: no fused CUDA kernel takes a mask AND GQA;
  * paged_attention_in_place: the same function, written so that torch.compile
    fuses the gather into its reductions (no copy of the blocks); equal to the
    reference eagerly and compiled, for plain and int8 caches and ragged
    query lengths;
  * a sliding window (cache.sliding_window = W, Mistral's): in every path above, a query at
    position p sees keys p-W+1..p only (a band mask; freed table entries point at the null
    block, which the mask hides), equal to model.dense_causal_attention(window=W); an engine
    with a window (eager, compiled, CUDA graphs) gives the dense windowed model's greedy tokens,
    and a 4,096-token sequence with W = 256 holds at most 17 blocks of 16;
  * StepContext: any mix of prefill chunks (with or without a cached prefix), decodes and
    k+1-token verifications in one step (built by graphs.StepInputs), as a few query-length
    groups, equal to cache.paged_attention; LLM(compile=True) (graphs.py) then gives exactly
    the eager engine's tokens;
  * on CUDA (given): the compiled step's attention over a plain pool is one Triton kernel,
    kernels.paged_decode (flash-decoding through the block table); it equals
    paged_attention_in_place, here through Triton's interpreter when triton is installed.
The compiled step around these (buckets, staging, CUDA graphs) is tests/test_graphs.py's.
Compilation is kept cheap: 2- and 3-layer models, max_num_seqs 4, and an
inductor cache in the test's temporary folder.
"""
import random

import pytest
import torch
from helpers import run_staggered, tiny_config, tiny_model

from cache import KVCache, paged_attention
from cache import BlockManager
from graphs import StepInputs, size_oblivious
from kernels import batched_paged_attention, paged_attention_in_place
from quantize import Int8KVCache
from engine import LLM, SamplingParams


@pytest.fixture(autouse=True)
def inductor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


ATTENTION_CASES = [(1, 6, 2, 1), (4, 6, 6, 1), (16, 8, 2, 3), (4, 9, 3, 5)]   # block size, heads, KV heads, Q


def _random_pool(cache_cls, block_size, n_heads, n_kv, Q, ragged=False):
    """A pool of random K, V (int8 values and scales for Int8KVCache), 5
    sequences over shuffled blocks, tables padded with garbage ids, and Q
    queries per sequence (ragged: 1..Q real ones). Returns (cache, q [B, Q, H, d],
    tables [B, W], seq_lens, query_lens)."""
    cfg = tiny_config(n_heads=n_heads, n_kv_heads=n_kv)
    rng = random.Random(block_size * 100 + n_heads + Q)
    torch.manual_seed(block_size + Q)
    num_blocks = 256                                    # enough for 5 x 40 tokens at block size 1
    cache = cache_cls(cfg, num_blocks, block_size, "cpu", torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape) if cache.k.is_floating_point() else
                  torch.randint(-127, 128, cache.k.shape, dtype=torch.int8))
    cache.v.copy_(torch.randn(cache.v.shape) if cache.v.is_floating_point() else
                  torch.randint(-127, 128, cache.v.shape, dtype=torch.int8))
    if cache_cls is Int8KVCache:
        cache.k_scale.uniform_(0.001, 0.02)
        cache.v_scale.uniform_(0.001, 0.02)
    seq_lens = [rng.randint(Q, 40) for _ in range(5)]
    query_lens = [rng.randint(1, Q) if ragged else Q for _ in seq_lens]
    width = max(-(-n // block_size) for n in seq_lens) + 2          # padded wider than needed
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables, used = [], 0
    for n in seq_lens:
        need = -(-n // block_size)
        own = blocks[used:used + need]
        used += need
        tables.append(own + [rng.randrange(num_blocks) for _ in range(width - need)])   # garbage padding
    q = torch.randn(len(seq_lens), Q, n_heads, cfg.head_dim)
    return cache, q, torch.tensor(tables), seq_lens, query_lens


def _fast_equals_reference(cache_cls, block_size, n_heads, n_kv, Q):
    cache, q, bt, seq_lens, _ = _random_pool(cache_cls, block_size, n_heads, n_kv, Q)
    for layer in range(cache.k.shape[0]):
        ref = paged_attention(q.flatten(0, 1), cache, layer, bt, seq_lens, [Q] * len(seq_lens))
        out = batched_paged_attention(q, cache, layer, bt, torch.tensor(seq_lens)).flatten(0, 1)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5,
                                   msg=f"{cache_cls.__name__} layer {layer}: batched attention differs from "
                                       f"cache.paged_attention (one sequence at a time)")


@pytest.mark.parametrize("block_size,n_heads,n_kv,Q", ATTENTION_CASES)
@pytest.mark.assignment("decode-attention")
@pytest.mark.needs("paged-attention", "kv-cache-bytes")
def test_fast_decode_attention_equals_reference(block_size, n_heads, n_kv, Q):
    """batched_paged_attention over 5 sequences of a shuffled pool (tables padded with garbage
    ids, Q queries each) equals the reference paged attention, block sizes 1-16, GQA 1-4."""
    _fast_equals_reference(KVCache, block_size, n_heads, n_kv, Q)


@pytest.mark.parametrize("W", [1, 5, 16])
@pytest.mark.assignment("decode-attention")
@pytest.mark.needs("kv-cache-bytes")
def test_batched_and_in_place_attention_keep_a_sliding_window(W):
    """cache.sliding_window = W: in batched_paged_attention and in paged_attention_in_place (the
    compiled path's formulation) the query at position p sees keys p - W < k <= p only. The
    reference is written here: the keys gathered through each table, a band mask, float64."""
    cache, q, bt, seq_lens, _ = _random_pool(KVCache, 4, 6, 2, 3)
    cache.sliding_window = W
    B, Q, H, d = q.shape
    k, v = cache.blocks(0, bt)                                    # [B, width, bs, n_kv, d]
    k, v = (t.flatten(1, 2).double().repeat_interleave(H // k.shape[-2], dim=2) for t in (k, v))
    ref = torch.empty(B, Q, H, d, dtype=torch.float64)
    for b, n in enumerate(seq_lens):
        pos, keys = torch.arange(n - Q, n)[:, None], torch.arange(k.shape[1])[None, :]
        band = (keys <= pos) & (keys > pos - W)                   # [Q, T]: the last W positions
        scores = torch.einsum("qhd,thd->hqt", q[b].double(), k[b]) / d ** 0.5
        p = scores.masked_fill(~band, float("-inf")).softmax(-1)
        ref[b] = torch.einsum("hqt,thd->qhd", p, v[b])
    out = batched_paged_attention(q, cache, 0, bt, torch.tensor(seq_lens))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5,
                               msg=f"window {W}: the batched attention must see keys p - W < k <= p only")
    q_pos = torch.tensor(seq_lens)[:, None] - Q + torch.arange(Q)
    out = paged_attention_in_place(q, cache, 0, bt, q_pos)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5,
                               msg=f"window {W}: the compiled path's attention must see keys p - W < k <= p only")
    # a mixed step: a chunk of Q beside decodes of 1 (query_lens), at a caller's scale
    lens, scale = torch.tensor([Q] + [1] * (B - 1)), 0.3
    out = batched_paged_attention(q, cache, 0, bt, torch.tensor(seq_lens), lens, scale=scale)
    for b, (n, m) in enumerate(zip(seq_lens, lens.tolist())):      # padding rows: the last real position
        pos, keys = torch.arange(n - m, n - m + Q).clamp(max=n - 1)[:, None], torch.arange(k.shape[1])[None, :]
        band = (keys <= pos) & (keys > pos - W)
        p = (torch.einsum("qhd,thd->hqt", q[b].double(), k[b]) * scale).masked_fill(~band, float("-inf"))
        torch.testing.assert_close(out[b].double(), torch.einsum("hqt,thd->qhd", p.softmax(-1), v[b]),
                                   atol=1e-5, rtol=1e-5, msg=f"window {W}, {m} real queries at scale {scale}")


@pytest.mark.assignment("decode-attention")
@pytest.mark.needs("paged-attention", "kv-cache-bytes")
def test_attentions_read_mla_latents_at_their_scale():
    """MLA's cache (cache.LatentCache): ONE KV head of r + R = 24 values per token, V its first
    r = 16, and the heads' own scale passed in. The reference loop, batched_paged_attention and
    paged_attention_in_place all equal a float64 reference written here: outputs [.., H, r] (not
    r + R), scores times the given scale (not 1/sqrt(r + R))."""
    from cache import LatentCache
    cfg = tiny_config(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, head_dim=8,
                      n_kv_heads=1)
    torch.manual_seed(3)
    cache = LatentCache(cfg, 40, 4, "cpu", torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape))
    seq_lens, Q, H, scale = [5, 17, 30], 2, 6, 0.3
    blocks = torch.randperm(40).tolist()
    bt = torch.tensor([blocks[i * 8:(i + 1) * 8] for i in range(3)])          # [B, 8]: 32 tokens each
    q = torch.randn(3, Q, H, 24)
    keys = cache.k[0][bt].flatten(1, 2)[:, :, 0].double()                      # [B, 32, r + R]
    ref = torch.empty(3, Q, H, 16, dtype=torch.float64)
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n - Q, n)[:, None]
        scores = torch.einsum("qhd,td->hqt", q[b].double(), keys[b]) * scale
        p = scores.masked_fill(torch.arange(32)[None, :] > pos, float("-inf")).softmax(-1)
        ref[b] = torch.einsum("hqt,tr->qhr", p, keys[b, :, :16])
    got = {"cache.paged_attention": paged_attention(q.flatten(0, 1), cache, 0, bt, seq_lens, [Q] * 3,
                                                    scale).view(3, Q, H, -1),
           "batched_paged_attention": batched_paged_attention(q, cache, 0, bt, torch.tensor(seq_lens), None, scale),
           "paged_attention_in_place": paged_attention_in_place(q, cache, 0, bt,
                                                                torch.tensor(seq_lens)[:, None] - Q + torch.arange(Q),
                                                                scale)}
    for name, out in got.items():
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, name=name: f"{name} over MLA's latents (V = the first r values, "
                                                            f"the given scale): {m}")


def _float64_attention(q, cache, layer, bt, seq_lens, query_lens=None, window=None):
    """The reference for the tests below, written here and independent of kernels.py: each
    sequence's keys read straight from the pool through its table (cache.k[layer][table]),
    query i of b at position n_b - m_b + i (a padded query at n_b - 1), a boolean causal (and
    band) mask applied with -inf, softmax(q k^T / sqrt(d)) v in float64. q [B, Q, H, d]."""
    B, Q, H, d = q.shape
    k, v = (t[layer][bt].flatten(1, 2).double() for t in (cache.k, cache.v))       # [B, T, n_kv, d]
    k, v = (t.repeat_interleave(H // t.shape[2], dim=2) for t in (k, v))           # query head h: KV h // G
    keys, out = torch.arange(k.shape[1])[None, :], torch.empty(B, Q, H, v.shape[-1], dtype=torch.float64)
    for b, n in enumerate(seq_lens):
        m = Q if query_lens is None else query_lens[b]
        pos = torch.arange(n - m, n - m + Q).clamp(max=n - 1)[:, None]            # [Q, 1]
        seen = (keys <= pos) & ((keys > pos - window) if window else True)         # [Q, T]
        scores = torch.einsum("qhd,thd->hqt", q[b].double(), k[b]) / d ** 0.5
        out[b] = torch.einsum("hqt,thd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v[b])
    return out


@pytest.mark.parametrize("W", [None, 3])
@pytest.mark.assignment("decode-attention")
@pytest.mark.needs("kv-cache-bytes")
def test_batched_attention_makes_its_masks_on_the_inputs_device(W, monkeypatch):
    """Every tensor batched_paged_attention makes itself (the query offsets, the causal mask
    from key positions, the window band) must be made on q's device: one made on the CPU
    (torch.arange(T) without device=) meets CUDA inputs and raises, a failure no CPU test
    sees. "meta" tensors stand in for CUDA here (shapes and dtypes, no data): the cache, q,
    tables and lengths all on "meta", with and without query_lens, without and with a window,
    on the CPU's fused path and on the CUDA path (kernels.on_cuda forced: grouped_attention).
    The output must come back on "meta", [B, Q, H, d], in q's dtype."""
    import kernels
    cfg = tiny_config(n_heads=4, n_kv_heads=2)
    cache = KVCache(cfg, 8, 4, "meta", torch.bfloat16)
    cache.sliding_window = W
    q = torch.empty(2, 3, 4, cfg.head_dim, device="meta", dtype=torch.bfloat16)
    bt = torch.zeros(2, 3, dtype=torch.long, device="meta")
    seq_lens = torch.tensor([7, 9], device="meta")
    for cuda in (False, True):
        monkeypatch.setattr(kernels, "on_cuda", lambda device, cuda=cuda: cuda)
        for query_lens in (None, torch.tensor([3, 1], device="meta")):
            case = f"window {W}, query_lens {'given' if query_lens is not None else 'None'}, " \
                   f"{'CUDA' if cuda else 'CPU'} path"
            try:
                out = batched_paged_attention(q, cache, 0, bt, seq_lens, query_lens)
            except NotImplementedError:        # an unfinished assignment says so itself
                raise
            except RuntimeError as e:
                raise AssertionError(f"{case}: inputs on a device other than the CPU raise (a tensor made on "
                                     f"the CPU, torch.arange without device=?): {e}") from e
            assert out.device.type == "meta", f"{case}: the output is on {out.device}, not the inputs' device"
            assert out.shape == (2, 3, 4, cfg.head_dim) and out.dtype == torch.bfloat16, \
                f"{case}: output {tuple(out.shape)} {out.dtype}, expected (2, 3, 4, {cfg.head_dim}) bfloat16"


@pytest.mark.assignment("decode-attention")
@pytest.mark.needs("kv-cache-bytes")
def test_batched_attention_keeps_bf16_in_bf16(monkeypatch):
    """A bf16 cache and bf16 queries give a bf16 output (the next layer's matmuls, the
    residual stream and CUDA graphs' static buffers are bf16; a float32 result doubles the
    bytes and breaks the caller's dtype), close to the float64 reference computed from the
    same bf16 values. Ragged queries (query_lens) and GQA 3, on the fused path and the CUDA
    path. Tolerance atol = rtol = 2**-8: rounding the output to bf16 alone costs up to 2**-9
    |ref| (half an ulp), and the rest is SDPA's own bf16 rounding inside.
    Measured, this seed: worst |out - ref| 0.0042 (53% of the allowance), of which the output's
    own rounding explains most (the float32 result rounded to bf16 is 0.0039 off); over 50
    seeds the worst was 0.0077, at most 0.0025 beyond 2**-8 |ref|."""
    import kernels
    torch.manual_seed(0)
    cfg = tiny_config(n_heads=6, n_kv_heads=2)
    cache = KVCache(cfg, 32, 4, "cpu", torch.bfloat16)
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    seq_lens, query_lens = [5, 13, 20], [3, 1, 2]
    blocks = torch.randperm(32).tolist()
    bt = torch.tensor([blocks[i * 6:(i + 1) * 6] for i in range(3)])            # 24 slots: padded tables
    q = torch.randn(3, 3, 6, cfg.head_dim).bfloat16()
    ref = _float64_attention(q, cache, 0, bt, seq_lens, query_lens)
    for cuda in (False, True):
        monkeypatch.setattr(kernels, "on_cuda", lambda device, cuda=cuda: cuda)
        out = batched_paged_attention(q, cache, 0, bt, torch.tensor(seq_lens), torch.tensor(query_lens))
        path = "the CUDA path" if cuda else "the fused path"
        assert out.dtype == torch.bfloat16, f"{path}: bf16 in, {out.dtype} out: attention must return q's dtype"
        torch.testing.assert_close(out.double(), ref, atol=2 ** -8, rtol=2 ** -8,
                                   msg=lambda m, path=path: f"{path}: bf16 attention far from the float64 "
                                                            f"reference: {m}")


@pytest.mark.parametrize("W", [None, 2])
@pytest.mark.assignment("decode-attention")
@pytest.mark.needs("kv-cache-bytes")
def test_batched_attention_masks_keys_exactly(W):
    """A masked key weighs exactly 0, however large its score: the mask must be boolean (or
    -inf), not an additive -10000 (BERT's), which a score 1e4 above the rest leaks through.
    One sequence of 6 tokens, its 2 new queries at positions 4 and 5, q = 10 everywhere; key 5
    (the future of query 4), key 7 (past the sequence, in its last block) and a padding block
    of the table are 1000 everywhere: scores 10 * 1000 * 16 / 4 = 40,000. With a window of 2,
    key 0 (outside every query's band) is 1000 too. Against the float64 reference written
    here (boolean mask, -inf), atol = rtol = 1e-5: measured 3.2e-7 (2e-16 with the window);
    an additive -1e4 mask is off by 1.6 (1.9)."""
    torch.manual_seed(1)
    cfg = tiny_config(n_heads=2, n_kv_heads=1)
    cache = KVCache(cfg, 4, 4, "cpu", torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    cache.sliding_window = W
    bt = torch.tensor([[2, 0, 1]])                        # positions 0-3: block 2, 4-7: block 0; block 1 pads
    for block, offset in [(0, 1), (0, 3)] + [(1, i) for i in range(4)] + ([(2, 0)] if W else []):
        cache.k[0, block, offset] = 1000.0                # keys 5, 7, the padding block (and key 0)
    q = torch.full((1, 2, 2, cfg.head_dim), 10.0)
    ref = _float64_attention(q, cache, 0, bt, [6], window=W)
    for query_lens in (None, torch.tensor([2])):
        out = batched_paged_attention(q, cache, 0, bt, torch.tensor([6]), query_lens)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"window {W}: a masked key with a score 40,000 above the "
                                                 f"rest changed the output (an additive mask, not -inf?): {m}")


@pytest.mark.parametrize("block_size,n_heads,n_kv,Q", ATTENTION_CASES)
@pytest.mark.assignment("int8")
@pytest.mark.needs("decode-attention", "paged-attention", "kv-cache-bytes")
def test_fast_decode_attention_reads_the_int8_cache(block_size, n_heads, n_kv, Q):
    """The same over the int8 KV cache (values and scales dequantized by its blocks())."""
    _fast_equals_reference(Int8KVCache, block_size, n_heads, n_kv, Q)


def _in_place_case(cache_cls, block_size, n_heads, n_kv, Q):
    """A ragged case: the reference over the real queries, and the in-place
    attention's inputs (a padded query repeats its sequence's last position)."""
    cache, q, bt, seq_lens, qlens = _random_pool(cache_cls, block_size, n_heads, n_kv, Q, ragged=Q > 1)
    i = torch.arange(Q)
    n, m = torch.tensor(seq_lens)[:, None], torch.tensor(qlens)[:, None]
    q_pos = n - m + torch.minimum(i, m - 1)                                  # [B, Q]
    real = i < m                                                             # [B, Q]: dropped after
    refs = [paged_attention(q[real], cache, layer, bt, seq_lens, qlens) for layer in range(cache.k.shape[0])]
    return cache, q, bt, q_pos, real, refs


@pytest.mark.parametrize("block_size,n_heads,n_kv,Q", ATTENTION_CASES)
@pytest.mark.needs("paged-attention", "kv-cache-bytes", "int8")
def test_in_place_attention_equals_reference(block_size, n_heads, n_kv, Q):
    """The compiled path's formulation, run eagerly: plain and int8 caches,
    block sizes 1-16, GQA groups 1-4, ragged queries."""
    for cache_cls in (KVCache, Int8KVCache):
        cache, q, bt, q_pos, real, refs = _in_place_case(cache_cls, block_size, n_heads, n_kv, Q)
        for layer, ref in enumerate(refs):
            torch.testing.assert_close(paged_attention_in_place(q, cache, layer, bt, q_pos)[real], ref,
                                       atol=1e-5, rtol=1e-5, msg=f"{cache_cls.__name__} layer {layer}")


@pytest.mark.timeout(600)
@pytest.mark.needs("paged-attention", "kv-cache-bytes", "int8")
def test_compiled_in_place_attention_equals_reference():
    """Compiled, as the engine compiles it (batch, query length and table
    width symbolic; each layer as layer 0 of a one-layer view), over the int8
    cache, whose dequantization fuses into the loads: one graph serves every
    layer, decode (Q = 1) and ragged verification (Q = 3) batches, and equals
    the reference. (The float cache's compiled attention is held to the
    reference by every compiled-step test below.)"""
    from graphs import dynamic, layer_cache
    from torch._dynamo.utils import counters
    compiled = torch.compile(paged_attention_in_place, fullgraph=True)
    graphs = counters["stats"]["unique_graphs"]
    for Q in (1, 3):
        cache, q, bt, q_pos, real, refs = _in_place_case(Int8KVCache, 16, 6, 2, Q)
        for layer, ref in enumerate(refs):                # as the engine reads a layer: layer 0 of a view
            with torch.inference_mode(), size_oblivious():
                out = compiled(dynamic(q, 0, 1), layer_cache(cache, layer), 0, dynamic(bt, 0, 1),
                               dynamic(q_pos, 0, 1))
            torch.testing.assert_close(out[real], ref, atol=1e-5, rtol=1e-5, msg=f"compiled, Q {Q} layer {layer}")
    assert counters["stats"]["unique_graphs"] - graphs == 1, "one graph for every layer, batch and Q"


def test_triton_paged_decode_equals_in_place_attention():
    """CUDA's compiled attention, kernels.paged_decode (tests/triton_check.py): ragged decodes and
    verifications, GQA groups 1-4, a sliding window, one split and several, equal to
    paged_attention_in_place (float32; on CUDA bf16 within 1e-2). Runs on CUDA, else in Triton's
    interpreter (a subprocess), else is skipped: CPU installs have no triton."""
    from triton_check import run
    failures = run("paged_decode")
    assert not failures, "\n".join(failures)


@pytest.mark.needs("decode-attention", "kv-cache-bytes", "int8")
def test_attention_bandwidth_counts_the_context_bytes():
    """experiments/compiled.py's attention_bandwidth, the measurement of the two attentions above:
    tested here, right after the compiled test, whose graph it reuses (the
    same shapes: nothing new to compile)."""
    from experiments.compiled import attention_bandwidth
    cache = _random_pool(Int8KVCache, 16, 6, 2, 1)[0]
    r = attention_bandwidth(cache, n_heads=6, batch=3, context=21, repeats=2)
    assert r["bytes"] == 3 * 21 * cache.bytes_per_token // 2                  # one of the 2 layers, scales included
    assert r["in_place_GBps"] > 0 and r["gather_GBps"] > 0
    assert r["in_place_GBps"] == pytest.approx(r["bytes"] / r["in_place_s"] / 1e9)


@pytest.mark.parametrize("block_size,n_heads,n_kv,seed", [(1, 6, 2, 0), (4, 6, 6, 1), (16, 8, 2, 2), (4, 9, 3, 3)])
@pytest.mark.assignment("decode-attention")
@pytest.mark.needs("paged-attention", "kv-cache-bytes", "block-allocation")
def test_mixed_step_equals_reference(block_size, n_heads, n_kv, seed):
    """A random mix of decodes, k+1 verifications and prefill chunks (some
    over a cached prefix) through StepInputs -> StepContext, against the
    per-sequence reference loop of cache.py."""
    cfg = tiny_config(n_heads=n_heads, n_kv_heads=n_kv)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bm = BlockManager(400, block_size, enable_prefix_caching=False)
    cache = KVCache(cfg, 400, block_size, "cpu", torch.float32)
    cache.k.normal_(), cache.v.normal_()
    inputs = StepInputs(bm, "cpu")
    for step in range(3):                               # tables change between steps: rows refresh
        work, lens = [], []
        for sid in range(rng.randint(1, 7)):
            sid = step * 100 + sid
            kind = rng.choice(["decode", "verify", "prefill", "cached"])
            n_q = {"decode": 1, "verify": rng.randint(2, 6), "prefill": rng.randint(1, 40),
                   "cached": rng.randint(1, 20)}[kind]
            start = 0 if kind == "prefill" else rng.randint(1, 60)
            bm.allocate(sid, [])
            bm.reserve(sid, 0, start + n_q)
            work.append((sid, [rng.randrange(cfg.vocab_size) for _ in range(n_q)], start))
            lens.append((start + n_q, n_q))
        hb = inputs.host(work)
        _, positions, ctx = inputs.device(hb, cache)
        q = torch.randn(len(positions), n_heads, cfg.head_dim)
        k, v = torch.randn(len(q), n_kv, cfg.head_dim), torch.randn(len(q), n_kv, cfg.head_dim)
        out = ctx.attend(0, q, k, v)                    # writes k, v into their slots, then attends
        width = max(len(bm.tables[w[0]]) for w in work)
        tables = torch.tensor([bm.tables[w[0]] + [0] * (width - len(bm.tables[w[0]])) for w in work])
        ref = paged_attention(q, cache, 0, tables, [s for s, _ in lens], [n for _, n in lens])
        sizes = [(int(g.block_tables.shape[0]), None if g.index is None else int(g.index.shape[1]))
                 for g in ctx.groups]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5,
                                   msg=f"step {step}: mixed-step attention differs (groups {sizes})")
        slots = [bm.tables[sid][p // block_size] * block_size + p % block_size
                 for sid, t, s in work for p in range(s, s + len(t))]
        assert ctx.slot_mapping.tolist() == slots, "slot = block_id * block_size + offset"
        assert positions.tolist() == [p for _, t, s in work for p in range(s, s + len(t))], \
            "positions run from each sequence's start over its new tokens, in batch order"
        for sid, _, _ in work:
            bm.free(sid)


# ----------------------------------------------------------------------------
# Sliding-window attention (Mistral): every path masks by cache.sliding_window
# ----------------------------------------------------------------------------
WINDOW_CASES = [(4, 6, 2, 5), (1, 4, 4, 3), (16, 8, 2, 20), (8, 9, 3, 16)]   # block size, heads, KV heads, W


def _windowed_step(step, seqs, done, bm, inputs, cache):
    """Run one step (sequence, tokens fed) of the sequences' own q, k, v [T, heads, d] through every
    attention path of kernels.py: StepContext on the CPU (SDPA) and on "CUDA" (grouped_attention;
    it writes the same k, v again), then paged_attention_in_place on the padded batch."""
    import kernels
    for s, n in step:
        bm.reserve(s, done[s], n)                       # frees what left the window: the null block
    _, positions, ctx = inputs.device(inputs.host([(s, [0] * n, done[s]) for s, n in step]), cache)
    q, k, v = (torch.cat([seqs[s][j][done[s]:done[s] + n] for s, n in step]) for j in range(3))
    outs = {"cpu": ctx.attend(0, q, k, v)}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kernels, "on_cuda", lambda device: True)
        outs["cuda"] = ctx.attend(0, q, k, v)
    starts, lens = torch.tensor([done[s] for s, _ in step]), torch.tensor([n for _, n in step])
    i = torch.arange(int(lens.max()))
    q_pos, real = starts[:, None] + torch.minimum(i, lens[:, None] - 1), i < lens[:, None]     # [B, Q]
    padded_q = q.new_zeros(*real.shape, *q.shape[1:])
    padded_q[real] = q
    width = max(len(bm.tables[s]) for s, _ in step)
    tables = torch.tensor([bm.tables[s] + [bm.null_block] * (width - len(bm.tables[s])) for s, _ in step])
    outs["in place"] = paged_attention_in_place(padded_q, cache, 0, tables, q_pos)[real]
    return outs, any(g.index is None for g in ctx.groups)


@pytest.mark.parametrize("block_size,n_heads,n_kv,W", WINDOW_CASES)
@pytest.mark.assignment("sliding-window")
@pytest.mark.needs("gqa-attention", "decode-attention", "kv-cache-bytes", "block-allocation")
def test_windowed_attention_equals_dense_windowed_reference(block_size, n_heads, n_kv, W):
    """A window W (cache.sliding_window): each query sees its last W positions in every path, the
    eager step on CPU and on CUDA and the compiled path's formulation, over steps that mix prefill
    chunks, decodes and ragged k+1-token verifications, through tables whose freed entries point at
    the null block (junk here: only the mask hides it). The reference is
    model.dense_causal_attention(window=W) over each whole sequence."""
    _windowed_equals_reference(KVCache, block_size, n_heads, n_kv, W)


@pytest.mark.parametrize("block_size,n_heads,n_kv,W", WINDOW_CASES[:2])
@pytest.mark.assignment("int8")
@pytest.mark.needs("gqa-attention", "decode-attention", "sliding-window", "kv-cache-bytes", "block-allocation")
def test_windowed_attention_reads_the_int8_cache(block_size, n_heads, n_kv, W):
    """The same over the int8 KV cache (the reference: K, V as stored, dequantized)."""
    _windowed_equals_reference(Int8KVCache, block_size, n_heads, n_kv, W)


def _windowed_equals_reference(cache_cls, block_size, n_heads, n_kv, W):
    """The windowed steps of the two tests above, over a cache of cache_cls."""
    from model import dense_causal_attention
    from quantize import dequantize_int8, quantize_int8
    rng, g = random.Random(W * 100 + block_size), torch.Generator().manual_seed(W)
    cfg = tiny_config(n_layers=1, n_heads=n_heads, n_kv_heads=n_kv, sliding_window=W)
    lens = [(rng.randint(1, 24), rng.randint(W + 6, W + 30)) for _ in range(5)]      # (prompt, total)
    pool = sum(-(-t // block_size) for _, t in lens) + 1
    bm = BlockManager(pool, block_size, enable_prefix_caching=False, sliding_window=W)
    cache = cache_cls(cfg, pool, block_size, "cpu", torch.float32)
    for t in cache.pools():
        t[:, bm.null_block] = 100                   # K = V = 100 (int8: x a scale of 100)
    seqs = [[torch.randn(t, h, cfg.head_dim, generator=g) for h in (n_heads, n_kv, n_kv)] for _, t in lens]
    stored = [(k, v) if cache_cls is KVCache else (dequantize_int8(*quantize_int8(k)),
                                                   dequantize_int8(*quantize_int8(v))) for _, k, v in seqs]
    inputs, done, freed, uniform = StepInputs(bm, "cpu"), [0] * len(lens), 0, False
    for s, (prompt, _) in enumerate(lens):
        bm.allocate(s, [0] * prompt)
    while any(d < t for d, (_, t) in zip(done, lens)):
        step = [(s, min(t - done[s], rng.randint(1, 16) if done[s] < p else rng.choice([1, 1, 2, 4])))
                for s, (p, t) in enumerate(lens) if done[s] < t and rng.random() < 0.9]
        if not step:
            continue
        outs, fast = _windowed_step(step, seqs, done, bm, inputs, cache)
        ref = torch.cat([dense_causal_attention(seqs[s][0][:done[s] + n], *(x[:done[s] + n] for x in stored[s]),
                                                window=W)[done[s]:] for s, n in step])
        for path, out in outs.items():
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, p=path: f"{cache_cls.__name__}, {p}, step {step}: {m}")
        for s, n in step:
            done[s] += n
        freed, uniform = freed + sum(bm.tables[s].count(bm.null_block) for s, _ in step), uniform or fast
    assert freed and uniform, "the steps freed blocks out of the window and had a decode-only step"


@pytest.mark.timeout(600)
@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("engine")
def test_compiled_engine_equals_eager_without_recompiling(tiny_path):
    """Both engines give the dense model's greedy tokens (model.generate: no cache, no paging), and
    after warm-up the compiled one never compiles again."""
    from torch._dynamo.utils import counters

    from model import generate, load_model
    prompts = [[5, 6, 7], list(range(100, 130)), [42] * 5, list(range(7, 20)), [9, 8, 7, 6], [300, 301]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (20, 7, 15, 3, 25, 11)]
    kw = dict(device="cpu", dtype="float32", max_num_seqs=4, kv_cache_bytes=1 << 22, block_size=4)
    eager = run_staggered(LLM(tiny_path, **kw), prompts, params)
    dense = load_model(tiny_path)[0]
    assert eager == [generate(dense, p, sp.max_tokens) for p, sp in zip(prompts, params)], \
        "the eager engine's paged attention (StepContext) changed a greedy output"
    llm = LLM(tiny_path, compile=True, **kw)
    assert llm.decoder is not None and llm.compile_seconds > 0, \
        "compile=True builds a compiled decoder and times its compilation"
    graphs = counters["stats"]["unique_graphs"]
    compiled = run_staggered(llm, prompts, params)
    assert compiled == eager, "compiled decode changed a greedy output"
    assert counters["stats"]["unique_graphs"] == graphs, "a step recompiled after warm-up"
    assert llm.stats["eager_steps"] == 0 and llm.stats["compiled_steps"] == llm.stats["steps"], \
        "every step (prefill chunks beside decodes included) runs compiled"
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks, \
        "every block returns to the pool once all requests finish"


@pytest.mark.parametrize("block_size,n_heads,n_kv,Q", ATTENTION_CASES)
@pytest.mark.assignment("decode-attention")
@pytest.mark.needs("paged-attention", "kv-cache-bytes")
def test_cuda_attention_reaches_a_fused_kernel(block_size, n_heads, n_kv, Q, monkeypatch):
    """On CUDA (forced here on a CPU), batched_paged_attention must not hand SDPA a boolean
    mask together with GQA (unequal head counts, enable_gqa): flash refuses the mask, and in
    torch 2.11 the memory-efficient kernel the GQA, so SDPA would silently run its math
    backend. kernels.grouped_attention folds each KV head's G query heads into its queries
    instead; it must still equal the reference. With kernels.STRICT_SDPA the call runs with
    the math backend off (sdpa_kernel), so a fallback raises instead of timing math."""
    import torch.nn.functional as F

    import kernels
    from torch.nn.attention import SDPBackend, sdpa_kernel
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, enable_gqa=False, **kw):
        calls.append((attn_mask is not None, enable_gqa or q.shape[1] != k.shape[1],
                      torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        with sdpa_kernel(SDPBackend.MATH):                        # this CPU has no fused CUDA kernel
            return sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(kernels, "on_cuda", lambda device: True)
    for strict in (False, True):
        monkeypatch.setattr(kernels, "STRICT_SDPA", strict)
        cache, q, bt, seq_lens, qlens = _random_pool(KVCache, block_size, n_heads, n_kv, Q, ragged=Q > 1)
        ref = paged_attention(q.flatten(0, 1), cache, 0, bt, seq_lens, [Q] * len(seq_lens))
        out = batched_paged_attention(q, cache, 0, bt, torch.tensor(seq_lens)).flatten(0, 1)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=f"strict={strict}: CUDA's attention differs")
        (mask, gqa, math_on, flash_on), = calls[-1:]
        assert not (mask and gqa), "a boolean mask together with GQA: no fused CUDA kernel takes both"
        assert math_on == (not strict) and flash_on, f"STRICT_SDPA={strict}: math backend on: {math_on}"
    assert len(calls) == 2, "each batched_paged_attention call makes exactly one SDPA call"


# Sliding-window attention through the engine (the kernels above: test_windowed_attention_...)
def mistral_checkpoint(directory, window: int) -> str:
    """A tiny random model saved as a Mistral checkpoint: config.json names its sliding_window."""
    import json
    import os

    from helpers import save_checkpoint
    path = save_checkpoint(tiny_model(seed=0, sliding_window=window), directory)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


@pytest.mark.timeout(600)
@pytest.mark.assignment("sliding-window")
@pytest.mark.needs("engine", "gqa-attention")
def test_windowed_engine_gives_the_dense_windowed_tokens(tmp_path):
    """A Mistral checkpoint with sliding_window 8, in blocks of 4 (the sequences outrun the window:
    blocks are freed, preemptions may recompute): the eager engine gives model.generate's greedy
    tokens (the dense path, no cache, the window); so does compile=True on the simulated CUDA path
    (CUDA graphs, mixed steps as rows, overlapped; prefill through grouped_attention). (Drafts
    verified through the window: test_windowed_attention_equals_dense_windowed_reference's ragged
    steps.)"""
    from cuda_sim import simulate_cuda
    from model import generate
    W = 8
    path = mistral_checkpoint(tmp_path, W)
    prompts = [[5, 6, 7, 8] * 5, list(range(100, 110)) * 3, [42] * 5, [9, 8, 7, 6, 1, 2, 3, 4, 5]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (20, 12, 16, 24)]
    dense = [generate(tiny_model(seed=0, sliding_window=W), p, sp.max_tokens) for p, sp in zip(prompts, params)]
    assert dense[3] != generate(tiny_model(seed=0), prompts[3], 24), "the window must change the tokens"
    kw = dict(device="cpu", dtype="float32", max_num_seqs=2, kv_cache_bytes=1 << 15, block_size=4)
    eager = LLM(path, **kw)
    assert eager.cache.sliding_window == eager.block_manager.sliding_window == W, "config.json's window"
    assert run_staggered(eager, prompts, params) == dense, "the eager engine's window differs from the model's"
    with simulate_cuda() as sim:
        llm = LLM(path, compile=True, **kw)
        outs = run_staggered(llm, prompts, params)
    assert outs == dense, "the compiled (CUDA-graph) engine's window differs from the model's"
    assert llm.decoder.steps[1] > 0 and sim.replays == sum(llm.decoder.steps.values()) == llm.stats["steps"], \
        "decode-only steps run their graph, and every step replays a CUDA graph"
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks - 1 and bm.ref_count[bm.null_block] == 1, "all back but the null block"


@pytest.mark.timeout(600)
@pytest.mark.assignment("sliding-window")
@pytest.mark.needs("engine", "gqa-attention")
def test_windowed_engine_holds_a_long_sequence_in_17_blocks():
    """The Goal, on the preset random:smollm2-tiny:sliding_window=256: a sequence of 4,096 tokens in
    blocks of 16 (a 3,840-token prompt in chunks of 16, then 256 greedy decodes) holds at most
    ceil(W / 16) + 1 = 17 blocks at every step (+ the null block), and its greedy tokens and their
    logprobs are the dense windowed model's. The reference is model.forward without a cache
    (dense_causal_attention(window=W)) on the engine's tokens (teacher forcing: each token must be
    the argmax given those before, so by induction a dense generation's tokens). With L layers the
    logit at p depends on tokens p - L(W - 1)..p alone: the pass starts L(W - 1) tokens back, not at 0."""
    W, bs, P, T = 256, 16, 3840, 4096
    llm = LLM(f"random:smollm2-tiny:sliding_window={W}", device="cpu", dtype="float32", block_size=bs,
              kv_cache_bytes=(T // bs + 4) * bs * 512, max_num_batched_tokens=bs)     # 512 B per token
    prompt = torch.randint(0, 49152, (P,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.add_request(prompt, SamplingParams(max_tokens=T - P, ignore_eos=True, logprobs=0))
    bm, most, out = llm.block_manager, 0, None
    while llm.has_unfinished_requests():
        for o in llm.step():
            out = o
        most = max([most] + [len(t) - t.count(bm.null_block) for t in bm.tables.values()])
        assert bm.num_blocks - bm.num_free_blocks <= 17 + 1, "the pool holds more than 17 blocks + the null block"
    assert most == 17 and out.finished and len(out.token_ids) == T - P, \
        "the sequence peaks at exactly 17 held blocks and emits all its tokens"
    ids, lo = prompt + out.token_ids, P - 1 - llm.config.n_layers * (W - 1)
    with torch.inference_mode():
        logits = llm.model(torch.tensor(ids[lo:-1]), torch.arange(lo, T - 1))[P - 1 - lo:]   # predict ids[P:]
    assert logits.argmax(-1).tolist() == out.token_ids, "greedy tokens differ from the dense windowed model's"
    logprobs = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).flatten()
    engine = torch.tensor([lp for lp, _ in out.outputs[0].logprobs])                  # (logprob, top-0)
    torch.testing.assert_close(engine, logprobs, atol=1e-4, rtol=0)
