"""Assignment: prune.py -- structured pruning by calibration importance, then distillation.

To pass, implement:
  * importance(model, ids): per layer 1 - cos(block input, block output), per MLP channel the
    mean |silu(gate) * up|, per KV group the mean norm of its query heads' outputs (o_proj's
    input), from one forward pass with hooks; a unit that writes nothing scores 0;
  * target_shape(cfg, target): the layers and MLP channels that leave <= target x the parameters;
  * cut(model, scores, shape): the kept rows and columns of every weight as a smaller
    Transformer, EXACTLY the original with the cut units' outputs zeroed (float32, 1e-5);
  * distill(student, teacher, texts, steps): AdamW on KL(teacher || student), which falls.
The pruned model is written as a Hugging Face checkpoint that nanoinfer and transformers load
with the same logits.
"""
import copy

import pytest
import torch
from helpers import tiny_model

import prune
from model import fused_rows, load_model, read_config
from support.checkpoint import write_checkpoint


def model_and_scores(seed=0, heads=6, bias=False):
    """A 3-layer tiny Llama (`heads` query heads over 2 KV groups, 128 MLP channels; q/k/v/o biases
    with bias, as Qwen2-style checkpoints have) and random scores: any scores define a valid cut,
    so the surgery is tested apart from the scoring."""
    m = tiny_model(seed, n_layers=3, n_heads=heads, attention_bias=bias)
    g = torch.Generator().manual_seed(seed)
    scores = {"layers": torch.rand(3, generator=g), "channels": torch.rand(3, 128, generator=g),
              "groups": torch.rand(3, 2, generator=g)}
    return m, scores


def kept(scores, k):
    """The k highest-scored indices, as a set (the test's own top-k, not prune.top)."""
    return set(torch.argsort(scores, descending=True)[:k].tolist())


def zeroed(model, scores, shape):
    """The reference: the original model with every cut unit's output set to zero (a layer: its
    o_proj and down_proj, so the block adds nothing; a channel: its down_proj column; a KV group:
    its query heads' o_proj columns)."""
    ref, cfg = copy.deepcopy(model), model.config
    g, d = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    keep_layers = kept(scores["layers"], shape.n_layers)
    with torch.no_grad():
        for i, layer in enumerate(ref.layers):
            if i not in keep_layers:
                for p in (*layer.self_attn.o_proj.parameters(), layer.mlp.down_proj.weight):
                    p.zero_()
                continue
            cut_ch = sorted(set(range(cfg.ffn_dim)) - kept(scores["channels"][i], shape.ffn_dim))
            layer.mlp.down_proj.weight[:, cut_ch] = 0
            for grp in set(range(cfg.n_kv_heads)) - kept(scores["groups"][i], shape.n_kv_heads):
                layer.self_attn.o_proj.weight[:, grp * g * d:(grp + 1) * g * d] = 0
    return ref


@pytest.mark.parametrize("layers, ffn, groups, bias", [(3, 64, 2, False), (3, 128, 1, True), (2, 128, 2, False),
                                                       (2, 64, 1, True)])
@pytest.mark.assignment("pruning")
@pytest.mark.needs("model")
def test_cut_is_the_original_with_the_cut_units_zeroed(layers, ffn, groups, bias):
    import dataclasses
    m, scores = model_and_scores(bias=bias)
    scores["layers"] = torch.tensor([0.2, 0.9, 0.5])         # a cut takes layer 0: kept layers move down
    scores["groups"] = torch.tensor([[.9, .1], [.1, .9], [.9, .1]])   # neighbours disagree: old index, not new
    shape = dataclasses.replace(m.config, n_layers=layers, ffn_dim=ffn, n_kv_heads=groups, n_heads=3 * groups)
    small = prune.cut(m, scores, shape)
    ids = torch.randint(0, m.config.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(20)
    got, ref = small(ids, pos), zeroed(m, scores, shape)(ids, pos)
    err = (got - ref).abs().max().item()
    assert err < 1e-5, (f"cut to {layers} layers, {ffn} channels, {groups} groups differs from the original "
                        f"with those units zeroed by {err:.2e}: a wrong row or column was kept")
    assert sum(p.numel() for p in small.parameters()) == prune.n_params(shape), "the small model has the shape's parameters"
    assert (got - m(ids, pos)).abs().max().item() > 1e-3, "the cut must change the model (else the test proves nothing)"


@pytest.mark.needs("model")
def test_importance_scores_a_unit_that_writes_nothing_zero():
    m = tiny_model(0, n_layers=3)
    cfg, d = m.config, m.config.head_dim
    with torch.no_grad():
        m.layers[1].self_attn.o_proj.weight.zero_()             # layer 1 adds nothing: x_out = x_in
        m.layers[1].mlp.down_proj.weight.zero_()
        m.layers[0].mlp.gate_up_proj.weight[5] = 0              # channel 5 of layer 0: silu(0) * up = 0
        v0 = (cfg.n_heads + cfg.n_kv_heads + 1) * d             # layer 2's v rows of KV group 1
        m.layers[2].self_attn.qkv_proj.weight[v0:v0 + d] = 0    # its heads average zeros
    s = prune.importance(m, list(range(3, 40)))
    assert s["layers"].shape == (3,) and s["channels"].shape == (3, 128) and s["groups"].shape == (3, 2)
    assert abs(s["layers"][1].item()) < 1e-6 and s["layers"].argmin().item() == 1, \
        f"a layer that adds nothing scores 1 - cos(x, x) = 0, the lowest: {s['layers'].tolist()}"
    assert s["channels"][0, 5].item() == 0 and s["channels"][0].argmin().item() == 5, "a dead channel scores 0"
    assert s["groups"][2, 1].item() < 1e-6 < s["groups"][2, 0].item(), "a group whose values are 0 outputs 0"
    assert (s["channels"] >= 0).all() and (s["groups"] >= 0).all()


def test_target_shape_keeps_at_most_the_target_share_of_the_parameters():
    cfg = read_config("random:smollm2-135m")
    for target, depth in ((0.7, 0.5), (0.7, 0.0), (0.5, 1.0), (0.85, 0.3)):
        shape = prune.target_shape(cfg, target, depth)
        share = prune.n_params(shape) / prune.n_params(cfg)
        assert target - 0.05 < share <= target, f"target {target}, depth share {depth}: kept {share:.3f}"
        assert shape.ffn_dim % 64 == 0 and (shape.n_layers < cfg.n_layers) == (depth > 0)
    assert prune.n_params(cfg) == 134_515_008, "SmolLM2-135M: 134.5M parameters, the tied head once"


@pytest.mark.needs("model", "pruning")
def test_distillation_lowers_the_kl_to_the_teacher():
    import dataclasses
    teacher, scores = model_and_scores()
    student = prune.cut(teacher, scores, dataclasses.replace(teacher.config, n_layers=2, ffn_dim=64))
    g = torch.Generator().manual_seed(2)
    texts = [torch.randint(0, 512, (32,), generator=g).tolist() for _ in range(4)]
    losses = prune.distill(student, teacher, texts, steps=24, lr=3e-3, log=lambda s: None)
    assert len(losses) == 24 and losses[0] > 0
    assert sum(losses[-4:]) < 0.5 * sum(losses[:4]), f"KL did not fall: {losses[:4]} -> {losses[-4:]}"
    assert not any(p.requires_grad for p in student.parameters()), "the student comes back frozen"
    assert not any(p.requires_grad for p in teacher.parameters()), "the teacher is never trained"


@pytest.mark.assignment("pruning")
@pytest.mark.needs("model")
def test_the_pruned_checkpoint_loads_with_the_same_logits(tmp_path):
    """nanoinfer's loader (strict: every tensor, every shape) and, where installed, transformers'
    LlamaForCausalLM read the written directory and compute the in-memory model's logits.
    (transformers wants the hidden size a multiple of the heads: 4 heads over 2 groups, cut to 1.)"""
    import dataclasses
    m, scores = model_and_scores(heads=4)
    shape = dataclasses.replace(m.config, n_layers=2, ffn_dim=64, n_kv_heads=1, n_heads=2, eos_token_id=2)
    small = prune.cut(m, scores, shape)
    out = write_checkpoint(small.state_dict(), shape, fused_rows(shape), tmp_path / "pruned")
    ids = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(3))
    want = small(ids, torch.arange(16))
    loaded, cfg = load_model(out)
    assert (cfg.n_layers, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads) == (2, 64, 2, 1)
    assert (loaded(ids, torch.arange(16)) - want).abs().max().item() < 1e-6
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(ids[None]).logits[0]
    assert (got - want).abs().max().item() < 1e-4, "transformers reads the pruned checkpoint differently"
