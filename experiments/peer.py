"""
peer -- what a serving engine adds over a plain generate loop.

Claim (lecture): continuous batching and a paged KV cache serve a heterogeneous workload faster
than static batches padded to their longest member. Baseline: Hugging Face transformers'
LlamaForCausalLM.generate, what a user without a serving engine would write, on the same
weights (the engine's own, copied into transformers' model), the same requests, in the same
run. Skipped when transformers is not installed (it is not a dependency).
"""
from __future__ import annotations

import time

import torch

from cache import kv_cache_bytes
from model import fused_rows
from sampler import SamplingParams
from support.checkpoint import PRESETS, RANDOM_PREFIX, hf_state_dict, parse_random_path

from experiments.common import model_config, seats, table, workload
from experiments.continuous_vs_static import STEP_KINDS, latency_stats, static_and_continuous_steps
from experiments.plan import Phase, build_seconds, decode, prefill, seconds, weight_bytes

NAME = "peer"
# seats: nanoinfer's, and the size of transformers' static batches; requests: common.HETEROGENEOUS
WORKLOAD = {"cpu": dict(seats=16, engine={}), "cpu-quick": dict(seats=8, engine={}),
            "gpu": dict(seats=16, engine={}), "gpu-quick": dict(seats=16, engine={})}
SKIPPED = "transformers is not installed (pip install transformers: the peer it is compared with)"


def hf_llama(llm, path: str):
    """transformers' LlamaForCausalLM with the config of `path` and the engine's own weights: built
    from the engine's state dict (model.py keeps Hugging Face's parameter names but the "model."
    prefix), in the engine's dtype (never a float32 copy of an 8B model). Raises ValueError if the
    two disagree on any tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**PRESETS[parse_random_path(path)[0]]) if str(path).startswith(RANDOM_PREFIX) else \
        LlamaConfig.from_pretrained(path)
    old = torch.get_default_dtype()
    torch.set_default_dtype(llm.dtype)
    try:
        with torch.device(llm.device):
            hf = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    ours = {("" if k == "lm_head.weight" else "model.") + k: v
            for k, v in hf_state_dict(llm.model.state_dict(), fused_rows(llm.config)).items()}
    missing, unexpected = hf.load_state_dict(ours, strict=False)
    if missing or unexpected:
        raise ValueError(f"transformers' Llama and nanoinfer's disagree: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def run(b):
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": SKIPPED}, f"Skipped: {SKIPPED}."
    w = b.sizes(WORKLOAD)
    llm, B = b.llm(**w.engine), w.seats
    prompts, lengths = workload(b, llm.config.vocab_size)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    b.progress("peer: nanoinfer")
    llm.generate([prompts[0]], params[0])
    with seats(llm, B):
        t0, before = time.perf_counter(), dict(llm.stats)
        ours = latency_stats(llm.generate(prompts, params), t0, time.perf_counter() - t0, before, llm.stats)
    try:
        hf = hf_llama(llm, b.path)
    except Exception as e:                        # e.g. a shape transformers' config refuses
        return ({"skipped": f"transformers cannot build {b.path}: {e!r}"},
                f"Skipped: transformers cannot build the model ({e!r}).")
    # Batches of B run to the longest request's length (generate has no continuous batching),
    # padded on the left so every row's last token is a real one.
    pad, t0, tokens = 0, time.perf_counter(), 0
    for i in range(0, len(prompts), B):
        b.progress(f"peer: transformers, group {i // B + 1}")
        group, want = prompts[i:i + B], lengths[i:i + B]
        width = max(map(len, group))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=llm.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=llm.device)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(want), min_new_tokens=max(want),
                        do_sample=False, pad_token_id=pad)
        tokens += sum(want)                       # only the tokens each request asked for count
    hf_s = time.perf_counter() - t0
    fig = {"requests": len(prompts), "nanoinfer_tokens": ours["output_tokens"], "transformers_tokens": tokens,
           "nanoinfer_tokens_per_s": ours["tokens_per_s"], "transformers_tokens_per_s": tokens / hf_s,
           "speedup": ours["tokens_per_s"] / (tokens / hf_s), "compiled": llm.decoder is not None,
           **{k: ours[k] for k in STEP_KINDS}}
    text = table(["engine", "output tokens/s"], [["nanoinfer (continuous batching)", ours["tokens_per_s"]],
                                                  [f"transformers generate (static batches of {B})", tokens / hf_s]])
    return fig, text + f"\n\nnanoinfer: {fig['speedup']:.2f}x the throughput of transformers' generate."


def plan(s):
    w = s.sizes(WORKLOAD)
    o = s.options(**w.engine)
    cfg, _ = model_config(o["path"])
    prompts, lengths = workload(s, cfg.vocab_size)
    static, cont = static_and_continuous_steps(lengths, w.seats)
    longest = max(map(len, prompts)) + max(lengths)
    # transformers' copy of the weights and its cache of a static batch, beside the engine; its steps eager
    hf = s.options(compile=False, share=False, max_num_seqs=w.seats, kv_cache_bytes=0)
    extra = weight_bytes(o) + kv_cache_bytes(cfg, s.dtype, w.seats * longest)
    return [Phase([o], [prefill(o, sum(map(len, prompts)), longest / 2), decode(o, cont, w.seats, longest / 2),
                        seconds(build_seconds(hf)), prefill(hf, sum(map(len, prompts)), longest / 2),
                        decode(hf, static, w.seats, longest / 2)],
                  context=longest, extra=extra)]
