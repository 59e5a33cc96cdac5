"""
support/structured.py -- structured outputs: a grammar's calls into llguidance, in one place.

What it protects: a structured request (a JSON schema, JSON mode, a regex, a choice list or a
Lark grammar: SamplingParams.structured_outputs, vLLM's names) gets output its grammar accepts,
or finishes at max_tokens with finish_reason "length"; a grammar that does not compile is a
ValueError naming the problem at the request's door (serve.py: a 400), never in a step.

The lesson itself lives in the tour: sampler.py turns a grammar's bitmask into -inf logits
(penalize), sequence.py feeds it every token and stops when the grammar is complete. This
file only speaks to the library: llguidance (vLLM's "guidance" backend; one 3 MB wheel, no
dependencies; grammars build lazily in < 1 ms and a mask costs ~10-50 us at a 49k vocabulary
on a CPU: docs/notes/structured-outputs.md compares it with xgrammar and outlines-core).
Its torch helper is not imported (llguidance.torch costs ~5 s of torch.compile import).

JSON's layout is json.dumps' (", " and ": ", no other whitespace) unless a request asks for
another (vLLM's options): a small model that may put whitespace anywhere can loop on newlines
until max_tokens.
Imports: the standard library, torch and llguidance (optional: without it a grammar is refused,
saying what to install); the tokenizer is passed in.
"""
from __future__ import annotations

import json
import weakref

import torch

try:                    # in requirements.txt; without it the engine runs and refuses only grammars
    import llguidance
    from llguidance.tiktoken import lltokenizer_from_encoding
except ImportError:
    llguidance = None
MISSING = "structured outputs need llguidance (pip install llguidance==1.9.1)"

# vLLM's StructuredOutputsParams: exactly one of these, and what each holds ...
KINDS = {"json": "a JSON schema (an object, or its JSON text)",
         "json_object": "true: any JSON object (OpenAI's JSON mode)",
         "regex": "a regular expression the whole output matches",
         "choice": "a list of strings: the output is one of them",
         "grammar": "a Lark grammar (llguidance's dialect)"}
# ... and its options for JSON (a client that sends every field sends them at null or false)
OPTIONS = {"whitespace_pattern": "a regex for the whitespace JSON may hold (default: none but "
                                 "json.dumps' single spaces)",
           "disable_any_whitespace": "true: JSON without any whitespace",
           "disable_additional_properties": "true: objects hold only the properties they list",
           "disable_fallback": "accepted: there is one backend, llguidance"}
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: dict) -> str:
    """SamplingParams.structured_outputs -> llguidance's grammar text, checked: a ValueError
    naming the problem (a key this engine does not know, two kinds at once, a schema or regex
    that does not compile). No tokenizer needed: this runs when the params are made."""
    if llguidance is None:
        raise ValueError(MISSING)
    if not isinstance(spec, dict):
        raise ValueError("must be a dict such as {'json': schema}")
    if spec.get("structural_tag") is not None:             # vLLM's tool-call tags: not here
        raise ValueError("'structural_tag' is not supported by this engine; send null or omit it")
    unknown = set(spec) - set(KINDS) - set(OPTIONS) - {"structural_tag"}
    asked = {k: v for k, v in spec.items() if v is not None and (k, v) != ("json_object", False)}
    kinds = [k for k in KINDS if k in asked]              # null (json_object: false): not asked
    if unknown or len(kinds) != 1:
        raise ValueError((f"unknown key(s) {sorted(unknown)}; " if unknown else "")
                         + "exactly one of: " + "; ".join(f"{k!r}: {v}" for k, v in KINDS.items())
                         + "; and optionally, for JSON: "
                         + "; ".join(f"{k!r}: {v}" for k, v in OPTIONS.items()))
    kind, value = kinds[0], spec[kinds[0]]
    M = llguidance.LLMatcher
    if kind in ("json", "json_object"):
        text = M.grammar_from_json_schema(json_schema(kind, value, spec), overrides=layout(spec))
    elif kind == "regex" and isinstance(value, str):
        text = M.grammar_from_regex(value)
    elif kind == "choice" and isinstance(value, list) and value \
            and all(isinstance(c, str) for c in value):
        text = M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    elif kind == "grammar" and isinstance(value, str):
        text = M.grammar_from_lark(value)
    else:
        raise ValueError(f"{kind!r} must be {KINDS[kind]}")
    if error := M.validate_grammar(text):
        what = {"json": "JSON schema", "json_object": "JSON grammar"}.get(kind, kind)
        raise ValueError(f"the {what} does not compile: {error.strip()[:500]}")
    return text


def json_schema(kind: str, value, spec: dict):
    """The schema to compile: JSON mode's any-object, or the one given (as JSON text too),
    closed everywhere with disable_additional_properties (vLLM's option)."""
    if kind == "json_object" and value is not True:
        raise ValueError("'json_object' must be true")
    schema = {"type": "object"} if kind == "json_object" else value
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("a JSON schema is an object (or true / false)")
    if schema is False:
        raise ValueError("the JSON schema false accepts no value: no output can satisfy it")
    schema = {} if schema is True else schema         # true: any JSON value ({}: llguidance's form)
    return tidy(schema, close=bool(spec.get("disable_additional_properties")))


VALUES = ("const", "enum", "default", "examples")         # their values are JSON data, not schemas
MAPS = ("properties", "patternProperties", "$defs", "definitions")    # name -> schema


def tidy(schema, close: bool):
    """The schema with what asks nothing dropped (uniqueItems: false, which llguidance refuses as
    unimplemented) and, with close, additionalProperties: false on every object without one."""
    if isinstance(schema, list):
        return [tidy(s, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in MAPS and isinstance(v, dict):                # a property may be named "enum"
            out[k] = {name: tidy(s, close) for name, s in v.items()}
        elif (k, v) != ("uniqueItems", False):
            out[k] = v if k in VALUES else tidy(v, close)
    if close and (out.get("type") == "object" or "properties" in out) \
            and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def layout(spec: dict) -> dict:
    """llguidance's JSON options: json.dumps' layout unless asked otherwise."""
    pattern, compact = spec.get("whitespace_pattern"), spec.get("disable_any_whitespace")
    if pattern is not None and not isinstance(pattern, str):
        raise ValueError("'whitespace_pattern' must be a regular expression (a string)")
    if compact:
        return {"whitespace_flexible": False}                 # "," and ":", nothing between
    return {"whitespace_pattern": pattern} if pattern else JSON_LAYOUT


class Grammar:
    """One sequence's place in its grammar (an llguidance matcher): the tokens allowed next, as
    a bitmask; each sampled token consumed, until nothing but EOS may follow."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size   # the tokenizer's vocabulary

    def fork(self) -> Grammar:
        """A copy in the same state, to go on alone (the n samples of one request)."""
        return Grammar(self.matcher.deep_copy(), self.vocab_size)

    def bitmask(self, V: int) -> torch.Tensor:
        """[ceil(V / 32)] int32, bit t % 32 of word t // 32 set where token t may come next.
        V is the model's vocabulary: ids past the tokenizer's (a padded LM head) stay 0."""
        words = -(-max(V, self.vocab_size) // 32)
        mask = torch.zeros(words, dtype=torch.int32)
        n = -(-self.vocab_size // 32) * 4                        # the bytes llguidance writes
        self.matcher.unsafe_compute_mask_ptr(mask.data_ptr(), n)
        return mask[:-(-V // 32)]

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; True when the output is complete (the grammar allows
        nothing but EOS now). The token was allowed (the mask was applied): a refusal means the
        sampler skipped the mask, an engine bug, raised so that the request fails alone."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} breaks the request's grammar: "
                             f"{self.matcher.get_error()}")
        return self.matcher.is_stopped()


_TOKENIZERS = weakref.WeakKeyDictionary()      # nanoinfer Tokenizer -> its llguidance twin


def make_grammar(spec: dict | None, tokenizer) -> Grammar | None:
    """A fresh Grammar for a request's structured_outputs (None: an unconstrained request), over
    the engine's own tokenizer (its tiktoken Encoding: the same ids and bytes, ~0.1 s once)."""
    if spec is None:
        return None
    if tokenizer.eos_token_id is None:
        raise ValueError("SamplingParams.structured_outputs needs a tokenizer with an EOS token")
    if tokenizer not in _TOKENIZERS:
        _TOKENIZERS[tokenizer] = lltokenizer_from_encoding(
            tokenizer.enc, n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eos_token_id)
    matcher = llguidance.LLMatcher(_TOKENIZERS[tokenizer], grammar_text(spec), log_level=0)
    if matcher.is_error():
        raise ValueError(f"SamplingParams.structured_outputs: {matcher.get_error()}")
    return Grammar(matcher, tokenizer.vocab_size)
