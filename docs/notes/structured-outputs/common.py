"""Shared pieces of the three library probes: the tokenizer.json read alone, the grammars,
the valid outputs, nanoinfer's own tokenizer for the token ids, the timing helpers."""
import json
import statistics
import sys
import time

TOK_DIR = "/work/main/support/smollm2_tokenizer"
TOK_JSON = TOK_DIR + "/tokenizer.json"
VOCAB = 49152
EOS = 2  # <|im_end|> (tokenizer_config.json eos_token of the instruct model)


def bytes_to_unicode_inv():
    """GPT-2's bytes_to_unicode, inverted (the same table as nanoinfer support/bytelevel.py)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in bs}
    others = [b for b in range(256) if b not in bs]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def read_vocab(path=TOK_JSON):
    """tokenizer.json alone -> (token_bytes list by id, encoded (stored) strings by id, special ids)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    vocab = data["model"]["vocab"]                      # stored string -> id
    specials = {t["content"]: t["id"] for t in data["added_tokens"]}
    n = max([*vocab.values(), *specials.values()]) + 1
    encoded = [""] * n
    for s, i in vocab.items():
        encoded[i] = s
    for s, i in specials.items():
        encoded[i] = s
    u2b = bytes_to_unicode_inv()
    raw = [b""] * n
    for s, i in vocab.items():
        if s not in specials:
            raw[i] = bytes(u2b[c] for c in s)
    return raw, encoded, set(specials.values())


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "status": {"enum": ["active", "inactive", "pending"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "score", "status", "address", "items"],
    "additionalProperties": False,
}
SCHEMA_STR = json.dumps(SCHEMA)
# a valid instance, as a model would write it (json.dumps default separators ", " and ": ")
VALID_SCHEMA_OUT = json.dumps({
    "name": "Ada Lovelace", "age": 36, "score": 0.75, "status": "active",
    "address": {"city": "London", "zip": "12345"},
    "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-7", "qty": 10}],
})
JSON_MODE = {"type": "object"}
VALID_JSON_MODE_OUT = '{"answer": "Paris", "population": 2.1e6, "ok": true, "tags": ["a", "b"], "meta": {"src": "x\\n"}}'
# deeper than outlines-core's {"type": "object"} regex goes (objects in arrays, 3 levels)
DEEP_JSON_OUT = '{"a": [{"b": {"c": [1, {"d": null}]}}]}'
REGEX = r"\d{3}-\d{4}"
VALID_REGEX_OUT = "555-1234"
CHOICES = ["yes", "no", "maybe"]
CHOICE_REGEX = "(yes|no|maybe)"
VALID_CHOICE_OUT = "maybe"

CASES = [  # name, valid output
    ("schema", VALID_SCHEMA_OUT),
    ("json_object", VALID_JSON_MODE_OUT),
    ("regex", VALID_REGEX_OUT),
    ("choice", VALID_CHOICE_OUT),
]


def nano_tokenizer():
    sys.path.insert(0, "/work/main")
    import os
    cwd = os.getcwd()
    os.chdir("/work/main")
    try:
        from tokenizer import Tokenizer
        return Tokenizer.from_pretrained(TOK_DIR)
    finally:
        os.chdir(cwd)


def timed(fn, reps=1):
    """[seconds] of `reps` calls of fn(); returns (times, last result)."""
    ts, r = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        r = fn()
        ts.append(time.perf_counter() - t0)
    return ts, r


def ms(x):
    return f"{x * 1e3:.3f} ms"


def us(x):
    return f"{x * 1e6:.1f} us"


def med(xs):
    return statistics.median(xs)


def p90(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


def bit_allowed(mask_row, tok):
    """is token `tok` allowed in an int32 bitmask row (torch tensor or list)?"""
    w = int(mask_row[tok // 32])
    return (w >> (tok % 32)) & 1 == 1


def mask_to_bool(mask_row, vocab=VOCAB):
    import torch
    bits = torch.arange(32, dtype=torch.int32)
    return ((mask_row.unsqueeze(-1) >> bits) & 1).bool().view(-1)[:vocab]


_BITS = None


def apply_mask_inplace(logits, mask):
    """The nanoinfer-side kernel: logits (B, V) float, mask (B, ceil(V/32)) int32; -inf where bit 0.
    Plain torch (no torch.compile); bit 31 is fine: >> is arithmetic but & 1 takes the low bit."""
    import torch
    global _BITS
    if _BITS is None:
        _BITS = torch.arange(32, dtype=torch.int32)
    allowed = ((mask.unsqueeze(-1) >> _BITS) & 1).bool().view(mask.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))


def walk(tokens, new, fill, consume, passes_for=300):
    """Feed `tokens` one by one: fill the mask (timed), check the token is allowed, consume it
    (timed). Fresh matcher (new()) per pass, passes until >= passes_for steps. Returns
    (first-mask times, later-mask times, consume times, final matcher, final mask)."""
    import torch
    first, later, cons = [], [], []
    mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    steps = 0
    while steps < passes_for:
        m = new()
        for i, t in enumerate(tokens):
            t0 = time.perf_counter()
            fill(m, mask)
            dt = time.perf_counter() - t0
            (first if i == 0 else later).append(dt)
            assert bit_allowed(mask[0], t), (i, t)
            t0 = time.perf_counter()
            ok = consume(m, t)
            cons.append(time.perf_counter() - t0)
            assert ok is not False, (i, t)
            steps += 1
        fill(m, mask)
    return first, later, cons, m, mask


def allowed_count(mask):
    return int(mask_to_bool(mask[0]).sum())
