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

while each rank reads only 1/N of the weights and holds 1/N of the KV cache
(split by KV heads: bytes per token per rank = 2 * L * (KV/N) * d * bytes, so
one byte budget per device holds N times the tokens). That is the trade: N
times less memory traffic per device against two all-reduces per layer on
the link. Over NVLink it pays; over PCIe or between machines it often does
not, which is why tensor parallelism stays inside one node.

The vocabulary is split too, by rows: the embedding (an all-reduce fills in
the ids of other ranks' rows) and the LM head (an all-gather assembles the logits).

Place in the data flow: rank 0 is the engine's own process (scheduler, block
manager, sampler, unchanged). N-1 worker processes each load the checkpoint,
keep their slice (shard_model) and their own KV pool for their KV heads:

    rank 0:   TensorParallelGroup.forward(input_ids, positions, ctx, copies)
                -> broadcast (copies, input ids, positions, ctx) to the workers
                -> run its own slice of the model             -- all-reduces --
    rank r:   _worker_loop: receive, apply the copy-on-write copies, run its slice

Every pool has the same number of blocks, so one block table addresses all
of them. torch.distributed only: NCCL on CUDA, gloo on CPU (a laptop runs
it). model.py knows nothing of this: shard_model swaps modules, the way
quantize_model does. Starting and stopping processes: support/workers.py.
"""
import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from cache import kv_cache_bytes
from model import ModelConfig, load_model, read_config
from quantize import Int8Linear, make_kv_cache, quantize_model
from support.workers import (CollectiveCounters, TensorParallelError, WorkerGroup,  # noqa: F401 (re-exported)
                             WorkerSpec, check_world_size, serve_worker)

# ----------------------------------------------------------------------------
# The collectives
# ----------------------------------------------------------------------------

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; torch 2.11 has only the old one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collectives(CollectiveCounters):
    """The two collectives tensor parallelism needs, over one process group.
    (comm.timing = True counts and times each call for bench.py: CollectiveCounters.)"""

    def __init__(self, rank: int, world_size: int, group=None):
        super().__init__()
        self.rank, self.world_size, self.group = rank, world_size, group   # group None: the default group

    def all_reduce(self, x):
        """Elementwise sum over ranks, in place; every rank gets the result."""
        if self.world_size > 1 and self.timing:
            self.timed(x, dist.all_reduce, x, group=self.group)
        elif self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x):
        """[rows, V/N] on each rank -> [rows, V] on every rank (rank r's slice at r*V/N).
        All-gather, not a gather to rank 0: the same bytes reach rank 0, and
        torch.compile traces an all-gather (dynamo refuses dist.gather)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        out = x.new_empty(self.world_size * x.shape[0], *x.shape[1:])            # [N * rows, V/N]
        if self.timing:
            self.timed(x, _all_gather, out, x, group=self.group)
        else:
            _all_gather(out, x, group=self.group)
        rows, cols = x.shape
        return out.view(self.world_size, rows, cols).transpose(0, 1).reshape(rows, self.world_size * cols)


# ----------------------------------------------------------------------------
# The parallel layers: each keeps its slice in an ordinary inner module
# ----------------------------------------------------------------------------
# (an nn.Linear / quantize.Int8Linear / nn.Embedding, so code that swaps those,
# kernels.choose_weight_layout, or counts them, quantize.decode_weight_bytes, still works)


def _narrow_(module: nn.Module, name: str, dim: int, rank: int, world_size: int):
    """Keep rank's 1/world_size of module.<name> along dim, in place: a copy, since a view keeps all alive."""
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
    int8: the per-output-channel scales are sliced with their rows."""

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
    this rank; its product is a partial sum, and an all-reduce adds them up.
    The bias is added once, after the sum. int8: each row's scale was computed
    over the WHOLE row, so every rank keeps all of them, and
    sum_r scale * (x_r q_r^T) = scale * x q^T exactly as unsharded."""

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
    """Rank r owns rows [r*V/N, (r+1)*V/N) of the embedding table. Each rank
    looks up the ids in its slice and gives zeros for the others; exactly one
    rank holds each id, so an all-reduce (a sum with zeros) yields every
    token's row on every rank, bit for bit."""

    def __init__(self, embedding: nn.Embedding, rank: int, world_size: int, comm: Collectives):
        super().__init__()
        _narrow_(embedding, "weight", 0, rank, world_size)       # [V/N, D]
        embedding.num_embeddings //= world_size
        self.embed, self.comm = embedding, comm
        self.start = rank * embedding.num_embeddings
        self.end = self.start + embedding.num_embeddings

    @property
    def weight(self):                                            # the table a tied head shares
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
    logits of its V/N tokens, an all-gather assembles [rows, V]. A tied head
    shares the sliced embedding table: both slice the same rows."""

    def __init__(self, linear, rank: int, world_size: int, comm: Collectives):
        super().__init__(linear, rank, world_size)
        self.comm = comm

    def forward(self, x):                                        # [rows, D]
        return self.comm.all_gather_last_dim(self.linear(x))    # [rows, V/N] -> [rows, V]


# ----------------------------------------------------------------------------
# Sharding a loaded model, and the check that comes first
# ----------------------------------------------------------------------------

def check_tensor_parallel(cfg: ModelConfig, world_size: int, device_type: str = "cpu"):
    """Raise ValueError unless every split is whole: each rank must own whole
    heads, KV heads, FFN columns and vocabulary rows. (vLLM replicates KV heads
    when N > KV heads and pads the vocabulary; nanoinfer refuses, and says which.)"""
    check_world_size(world_size, device_type)      # a positive integer; on CUDA, that many GPUs
    sizes = {"attention heads": cfg.n_heads, "KV heads": cfg.n_kv_heads,
             "FFN width": cfg.ffn_dim, "vocabulary size": cfg.vocab_size}
    bad = [f"{name} {n}" for name, n in sizes.items() if n % world_size]
    if bad:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's attention heads, "
                         f"KV heads, FFN width and vocabulary size; it does not divide: {', '.join(bad)}")


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """One rank's config: its heads, KV heads and FFN columns. dim, layers, head_dim
    and vocab_size stay whole (every rank sees the residual stream, the ids and
    the gathered logits in full). A KV cache built from it holds this rank's KV
    heads, so cache.kv_cache_bytes gives the lecture's formula over N."""
    return dataclasses.replace(cfg, n_heads=cfg.n_heads // world_size,
                               n_kv_heads=cfg.n_kv_heads // world_size, ffn_dim=cfg.ffn_dim // world_size)


def shard_model(model, rank: int, world_size: int, comm: Collectives | None = None):
    """Keep rank's slice of a loaded (optionally quantized) Transformer, in place.

    Quantize BEFORE sharding: row-parallel int8 layers then keep the scales of
    the whole rows, and the sharded model computes what the unsharded int8
    model does. Afterwards the attention modules and model.config hold the
    per-rank head counts, so Attention.forward and the KV cache run unchanged."""
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
    Sliced on the CPU, then moved: a device only ever holds its slice. (A
    production loader reads only its slice of the file: safetensors' get_slice.)"""
    model, _ = load_model(path, device="cpu", dtype=dtype)
    if quantization is not None:
        quantize_model(model, quantization)
    return shard_model(model, rank, world_size).to(device)


# ----------------------------------------------------------------------------
# The lecture's arithmetic, for models too big to run here (bench.py)
# ----------------------------------------------------------------------------
# Link bandwidths in bytes per second ONE way (a ring all-reduce sends and receives at once):
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
    """The module docstring's arithmetic for one step of `tokens` tokens on N ranks.
    allreduce_seconds is a lower bound: each of the 2L calls also pays a fixed
    latency, which dominates at small batch (bench.py measures it). Not
    counted: the embedding's all-reduce (one more [tokens, D]) and the logits all-gather."""
    check_tensor_parallel(cfg, world_size)         # e.g. 8 KV heads do not split 16 ways
    b = torch.finfo(dtype).bits // 8
    payload = 2 * cfg.n_layers * tokens * cfg.dim * b                        # two [tokens, D] per layer
    ring = 2 * (world_size - 1) / world_size * payload                       # reduce-scatter + all-gather
    weights = weight_bytes_per_rank(cfg, world_size, b)
    return {"world_size": world_size, "tokens": tokens, "bytes_per_value": b, "weight_bytes_per_rank": weights,
            "kv_bytes_per_token_per_rank": kv_cache_bytes(shard_config(cfg, world_size), dtype),
            "allreduce_calls": 2 * cfg.n_layers, "allreduce_bytes": payload, "ring_bytes_per_rank": ring,
            "allreduce_seconds": ring / link_bytes_per_s,
            "weight_read_seconds": weights / hbm_bytes_per_s}   # the decode step's memory bound per rank


# ----------------------------------------------------------------------------
# One step on every rank: rank 0 sends it, each worker's loop runs it
# ----------------------------------------------------------------------------

def _place(obj, device, cache):
    """obj with its tensors on `device` and any attention context's .cache set to `cache`:
    walks tensors, lists, tuples, dicts, dataclasses and objects with a .cache (the
    context: a shallow copy, the caller's is unchanged). Rank 0 sends
    _place(args, "cpu", None); a worker runs _place(args, its device, its pool)."""
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
    A step arrives as one pickled object (dist.broadcast_object_list); vLLM
    avoids the pickling with a shared-memory ring buffer for the metadata."""
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
    dist.destroy_process_group()


def worker_main():
    """A worker process: its own interpreter, started by support/workers.py as
    `python -c "import parallel; parallel.worker_main()"` with its rank and rank 0's
    address in its environment (as torchrun does). Nothing re-imports the user's
    script, so it needs no `if __name__ == "__main__":` guard."""
    serve_worker(load_shard, _worker_loop)


class TensorParallelGroup(WorkerGroup):
    """Rank 0's handle on N ranks: tp.model (its shard), tp.config (per rank),
    tp.allocate_cache, tp.forward, tp.close() (also run at interpreter exit).

    What a step does is here. The processes (start the workers or join
    torchrun's group, watch them, name a failure, stop them) are
    WorkerGroup's, in support/workers.py. After a failure only close() works."""

    def __init__(self, path: str, world_size: int, device="cpu", dtype=torch.float32, quantization=None,
                 collective_timeout_s: float = 120.0, startup_timeout_s: float = 600.0):
        device_type = torch.device(device).type
        self.full_config, self.cache = read_config(path), None
        check_tensor_parallel(self.full_config, world_size, device_type)   # before any process starts
        spec = WorkerSpec(path, world_size, device_type, dtype, quantization, collective_timeout_s)
        super().__init__(spec, load_shard, _worker_loop, "import parallel; parallel.worker_main()",
                         startup_timeout_s)

    def allocate_cache(self, num_blocks: int, block_size: int = 16, kv_cache_dtype=None):
        """Every rank allocates a pool of num_blocks blocks for its KV heads: the same
        number everywhere, so rank 0's block manager addresses all pools."""
        if not isinstance(num_blocks, int) or num_blocks < 1 or kv_cache_dtype not in (None, "int8"):
            raise ValueError(f"need num_blocks >= 1 and kv_cache_dtype None or 'int8', "
                             f"got {num_blocks!r}, {kv_cache_dtype!r}")
        self._send(("alloc", num_blocks, block_size, kv_cache_dtype))
        try:
            self.cache = make_kv_cache(self.config, num_blocks, block_size, kv_cache_dtype, self.device, self.dtype)
            self.comm.all_reduce(torch.zeros(1, device=self.device))        # every worker allocated too
        except BaseException as e:
            self.fail(e)
        return self.cache

    def forward(self, input_ids, positions, ctx=None, copies=()):
        """One step on every rank; returns the logits [rows, V] (rank 0's copy).
        ctx: any attention context with a .cache; each rank runs a shallow copy
        holding its own pool. copies: the block manager's pending copy-on-write
        (src, dst) pairs, applied on every rank (twice on rank 0 is harmless)."""
        return self.run(_forward, input_ids, positions, ctx, copies=copies)

    def run(self, fn, *args, copies=()):
        """fn(model, cache, *args) on every rank; returns rank 0's result. fn is
        pickled by name: a module-level function of an importable module."""
        copies = [(int(s), int(d)) for s, d in copies]
        self._send(("step", copies, fn, _place(args, "cpu", None)))
        try:
            return _execute(self.model, self.cache, copies, fn, _place(args, self.device, self.cache))
        except BaseException as e:
            self.fail(e)

    def _send(self, message):
        """Broadcast one command, after checking that every worker lives (poll()
        asks the OS without waiting; gloo also fails a collective at once when a
        peer's connection closes, NCCL only at its timeout)."""
        if self.closed or self.broken or any(p.poll() is not None for p in self.procs):
            self.fail(None)                 # raises TensorParallelError, naming each worker's state
        try:
            dist.broadcast_object_list([message], src=0, group=self.commands)
        except BaseException as e:
            self.fail(e)
