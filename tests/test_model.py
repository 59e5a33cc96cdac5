"""Assignment: model.py -- a Llama-style decoder.

To pass, implement:
  * RMSNorm (equal to torch's F.rms_norm), RoPE (equal to rotating complex
    pairs, with scores depending only on relative position), GQA attention
    by grouping query heads (equal to SDPA with K/V heads repeated);
  * Transformer.forward(input_ids[N], positions[N], ctx=None): the dense
    causal path over one sequence;
  * load_model for Hugging Face checkpoints (single file and sharded,
    tied and untied LM heads, Llama-3.1 rope scaling, attention bias),
    with clear errors for broken checkpoints;
  * default_model_path: converting the GGUF of SmolLM2 correctly;
  * generate: naive greedy generation without a cache.
The real model must reproduce logits from Hugging Face transformers
(tests/fixtures/make_model_fixture.py made them) within 1e-4 in float32.
"""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import FIXTURES, tiny_config, tiny_model
from safetensors.torch import load_file

from model import (ModelConfig, RMSNorm, Transformer, apply_rope, dense_causal_attention, generate,
                   load_model, rope_frequencies)

GOLDEN = load_file(os.path.join(FIXTURES, "model_golden.safetensors"))


# ---------------------------------------------------------------- the pieces

def test_rmsnorm_equals_torch_rms_norm():
    torch.manual_seed(0)
    norm = RMSNorm(48, eps=1e-5)
    norm.weight.data.uniform_(0.5, 2)
    x = torch.randn(7, 48) * 3
    ref = F.rms_norm(x, (48,), norm.weight, eps=1e-5)
    assert torch.allclose(norm(x), ref, atol=1e-6), "RMSNorm must be w * x / sqrt(mean(x^2) + eps)"


def rope_as_complex(x, positions, inv_freq):
    """Independent RoPE: pair dim i with dim i + d/2 as one complex number and
    multiply it by e^(i * position * inv_freq[i])."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    angle = positions.double()[:, None, None] * inv_freq.double()[None, None, :]
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1).float()


def rope(x, positions, cfg):
    angles = positions.float()[:, None] * rope_frequencies(cfg)[None]
    return apply_rope(x, angles.cos()[:, None], angles.sin()[:, None])


def test_rope_is_a_rotation_of_complex_pairs():
    cfg = tiny_config()
    torch.manual_seed(0)
    x = torch.randn(5, 3, cfg.head_dim)
    pos = torch.tensor([0, 1, 7, 100, 1000])
    got = rope(x, pos, cfg)
    assert torch.allclose(got, rope_as_complex(x, pos, rope_frequencies(cfg)), atol=1e-4)
    assert torch.allclose(got.norm(dim=-1), x.norm(dim=-1), atol=1e-4), "a rotation keeps the norm"


def test_rope_scores_depend_only_on_relative_position():
    cfg = tiny_config()
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, cfg.head_dim), torch.randn(1, 1, cfg.head_dim)

    def score(m, n):
        return (rope(q, torch.tensor([m]), cfg) * rope(k, torch.tensor([n]), cfg)).sum().item()
    for m, n in [(5, 2), (10, 7), (103, 100), (3, 0)]:   # all m - n = 3
        assert score(m, n) == pytest.approx(score(3, 0), abs=1e-4), f"score({m},{n}) != score(3,0)"
    assert score(9, 2) != pytest.approx(score(3, 0), abs=1e-3), "different offsets must differ"


def test_llama3_rope_scaling_frequencies():
    """Llama 3.1's rule: wavelengths above old_ctx/low_freq_factor are slowed
    down by `factor`, those below old_ctx/high_freq_factor are untouched."""
    cfg = tiny_config(head_dim=64, rope_theta=500000.0,
                      rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192})
    base = rope_frequencies(tiny_config(head_dim=64, rope_theta=500000.0))
    scaled = rope_frequencies(cfg)
    wavelen = 2 * torch.pi / base
    assert torch.equal(scaled[wavelen < 2048], base[wavelen < 2048])
    assert torch.allclose(scaled[wavelen > 8192], base[wavelen > 8192] / 8)
    mid = (wavelen > 2048) & (wavelen < 8192)
    assert mid.any() and ((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8)).all()


@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (6, 2), (8, 2), (9, 3)])
def test_dense_attention_equals_sdpa(n_heads, n_kv):
    torch.manual_seed(0)
    N, d = 13, 16
    q, k, v = torch.randn(N, n_heads, d), torch.randn(N, n_kv, d), torch.randn(N, n_kv, d)
    got = dense_causal_attention(q, k, v)
    # SDPA wants [heads, N, d] and one K/V per query head: repeat each KV head G times.
    G = n_heads // n_kv
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(G, 1).transpose(0, 1),
                                         v.repeat_interleave(G, 1).transpose(0, 1), is_causal=True)
    assert torch.allclose(got, ref.transpose(0, 1), atol=1e-5), "causal GQA attention != SDPA"


def test_gqa_equals_mha_with_repeated_kv_heads():
    """A GQA model computes exactly what multi-head attention computes when
    each K/V head's weights are copied to the G query heads that share it."""
    gqa = tiny_model(n_heads=6, n_kv_heads=2)
    mha = Transformer(tiny_config(n_heads=6, n_kv_heads=6)).eval()
    sd = gqa.state_dict()
    for name in list(sd):
        if name.endswith(("k_proj.weight", "v_proj.weight")):   # [n_kv*d, D] -> [H*d, D]
            w = sd[name].view(2, 16, 64)
            sd[name] = w.repeat_interleave(3, dim=0).reshape(6 * 16, 64)
    mha.load_state_dict(sd)
    ids = torch.randint(0, 512, (20,))
    pos = torch.arange(20)
    assert torch.allclose(gqa(ids, pos), mha(ids, pos), atol=1e-4)


def test_tiny_model_is_causal_and_position_aware():
    model = tiny_model()
    ids = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(0))
    full = model(ids, torch.arange(12))
    prefix = model(ids[:7], torch.arange(7))
    assert torch.allclose(full[:7], prefix, atol=1e-5), "a token must not see the future"
    shifted = model(ids[:7], torch.arange(7) + 50)
    assert torch.allclose(prefix, shifted, atol=1e-4), "RoPE sees relative positions only"
    spread = model(ids[:7], torch.arange(7) * 2)
    assert not torch.allclose(prefix, spread, atol=1e-3), "relative positions must change the output"


# ------------------------------------------------ against Hugging Face transformers

def test_tiny_sharded_llama3_checkpoint_matches_transformers():
    """tests/fixtures/tiny_llama3 was written by transformers' save_pretrained
    (3 shards + index, untied head, attention bias, llama3 rope scaling)."""
    model, cfg = load_model(os.path.join(FIXTURES, "tiny_llama3"))
    assert cfg.rope_scaling and not cfg.tie_embeddings and cfg.attention_bias
    ids = GOLDEN["tiny_ids"]
    got = model(ids, torch.arange(len(ids)))
    assert (got - GOLDEN["tiny_logits"]).abs().max() < 1e-4


@pytest.mark.parametrize("i", range(4))
def test_real_model_logits_match_transformers(real_model, i):
    ids = GOLDEN[f"ids_{i}"]
    logits = real_model(ids, torch.arange(len(ids)))[:, GOLDEN["cols"]]
    err = (logits - GOLDEN[f"logits_{i}"]).abs().max().item()
    assert err < 1e-4, f"prompt {i}: max |logit - transformers| = {err:.2e}"


@pytest.mark.parametrize("i", range(4))
def test_real_model_greedy_tokens_match_transformers(real_model, i):
    ids = GOLDEN[f"ids_{i}"].tolist()
    ref = GOLDEN[f"greedy_{i}"].tolist()
    assert generate(real_model, ids, len(ref)) == ref


def test_chat_answers_paris(real_model, real_tokenizer):
    prompt = real_tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                tokenize=True)
    out = generate(real_model, prompt, 12, eos_token_id=real_tokenizer.eos_token_id)
    assert "Paris" in real_tokenizer.decode(out)


def test_sampled_generation_is_seeded_and_stops_at_eos():
    model = tiny_model()
    a = generate(model, [1, 2, 3], 30, temperature=1.0, generator=torch.Generator().manual_seed(5))
    b = generate(model, [1, 2, 3], 30, temperature=1.0, generator=torch.Generator().manual_seed(5))
    c = generate(model, [1, 2, 3], 30, temperature=1.0, generator=torch.Generator().manual_seed(6))
    assert a == b and a != c
    greedy = generate(model, [1, 2, 3], 30)
    eos = greedy[4]
    assert generate(model, [1, 2, 3], 30, eos_token_id=eos)[-1] == eos
    assert len(generate(model, [1, 2, 3], 30, eos_token_id=eos)) == greedy.index(eos) + 1


# ------------------------------------------------------------------ bad input

def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def copy_tiny(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(os.path.join(FIXTURES, "tiny_llama3"), d)
    return d


def test_corrupt_config(tmp_path):
    d = copy_tiny(tmp_path)
    (d / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(str(d))


def test_unsupported_architecture(tmp_path):
    d = copy_tiny(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(str(d))


def test_truncated_safetensors(tmp_path):
    d = copy_tiny(tmp_path)
    shard = d / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:5000])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_model(str(d))


def test_missing_tensor(tmp_path):
    d = copy_tiny(tmp_path)
    (d / "model-00003-of-00003.safetensors").unlink()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not v.startswith("model-00003")}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lacks tensors"):
        load_model(str(d))


def test_prompt_longer_than_context():
    model = tiny_model(max_seq_len=32)
    with pytest.raises(ValueError, match="context"):
        generate(model, list(range(30)), 5)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(40, dtype=torch.long), torch.arange(40))
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], 5)


def test_config_rejects_inconsistent_heads():
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig.from_hf({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
                             "num_attention_heads": 4, "num_key_value_heads": 3,
                             "intermediate_size": 8, "vocab_size": 10})
