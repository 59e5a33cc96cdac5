"""
model.py -- a Llama-style decoder, written as the pure architecture.

The lesson: a modern decoder-only LLM is a short stack of simple pieces.

    token ids --embed--> x [N, D]
    repeat L times:
        x = x + Attention(RMSNorm(x))      # grouped-query attention with RoPE (Mistral: windowed)
        x = x + MLP(RMSNorm(x))            # SwiGLU feed-forward
    logits = LMHead(RMSNorm(x))            # [N, vocab]

Place in the data flow: the engine calls Transformer.forward(input_ids[N], positions[N], ctx)
on the new tokens of all running sequences, flattened. All but attention is per token, so it
runs on the flat [N, D] tensor, whatever sequence a token belongs to ("selective batching").
Attention mixes tokens of one sequence only, through `ctx.attend(layer, q, k, v)`: cache.py's
context writes k, v into the paged KV cache and attends over it. ctx=None: the dense causal
path over ONE sequence, no cache, the reference every faster path is tested against.

load_model(path) at the bottom reads a Hugging Face checkpoint directory or "random:<preset>"
(published shapes, seeded random weights) through support/; this file imports no tour file.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from support import checkpoint, checks
from support.default_model import default_model_path  # noqa: F401 (re-exported)


@dataclass
class ModelConfig:
    """The handful of numbers that define a Llama-family model."""
    dim: int = 576                  # hidden size D
    n_layers: int = 30              # L
    n_heads: int = 9                # query heads H
    n_kv_heads: int = 3             # key/value heads (GQA: H // n_kv_heads query heads share one)
    head_dim: int = 64              # d, usually D // H
    ffn_dim: int = 1536             # SwiGLU hidden size
    vocab_size: int = 49152
    rope_theta: float = 100000.0
    rope_scaling: dict | None = None  # Llama-3.1 style {"rope_type": "llama3", ...} or None
    rms_eps: float = 1e-5
    tie_embeddings: bool = True     # LM head shares the embedding matrix
    max_seq_len: int = 8192         # max_position_embeddings
    attention_bias: bool = False    # a few Llama variants put a bias on q/k/v/o
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    random_seed: int | None = None  # set by "random:" presets: the weights are random, not trained
    sliding_window: int | None = None  # Mistral's W: a query sees its last W positions (None: all)
    cla_share: int = 1              # cross-layer attention: S consecutive layers share one K/V
    global_every: int = 0           # local + global: every N-th layer full, the others windowed
    # Multi-head latent attention (DeepSeek-V2; LatentAttention), on when kv_lora_rank > 0.
    # Hugging Face's names; head_dim is then qk_rope_head_dim (what RoPE rotates), n_kv_heads 1.
    kv_lora_rank: int = 0           # r: the latent each token's K and V are made from
    qk_rope_head_dim: int = 0       # R: the RoPE part of each query head and of the ONE shared key
    qk_nope_head_dim: int = 0       # each query/key head's part without RoPE
    v_head_dim: int = 0             # each value head
    q_lora_rank: int | None = None  # queries through a low-rank bottleneck too (None: q_proj)

    @property
    def kv_layers(self) -> int:
        """Layers whose K/V the cache holds for a token's whole life: one per group of cla_share
        (CLA); with local + global layers only the global ones (cache.HybridCache keeps the local
        ones' last W tokens apart); else every layer."""
        L = self.n_layers                       # (global layers: L // N; CLA: ceil(L / S))
        return L // self.global_every if self.global_every else -(-L // self.cla_share)

    def window_of(self, layer_idx: int) -> int | None:
        """The window layer `layer_idx` attends within: global_every = N makes every N-th layer
        global (Gemma's (i + 1) % N == 0: it sees every position), the rest local (the last W)."""
        is_global = self.global_every and (layer_idx + 1) % self.global_every == 0
        return None if is_global else self.sliding_window

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """From a config.json dict, each field type- and range-checked (support/checkpoint.py)."""
        return cls(**checkpoint.config_fields(hf))


# --- The building blocks -------------------------------------------------------

class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps): LayerNorm without mean-centering or bias.
    In float32 (a bfloat16 mean of squares loses too much), cast back before the
    weight multiply: Hugging Face's order, so bf16 results match bit for bit."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        """x [..., D] -> the same shape and dtype (the order above)."""
        # assignment: rmsnorm-rope
        dtype, x = x.dtype, x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
        # end assignment


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/d) for i < d/2: one rotation speed per pair of dims.
    Llama 3.1's long-context "llama3" scaling slows the low frequencies down
    (divides them by `factor`), keeps the high ones, and blends in between."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is not None:
        # assignment: rmsnorm-rope
        factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv_freq = torch.where(medium, blended, scaled)
        # end assignment
    return inv_freq


def apply_rope(x, cos, sin):
    """Rotate each pair (x[i], x[i + d/2]) by the angle position * inv_freq[i] (Hugging Face's
    "rotate half" pairing, not GGUF's interleaved one). x: [N, heads, d]; cos, sin: [N, 1, d/2].
    The point: <rope(q, m), rope(k, n)> depends only on m - n: attention sees relative positions."""
    # assignment: rmsnorm-rope
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    # end assignment


def apply_rope_pairs(x, cos, sin):
    """apply_rope with DeepSeek's pairing: (x[2i], x[2i+1]) rotate together (Hugging Face's
    complex multiply): the same rotations, of other pairs of dims. So: evens, then odds, rotate
    as halves, interleave back."""
    d = x.shape[-1]
    halves = x.unflatten(-1, (d // 2, 2)).transpose(-1, -2).flatten(-2)      # [x0 x2 .. x1 x3 ..]
    return apply_rope(halves, cos, sin).unflatten(-1, (2, d // 2)).transpose(-1, -2).flatten(-2)


def in_window(q_pos, k_pos, window: int):
    """Sliding window (Mistral, Hugging Face's mask): the query at position q sees key position k
    iff q - W < k, its last W positions. q_pos [n_q], k_pos [T] -> [n_q, T] bool (not causal)."""
    # assignment: sliding-window
    return k_pos[None, :] > q_pos[:, None] - window
    # end assignment


def dense_causal_attention(q, k, v, window: int | None = None, scale: float | None = None):
    """Plain causal softmax attention over one sequence (a window: in_window too). q: [N, H, d],
    k: [N, n_kv, d], v: [N, n_kv, dv] -> [N, H, dv]; scores times scale (None: 1/sqrt(d)). GQA by
    grouping: the H query heads are n_kv groups of G = H // n_kv heads sharing one K/V head;
    reshape q, never copy k/v (what GQA avoids)."""
    # assignment: gqa-attention
    (N, H, d), n_kv = q.shape, k.shape[1]
    qg = q.view(N, n_kv, H // n_kv, d)                               # [N, n_kv, G, d]
    scale = d ** -0.5 if scale is None else scale          # 1/sqrt(d): scores of unit variance
    scores = torch.einsum("qhgd,khd->hgqk", qg.float(), k.float()) * scale   # [n_kv, G, N, N]
    causal = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
    if window:                                                      # and only the last W: j > i - W
        causal &= in_window(torch.arange(N, device=q.device), torch.arange(N, device=q.device),
                            window)
    scores = scores.masked_fill(~causal, float("-inf"))             # token i sees j <= i
    probs = scores.softmax(dim=-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())           # [N, n_kv, G, dv]
    return out.reshape(N, H, -1).to(q.dtype)
    # end assignment


class Attention(nn.Module):
    """Grouped-query attention: H query heads, n_kv key/value heads. The KV cache
    scales with n_kv, not H: SmolLM2's 9 query heads over 3 KV heads, a 3x smaller cache.
    q, k and v read the same x: ONE linear of their stacked rows, [(H + 2 n_kv) d, D] (vLLM's
    QKVParallelLinear, gpt-fast's wqkv). A decode step streams one wide weight instead of three,
    two of them narrow (k, v: n_kv d rows, too few to keep a GPU's memory busy).
    Cross-layer attention (CLA, cla_share = S): only the first layer of each S computes K and V;
    the next S - 1 attend to ITS cache layer (kv_layer) and have no k, v rows: the cache holds
    L / S layers, S times fewer bytes per token."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.window = layer_idx, cfg.window_of(layer_idx)   # Mistral's W or None
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.kv_layer = layer_idx // cfg.cla_share                   # the cache layer it reads
        self.writes_kv = layer_idx % cfg.cla_share == 0              # CLA: the group's first
        b = cfg.attention_bias
        # Hugging Face's q_proj, k_proj, v_proj, stacked at load (FUSED below); CLA: q alone
        rows = (cfg.n_heads + 2 * cfg.n_kv_heads * self.writes_kv) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.dim, rows, bias=b)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=b)

    def forward(self, x, cos, sin, ctx):
        N, H, KV, d = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        if self.writes_kv:
            q, k, v = self.qkv_proj(x).split([H * d, KV * d, KV * d], dim=-1)
            k, v = apply_rope(k.view(N, KV, d), cos, sin), v.view(N, KV, d)   # [N, n_kv, d]
        else:                                   # CLA: K, V are the group's first layer's
            q, k, v = self.qkv_proj(x), None, None
        q = apply_rope(q.view(N, H, d), cos, sin)                        # [N, H, d]
        # no cache: one sequence, dense; else the paged KV cache (cache.py; k None: read only)
        out = (dense_causal_attention(q, k, v, self.window) if ctx is None
               else ctx.attend(self.kv_layer, q, k, v))
        return self.o_proj(out.reshape(N, H * d))


class LatentAttention(nn.Module):
    """Multi-head latent attention (MLA, DeepSeek-V2). Every head's K and V are made from ONE
    latent c = norm(W_DKV x) of r values (r = 512), plus ONE RoPE key k_R of R values (64)
    that all heads share. The cache holds c and k_R: r + R = 576 values per token and layer,
    against MHA's 2 H d = 8,192 at 32 heads of 128 (14x fewer; GQA-8: 2,048). Head h's
        k_h = [W_UK,h c ; k_R],   v_h = W_UV,h c       (W_UK,h, W_UV,h: head h's rows of kv_b_proj)
    Why RoPE stays apart: a rotation between W_UK and c depends on the position, so W_UK could
    not be folded into the query (absorbed, below); only k_R rotates, and c is position-free.
    The dense path (ctx None) expands K, V per head: the reference. The paged path never does."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.window, self.n_heads = layer_idx, cfg.sliding_window, cfg.n_heads
        self.kv_layer, self.writes_kv = layer_idx, True       # (no CLA with MLA: support/checks)
        H, D, b, self.q_lora = cfg.n_heads, cfg.dim, cfg.attention_bias, cfg.q_lora_rank
        self.r, self.R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.nope, self.dv = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.scale = (self.nope + self.R) ** -0.5       # the heads' own width, not the latent's
        q_rows = H * (self.nope + self.R)
        if self.q_lora is None:
            self.q_proj = nn.Linear(D, q_rows, bias=False)
        else:                                 # DeepSeek-V2 (not Lite): a low-rank query too
            self.q_a_proj = nn.Linear(D, self.q_lora, bias=b)
            self.q_a_layernorm = RMSNorm(self.q_lora, 1e-6)     # Hugging Face: eps 1e-6, always
            self.q_b_proj = nn.Linear(self.q_lora, q_rows, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.r + self.R, bias=b)       # W_DKV and W_KR
        self.kv_a_layernorm = RMSNorm(self.r, 1e-6)
        self.kv_b_proj = nn.Linear(self.r, H * (self.nope + self.dv), bias=False)  # [W_UK; W_UV]
        self.o_proj = nn.Linear(H * self.dv, D, bias=b)

    def forward(self, x, cos, sin, ctx):
        N, H = x.shape[0], self.n_heads
        q = self.q_proj(x) if self.q_lora is None else \
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(N, H, -1).split([self.nope, self.R], dim=-1)   # [N, H, nope], R
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.r, self.R], dim=-1)  # [N, r], [N, R]
        c = self.kv_a_layernorm(c)
        q_rope = apply_rope_pairs(q_rope, cos, sin)                            # [N, H, R]
        k_rope = apply_rope_pairs(k_rope[:, None], cos, sin)                   # [N, 1, R]
        if ctx is None:                     # naive: K, V for every head, then plain attention
            k_nope, v = self.kv_b_proj(c).view(N, H, -1).split([self.nope, self.dv], dim=-1)
            k = torch.cat([k_nope, k_rope.expand(N, H, self.R)], dim=-1)      # [N, H, nope + R]
            out = dense_causal_attention(torch.cat([q_nope, q_rope], dim=-1), k, v, self.window,
                                         self.scale)                           # [N, H, dv]
        else:
            out = self.absorbed(q_nope, q_rope, c, k_rope, ctx)
        return self.o_proj(out.reshape(N, H * self.dv))

    def absorbed(self, q_nope, q_rope, c, k_rope, ctx):
        """Attention over the paged latents, never expanded (DeepSeek's "absorb"):
            q_h . k_h,t = (W_UK,h^T q_h) . c_t + q_R,h . k_R,t       (W_UK folded into the query)
            sum_t p_t v_h,t = W_UV,h (sum_t p_t c_t)            (W_UV after the weighted sum)
        so it is MQA: H queries of r + R values, ONE KV head [c ; k_R] written per token, V its
        first r values, scale 1/sqrt(nope + R). q_nope [N, H, nope], q_rope [N, H, R], c [N, r],
        k_rope [N, 1, R] -> [N, H, dv]. Per cached token it reads r + R values and does ~2H(2r + R)
        FLOPs: ~H FLOPs per byte in bf16, compute-bound at 128 heads (why FlashMLA is). Prefill
        runs absorbed too (one path, a latent cache); vLLM expands K, V there: fewer FLOPs."""
        # assignment: mla-absorb
        w_uk, w_uv = self.kv_b_proj.weight.view(self.n_heads, -1, self.r).split(
            [self.nope, self.dv], dim=1)                                  # [H, nope, r], [H, dv, r]
        q = torch.cat([torch.einsum("nhd,hdr->nhr", q_nope, w_uk), q_rope], dim=-1)   # [N, H, r+R]
        latent = torch.cat([c, k_rope[:, 0]], dim=-1)[:, None]               # [N, 1, r + R]
        o = ctx.attend(self.kv_layer, q, latent, None, self.scale)   # [N, H, r]: sum_t p_t c_t
        return torch.einsum("nhr,hvr->nhv", o, w_uv)                           # [N, H, dv]
        # end assignment


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Two-thirds of the weights live here. gate and up
    read the same x: one linear of their stacked rows, as q/k/v above."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)   # [gate; up] rows
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)                       # [N, F] each
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm residual block: x += attn(norm(x)); x += mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.self_attn = (LatentAttention if cfg.kv_lora_rank else Attention)(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, ctx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


# Hugging Face stores each stacked linear as separate matrices: loading stacks their rows in this
# order (vLLM's "stacked params"), and support.checkpoint.hf_state_dict splits them back.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class SharedKV:
    """The dense path of a CLA model: each group's first layer's K, V, kept for the layers that
    share them (what the paged cache does across steps, here within one pass); no logits rows."""
    logits_indices = None

    def __init__(self, window):
        self.window, self.kv = window, {}

    def attend(self, kv_layer: int, q, k, v):
        if k is not None:
            self.kv[kv_layer] = (k, v)
        return dense_causal_attention(q, *self.kv[kv_layer], self.window)


class Transformer(nn.Module):
    """The whole decoder. Submodule names follow Hugging Face's LlamaForCausalLM (minus its
    "model." prefix; q/k/v and gate/up stacked, FUSED) so a checkpoint loads as is."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)  # moves with .to

    def forward(self, input_ids, positions, ctx=None):
        """input_ids, positions: [N] -> logits [N, vocab] (with ctx: its logits_indices rows)."""
        if ctx is None and input_ids.shape[0] > self.config.max_seq_len:
            raise ValueError(f"sequence of {input_ids.shape[0]} tokens is longer than the "
                             f"model's context of {self.config.max_seq_len}")
        # RoPE angles for each token's own position, computed in float32: [N, 1, d/2]
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x = self.embed_tokens(input_ids)                                 # [N, D]
        if ctx is None and self.config.cla_share > 1:
            ctx = SharedKV(self.config.sliding_window)          # CLA's dense path keeps K, V
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        if ctx is not None and ctx.logits_indices is not None:
            x = x[ctx.logits_indices]   # the LM head is big (V x D): only rows we sample from
        return self.lm_head(self.norm(x)).float()                        # [rows, V]


# --- Naive generation: the lecture's baseline -------------------------------------

@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int,
             temperature: float = 0.0, eos_token_id: int | None = None,
             generator: torch.Generator | None = None) -> list[int]:
    """The new tokens, each by re-running the whole sequence through the dense path: no KV cache,
    so T tokens cost O(T^2) token-passes instead of O(T). The reference the cached engine must
    reproduce token for token, and bench.py's kv-cache baseline."""
    checks.check_naive_generate(prompt_ids, max_new_tokens, model.config.max_seq_len)
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=model.embed_tokens.weight.device)
    out = []
    for _ in range(max_new_tokens):
        logits = model(ids, torch.arange(len(ids), device=ids.device))[-1]   # last position: [V]
        if temperature == 0:
            nxt = int(logits.argmax())                                    # greedy
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        out.append(nxt)
        if nxt == eos_token_id:
            break
        ids = torch.cat([ids, ids.new_tensor([nxt])])
    return out


# --- What a token costs: the roofline's FLOPs ---------------------------------------

def model_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """FLOPs to run one token through the model at a `context`-token position: 2 FLOPs (a multiply
    and an add) per weight of every matmul, plus attention's QK^T and PV over the context. A decode
    step of B sequences does B x this for one read of the weights (experiments/roofline.py).
    The matmuls are the model's own: CLA's sharing layers have no k, v; MLA's differ."""
    # assignment: roofline
    d, h, hd, f, L = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.ffn_dim, cfg.n_layers
    if not cfg.kv_lora_rank:   # q, o (H hd x D) in every layer; k, v (n_kv hd x D) in ceil(L / S)
        kv_rows = 2 * cfg.n_kv_heads * hd * -(-L // cfg.cla_share)   # (CLA: where K/V are made)
        attn = L * (d * h * hd + h * hd * d) + kv_rows * d
        per_cached = 4 * h * hd             # QK^T and PV: 2 H hd each per cached token
    else:    # MLA: q (or q_a, q_b), kv_a [r + R, D], kv_b [H (nope + dv), r], o [D, H dv]
        r, R, nope, dv, qr = (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                              cfg.v_head_dim, cfg.q_lora_rank)
        q = d * h * (nope + R) if qr is None else qr * (d + h * (nope + R))
        attn = L * (q + d * (r + R) + r * h * (nope + dv) + h * dv * d)
        per_cached = 2 * h * (2 * r + R)    # absorbed, as the engine runs it: QK^T over r + R, PV r
    # + gate, up, down (3 x F x D) in every layer and the LM head (V x D)
    return 2 * (attn + L * 3 * d * f + d * cfg.vocab_size) + L * per_cached * context
    # end assignment


# --- Loading: a short door into support/checkpoint.py -----------------------------

def read_config(path) -> ModelConfig:
    """The config of a model path without loading any weight: a checkpoint directory's
    config.json, or a "random:<preset>[:seed=N][:kv_heads=N][:sliding_window=W]" preset's."""
    return ModelConfig(**checkpoint.read_config_fields(path))


def load_model(path, device="cpu", dtype=torch.float32):
    """A checkpoint directory or "random:<preset>[:seed=N]" -> (model, config). The names and
    shapes of the model's tensors are what the checkpoint must hold, strictly (ONE error lists
    every difference). Each tensor goes straight to its device and dtype, so peak memory is about
    one copy of the weights; device="meta" reads none."""
    cfg = read_config(path)
    if cfg.random_seed is not None:
        return random_weights(cfg, cfg.random_seed, device=device, dtype=dtype)
    return _build(cfg, device,
                  lambda expected: checkpoint.read_tensors(path, cfg, expected, device, dtype))


def fused_rows(cfg: ModelConfig) -> dict:
    """{stacked linear: [(Hugging Face part, its rows), ...]} (FUSED, with this config's sizes).
    A stacked linear may hold only its first parts (a CLA layer's qkv_proj: q alone); MLA's
    q_proj stands alone."""
    qkv = [cfg.n_heads * cfg.head_dim] + [cfg.n_kv_heads * cfg.head_dim] * 2
    sizes = {"qkv_proj": qkv, "gate_up_proj": [cfg.ffn_dim] * 2}
    return {name: list(zip(FUSED[name], sizes[name])) for name in FUSED
            if not (cfg.kv_lora_rank and name == "qkv_proj")}


def random_weights(cfg: ModelConfig, seed: int = 0, device="cpu", dtype=torch.float32):
    """A Transformer for cfg with seeded random weights on `device` in `dtype`, scaled so
    activations stay finite through any depth: timings are real (shapes and bytes); text is not."""
    return _build(cfg, device,
                  lambda expected: checkpoint.random_tensors(expected, seed, device, dtype))


def _build(cfg: ModelConfig, device, tensors_for):
    """Build on the meta device, get {Hugging Face name: tensor} for its {name: shape} (each
    stacked linear as its parts), stack them, assign them."""
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight")      # shares embed_tokens.weight
    parts = fused_rows(cfg)
    tensors = checkpoint.stack_fused(tensors_for(checkpoint.unstacked(expected, parts)), parts)
    params = {k: nn.Parameter(t, requires_grad=False) for k, t in tensors.items()}
    model.load_state_dict(params, strict=False, assign=True)   # completeness was checked by support
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_frequencies(cfg).to(device)   # buffers are not in the checkpoint
    left = [n for n, p in model.named_parameters() if p.is_meta != (str(device) == "meta")]
    assert not left, f"parameters left unloaded: {left[:3]}"
    return model.eval().requires_grad_(False), cfg
