"""
parallel.py -- tensor parallelism: one model across several devices.

The lesson: when one device is too small or too slow for a model, split
EVERY layer across N devices (Megatron-LM's tensor parallelism) rather than
giving each device a few whole layers. A linear layer y = x W^T can be split
two ways, and a transformer layer is one of each, back to back:

    column-parallel (q, k, v, gate, up): rank r owns a slice of the OUTPUT
        features (rows of W): its own attention heads, its own FFN columns.
        Needs the full input x, computes its slice of y; no communication.
    row-parallel (o, down): rank r owns a slice of the INPUT features
        (columns of W): exactly the heads / FFN columns it computed above.
        Each rank's product is a partial sum; an ALL-REDUCE adds them up.

    x [T, D] (same on every rank)
      -> q, k, v  column-parallel      [T, (H/N) d], [T, (KV/N) d]   heads are independent,
      -> attention over own KV heads   [T, (H/N) d]                  so attention needs no talk
      -> o        row-parallel         [T, D] partial  -> all-reduce #1
      -> gate, up column-parallel      [T, F/N]                      silu(g)*u is elementwise
      -> down     row-parallel         [T, D] partial  -> all-reduce #2

So TWO all-reduces per layer, each of a [tokens, D] activation. Per step:

    all-reduce payload = 2 * layers * tokens * dim * bytes_per_value
    ring all-reduce:     each rank sends (and receives) 2 (N-1)/N of it
    communication time ~ 2 (N-1)/N * payload / link bandwidth   (+ a latency per call)

while each rank reads only 1/N of the weights and holds 1/N of the KV cache:
the cache is split by KV heads, so the same byte budget per device holds N
times the tokens (bytes per token per rank = 2 * L * (KV/N) * d * bytes).
That is the trade: N times less memory traffic per device against two
all-reduces per layer on the link between devices. Over NVLink it pays; over
PCIe or between machines it often does not, which is why tensor parallelism
stays inside one node and pipeline/data parallelism go across nodes.

The vocabulary is split too: the embedding table by rows (rank r looks up
only the ids in its slice, zeros elsewhere, and an all-reduce fills in the
rest) and the LM head by rows (rank r computes the logits of its slice of
the vocabulary, an all-gather assembles the full row for the sampler).

Place in the data flow: rank 0 is the engine's own process. It runs the
scheduler, the block manager and the sampler, exactly as without
parallelism. N-1 worker processes (torch.multiprocessing, one device each on
CUDA) each load the same checkpoint, keep their own slice (shard_model),
hold their own KV pool for their KV heads, and loop:

    rank 0:   TensorParallelGroup.forward(input_ids, positions, ctx, copies)
                -> broadcast (copies, input ids, positions, ctx) to the workers
                -> run its own slice of the model             -- all-reduces --
    rank r:   receive, apply the copy-on-write copies, run its own slice

The block manager needs no change: every rank's pool has the same number
of blocks, so one block table addresses all of them. Communication is
torch.distributed only: NCCL on CUDA, gloo on CPU (so a laptop runs it).
model.py knows nothing of any of this: shard_model swaps modules and slices
weights, the way quantize.quantize_model swaps linear layers.
"""
from __future__ import annotations

import atexit
import copy
import dataclasses
import json
import os
import signal
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from cache import KVCache, kv_cache_bytes
from model import ModelConfig, load_model
from quantize import Int8KVCache, Int8Linear, quantize_model

# ----------------------------------------------------------------------------
# The collectives, counted and timed for bench.py
# ----------------------------------------------------------------------------

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name
# warns); the GPU machines' torch 2.11 has only the old one. Same operation.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collectives:
    """The two collectives tensor parallelism needs, over one process group.

    With timing=True (eager steps only: the clock is not traceable by
    torch.compile) every call is counted and timed; bench.py reads calls,
    bytes and seconds. On CUDA the timer synchronizes first, so the time is
    the collective itself, not the matmuls queued before it. On rank 0 it
    includes waiting for the slowest rank to arrive: skew shows up as
    communication time, which is also what the step pays for it.
    """

    def __init__(self, rank: int, world_size: int, group=None):
        self.rank, self.world_size, self.group = rank, world_size, group   # group None: the default group
        self.timing = False
        self.reset()

    def reset(self):
        self.calls, self.bytes, self.seconds = 0, 0, 0.0

    def _timed(self, x, fn):
        if not self.timing:
            return fn()
        sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += x.numel() * x.element_size()    # this rank's tensor (a ring all-reduce sends
        return out                                    # 2 (N-1)/N of it, an all-gather (N-1) times it)

    def all_reduce(self, x):
        """Elementwise sum over ranks, in place; every rank gets the result."""
        if self.world_size == 1:
            return x
        self._timed(x, lambda: dist.all_reduce(x, group=self.group))
        return x

    def all_gather_last_dim(self, x):
        """[..., V/N] on each rank -> [..., V] on every rank, rank r's slice at r*V/N.

        All-gather rather than a gather to rank 0 (where the sampler runs): rank 0
        receives the same bytes either way, and the all-gather is traceable by
        torch.compile (kernels.py's compiled decode step) while dist.gather is
        not (torch 2.13 on CPU: dynamo refuses dist.gather; the whole sharded
        model compiled with fullgraph=True ran and matched eager).
        """
        if self.world_size == 1:
            return x
        x = x.contiguous()
        out = x.new_empty(self.world_size * x.shape[0], *x.shape[1:])            # [N * rows, V/N]
        self._timed(x, lambda: _all_gather(out, x, group=self.group))
        rows, cols = x.shape
        return out.view(self.world_size, rows, cols).transpose(0, 1).reshape(rows, self.world_size * cols)  # [rows, V]


# ----------------------------------------------------------------------------
# The parallel layers: each keeps its slice in an ordinary inner module
# ----------------------------------------------------------------------------
# The slices live in an ordinary nn.Linear / quantize.Int8Linear / nn.Embedding
# inside each wrapper, so code that swaps those (kernels.choose_weight_layout)
# or counts them (quantize.decode_weight_bytes) keeps working after sharding.


def _narrow_(module: nn.Module, name: str, dim: int, rank: int, world_size: int):
    """Keep rank's 1/world_size of module.<name> along dim, in place.

    A copy (clone), not a view: a view would keep the whole tensor alive."""
    t = getattr(module, name)
    size = t.shape[dim] // world_size
    piece = t.detach().narrow(dim, rank * size, size).clone()
    setattr(module, name, nn.Parameter(piece, requires_grad=False) if isinstance(t, nn.Parameter) else piece)


def _check_linear(linear):
    if type(linear) not in (nn.Linear, Int8Linear):
        raise TypeError(f"cannot shard a {type(linear).__name__}: shard the model right after loading "
                        f"(and quantize_model), before kernels.py changes the weight layout")


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T: rank r owns output features [r*out/N, (r+1)*out/N).

    Input x [T, in] is the same on every rank; output [T, out/N] stays split
    (the next op works on whole heads or FFN columns), so no communication.
    int8: the per-output-channel scales are sliced with their rows.
    """

    def __init__(self, linear, rank: int, world_size: int):
        super().__init__()
        _check_linear(linear)
        # assignment: tensor-parallel
        for name in ("weight", "bias", "scale"):                 # W [out, in], b [out], scale [out]
            if getattr(linear, name, None) is not None:
                _narrow_(linear, name, 0, rank, world_size)
        linear.out_features //= world_size
        # end assignment
        self.linear = linear                                     # [out/N, in]

    def forward(self, x):                                        # [T, in] -> [T, out/N]
        return self.linear(x)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T (+ b): rank r owns input features [r*in/N, (r+1)*in/N).

    Its input [T, in/N] is what the column-parallel layer before it left on
    this rank; its product is a partial sum, and an all-reduce adds the
    partial sums of all ranks. The bias is added once, after the sum. int8:
    each output row's scale was computed over the WHOLE row, so every rank
    keeps all of them, and sum_r scale * (x_r q_r^T) = scale * x q^T exactly
    as unsharded.
    """

    def __init__(self, linear, rank: int, world_size: int, comm: Collectives):
        super().__init__()
        _check_linear(linear)
        # assignment: tensor-parallel
        _narrow_(linear, "weight", 1, rank, world_size)          # W [out, in/N]
        linear.in_features //= world_size
        bias = linear.bias
        linear.bias = None
        self.register_buffer("bias", None if bias is None else bias.detach())
        # end assignment
        self.linear, self.comm = linear, comm

    def forward(self, x):                                        # [T, in/N]
        # assignment: tensor-parallel
        y = self.comm.all_reduce(self.linear(x))                 # [T, out]: partial sums -> the sum
        return y if self.bias is None else y + self.bias
        # end assignment


class VocabParallelEmbedding(nn.Module):
    """Rank r owns rows [r*V/N, (r+1)*V/N) of the embedding table.

    Each rank looks up the ids in its slice and gives zeros for the others;
    exactly one rank holds each id, so an all-reduce (a sum with zeros)
    yields every token's row on every rank, bit for bit.
    """

    def __init__(self, embedding: nn.Embedding, rank: int, world_size: int, comm: Collectives):
        super().__init__()
        _narrow_(embedding, "weight", 0, rank, world_size)       # [V/N, D]
        embedding.num_embeddings //= world_size
        self.embed, self.comm = embedding, comm
        self.start = rank * embedding.num_embeddings
        self.end = self.start + embedding.num_embeddings

    @property
    def weight(self):
        return self.embed.weight

    def forward(self, ids):                                      # [T] -> [T, D]
        # assignment: tensor-parallel
        mine = (ids >= self.start) & (ids < self.end)            # [T] ids this rank holds
        x = self.embed(torch.where(mine, ids - self.start, 0))   # others' ids read row 0 ...
        x = x.masked_fill(~mine[:, None], 0)                     # ... and are zeroed
        return self.comm.all_reduce(x)
        # end assignment


class VocabParallelHead(ColumnParallelLinear):
    """The LM head, column-parallel over the vocabulary: rank r computes the
    logits of its V/N tokens, then an all-gather assembles [rows, V].

    A tied head shares the (sliced) embedding table, and both slice the
    vocabulary the same way, so they stay one tensor.
    """

    def __init__(self, linear, rank: int, world_size: int, comm: Collectives):
        super().__init__(linear, rank, world_size)
        self.comm = comm

    def forward(self, x):                                        # [rows, D]
        return self.comm.all_gather_last_dim(self.linear(x))    # [rows, V/N] -> [rows, V]


# ----------------------------------------------------------------------------
# Sharding a loaded model, and the checks that come first
# ----------------------------------------------------------------------------


def read_config(path: str) -> ModelConfig:
    """The model's config without loading its weights (a checkpoint directory's
    config.json; anything else load_model knows, on the meta device)."""
    cfg_file = os.path.join(path, "config.json") if isinstance(path, str) else ""
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            return ModelConfig.from_hf(json.load(f))
    return load_model(path, device="meta")[1]


def check_tensor_parallel(cfg: ModelConfig, world_size: int, device_type: str = "cpu"):
    """Raise ValueError unless every split is whole: each rank must own whole
    heads, whole KV heads, whole FFN columns and whole vocabulary rows.
    (vLLM replicates KV heads when N > KV heads and pads the vocabulary;
    nanoinfer refuses instead, and says which numbers do not divide.)"""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    sizes = {"attention heads": cfg.n_heads, "KV heads": cfg.n_kv_heads,
             "FFN width": cfg.ffn_dim, "vocabulary size": cfg.vocab_size}
    bad = [f"{name} {n}" for name, n in sizes.items() if n % world_size]
    if bad:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's attention heads, "
                         f"KV heads, FFN width and vocabulary size; it does not divide: {', '.join(bad)}")
    if device_type == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs, "
                         f"{torch.cuda.device_count()} visible (CUDA_VISIBLE_DEVICES)")


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's shard: its heads, KV heads and FFN columns.

    dim, layers, head_dim and vocab_size stay whole: they describe tensors
    every rank sees in full (the residual stream, token ids, gathered logits).
    The KV cache built from this config holds this rank's KV heads only, so
    cache.kv_cache_bytes gives the lecture's formula divided by N."""
    return dataclasses.replace(cfg, n_heads=cfg.n_heads // world_size,
                               n_kv_heads=cfg.n_kv_heads // world_size, ffn_dim=cfg.ffn_dim // world_size)


def shard_model(model, rank: int, world_size: int, comm: Collectives | None = None):
    """Keep rank's slice of a loaded (optionally quantized) Transformer, in place.

    Quantize BEFORE sharding: row-parallel int8 layers then keep the scales of
    the whole rows, and the sharded model computes what the unsharded int8
    model does. Afterwards the attention modules and model.config hold the
    per-rank head counts, so Attention.forward and the KV cache run unchanged.
    """
    cfg = model.config
    check_tensor_parallel(cfg, world_size)
    comm = comm or Collectives(rank, world_size)
    tied = model.lm_head.weight is model.embed_tokens.weight
    for block in model.layers:
        a, m = block.self_attn, block.mlp
        a.q_proj, a.k_proj, a.v_proj = (ColumnParallelLinear(p, rank, world_size)        # own heads
                                        for p in (a.q_proj, a.k_proj, a.v_proj))
        a.o_proj = RowParallelLinear(a.o_proj, rank, world_size, comm)                    # all-reduce #1
        a.n_heads, a.n_kv_heads = a.n_heads // world_size, a.n_kv_heads // world_size
        m.gate_proj, m.up_proj = (ColumnParallelLinear(p, rank, world_size) for p in (m.gate_proj, m.up_proj))
        m.down_proj = RowParallelLinear(m.down_proj, rank, world_size, comm)              # all-reduce #2
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, rank, world_size, comm)
    model.lm_head = VocabParallelHead(model.lm_head, rank, world_size, comm)
    if tied:          # one table: the head sliced the same rows; keep a single copy of them
        model.lm_head.linear.weight = model.embed_tokens.weight
    model.full_config, model.config = cfg, shard_config(cfg, world_size)
    model.tp_rank, model.tp_world_size, model.tp_comm = rank, world_size, comm
    return model


def load_shard(path: str, rank: int, world_size: int, device, dtype, quantization=None):
    """load_model -> quantize_model -> shard_model -> to(device), for one rank.

    Loaded on the CPU and moved after slicing, so a device only ever holds its
    slice (the point of tensor parallelism: a model too big for one device).
    A float32 checkpoint loaded as float32 stays memory-mapped, so N processes
    share the file's pages (page cache) and copy only their slices into
    their own memory. (A production loader reads just its slice from the
    file, e.g. safetensors' get_slice; this one stays a three-liner.)"""
    model, _ = load_model(path, device="cpu", dtype=dtype)
    if quantization is not None:
        quantize_model(model, quantization)
    shard_model(model, rank, world_size)
    return model.to(device)


def make_cache(cfg: ModelConfig, num_blocks: int, block_size: int, kv_cache_dtype, device, dtype):
    """One rank's KV pool for its KV heads (cfg is the sharded config)."""
    if kv_cache_dtype not in (None, "int8"):
        raise ValueError(f"kv_cache_dtype must be None or 'int8', got {kv_cache_dtype!r}")
    return (Int8KVCache if kv_cache_dtype == "int8" else KVCache)(cfg, num_blocks, block_size, device, dtype)


# ----------------------------------------------------------------------------
# The lecture's arithmetic, for models too big to run here (bench.py)
# ----------------------------------------------------------------------------
# Link bandwidths, bytes per second in ONE direction (a ring all-reduce sends
# and receives at the same time, so the per-direction figure is the one):
NVLINK_H100_SXM = 450e9   # NVIDIA H100 SXM datasheet: NVLink 900 GB/s, i.e. both directions together
PCIE_GEN5_X16 = 64e9      # PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b coding = 63 GB/s each way
HBM_H100_SXM = 3.35e12    # NVIDIA H100 SXM datasheet: HBM3 3.35 TB/s, to compare the weight read with


def weight_bytes_per_rank(cfg: ModelConfig, world_size: int, bytes_per_value: int) -> int:
    """Bytes of weights one rank holds: every matrix split N ways, norms (and
    the row-parallel biases) replicated. A tied head shares the table."""
    D, L, H, KV, d, F_, V = (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                             cfg.head_dim, cfg.ffn_dim, cfg.vocab_size)
    split = L * (D * H * d + 2 * D * KV * d + H * d * D + 3 * D * F_)        # q, k, v, o, gate, up, down
    split += V * D * (1 if cfg.tie_embeddings else 2)                        # embedding (+ head)
    replicated = L * 2 * D + D                                               # RMSNorm weights
    if cfg.attention_bias:
        split += L * (H + 2 * KV) * d                                        # q, k, v biases
        replicated += L * D                                                  # o bias, added after the sum
    return (split // world_size + replicated) * bytes_per_value


def tensor_parallel_cost(cfg: ModelConfig, world_size: int, tokens: int, dtype=torch.bfloat16,
                         link_bytes_per_s: float = NVLINK_H100_SXM, hbm_bytes_per_s: float = HBM_H100_SXM) -> dict:
    """The seed's arithmetic for one forward step of `tokens` tokens on N ranks.

    allreduce_bytes = 2 * layers * tokens * dim * bytes  (two [tokens, D] all-reduces per layer)
    ring_bytes_per_rank = 2 (N-1)/N * allreduce_bytes    (a ring all-reduce: reduce-scatter +
                          all-gather, each moving (N-1)/N of the data through every rank's link)
    allreduce_seconds = ring bytes / link bandwidth: a lower bound; each of the 2L calls also
                        pays a fixed latency, which dominates at small batch (bench.py measures it).
    Not counted: the embedding's all-reduce (one more [tokens, D]) and the logits all-gather.
    """
    check_tensor_parallel(cfg, world_size)         # e.g. 8 KV heads do not split 16 ways
    b = torch.finfo(dtype).bits // 8
    payload = 2 * cfg.n_layers * tokens * cfg.dim * b
    ring = 2 * (world_size - 1) / world_size * payload
    weights = weight_bytes_per_rank(cfg, world_size, b)
    return {"world_size": world_size, "tokens": tokens, "bytes_per_value": b,
            "weight_bytes_per_rank": weights,
            "kv_bytes_per_token_per_rank": kv_cache_bytes(shard_config(cfg, world_size), dtype),
            "allreduce_calls": 2 * cfg.n_layers,
            "allreduce_bytes": payload,
            "ring_bytes_per_rank": ring,
            "allreduce_seconds": ring / link_bytes_per_s,
            "weight_read_seconds": weights / hbm_bytes_per_s}   # the decode step's memory bound per rank


# ----------------------------------------------------------------------------
# The processes: rank 0 (the engine) and its workers
# ----------------------------------------------------------------------------

FOREVER = timedelta(days=3650)   # a worker waits for rank 0's next step as long as the engine idles


class TensorParallelError(RuntimeError):
    """A worker died or a collective failed: the group cannot run another step."""


@dataclasses.dataclass
class _Spec:
    """What every rank needs to load its shard (pickled to the spawned workers)."""
    path: str
    world_size: int
    device_type: str
    dtype: torch.dtype
    quantization: str | None
    collective_timeout_s: float


def _device(spec: _Spec, local_rank: int) -> torch.device:
    if spec.device_type == "cuda":  # pragma: no cover (CUDA)
        torch.cuda.set_device(local_rank)          # NCCL and new tensors use this GPU
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _init_groups(spec: _Spec, rank: int, store):
    """Join the process group; return the command group.

    Two groups: the default one (NCCL on CUDA, gloo on CPU) carries the
    all-reduces and has a collective timeout, so a rank that stops answering
    turns into an error instead of a hang. The command group (gloo: it
    carries pickled Python objects through CPU memory) has no practical
    timeout: a worker waits on it for rank 0's next step, however long the
    engine idles. store None: torchrun's environment (env://)."""
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=spec.collective_timeout_s)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=spec.world_size, timeout=timeout)
    elif not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    return dist.new_group(backend="gloo", timeout=FOREVER)


def _place(obj, device, cache):
    """obj with its tensors on `device` and any attention context's .cache set to `cache`.

    Walks tensors, lists, tuples, dicts and objects with a .cache attribute
    (the context: a shallow copy, so the caller's object is not changed).
    Rank 0 sends _place(args, "cpu", None); a worker runs _place(args, its
    device, its own cache). Any context class works unchanged this way."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if type(obj) in (list, tuple):
        return type(obj)(_place(x, device, cache) for x in obj)
    if type(obj) is dict:
        return {k: _place(v, device, cache) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not hasattr(obj, "cache"):
        return dataclasses.replace(obj, **{f.name: _place(getattr(obj, f.name), device, cache)
                                           for f in dataclasses.fields(obj) if f.init})
    if hasattr(obj, "cache") and hasattr(obj, "__dict__"):
        new = copy.copy(obj)
        for name, value in list(vars(new).items()):
            if name != "cache":
                setattr(new, name, _place(value, device, cache))
        new.cache = cache
        return new
    return obj


def _forward(model, cache, input_ids, positions, ctx):
    """The step every rank runs: its slice of the model over the same tokens."""
    return model(input_ids, positions, ctx)


@torch.inference_mode()
def _execute(model, cache, copies, fn, args):
    for src, dst in copies:                 # copy-on-write first, on every rank's pool
        cache.copy_block(src, dst)
    return fn(model, cache, *args)


def _worker_loop(model, device, dtype, commands):
    """Rank r >= 1: receive each of rank 0's commands and run it, until "stop".

    Each step arrives as one pickled object over the command group
    (dist.broadcast_object_list). A production engine avoids the pickling:
    vLLM puts the step's metadata in a shared-memory ring buffer and
    broadcasts its tensors directly; for nanoinfer's small steps this is
    plenty, and it stays one line."""
    cache = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=commands)
        kind, *payload = box[0]
        if kind == "stop":
            break
        if kind == "alloc":                 # (num_blocks, block_size, kv_cache_dtype)
            cache = make_cache(model.config, *payload, device, dtype)
            model.tp_comm.all_reduce(torch.zeros(1, device=device))   # tell rank 0 it worked
        else:                               # "step": (copies, fn, args)
            copies, fn, args = payload
            _execute(model, cache, copies, fn, _place(args, device, cache))
    dist.destroy_process_group()


def _spawned_worker(rank: int, port: int, spec: _Spec):
    """Entry point of a worker process started by TensorParallelGroup.

    Loads its shard BEFORE joining the process group and reports "ready" (or
    its traceback) through the rendezvous store, so rank 0 can watch it load
    and name the error instead of blocking in init_process_group."""
    store = dist.TCPStore("127.0.0.1", port, spec.world_size, is_master=False,
                          timeout=timedelta(seconds=spec.collective_timeout_s))
    try:
        if spec.device_type == "cpu":       # N processes share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
        device = _device(spec, rank)
        model = load_shard(spec.path, rank, spec.world_size, device, spec.dtype, spec.quantization)
        store.set(f"ready/{rank}", "ok")
        commands = _init_groups(spec, rank, store)
        _worker_loop(model, device, spec.dtype, commands)
    except BaseException:
        try:                                # relay the traceback; rank 0 quotes it
            store.set(f"error/{rank}", traceback.format_exc())
        except Exception:
            pass                            # rank 0 (the store's host) is gone: nobody to tell
        raise


class TensorParallelGroup:
    """Rank 0's handle on a tensor-parallel group: its own shard, the workers, the steps.

    The engine's process is rank 0. Without torchrun, N-1 workers are
    spawned here (torch.multiprocessing, "spawn": CUDA cannot be forked);
    under torchrun (WORLD_SIZE set) every process constructs the group, rank
    0 returns as the engine, and every other rank serves rank 0's steps
    inside this constructor and then exits the process (SystemExit(0))
    when rank 0 closes the group. Rank r uses cuda:r (cuda:LOCAL_RANK
    under torchrun), or the CPU.

        tp = TensorParallelGroup(path, 2, device="cpu", dtype=torch.float32)
        tp.model, tp.config      rank 0's shard and its (per-rank) config
        tp.allocate_cache(num_blocks, block_size)   every rank: its own pool
        logits = tp.forward(input_ids, positions, ctx, copies=[(src, dst)])
        tp.close()               also run at interpreter exit

    A worker that dies makes the next call raise TensorParallelError within
    seconds: its process is checked before every step, and gloo fails a
    collective at once when a peer's connection closes. (NCCL may notice a
    peer that died mid-step only at the collective timeout, when its watchdog
    ends the process; not tried here, on one GPU.) After a failure the group
    is unusable and only close() works.
    """

    def __init__(self, path: str, world_size: int, device="cpu", dtype=torch.float32, quantization=None,
                 collective_timeout_s: float = 120.0, startup_timeout_s: float = 600.0):
        device_type = torch.device(device).type
        self.full_config = read_config(path)
        check_tensor_parallel(self.full_config, world_size, device_type)   # before any process starts
        self.spec = _Spec(path, world_size, device_type, dtype, quantization, collective_timeout_s)
        self.world_size, self.dtype = world_size, dtype
        self.procs, self.store, self.commands, self.cache = [], None, None, None
        self._closed, self._broken, self._owns_group = False, None, True
        if "WORLD_SIZE" in os.environ:
            self._join_torchrun()
            return
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process (is another "
                               "TensorParallelGroup still open? close() it first)")
        # The rendezvous store lives in this process; port 0 = any free port.
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=collective_timeout_s))
        mp = torch.multiprocessing.get_context("spawn")
        self.procs = [mp.Process(target=_spawned_worker, args=(r, self.store.port, self.spec),
                                 name=f"nanoinfer-tp-rank{r}", daemon=True) for r in range(1, world_size)]
        atexit.register(self.close)
        try:
            for p in self.procs:
                p.start()
            self.device = _device(self.spec, 0)
            self.model = load_shard(path, 0, world_size, self.device, dtype, quantization)  # while they load
            self._wait_ready(startup_timeout_s)
            self.commands = _init_groups(self.spec, 0, self.store)
        except BaseException:
            self.close()
            raise

    def _join_torchrun(self):
        """Under torchrun: join the existing group; ranks other than 0 serve and exit."""
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        if int(os.environ["WORLD_SIZE"]) != self.world_size:
            raise ValueError(f"tensor_parallel_size={self.world_size} but torchrun started "
                             f"WORLD_SIZE={os.environ['WORLD_SIZE']} processes")
        self._owns_group = not dist.is_initialized()
        self.device = _device(self.spec, local_rank)
        self.commands = _init_groups(self.spec, rank, None)
        model = load_shard(self.spec.path, rank, self.world_size, self.device, self.dtype, self.spec.quantization)
        if rank != 0:
            _worker_loop(model, self.device, self.dtype, self.commands)
            raise SystemExit(0)            # this process existed to serve rank 0; rank 0 has closed
        self.model = model
        atexit.register(self.close)

    # -- what the engine uses ----------------------------------------------------

    @property
    def config(self) -> ModelConfig:
        """The per-rank config (heads, KV heads, FFN columns over N): size the KV pool with it."""
        return self.model.config

    @property
    def comm(self) -> Collectives:
        """Rank 0's collectives: set comm.timing = True to count and time them (bench.py)."""
        return self.model.tp_comm

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def allocate_cache(self, num_blocks: int, block_size: int = 16, kv_cache_dtype=None):
        """Every rank allocates its own pool of num_blocks blocks for its KV heads.

        The same num_blocks on every rank, so rank 0's block manager addresses
        all pools; sized from kv_cache_bytes(tp.config, dtype), the lecture's
        formula over N, one budget holds N times the tokens."""
        if not isinstance(num_blocks, int) or num_blocks < 1 or kv_cache_dtype not in (None, "int8"):
            raise ValueError(f"need num_blocks >= 1 and kv_cache_dtype None or 'int8', "
                             f"got {num_blocks!r}, {kv_cache_dtype!r}")
        self._send(("alloc", num_blocks, block_size, kv_cache_dtype))
        try:
            self.cache = make_cache(self.config, num_blocks, block_size, kv_cache_dtype, self.device, self.dtype)
            self.comm.all_reduce(torch.zeros(1, device=self.device))        # every worker allocated too
        except BaseException as e:
            self._fail(e)
        return self.cache

    def forward(self, input_ids, positions, ctx=None, copies=()):
        """One step of the model on every rank; returns the logits [rows, V] (rank 0's copy).

        ctx is any attention context with a .cache attribute (cache.py's,
        kernels.py's, or the engine's own): each rank gets a shallow copy
        whose .cache is its own pool. copies are the block manager's pending
        copy-on-write (src, dst) pairs: applied on every rank, rank 0's
        included, before the forward (applying a copy twice is harmless)."""
        return self.run(_forward, input_ids, positions, ctx, copies=copies)

    def run(self, fn, *args, copies=()):
        """Run fn(model, cache, *args) on every rank; return rank 0's result.

        fn must be a module-level function (it is pickled by name), e.g.
        kernels.decode_step; tensors in args travel through CPU memory."""
        copies = [(int(s), int(d)) for s, d in copies]
        self._send(("step", copies, fn, _place(args, "cpu", None)))
        try:
            return _execute(self.model, self.cache, copies, fn, _place(args, self.device, self.cache))
        except BaseException as e:
            self._fail(e)

    # -- failures and shutdown ---------------------------------------------------

    def _send(self, message):
        """Broadcast one command to the workers, after checking that they live."""
        if self._closed or self._broken:
            raise TensorParallelError(self._broken or "the tensor-parallel group is closed")
        if any(not p.is_alive() for p in self.procs):
            self._fail(None)
        try:
            dist.broadcast_object_list([message], src=0, group=self.commands)
        except BaseException as e:
            self._fail(e)

    def _fail(self, error):
        """Mark the group unusable (the ranks are out of step) and raise a clear error."""
        self._broken = (f"tensor-parallel group of {self.world_size} failed "
                        f"({type(error).__name__ if error is not None else 'a worker died'}); "
                        f"{self._describe_workers()}; close() it and start a new one")
        if error is not None and not isinstance(error, Exception):
            raise error                     # KeyboardInterrupt and friends stay what they are
        raise TensorParallelError(self._broken) from error

    def _describe_workers(self) -> str:
        if not self.procs:
            return "see the other ranks' logs (torchrun)"
        states = []
        for rank, p in enumerate(self.procs, start=1):
            if p.pid is None:
                states.append(f"rank {rank} never started")
                continue
            p.join(timeout=0.2)             # a dying worker: give it a moment to be reaped
            code = p.exitcode
            if code is None:
                states.append(f"rank {rank} (pid {p.pid}) alive")
                continue
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            state = f"rank {rank} (pid {p.pid}) died, {how}"
            if self.store is not None and self.store.check([f"error/{rank}"]):
                state += ": " + self.store.get(f"error/{rank}").decode().strip().splitlines()[-1]
            states.append(state)
        return "workers: " + "; ".join(states)

    def _wait_ready(self, timeout_s: float):
        """Wait until every worker has loaded its shard; name the one that failed."""
        deadline = time.monotonic() + timeout_s
        while not self.store.check([f"ready/{r}" for r in range(1, self.world_size)]):
            if any(not p.is_alive() for p in self.procs):   # spawn re-imports the main script:
                raise TensorParallelError(                   # an unguarded one fails in the child
                    f"a tensor-parallel worker failed to start; {self._describe_workers()} (a script "
                    f"that starts workers needs `if __name__ == \"__main__\":` around its main code)")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers not ready after {timeout_s} s; "
                                          f"{self._describe_workers()}")
            time.sleep(0.02)

    def close(self):
        """Stop the workers and leave the process group; no process is left behind."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.commands is not None and not self._broken:
            try:
                dist.broadcast_object_list([("stop",)], src=0, group=self.commands)
            except Exception:
                pass                        # a worker died meanwhile: the loop below ends it
        told = self.commands is not None and not self._broken   # else they may be stuck, or still loading
        for p in self.procs:
            if p.pid is None:               # never started (start() failed earlier): nothing to stop
                continue
            p.join(timeout=10 if told else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            if self._owns_group:
                dist.destroy_process_group()
            elif self.commands is not None:
                dist.destroy_process_group(self.commands)
        self.store = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
