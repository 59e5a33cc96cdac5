"""Shared test helpers: the real default model (loaded once per test session)
and tiny random models for fast unit tests."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
FIXTURES = os.path.join(ROOT, "tests", "fixtures")

from model import ModelConfig, Transformer, default_model_path, load_model  # noqa: E402

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer Llama small enough to run thousands of steps in a test."""
    base = dict(dim=64, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=512,
                rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=True, max_seq_len=1024)
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


@pytest.fixture(scope="session")
def real_path():
    return default_model_path()


@pytest.fixture(scope="session")
def real_model(real_path):
    model, _ = load_model(real_path, device="cpu", dtype=torch.float32)
    return model


@pytest.fixture(scope="session")
def real_tokenizer(real_path):
    from tokenizer import Tokenizer
    return Tokenizer.from_pretrained(real_path)
