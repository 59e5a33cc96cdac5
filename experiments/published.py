"""
experiments/published.py -- the published models whose KV caches the lecture quotes, and their
arithmetic (bf16): bytes per token, and one sequence of 128k tokens (kv-compression's last table).
"""
from __future__ import annotations

LONG_CONTEXT = 128 * 1024
# The lecture's arithmetic for published models, bf16: (model, attention, layers, values cached per token per
# layer, window). Llama-2-70B: arXiv:2307.09288 and its config.json (80 layers, 64 heads of 128, 8 KV heads;
# "MHA" is that body with 64 KV heads). DeepSeek-V2: arXiv:2405.04434 sec. 2.1 and app. B (60 layers, 128
# heads of 128; MLA caches the latent c_KV, d_c = 512, and the shared RoPE key, 64: 576 values). Mistral-7B:
# arXiv:2310.06825 and its config.json (32 layers, 8 KV heads of 128, sliding_window 4096).
PUBLISHED_KV = [("Llama-2-70B", "MHA (64 KV heads)", 80, 2 * 64 * 128, None),
                ("Llama-2-70B", "GQA-8 (published)", 80, 2 * 8 * 128, None),
                ("DeepSeek-V2", "MHA (128 heads x 128 dims)", 60, 2 * 128 * 128, None),
                ("DeepSeek-V2", "MLA (published): 512 latent + 64 RoPE", 60, 576, None),
                ("Mistral-7B", "GQA-8, full attention", 32, 2 * 8 * 128, None),
                ("Mistral-7B", "GQA-8, 4k window (published)", 32, 2 * 8 * 128, 4096)]


def published_kv_arithmetic(context: int = LONG_CONTEXT) -> list:
    """PUBLISHED_KV in bf16 bytes: per token, and one sequence of `context` tokens (a window caps it)."""
    rows = [{"model": m, "attention": a, "layers": L, "values_per_token_per_layer": v, "window": win,
             "bytes_per_token": L * v * 2, "context": context, "tokens_held": min(context, win or context),
             "kv_bytes_at_context": L * v * 2 * min(context, win or context)} for m, a, L, v, win in PUBLISHED_KV]
    for r in rows:                         # against the first (uncompressed) row of the same model
        first = next(x for x in rows if x["model"] == r["model"])
        r["reduction"] = first["kv_bytes_at_context"] / r["kv_bytes_at_context"]
    return rows
