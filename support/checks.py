"""
support/checks.py -- the checks at the engine's door, written once.

What it protects: every value a user hands the engine (a SamplingParams, a
prompt, the engine's options, a device or dtype name) is refused where it
enters, with a message that names it, before it can reach a tensor, a hash,
the batch or another user's request. A request that would fail later, in
the middle of a step, would cost its batch-mates that step.

Why here and not in the tour: these lines teach nothing about inference, and
the library (scheduler.py, sampler.py) and the server (serve.py) must refuse
exactly the same things, which they can only do if each check exists once.
The RANGES stay with the lesson (SamplingParams.LIMITS in sampler.py); this
file only walks them. Everything here runs while a request or an engine is
built, never inside an engine step. Imports: the standard library and torch.
"""
from __future__ import annotations

import contextlib
import math
import os

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
    """repr of a value for an error message, cut short (a stop list or a client's field can be megabytes)."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + f"... ({len(r)} characters)"


# ----------------------------------------------------------------------------
# SamplingParams: its fields against its LIMITS
# ----------------------------------------------------------------------------

def check_sampling_params(p) -> None:
    """Raise ValueError naming the first field of `p` (a SamplingParams) outside
    its range. The bounds are read from p.LIMITS at each call, so changing them
    changes what the library and the server accept. A single stop string
    becomes a one-element list; tuples become lists."""
    L = p.LIMITS

    def check(ok, name, what):
        if not ok:
            raise ValueError(f"SamplingParams.{name} must be {what}, got {short(getattr(p, name))}")
    lo = 1 if p.prompt_logprobs is None else 0       # 0 tokens: score the prompt only (prompt_logprobs)
    check(is_int(p.max_tokens) and lo <= p.max_tokens <= L["max_tokens"], "max_tokens",
          f"an integer in [{lo}, {L['max_tokens']}]" + (" (0 only with prompt_logprobs)" if lo else ""))
    check(is_num(p.temperature) and 0 <= p.temperature < math.inf and fits_float(p.temperature),
          "temperature", "a finite number >= 0")
    check(is_int(p.top_k) and p.top_k >= 0, "top_k", "an integer >= 0 (0 = off)")   # clamped to the vocabulary
    check(is_num(p.top_p) and 0 < p.top_p <= 1, "top_p", "a number in (0, 1]")
    lo, hi = L["seed"]
    check(p.seed is None or (is_int(p.seed) and lo <= p.seed <= hi), "seed",
          "None or an integer in [-2**63, 2**64 - 1]")
    if isinstance(p.stop, str):
        p.stop = [p.stop]
    check(isinstance(p.stop, (list, tuple)) and len(p.stop) <= L["stop"] and all(
          isinstance(s, str) and 0 < len(s) <= L["stop_chars"] for s in p.stop), "stop",
          f"a list of at most {L['stop']} non-empty strings of at most {L['stop_chars']} characters")
    p.stop = list(p.stop)
    check(isinstance(p.stop_token_ids, (list, tuple)) and len(p.stop_token_ids) <= L["stop_token_ids"]
          and all(is_int(t) and 0 <= t < 2**63 for t in p.stop_token_ids), "stop_token_ids",
          f"a list of at most {L['stop_token_ids']} token ids")
    p.stop_token_ids = list(p.stop_token_ids)
    check(isinstance(p.ignore_eos, bool), "ignore_eos", "a bool")
    check(is_int(p.n) and 1 <= p.n <= L["n"], "n", f"an integer in [1, {L['n']}]")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        check(k is None or (is_int(k) and 0 <= k <= L[name]), name, f"None or an integer in [0, {L[name]}]")
    for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        lo, hi = L[name]
        check(is_num(getattr(p, name)) and lo <= getattr(p, name) <= hi, name, f"a number in [{lo}, {hi}]")


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
    check_prompt_length(len(ids), max_len, "context" if max_len == cfg.max_seq_len else "KV cache pool")
    check_seats(params.n, max_num_seqs)     # its n samples run side by side
    return ids


def new_request_id(request_id, in_use, counter) -> str:
    """A request's id: the caller's (as a string), which no live request may hold, or the counter's next."""
    request_id = str(next(counter)) if request_id is None else str(request_id)
    if request_id in in_use:
        raise ValueError(f"request id {request_id!r} is already in use")
    return request_id


@contextlib.contextmanager
def naming(what: str):
    """Re-raise a ValueError or TypeError with `what` in front: which prompt of a list was refused."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise type(e)(f"{what}: {e}") from None


def unschedulable(request_id, num_tokens: int, num_blocks: int) -> str:
    """Why a request fails at once: even an empty engine could not hold it."""
    return (f"request {request_id} cannot be scheduled even in an "
            f"empty engine ({num_tokens} tokens, {num_blocks} blocks)")


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


def check_chat(messages, chat_template: str | None) -> None:
    """Tokenizer.apply_chat_template's input: a non-empty list of {'role', 'content'} string dicts,
    for a checkpoint whose template is ChatML (the only one implemented)."""
    if "<|im_start|>" not in (chat_template or ""):
        raise ValueError("this checkpoint's chat template is not ChatML; only ChatML is implemented")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"each message needs a string 'role' and 'content', got {m!r}")


# ----------------------------------------------------------------------------
# Engine options
# ----------------------------------------------------------------------------

def check_positive_ints(**values) -> None:
    for name, v in values.items():
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def check_engine_options(max_num_seqs, max_num_batched_tokens, compile: bool, tensor_parallel_size) -> None:
    """LLM's batch limits, and options that cannot go together."""
    check_positive_ints(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    if compile and tensor_parallel_size != 1:
        raise ValueError("compile=True with tensor_parallel_size > 1 is not supported")


def check_pool_size(num_blocks: int, needed: int, budget: int, block_size: int, bytes_per_token: int) -> None:
    """A KV pool's byte budget must hold the blocks the engine needs (a compiled step: one scratch block more)."""
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


def check_speculative(speculative, k, max_k: int, max_num_batched_tokens: int) -> None:
    """speculative is None, "ngram" or a draft model directory; k drafts
    per step fit in [1, max_k] and, with the token they verify, in one step's budget."""
    if speculative is None:
        return
    if not is_int(k) or not 1 <= k <= max_k:
        raise ValueError(f"num_speculative_tokens must be an integer in [1, {max_k}], got {k!r}")
    if max_num_batched_tokens < k + 1:
        raise ValueError(f"speculation needs max_num_batched_tokens >= num_speculative_tokens + 1 = {k + 1}")
    if speculative != "ngram" and not (isinstance(speculative, str) and os.path.isdir(speculative)):
        raise ValueError(f"speculative must be None, 'ngram' or a draft model directory, got {speculative!r}")


def check_tensor_parallel(cfg, world_size: int, device_type: str = "cpu") -> None:
    """parallel.py's split needs each rank to own whole heads, KV heads, FFN columns and
    vocabulary rows (vLLM replicates KV heads and pads the vocabulary; we refuse), and one
    GPU per rank on CUDA."""
    check_world_size(world_size, device_type)      # a positive integer; on CUDA, that many GPUs
    sizes = {"attention heads": cfg.n_heads, "KV heads": cfg.n_kv_heads,
             "FFN width": cfg.ffn_dim, "vocabulary size": cfg.vocab_size}
    bad = [f"{name} {n}" for name, n in sizes.items() if n % world_size]
    if bad:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's attention heads, "
                         f"KV heads, FFN width and vocabulary size; it does not divide: {', '.join(bad)}")


def check_shardable(linear, types) -> None:
    """shard_model slices each linear once, right after loading: an already sharded one is refused."""
    if type(linear) not in types:
        raise TypeError(f"cannot shard a {type(linear).__name__}: shard the model once, "
                        f"right after loading (and quantize_model)")


def check_kv_pool_args(num_blocks, kv_cache_dtype) -> None:
    """A tensor-parallel group's KV pool: a positive block count, a known storage type."""
    if not is_int(num_blocks) or num_blocks < 1 or kv_cache_dtype not in (None, "int8"):
        raise ValueError(f"need num_blocks >= 1 and kv_cache_dtype None or 'int8', "
                         f"got {num_blocks!r}, {kv_cache_dtype!r}")


def check_same_vocabulary(path, draft_config, draft_tokenizer, target_config, target_tokenizer) -> None:
    """A draft model proposes token ids the target must read as the same tokens (configs' vocab_size,
    tokenizers' ranks)."""
    if draft_config.vocab_size != target_config.vocab_size or draft_tokenizer.ranks != target_tokenizer.ranks:
        raise ValueError(f"the draft model at {path} has a different vocabulary "
                         f"({draft_config.vocab_size} tokens) than the target ({target_config.vocab_size})")
