"""
support/checks.py -- the checks at the engine's door, written once.

What it protects: every value a user hands the engine (a SamplingParams, a
prompt, the engine's options, a device or dtype name) is refused where it
enters, with a message that names it, before it can reach a tensor, a hash,
the batch or another user's request. A request that would fail later, in
the middle of a step, would cost its batch-mates that step.

Why here and not in the tour: these lines teach nothing about inference, and
the library (engine.py, sampler.py) and the server (serve.py) must refuse
exactly the same things, which they can only do if each check exists once.
The RANGES stay with the lessons (each field of SamplingParams in sampler.py
and of EngineConfig in engine.py declares its own); this file only walks
them. Everything here runs while a request or an engine is built, never
inside an engine step. Imports: the standard library and torch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import types
import typing

import torch

from support.workers import check_world_size

# ----------------------------------------------------------------------------
# Small predicates and error text
# ----------------------------------------------------------------------------


def is_int(x) -> bool:
    # JSON true is a Python bool, and bool is a subclass of int: "max_tokens": true
    # must be a type error, not 1 token.
    return isinstance(x, int) and not isinstance(x, bool)


def is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def fits_float(x) -> bool:
    """An int such as 10**400 compares fine but overflows once it meets a tensor."""
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def short(value, limit: int = 80) -> str:
    """repr of a value for an error message, cut short (a stop list or a client's field can be
    megabytes)."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + f"... ({len(r)} characters)"


# ----------------------------------------------------------------------------
# Declared fields: SamplingParams and EngineConfig against their own ranges
# ----------------------------------------------------------------------------
# A field declares its range beside it (sampler.knob, engine.option), in its
# metadata: ge / gt / le (bounds), choices, items (a list's most entries),
# chars (a string's most characters). Its type is its annotation. The walk
# below reads both at every call, so a new field, or a tightened range, needs
# no edit here, and the library and the server refuse the same values.

NOUNS = {int: "an integer", float: "a number", bool: "a bool", str: "a string", type(None): "None"}


def _interval(b) -> str:
    """The bounds of a metadata dict as text: "in [1, 128]", "in (0, 1]", ">= 0", or ""."""
    lo, hi = b.get("ge", b.get("gt")), b.get("le")
    left = "[" if "ge" in b else "("
    if lo is not None and hi is not None:
        return f" in {left}{lo}, {hi}]"
    return f" {'>=' if 'ge' in b else '>'} {lo}" if lo is not None else ""


def _describe(kind, b) -> str:
    """What a value of annotation `kind` within the bounds `b` must be, for an error message."""
    if "choices" in b:
        return " or ".join(map(repr, b["choices"]))
    if typing.get_origin(kind) is dict:
        return f"a map of at most {b['items']} token ids to numbers{_interval(b)}"
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        chars = f" of 1 to {b['chars']} characters" if "chars" in b else ""
        plural = {int: "integers", float: "numbers", str: "strings"}[item]
        return f"a list of at most {b['items']} {plural}{_interval(b)}{chars}"
    if kind is int and b.get("ge") == 1 and "le" not in b:
        return "a positive integer"
    if kind is str and "chars" in b:
        return f"a string of 1 to {b['chars']} characters"
    noun = NOUNS.get(kind, getattr(kind, "__name__", str(kind)))
    return noun + (_interval(b) if kind in (int, float) else "")


def _within(value, b) -> bool:
    return (value >= b.get("ge", value) and value <= b.get("le", value)
            and ("gt" not in b or value > b["gt"]))


def _fits(value, kind, b) -> bool:
    """Is `value` of annotation `kind` (int, float, bool, str, None, list[X], or any class) and
    within the bounds `b`? JSON's true is a bool, not the integer 1; 10**400 is no float."""
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        return (isinstance(value, list) and len(value) <= b["items"]
                and all(_fits(v, item, b) for v in value))
    if typing.get_origin(kind) is dict:          # token id (>= 0) -> a value within the bounds
        key, item = typing.get_args(kind)
        return (isinstance(value, dict) and len(value) <= b["items"]
                and all(_fits(k, key, {"ge": 0}) and _fits(v, item, b) for k, v in value.items()))
    if kind is int:
        return is_int(value) and _within(value, b)
    if kind is float:
        return is_num(value) and fits_float(value) and math.isfinite(value) and _within(value, b)
    if kind is str and "chars" in b:
        return isinstance(value, str) and 0 < len(value) <= b["chars"]
    return isinstance(value, kind)


_annotations = functools.cache(typing.get_type_hints)   # a class's evaluated annotations


def check_fields(obj, prefix: str = "") -> None:
    """Raise ValueError naming the first field of the dataclass `obj` whose value is not of its
    annotated type (any member of a union) or outside its declared range; tuples become lists."""
    kinds = _annotations(type(obj))
    for f in dataclasses.fields(obj):
        value, b = getattr(obj, f.name), f.metadata
        if isinstance(value, tuple):
            setattr(obj, f.name, value := list(value))
        kind = kinds[f.name]
        options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
        if "choices" in b:
            ok, what = value in b["choices"], _describe(None, b)
        else:
            ok = any(_fits(value, k, b) for k in options)
            what = " or ".join(_describe(k, b) for k in options)
        if not ok:
            raise ValueError(f"{prefix}{f.name} must be {what}, got {short(value)}")


def check_sampling_params(p) -> None:
    """SamplingParams' fields against their declared ranges; then the one rule that joins two
    of them: 0 new tokens is a request that only scores its prompt (prompt_logprobs)."""
    check_fields(p, "SamplingParams.")
    if getattr(p, "allowed_token_ids", None) == []:
        raise ValueError("SamplingParams.allowed_token_ids: at least one token (None: every token)")
    if getattr(p, "structured_outputs", None) is not None:     # it compiles (support/structured)
        from support.structured import grammar_text           # llguidance: loaded when first asked
        with naming("SamplingParams.structured_outputs"):
            grammar_text(p.structured_outputs)
    if p.max_tokens == 0 and p.prompt_logprobs is None:
        hi = type(p).__dataclass_fields__["max_tokens"].metadata["le"]
        raise ValueError(f"SamplingParams.max_tokens must be an integer in [1, {hi}] "
                         f"(0 only with prompt_logprobs), got 0")


# ----------------------------------------------------------------------------
# Requests: the prompt, its length, its seats
# ----------------------------------------------------------------------------

def check_request(ids, params, params_type, cfg, max_len: int, max_num_seqs: int) -> list[int]:
    """What LLM.add_request checks before it queues anything: the params'
    type, the prompt (already encoded if it was a string) as token ids in the
    vocabulary, room to generate, and seats for its n samples. Returns the ids."""
    if not isinstance(params, params_type):
        raise TypeError(f"params must be a {params_type.__name__}")
    if not (isinstance(ids, (list, tuple)) and all(is_int(t) for t in ids)):
        raise TypeError("a prompt is a string or a list of token ids")
    ids = check_token_ids(list(ids), cfg.vocab_size)
    for name in ("logit_bias", "allowed_token_ids"):       # token ids the model has
        if getattr(params, name, None) and max(getattr(params, name)) >= cfg.vocab_size:
            raise ValueError(f"SamplingParams.{name}: token ids must be in [0, {cfg.vocab_size})")
    where = "context" if max_len == cfg.max_seq_len else "KV cache pool"
    check_prompt_length(len(ids), max_len, where)
    check_seats(params.n, max_num_seqs)     # its n samples run side by side
    return ids


def check_prompt_text(text: str, tokenizer, max_len: int, what: str = "the prompt") -> str:
    """A prompt's text, before it is encoded: refused (ValueError) if no tokenization of it can
    fit max_len tokens (each token covers at most tokenizer.max_token_bytes bytes: the check
    costs no tokenizer work), or if it holds a character the vocabulary has no token for, which
    encoding would drop silently (the Hugging Face reference does)."""
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > max_len * tokenizer.max_token_bytes:
        least = -(-size // tokenizer.max_token_bytes)
        raise ValueError(f"{what} has {size} bytes: at least {least} tokens, more than the "
                         f"{max_len} this model's context holds")
    if (c := tokenizer.unencodable(text)) is not None:
        raise ValueError(f"{what} holds the character {c!r} (U+{ord(c):04X}; UTF-8 "
                         f"{c.encode('utf-8', 'surrogatepass').hex(' ')}), which this model's "
                         f"vocabulary has no token for: it would be dropped from the prompt")
    return text


def new_request_id(request_id, in_use, counter) -> str:
    """A request's id: the caller's (as a string), which no live request may hold, or the
    counter's next."""
    request_id = str(next(counter)) if request_id is None else str(request_id)
    if request_id in in_use:
        raise ValueError(f"request id {request_id!r} is already in use")
    return request_id


@contextlib.contextmanager
def naming(what: str):
    """Re-raise a ValueError or TypeError with `what` in front: which prompt of a list was
    refused."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise type(e)(f"{what}: {e}") from None


def generate_inputs(prompts, params) -> tuple[list, list]:
    """LLM.generate's arguments as two lists of one length: a single prompt (a string or token
    ids) becomes a list of one, a single SamplingParams (or None) serves every prompt."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    params = params if isinstance(params, list) else [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
    return prompts, params


def check_token_ids(ids: list[int], vocab_size: int) -> list[int]:
    """Token ids the model can embed: in its vocabulary, and at least one."""
    if any(not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def check_prompt_length(num_tokens: int, max_len: int, where: str) -> None:
    """A prompt must leave room for at least one generated token."""
    if num_tokens >= max_len:
        raise ValueError(f"the prompt has {num_tokens} tokens; the model's {where} holds "
                         f"{max_len}, which leaves no room to generate")


def check_seats(n: int, max_num_seqs: int) -> None:
    """The n samples of a request run side by side: more than the batch's seats could never run."""
    if n > max_num_seqs:
        raise ValueError(f"n={n} samples need {n} batch seats; this engine runs at most "
                         f"max_num_seqs={max_num_seqs} sequences at once")


ROLE_CONTENT = ("role", "content")


def check_chat(messages, chat_template: str | None) -> None:
    """Tokenizer.apply_chat_template's input: a non-empty list of {'role', 'content'} string dicts,
    for a checkpoint whose template is ChatML (the only one implemented)."""
    if "<|im_start|>" not in (chat_template or ""):
        raise ValueError("this checkpoint's chat template is not ChatML; only ChatML is "
                         "implemented")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for m in messages:
        if not isinstance(m, dict) or not all(isinstance(m.get(k), str) for k in ROLE_CONTENT):
            raise ValueError(f"each message needs a string 'role' and 'content', got {m!r}")


# ----------------------------------------------------------------------------
# Engine options
# ----------------------------------------------------------------------------

def check_block_pool(num_blocks: int, block_size: int, sliding_window) -> None:
    """cache.BlockManager's pool: at least one block, a positive block size and window."""
    check_positive_ints(block_size=block_size,
                        sliding_window=1 if sliding_window is None else sliding_window)
    if num_blocks < 1:
        raise ValueError("the KV cache has no blocks")


def check_naive_generate(prompt_ids, max_new_tokens: int, max_seq_len: int) -> None:
    """model.generate's arguments: a prompt to condition on, and room for the new tokens."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: there is no token to condition on")
    if len(prompt_ids) + max_new_tokens > max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds the model's context of {max_seq_len} tokens")


def check_positive_ints(**values) -> None:
    for name, v in values.items():
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def check_prunable(cfg) -> None:
    """prune.py cuts a plain GQA model's layers, MLP channels and KV groups: MLA, cross-layer
    attention and sliding windows have units of their own, refused by name."""
    kinds = [k for k, on in (("MLA (kv_lora_rank)", cfg.kv_lora_rank),
                             ("CLA (cla_share)", cfg.cla_share > 1),
                             ("a sliding window", cfg.sliding_window)) if on]
    if kinds:
        raise ValueError(f"prune.py prunes plain GQA models; this one has {' and '.join(kinds)}")


def check_engine_config(c) -> None:
    """EngineConfig's fields against their declared ranges, then the options that depend
    on each other: a speculative step's k drafts and the token they verify fit one step's
    budget; compile=True runs on one device, and not with llm.int8."""
    check_fields(c)
    if c.compile and c.tensor_parallel_size != 1:
        raise ValueError("compile=True with tensor_parallel_size > 1 is not supported")
    if c.overlap and c.tensor_parallel_size != 1:
        raise ValueError("overlap=True with tensor_parallel_size > 1 is not supported")
    if c.compile and c.quantization == "llm.int8":
        raise ValueError("quantization='llm.int8' picks its outlier columns on every call (a shape "
                         "that depends on the data), which a CUDA graph cannot replay: use "
                         "compile=False")
    if c.speculative is None:
        return
    directory = isinstance(c.speculative, str) and os.path.isdir(c.speculative)
    if c.speculative != "ngram" and not directory:
        raise ValueError(f"speculative must be None, 'ngram' or a draft model directory, "
                         f"got {c.speculative!r}")
    if c.max_num_batched_tokens < c.num_speculative_tokens + 1:
        raise ValueError(f"speculation needs max_num_batched_tokens >= num_speculative_tokens + 1 "
                         f"= {c.num_speculative_tokens + 1}")


def check_pool_size(num_blocks: int, needed: int, budget: int, block_size: int,
                    bytes_per_token: int) -> None:
    """A KV pool's byte budget must hold the blocks the engine needs (a compiled step: one
    scratch block more)."""
    if num_blocks < needed:
        raise ValueError(f"kv_cache_bytes={budget} is too small for {needed} block(s) of "
                         f"{block_size} tokens ({bytes_per_token * block_size} bytes each)")


def resolve_device_dtype(device, dtype, quantization):
    """"auto" and names -> (torch.device, torch.dtype)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if dtype == "auto":      # bf16 halves the bytes per step on GPU. On CPU float32, where
        # every path is bit-exact against the dense reference (bench.py measures bf16 too:
        # faster on the machine in the README); int8 takes bf16 activations (quantize.py)
        dtype = torch.float32 if device.type == "cpu" and quantization is None else torch.bfloat16
    elif isinstance(dtype, str):
        names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if dtype not in names:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(names)}, got {dtype!r}")
        dtype = names[dtype]
    return device, dtype


def check_tensor_parallel(cfg, world_size: int, device_type: str = "cpu",
                          quantization=None) -> None:
    """parallel.py's split needs each rank to own whole heads, KV heads, FFN columns and
    vocabulary rows (vLLM replicates KV heads and pads the vocabulary; we refuse), one GPU per
    rank on CUDA, and float or int8 weights (the slicing knows int8's layout only)."""
    check_world_size(world_size, device_type)      # a positive integer; on CUDA, that many GPUs
    if quantization not in (None, "int8"):
        raise ValueError(f"tensor parallelism shards float or int8 weights, not {quantization!r}")
    if cfg.global_every:
        raise ValueError("tensor parallelism with local + global layers (global_every) is not "
                         "implemented")
    if cfg.kv_lora_rank:
        raise ValueError("tensor parallelism with multi-head latent attention (kv_lora_rank) is "
                         "not implemented (each rank would hold all of the latent, its heads of "
                         "q_proj, kv_b_proj and o_proj)")
    sizes = {"attention heads": cfg.n_heads, "KV heads": cfg.n_kv_heads,
             "FFN width": cfg.ffn_dim, "vocabulary size": cfg.vocab_size}
    bad = [f"{name} {n}" for name, n in sizes.items() if n % world_size]
    if bad:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's attention "
                         f"heads, KV heads, FFN width and vocabulary size; it does not divide: "
                         f"{', '.join(bad)}")


def check_shardable(linear, types) -> None:
    """shard_model slices each linear once, right after loading: an already sharded one is
    refused."""
    if type(linear) not in types:
        raise TypeError(f"cannot shard a {type(linear).__name__}: shard the model once, "
                        f"right after loading (and quantize_model)")


def check_kv_pool_args(num_blocks, kv_cache_dtype) -> None:
    """A tensor-parallel group's KV pool: a positive block count, a known storage type."""
    if not is_int(num_blocks) or num_blocks < 1 or kv_cache_dtype not in (None, "int8"):
        raise ValueError(f"need num_blocks >= 1 and kv_cache_dtype None or 'int8', "
                         f"got {num_blocks!r}, {kv_cache_dtype!r}")


def check_same_vocabulary(path, draft_config, draft_tokenizer, target_config,
                          target_tokenizer) -> None:
    """A draft model proposes token ids the target must read as the same tokens (configs'
    vocab_size, tokenizers' ranks)."""
    same = draft_config.vocab_size == target_config.vocab_size
    if not same or draft_tokenizer.ranks != target_tokenizer.ranks:
        raise ValueError(f"the draft model at {path} has a different vocabulary "
                         f"({draft_config.vocab_size} tokens) than the target "
                         f"({target_config.vocab_size})")


def say_pool(cfg, usable: int, block_size: int, per_token: int, int8: bool, dtype, total: int):
    """The KV pool's one line: its tokens and the lecture's bytes-per-token formula."""
    value = f"(1 B + 4/{cfg.head_dim} B of scale)" if int8 else f"{dtype.itemsize} B"
    formula = (f"{cfg.kv_layers} layers*({cfg.kv_lora_rank} latent + {cfg.qk_rope_head_dim} "
               f"RoPE key) values" if cfg.kv_lora_rank else
               f"2*{cfg.kv_layers} layers*{cfg.n_kv_heads} kv heads*{cfg.head_dim} dims")
    local = (f" (global layers; the {cfg.n_layers - cfg.kv_layers} local layers keep a window "
             f"per seat in a pool of their own)" if cfg.global_every else "")
    print(f"nanoinfer: KV cache {usable} blocks x {block_size} tokens = {usable * block_size} "
          f"tokens; {per_token} B/token = {formula}*{value}{local}; "
          f"{total / 2**20:.1f} MiB allocated")


def say_random_weights(path, seed) -> None:
    """A random: preset says so once, where its engine is built."""
    if seed is not None:
        print(f"nanoinfer: {path}: RANDOM weights (published shapes, seed {seed}): timings "
              "are real, the text is noise")


def check_quantize(method, formats, quantized: bool, calibration) -> None:
    """quantize_model's arguments: a known method, a float model, AWQ's calibration ids."""
    if method not in formats:
        raise ValueError(f"unknown quantization {method!r}; the supported methods are "
                         f"{', '.join(formats)}")
    if quantized:
        raise ValueError("the model is already quantized; load a fresh float model to quantize "
                         "it again")
    if method == "awq" and not calibration:
        raise ValueError("awq needs calibration token ids (support/calibration.py)")


def check_local_global(cfg, c) -> None:
    """Local + global layers (cfg.global_every) run on the eager path, in the model's dtype."""
    if c.compile or c.kv_cache_dtype == "int8":
        raise ValueError("global_every (local + global layers) runs eagerly and in the model's "
                         "dtype: compile=True and kv_cache_dtype='int8' are not implemented "
                         "with it")


def check_kv_cache_dtype(kv_cache_dtype, cfg=None) -> None:
    if kv_cache_dtype not in (None, "int8"):
        raise ValueError(f"kv_cache_dtype must be None (the model's dtype) or 'int8', "
                         f"got {kv_cache_dtype!r}")
    if kv_cache_dtype == "int8" and cfg is not None and cfg.kv_lora_rank:
        raise ValueError("kv_cache_dtype='int8' with multi-head latent attention (kv_lora_rank): "
                         "an int8 latent cache is not implemented; use the model's dtype")
