"""scripts/kv_conversion.py -- what the KV chapter's savings cost a model that was NOT trained for them.

The default model (SmolLM2-135M-Instruct: 30 layers, GQA with 3 KV heads of 64, so 384 values a token
and layer) converted without any training, its perplexity on the project's evaluation text
(tests/fixtures, never the calibration text) against the KV bytes per token:

  low-rank   a joint latent for K and V (MLA's idea): each layer's K/V projection W_kv [384, D] is
             replaced by P W_kv, P = V_r V_r^T the top-r principal directions of its K/V outputs on
             the calibration text (all 405 tokens of support/calibration.py; MHA2MLA and Palu
             calibrate likewise, on more). The cache then holds c = V_r^T W_kv x, r values, and
             K, V = V_r c. RoPE is applied after the expansion, so unlike trained MLA (a decoupled
             RoPE key) the up-projection cannot be absorbed into the query: the quality side only.
             At r = 384 the model is unchanged (checked: the same perplexity).
  cla        cross-layer attention over pairs (2j, 2j + 1): the second layer attends to the first
             one's K/V and writes none. Pairs are chosen by their own cost on the calibration text,
             cheapest first: 1, 2, 4 pairs, then all 15 (CLA-2 on every layer).

    python scripts/kv_conversion.py --json results/cpu-kv-conversion-2026-11-28.json

Both are trained in by the papers that propose them (DeepSeek-V2, Brandon et al. 2024): the lecture's
"MLA trained from scratch is slightly better than MHA" is not what a conversion gives. Float32, CPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import default_model_path, dense_causal_attention, load_model  # noqa: E402
from support.calibration import calibration_ids  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

from experiments.common import eval_text  # noqa: E402


class PairShared:
    """The dense path's ctx for CLA without training: a layer in `sharers` attends to the K/V of the
    layer before it (its own are computed and dropped); the others to their own."""
    logits_indices = None

    def __init__(self, sharers=()):
        self.sharers, self.kv = set(sharers), {}

    def attend(self, layer: int, q, k, v, scale=None):
        self.kv[layer] = (k, v)
        return dense_causal_attention(q, *self.kv[layer - 1 if layer in self.sharers else layer])


@torch.inference_mode()
def perplexity(model, ids: list[int], sharers=(), window: int = 4096) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[start:start + window + 1])
        logits = model(chunk[:-1], torch.arange(len(chunk) - 1), PairShared(sharers))
        nll += F.cross_entropy(logits.float(), chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)


@torch.inference_mode()
def kv_outputs(model, ids: list[int]) -> list[torch.Tensor]:
    """Each layer's K/V projection outputs [T, 2 n_kv d] (before RoPE) on `ids`, by forward hooks."""
    cfg, outs, hooks = model.config, [], []
    q_rows = cfg.n_heads * cfg.head_dim
    for layer in model.layers:
        hooks.append(layer.self_attn.qkv_proj.register_forward_hook(
            lambda mod, inp, out: outs.append(out[:, q_rows:].clone())))
    model(torch.tensor(ids), torch.arange(len(ids)))
    for h in hooks:
        h.remove()
    return outs


@torch.inference_mode()
def low_rank(model, kv: list[torch.Tensor], rank: int):
    """Every layer's W_kv replaced by V_r V_r^T W_kv (rank r), V_r: the top right singular vectors
    of that layer's K/V outputs on the calibration text. Returns the originals (to restore)."""
    q_rows, saved = model.config.n_heads * model.config.head_dim, []
    for layer, y in zip(model.layers, kv):
        w = layer.self_attn.qkv_proj.weight
        saved.append(w[q_rows:].clone())
        basis = torch.linalg.svd(y.double(), full_matrices=False).Vh[:rank].T          # [384, r]
        w[q_rows:] = (basis @ (basis.T @ w[q_rows:].double())).to(w.dtype)
    return saved


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the default model)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    path = args.model or default_model_path()
    model, cfg = load_model(path, dtype=torch.float32)
    tok = Tokenizer.from_pretrained(path)
    calib, ids = calibration_ids(tok, 10**6), tok.encode(eval_text())      # all 405 calibration tokens
    full = 2 * cfg.n_kv_heads * cfg.head_dim                       # values a token and layer (384)
    bf16 = lambda values: 2 * values                               # noqa: E731 (bytes a token, bf16)
    base = perplexity(model, ids)
    rows = [{"variant": "GQA (as trained)", "values_per_token": full * cfg.n_layers, "ppl": base}]
    kv = kv_outputs(model, calib)
    for r in (full, 256, 192, 128, 96, 64, 32):
        saved = low_rank(model, kv, r)
        rows.append({"variant": f"low-rank latent r = {r}", "values_per_token": r * cfg.n_layers,
                     "ppl": perplexity(model, ids)})
        with torch.no_grad():                                      # back to the trained weights
            for layer, w in zip(model.layers, saved):
                layer.self_attn.qkv_proj.weight[cfg.n_heads * cfg.head_dim:] = w
        print(rows[-1], flush=True)
    pair_cost = {j: perplexity(model, calib, {j}) for j in range(1, cfg.n_layers, 2)}   # on calibration
    order = sorted(pair_cost, key=pair_cost.get)
    for n in (1, 2, 4, len(order)):
        rows.append({"variant": f"CLA: {n} pair(s) share (layers {sorted(order[:n])[:6]}{'...' if n > 6 else ''} "
                                f"read the one before)", "values_per_token": full * (cfg.n_layers - n),
                     "ppl": perplexity(model, ids, order[:n])})
        print(rows[-1], flush=True)
    for r in rows:
        r["bytes_per_token_bf16"] = bf16(r["values_per_token"])
        r["kv_vs_gqa"] = r["values_per_token"] / (full * cfg.n_layers)
        r["ppl_change"] = r["ppl"] / base - 1
    print("| variant | KV values/token (all layers) | bf16 KiB/token | share of GQA's | perplexity | change |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['values_per_token']:,} | {r['bytes_per_token_bf16'] / 1024:.1f} | "
              f"{r['kv_vs_gqa']:.0%} | {r['ppl']:.2f} | {r['ppl_change']:+.1%} |")
    if args.json:                  # a bench results file: its "meta", then this script's entry
        meta = {"device": f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)", "dtype": "float32",
                "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "model": os.path.basename(str(path).rstrip("/")), "command": "python scripts/kv_conversion.py "
                + " ".join(argv if argv is not None else sys.argv[1:])}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "kv-conversion": {"eval_tokens": len(ids), "calibration_tokens": len(calib),
                                                       "rows": rows}}, f, indent=1)


if __name__ == "__main__":
    main()
