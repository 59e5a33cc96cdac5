"""Assignment: kernels.py -- the compiled decode path.

To pass, implement:
  * batched_paged_attention: the vectorized paged attention for up to Q new
    queries per sequence: one gather through the block tables, a length mask,
    GQA without copying K, V per query head (head h reads KV head h // group). It must equal the
    reference cache.paged_attention on ragged batches, any block size and
    grouping, with block tables padded by garbage ids;
  * paged_attention_in_place: the same function, written so that torch.compile
    fuses the gather into its reductions (no copy of the blocks); equal to the
    reference eagerly and compiled, for plain and int8 caches and ragged
    query lengths;
  * StepInputs + StepContext: any mix of prefill chunks (with or without a
    cached prefix), decodes and k+1-token verifications in one step, as a few
    query-length groups, equal to cache.paged_attention;
  * batch_buckets / width_buckets / bucket: the padded shapes;
  * CompiledDecoder: one transformer block and the LM head compiled ONCE with
    symbolic sizes, serving every layer, batch, width and query length;
    padded rows and padded queries write only into the scratch block; after
    warm-up no step compiles anything new; LLM(compile=True) gives exactly the
    tokens of the eager engine, with speculative verification steps too;
    int8 weights through the compiled (fused) product equal float32 arithmetic;
  * choose_weight_layout (support/timing.py, built with the compiled path):
    the same function, another memory layout of the weights.
Compilation is kept cheap: 2- and 3-layer models, max_num_seqs 4, and an
inductor cache in the test's temporary folder.
"""
import random

import numpy as np
import pytest
import torch
from conftest import tiny_config, tiny_model

from cache import KVCache, paged_attention
from cache import AttentionContext, BlockManager
from kernels import (CompiledDecoder, QueryGroup, StepContext, StepInputs, batch_buckets, batched_paged_attention,
                     bucket, paged_attention_in_place, size_oblivious, width_buckets)
from quantize import Int8KVCache
from scheduler import LLM, SamplingParams
from support.timing import choose_weight_layout


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


@pytest.mark.parametrize("block_size,n_heads,n_kv,Q", ATTENTION_CASES)
@pytest.mark.assignment("decode-attention")
@pytest.mark.needs("paged-attention", "kv-cache-bytes", "int8")
def test_fast_decode_attention_equals_reference(block_size, n_heads, n_kv, Q):
    for cache_cls in (KVCache, Int8KVCache):
        cache, q, bt, seq_lens, _ = _random_pool(cache_cls, block_size, n_heads, n_kv, Q)
        for layer in range(cache.k.shape[0]):
            ref = paged_attention(q.flatten(0, 1), cache, layer, bt, seq_lens, [Q] * len(seq_lens))
            out = batched_paged_attention(q, cache, layer, bt, torch.tensor(seq_lens)).flatten(0, 1)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5,
                                       msg=f"{cache_cls.__name__} layer {layer}: fast decode attention differs")


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


@pytest.mark.needs("paged-attention", "kv-cache-bytes", "int8")
def test_compiled_in_place_attention_equals_reference():
    """Compiled, as the engine compiles it (batch, query length and table
    width symbolic; each layer as layer 0 of a one-layer view), over the int8
    cache, whose dequantization fuses into the loads: one graph serves every
    layer, decode (Q = 1) and ragged verification (Q = 3) batches, and equals
    the reference. (The float cache's compiled attention is held to the
    reference by every compiled-step test below.)"""
    from kernels import dynamic, layer_cache
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


@pytest.mark.needs("decode-attention", "kv-cache-bytes", "int8")
def test_attention_bandwidth_counts_the_context_bytes():
    """bench.attention_bandwidth, the measurement of the two attentions above:
    tested here, right after the compiled test, whose graph it reuses (the
    same shapes: nothing new to compile)."""
    from bench import attention_bandwidth
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
        assert positions.tolist() == [p for _, t, s in work for p in range(s, s + len(t))]
        for sid, _, _ in work:
            bm.free(sid)


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(5) == [1, 2, 4, 8]
    assert batch_buckets(1) == [1]
    assert width_buckets(3) == [2, 4] and width_buckets(1) == [2] and width_buckets(512)[-1] == 512
    assert bucket(3, [1, 2, 4]) == 4 and bucket(4, [1, 2, 4]) == 4
    with pytest.raises(ValueError):
        bucket(5, [1, 2, 4])


@pytest.mark.needs("model")
def test_transposed_layout_computes_the_same_function(monkeypatch):
    import support.timing
    ids, pos = torch.randint(0, 512, (9,)), torch.arange(9)
    ref = tiny_model(seed=3, attention_bias=True)(ids, pos)
    assert choose_weight_layout(tiny_model(seed=3)) in ("default", "transposed")   # measured: either is legitimate
    model = tiny_model(seed=3, attention_bias=True)                 # tied embeddings
    times = iter([1.0, 0.5])                                        # force it: [in, out] measured 2x faster
    monkeypatch.setattr(support.timing, "median_seconds", lambda fn, **kw: (fn(), next(times))[1])
    assert choose_weight_layout(model) == "transposed"
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            assert m.weight.stride() == (1, m.weight.shape[0]), f"{name}: the [out, in] weight must be stored [in, out]"
    assert model.embed_tokens.weight.is_contiguous(), "the embedding table keeps its layout (the head got a copy)"
    torch.testing.assert_close(model(ids, pos), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.needs("model", "paged-attention", "kv-cache-bytes")
def test_compiled_step_pads_into_scratch_and_compiles_once():
    """A decode step (batch 3, padded to 4) and a ragged verification step
    (1-3 tokens per sequence, padded to Q = 3) through the compiled step of
    a 3-layer model: real blocks change only at the step's slots, the
    logits equal cache.py's per-sequence reference, and ONE block graph (plus
    the LM head's) serves every layer, both query lengths and both batches."""
    from torch._dynamo.utils import counters
    model = tiny_model(seed=4, n_layers=3)              # a shape no other test compiles
    cache = KVCache(model.config, 9, 4, "cpu", torch.float32)
    torch.manual_seed(0)
    cache.k.normal_(), cache.v.normal_()     # made outside inference mode, as LLM makes it
    graphs = counters["stats"]["unique_graphs"]
    dec = CompiledDecoder(model, cache, max_num_seqs=4, max_blocks_per_seq=4, scratch_block=8, query_sizes=(1, 3))
    tables = [[0, 1], [2], [3, 4, 5]]
    for query_lens, seq_lens in (([1, 1, 1], [7, 3, 10]), ([3, 1, 2], [7, 3, 10])):
        positions = [p for n, m in zip(seq_lens, query_lens) for p in range(n - m, n)]
        slots = [t[p // 4] * 4 + p % 4 for t, n, m in zip(tables, seq_lens, query_lens) for p in range(n - m, n)]
        tokens = [5 + i for i in range(len(slots))]
        before_k, before_v = cache.k.clone(), cache.v.clone()
        with torch.inference_mode():                                # as the engine runs it
            logits = dec(tokens, positions, slots, padded(tables), query_lens)
        assert logits.shape == (len(slots), model.config.vocab_size)
        changed = (cache.k != before_k).any(-1).any(-1).any(0).flatten()    # per slot
        changed_slots = set(torch.nonzero(changed[:8 * 4]).flatten().tolist())
        assert changed_slots == set(slots), f"real blocks changed at {changed_slots}, expected only {slots}"
        # the reference: the same step from the same cache state through cache.py's
        # per-sequence loop (not the kernel under test)
        cache.k.copy_(before_k), cache.v.copy_(before_v)
        ctx = AttentionContext(cache, torch.tensor(slots), torch.tensor([t + [8] * (3 - len(t)) for t in tables]),
                               seq_lens, query_lens)
        with torch.inference_mode():
            ref = model(torch.tensor(tokens), torch.tensor(positions), ctx)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4, msg=f"query lengths {query_lens}")
    assert dec.steps == {1: 1, 3: 1}
    assert counters["stats"]["unique_graphs"] - graphs == 2, "one graph for the block, one for the LM head"


def padded(tables, fill=8):
    """Block tables (lists) as the rows of one array, padded with a valid block
    (8: the compiled tests' scratch block); attention masks what is past a sequence."""
    width = max(map(len, tables))
    return np.array([t + [fill] * (width - len(t)) for t in tables])


def decode_step(model, cache, tokens, positions, slots, tables):
    """One eager decode step (one new token per sequence) from Python lists,
    through kernels.StepContext (the engine builds its inputs with StepInputs)."""
    as_tensor = lambda x: torch.as_tensor(x, dtype=torch.long)   # noqa: E731
    group = QueryGroup(None, as_tensor(padded(tables)), as_tensor(positions) + 1, None)
    return model(as_tensor(tokens), as_tensor(positions), StepContext(cache, as_tensor(slots), [group]))


def _run_staggered(llm, prompts, params):
    """Requests join at different steps, finish at different lengths."""
    ids, outs, step = {}, {}, 0
    pending = list(enumerate(prompts))
    while pending or llm.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            ids[llm.add_request(p, params[i])] = i
        for o in llm.step():
            if o.finished:
                outs[ids[o.request_id]] = o.token_ids
        step += 1
    return [outs[i] for i in range(len(prompts))]


@pytest.mark.assignment("decode-attention")
@pytest.mark.needs("engine")
def test_compiled_engine_equals_eager_without_recompiling(tiny_path):
    from torch._dynamo.utils import counters
    prompts = [[5, 6, 7], list(range(100, 130)), [42] * 5, list(range(7, 20)), [9, 8, 7, 6], [300, 301]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (20, 7, 15, 3, 25, 11)]
    kw = dict(device="cpu", dtype="float32", max_num_seqs=4, kv_cache_bytes=1 << 22, block_size=4)
    eager = _run_staggered(LLM(tiny_path, **kw), prompts, params)
    llm = LLM(tiny_path, compile=True, **kw)
    assert llm.decoder is not None and llm.compile_seconds > 0
    graphs = counters["stats"]["unique_graphs"]
    compiled = _run_staggered(llm, prompts, params)
    assert compiled == eager, "compiled decode changed a greedy output"
    assert counters["stats"]["unique_graphs"] == graphs, "a step recompiled after warm-up"
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.needs("decode-attention", "int8", "rmsnorm-rope", "kv-cache-bytes")
def test_compiled_int8_bf16_step_matches_eager():
    """int8 weights with bf16 activations (the CPU int8 kernel) through the
    compiled step. bf16 is not bit-exact across fusion (inductor keeps fused
    intermediates in float32), so both paths are held to the same float32
    computation instead: the compiled step may err no more than the eager one."""
    import copy

    from quantize import quantize_model
    model = quantize_model(tiny_model(seed=5).to(torch.bfloat16))
    exact = copy.deepcopy(model).float()                  # same int8 weights, float32 arithmetic
    cache = KVCache(model.config, 9, 4, "cpu", torch.bfloat16)
    torch.manual_seed(0)
    cache.k.normal_(), cache.v.normal_()
    cache32 = KVCache(model.config, 9, 4, "cpu", torch.float32)
    cache32.k.copy_(cache.k), cache32.v.copy_(cache.v)
    tables, positions = [[0, 1], [2, 3, 4]], [6, 9]
    slots = [t[p // 4] * 4 + p % 4 for t, p in zip(tables, positions)]
    with torch.inference_mode():
        truth = decode_step(exact, cache32, [5, 6], positions, slots, tables)
        eager = decode_step(model, cache, [5, 6], positions, slots, tables).float()
        dec = CompiledDecoder(model, cache, max_num_seqs=2, max_blocks_per_seq=4, scratch_block=8)
        compiled = dec([5, 6], positions, slots, padded(tables)).float()
    err = lambda x: ((x - truth).norm() / truth.norm()).item()   # noqa: E731
    assert err(eager) < 0.03, f"eager bf16 int8 step is {err(eager):.4f} from float32"
    assert err(compiled) < 1.5 * err(eager), f"compiled {err(compiled):.4f} vs eager {err(eager):.4f} from float32"


@pytest.mark.needs("model", "paged-attention", "kv-cache-bytes", "int8")
def test_compiled_int8_float32_step_is_float32_arithmetic(monkeypatch):
    """int8 weights with float32 activations through the compiled step take
    the fused int8 product (quantize.Int8Linear._fused: the path a GPU's
    small batches take). Held to an independent computation: the same
    weights dequantized into ordinary nn.Linear layers, run eagerly through
    cache.py's reference attention."""
    import copy

    import quantize
    model = quantize.quantize_model(tiny_model(seed=5, n_heads=4, n_kv_heads=2))   # a shape of its own
    truth_model = copy.deepcopy(model)
    for parent in list(truth_model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, quantize.Int8Linear):
                lin = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                lin.weight.data = quantize.dequantize_int8(child.weight, child.scale)
                setattr(parent, name, lin)
    traced = []
    fused = quantize.Int8Linear._fused
    monkeypatch.setattr(quantize.Int8Linear, "_fused", lambda self, x: traced.append(1) or fused(self, x))
    cache = KVCache(model.config, 9, 4, "cpu", torch.float32)
    torch.manual_seed(0)
    cache.k.normal_(), cache.v.normal_()
    before_k, before_v = cache.k.clone(), cache.v.clone()
    tables, positions = [[0, 1], [2, 3, 4]], [6, 9]
    slots = [t[p // 4] * 4 + p % 4 for t, p in zip(tables, positions)]
    with torch.inference_mode():
        dec = CompiledDecoder(model, cache, max_num_seqs=2, max_blocks_per_seq=4, scratch_block=8)
        compiled = dec([5, 6], positions, slots, padded(tables))
        cache.k.copy_(before_k), cache.v.copy_(before_v)
        ctx = AttentionContext(cache, torch.tensor(slots), torch.tensor([t + [8] * (3 - len(t)) for t in tables]),
                               [p + 1 for p in positions], [1, 1])
        truth = truth_model(torch.tensor([5, 6]), torch.tensor(positions), ctx)
    assert traced, "the compiled int8 step did not take the fused product"
    torch.testing.assert_close(compiled, truth, atol=1e-4, rtol=1e-4)


@pytest.mark.needs("engine", "ngram-drafter", "rejection-sampling")
def test_compiled_verification_gives_the_eager_tokens(tiny_path):
    """Speculative decoding with compile=True: verification steps (k + 1 = 4
    tokens per sequence, ragged when a drafter finds fewer) run through the
    compiled step, the greedy tokens are exactly the plain eager engine's,
    and nothing compiles after warm-up."""
    from torch._dynamo.utils import counters
    prompts = [[5, 6, 7, 8] * 5, list(range(100, 110)) * 3, [42] * 5, [9, 8, 7, 6]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (24, 16, 20, 12)]
    kw = dict(device="cpu", dtype="float32", max_num_seqs=4, kv_cache_bytes=1 << 22, block_size=4)
    eager = [o.token_ids for o in LLM(tiny_path, **kw).generate(prompts, params)]
    llm = LLM(tiny_path, compile=True, speculative="ngram", num_speculative_tokens=3, **kw)
    assert llm.decoder.query_sizes == [1, 4]
    graphs = counters["stats"]["unique_graphs"]
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs == eager, "compiled verification changed a greedy output"
    assert llm.decoder.steps[4] > 0, "no verification step went through the compiled path"
    assert llm.stats["accepted_tokens"] > 0
    assert counters["stats"]["unique_graphs"] == graphs, "a step recompiled after warm-up"
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
