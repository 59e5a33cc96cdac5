"""
support/server.py -- the HTTP plumbing under serve.py's lesson.

What it protects: a server shared by strangers. serve.py teaches the serving
lesson (an engine thread, a queue per request, server-sent events, the OpenAI
schema, the limits that protect the batch); what an exposed server needs
besides is here, each piece written once:
  * APIError and the OpenAI error object {"error": {message, type, param,
    code}} for every error: FastAPI's own (404, 405 with Allow, a body it
    cannot parse, a pydantic validation error, which FastAPI answers 422 but
    OpenAI 400, naming the field), ours, and a bug (500, one line in the log,
    never a traceback to the client);
  * the checks' HTTP side: a ValueError of SamplingParams or of the
    library's prompt checks as a 400 naming the API's field, lone surrogates,
    the model name, vLLM's extras at their neutral values;
  * Reply: RequestOutput snapshots as OpenAI's JSON (choice indexes, echo,
    logprobs with text_offset, usage);
  * the endpoints beside generation: /v1/models, vLLM's /tokenize,
    /detokenize and /tokenizer_info, /health, /metrics (prometheus_client's
    counters, gauges and histograms);
  * Guard, an ASGI middleware: the head's size (431), the API key
    (constant-time), the body's size before a byte of it is read
    (Content-Length first, a chunked body counted as it streams: 413), a
    deadline for the whole body (408: a client trickling a byte a second
    cannot stretch it), and the catch-all for bugs;
  * Server: uvicorn on a socket bound at once (port 0 picks a free port), with
    socketserver's verbs (serve_forever on a thread, shutdown, server_close);
    drain and serve_until_signal, the SIGTERM/Ctrl-C shutdown; the command
    line's flags (one per field of EngineConfig); one_shot; exposure_warning.
What uvicorn already does is left to it: a request beyond --max-connections
gets its 503 (limit_concurrency), an idle keep-alive connection closes after
--keep-alive-timeout, h11 refuses a malformed request with a 400; HeadDeadline
adds what it lacks, a deadline for each request's head (--head-timeout). Imports:
the standard library, starlette, fastapi, pydantic, uvicorn, prometheus_client,
support.checks; serve.py's objects (the Engine, the LLM, its outputs) are
passed in, and the engine's options as a dataclass (EngineConfig).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import ipaddress
import re
import signal
import socket
import sys
import threading
import time
import typing
from itertools import accumulate

import prometheus_client
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from support.checks import check_prompt_text, check_token_ids, short
from support.schema import GUIDED

# ----------------------------------------------------------------------------
# Errors: one object for all of them
# ----------------------------------------------------------------------------


class APIError(Exception):
    """An HTTP error with an OpenAI-style body: the status, a message saying
    what to fix, the offending request field (OpenAI's "param") and a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None, kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.kind = kind               # the error object's "type" (None: the status's)


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               503: "server_overloaded"}


def error_json(e: APIError) -> dict:
    kind = e.kind or ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500
                                     else "server_error")
    return {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_json(e), e.status, e.headers)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; this request was not completed",
                    code="server_shutting_down", kind="server_error")   # not overloaded: going


def install_error_handlers(app) -> None:
    """Every error the app can raise becomes an OpenAI error object."""
    async def api_error(request, e: APIError):
        return error_response(e)

    async def validation_error(request, e: RequestValidationError):
        # pydantic's first complaint; its loc is ("body", field, ...): the field is OpenAI's param
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ())][1:]
        sent = request.headers.get("content-type")
        typed = (f" (it came as Content-Type: {short(sent)}; send application/json)"
                 if sent and "json" not in sent else "")
        if err.get("type") == "json_invalid":
            why = err.get("ctx", {}).get("error")
            return error_response(APIError(400, f"the body is not valid JSON{typed}: {why}"))
        if not loc:                    # valid JSON, but not an object
            return error_response(APIError(400, f"the body must be a JSON object{typed}, got "
                                           f"{short(err.get('input'))}"))
        param = loc[0] if loc else None
        where = ".".join(loc) or "the body"
        message = f"{where}: {err.get('msg')}, got {short(err.get('input'))}"
        return error_response(APIError(400, message, param))

    # 404, 405 (with Allow), a body FastAPI cannot parse
    async def http_error(request, e: HTTPException):
        return error_response(APIError(e.status_code, str(e.detail), headers=e.headers))
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    # Any other exception (a bug) is Guard's: a 500 error object, one line in the log.


# ----------------------------------------------------------------------------
# The checks' HTTP side: a ValueError becomes a 400 naming the API's field
# ----------------------------------------------------------------------------


def utf8(text: str, param: str) -> str:
    """JSON can carry a lone surrogate ("\\ud800") that no UTF-8 encoder (a tokenizer's) accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param!r} holds a lone UTF-16 surrogate, which is not text",
                       param) from None
    return text


def token_keyed(mapping, param: str, vocab_size: int):
    """OpenAI's {"token id as text": value} (JSON keys are strings) -> {id: value}; None stays."""
    if mapping is None:
        return None
    try:
        out = {int(k): v for k, v in mapping.items()}
    except ValueError:
        out = {-1: None}
    if any(not 0 <= k < vocab_size for k in out):
        raise APIError(400, f"{param!r} maps token ids (integers in [0, {vocab_size}), as JSON "
                       f"strings) to numbers", param)
    return out


def token_list(ids, param: str, vocab_size: int):
    """A list of token ids the model has (vLLM's allowed_token_ids); None stays."""
    if ids is not None and not all(0 <= t < vocab_size for t in ids):
        raise APIError(400, f"{param!r} lists token ids: integers in [0, {vocab_size})", param)
    return ids


def structured_outputs(body) -> tuple[dict | None, str]:
    """(SamplingParams.structured_outputs, the API field that asked for it): OpenAI's
    response_format, or vLLM's structured_outputs or guided_* fields. Two at once is a 400."""
    asked = {name: {kind: getattr(body, name)} for name, kind in GUIDED.items()
             if getattr(body, name, None) is not None}
    if body.structured_outputs is not None:
        asked["structured_outputs"] = body.structured_outputs
    if (rf := body.response_format) is not None and rf.type != "text":
        schema = rf.json_schema.json_schema if rf.json_schema else None
        if rf.type == "json_schema" and rf.json_schema is None:
            raise APIError(400, "'response_format' of type json_schema needs 'json_schema': "
                           "{'name': ..., 'schema': {...}}", "response_format")
        asked["response_format"] = ({"json": schema} if schema is not None
                                    else {"json_object": True})
    if len(asked) > 1:
        raise APIError(400, f"ask for one structured output at a time, got {sorted(asked)}",
                       sorted(asked)[1])
    name, spec = next(iter(asked.items()), ("structured_outputs", None))
    if (ws := body.guided_whitespace_pattern) is not None:       # vLLM's older spelling
        if spec is None:
            raise APIError(400, "'guided_whitespace_pattern' shapes a JSON output: send it with "
                           "guided_json or response_format", "guided_whitespace_pattern")
        spec = {**spec, "whitespace_pattern": ws}
    return spec, name


def prompt_text(llm, text: str, param: str) -> str:
    """A prompt's text (or a chat's messages'), checked before any tokenizer work: UTF-8, no more
    bytes than the context's tokens can hold, no character the vocabulary would drop
    (support/checks.py: check_prompt_text); else a 400 naming `param`. Tokenizing stays off the
    event loop (run_in_threadpool): /health answers while a long prompt is encoded."""
    try:
        return check_prompt_text(utf8(text, param), llm.tokenizer, llm.max_len, repr(param))
    except ValueError as e:
        code = "context_length_exceeded" if "context holds" in str(e) else None
        raise APIError(400, str(e), param, code) from None


def checked(cls, api_names: dict, **fields):
    """cls(**fields) (SamplingParams), its ValueError a 400 naming the API's field: the class
    states every range once and names the field at fault ("SamplingParams.top_p must be ...")."""
    try:
        return cls(**fields)
    except ValueError as e:
        name = m.group(1) if (m := re.match(rf"{cls.__name__}\.(\w+)", str(e))) else None
        param = api_names.get(name, name)
        raise APIError(400, str(e).replace(f"{cls.__name__}.{name}", repr(param)), param) from None


def check_model(served: str, asked: str | None) -> None:
    if asked not in (None, served):
        raise APIError(404, f"the model {asked[:100]!r} does not exist; this server serves "
                       f"{served!r}", "model",
                       "model_not_found")


def check_prompts(llm, prompts: list, param: str, max_waiting: int) -> list:
    """(token ids, text) prompts the engine can take: 1 to max_waiting of them (more could never
    wait at once), ids in the vocabulary, at least one, shorter than the context."""
    if not 0 < len(prompts) <= max_waiting:
        raise APIError(400, f"a request holds 1 to {max_waiting} prompts, not {len(prompts)}",
                       param)
    for ids, _ in prompts:
        try:
            check_token_ids(ids, llm.config.vocab_size)
        except ValueError as e:
            raise APIError(400, str(e), param) from None
        if len(ids) >= llm.max_len:    # 413: well formed, but bigger than the context can ever hold
            raise APIError(413, f"the prompt has {len(ids)} tokens; this server's context "
                           f"holds {llm.max_len}",
                           param, "context_length_exceeded")
    return prompts


# ----------------------------------------------------------------------------
# Answers: RequestOutput snapshots -> OpenAI's JSON
# ----------------------------------------------------------------------------


def piece(tok, t: int) -> str:
    # A token is bytes, not always whole UTF-8 characters: shown with replacement
    # characters (chat's logprobs give the exact bytes too).
    return tok.token_bytes(t).decode("utf-8", errors="replace")


def logprobs_json(tok, ids: list, lps: list, offset: int, chat: bool) -> dict:
    """OpenAI's logprobs object for these tokens. Each entry of lps is (logprob,
    {alternative id: logprob}), or None for a prompt's first token (nothing conditions it).
    Completions: tokens, token_logprobs, top_logprobs and text_offset (each token's start
    in the choice's text, from `offset`); chat: a content list with the tokens' bytes."""
    if chat:
        def entry(t, lp):
            return {"token": piece(tok, t), "logprob": lp, "bytes": list(tok.token_bytes(t))}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top.items()]}
                            for t, (lp, top) in zip(ids, lps)]}
    tokens = [piece(tok, t) for t in ids]
    return {"tokens": tokens, "token_logprobs": [e and e[0] for e in lps],
            "top_logprobs": [e and {piece(tok, a): v for a, v in e[1].items()} for e in lps],
            "text_offset": list(accumulate(map(len, tokens), initial=offset))[:-1]}


class Reply:
    """One HTTP request's answer in OpenAI's JSON: its head, each choice's index (prompt i's
    sample j is choice i * n + j, as OpenAI numbers them), the echoed prompt, logprobs, usage."""

    def __init__(self, llm, rids: list, prompts: list, params, chat: bool, echo: bool, model: str):
        self.tok = llm.tokenizer
        self.prompts = prompts
        self.chat = chat
        self.echo = echo
        self.n = params.n
        self.k = params.logprobs
        self.order = {rid: i for i, rid in enumerate(rids)}   # engine request -> its prompt's index
        self.outs: dict = {}                                  # engine request -> its latest output
        self.sent: dict = {}                                  # choice -> characters sent (offsets)
        self.head = {"id": ("chatcmpl-" if chat else "cmpl-") + rids[0],
                     "created": int(time.time()),
                     "object": "chat.completion" if chat else "text_completion", "model": model}

    def index(self, out, c) -> int:
        return self.order[out.request_id] * self.n + c.index

    def choice(self, out, c, delta: bool) -> dict:
        """One choice: all its text so far, or (a stream's delta) what this step added."""
        i = self.index(out, c)
        if delta:
            text, ids, lps = c.new_text, c.new_token_ids, c.new_logprobs
        else:
            text, ids, lps = c.text, c.token_ids, c.logprobs
        if self.echo and i not in self.sent:   # the prompt first (a stream: in its first chunk)
            p_ids, p_text = self.prompts[self.order[out.request_id]]
            text = (self.tok.decode(p_ids) if p_text is None else p_text) + text
            ids = p_ids + ids
            if self.k is not None:
                lps = (out.prompt_logprobs or [None] * len(p_ids)) + (lps or [])
        start = self.sent[i] = self.sent.get(i, 0)
        self.sent[i] += len(text)
        lp = None if self.k is None else logprobs_json(self.tok, ids, lps, start, self.chat)
        if not self.chat:
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
        if delta:
            message = {"content": text} if text else {}
        else:
            message = {"role": "assistant", "content": text}
        return {"index": i, "delta" if delta else "message": message, "logprobs": lp,
                "finish_reason": c.finish_reason}

    def usage(self) -> dict:
        prompt = sum(len(ids) for ids, _ in self.prompts)
        done = sum(len(c.token_ids) for out in self.outs.values() for c in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


# ----------------------------------------------------------------------------
# The endpoints beside generation: models, the tokenizer, health, metrics
# ----------------------------------------------------------------------------
# Each reads the engine (app.state.engine: its llm, draining, metrics) and the
# served model's name (app.state.model). The tokenizer's endpoints are vLLM's:
# lm-evaluation-harness and vLLM's benchmark use them when a server has them.

side_routes = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True     # this tokenizer adds none (no BOS), as /v1/completions
    return_token_strs: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


@side_routes.get("/v1/models")
async def models(request: Request):
    llm, name = request.app.state.engine.llm, request.app.state.model
    # root: where the weights come from (vLLM's field; `vllm bench serve` loads its tokenizer
    # from it)
    card = {"id": name, "object": "model", "created": 0, "owned_by": "nanoinfer",
            "root": llm.path, "parent": None, "max_model_len": llm.max_len}
    return {"object": "list", "data": [card]}


@side_routes.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    llm = request.app.state.engine.llm
    check_model(request.app.state.model, body.model)
    # as /v1/completions encodes it, off the event loop
    ids = await run_in_threadpool(llm.tokenizer.encode, prompt_text(llm, body.prompt, "prompt"),
                                  allow_special=True)
    return {"count": len(ids), "max_model_len": llm.max_len, "tokens": ids,
            "token_strs": [piece(llm.tokenizer, t) for t in ids]
            if body.return_token_strs else None}


@side_routes.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    llm = request.app.state.engine.llm
    check_model(request.app.state.model, body.model)
    if any(not 0 <= t < llm.config.vocab_size for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {llm.config.vocab_size})", "tokens")
    return {"prompt": llm.tokenizer.decode(body.tokens)}


@side_routes.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    """What tokenizer_config.json would say, as vLLM's endpoint gives it (lm-eval reads
    eos_token)."""
    llm = request.app.state.engine.llm
    tok = llm.tokenizer
    name = lambda i: None if i is None else tok.id_to_special.get(i, tok.decode([i]))   # noqa: E731
    return {"tokenizer_class": type(tok).__name__, "eos_token": name(tok.eos_token_id),
            "bos_token": name(tok.bos_token_id), "pad_token": None,
            "chat_template": tok.chat_template,
            "model_max_length": llm.max_len, "vocab_size": tok.vocab_size}


@side_routes.get("/health")
async def health(request: Request):
    if request.app.state.engine.draining:      # a load balancer's probe: send new users elsewhere
        raise shutting_down()
    return {"status": "ok"}


@side_routes.get("/metrics")
async def metrics(request: Request):
    engine = request.app.state.engine
    return PlainTextResponse(engine.metrics.text(),
                             media_type=prometheus_client.CONTENT_TYPE_LATEST)


# ----------------------------------------------------------------------------
# Guard: the head, the API key, the body (before the app sees them), and bugs
# ----------------------------------------------------------------------------

OPEN_PATHS = ("/health", "/metrics")   # probes and scrapers: no prompt or output passes there


class Guard:
    """ASGI middleware. A request without the key is refused before its body
    is read (an unauthenticated client cannot make the server read 1 GB); a
    body over max_body_bytes is refused by its Content-Length before reading,
    or (chunked) as soon as it has streamed past the limit; the whole body must
    arrive within body_timeout. The app then reads the buffered body as usual,
    and later receive() calls (a disconnect) pass through. A bug below it is a
    500 error object and one line in the log (no traceback is formatted: on
    Python 3.11 that races with another thread's, see CPython gh-106905)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, body_timeout: float,
                 max_header_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers, limit = Headers(scope=scope), self.max_body_bytes
        # h11 bounds only a head still arriving; one that came whole is measured here
        head = len(scope.get("raw_path", b""))
        head += sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if head > self.max_header_bytes:
            e = APIError(431, f"the request line and headers exceed {self.max_header_bytes} bytes",
                         code="headers_too_large")
            return await error_response(e)(scope, receive, send)
        if self.api_key and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            e = APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                         code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await error_response(e)(scope, receive, send)
        declared = headers.get("content-length")   # h11 has refused a malformed one already (400)
        if declared is not None and int(declared) > limit:
            return await self._too_large(declared, scope, receive, send)
        chunks, size, more = [], 0, True
        deadline = time.monotonic() + self.body_timeout
        try:
            while more:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                if message["type"] == "http.disconnect":
                    return
                chunks.append(message.get("body", b""))
                size, more = size + len(chunks[-1]), message.get("more_body", False)
                if size > limit:
                    return await self._too_large(f"more than {limit}", scope, receive, send)
        except TimeoutError:
            e = APIError(408, f"the request body did not arrive within {self.body_timeout:g} s",
                         code="timeout")
            return await error_response(e)(scope, receive, send)
        body = b"".join(chunks)
        try:                           # JSON on the wire is UTF-8 (RFC 8259 8.1): not UTF-16
            body.decode("utf-8")
        except UnicodeDecodeError as u:
            bad = body[u.start:u.start + 4]
            e = APIError(400, f"the body is not UTF-8 (at byte {u.start}: {bad!r}); JSON bodies "
                         "must be", code="invalid_encoding")
            return await error_response(e)(scope, receive, send)
        buffered = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return buffered.pop() if buffered else await receive()
        started = []

        async def tracked(message):
            started.append(message["type"] == "http.response.start")
            await send(message)
        try:
            await self.app(scope, replay, tracked)
        except Exception as e:     # a bug: one line in the server's log, no traceback to the client
            print(f"nanoinfer: error handling {scope['method']} {scope['path'][:200]}: {e!r}",
                  file=sys.stderr, flush=True)
            if not started:        # (after the response began, uvicorn closes the connection)
                await error_response(APIError(500, "internal server error"))(scope, receive, send)

    def _authorized(self, headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        # compare_digest's time does not depend on where the strings differ, so the
        # key cannot be guessed a byte at a time from response times.
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("latin-1", "replace"), self.api_key.encode())

    async def _too_large(self, size, scope, receive, send):
        # uvicorn reads and drops the rest of an unread body, so the connection
        # stays usable and the client reads this answer (no reset).
        e = APIError(413, f"the body has {str(size)[:30]} bytes; this server takes at most "
                     f"{self.max_body_bytes}", code="body_too_large")
        await error_response(e)(scope, receive, send)


# ----------------------------------------------------------------------------
# Metrics: Prometheus counters, gauges and histograms (prometheus_client)
# ----------------------------------------------------------------------------

# From 5 ms (one compiled GPU decode step) to 30 s (a long queue on a CPU):
# roughly 2-2.5x apart, so any quantile is known to within a factor of ~2.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

COUNTERS = {"prompt_tokens_total": "Prompt tokens of finished requests.",
            "generation_tokens_total": "Generated tokens.",
            "requests_finished_total": "Requests finished.",
            "requests_aborted_total": "Requests aborted (client gone, or drained).",
            "requests_failed_total": "Requests failed by an engine error."}


def _gauges(llm) -> dict:
    """name -> (help, a function read at scrape time): the engine's own structures, each a
    single len() or counter, so a scrape in the middle of a step never sees a torn value."""
    bm, sch = llm.block_manager, llm.scheduler
    return {"requests_running": ("Sequences in the running batch.", lambda: len(sch.running)),
            "requests_waiting": ("Sequences waiting for a seat.", lambda: len(sch.waiting)),
            "kv_blocks_total": ("KV cache blocks in the pool.", lambda: bm.num_blocks),
            "kv_blocks_free": ("KV blocks free (including cached ones).",
                               lambda: bm.num_free_blocks),
            "kv_blocks_used": ("KV blocks held by sequences.",
                               lambda: bm.num_blocks - bm.num_free_blocks),
            "kv_blocks_cached": ("Free KV blocks still holding a reusable prefix.",
                                 lambda: bm.num_cached_blocks)}


class Metrics:
    """What /metrics reports, as nanoinfer_<name>: counters and latency histograms fed from
    each RequestOutput snapshot (observe), gauges read from the engine at scrape time. One
    registry per server; prometheus_client's metrics are thread-safe (the engine thread
    writes, a scrape reads) and it writes the text format."""

    def __init__(self, llm):
        self.registry = prometheus_client.CollectorRegistry()
        self.counters = {name: prometheus_client.Counter("nanoinfer_" + name, text,
                                                         registry=self.registry)
                         for name, text in COUNTERS.items()}
        for name, (text, read) in _gauges(llm).items():
            gauge = prometheus_client.Gauge("nanoinfer_" + name, text, registry=self.registry)
            gauge.set_function(read)
        self.ttft = prometheus_client.Histogram("nanoinfer_time_to_first_token_seconds",
                                                "Arrival to first token.", registry=self.registry,
                                                buckets=LATENCY_BUCKETS)
        self.itl = prometheus_client.Histogram("nanoinfer_inter_token_latency_seconds",
                                               "Time between streamed tokens.",
                                               registry=self.registry, buckets=LATENCY_BUCKETS)
        self.last: dict = {}             # request id -> (time, tokens) of its last output

    def value(self, counter: str) -> float:
        return self.registry.get_sample_value("nanoinfer_" + counter)

    def ended(self, rid: str, counter: str | None = None):
        """A request left the engine (finished, aborted or failed: `counter`)."""
        self.last.pop(rid, None)
        if counter:
            self.counters[counter].inc()

    def observe(self, out):
        now, m = time.perf_counter(), out.metrics
        tokens = sum(len(c.token_ids) for c in out.outputs)
        # The first token's latency is TTFT (queueing + prefill); every later gap,
        # divided by the tokens it brought (speculation can bring several), is
        # the inter-token latency: one engine step of the whole batch.
        last_time, last_tokens = self.last.get(out.request_id, (now, 0))
        if last_tokens == 0 and tokens > 0 and m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        elif tokens > last_tokens:
            self.itl.observe((now - last_time) / (tokens - last_tokens))
        if tokens > last_tokens:
            self.counters["generation_tokens_total"].inc(tokens - last_tokens)
        if out.finished:
            self.counters["prompt_tokens_total"].inc(m.prompt_tokens)
            self.counters["requests_finished_total"].inc()
            self.last.pop(out.request_id, None)
        else:
            self.last[out.request_id] = (now, tokens)

    def text(self) -> str:
        return prometheus_client.generate_latest(self.registry).decode()


# ----------------------------------------------------------------------------
# The server: uvicorn, started and stopped like socketserver
# ----------------------------------------------------------------------------


def check_limits(**limits) -> None:
    for name, value in limits.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")


class HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head: a connection that has not
    sent a whole request line and headers within head_timeout seconds of opening (or of its
    last response) is closed. uvicorn's own timer starts only after a response and any byte
    stops it, so a client that connects and sends nothing, or a header a minute, held a
    connection, and a few hundred of them every seat under --max-connections, for ever."""
    head_timeout = 10.0                        # set per server: a subclass made by Server
    deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport):
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:   # a head arrived
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()                        # the next request's head, on a kept-alive one

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self):
        self._disarm()
        self.deadline = self.loop.call_later(self.head_timeout, self._expired)

    def _disarm(self):
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self):
        self.deadline = None
        if not self.transport.is_closing():
            self.transport.close()


class Server:
    """A FastAPI app served by uvicorn (h11, one event loop) on a socket bound now: port 0
    picks a free port, read it from server_address. serve_forever() blocks until shutdown()
    (run it on a thread); server_close() closes the socket. It adds to the app the error
    handlers, `routers` and Guard (api_key, max_body_bytes, body_timeout). max_connections:
    uvicorn's limit_concurrency (beyond it, 503); keep_alive_timeout: an idle keep-alive
    connection closes after it; head_timeout: a request's head must arrive within it
    (HeadDeadline); max_header_bytes: the request line and headers at most (431; h11's 400
    while a head still arriving is over it)."""

    def __init__(self, app, host: str, port: int, routers=(), *, api_key: str | None = None,
                 max_body_bytes: int = 4 << 20, body_timeout: float = 30.0,
                 max_connections: int = 512, keep_alive_timeout: float = 5.0,
                 head_timeout: float = 10.0, max_header_bytes: int = 64 << 10,
                 graceful_seconds: float = 5.0):
        self.limits = dict(api_key=api_key or None, max_body_bytes=max_body_bytes,
                           body_timeout=body_timeout, max_connections=max_connections,
                           keep_alive_timeout=keep_alive_timeout, head_timeout=head_timeout)
        check_limits(**{k: v for k, v in self.limits.items() if k != "api_key"})
        self.app = app
        install_error_handlers(app)
        for r in routers:
            app.include_router(r)
        app.add_middleware(Guard, api_key=api_key or None, max_body_bytes=max_body_bytes,
                           body_timeout=body_timeout, max_header_bytes=max_header_bytes)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # The kernel's queue of connections not yet accepted: a burst of connects
        # must wait there, not be reset, while the event loop is busy.
        self.socket = socket.create_server((host, port), family=family,
                                           backlog=min(max_connections, socket.SOMAXCONN))
        self.server_address = self.socket.getsockname()[:2]
        protocol = type("HeadDeadline", (HeadDeadline,), {"head_timeout": head_timeout})
        config = uvicorn.Config(app, http=protocol, lifespan="off", log_config=None,
                                log_level="warning", access_log=False,
                                limit_concurrency=max_connections,
                                timeout_keep_alive=keep_alive_timeout,
                                timeout_graceful_shutdown=graceful_seconds,
                                h11_max_incomplete_event_size=max_header_bytes)
        self.uvicorn = uvicorn.Server(config)
        self._serving = threading.Event()
        self._done = threading.Event()

    def serve_forever(self, poll_interval: float | None = None):   # uvicorn polls every 0.1 s
        self._serving.set()
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self._done.set()

    def shutdown(self, timeout: float = 30.0):
        """Stop accepting, finish the responses being written (uvicorn cancels what is left after
        graceful_seconds), and return once serve_forever has."""
        self.uvicorn.should_exit = True
        if self._serving.is_set():
            self._done.wait(timeout)

    def server_close(self):
        self.socket.close()


def drain(engine, timeout: float, hurry: threading.Event | None = None) -> dict:
    """Graceful shutdown of serve.py's Engine: new requests get 503 (/health too, so a load
    balancer sends users elsewhere); those in flight get `timeout` seconds to finish (less if
    `hurry` is set); the rest are aborted, their routes told so (a JSON error, or a stream's
    error event). Returns in_flight, aborted, kv_blocks_free, kv_blocks_total."""
    aborted, in_flight = engine.metrics.value("requests_aborted_total"), engine.start_draining()
    deadline = time.monotonic() + timeout
    while engine.live and time.monotonic() < deadline and not (hurry and hurry.is_set()):
        time.sleep(0.02)
    engine.abort(None, shutting_down())
    while engine.live and time.monotonic() < deadline + 30:
        time.sleep(0.02)
    bm = engine.llm.block_manager
    aborted = int(engine.metrics.value("requests_aborted_total") - aborted)
    return {"in_flight": in_flight, "aborted": aborted,
            "kv_blocks_free": bm.num_free_blocks, "kv_blocks_total": bm.num_blocks}


def serve_until_signal(server: Server, drain_seconds: float) -> None:
    """serve_forever on a thread until SIGTERM or SIGINT; then server.engine.drain(), stop
    serving, stop the engine and close the LLM. The main thread only waits: a signal
    handler must not block, and the drain needs the server still answering (503s to
    newcomers, the rest of the streams in flight). A second signal ends the wait at once."""
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(signum, frame):
        (hurry if stop.is_set() else stop).set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    thread = threading.Thread(target=server.serve_forever, name="nanoinfer-http", daemon=True)
    thread.start()
    while not stop.wait(0.5) and thread.is_alive():
        pass
    engine = server.engine
    print(f"\nnanoinfer: draining: {len(engine.live)} requests in flight get up to "
          f"{drain_seconds:g} s (signal again to stop them now)", flush=True)
    report = drain(engine, drain_seconds, hurry)
    server.shutdown()           # the routes write the drained requests' errors, then uvicorn stops
    server.server_close()
    engine.stop()
    engine.llm.close()                 # after the engine thread: tensor-parallel workers stop last
    print(f"nanoinfer: stopped ({report['in_flight']} in flight, {report['aborted']} aborted); "
          f"{report['kv_blocks_free']}/{report['kv_blocks_total']} KV blocks free", flush=True)


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A warning when the server is reachable beyond this machine without a key."""
    if api_key:
        return None
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (f"nanoinfer: WARNING: listening on {host or 'every interface'} without an API key: "
            f"anyone who can reach this port can use it (set --api-key or NANOINFER_API_KEY)")


# ----------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------


def serve_arguments(argv, description: str, config_type) -> argparse.Namespace:
    """serve.py's command line: a flag per engine option, the serving limits, one-shot mode."""
    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    option_flags(ap.add_argument_group("engine options (engine.EngineConfig)"), config_type)
    srv = ap.add_argument_group("serving limits (docs/SERVING.md)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' except on /health and /metrics "
                     "(default: $NANOINFER_API_KEY, which keeps the key out of the process list)")
    srv.add_argument("--max-waiting", type=int, default=256,
                     help="queued requests before answering 503")
    srv.add_argument("--max-request-tokens", type=int, default=None,
                     help="prompts x n x max_tokens at most per request (default 16 x the context)")
    srv.add_argument("--max-body-bytes", type=int, default=4 << 20,
                     help="larger bodies get 413 (default 4 MiB)")
    srv.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds for a request's body to arrive (408)")
    srv.add_argument("--max-connections", type=int, default=512,
                     help="uvicorn's limit_concurrency: connections or requests beyond it get 503")
    srv.add_argument("--keep-alive-timeout", type=float, default=5.0,
                     help="seconds an idle keep-alive connection stays open")
    srv.add_argument("--head-timeout", type=float, default=10.0,
                     help="seconds for a request's line and headers to arrive, from the "
                     "connection's start or its last response; then it is closed")
    srv.add_argument("--drain-seconds", type=float, default=30.0,
                     help="on SIGTERM/Ctrl-C, how long requests in flight may still run")
    one = ap.add_argument_group("one-shot")
    one.add_argument("--prompt", default=None, help="one-shot: generate for this prompt and exit")
    one.add_argument("--chat", action="store_true",
                     help="one-shot: wrap --prompt in the chat template")
    one.add_argument("--max-tokens", type=int, default=256, help="one-shot: tokens to generate")
    one.add_argument("--temperature", type=float, default=0.0, help="one-shot: 0 = greedy")
    return ap.parse_args(argv)


def option_flags(group, config_type) -> None:
    """A flag per field of the dataclass config_type (EngineConfig): --block-size for block_size
    (or the field's own "flag"), its default, its help, its choices; a bool is --x / --no-x."""
    kinds = typing.get_type_hints(config_type)
    for f in dataclasses.fields(config_type):
        kind, meta = kinds[f.name], f.metadata
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        if kind is bool:
            extra = {"action": argparse.BooleanOptionalAction}
        else:           # int, int | None: an integer; everything else is given as text
            extra = {"type": int if int in (typing.get_args(kind) or (kind,)) else str}
            if "choices" in meta:
                extra["choices"] = [c for c in meta["choices"] if c is not None]
        shown = "" if f.default is None or kind is bool else " (default: %(default)s)"
        group.add_argument(flag, dest=f.name, default=f.default, help=meta["help"] + shown, **extra)


def engine_config(args: argparse.Namespace, config_type):
    """The config_type (EngineConfig) that option_flags' flags describe."""
    return config_type(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config_type)})


def http_limits(args: argparse.Namespace, api_key: str | None) -> dict:
    """Server's keyword arguments from serve_arguments' flags."""
    return dict(api_key=api_key, max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                max_connections=args.max_connections, keep_alive_timeout=args.keep_alive_timeout,
                head_timeout=args.head_timeout)


def one_shot(llm, prompt: str, chat: bool, params, out=None):
    """Generate for one prompt, printing text as it is produced: no server and no threads,
    the engine thread's add_request/step loop for one request, printing each step's new
    text (the engine holds back what may still become a stop string)."""
    out = out or sys.stdout
    if chat:
        message = {"role": "user", "content": prompt}
        ids = llm.tokenizer.apply_chat_template([message], tokenize=True)
    else:
        ids = llm.tokenizer.encode(prompt, allow_special=True)
    rid = llm.add_request(ids, params)
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.request_id == rid and o.outputs[0].new_text:
                out.write(o.outputs[0].new_text)
                out.flush()
    out.write("\n")
    return o
