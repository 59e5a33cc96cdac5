"""
support/schema.py -- OpenAI's request bodies for serve.py, made from SamplingParams.

What it protects: the server and the library agree on what a request may
ask for, because the server's sampling fields ARE SamplingParams' fields.
request_models(SamplingParams) builds the pydantic models of
/v1/completions and /v1/chat/completions: every field of SamplingParams
with its own annotated type (plus null, OpenAI's "the default"), then the
API's own fields. pydantic checks names and JSON types before anything
reaches the engine: an unknown field (a typo'd option must not be silently
ignored) or a wrong type is a 400 naming it; strict: "5" is not 5, true is
not 1. The RANGES are not repeated here: SamplingParams checks its own
(support/checks.py), and the server turns its ValueError into a 400 naming
the API's field (support/server.py, checked). So a new sampling field is one
line in sampler.py: the schema and the server's mapping follow from it.
Imports: the standard library and pydantic; SamplingParams is passed in.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

# SamplingParams' fields the API spells its own way, per endpoint: chat's logprobs is a
# bool with top_logprobs beside it; completions score the prompt with echo + logprobs.
API_SPELLED = ("logprobs", "prompt_logprobs", "logit_bias")   # logit_bias: JSON keys are strings


class Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Schema):
    include_usage: bool | None = None         # a last chunk with the token counts
    include_obfuscation: bool | None = None   # OpenAI's padding against length side channels: none
    continuous_usage_stats: bool | None = None   # vLLM's: with include_usage, counts in every chunk


class TextPart(Schema):
    type: Literal["text"]
    text: str


class Message(Schema):
    role: Literal["system", "developer", "user", "assistant"]   # developer: OpenAI's newer system
    content: str | list[TextPart]       # newer clients send typed parts: text is all a model takes
    name: str | None = None


def sampling_fields(params_type) -> dict:
    """{name: (type | None, None)} for every field of params_type the API takes as it is."""
    kinds = typing.get_type_hints(params_type)
    return {f.name: (kinds[f.name] | None, None) for f in dataclasses.fields(params_type)
            if f.name not in API_SPELLED}


# Every field of the OpenAI API's request types (the `openai` package's CompletionCreateParams
# and chat's, 3.51: tests/test_serve.py compares) is accepted by name: a client that sends one at
# its default must not get "extra inputs are not permitted". A field this server does not
# implement is accepted at null or at the values that ask for nothing, and refused by name with
# a 400 otherwise: a request is never served without what it asked for, silently.
NOTHING = {                                # field: (values that ask for nothing, why not more)
    "suffix": ((None, ""), "text after the completion (insertion) is not implemented"),
    "audio": ((None,), "audio output is not implemented"),
    "modalities": ((None, ["text"]), "only text comes out"),
    "function_call": ((None, "none"), "function calling is not implemented"),
    "functions": ((None, []), "function calling is not implemented"),
    "tools": ((None, []), "tool calling is not implemented"),
    "tool_choice": ((None, "none"), "tool calling is not implemented"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "reasoning_effort": ((None,), "this model does not reason before answering"),
    "verbosity": ((None,), "verbosity is not implemented"),
    "web_search_options": ((None,), "web search is not implemented"),
    "moderation": ((None,), "moderation is not implemented"),
    "store": ((None, False), "completions are not stored"),
    "structural_tag": ((None,), "structural tags (vLLM's tool-call formats) are not implemented"),
    "service_tier": ((None, "auto", "default"), "one service tier"),
    "prompt_cache_retention": ((None,), "the prefix cache keeps blocks while memory allows"),
}
# Accepted as sent: they change nothing this server returns (hints, labels, one tier of cache).
HINTS = ("metadata", "parallel_tool_calls", "prompt_cache_key", "prompt_cache_options",
         "safety_identifier")
CHAT_ONLY = tuple(f for f in NOTHING if f not in ("suffix", "structural_tag"))   # both: vLLM's


# Structured outputs (support/structured.py): OpenAI's response_format, and vLLM's older
# guided_* fields beside SamplingParams' own structured_outputs (support/server.py picks one)
class JSONSchemaFormat(Schema):
    model_config = ConfigDict(populate_by_name=True)
    name: str
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")   # None: any object
    strict: bool | None = None                  # always strict here: the output follows the schema
    description: str | None = None


class ResponseFormat(Schema):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}           # vLLM's name -> structured_outputs' key
GUIDED_TYPES = {"guided_json": dict[str, Any] | str, "guided_regex": str,
                "guided_choice": list[str], "guided_grammar": str,
                "guided_whitespace_pattern": str,    # structured_outputs' whitespace_pattern
                "guided_decoding_backend": str}      # accepted as a hint: the backend is llguidance


def unsupported(body, chat: bool) -> tuple[str, str] | None:
    """(field, message) for the first field set to what this server does not do; else None."""
    for name, (nothing, why) in NOTHING.items():
        value = getattr(body, name, None)
        if value not in nothing:
            return name, f"'{name}' is not supported by this server: {why}; send null or omit it"
    best_of, n = getattr(body, "best_of", None), body.n or 1
    if best_of is not None and best_of != n:     # vLLM's rule: every sample drawn is returned
        return "best_of", f"'best_of' must equal n ({n}): every sample drawn is returned"
    return None


def request_models(params_type) -> tuple[type, type]:
    """(CompletionRequest, ChatRequest): the bodies of the two generation endpoints."""
    sampling = create_model("Sampling", __base__=Schema, model=(str | None, None),
                            stream=(bool | None, None), stream_options=(StreamOptions | None, None),
                            user=(str | None, None), logit_bias=(dict[str, Any] | None, None),
                            response_format=(ResponseFormat | None, None),
                            structural_tag=(Any, None),
                            **{f: (t | None, None) for f, t in GUIDED_TYPES.items()},
                            **sampling_fields(params_type))
    completion = create_model(
        "CompletionRequest", __base__=sampling,
        prompt=(str | list[str] | list[int] | list[list[int]], ...),   # one prompt, or a list
        echo=(bool | None, None),         # each choice's text (and logprobs) starts with its prompt
        logprobs=(int | None, None),      # each token's logprob and its k likeliest alternatives
        best_of=(int | None, None), suffix=(str | None, None))
    documented = {f: (Any, None) for f in CHAT_ONLY + HINTS}       # JSON of any shape, or null
    chat = create_model(
        "ChatRequest", __base__=sampling,
        messages=(list[Message], Field(min_length=1)),
        max_completion_tokens=(int | None, None),   # OpenAI's newer name for max_tokens
        logprobs=(bool | None, None), top_logprobs=(int | None, None), **documented)
    return completion, chat
