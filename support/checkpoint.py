"""
support/checkpoint.py -- strict checkpoint loading, config validation, "random:" presets.

What it protects: a model that loads must be the model its files describe.
A config.json with a typo ("30" layers as a string, 29 layers over 30 layers
of weights, tie_word_embeddings over a trained LM head) would otherwise load
"successfully" and produce garbage, or fail far away as a TypeError deep in
the model. So every config field is type- and range-checked and named as
config.json spells it, and loading is strict like
load_state_dict(strict=True): the weights must hold exactly the tensors the
config implies, with the implied shapes, or ONE error lists every
difference with a hint at the config field that probably disagrees.

It also holds the "random:<preset>" models (published shapes, seeded random
weights: the lecture's model sizes without a download) and reads the
tokenizer files of a checkpoint for tokenizer.py.

It works on plain data and imports nothing of the tour (support/'s rule):
config validation returns a dict of ModelConfig's fields; model.load_model
builds the Transformer on the meta device, passes {name: shape} of the
tensors it expects and gets back {name: tensor} (read strictly from the
files, or seeded random values), then assigns them. A config object passed
here is only read by attribute (n_layers, tie_embeddings, attention_bias).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import zlib

import torch

from support.default_model import default_model_path

RANDOM_PREFIX = "random:"


# ----------------------------------------------------------------------------
# Config validation: a Hugging Face config.json dict -> ModelConfig's fields
# ----------------------------------------------------------------------------

def config_fields(hf: dict) -> dict:
    """Read a Hugging Face config.json dict, refusing what the model cannot run.

    Returns the keyword arguments of model.ModelConfig. Every field is type-
    and range-checked, and an error names the field as config.json spells
    it: a string "30" for num_hidden_layers, or a max_position_embeddings of
    0, fails here, at load time, instead of as a TypeError deep inside the
    model or as every prompt refused later.
    """
    if not isinstance(hf, dict):
        raise ValueError(f"a model config must be a JSON object, got {type(hf).__name__}")
    deepseek = _architecture(hf)
    dim = _int_field(hf, "hidden_size")
    n_heads = _int_field(hf, "num_attention_heads")
    n_kv = _int_field(hf, "num_key_value_heads", n_heads, hi=n_heads)   # absent: plain MHA
    if n_heads % n_kv:
        raise ValueError(f"num_attention_heads={n_heads} is not a multiple of "
                         f"num_key_value_heads={n_kv}: "
                         f"GQA needs every KV head shared by the same number of query heads")
    if hf.get("head_dim") is None and dim % n_heads:
        raise ValueError(f"hidden_size={dim} is not divisible by num_attention_heads={n_heads}; "
                         f"such a checkpoint must state head_dim")
    head_dim = _int_field(hf, "head_dim", dim // n_heads)
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even: RoPE rotates pairs of dimensions")
    vocab = _int_field(hf, "vocab_size")
    rope_theta, rope_scaling = _rope_settings(hf)
    n_layers = _int_field(hf, "num_hidden_layers", hi=MAX_LAYERS)
    if deepseek and _int_field(hf, "first_k_dense_replace", 0, lo=0) < n_layers:
        raise ValueError("DeepSeek's mixture-of-experts layers are not implemented: nanoinfer runs "
                         "MLA on a dense FFN (first_k_dense_replace must be num_hidden_layers)")
    return dict(
        dim=dim, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        ffn_dim=_int_field(hf, "intermediate_size"), vocab_size=vocab,
        rope_theta=rope_theta, rope_scaling=rope_scaling,
        rms_eps=_float_field(hf, "rms_norm_eps", 1e-6 if deepseek else 1e-5, lambda v: 0 < v < 1,
                             "in (0, 1)"),
        tie_embeddings=_bool_field(hf, "tie_word_embeddings", False),
        max_seq_len=_int_field(hf, "max_position_embeddings", 2048),
        attention_bias=_bool_field(hf, "attention_bias", False),
        bos_token_id=_token_ids(hf, "bos_token_id", vocab),
        eos_token_id=_token_ids(hf, "eos_token_id", vocab),
        # Mistral's local attention: each query sees its last W positions
        # (null or absent: all of them).
        sliding_window=_int_field(hf, "sliding_window", None),
        # Local layers with a global one every N (Gemma 3's sliding_window_pattern, Character.AI):
        # layer i attends globally when (i + 1) % N == 0, the others within the window.
        global_every=_global_every(hf, n_layers),
        # Cross-layer attention (Brandon et al. 2024): groups of this many consecutive layers
        # share the first one's K/V (its own field: no Hugging Face architecture has it).
        cla_share=_int_field(hf, "cla_share", 1, hi=MAX_LAYERS),
    ) | _mla_fields(hf, head_dim, deepseek)


def _architecture(hf: dict) -> bool:
    """Refuse what is not a Llama-family checkpoint; True for DeepSeek-V2 (MLA attention)."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config field architectures must be a list of strings, got {archs!r}")
    # Mistral is Llama's architecture plus a sliding window (config field sliding_window): same
    # tensors. DeepSeek-V2 is Llama's block with MLA for attention (model.LatentAttention).
    deepseek = hf.get("model_type") == "deepseek_v2" or "DeepseekV2ForCausalLM" in archs
    if (hf.get("model_type") not in ("llama", "mistral") and not deepseek
            and not {"LlamaForCausalLM", "MistralForCausalLM"} & set(archs)):
        raise ValueError(
            f"unsupported architecture: model_type={hf.get('model_type')!r}, "
            f"architectures={archs}; nanoinfer runs Llama-family checkpoints only (Llama, "
            f"Mistral, DeepSeek-V2's attention on a dense FFN)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (Llama uses silu)")
    if _bool_field(hf, "mlp_bias", False):
        raise ValueError("unsupported mlp_bias=true: Llama's MLP has no bias")
    return deepseek


def _global_every(hf: dict, n_layers: int) -> int:
    """global_every (0: none); it needs a window to leave, and is not combined with CLA or MLA."""
    n = _int_field(hf, "global_every", 0, lo=0, hi=MAX_LAYERS)
    if n and not 2 <= n <= n_layers:
        raise ValueError(f"global_every={n} must be in [2, num_hidden_layers={n_layers}]: every "
                         f"N-th layer global, at least one local layer and one global one")
    if n and hf.get("sliding_window") is None:
        raise ValueError("global_every without sliding_window: the local layers need a window W")
    cla = _int_field(hf, "cla_share", 1, hi=MAX_LAYERS) > 1
    if n and (cla or hf.get("kv_lora_rank") is not None):
        raise ValueError("global_every with cla_share or kv_lora_rank is not implemented")
    return n


def _mla_fields(hf: dict, head_dim: int, deepseek: bool) -> dict:
    """Multi-head latent attention's fields (DeepSeek-V2's names; model.LatentAttention), when
    kv_lora_rank is set; {} otherwise. The "random:" option kv_lora_rank=r puts MLA on a Llama
    body: the per-head widths default to its head_dim, RoPE's to half of it (DeepSeek: 64 of 128).
    Sets head_dim to the RoPE width (what rope_frequencies rotates, as Hugging Face does) and one
    "KV head"."""
    if hf.get("kv_lora_rank") is None:
        if deepseek:
            raise _missing("kv_lora_rank")
        return {}
    rope = _int_field(hf, "qk_rope_head_dim", head_dim // 2)
    if rope % 2:
        raise ValueError(f"qk_rope_head_dim={rope} must be even: RoPE rotates pairs of dimensions")
    if _int_field(hf, "cla_share", 1, hi=MAX_LAYERS) > 1:
        raise ValueError("cla_share with kv_lora_rank: cross-layer attention over MLA's latents "
                         "is not implemented")
    return dict(kv_lora_rank=_int_field(hf, "kv_lora_rank"), qk_rope_head_dim=rope,
                qk_nope_head_dim=_int_field(hf, "qk_nope_head_dim", head_dim),
                v_head_dim=_int_field(hf, "v_head_dim", head_dim),
                q_lora_rank=_int_field(hf, "q_lora_rank", None), head_dim=rope, n_kv_heads=1)


# Field checks for config_fields. Sizes are JSON integers (not 30.0, not "30",
# not true: Python's bool is an int, so it is refused explicitly) in [1, 2^31 - 1].
# The layer count has a tighter cap: the deepest published Llama has 126
# layers, and a typo of a billion would make the loader build a billion
# modules before it could say the weights disagree.
MAX_LAYERS = 1024
_REQUIRED = object()


def _missing(name):
    return ValueError(f"config.json is missing the field {name!r}")


def _int_field(d: dict, key: str, default=_REQUIRED, lo: int = 1, hi: int = 2**31 - 1,
               name=None) -> int:
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


def _float_field(d: dict, key: str, default, ok=lambda v: v > 0, rule: str = "> 0",
                 name=None) -> float:
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
        raise ValueError(f"config field {key} must be true or false, got {v!r} "
                         f"({type(v).__name__})")
    return v


def _token_ids(d: dict, key: str, vocab: int):
    """bos/eos: null, one id, or a list of ids (Llama 3 Instruct stops on three), each in
    [0, vocab)."""
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
        raise ValueError(f"unsupported RoPE scaling {rope_type!r} in {where}: only 'llama3' is "
                         f"implemented")
    if "rope_theta" in hf:
        theta = _float_field(hf, "rope_theta", 10000.0)
    else:
        theta = _float_field(rope, "rope_theta", 10000.0, name=f"{where}.rope_theta")
    if rope_type != "llama3":
        return theta, None
    scaling = {
        "rope_type": "llama3",
        "factor": _float_field(rope, "factor", _REQUIRED, lambda v: v >= 1, ">= 1",
                               name=f"{where}.factor"),
        "low_freq_factor": _float_field(rope, "low_freq_factor", 1.0,
                                        name=f"{where}.low_freq_factor"),
        "high_freq_factor": _float_field(rope, "high_freq_factor", 4.0,
                                         name=f"{where}.high_freq_factor"),
        "original_max_position_embeddings": _int_field(
            rope, "original_max_position_embeddings",
            name=f"{where}.original_max_position_embeddings"),
    }
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(f"config field {where}.high_freq_factor ({scaling['high_freq_factor']}) "
                         f"must be greater than low_freq_factor ({scaling['low_freq_factor']})")
    return theta, scaling


def read_config_fields(path) -> dict:
    """ModelConfig's fields for a model path, reading no weight: a checkpoint
    directory's config.json, or a "random:" preset's published config (with
    random_seed set, so that everyone downstream can say the weights are random)."""
    path = os.fspath(path)
    if path.startswith(RANDOM_PREFIX):
        name, seed, overrides = parse_random_path(path)
        try:
            return {**config_fields({**PRESETS[name], **overrides}), "random_seed": seed}
        except ValueError as e:
            raise ValueError(f"{path!r}: {e}") from None
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
        return config_fields(hf)
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from None


# ----------------------------------------------------------------------------
# Loading a Hugging Face checkpoint directory, strictly
# ----------------------------------------------------------------------------

def read_tensors(path, cfg, expected: dict, device="cpu", dtype=torch.float32) -> dict:
    """The tensors of checkpoint directory `path`: {name: tensor on device, in dtype}.

    `expected` is {name: shape} of every tensor the model built from `cfg`
    needs (model.load_model takes it from a meta-device Transformer). First
    only the headers of the *.safetensors files are read and compared with
    it (_check_tensors: one error lists every difference); then each tensor
    is read from the memory-mapped file and cast straight to its final device
    and dtype, one at a time, so peak memory is about one copy of the
    weights, not two. With device="meta" no weight is read at all.
    """
    path = os.fspath(path)
    files = _weight_files(path)
    found = _scan_weights(path, files)
    _check_tensors(path, cfg, expected, found)
    tensors = {}
    for fname in files:
        wanted = {key: short for short, (f, key, _, _) in found.items()
                  if f == fname and short in expected}
        if str(device) == "meta":
            tensors.update({s: torch.empty(found[s][2], device="meta", dtype=dtype)
                            for s in wanted.values()})
            continue
        for key, t in _read_safetensors(os.path.join(path, fname), wanted):
            tensors[wanted[key]] = t.to(device=device, dtype=dtype)   # one tensor at a time
    return tensors


def _present(parts: list, rows: int) -> list:
    """The leading parts that make up `rows` rows (a CLA layer's qkv_proj holds q alone)."""
    held, total = [], 0
    for part, n in parts:
        if total >= rows:
            break
        held.append((part, n))
        total += n
    if total != rows:
        raise ValueError(f"{rows} rows are no prefix of the stacked parts {parts}")
    return held


def unstacked(expected: dict, parts: dict) -> dict:
    """{name: shape} with each stacked linear's tensors (parts: {"qkv_proj": [("q_proj", rows),
    ...]}) as its Hugging Face parts: what a checkpoint holds."""
    out = {}
    for name, shape in expected.items():
        prefix, module, param = _split_name(name)
        if module not in parts:
            out[name] = shape
            continue
        for part, rows in _present(parts[module], shape[0]):
            out[f"{prefix}{part}.{param}"] = (rows, *shape[1:])
    return out


def stack_fused(tensors: dict, parts: dict) -> dict:
    """{Hugging Face name: tensor} -> each stacked linear's parts concatenated along their rows,
    in parts' order (each part freed once stacked: the peak is one stacked tensor more)."""
    out = {}
    for name in list(tensors):
        if name not in tensors:
            continue
        prefix, module, param = _split_name(name)
        fused = next((f for f, ps in parts.items() if module in dict(ps)), None)
        if fused is None:
            out[name] = tensors.pop(name)
            continue
        held = [f"{prefix}{part}.{param}" for part, _ in parts[fused]]   # a prefix of them
        out[f"{prefix}{fused}.{param}"] = torch.cat([tensors.pop(h) for h in held if h in tensors])
    return out


def hf_state_dict(state_dict: dict, parts: dict) -> dict:
    """A model's state dict under Hugging Face's names: each stacked linear split back into its
    parts (views), for transformers' LlamaForCausalLM and for writing a checkpoint."""
    out = {}
    for name, t in state_dict.items():
        prefix, module, param = _split_name(name)
        if module not in parts:
            out[name] = t
            continue
        names, rows = zip(*_present(parts[module], t.shape[0]))
        out.update((f"{prefix}{n}.{param}", p) for n, p in zip(names, t.split(list(rows))))
    return out


def _split_name(name: str) -> tuple[str, str, str]:
    """"layers.0.self_attn.qkv_proj.weight" -> ("layers.0.self_attn.", "qkv_proj", "weight")."""
    head, _, param = name.rpartition(".")
    prefix, _, module = head.rpartition(".")
    return (prefix + "." if prefix else ""), module, param


def _weight_files(path: str) -> list[str]:
    """The safetensors files: the shards model.safetensors.index.json lists, else every
    *.safetensors."""
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
                        raise ValueError(f"tensor {short!r} appears twice in {path}: as "
                                         f"{found[short][1]} in {found[short][0]} and as {key} "
                                         f"in {fname}")
                    found[short] = (fname, key, tuple(sl.get_shape()), sl.get_dtype())
        except ValueError:
            raise
        except Exception as e:  # safetensors raises its own error type on bad headers / short files
            raise ValueError(f"cannot read weights file {fpath} (truncated or corrupt?): "
                             f"{e}") from None
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
# safetensors' names; int8/fp8 need scales we do not read
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _check_tensors(path: str, cfg, expected: dict, found: dict) -> None:
    """Compare the checkpoint with what the config implies; raise ONE ValueError listing
    every difference.

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
            shown = ", ".join(items[:n]) + (f", ... and {len(items) - n} more"
                                            if len(items) > n else "")
            lines.append(f"  {len(items)} {title}: {shown}")
    lines.append("  hint: " + _mismatch_hint(cfg, present, missing + unexpected, misshapen))
    raise ValueError("\n".join(lines))


def _shape_fields(name: str) -> str:
    """Which config fields set a tensor's shape, for the error message."""
    for part, fields in (("embed_tokens", "vocab_size, hidden_size"),
                         ("lm_head", "vocab_size, hidden_size"),
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


def _mismatch_hint(cfg, present: dict, differing: list[str], misshapen: list[str]) -> str:
    """Guess which config fields disagree with the weights."""
    hints = []
    layers = {int(m.group(1)) for k in present if (m := re.match(r"layers\.(\d+)\.", k))}
    if layers and layers != set(range(cfg.n_layers)):
        hints.append(f"does num_hidden_layers match the checkpoint? config.json says "
                     f"{cfg.n_layers}, the weights hold {len(layers)} layers "
                     f"(indices {min(layers)}..{max(layers)})")
    if "lm_head.weight" in differing:
        hints.append(f"is tie_word_embeddings ({str(cfg.tie_embeddings).lower()}) right? "
                     f"The weights' lm_head.weight disagrees with it (absent, or different from "
                     f"embed_tokens.weight)")
    if any(k.endswith(".bias") for k in differing):
        hints.append(f"does attention_bias ({str(cfg.attention_bias).lower()}) match the "
                     f"checkpoint?")
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
# Writing a checkpoint directory (prune.py's output; the tests' tiny models)
# ----------------------------------------------------------------------------

# ModelConfig's field -> config.json's key (Llama's names), for the fields a model's shape needs.
HF_KEYS = {"dim": "hidden_size", "ffn_dim": "intermediate_size", "n_layers": "num_hidden_layers",
           "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
           "head_dim": "head_dim",
           "vocab_size": "vocab_size", "rms_eps": "rms_norm_eps", "rope_theta": "rope_theta",
           "max_seq_len": "max_position_embeddings", "tie_embeddings": "tie_word_embeddings",
           "attention_bias": "attention_bias", "rope_scaling": "rope_scaling",
           "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id"}


def write_checkpoint(state_dict: dict, cfg, parts: dict, directory, source=None) -> str:
    """A model as a Hugging Face checkpoint directory that load_model, serve.py and transformers'
    LlamaForCausalLM read: config.json (the source checkpoint's, if any, with every field of `cfg`
    written over it), model.safetensors (Hugging Face's names: `parts` splits each stacked linear;
    a tied LM head once) and the source's tokenizer files (else the default model's)."""
    from safetensors.torch import save_file
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    src = tokenizer_path(source)
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32"}
    if source and os.path.isfile(os.path.join(os.fspath(source), "config.json")):
        with open(os.path.join(os.fspath(source), "config.json")) as f:
            base = json.load(f)
    base.update((key, getattr(cfg, field)) for field, key in HF_KEYS.items()      # ids: None keeps
                if getattr(cfg, field) is not None or not key.endswith("token_id"))   # the source's
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(base, f, indent=1)
    tensors = {("" if k == "lm_head.weight" else "model.") + k: v.detach().contiguous()
               for k, v in hf_state_dict(state_dict, parts).items()
               if not (cfg.tie_embeddings and k == "lm_head.weight")}
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        same = os.path.abspath(src) == os.path.abspath(directory)
        if os.path.isfile(os.path.join(src, name)) and not same:
            shutil.copy(os.path.join(src, name), directory)
    return directory


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
# this model reads), so config_fields validates it like any checkpoint.

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
            "tie_word_embeddings": tied, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"}


def _deepseek(hidden, ffn, layers, heads, kv_lora, q_lora, nope, rope, v, vocab, max_pos, bos,
              eos):
    """DeepSeek-V2's config.json fields, every layer's FFN dense (first_k_dense_replace)."""
    return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "first_k_dense_replace": layers, "num_attention_heads": heads,
            "num_key_value_heads": heads, "kv_lora_rank": kv_lora, "q_lora_rank": q_lora,
            "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v, "head_dim": rope,
            "vocab_size": vocab, "max_position_embeddings": max_pos, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False, "bos_token_id": bos, "eos_token_id": eos,
            "torch_dtype": "bfloat16"}


PRESETS = {
    # the default model's shapes (HuggingFaceTB/SmolLM2-135M-Instruct): 134,515,008 parameters
    "smollm2-135m": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                     "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                     "rope_theta": 100000.0, "tie_word_embeddings": True, "hidden_act": "silu",
                     "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
                     "torch_dtype": "bfloat16"},
    # meta-llama/Llama-3.2-1B: 1,235,814,400 parameters (embeddings tied, counted once)
    "llama-3.2-1b": _llama3(hidden=2048, ffn=8192, layers=16, heads=32, head_dim=64, tied=True,
                            rope_factor=32.0),
    # meta-llama/Llama-3.2-3B: 3,212,749,824
    "llama-3.2-3b": _llama3(hidden=3072, ffn=8192, layers=28, heads=24, head_dim=128, tied=True,
                            rope_factor=32.0),
    # meta-llama/Llama-3.1-8B: 8,030,261,248
    "llama-3.1-8b": _llama3(hidden=4096, ffn=14336, layers=32, heads=32, head_dim=128,
                            tied=False, rope_factor=8.0),
    # nvidia/Llama-3.1-Minitron-4B-Width-Base: 8B pruned in width (hidden 4096 -> 3072, MLP
    # 14336 -> 9216) and distilled: 4,512,746,496; -Depth-Base: 16 of its 32 layers: 4,540,469,248
    "llama-3.1-minitron-4b-width": _llama3(hidden=3072, ffn=9216, layers=32, heads=32,
                                           head_dim=128, tied=False, rope_factor=8.0),
    "llama-3.1-minitron-4b-depth": _llama3(hidden=4096, ffn=14336, layers=16, heads=32,
                                           head_dim=128, tied=False, rope_factor=8.0),
    # meta-llama/Llama-3.1-70B: 70,553,706,496 (141 GB in bf16: the meta device, or tensor
    # parallelism)
    "llama-3.1-70b": _llama3(hidden=8192, ffn=28672, layers=80, heads=64, head_dim=128,
                             tied=False, rope_factor=8.0),
    # NOT a published model: SmolLM2's vocabulary (and tokenizer) on a 2-layer,
    # 64-wide body. Its forward pass is nearly free, so an engine step on it is
    # the engine's own work (bench.py's overhead experiment).
    "smollm2-tiny": {**_llama3(hidden=64, ffn=128, layers=2, heads=4, head_dim=16, tied=True,
                               rope_factor=8.0),
                     "num_key_value_heads": 2, "vocab_size": 49152, "max_position_embeddings": 8192,
                     "rope_theta": 100000.0, "rope_scaling": None, "bos_token_id": 1,
                     "eos_token_id": 2},
    # NOT a published model: Llama 3's vocabulary and RoPE on a 2-layer, 64-wide
    # body, for fast CPU tests of the engine with ids beyond the tokenizer's vocabulary.
    "tiny": {**_llama3(hidden=64, ffn=128, layers=2, heads=4, head_dim=16, tied=False,
                       rope_factor=8.0),
             "num_key_value_heads": 2, "max_position_embeddings": 4096},
    # NOT the published model: deepseek-ai/DeepSeek-V2-Lite's attention (MLA, 27 layers of 16
    # heads, r = 512, R = 64) on a dense FFN in every layer (its first layer's: the model is a
    # mixture of experts after it), without its YaRN long-context RoPE scaling.
    "deepseek-v2-lite-attn": _deepseek(hidden=2048, ffn=10944, layers=27, heads=16, kv_lora=512,
                                       q_lora=None, nope=128, rope=64, v=128, vocab=102400,
                                       max_pos=163840, bos=100000, eos=100001),
    # NOT a published model: MLA (with DeepSeek-V2's low-rank queries) on a 2-layer, 64-wide
    # body with SmolLM2's vocabulary: the MLA engine's fast CPU tests.
    "deepseek-mla-tiny": _deepseek(hidden=64, ffn=128, layers=2, heads=4, kv_lora=32, q_lora=24,
                                   nope=16, rope=16, v=16, vocab=49152, max_pos=4096, bos=1, eos=2),
}


# Options of a preset, each at most once, in any order: the seed of the random weights, and
# overrides of its config.json (validated by config_fields like any checkpoint's):
#   kv_heads=N        -> num_key_value_heads: MHA (N = heads), GQA, MQA (N = 1) on the same body.
#                        Every other tensor is unchanged for a given seed; k_proj and v_proj take
#                        the new shape [N * head_dim, hidden], drawn from their usual per-name
#                        seed and scale.
#   sliding_window=W  -> sliding_window (Mistral's): each query sees its last W positions.
#   cla_share=S       -> cla_share: cross-layer attention, S layers share each K/V layer.
#   global_every=N    -> with sliding_window=W: every N-th layer global, the others local.
#   kv_lora_rank=r    -> multi-head latent attention on the same body (the same query heads and
#                        FFN): a latent of r + a shared RoPE key of head_dim / 2, heads of head_dim.
PRESET_OPTIONS = {"seed": None, "kv_heads": "num_key_value_heads",
                  "sliding_window": "sliding_window", "cla_share": "cla_share",
                  "kv_lora_rank": "kv_lora_rank", "global_every": "global_every"}


def parse_random_path(path: str) -> tuple[str, int, dict]:
    """"random:<preset>[:seed=N][:kv_heads=N][:sliding_window=W][:cla_share=S][:kv_lora_rank=r]
    [:global_every=N]"
    -> (preset, seed, config.json overrides), e.g. "random:llama-3.2-1b:kv_heads=1:seed=3". The
    default seed is 0."""
    rest = os.fspath(path).removeprefix(RANDOM_PREFIX)
    name, *options = rest.split(":")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} in {path!r}; presets: {', '.join(PRESETS)}")
    values = {}
    for option in options:
        m = re.fullmatch(r"([a-z_]+)=(\d{1,19})", option)
        if m is None or m.group(1) not in PRESET_OPTIONS or m.group(1) in values:
            raise ValueError(f"bad option {option!r} in {path!r}: expected random:{name}[:seed=N]"
                             f"[:kv_heads=N][:sliding_window=W][:cla_share=S][:kv_lora_rank=r]"
                             f"[:global_every=N], "
                             f"each at most once, with non-negative integers")
        values[m.group(1)] = int(m.group(2))
    seed = values.pop("seed", 0)
    if seed >= 2**63:
        raise ValueError(f"bad option seed={seed} in {path!r}: expected seed=N with N an integer "
                         f"in [0, 2^63)")
    return name, seed, {PRESET_OPTIONS[k]: v for k, v in values.items()}


def preset_config(path: str) -> dict:
    """The Hugging Face config.json dict of a "random:" path: its preset with the options'
    overrides."""
    name, _, overrides = parse_random_path(path)
    return {**PRESETS[name], **overrides}



def random_tensors(expected: dict, seed: int = 0, device="cpu", dtype=torch.float32) -> dict:
    """{name: shape} -> {name: seeded random tensor}, made directly on `device` in `dtype`.

    The weights are not trained: generated text is gibberish, while memory,
    bytes per step and timings are those of the real model. On device="meta"
    nothing is allocated (sizes and parameter counts only).

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
    gen = None if str(device) == "meta" else torch.Generator(device=device)
    tensors = {}
    for name, shape in expected.items():
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
    return tensors


# SmolLM2's tokenizer (Apache-2.0), shipped with the project: "random:" presets
# need no model on disk, so a GPU node with no network runs them straight away.
SHIPPED_TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_tokenizer")


def tokenizer_path(path: str | None) -> str:
    """Where the tokenizer of a model path lives: a checkpoint directory holds
    its own; None (the default model) uses the default model's; "random:"
    presets use SmolLM2's, shipped in support/smollm2_tokenizer (49152 tokens;
    ids a bigger preset samples beyond it decode to a placeholder, see tokenizer.py)."""
    if path is None:
        return default_model_path()
    if os.fspath(path).startswith(RANDOM_PREFIX):
        return SHIPPED_TOKENIZER
    return os.fspath(path)


# ----------------------------------------------------------------------------
# The tokenizer files of a checkpoint (for tokenizer.Tokenizer.from_pretrained)
# ----------------------------------------------------------------------------

def read_tokenizer_files(path, gpt2_pattern: str, digits_then_gpt2_pattern: str) -> dict:
    """tokenizer.json (+ tokenizer_config.json) of a checkpoint directory -> the
    keyword arguments of tokenizer.Tokenizer: vocab, specials, pattern,
    eos_token, bos_token, chat_template.

    Only byte-level BPE is accepted (anything else is refused by name when
    loaded, not when it first encodes wrongly). The pre-tokenizer is read
    from the file, not assumed; tokenizer.py hands in the two regexes it
    knows (see _pattern_from).
    """
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tj):
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    with open(tj, encoding="utf-8") as f:
        data = json.load(f)
    model = data.get("model", {})
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ValueError(f"{tj}: only byte-level BPE tokenizers are supported, "
                         f"got {model.get('type')!r}")
    cfg = {}
    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file, encoding="utf-8") as f:
            cfg = json.load(f)

    def name(t):   # tokenizer_config stores a token as a string or as {"content": ...}
        return t.get("content") if isinstance(t, dict) else t
    return dict(vocab=model["vocab"],
                specials={t["content"]: t["id"] for t in data.get("added_tokens", [])},
                pattern=_pattern_from(data.get("pre_tokenizer"), gpt2_pattern,
                                      digits_then_gpt2_pattern),
                eos_token=name(cfg.get("eos_token")), bos_token=name(cfg.get("bos_token")),
                chat_template=cfg.get("chat_template"))


def _pattern_from(pre_tokenizer: dict | None, gpt2: str, digits_then_gpt2: str) -> str:
    """Translate the Hugging Face pre-tokenizer description into one regex."""
    steps = pre_tokenizer.get("pretokenizers", [pre_tokenizer]) if pre_tokenizer else []
    kinds = [s["type"] for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return gpt2
    if (kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits")
            and steps[1].get("use_regex", True)):
        return digits_then_gpt2
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        return steps[0]["pattern"]["Regex"]   # e.g. Llama 3 ships its regex explicitly
    raise ValueError(f"unsupported pre-tokenizer {kinds}: expected byte-level BPE")
