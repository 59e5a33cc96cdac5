"""The shape an llguidance integration in nanoinfer could take (a sketch, tested here):
one LLTokenizer per model, one LLMatcher per structured request, one int32 bitmask row per
batch row, masks filled together by an LLExecutor, applied to the structured rows only, then
each sampled token consumed. No transformers, and no llguidance.torch (its import pulls in
torch._dynamo for a @torch.compile kernel: ~3 s)."""
import json
import random
import re
import time

import jsonschema
import llguidance as llg
import torch

from common import EOS, TOK_JSON, VOCAB, med, nano_tokenizer, us

torch.set_num_threads(1)
WORDS = (VOCAB + 31) // 32                       # 1536 int32 words per row

# --- once per model -------------------------------------------------------------------
TOK = llg.LLTokenizer(open(TOK_JSON, encoding="utf-8").read(), eos_token=EOS)
EXEC = llg.LLExecutor(num_threads=1)             # 2-core box: 1 thread; default 80% of the cores
BITS = torch.arange(32, dtype=torch.int32)


# JSON whitespace: flexible by default ([ \t\n\r]+ anywhere), where a small model or random logits
# can loop on whitespace; a one-space pattern keeps the usual json.dumps layout and bounds it.
JSON_OPTS = {"whitespace_pattern": r"[ ]?"}


def grammar_for(response_format=None, guided_json=None, guided_regex=None, guided_choice=None):
    """OpenAI response_format / vLLM guided_* -> an llguidance grammar string."""
    rf = response_format or {}
    if rf.get("type") == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTS)
    if rf.get("type") == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(rf["json_schema"]["schema"], overrides=JSON_OPTS)
    if guided_json is not None:
        return llg.LLMatcher.grammar_from_json_schema(guided_json, overrides=JSON_OPTS)
    if guided_regex is not None:
        return llg.LLMatcher.grammar_from_regex(guided_regex)
    if guided_choice is not None:
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in guided_choice))
    return None


def new_matcher(grammar: str) -> llg.LLMatcher:
    m = llg.LLMatcher(TOK, grammar, log_level=0)  # never raises: bad grammar -> is_error()
    if m.is_error():
        raise ValueError(m.get_error())            # -> HTTP 400
    return m


def fill_masks(matchers: list, bitmask: torch.Tensor) -> list[int]:
    """bitmask: (B, WORDS) int32 CPU contiguous; fills row i for each non-None matchers[i].
    Returns the rows that need masking."""
    rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
    if rows:
        EXEC.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), WORDS * 4, bitmask.shape[0])
    return [i for _, i in rows]


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits (B, V) float; -inf in place wherever the row's bit is 0 (rows listed only)."""
    if not rows:
        return
    idx = torch.tensor(rows)
    m = bitmask[idx]
    allowed = ((m.unsqueeze(-1) >> BITS) & 1).bool().view(len(rows), -1)[:, : logits.shape[1]]
    sub = logits[idx]
    sub.masked_fill_(~allowed, float("-inf"))
    logits[idx] = sub.to(logits.device) if sub.device != logits.device else sub
    if logits.shape[1] > WORDS * 32:                # padded lm_head: ids past the tokenizer
        logits[idx, WORDS * 32:] = float("-inf")


# --- a toy batched decode loop: random logits, sampled under the masks ------------------
BOUNDED = {  # a schema whose every string / array is bounded, so random sampling terminates
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "status", "tags", "ok"],
    "additionalProperties": False,
}
REQUESTS = [
    dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": BOUNDED}}),
    dict(guided_regex=r"[0-9]{3}-[0-9]{4}"),
    dict(guided_choice=["yes", "no", "maybe"]),
    None,                                          # an unconstrained request in the same batch
]
nt = nano_tokenizer()
rng = torch.Generator().manual_seed(0)
B = len(REQUESTS)
for trial in range(5):
    matchers = [new_matcher(grammar_for(**r)) if r else None for r in REQUESTS]
    outs = [[] for _ in range(B)]
    done = [False] * B
    bitmask = torch.full((B, WORDS), -1, dtype=torch.int32)
    fill_t = []
    for step in range(200):
        t0 = time.perf_counter()
        rows = fill_masks([m if not done[i] else None for i, m in enumerate(matchers)], bitmask)
        fill_t.append(time.perf_counter() - t0)
        logits = torch.randn(B, VOCAB, generator=rng) * 3
        # make the structural tokens likelier, as a model would, so strings end sometimes
        logits[:, EOS] += 4
        apply_masks(logits, bitmask, rows)
        toks = torch.multinomial(torch.softmax(logits, -1), 1, generator=rng).flatten().tolist()
        for i, t in enumerate(toks):
            if done[i]:
                continue
            m = matchers[i]
            if m is not None:
                assert m.consume_token(t), m.get_error()   # cannot fail: t was allowed
            if t != EOS:
                outs[i].append(t)
            # stop on EOS, or when the grammar allows nothing but EOS (the engine need not ask)
            if t == EOS or (m is not None and m.is_stopped()) or (m is None and step >= 20):
                done[i] = True
        if all(done):
            break
    assert all(done), "did not finish in 200 steps"
    texts = [nt.decode(o) for o in outs]
    jsonschema.validate(json.loads(texts[0]), BOUNDED)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts[1]) and texts[2] in ("yes", "no", "maybe")
    print(f"trial {trial}: {step + 1} steps; outputs valid: {texts[0]!r} {texts[1]!r} {texts[2]!r}; "
          f"batched fill median {us(med(fill_t))}")

# --- speculative decoding: check k draft tokens, keep the valid prefix, roll back ---------
schema_m = new_matcher(grammar_for(guided_json=BOUNDED))
good = nt.encode('{"name": "Ada", "age": 36, "status": "active", "tags": [], "ok": true}')
schema_m.consume_tokens(good[:5])
draft = good[5:9] + nt.encode("}}")               # 4 valid draft tokens, then a bad one
n_ok = schema_m.validate_tokens(draft)             # how many the grammar accepts; state unchanged
masks = torch.full((len(draft) + 1, WORDS), -1, dtype=torch.int32)
EXEC.unsafe_compute_mask_ptr_with_draft_token([(schema_m, 0, draft)], masks.data_ptr(), WORDS * 4,
                                              masks.shape[0])
print(f"draft of {len(draft)}: validate_tokens -> {n_ok}; per-position masks in one call: the bad token "
      f"allowed at its position? {bool((int(masks[n_ok, draft[n_ok] // 32]) >> (draft[n_ok] % 32)) & 1)}")
schema_m.consume_tokens(draft[:n_ok])              # target model accepted all n_ok, say
schema_m.rollback(2)                               # ... or only n_ok - 2 of them: undo 2
print("rollback(2) then go on:", schema_m.consume_tokens(good[5 + n_ok - 2:]), "accepting:",
      schema_m.is_accepting())
