"""
prune.py -- a smaller model from a trained one: score every unit, cut the least useful, distill.

Lesson (lecture chapter 8's last row, Minitron: Muralidharan et al. 2024): decode streams every
weight once a step (the roofline), so a model with 0.7x the parameters decodes in ~0.7x the
time. Training it from scratch costs what the original cost; Minitron instead (1) scores each
attention group, MLP channel and layer by its activations on a small calibration text, (2) cuts
the lowest-scored ones out of the trained weights, and (3) distills: the small model learns the
big one's next-token distributions (a KL loss on its logits), a few hundred steps instead of a
pretraining run. "0.5x the size, ~2x the speed, < 5% drop, training needed."

Where it sits: offline, before serving. It reads a checkpoint (model.load_model) and writes an
ordinary Hugging Face directory (support.checkpoint.write_checkpoint) that LLM(path),
serve.py --model and transformers load:

    python prune.py --out pruned/ --target-params 0.7 --steps 60

Plain GQA models only: MLA, CLA and sliding windows are refused (their units are not this file's).
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.nn.functional as F

from model import ModelConfig, Transformer, fused_rows, load_model
from support.calibration import calibration_ids
from support.checks import check_prunable
from support.cli import prune_arguments
from support.checkpoint import write_checkpoint

# --- 1. Importance: what each unit does on calibration text ---------------------------------------
# A unit that writes little into the residual stream on real text is cheap to remove. Minitron's
# activation-based scores, one forward pass, no gradients:
#   MLP channel j:   mean over tokens of |silu(gate_j) * up_j|  (what down_proj reads from it)
#   KV group g:      mean over tokens of || the outputs of g's query heads ||  (what o_proj reads)
#   layer l:         1 - cos(x_in, x_out)  (block importance: a layer that barely turns the
#                    residual stream can go; ShortGPT's measure, Minitron's depth axis)


@torch.no_grad()
def importance(model: Transformer, ids: list[int]) -> dict:
    """Scores on one calibration sequence: {"layers": [L], "channels": [L, F], "groups": [L, n_kv]};
    higher = more important."""
    cfg, found, hooks = model.config, {"layers": [], "channels": [], "groups": []}, []

    def mlp(module, args, out):                               # args[0]: down_proj's input [N, F]
        found["channels"].append(args[0].abs().mean(0))

    def attn(module, args, out):                              # o_proj's input [N, H d]
        a = args[0].view(len(args[0]), cfg.n_kv_heads, -1)   # [N, n_kv, group d]: heads of a group
        found["groups"].append(a.norm(dim=-1).mean(0))       # are adjacent (head h reads kv h // g)

    def block(module, args, out):                             # args[0]: the block's input [N, D]
        found["layers"].append(1 - F.cosine_similarity(args[0], out, dim=-1).mean())

    for layer in model.layers:
        hooks += [layer.mlp.down_proj.register_forward_hook(mlp), layer.register_forward_hook(
            block), layer.self_attn.o_proj.register_forward_hook(attn)]
    dev = model.embed_tokens.weight.device
    try:
        model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev))
    finally:
        for h in hooks:
            h.remove()
    return {k: torch.stack(v).float() for k, v in found.items()}


# --- 2. Surgery: the kept rows and columns of every weight, as a smaller model ------------------

def n_params(cfg: ModelConfig) -> int:
    """Parameters of a shape, counted on the meta device (a tied LM head once)."""
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(cfg).parameters())


def target_shape(cfg: ModelConfig, target: float, depth_share: float = 0.5) -> ModelConfig:
    """The shape with `target` x the parameters: depth_share of the cut as whole layers, the rest
    as MLP channels of every kept layer (multiples of 64 kept: the matmul tiles stay full)."""
    total = n_params(cfg)
    per_layer = total - n_params(dataclasses.replace(cfg, n_layers=cfg.n_layers - 1))
    layers = cfg.n_layers - round(depth_share * (1 - target) * total / per_layer)
    small = dataclasses.replace(cfg, n_layers=max(1, layers))
    per_channel = small.n_layers * 3 * cfg.dim               # a gate row, an up row, a down column
    ffn = cfg.ffn_dim - 64 * math.ceil((n_params(small) - target * total) / per_channel / 64)
    return dataclasses.replace(small, ffn_dim=max(64, min(cfg.ffn_dim, ffn)))


def top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k highest scores, in their original order (layers keep their order)."""
    return scores.topk(k).indices.sort().values


@torch.no_grad()
def cut(model: Transformer, scores: dict, shape: ModelConfig) -> Transformer:
    """A new model of `shape` (fewer layers, MLP channels, KV groups) holding the kept slices of
    `model`'s weights: exactly `model` with the cut units' outputs zeroed, minus whole layers."""
    cfg, sd, out = model.config, model.state_dict(), {}
    g, d = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim       # query heads per group, head dim
    # assignment: pruning
    for new, old in enumerate(top(scores["layers"], shape.n_layers).tolist()):
        p, q = f"layers.{old}.", f"layers.{new}."
        ch = top(scores["channels"][old], shape.ffn_dim)
        grp = top(scores["groups"][old], shape.n_kv_heads)
        ar = torch.arange(g * d, device=grp.device)
        kv = (grp[:, None] * d + ar[:d]).flatten()                   # a group's k (and v) rows
        qr = (grp[:, None] * g * d + ar).flatten()                   # its g query heads' rows
        rows = torch.cat([qr, cfg.n_heads * d + kv, (cfg.n_heads + cfg.n_kv_heads) * d + kv])
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight",
                     "self_attn.o_proj.bias"):                       # kept whole (a bias: if any)
            if p + name in sd:
                out[q + name] = sd[p + name]
        for name in ("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"):
            if p + name in sd:                                       # [q; k; v] rows: the kept ones
                out[q + name] = sd[p + name][rows]
        out[q + "self_attn.o_proj.weight"] = sd[p + "self_attn.o_proj.weight"][:, qr]
        gate, up = sd[p + "mlp.gate_up_proj.weight"].chunk(2)       # [gate; up] rows
        out[q + "mlp.gate_up_proj.weight"] = torch.cat([gate[ch], up[ch]])
        out[q + "mlp.down_proj.weight"] = sd[p + "mlp.down_proj.weight"][:, ch]
    # end assignment
    out.update((k, v) for k, v in sd.items() if not k.startswith("layers."))
    with torch.device("meta"):
        small = Transformer(shape)
    small.load_state_dict({k: v.clone() for k, v in out.items()}, strict=True, assign=True)
    if shape.tie_embeddings:
        small.lm_head.weight = small.embed_tokens.weight
    small.inv_freq = model.inv_freq.clone()
    return small.requires_grad_(False).eval()


# --- 3. Distillation: learn the original's distributions, not just its argmax ------------------
# loss = KL(teacher || student) = sum_v p_t(v) (log p_t(v) - log p_s(v)), averaged over positions:
# every position gives the whole distribution over 49,152 tokens, far more signal per token than
# the one-hot next token of pretraining, which is why a few hundred steps recover most of the cut.

def distill(student: Transformer, teacher: Transformer, texts: list[list[int]], steps: int,
            lr: float = 1e-4, log=print) -> list[float]:
    """AdamW on the KL to the teacher's logits, one sequence of `texts` a step (round robin);
    returns the losses. The student comes back frozen (eval, no grad)."""
    student.requires_grad_(True).train()
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        ids = torch.tensor(texts[step % len(texts)], device=teacher.embed_tokens.weight.device)
        pos = torch.arange(len(ids), device=ids.device)
        with torch.no_grad():
            p_t = F.log_softmax(teacher(ids, pos), dim=-1)               # [T, V]
        p_s = F.log_softmax(student(ids, pos), dim=-1)
        loss = F.kl_div(p_s, p_t, log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        log(f"distill {step + 1}/{steps}: KL {losses[-1]:.4f} ({time.perf_counter() - t0:.0f} s)")
    student.requires_grad_(False).eval()
    return losses


def teacher_texts(llm, n: int = 32, tokens: int = 128, seed: int = 0) -> list[list[int]]:
    """Distillation data the teacher (`llm`, an engine on its weights) writes itself, never the
    evaluation text: n samples (temperature 1) from varied openings, each prompt + sample ids."""
    from sampler import SamplingParams
    openers = ["The history of", "In a small village", "How to make", "Scientists have found",
               "Dear friend,", "The best way to learn", "Once upon a time", "A guide to"]
    params = [SamplingParams(temperature=1.0, max_tokens=tokens, seed=seed + i, ignore_eos=True)
              for i in range(n)]
    outs = llm.generate([openers[i % len(openers)] for i in range(n)], params)
    return [o.prompt_token_ids + o.token_ids for o in outs]


def main(argv=None):
    """Score, cut, distill, write (the flags: support/cli.py)."""
    from engine import LLM
    args = prune_arguments(argv)
    llm = LLM(args.model)                    # the original's engine: its tokenizer, its samples
    teacher, cfg = load_model(llm.path)
    check_prunable(cfg)                      # plain GQA: MLA, CLA and windows have other units
    shape = target_shape(cfg, args.target_params, args.depth_share)
    student = cut(teacher, importance(teacher, calibration_ids(llm.tokenizer, 1024)), shape)
    print(f"cut: {n_params(cfg) / 1e6:.1f}M -> {n_params(shape) / 1e6:.1f}M parameters "
          f"({shape.n_layers} layers, MLP {shape.ffn_dim}, {shape.n_kv_heads} KV groups)")
    if args.steps:
        distill(student, teacher, teacher_texts(llm, args.texts), args.steps, args.lr)
    write_checkpoint(student.state_dict(), shape, fused_rows(shape), args.out, source=llm.path)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
