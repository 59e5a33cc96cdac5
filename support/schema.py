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
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

# SamplingParams' fields the API spells its own way, per endpoint: chat's logprobs is a
# bool with top_logprobs beside it; completions score the prompt with echo + logprobs.
API_SPELLED = ("logprobs", "prompt_logprobs")


class Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Schema):
    include_usage: bool | None = None         # a last chunk with the token counts
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


def request_models(params_type) -> tuple[type, type]:
    """(CompletionRequest, ChatRequest): the bodies of the two generation endpoints."""
    sampling = create_model("Sampling", __base__=Schema, model=(str | None, None),
                            stream=(bool | None, None), stream_options=(StreamOptions | None, None),
                            user=(str | None, None), **sampling_fields(params_type))
    completion = create_model(
        "CompletionRequest", __base__=sampling,
        prompt=(str | list[str] | list[int] | list[list[int]], ...),   # one prompt, or a list
        echo=(bool | None, None),         # each choice's text (and logprobs) starts with its prompt
        logprobs=(int | None, None))      # each token's logprob and its k likeliest alternatives
    chat = create_model(
        "ChatRequest", __base__=sampling,
        messages=(list[Message], Field(min_length=1)),
        max_completion_tokens=(int | None, None),   # OpenAI's newer name for max_tokens
        logprobs=(bool | None, None), top_logprobs=(int | None, None))
    return completion, chat
