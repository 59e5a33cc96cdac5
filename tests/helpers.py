"""Helpers the tests import: the repository's paths, tiny random Llamas, and
writing a model as a checkpoint directory. (Fixtures live in conftest.py;
pytest advises against importing from a conftest.)"""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
FIXTURES = os.path.join(ROOT, "tests", "fixtures")

from model import ModelConfig, Transformer, default_model_path, fused_rows  # noqa: E402
from support.checkpoint import hf_state_dict, write_checkpoint  # noqa: E402


def hf_sd(model) -> dict:
    """A model's state dict under Hugging Face's names (q_proj, k_proj, v_proj, gate_proj, up_proj:
    model.FUSED's parts, split back)."""
    return hf_state_dict(model.state_dict(), fused_rows(model.config))


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer Llama small enough to run thousands of steps in a test."""
    base = dict(dim=64, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=16, ffn_dim=128,
                vocab_size=512, rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=True,
                max_seq_len=1024)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    """Random weights, scaled so logits are far from uniform (ties would make
    greedy comparisons meaningless)."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.5 if "embed" in name else 0.2)
    return model.eval().requires_grad_(False)


def save_checkpoint(model, directory, tokenizer_from=None):
    """Write a model as a Hugging Face checkpoint directory (config.json +
    model.safetensors), with the default model's tokenizer files (eos 2, bos 1: its ids)."""
    import dataclasses
    c = model.config
    c = dataclasses.replace(c, eos_token_id=2 if c.eos_token_id is None else c.eos_token_id,
                            bos_token_id=1 if c.bos_token_id is None else c.bos_token_id)
    return write_checkpoint(model.state_dict(), c, fused_rows(c), directory, tokenizer_from or default_model_path())


def assert_no_leak(llm):
    """Every KV block back in the free list, the pool consistent, nothing left running."""
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks leaked"
    bm.check_invariants()
    assert not llm.scheduler.running and not llm.scheduler.waiting and not llm.requests


def assert_dense_prompt_logprobs(model, ids, got, k):
    logits = model(torch.tensor(ids), torch.arange(len(ids))).float()                 # [L, V], dense, no ctx
    ref, tol = torch.log_softmax(logits, dim=-1), 1e-5 + 1e-6 * torch.logsumexp(logits, dim=-1).abs()
    assert got is not None and len(got) == len(ids) and got[0] is None, "one entry per prompt token, the first None"
    for i in range(1, len(ids)):
        lp, top = got[i]
        assert lp == pytest.approx(ref[i - 1, ids[i]].item(), abs=tol[i - 1].item()), f"prompt position {i}"
        values, indices = ref[i - 1].topk(k)
        assert list(top) == indices.tolist(), f"prompt position {i}: the top-{k} ids"
        assert list(top.values()) == pytest.approx(values.tolist(), abs=tol[i - 1].item())


def run_staggered(llm, prompts, params):
    """Requests join at different steps, finish at different lengths."""
    ids, outs, step = {}, {}, 0
    pending = list(enumerate(prompts))
    while pending or llm.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            ids[llm.add_request(p, params[i])] = i
        for o in llm.step():
            if o.finished:
                outs[ids[o.request_id]] = o.token_ids
        step += 1
    return [outs[i] for i in range(len(prompts))]
