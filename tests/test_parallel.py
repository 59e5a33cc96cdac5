"""Assignment: parallel.py -- tensor parallelism on torch.distributed.

To pass, implement:
  * ColumnParallelLinear / RowParallelLinear: rank r keeps rows (output
    features) or columns (input features) r*n/N..(r+1)*n/N of each weight;
    the row-parallel one all-reduces its partial sums and adds its bias once.
    int8 layers shard the same way: column-parallel scales are sliced with
    their rows, row-parallel ones kept whole;
  * VocabParallelEmbedding (own rows, zeros for others' ids, all-reduce) and
    VocabParallelHead (own logits, all-gathered to [rows, V]);
  * shard_model(model, rank, N): swaps those in place and leaves per-rank
    head counts in the attention modules and model.config; a tied head stays
    one tensor with the embedding; shapes that do not divide raise ValueError;
  * TensorParallelGroup: starts N-1 worker processes (gloo on CPU), each with
    its own shard and its own KV pool; forward() runs every rank's shard over
    the same tokens and attention context (and copy-on-write copies). The
    logits equal the unsharded model's: on a tiny model (dense and paged, with
    a fork), in int8, and on the real model with N = 3 (greedy tokens
    identical; each rank's pool holds a third of the bytes per token);
  * failures: indivisible shapes raise before any process starts; close()
    leaves no process; a worker that fails to load is named with its error;
    a killed worker makes the next step raise within seconds; so does a
    worker that dies in the middle of a collective;
  * worker processes start as their own interpreters running
    support/workers.py's serve_worker with parallel.load_shard and
    parallel._worker_loop: a user's script needs no
    `if __name__ == "__main__":` guard, even when read from stdin, and
    leaves no worker running when it exits;
  * tensor_parallel_cost: the lecture's arithmetic; checked on Llama-3.1-8B's
    shapes against its published parameter count and a sharded meta model.

The groups are expensive to start (a process importing torch), so the tests
share one open group at a time (open_group below), in file order.
"""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, save_checkpoint, tiny_model

import parallel
from cache import AttentionContext, BlockManager, kv_cache_bytes
from model import ModelConfig, Transformer, generate, load_model
from parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelError, TensorParallelGroup,
                      VocabParallelEmbedding, VocabParallelHead, shard_model, tensor_parallel_cost,
                      weight_bytes_per_rank)
from quantize import Int8Linear, quantize_model

# ------------------------------------------------------------ shared groups

_OPEN = {}     # at most one group at a time: one process group per process


def open_group(key, factory):
    """The open group for `key`, starting it (and closing any other) if needed."""
    if key not in _OPEN:
        close_groups()
        _OPEN[key] = factory()
    return _OPEN[key]


def close_groups():
    for g in _OPEN.values():
        g.close()
    _OPEN.clear()


@pytest.fixture(scope="module", autouse=True)
def _close_at_end():
    _BASELINE.update(children())    # children of other tests' fixtures, not ours
    yield
    close_groups()


_BASELINE = set()


def children() -> set[int]:
    """pids of this process's running (not zombie) children. The workers are
    plain subprocesses, which multiprocessing.active_children() does not see."""
    me, out = os.getpid(), set()
    if not os.path.isdir("/proc"):                          # not Linux: ask ps
        ps = subprocess.Popen(["ps", "-A", "-o", "pid=,ppid=,stat="], stdout=subprocess.PIPE, text=True)
        rows = [line.split()[:3] for line in ps.communicate()[0].splitlines()]
        return {int(p) for p, pp, st in rows if int(pp) == me and not st.startswith("Z")} - {ps.pid}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue                                        # gone meanwhile
        if int(ppid) == me and state != "Z":
            out.add(int(d))
    return out


def strays() -> set[int]:
    """Children started by this file's tests that still run."""
    return children() - _BASELINE


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (6 heads, 2 KV heads, FFN 128, vocabulary 512: all even),
    with biases on q, k, v, o: the row-parallel o_proj must add its bias once."""
    path = save_checkpoint(tiny_model(seed=3, attention_bias=True), tmp_path_factory.mktemp("tp_tiny"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "attention_bias": True}, f)      # save_checkpoint does not write it
    return path


def reference(path, quantization=None):
    """The independent reference: the same checkpoint, unsharded, in this process."""
    model, _ = load_model(path, device="cpu", dtype=torch.float32)
    return quantize_model(model, quantization) if quantization else model


def alive(pid):
    """Running (a zombie, dead but not yet reaped, is not)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except ProcessLookupError:
        return False
    except OSError:
        return True                         # no /proc (not Linux): kill(0) said it exists


# ------------------------------------------------------------ sharding, in one process

@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.assignment("tensor-parallel")
@pytest.mark.needs("int8")
def test_shard_model_keeps_each_ranks_slice(quantized):
    full = tiny_model(seed=1)
    if quantized:
        quantize_model(full, "int8")
    shards = []
    for rank in range(2):
        m = tiny_model(seed=1)
        if quantized:
            quantize_model(m, "int8")
        shards.append(shard_model(m, rank, 2))
    a0, a1, af = (m.layers[1].self_attn for m in (*shards, full))
    rows = {"q_proj": 6 * 16, "k_proj": 2 * 16, "v_proj": 2 * 16}          # tiny: 6 heads, 2 KV heads of 16
    parts = lambda t, r: t.split([n // r for n in rows.values()])          # noqa: E731 (q, k, v of q/k/v stacked)
    for i, name in enumerate(rows):                                         # each rank: its heads of EACH part
        cat = torch.cat([parts(a.qkv_proj.linear.weight, 2)[i] for a in (a0, a1)], dim=0)
        assert torch.equal(cat, parts(af.qkv_proj.weight, 1)[i]), f"{name}: ranks must own consecutive rows of it"
    assert isinstance(a0.qkv_proj, ColumnParallelLinear) and isinstance(a0.o_proj, RowParallelLinear), \
        "attention: qkv_proj is column-parallel, o_proj row-parallel"
    assert torch.equal(torch.cat([a0.o_proj.linear.weight, a1.o_proj.linear.weight], 1), af.o_proj.weight), \
        "o_proj: ranks must own consecutive input columns"
    mlp0, mlp1, mlpf = (m.layers[0].mlp for m in (*shards, full))
    assert torch.equal(torch.cat([mlp0.down_proj.linear.weight, mlp1.down_proj.linear.weight], 1),
                       mlpf.down_proj.weight), "down_proj: ranks must own consecutive input columns"
    up = lambda t: t.chunk(2)[1]                                             # noqa: E731 (up: gate/up's second half)
    assert torch.equal(torch.cat([up(mlp0.gate_up_proj.linear.weight), up(mlp1.gate_up_proj.linear.weight)], 0),
                       up(mlpf.gate_up_proj.weight)), "up_proj: ranks must own consecutive rows of it"
    if quantized:
        q = lambda t, r: t[:6 * 16 // r]                                     # noqa: E731 (q's rows of q/k/v)
        assert torch.equal(torch.cat([q(a0.qkv_proj.linear.scale, 2), q(a1.qkv_proj.linear.scale, 2)]),
                           q(af.qkv_proj.scale, 1)), "column-parallel int8: the scales are sliced with their rows"
        assert torch.equal(a0.o_proj.linear.scale, af.o_proj.scale), "row-parallel int8 keeps every row's scale"
    # heads per rank, in the modules and in the config the KV cache is built from
    for layer in (a0.qkv_proj, mlp0.gate_up_proj, shards[0].lm_head):
        assert layer.linear.out_features == layer.linear.weight.shape[0], "a column shard says its own out_features"
    for layer in (a0.o_proj, mlp0.down_proj):              # (int8's bf16 and compiled products reshape by them)
        assert (layer.linear.out_features, layer.linear.in_features) == tuple(layer.linear.weight.shape), \
            "a row shard says its own in_features (and the whole out_features)"
    lin = torch.nn.Linear(8, 4)
    whole = lin.bias.detach().clone()
    biased = RowParallelLinear(lin, 1, 2, None)                               # (comm: unused until forward)
    assert biased.linear.bias is None and biased.bias is not None and torch.equal(biased.bias, whole), \
        "a row shard's bias moves whole to the module (added once, after the all-reduce), none on the slice"
    bias16 = RowParallelLinear(torch.nn.Linear(8, 4).bfloat16(), 1, 2, None).bias
    assert bias16.dtype == torch.bfloat16, f"a bf16 layer's bias stays bf16 (got {bias16.dtype}): the sum's dtype"
    assert (a0.n_heads, a0.n_kv_heads) == (3, 1), "each rank's attention holds its share of the heads and KV heads"
    assert (shards[0].config.n_heads, shards[0].config.n_kv_heads, shards[0].config.ffn_dim) == (3, 1, 64), \
        "the shard's config (the KV cache is built from it) gives per-rank heads, KV heads, FFN"
    assert shards[0].config.vocab_size == 512 and shards[0].full_config.n_heads == 6, \
        "vocab_size stays whole in the config; full_config keeps the unsharded shape"
    # vocabulary: rows of the embedding; a tied float head stays the same tensor
    emb = torch.cat([s.embed_tokens.weight for s in shards])
    assert torch.equal(emb, full.embed_tokens.weight), "the ranks' embedding rows concatenate to the full table"
    assert isinstance(shards[0].embed_tokens, VocabParallelEmbedding), "the embedding is vocab-parallel"
    assert isinstance(shards[1].lm_head, VocabParallelHead), "the head is vocab-parallel"
    if quantized:
        assert isinstance(shards[1].lm_head.linear, Int8Linear), "an int8 head stays Int8Linear after sharding"
        assert torch.equal(torch.cat([s.lm_head.linear.weight for s in shards]), full.lm_head.weight), \
            "int8 head: ranks must own consecutive vocabulary rows"
    else:
        assert shards[1].lm_head.linear.weight is shards[1].embed_tokens.weight, "tied weights must stay tied"


def test_indivisible_shapes_raise_before_any_process_starts(tmp_path, monkeypatch):
    path = save_checkpoint(tiny_model(vocab_size=500, ffn_dim=128), tmp_path)  # 6 heads, 2 KV heads
    before = children()
    with pytest.raises(ValueError, match=r"KV heads 2.*FFN width 128.*vocabulary size 500"):
        TensorParallelGroup(path, 3)
    with pytest.raises(ValueError, match="attention heads 6"):
        TensorParallelGroup(path, 4)
    with pytest.raises(ValueError, match="vocabulary size 500"):
        shard_model(tiny_model(vocab_size=500), 0, 3)
    with pytest.raises(ValueError, match="positive integer"):
        TensorParallelGroup(path, 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 GPUs, 1 visible"):
        TensorParallelGroup(path, 2, device="cuda")
    assert children() == before, "a process was started before the check"
    assert not dist.is_initialized(), "the process group was joined before the check"


def test_a_failed_start_raises_and_leaves_no_process(tmp_path):
    path = save_checkpoint(tiny_model(), tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))     # the config reads, the weights do not
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        TensorParallelGroup(path, 2)
    assert not strays(), "the workers of a failed start must be stopped"
    assert not dist.is_initialized()


def test_a_worker_that_fails_to_load_is_named_with_its_error(tiny_dir, monkeypatch):
    """Rank 0 loads, its worker does not: the start fails as soon as the worker
    exits, naming its rank, exit code and the last line of its traceback."""
    import support.workers
    to_json = support.workers.WorkerSpec.to_json
    missing = os.path.join(tiny_dir, "missing")
    monkeypatch.setattr(support.workers.WorkerSpec, "to_json",     # what the workers are told to load
                        lambda spec: to_json(dataclasses.replace(spec, path=missing)))
    t0 = time.perf_counter()
    with pytest.raises(TensorParallelError, match=r"failed to start.*rank 1 \(pid \d+\) died, exit code 1: "
                                                  r"FileNotFoundError.*missing"):
        TensorParallelGroup(tiny_dir, 2, startup_timeout_s=300)
    assert time.perf_counter() - t0 < 120, "a worker's failed start must be reported when it happens"
    assert not strays() and not dist.is_initialized()


# ------------------------------------------------------------ the tiny model, N = 2

def tiny2(path):
    return open_group(("tiny", 2), lambda: TensorParallelGroup(path, 2))


@pytest.mark.assignment("tensor-parallel")
@pytest.mark.needs("model")
def test_tiny_dense_logits_equal_unsharded(tiny_dir):
    group, ref = tiny2(tiny_dir), reference(tiny_dir)
    assert ref.layers[0].self_attn.o_proj.bias is not None, "the reference must have its biases"
    gen = torch.Generator().manual_seed(0)
    # random ids, and each rank's first and last vocabulary ids (rank 1 owns 256..511)
    for ids in [torch.randint(0, 512, (n,), generator=gen) for n in (1, 7, 33)] + [torch.tensor([0, 255, 256, 511, 256])]:
        length = len(ids)
        pos = torch.arange(length)
        want = ref(ids, pos)
        got = group.forward(ids, pos)
        assert got.shape == want.shape == (length, 512), "N=2 logits cover the full vocabulary for every token"
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5,
                                   msg=lambda m: f"N=2 logits differ from N=1 ({length} tokens): {m}")


def greedy_paged(group, prompts, steps, block_size=4, fork=None):
    """Prefill all prompts in one flat batch, then decode them together through
    the group's paged caches; returns each sequence's tokens and the logits
    rows of every step. fork=(parent, forced token): after the prefill the
    parent is forked, and the child continues with the forced token, so both
    write into a shared block (copy-on-write, on every rank)."""
    bm = BlockManager(group.cache.num_blocks, block_size, enable_prefix_caching=False)
    seqs = {i: list(p) for i, p in enumerate(prompts)}
    for i, p in seqs.items():
        bm.allocate(i, p)
    fed = {i: 0 for i in seqs}                   # tokens already in the cache
    rows_out = []
    for step in range(steps + 1):
        work = []
        for i, toks in seqs.items():
            start = fed[i]
            work.append((i, toks[start:], start, bm.append_slots(i, start, len(toks) - start)))
        rows = list(torch.tensor([len(w[1]) for w in work]).cumsum(0) - 1)
        copies = list(bm.pending_copies)         # build() applies (and clears) rank 0's
        ids, pos, ctx = AttentionContext.build(group.cache, bm, work, [int(r) for r in rows], "cpu")
        logits = group.forward(ids, pos, ctx, copies=copies)          # [B, V]
        rows_out.append({i: logits[b] for b, (i, *_) in enumerate(work)})
        for b, (i, toks, start, _) in enumerate(work):
            fed[i] = start + len(toks)
            seqs[i].append(int(logits[b].argmax()))
        if step == 0 and fork is not None:
            parent, forced = fork
            child = len(seqs)
            bm.fork(parent, child)
            seqs[child], fed[child] = seqs[parent][:-1] + [forced], fed[parent]
    return seqs, rows_out


@pytest.mark.assignment("tensor-parallel")
@pytest.mark.needs("model", "paged-attention", "kv-cache-bytes", "block-allocation", "copy-on-write")
def test_tiny_paged_prefill_then_decode_equal_unsharded(tiny_dir):
    group, ref = tiny2(tiny_dir), reference(tiny_dir)
    group.allocate_cache(num_blocks=24, block_size=4)
    prompts = [[5, 17, 300, 2, 9, 44], [7, 7, 100, 200, 301, 400, 3, 11, 90]]   # 6 tokens: a partial block
    seqs, rows = greedy_paged(group, prompts, steps=3, fork=(0, 123))
    assert len(seqs) == 3 and seqs[2][6] == 123, "the fork is a third sequence that continues with its forced token"
    for step, logits in enumerate(rows):
        for i, got in logits.items():
            n = len(seqs[i]) - (len(rows) - step)           # tokens the step had seen
            want = ref(torch.tensor(seqs[i][:n]), torch.arange(n))[-1]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5, msg=lambda m: (
                f"sequence {i}, step {step}: paged N=2 logits differ from the dense N=1 model: {m}"))


@pytest.mark.needs("tensor-parallel", "model")
def test_allreduce_counter_for_the_bench(tiny_dir):
    group = tiny2(tiny_dir)
    cfg = group.full_config
    group.comm.reset()
    group.comm.timing = True
    try:
        group.forward(torch.arange(10), torch.arange(10))
    finally:
        group.comm.timing = False
    # 2 per layer + the embedding's all-reduce + the logits' all-gather
    assert group.comm.calls == 2 * cfg.n_layers + 2
    assert group.comm.bytes == (2 * cfg.n_layers + 1) * 10 * cfg.dim * 4 + 10 * cfg.vocab_size // 2 * 4
    assert group.comm.seconds > 0


def _die_on_workers(model, cache):
    """Workers exit at once; rank 0 waits for them in an all-reduce."""
    if dist.get_rank() != 0:
        os._exit(7)
    return model.tp_comm.all_reduce(torch.ones(1))


@pytest.mark.needs("tensor-parallel")
def test_worker_dying_inside_a_collective_raises(tiny_dir):
    group = tiny2(tiny_dir)
    t0 = time.perf_counter()
    with pytest.raises(TensorParallelError, match="exit code 7"):
        group.run(_die_on_workers)
    assert time.perf_counter() - t0 < 5, "a peer gone mid-collective must fail in seconds"
    close_groups()
    assert not strays()


# ------------------------------------------------------------ int8, and a killed worker

def tiny2_int8(path):
    return open_group(("tiny-int8", 2), lambda: TensorParallelGroup(path, 2, quantization="int8"))


@pytest.mark.assignment("tensor-parallel")
@pytest.mark.needs("model", "int8")
def test_int8_sharded_equals_int8_unsharded(tiny_dir):
    group, ref = tiny2_int8(tiny_dir), reference(tiny_dir, "int8")
    assert isinstance(group.model.layers[0].mlp.down_proj.linear, Int8Linear), \
        "the int8 group's layers must be Int8Linear"
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24)
    want, unquantized = ref(ids, pos), reference(tiny_dir)(ids, pos)
    assert (want - unquantized).abs().max() > 1e-3, "the reference must really be quantized"
    torch.testing.assert_close(group.forward(ids, pos), want, atol=1e-4, rtol=1e-5,
                               msg=lambda m: f"int8 N=2 logits differ from int8 N=1: {m}")


@pytest.mark.needs("tensor-parallel", "model", "int8")
def test_killed_worker_raises_within_seconds(tiny_dir):
    group = tiny2_int8(tiny_dir)
    ids = torch.arange(5)
    group.forward(ids, torch.arange(5))                      # healthy first
    (pid,) = group.pids
    os.kill(pid, signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(TensorParallelError, match="SIGKILL"):
        group.forward(ids, torch.arange(5))
    assert time.perf_counter() - t0 < 5, "a dead worker must be noticed in seconds"
    with pytest.raises(TensorParallelError, match="close"):   # and the group stays refused
        group.forward(ids, torch.arange(5))
    close_groups()
    assert not alive(pid) and not strays()
    assert not dist.is_initialized()


# ------------------------------------------------------------ the real model, N = 3

def _pool_shapes(model, cache):
    """(bytes, KV heads, blocks) of every rank's pool, gathered on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, (cache.total_bytes, cache.k.shape[-2], cache.num_blocks))
    return out


@pytest.mark.timeout(600)
@pytest.mark.assignment("tensor-parallel")
@pytest.mark.needs("model", "paged-attention", "kv-cache-bytes", "block-allocation")
def test_real_model_n3_greedy_tokens_equal_unsharded(real_path, real_model, real_tokenizer):
    group = open_group(("real", 3), lambda: TensorParallelGroup(real_path, 3))
    cfg = real_model.config
    assert (group.config.n_heads, group.config.n_kv_heads, group.config.ffn_dim) == (3, 1, 512), \
        "with N=3 each rank holds a third of the heads, KV heads and FFN"
    per_token = kv_cache_bytes(group.config, torch.float32)
    assert 3 * per_token == kv_cache_bytes(cfg, torch.float32) == 46080, "each rank holds a third per token"
    group.allocate_cache(num_blocks=12, block_size=16)
    assert group.run(_pool_shapes) == [(12 * 16 * per_token, 1, 12)] * 3, "every rank: a third of the pool"
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
    ids = [real_tokenizer.encode(p) for p in prompts]
    steps = 3
    seqs, _ = greedy_paged(group, ids, steps=steps, block_size=16)
    for i, p in enumerate(ids):
        want = generate(real_model, p, steps + 1)             # N = 1, dense, no cache
        assert seqs[i][len(p):] == want, f"prompt {prompts[i]!r}: N=3 gave {seqs[i][len(p):]}, N=1 {want}"
    pids = group.pids
    close_groups()
    assert not any(alive(p) for p in pids), "close() must leave no worker process"
    assert not strays() and not dist.is_initialized(), "close() must leave no stray process and no process group"


# ------------------------------------------------------------ through the engine

@pytest.mark.timeout(600)
@pytest.mark.assignment("tensor-parallel")
@pytest.mark.needs("engine", "sampler", "copy-on-write")
def test_engine_n2_equals_n1_batched_chunked_preempted(tiny_dir):
    """LLM(tensor_parallel_size=2): the same greedy tokens as N = 1 with a
    batch, chunked prefills, a fork (n = 2) and preemptions; a pool sized by
    the same byte budget holds twice the tokens; close() leaves no worker."""
    close_groups()
    from engine import LLM, SamplingParams
    prompts = [list(range(5, 5 + 9 * i)) for i in range(1, 6)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * 4 + [SamplingParams(max_tokens=6, n=2, seed=1,
                                                                                    temperature=1.0)]
    kw = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=6)
    budget = 24 * 4 * 512                         # 24 blocks at N = 1 (512 B per token)
    ref = LLM(tiny_dir, kv_cache_bytes=budget, **kw)
    want = [[c.token_ids for c in o.outputs] for o in ref.generate(prompts, params)]
    assert ref.scheduler.num_preemptions >= 1, "the pool was meant to force preemption"
    llm = LLM(tiny_dir, kv_cache_bytes=budget // 2, tensor_parallel_size=2, **kw)   # 24 blocks again
    try:
        assert llm.block_manager.num_blocks == ref.block_manager.num_blocks, "half the bytes per token per rank"
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        assert got == want, "tensor parallelism changed the engine's tokens"
        assert llm.scheduler.num_preemptions >= 1, "the N=2 run must preempt too"
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks, "every block is back after generate"
        pids = llm.tp.pids
    finally:
        llm.close()
    assert not any(alive(p) for p in pids), "LLM.close() must leave no worker process"
    assert not dist.is_initialized(), "close() must destroy the process group"


# A user's script as people write them: no `if __name__ == "__main__":` guard, no close().
UNGUARDED_SCRIPT = """
import dataclasses
import json
from engine import LLM, SamplingParams
llm = LLM(path={path!r}, tensor_parallel_size=2, kv_cache_bytes=1 << 20)
outs = llm.generate({prompts!r}, SamplingParams(max_tokens=8, ignore_eos=True))
print(json.dumps({{"tokens": [o.token_ids for o in outs], "pids": llm.tp.pids}}))
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["file", "stdin"])
@pytest.mark.needs("tensor-parallel", "engine")
def test_unguarded_script_runs_tensor_parallel(tiny_dir, tmp_path, how):
    """A script without a __main__ guard, run as a file or piped to `python -`,
    starts its workers (which must not re-run the script), gets the greedy
    tokens of N = 1, and at exit leaves no worker running and no traceback."""
    close_groups()
    from engine import LLM, SamplingParams
    prompts = [[5, 17, 300, 2, 9, 44], [7, 7, 100, 200, 301, 400, 3]]   # ids: the tiny vocabulary is 512
    want = [o.token_ids for o in LLM(tiny_dir, kv_cache_bytes=1 << 20).generate(
        prompts, SamplingParams(max_tokens=8, ignore_eos=True))]
    script = textwrap.dedent(UNGUARDED_SCRIPT.format(path=tiny_dir, prompts=prompts))
    (tmp_path / "user_script.py").write_text(script)
    argv, stdin = ([sys.executable, "user_script.py"], None) if how == "file" else ([sys.executable, "-"], script)
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run(argv, input=stdin, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"the unguarded script ({how}) failed:\n{run.stderr[-3000:]}"
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, f"the script's body ran {len(lines)} times (a worker re-ran it?):\n{run.stdout}"
    out = json.loads(lines[0])
    assert out["tokens"] == want, "N=2 in a script gave other greedy tokens than N=1"
    assert "Traceback" not in run.stderr, f"a process failed at exit:\n{run.stderr[-3000:]}"
    assert len(out["pids"]) == 1 and not any(alive(p) for p in out["pids"]), "a worker outlived the script"


# ------------------------------------------------------------ the lecture's arithmetic

LLAMA_8B = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
                       vocab_size=128256, tie_embeddings=False)


@pytest.mark.needs("tensor-parallel", "kv-cache-bytes")
def test_cost_arithmetic_on_llama_8b_shapes():
    # Meta's published parameter count of Llama-3.1-8B, in bf16
    assert weight_bytes_per_rank(LLAMA_8B, 1, 2) == 8_030_261_248 * 2
    c = tensor_parallel_cost(LLAMA_8B, 8, tokens=64, dtype=torch.bfloat16,
                             link_bytes_per_s=parallel.NVLINK_H100_SXM)
    assert c["allreduce_bytes"] == 2 * 32 * 64 * 4096 * 2 == 33_554_432
    assert c["ring_bytes_per_rank"] == 33_554_432 * 2 * 7 / 8
    assert c["allreduce_seconds"] == pytest.approx(58_720_256 / 450e9)
    assert c["kv_bytes_per_token_per_rank"] == 2 * 32 * 1 * 128 * 2     # 8 KV heads over 8 ranks
    assert tensor_parallel_cost(LLAMA_8B, 1, 64)["ring_bytes_per_rank"] == 0
    with pytest.raises(ValueError, match="KV heads 8"):
        tensor_parallel_cost(LLAMA_8B, 16, 64)               # 8 KV heads do not split 16 ways
    # an independent count: shard a meta-device model for rank 0 of 4 and add up its tensors
    with torch.device("meta"):
        model = Transformer(LLAMA_8B).to(torch.bfloat16)
    shard_model(model, 0, 4)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers()) if t is not model.inv_freq}
    measured = sum(t.numel() * t.element_size() for t in tensors.values())
    assert weight_bytes_per_rank(LLAMA_8B, 4, 2) == measured


# ---- paths the rest of this file does not reach

@pytest.mark.needs("model", "tensor-parallel")
def test_joining_torchruns_group_serves_from_rank_0_and_leaves_its_group(tiny_dir, monkeypatch):
    """Under torchrun (WORLD_SIZE, RANK and the rendezvous in the
    environment) the group joins the existing process group instead of
    spawning workers: a WORLD_SIZE other than tensor_parallel_size is refused
    naming both; with a group the script already initialized, rank 0's logits
    equal the unsharded model's and close() leaves the script's group alone;
    without one, it makes the group and destroys it on close()."""
    import socket
    close_groups()                                      # this process may hold one group at a time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="tensor_parallel_size=1 but torchrun started WORLD_SIZE=2"):
        TensorParallelGroup(tiny_dir, 1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    ref, ids = reference(tiny_dir), torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    dist.init_process_group("gloo")                     # what the user's script did under torchrun
    try:
        group = TensorParallelGroup(tiny_dir, 1)
        assert not group.procs, "under torchrun nothing is spawned"
        torch.testing.assert_close(group.forward(ids, torch.arange(8)), ref(ids, torch.arange(8)), atol=1e-5, rtol=0)
        group.close()
        assert dist.is_initialized(), "close() must not destroy a group the script made"
    finally:
        dist.destroy_process_group()
    group = TensorParallelGroup(tiny_dir, 1)            # no group yet: the group makes (and owns) it
    torch.testing.assert_close(group.forward(ids, torch.arange(8)), ref(ids, torch.arange(8)), atol=1e-5, rtol=0)
    for bad in [(0, 4), (8, 4, "int4")]:
        with pytest.raises(ValueError, match="need num_blocks >= 1 and kv_cache_dtype None or 'int8'"):
            group.allocate_cache(*bad)
    group.close()
    assert not dist.is_initialized(), "a group it made itself must be destroyed on close()"
