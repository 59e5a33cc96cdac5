"""Tests: graphs.py -- the compiled step (no region of its own to write: its lessons are read,
and a student changing it, a bucket policy, the staging or the recording, must keep these).

What it must keep:
  * batch_buckets / width_buckets / bucket: the padded shapes;
  * CompiledDecoder: one transformer block and the LM head compiled ONCE with
    symbolic sizes, serving every layer, batch, width and query length;
    padded rows and padded queries write only into the scratch block; after
    warm-up no step compiles anything new; speculative verification steps give
    the eager engine's tokens; int8 weights through the compiled (fused) product
    equal float32 arithmetic; with backend="aot_eager" (no inductor pass) every
    step equals eager too;
  * the CUDA path, through the capture simulator (tests/cuda_sim.py): warm-up records
    every bucket as one graph in one shared pool, each step is a replay equal to the
    eager step; a decoder that skips a static buffer or reads a graph's own output
    fails; warming up again writes only the scratch block; the pinned staging buffer
    waits on an event before each refill;
  * choose_weight_layout (support/timing.py, built with the compiled path):
    the same function, another memory layout of the weights, one layer at a time;
    support.timing.step_memory: the largest bucket's peak, measured.
Compilation is kept cheap: 2- and 3-layer models, max_num_seqs 4, and an
inductor cache in the test's temporary folder.
"""
import random

import numpy as np
import pytest
import torch
from helpers import run_staggered, tiny_model

from cache import AttentionContext, KVCache
from graphs import CompiledDecoder, batch_buckets, bucket, size_oblivious, width_buckets
from kernels import QueryGroup, StepContext
from quantize import Int8KVCache
from engine import LLM, SamplingParams
from support.timing import choose_weight_layout


@pytest.fixture(autouse=True)
def inductor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


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


@pytest.mark.timeout(600)
@pytest.mark.needs("model", "paged-attention", "kv-cache-bytes")
def test_compiled_step_pads_into_scratch_and_compiles_once():
    """A decode step (batch 3, padded to 4) and a ragged verification step
    (1-3 tokens per sequence, padded to Q = 3) through the compiled step of
    a 3-layer model: real blocks change only at the step's slots, the
    logits equal cache.py's per-sequence reference, and ONE block graph (plus
    the LM head's) serves every layer, both query lengths and both batches."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()               # what earlier tests compiled (an LM head of this shape) counts as new
    model = tiny_model(seed=4, n_layers=3)
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


@pytest.mark.timeout(600)
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


@pytest.mark.timeout(600)
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


@pytest.mark.timeout(600)
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


# ----------------------------------------------------------------------------
# The CUDA path on a CPU: AOTAutograd without inductor, and CUDA graphs simulated
# (tests/cuda_sim.py: captures record aten ops, replays re-run them on the same tensors)
# ----------------------------------------------------------------------------
SIM_BLOCKS, SIM_BS = 4, 4                 # blocks per sequence, tokens per block; the scratch block is last


def _sim_script(seed: int, n_seqs: int, max_q: int, steps: int, chunk: int = 0):
    """A schedule of compiled steps: per step, (sequence, tokens fed, chunk?) for a varying subset of
    sequences (the batch bucket changes), each feeding 1..max_q tokens (decode, ragged
    verification), or (chunk > 0, one sequence in three) a prefill chunk of up to `chunk` tokens
    (a mixed step: rows), never past its SIM_BLOCKS blocks (the width bucket grows to the widest)."""
    rng, fed, script = random.Random(seed), [0] * n_seqs, []
    for _ in range(steps):
        live = [s for s in range(n_seqs) if fed[s] < SIM_BLOCKS * SIM_BS]
        if not live:
            break
        batch = sorted(rng.sample(live, rng.randint(1, len(live))))
        step = []
        for s in batch:
            is_chunk = chunk and rng.random() < 1 / 3
            n = rng.randint(max_q + 1, chunk) if is_chunk else rng.randint(1, max_q)
            step.append((s, min(n, SIM_BLOCKS * SIM_BS - fed[s]), is_chunk))
        script.append(step)
        for s, n, _ in step:
            fed[s] += n
    return script


def _sim_steps(model, cache, script, run, seed=0):
    """Run the script through run(tokens, positions, slots, tables, query_lens, lens, rows) ->
    logits of `rows` (as the engine asks: every row of a decode or verification, the last of a
    prefill chunk); returns the logits of each step. Sequence s owns blocks s*SIM_BLOCKS...;
    tables are padded with the scratch block; the token ids are random, not sampled (no feedback)."""
    rng, fed, outs = random.Random(seed + 1), {}, []
    for step in script:
        tokens, positions, slots, tables, qlens, lens, rows = [], [], [], [], [], [], []
        for s, n, is_chunk in step:
            rows += range(len(tokens) + (n - 1 if is_chunk else 0), len(tokens) + n)
            start = fed.get(s, 0)
            table = [s * SIM_BLOCKS + j for j in range(SIM_BLOCKS)]
            tokens += [rng.randrange(model.config.vocab_size) for _ in range(n)]
            positions += list(range(start, start + n))
            slots += [table[p // SIM_BS] * SIM_BS + p % SIM_BS for p in range(start, start + n)]
            tables.append(table)
            qlens.append(n)
            lens.append(start + n)
            fed[s] = start + n
        with torch.inference_mode():
            outs.append(run(tokens, positions, slots, np.array(tables), qlens, lens, rows).clone())
    return outs


def _sim_compare(model, cache_cls, script, decoder_steps, atol=1e-4):
    """decoder_steps(cache) -> run function; each step's logits and the real blocks of the cache
    against the eager reference (cache.py's per-sequence attention through the same model)."""
    n_blocks = 4 * SIM_BLOCKS + 1
    ref_cache = cache_cls(model.config, n_blocks, SIM_BS, "cpu", torch.float32)
    dec_cache = cache_cls(model.config, n_blocks, SIM_BS, "cpu", torch.float32)

    def eager(tokens, positions, slots, tables, qlens, lens, rows):
        ctx = AttentionContext(ref_cache, torch.tensor(slots), torch.tensor(tables), lens, qlens)
        return model(torch.tensor(tokens), torch.tensor(positions), ctx)[rows]
    ref = _sim_steps(model, ref_cache, script, eager)
    got = _sim_steps(model, dec_cache, script, decoder_steps(dec_cache))
    for i, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, atol=atol, rtol=atol, msg=lambda m, i=i: f"step {i} {script[i]}: {m}")
    real = 4 * SIM_BLOCKS                         # blocks past it: the scratch block
    for name, t in vars(ref_cache).items():
        if isinstance(t, torch.Tensor):
            torch.testing.assert_close(getattr(dec_cache, name)[:, :real].float(), t[:, :real].float(),
                                       atol=atol, rtol=atol, msg=lambda m, n=name: f"cache {n}: {m}")


def _decoder(model, query_sizes=(1,), warm=True, max_rows=4):
    """decoder_steps for _sim_compare: a CompiledDecoder for 4 sequences of SIM_BLOCKS blocks,
    mixed steps of up to max_rows tokens as rows."""
    def make(cache):
        dec = CompiledDecoder(model, cache, max_num_seqs=4, max_blocks_per_seq=SIM_BLOCKS,
                              scratch_block=4 * SIM_BLOCKS, query_sizes=query_sizes, max_rows=max_rows)
        if warm:
            dec.warmup()
        make.decoder = dec
        return lambda tokens, positions, slots, tables, qlens, lens, rows: dec(tokens, positions, slots, tables,
                                                                               qlens, rows)
    return make


MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, head_dim=8, n_kv_heads=1)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", ["gqa", "cla", "mla"])
@pytest.mark.needs("model", "paged-attention", "kv-cache-bytes", "mla-absorb")
def test_compiled_steps_through_aot_autograd_alone_equal_eager(monkeypatch, variant):
    """The compiled step is right by the declared semantics of its ops, not by an inductor
    pass: with backend="aot_eager" (AOTAutograd's functionalization, no re-inplacing), every
    step of a 2-layer model equals the eager step and leaves the same cache. (Writing into a
    view OF a graph input, cache.write(0, ...) on a layer's [1, ...] view, lost the K/V of
    every layer but the first: AOTAutograd rebuilt that view from layer 0's storage offset.)
    "cla" (cla_share=2): the second layer writes nothing and reads the first one's cache layer;
    "mla": latents written and read absorbed, V a view of the one pool, the heads' scale."""
    import graphs
    from cache import LatentCache
    monkeypatch.setattr(graphs, "BACKEND", "aot_eager")
    model = tiny_model(seed=11, **{"gqa": {}, "cla": dict(cla_share=2), "mla": MLA}[variant])
    make = _decoder(model, warm=False, max_rows=32)
    _sim_compare(model, LatentCache if variant == "mla" else KVCache, _sim_script(0, 4, 1, 8, chunk=6), make)
    assert make.decoder.row_steps > 0, "the script must hold mixed steps"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", ["float32", "int8"])
@pytest.mark.needs("model", "paged-attention", "kv-cache-bytes", "int8")
def test_cuda_graph_steps_equal_eager(variant):
    """Through the capture simulator: warm-up records EVERY (Q, B, W) bucket as one graph,
    biggest first, in one shared pool, and each step is a replay. Every step's logits and the
    cache equal the eager steps': decodes, ragged k+1 verifications and mixed steps (prefill
    chunks beside them, as rows) over changing batch and width buckets; "int8": int8 weights
    (the fused product) over the int8 KV cache."""
    from cuda_sim import simulate_cuda

    import quantize
    model = tiny_model(seed=12)
    if variant == "int8":
        model = quantize.quantize_model(model)
    max_q = 1 if variant == "int8" else 4                 # int8: decode steps only (fewer graphs)
    with simulate_cuda() as sim:
        make = _decoder(model, query_sizes=(1, max_q), max_rows=16)
        _sim_compare(model, Int8KVCache if variant == "int8" else KVCache,
                     _sim_script(1, 4, max_q, 8, chunk=max_q + 4), make)
    dec = make.decoder
    assert dec.row_sizes == [1, 2, 4, 8, 16]
    assert len(dec.graphs) == len(dec.buckets()) == len(sim.graphs) == len(dec.widths) * (5 + (max_q > 1) * 3)
    sizes = [k[0] * k[1] * k[2] for k in dec.graphs]
    assert sizes == sorted(sizes, reverse=True), "recorded biggest first: the shared pool grows once"
    assert len({g.pool_id for g in sim.graphs}) == 1, "one memory pool shared by every bucket's graph"
    assert sim.replays >= 8 and sim.syncs >= len(sim.graphs)
    assert sum(dec.steps.values()) == 8 and (variant == "int8" or dec.steps[4] > 0)
    assert dec.row_steps > 0, "mixed steps replayed a graph too"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.needs("engine", "ngram-drafter", "rejection-sampling")
def test_cuda_graph_engine_gives_the_eager_tokens(tiny_path, speculative):
    """The whole engine on the simulated CUDA path: requests join and finish at different steps
    (their prefill chunks beside the running decodes replay a rows bucket: no eager forward) and
    the greedy tokens are the plain eager engine's. Speculative: n-gram drafts verified in
    k + 1 = 4-token replays (in order: drafting reads the tokens). Not: the overlapped engine
    (compile=True's default), each decode row's token copied into the graph's static input ids
    on the device from the step in flight, never through the host."""
    from cuda_sim import simulate_cuda
    prompts = [[5, 6, 7, 8] * 5, list(range(100, 110)) * 3, [42] * 5, [9, 8, 7, 6]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (20, 12, 16, 9)]
    kw = dict(device="cpu", dtype="float32", max_num_seqs=4, kv_cache_bytes=1 << 17, block_size=16,
              max_num_batched_tokens=32)
    eager = run_staggered(LLM(tiny_path, **kw), prompts, params)
    spec = dict(speculative="ngram", num_speculative_tokens=3) if speculative else {}
    with simulate_cuda() as sim:
        llm = LLM(tiny_path, compile=True, **spec, **kw)
        assert llm.overlap, "compile=True: overlapped unless told otherwise"
        assert llm.decoder.row_sizes == [1, 2, 4, 8, 16, 32]
        assert len(llm.decoder.graphs) == len(sim.graphs) == (6 + 3 * speculative) * len(llm.decoder.widths)
        outs = run_staggered(llm, prompts, params)
    assert outs == eager, "the CUDA-graph engine changed a greedy output"
    assert llm.decoder.steps[1] > 0 and (not speculative or llm.decoder.steps[4] > 0)
    assert llm.decoder.row_steps > 0 and llm.stats["eager_steps"] == 0, "every step replays a graph"
    assert llm.stats["graph_steps"] == llm.stats["steps"] == sim.replays == sum(llm.decoder.steps.values())
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.timeout(600)
@pytest.mark.needs("engine", "mla-absorb")
def test_cuda_graph_engine_runs_mla_latents_in_place():
    """random:deepseek-mla-tiny on the simulated CUDA path: the latent cache read in place with
    the heads' scale (no Triton kernel for MLA), requests joining and finishing at different steps,
    every step a graph replay, the eager engine's greedy tokens."""
    from cuda_sim import simulate_cuda
    prompts = [[5, 6, 7, 8] * 5, list(range(100, 110)) * 3, [42] * 5, [9, 8, 7, 6]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (20, 12, 16, 9)]
    kw = dict(device="cpu", dtype="float32", max_num_seqs=2, kv_cache_bytes=1 << 16, block_size=16,
              max_num_batched_tokens=16)
    eager = run_staggered(LLM("random:deepseek-mla-tiny", **kw), prompts, params)
    with simulate_cuda() as sim:
        llm = LLM("random:deepseek-mla-tiny", compile=True, **kw)
        outs = run_staggered(llm, prompts, params)
    assert outs == eager, "the CUDA-graph MLA engine changed a greedy output"
    assert llm.stats["eager_steps"] == 0 and llm.stats["graph_steps"] == llm.stats["steps"] == sim.replays > 0


def _forgets_the_static_copy(monkeypatch):
    """A decoder whose step reads its inputs where this step's copy put them, new tensors each
    step, instead of copying them into the static buffers a graph was recorded on."""
    load = CompiledDecoder._load

    def forgetful(self, key, *args):
        prow = load(self, key, *args)
        self.ids, self.positions, self.slots, self.tables = (t.clone() for t in
                                                             (self.ids, self.positions, self.slots, self.tables))
        self.contexts.clear()                          # this step's views, over this step's tensors
        return prow
    monkeypatch.setattr(CompiledDecoder, "_load", forgetful)


def _keeps_a_graph_output(monkeypatch):
    """A decoder that reads a step's logits from a graph's own output (pool memory), not from
    the static buffer every graph copies its output into."""
    def keeps(self, key):
        ids, positions, ctx = self._bucket(key)
        with size_oblivious():
            self.logits = type(self.model).forward(self.regions, ids, positions, ctx)
    monkeypatch.setattr(CompiledDecoder, "_forward", keeps)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("bug", [_forgets_the_static_copy, _keeps_a_graph_output])
@pytest.mark.needs("model", "paged-attention", "kv-cache-bytes")
def test_cuda_graph_simulator_catches_a_broken_decoder(bug, monkeypatch):
    """The bugs CUDA graphs add, each invisible on the CPU path (there the same broken decoder
    equals eager): a step that forgets to copy into a static buffer replays the recorded
    step's inputs; one that reads a graph's output reads memory other graphs share."""
    import graphs
    from cuda_sim import simulate_cuda
    monkeypatch.setattr(graphs, "BACKEND", "aot_eager")
    bug(monkeypatch)
    model, script = tiny_model(seed=13), _sim_script(2, 4, 1, 4)
    _sim_compare(model, KVCache, script, _decoder(model))            # CPU: no graph, no bug
    with simulate_cuda(), pytest.raises((AssertionError, IndexError)):   # wrong values, or another graph's shape
        _sim_compare(model, KVCache, script, _decoder(model))


@pytest.mark.needs("model", "paged-attention", "kv-cache-bytes")
def test_warmup_again_after_serving_writes_only_the_scratch_block():
    """serve.py warms the decoder up again in its engine thread. Every graph then replays on
    what its static inputs hold: after serving, the last real step's slots and tables. Each
    replay must reload the scratch inputs first: no block a sequence owns may change."""
    from cuda_sim import simulate_cuda
    model = tiny_model(seed=14)
    with simulate_cuda() as sim:
        make = _decoder(model)
        _sim_compare(model, KVCache, _sim_script(3, 4, 1, 6), make)    # serve a few steps
        dec, real = make.decoder, 4 * SIM_BLOCKS
        torch.manual_seed(0)
        dec.cache.k.normal_(), dec.cache.v.normal_()                # any write shows
        before_k, before_v, replays = dec.cache.k.clone(), dec.cache.v.clone(), sim.replays
        dec.warmup()
    assert sim.replays - replays == len(dec.graphs), "warm-up again replays every graph (records none)"
    for after, before in ((dec.cache.k, before_k), (dec.cache.v, before_v)):
        changed = (after[:, :real] != before[:, :real]).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
        assert not changed, f"warm-up again wrote into blocks {changed}, which sequences own"
    assert not torch.equal(dec.cache.k[:, real:], before_k[:, real:]), "the replays wrote the scratch block"


def test_cuda_graph_simulator_is_a_strict_capture():
    """The simulator itself: a capture refuses what needs the host, leaves its inputs as they
    were and its memory garbage; a replay re-runs the ops on the same tensors; a replay
    poisons what other graphs of its pool allocated (another pool's stay)."""
    from cuda_sim import HostSyncError, simulate_cuda
    x = torch.arange(6.0)
    with simulate_cuda() as sim:
        for host in (lambda: x.sum().item(), lambda: x.tolist(), lambda: x.nonzero(), lambda: x[x > 2],
                     lambda: x.numpy(), lambda: x.cpu(), lambda: torch.randn(3), lambda: torch.cuda.synchronize()):
            with pytest.raises(HostSyncError), torch.cuda.graph(torch.cuda.CUDAGraph()):
                host()
        x.sum().item(), x[x > 2], torch.cuda.synchronize()          # outside a capture: allowed
        assert sim.syncs == 1 and sim.replays == 0
        triple = torch.compile(lambda t: t * 3, backend="aot_eager")
        with pytest.raises(HostSyncError, match="compiled"), torch.cuda.graph(torch.cuda.CUDAGraph()):
            triple(x)                                               # a compile inside a capture
        a, b, c = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(a):
            y = x * 2                                               # a's memory
            x.add_(1)                                               # a static input, mutated
        assert torch.equal(x, torch.arange(6.0)) and y.isnan().all(), "a capture runs nothing"
        a.replay()
        assert torch.equal(x, torch.arange(6.0) + 1) and torch.equal(y, torch.arange(6.0) * 2)
        with torch.cuda.graph(b, pool=a.pool()):
            x + 1                                                   # b's memory
        with torch.cuda.graph(c):                                   # a pool of its own
            w = x - 1
        c.replay()
        assert torch.equal(w, x - 1) and torch.equal(y, torch.arange(6.0) * 2), "another pool: untouched"
        b.replay()
        assert y.isnan().all(), "b shares a's pool: a's memory may hold b's values"


def test_staging_waits_for_its_last_copy_before_refilling(monkeypatch):
    """The pinned buffer is reused every step, and its copy to the GPU is asynchronous: on CUDA
    an event is recorded after each copy and waited on before the next refill (vLLM hit this
    race when a refill overtook a copy still in flight). A stub event logs what the buffer
    holds at each call: wait, fill, copy, record, in that order, every step."""
    import graphs
    log = []

    class StubEvent:
        def record(self):
            log.append(("record", staging.buf[:3].tolist()))

        def synchronize(self):
            log.append(("synchronize", staging.buf[:3].tolist()))
    to = torch.Tensor.to
    empty = torch.empty
    monkeypatch.setattr(graphs, "on_cuda", lambda device: True)
    monkeypatch.setattr(torch.cuda, "Event", StubEvent)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **kw: empty(*a, **kw))   # no pinned memory here
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **kw: log.append(("copy", t[:3].tolist())) or to(t, *a, **kw))
    staging = graphs.Staging("cpu")
    first = staging.send([np.array([1, 2]), np.array([3])])
    second = staging.send([np.array([7, 8, 9])])
    assert [t.tolist() for t in first] == [[1, 2], [3]] and second[0].tolist() == [7, 8, 9]
    assert [what for what, _ in log] == ["synchronize", "copy", "record"] * 2
    assert log[1:] == [("copy", [1, 2, 3]), ("record", [1, 2, 3]), ("synchronize", [1, 2, 3]),
                       ("copy", [7, 8, 9]), ("record", [7, 8, 9])], "refilled before its copy was waited for"


@pytest.mark.needs("model", "paged-attention", "kv-cache-bytes")
def test_step_memory_measures_the_largest_bucket(monkeypatch):
    """The KV pool is sized after measuring what a compiled step needs beside it (vLLM's and
    nano-vllm's profile run): the largest bucket, run once to compile, then measured with the
    allocator's peak, read here by a meter of CPU allocations in place of torch.cuda. Its
    static buffers count once, its temporaries once more with CUDA graphs (their pool)."""
    import graphs
    from cuda_sim import MemoryMeter
    from support.timing import step_memory
    monkeypatch.setattr(graphs, "BACKEND", "aot_eager")          # the meter sees aten ops, not C++ kernels
    model, run = tiny_model(seed=15), []
    forward = CompiledDecoder._forward
    monkeypatch.setattr(CompiledDecoder, "_forward", lambda self, key: run.append(key) or forward(self, key))
    V, meter = model.config.vocab_size, MemoryMeter()
    pool = lambda: KVCache(model.config, 1, 4, "cpu", torch.float32)       # noqa: E731 (one block: the scratch)
    make = lambda: CompiledDecoder(model, pool(), max_num_seqs=5, max_blocks_per_seq=6,   # noqa: E731
                                   scratch_block=0, query_sizes=(1, 3), max_rows=32).scratch_step()
    with meter:
        eager, graphs = (step_memory(make, "cpu", graphs, memory=meter) for graphs in (False, True))
    assert run == [(3, 8, 8), (1, 32, 8)] * 4, \
        "the largest buckets (Q 3, batch 8, width 8; 32 rows, width 8), twice per measurement"
    logits = 3 * 8 * V * 4                                         # [B*Q, V] float32: static, and a temporary
    assert eager >= 2 * logits and graphs - eager >= logits, (eager, graphs)
    assert graphs - eager < eager, "the temporaries are counted once more, not the static buffers"


def test_weight_layout_frees_each_old_weight_as_it_goes(monkeypatch):
    """choose_weight_layout runs before the KV pool takes the free memory, and rewrites the
    weights one layer at a time: each old weight is freed before the next copy is made, so
    the peak is the weights plus ONE layer (not two copies of the model, 16 GB at 8B)."""
    import weakref

    import support.timing
    model = tiny_model(seed=3, ffn_dim=1024, tie_embeddings=False)     # the largest layer is not the last
    log, contiguous = [], torch.Tensor.contiguous
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            weakref.finalize(m.weight.untyped_storage(), log.append, "freed")     # its memory, not the object
    times = iter([1.0, 0.5])                                        # [in, out] measured 2x faster
    monkeypatch.setattr(support.timing, "median_seconds", lambda fn, **kw: (fn(), next(times))[1])
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a, **kw: log.append("copy") or contiguous(t, *a, **kw))
    assert choose_weight_layout(model) == "transposed"
    n = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert log == ["copy"] + ["copy", "freed"] * n, "an old weight outlived the next layer's copy"


@pytest.mark.timeout(600)
@pytest.mark.needs("engine")
def test_the_default_model_runs_continuous_batching_without_an_eager_step(real_path):
    """bench's continuous-vs-static workload (its smoke size: 8 requests of 4-32 tokens, 4 seats, all
    arriving at once) on the default model, compile=True: every step, the first one's four whole
    prompts and each later step that admits a request beside the running decodes included, runs
    the compiled step (on a GPU: a graph replay), none the eager model; the tokens are
    compile=False's, exactly (float32)."""
    from types import SimpleNamespace

    from experiments.common import workload
    b = SimpleNamespace(sizes=lambda table: SimpleNamespace(**table["cpu-quick"]))
    kw = dict(max_num_seqs=4, kv_cache_bytes=64 << 20, max_num_batched_tokens=64)   # rows <= 64
    runs = {}
    for compiled in (False, True):
        llm = LLM(real_path, compile=compiled, **kw)
        prompts, lengths = workload(b, llm.config.vocab_size)
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
        runs[compiled] = ([o.token_ids for o in llm.generate(prompts, params)], dict(llm.stats))
    assert runs[True][0] == runs[False][0], "the compiled engine changed a greedy output"
    stats = runs[True][1]
    assert stats["eager_steps"] == 0 and stats["compiled_steps"] == stats["steps"] > 0, stats