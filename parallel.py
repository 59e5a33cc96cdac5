"""
parallel.py -- tensor parallelism: one model across several devices.

The lesson: when one device is too small or too slow for a model, split EVERY layer
across N devices (Megatron-LM) rather than giving each device a few whole layers.
A linear y = x W^T splits two ways, and a transformer layer is one of each, back to back:

    column-parallel (q, k, v, gate, up): rank r owns some OUTPUT features (rows of W),
        its own heads / FFN columns: from the full x, its slice of y; no communication.
    row-parallel (o, down): rank r owns the matching INPUT features (columns of W):
        its product is a partial sum, and an ALL-REDUCE adds them up.

    x [T, D] (same on every rank)
      -> q, k, v  column-parallel      [T, (H/N) d], [T, (KV/N) d]   heads are independent,
      -> attention over own KV heads   [T, (H/N) d]                  so attention needs no talk
      -> o        row-parallel         [T, D] partial  -> all-reduce #1
      -> gate, up column-parallel      [T, F/N]                      silu(g)*u is elementwise
      -> down     row-parallel         [T, D] partial  -> all-reduce #2

So TWO all-reduces of a [tokens, D] activation per layer (the vocabulary is split
too: VocabParallelEmbedding and VocabParallelHead). Per step:

    all-reduce payload = 2 * layers * tokens * dim * bytes_per_value
    ring all-reduce:     each rank sends (and receives) 2 (N-1)/N of it
    communication time ~ 2 (N-1)/N * payload / link bandwidth   (+ a latency per call)

against N times less memory traffic per device: each rank reads 1/N of the weights
and holds 1/N of the KV cache (its KV heads: 2 * L * (KV/N) * d * bytes per token).
Over NVLink it pays; over PCIe or between machines it often does not, so tensor
parallelism stays inside one node.

Place in the data flow: rank 0 is the engine's own process (scheduler, block manager, sampler
unchanged); TensorParallelGroup.forward broadcasts each step (copy-on-write copies, ids,
positions, ctx) to N-1 workers (_worker_loop), and every rank runs its slice over its own KV
pool of as many blocks, so one block table addresses them all. model.py knows nothing of this
(shard_model swaps modules, as quantize_model does); the processes (NCCL on CUDA, gloo on CPU)
are support/workers.py's.
"""
import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from cache import kv_cache_bytes
from model import ModelConfig, load_model, read_config
from quantize import Int8Linear, make_kv_cache, quantize_model
from support.checks import check_kv_pool_args, check_shardable, check_tensor_parallel
from support.workers import CollectiveCounters, TensorParallelError, WorkerGroup  # noqa: F401
from support.workers import WorkerSpec

# --- The collectives ----------------------------------------------------------
# torch 2.13 renamed all_gather_into_tensor to all_gather_single; torch 2.11 has only the old one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collectives(CollectiveCounters):
    """The two collectives tensor parallelism needs, over one process group
    (None: the default one). comm.timing = True times each call for bench.py."""

    def __init__(self, rank: int, world_size: int, group=None):
        super().__init__()
        self.rank, self.world_size, self.group = rank, world_size, group

    def _call(self, x, fn, *args):
        return (self.timed(x, fn, *args, group=self.group) if self.timing
                else fn(*args, group=self.group))

    def all_reduce(self, x):
        """Elementwise sum over ranks, in place; every rank gets the result."""
        if self.world_size > 1:
            self._call(x, dist.all_reduce, x)
        return x

    def all_gather_last_dim(self, x):
        """[rows, V/N] on each rank -> [rows, V] on every rank (rank r's slice at r*V/N).
        Not a gather to rank 0: the same bytes, and dynamo traces an all-gather, not a gather."""
        if self.world_size == 1:
            return x
        x, N, (rows, cols) = x.contiguous(), self.world_size, x.shape
        out = x.new_empty(N * rows, cols)                                         # [N * rows, V/N]
        self._call(x, _all_gather, out, x)
        return out.view(N, rows, cols).transpose(0, 1).reshape(rows, N * cols)  # [rows, N, V/N]


# --- The parallel layers: each keeps its slice in an inner nn.Linear / Int8Linear / nn.Embedding,
# so code that walks those still works (timing.choose_weight_layout, quantize.decode_weight_bytes).

def _narrow_(module: nn.Module, name: str, dim: int, rank: int, world_size: int, parts=None):
    """Keep rank's 1/world_size of module.<name> along dim, in place: a copy, since a view
    keeps the whole tensor alive. parts (a stacked linear's row counts, model.FUSED): rank's
    1/world_size of EACH part (its q heads, k heads and v heads), stacked again."""
    t = getattr(module, name)
    pieces = t.detach().split(parts or [t.shape[dim]], dim)
    piece = torch.cat([p.narrow(dim, rank * p.shape[dim] // world_size, p.shape[dim] // world_size)
                       for p in pieces], dim)
    if isinstance(t, nn.Parameter):
        piece = nn.Parameter(piece, requires_grad=False)
    setattr(module, name, piece)


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T: rank r owns output features [r*out/N, (r+1)*out/N) (int8: with their
    scales); the output [T, out/N] stays split, as the next op works on whole heads or columns."""

    def __init__(self, linear, rank: int, world_size: int, comm: Collectives | None = None,
                 parts: list[int] | None = None):
        """Keep rank r's slice of the output rows of weight, bias and int8 scale (_narrow_; a
        stacked linear: of each part); out_features becomes out / N."""
        super().__init__()
        check_shardable(linear, (nn.Linear, Int8Linear))        # once, right after loading
        # assignment: tensor-parallel
        for name in ("weight", "bias", "scale"):                 # W [out, in], b [out], scale [out]
            if getattr(linear, name, None) is not None:
                _narrow_(linear, name, 0, rank, world_size, parts)   # stacked: each part's slice
        linear.out_features //= world_size
        # end assignment
        self.linear, self.comm = linear, comm     # [out/N, in]; comm: the head's all-gather

    def forward(self, x):                                        # [T, in] -> [T, out/N]
        return self.linear(x)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b: rank r owns input features [r*in/N, (r+1)*in/N), the bias is
    added once, after the all-reduce. int8: a row's scale covers the WHOLE row, so every rank
    keeps all of them: sum_r scale * (x_r q_r^T) = scale * x q^T, exactly as unsharded."""

    def __init__(self, linear, rank: int, world_size: int, comm: Collectives):
        """Keep rank r's slice of the weight's input columns; in_features becomes in / N; the
        bias moves to the buffer `bias`, added once after the all-reduce (linear.bias: None)."""
        super().__init__()
        check_shardable(linear, (nn.Linear, Int8Linear))        # once, right after loading
        # assignment: tensor-parallel
        _narrow_(linear, "weight", 1, rank, world_size)          # W [out, in/N]
        linear.in_features //= world_size
        bias = linear.bias
        linear.bias = None
        self.register_buffer("bias", None if bias is None else bias.detach())
        # end assignment
        self.linear, self.comm = linear, comm

    def forward(self, x):                                        # [T, in/N]
        """Every rank's partial product, summed by comm.all_reduce, then + bias: [T, out]."""
        # assignment: tensor-parallel
        y = self.comm.all_reduce(self.linear(x))                 # [T, out]: partial sums -> the sum
        return y if self.bias is None else y + self.bias
        # end assignment


class VocabParallelEmbedding(nn.Module):
    """Rank r owns rows [r*V/N, (r+1)*V/N) and gives zeros for other ids; exactly one rank
    holds each id, so an all-reduce (a sum with zeros) yields every row, bit for bit."""

    def __init__(self, embedding: nn.Embedding, rank: int, world_size: int, comm: Collectives):
        super().__init__()
        _narrow_(embedding, "weight", 0, rank, world_size)       # [V/N, D]
        embedding.num_embeddings //= world_size
        self.embed, self.comm = embedding, comm
        self.start = rank * embedding.num_embeddings             # its ids: [start, end)
        self.end = self.start + embedding.num_embeddings

    weight = property(lambda self: self.embed.weight)            # the table a tied head shares

    def forward(self, ids):                                      # [T] -> [T, D]
        """Its rows for the ids in [start, end), zeros for the others, summed over ranks."""
        # assignment: tensor-parallel
        mine = (ids >= self.start) & (ids < self.end)            # [T] ids this rank holds
        x = self.embed(torch.where(mine, ids - self.start, 0))   # others' ids read row 0 ...
        x = x.masked_fill(~mine[:, None], 0)                     # ... and are zeroed
        return self.comm.all_reduce(x)
        # end assignment


class VocabParallelHead(ColumnParallelLinear):
    """The LM head, column-parallel over the vocabulary (a tied head shares the sliced
    embedding table): rank r computes its V/N logits, an all-gather assembles [rows, V]."""

    def forward(self, x):                                        # [rows, D]
        return self.comm.all_gather_last_dim(self.linear(x))    # [rows, V/N] -> [rows, V]


# --- Sharding a loaded model ------------------------------------------------------
# Every rank must own whole heads, KV heads, FFN columns and vocabulary rows (vLLM replicates KV
# heads and pads the vocabulary; support/checks.py's check_tensor_parallel refuses instead).

def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """One rank's config (and KV cache shape): its heads, KV heads and FFN columns; dim,
    layers, head_dim and vocab_size stay whole, as every rank sees [T, D], ids and logits."""
    return dataclasses.replace(cfg, n_heads=cfg.n_heads // world_size,
                               n_kv_heads=cfg.n_kv_heads // world_size,
                               ffn_dim=cfg.ffn_dim // world_size)


def shard_model(model, rank: int, world_size: int, comm: Collectives | None = None):
    """Keep rank's slice of a loaded Transformer, in place (quantize BEFORE: whole-row
    scales). The attention modules and model.config then hold the per-rank head counts,
    so Attention.forward and the KV cache run unchanged."""
    cfg = model.config
    check_tensor_parallel(cfg, world_size)
    comm = comm or Collectives(rank, world_size)
    tied = model.lm_head.weight is model.embed_tokens.weight
    for block in model.layers:
        a, m = block.self_attn, block.mlp
        qkv = [a.n_heads * a.head_dim] + [a.n_kv_heads * a.head_dim] * 2 * a.writes_kv   # q, k, v
        a.qkv_proj = ColumnParallelLinear(a.qkv_proj, rank, world_size, parts=qkv)
        a.o_proj = RowParallelLinear(a.o_proj, rank, world_size, comm)       # all-reduce #1
        a.n_heads, a.n_kv_heads = a.n_heads // world_size, a.n_kv_heads // world_size
        m.gate_up_proj = ColumnParallelLinear(m.gate_up_proj, rank, world_size,   # its gate and
                                              parts=[cfg.ffn_dim] * 2)            # up columns
        m.down_proj = RowParallelLinear(m.down_proj, rank, world_size, comm) # all-reduce #2
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, rank, world_size, comm)
    model.lm_head = VocabParallelHead(model.lm_head, rank, world_size, comm)
    if tied:          # one table: the head sliced the same rows; keep a single copy of them
        model.lm_head.linear.weight = model.embed_tokens.weight
    model.full_config, model.config, model.tp_comm = cfg, shard_config(cfg, world_size), comm
    return model


def load_shard(path: str, rank: int, world_size: int, device, dtype, quantization=None):
    """load_model -> quantize_model -> shard_model -> to(device): sliced on the CPU, so a device
    holds only its slice (a production loader reads only its slice: safetensors' get_slice)."""
    model, _ = load_model(path, device="cpu", dtype=dtype)
    if quantization is not None:
        quantize_model(model, quantization)
    return shard_model(model, rank, world_size).to(device)


# --- The lecture's arithmetic, for models too big to run here (bench.py) ------------
# Link bandwidths in bytes per second ONE way (a ring all-reduce sends and receives at once):
NVLINK_H100_SXM = 450e9   # NVIDIA H100 SXM datasheet: NVLink 900 GB/s, both directions together
PCIE_GEN5_X16 = 64e9      # PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b coding = 63 GB/s each way
HBM_H100_SXM = 3.35e12    # NVIDIA H100 SXM datasheet: HBM3 3.35 TB/s (to read the weights)


def weight_bytes_per_rank(cfg: ModelConfig, world_size: int, bytes_per_value: int) -> int:
    """Bytes of weights one rank holds: matrices split N ways, norms and o biases replicated."""
    D, L, H, KV, d, F_, V = (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                             cfg.head_dim, cfg.ffn_dim, cfg.vocab_size)
    split = L * (D * H * d + 2 * D * KV * d + H * d * D + 3 * D * F_)   # q, k, v, o, gate, up, down
    split += V * D * (1 if cfg.tie_embeddings else 2)                        # embedding (+ head)
    replicated = L * 2 * D + D                                               # RMSNorm weights
    if cfg.attention_bias:
        split += L * (H + 2 * KV) * d                                        # q, k, v biases
        replicated += L * D                                                  # o bias: after the sum
    return (split // world_size + replicated) * bytes_per_value


def tensor_parallel_cost(cfg: ModelConfig, world_size: int, tokens: int, dtype=torch.bfloat16,
                         link_bytes_per_s: float = NVLINK_H100_SXM,
                         hbm_bytes_per_s: float = HBM_H100_SXM) -> dict:
    """The module docstring's arithmetic for one step of `tokens` tokens on N ranks.
    allreduce_seconds is a lower bound (each of the 2L calls also pays a latency,
    which dominates at small batch); weight_read_seconds the decode step's memory bound."""
    check_tensor_parallel(cfg, world_size)         # e.g. 8 KV heads do not split 16 ways
    b = torch.finfo(dtype).bits // 8
    payload = 2 * cfg.n_layers * tokens * cfg.dim * b               # two [tokens, D] per layer
    ring = 2 * (world_size - 1) / world_size * payload              # reduce-scatter + all-gather
    weights = weight_bytes_per_rank(cfg, world_size, b)
    return {"world_size": world_size, "tokens": tokens, "bytes_per_value": b,
            "weight_bytes_per_rank": weights,
            "kv_bytes_per_token_per_rank": kv_cache_bytes(shard_config(cfg, world_size), dtype),
            "allreduce_calls": 2 * cfg.n_layers, "allreduce_bytes": payload,
            "ring_bytes_per_rank": ring, "allreduce_seconds": ring / link_bytes_per_s,
            "weight_read_seconds": weights / hbm_bytes_per_s}


# --- One step on every rank: rank 0 sends it, each worker's loop runs it -----------

def _place(obj, device, cache):
    """A copy of obj (tensors, lists, tuples, dicts, contexts, dataclasses) with its tensors on
    `device` and a context's .cache set to `cache` (rank 0 sends it on "cpu", without one)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if type(obj) in (list, tuple):
        return type(obj)(_place(x, device, cache) for x in obj)
    if type(obj) is dict:
        return {k: _place(v, device, cache) for k, v in obj.items()}
    if hasattr(obj, "cache") or dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        vars(new).update({k: cache if k == "cache" else _place(v, device, cache)
                          for k, v in vars(obj).items()})
        return new
    return obj


def _forward(model, cache, input_ids, positions, ctx):      # the step: every rank, its slice
    return model(input_ids, positions, ctx)


@torch.inference_mode()
def _execute(model, cache, copies, fn, args):
    for src, dst in copies:                 # copy-on-write first, on every rank's pool
        cache.copy_block(src, dst)
    return fn(model, cache, *args)


def _worker_loop(model, device, dtype, commands):
    """Rank r >= 1: run rank 0's commands until "stop" (pickled; vLLM uses shared memory)."""
    cache = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=commands)
        kind, *payload = box[0]
        if kind == "stop":
            break
        if kind == "alloc":                 # (num_blocks, block_size, kv_cache_dtype)
            cache = make_kv_cache(model.config, *payload, device, dtype)
            model.tp_comm.all_reduce(torch.zeros(1, device=device))   # tell rank 0 it worked
        else:                               # "step": (copies, fn, args)
            copies, fn, args = payload
            _execute(model, cache, copies, fn, _place(args, device, cache))


class TensorParallelGroup(WorkerGroup):
    """Rank 0's handle on N ranks: tp.model (its shard), tp.config (per rank), allocate_cache,
    forward, close(). The processes are WorkerGroup's; after a failure only close() works."""

    def __init__(self, path: str, world_size: int, device="cpu", dtype=torch.float32,
                 quantization=None, collective_timeout_s: float = 120.0,
                 startup_timeout_s: float = 600.0):
        device_type = torch.device(device).type
        self.full_config, self.cache = read_config(path), None
        # before any process: whole heads per rank, float or int8 weights
        check_tensor_parallel(self.full_config, world_size, device_type, quantization)
        spec = WorkerSpec(path, world_size, device_type, dtype, quantization, collective_timeout_s)
        super().__init__(spec, load_shard, _worker_loop, startup_timeout_s)

    def allocate_cache(self, num_blocks: int, block_size: int = 16, kv_cache_dtype=None):
        """Every rank allocates num_blocks blocks for its KV heads (one block manager for all)."""
        check_kv_pool_args(num_blocks, kv_cache_dtype)
        self._send(("alloc", num_blocks, block_size, kv_cache_dtype))
        try:
            self.cache = make_kv_cache(self.config, num_blocks, block_size, kv_cache_dtype,
                                       self.device, self.dtype)
            self.comm.all_reduce(torch.zeros(1, device=self.device))   # every worker allocated too
        except BaseException as e:
            self.fail(e)
        return self.cache

    def forward(self, input_ids, positions, ctx=None, copies=()):
        """One step on every rank -> logits [rows, V], after the pending copy-on-write (src, dst)
        copies (twice on rank 0: harmless); each rank's copy of ctx holds its own pool."""
        return self.run(_forward, input_ids, positions, ctx, copies=copies)

    def run(self, fn, *args, copies=()):
        """fn(model, cache, *args) on every rank -> rank 0's result (fn: module-level)."""
        copies = [(int(s), int(d)) for s, d in copies]
        self._send(("step", copies, fn, _place(args, "cpu", None)))
        try:
            args = _place(args, self.device, self.cache)
            return _execute(self.model, self.cache, copies, fn, args)
        except BaseException as e:
            self.fail(e)

    def _send(self, message):
        """Broadcast one command, after checking that every worker lives (poll() does
        not wait; gloo fails at once when a peer dies, NCCL only at its timeout)."""
        if self.closed or self.broken or any(p.poll() is not None for p in self.procs):
            self.fail(None)                 # raises TensorParallelError, naming each worker's state
        try:
            dist.broadcast_object_list([message], src=0, group=self.commands)
        except BaseException as e:
            self.fail(e)
