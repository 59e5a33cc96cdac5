"""
serve.py -- serving many users: an OpenAI-compatible HTTP server, and a one-shot CLI.

The lesson: continuous batching pays off when requests arrive at different
times. A server turns arrivals into engine steps:

    HTTP handler threads (one per connection)        engine thread (one)
      parse + validate the JSON, tokenize               loop:
      submit(ids, params) --inbox------------------->     add new requests, aborts
      read RequestOutput snapshots <--per-request queue--  llm.step()  (one batch of all)
      write JSON, or SSE chunks as text grows             put each output in its queue

Only the engine thread touches the LLM (it is not thread-safe); handlers
talk to it through queues. A request waits in the scheduler's queue while
the batch is full (continuous batching admits it the step a seat frees up),
so time to first token = queueing + prefill, and the gap between streamed
tokens = one engine step of the whole batch.

Endpoints (request and response shapes follow the OpenAI API):
    POST /v1/completions       prompt (string or token ids) -> text
    POST /v1/chat/completions  messages -> the model's chat template -> text
    GET  /v1/models
    GET  /health               {"status": "ok"}; 503 while draining
    GET  /metrics              Prometheus text format
"stream": true answers with server-sent events, "data: {json}\\n\\n" per
chunk, ending with "data: [DONE]"; an error after the stream has begun is a
last event "data: {"error": {...}}" before "data: [DONE]".

A server shared by many users must not let one of them hurt the others, so
every request is bounded before it costs anything (the flags in brackets):
the body's size is checked before it is read [--max-body-bytes], the headers
and the body must arrive in time [--header-timeout, --body-timeout], open
connections are capped [--max-connections], the waiting queue is bounded
[--max-waiting], prompt + max_tokens must fit the context, n x max_tokens is
capped [--max-request-tokens], and sampling values are checked by
SamplingParams itself (one statement of each range, shared with the library).
A client that disconnects, streaming or not, has its request aborted, so its
KV blocks go back to the pool at once. An engine failure fails the requests
of that step with an error; the server goes on.

Every error is an OpenAI-style object {"error": {"message", "type", "param", "code"}}:
    400 malformed or invalid request        401 missing or wrong API key
    404 unknown path or model               405 method not allowed (Allow names the right one)
    408 headers or body too slow            413 body too large, or a prompt the context cannot hold
    500 engine failure                      503 queue full, too many connections (Retry-After), draining

Auth: with --api-key KEY (or $NANOINFER_API_KEY) every /v1/* request needs
"Authorization: Bearer KEY"; /health and /metrics stay open (probes and
scrapers; they carry no prompts or outputs). Without a key the server binds
loopback by default and warns when told to bind anything else.

Shutdown: SIGTERM or Ctrl-C drains. New requests get 503, requests in flight
get --drain-seconds to finish, the rest are aborted with an error (a stream
gets an error event), every KV block is back in the pool, exit status 0. A
second signal ends the wait at once.

    python serve.py [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [limits] [engine options]
    python serve.py --prompt "Once upon a time"          # one-shot, streamed to stdout
    python serve.py --chat --prompt "What is the capital of France?"
Only the standard library is used (http.server, threading, queue, json).
"""
from __future__ import annotations

import argparse
import hmac
import io
import ipaddress
import json
import os
import queue
import re
import select
import signal
import socket
import sys
import threading
import time
import uuid
from collections import deque
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from scheduler import LLM, SamplingParams
from support.checks import check_seats, check_token_ids, is_int, is_num, short

# ----------------------------------------------------------------------------
# Metrics: Prometheus counters, gauges and histograms
# ----------------------------------------------------------------------------


class Histogram:
    """Cumulative buckets, as Prometheus wants them."""

    def __init__(self, name: str, help_text: str, buckets):
        self.name, self.help, self.buckets = name, help_text, list(buckets)
        self.counts, self.sum, self.count = [0] * len(self.buckets), 0.0, 0

    def observe(self, value: float):
        # Prometheus buckets are cumulative ("<= le"), so a value counts in every
        # bucket at or above it; a scraper derives quantiles from the differences.
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        lines += [f'{self.name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        lines += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum}",
                  f"{self.name}_count {self.count}"]
        return lines


# From 5 ms (one compiled GPU decode step) to 30 s (a long queue on a CPU):
# roughly 2-2.5x apart, so any quantile is known to within a factor of ~2.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# ----------------------------------------------------------------------------
# The engine thread
# ----------------------------------------------------------------------------


class APIError(Exception):
    """An HTTP error with an OpenAI-style body: the status, a message saying
    what to fix, the offending request field (OpenAI's "param") and a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               503: "server_overloaded"}


def error_json(e: APIError) -> dict:
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "server_error")
    return {"error": {"message": str(e), "type": kind,
                      "param": e.param, "code": e.code}}


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; this request was not completed", code="server_shutting_down")


ACCEPTED = object()     # the engine's first message on a request's queue: add_request took it


class Engine:
    """Owns the LLM and runs llm.step() while there is work; the only thread
    that touches the LLM. Handlers submit() and read their queue."""

    def __init__(self, llm: LLM, max_waiting: int = 256):
        self.llm, self.max_waiting = llm, max_waiting
        # Handlers never call the LLM: they post messages here, and the engine
        # thread applies them between steps, so no lock is needed around the
        # scheduler, the block manager or the KV cache.
        self.inbox: queue.Queue = queue.Queue()        # ("add", rid, ids, params, q) | ("abort", rid) | ...
        self.streams: dict[str, queue.Queue] = {}      # request id -> its handler's queue
        self.lock = threading.Lock()                   # guards live, draining and the metrics below
        self.live: set[str] = set()                    # submitted and not yet ended (drain waits for these)
        self.draining = False
        self.prompt_tokens = self.generation_tokens = self.finished = self.aborted = self.failed = 0
        self.ttft = Histogram("nanoinfer_time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.itl = Histogram("nanoinfer_inter_token_latency_seconds", "Time between streamed tokens.",
                             LATENCY_BUCKETS)
        self._last = {}                                # request id -> (time, tokens) of its last output
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="nanoinfer-engine", daemon=True)
        self.thread.start()

    def submit(self, ids: list[int], params: SamplingParams) -> tuple[str, queue.Queue]:
        """Queue a request; ACCEPTED (or an exception), then its RequestOutput snapshots arrive on the queue."""
        with self.lock:     # one lock with drain: a request is either refused or counted as in flight
            if self.draining:
                raise shutting_down()
            # Back-pressure: refuse rather than queue without bound. A request that
            # would wait behind max_waiting others would likely time out anyway, and
            # an unbounded queue turns overload into unbounded memory and latency.
            # (Reading the deque's length from this thread is safe; being off by one
            # under a race only moves the limit by one.)
            if len(self.llm.scheduler.waiting) + self.inbox.qsize() >= self.max_waiting:
                raise APIError(503, f"the server has {self.max_waiting} requests waiting; try again later",
                               code="server_overloaded", headers={"Retry-After": "1"})
            rid, q = uuid.uuid4().hex, queue.Queue()     # unguessable ids: one client cannot abort another's
            self.live.add(rid)
            self.inbox.put(("add", rid, ids, params, q))
        return rid, q

    def abort(self, rid: str):
        self.inbox.put(("abort", rid))

    def num_live(self) -> int:
        with self.lock:
            return len(self.live)

    def start_draining(self) -> int:
        """Refuse new requests from now on; returns how many are in flight."""
        with self.lock:
            self.draining = True
            return len(self.live)

    def abort_all(self, error: Exception, timeout: float = 30.0) -> int:
        """Abort every request in the engine, each handler receiving `error`; returns how many."""
        done, box = threading.Event(), {"aborted": 0}
        self.inbox.put(("abort_all", error, done, box))
        done.wait(timeout)
        return box["aborted"]

    def stop(self):
        self._stop.set()
        self.inbox.put(("wake",))
        self.thread.join(timeout=10)

    def _loop(self):
        llm = self.llm
        if llm.decoder is not None:    # compile=True: CUDA graphs are recorded per thread, so
            llm.decoder.warmup()       # replay every bucket once here, before the first request
        while not self._stop.is_set():
            # Idle: sleep until a request arrives (the 0.5 s timeout only bounds how
            # long stop() waits). Busy: never block, take whatever has arrived, then
            # step: a new request joins the very next batch (continuous batching).
            try:
                msgs = [self.inbox.get(timeout=0.5) if not llm.has_unfinished_requests() else self.inbox.get_nowait()]
            except queue.Empty:
                msgs = []
            while not self.inbox.empty():
                msgs.append(self.inbox.get_nowait())
            for msg in msgs:
                self._apply(msg)
            if llm.has_unfinished_requests():
                self._step()

    def _apply(self, msg):
        """One message from a handler (or from drain), applied between two steps."""
        if msg[0] == "add":
            _, rid, ids, params, q = msg
            try:
                self.llm.add_request(ids, params, request_id=rid)
            except (ValueError, TypeError) as e:       # a bad request fails alone, as a 400
                self._end(rid)
                q.put(APIError(400, str(e)))
                return
            self.streams[rid] = q
            self._last[rid] = (time.perf_counter(), 0)
            q.put(ACCEPTED)
        # An abort may race with the request finishing: only live ones count.
        elif msg[0] == "abort" and msg[1] in self.streams:
            self._abort(msg[1])
        elif msg[0] == "abort_all":
            _, error, done, box = msg
            for rid in list(self.streams):
                self._abort(rid, error)
                box["aborted"] += 1
            done.set()

    def _abort(self, rid: str, error: Exception | None = None, counter: str = "aborted"):
        """Stop a request and free its blocks; its handler gets `error` (None: the client left)."""
        self.llm.abort(rid)
        q = self.streams.pop(rid)
        if error is not None:
            q.put(error)
        self._end(rid, counter)

    def _end(self, rid: str, counter: str | None = None):
        self._last.pop(rid, None)
        with self.lock:
            self.live.discard(rid)
            if counter:
                setattr(self, counter, getattr(self, counter) + 1)

    def _step(self):
        llm = self.llm
        try:
            outputs = llm.step()
        except Exception as e:   # an engine bug: fail the requests in the engine, keep serving
            print(f"nanoinfer: engine step failed: {e!r}", file=sys.stderr)
            error = APIError(500, f"internal engine error ({type(e).__name__}); the request was stopped",
                             code="engine_error")
            for rid in list(self.streams):
                self._abort(rid, error, counter="failed")
            for rid in list(llm.requests):     # anything left without a handler: free its blocks too
                llm.abort(rid)
            return
        # Every request that moved gets a snapshot of its whole state (text so
        # far, tokens, finish reason); the handler computes what is new.
        for out in outputs:
            self._observe(out)
            q = self.streams.get(out.request_id)
            if q is not None:
                q.put(out)
            if out.finished and self.streams.pop(out.request_id, None) is not None:
                self._end(out.request_id)

    def _observe(self, out):
        """Token counters and latency histograms from each output snapshot."""
        now, m = time.perf_counter(), out.metrics
        tokens = sum(len(c.token_ids) for c in out.outputs)
        # The first token's latency is TTFT (queueing + prefill); every later gap,
        # divided by the tokens it brought (speculation can bring several), is
        # the inter-token latency: one engine step of the whole batch.
        last_time, last_tokens = self._last.get(out.request_id, (now, tokens))
        with self.lock:
            if last_tokens == 0 and tokens > 0 and m.time_to_first_token is not None:
                self.ttft.observe(m.time_to_first_token)
            elif tokens > last_tokens:
                self.itl.observe((now - last_time) / (tokens - last_tokens))
            self.generation_tokens += tokens - last_tokens
            if out.finished:
                self.prompt_tokens += m.prompt_tokens
                self.finished += 1
        if out.finished:
            self._last.pop(out.request_id, None)
        else:
            self._last[out.request_id] = (now, tokens)

    def metrics_text(self) -> str:
        # Gauges are read live from the engine's structures (a scrape may see them
        # mid-step; each is a single len() or counter, so it is never torn).
        bm, sch = self.llm.block_manager, self.llm.scheduler
        gauges = [("requests_running", "Sequences in the running batch.", len(sch.running)),
                  ("requests_waiting", "Sequences waiting for a seat.", len(sch.waiting)),
                  ("kv_blocks_total", "KV cache blocks in the pool.", bm.num_blocks),
                  ("kv_blocks_free", "KV blocks free (including cached ones).", bm.num_free_blocks),
                  ("kv_blocks_used", "KV blocks held by sequences.", bm.num_blocks - bm.num_free_blocks),
                  ("kv_blocks_cached", "Free KV blocks still holding a reusable prefix.", bm.num_cached_blocks)]
        with self.lock:
            counters = [("prompt_tokens_total", "Prompt tokens of finished requests.", self.prompt_tokens),
                        ("generation_tokens_total", "Generated tokens.", self.generation_tokens),
                        ("requests_finished_total", "Requests finished.", self.finished),
                        ("requests_aborted_total", "Requests aborted (client gone, or drained).", self.aborted),
                        ("requests_failed_total", "Requests failed by an engine error.", self.failed)]
            lines = []
            for kind, rows in (("gauge", gauges), ("counter", counters)):
                for name, help_text, value in rows:
                    lines += [f"# HELP nanoinfer_{name} {help_text}", f"# TYPE nanoinfer_{name} {kind}",
                              f"nanoinfer_{name} {value}"]
            lines += self.ttft.render() + self.itl.render()
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------
# Request parsing: OpenAI JSON -> token ids + SamplingParams
# ----------------------------------------------------------------------------


def _opt(check):
    return lambda v: v is None or check(v)      # null means "the default", as in OpenAI's API


# field -> (check, what it must be). Fields of the OpenAI API we accept.
# One table instead of scattered ifs: every field is checked the same way and
# the error names the field (OpenAI's "param"), so a client sees exactly what
# to fix. Validation happens here, in the handler thread, before anything
# reaches the engine: a bad request never costs the batch a step.
# Only JSON types and what exists only in the API are checked here; the RANGES
# of the sampling fields are SamplingParams' (its LIMITS and __post_init__), so
# the server and the library can never disagree about what is allowed.
COMMON_FIELDS = {
    "model": (lambda v: isinstance(v, str), "a string"),
    "max_tokens": (_opt(is_int), "an integer"),
    "temperature": (_opt(is_num), "a number"),
    "top_p": (_opt(is_num), "a number"),
    "top_k": (_opt(is_int), "an integer (0 or -1: off)"),
    "seed": (_opt(is_int), "an integer"),
    "n": (_opt(is_int), "an integer"),
    "stream": (_opt(lambda v: isinstance(v, bool)), "a boolean"),
    "stream_options": (_opt(lambda v: isinstance(v, dict)), "an object"),
    "stop": (_opt(lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))),
             "a string or a list of strings"),
    "ignore_eos": (_opt(lambda v: isinstance(v, bool)), "a boolean"),
    "user": (lambda v: isinstance(v, str), "a string"),
    "presence_penalty": (lambda v: v is None or v == 0, "0 (penalties are not supported)"),
    "frequency_penalty": (lambda v: v is None or v == 0, "0 (penalties are not supported)"),
}
COMPLETION_FIELDS = {**COMMON_FIELDS,
                     "prompt": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(map(is_int, v))),
                                "a string or a list of token ids"),
                     "logprobs": (_opt(is_int), "an integer"),
                     "echo": (lambda v: v is None or v is False, "false (echo is not supported)")}
CHAT_FIELDS = {**COMMON_FIELDS,
               "messages": (lambda v: isinstance(v, list) and len(v) > 0, "a non-empty list of messages"),
               "logprobs": (_opt(lambda v: isinstance(v, bool)), "a boolean"),
               "top_logprobs": (_opt(is_int), "an integer"),
               "max_completion_tokens": (_opt(is_int), "an integer")}
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _check_fields(body, fields):
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for key, value in body.items():
        if key not in fields:       # as OpenAI does: a typo'd option must not be silently ignored
            raise APIError(400, f"unrecognized request argument: {short(key)}", key[:100])
        ok, what = fields[key]
        if not ok(value):
            raise APIError(400, f"{key!r} must be {what}, got {short(value)}", key)


def _unicode(text: str, param: str) -> str:
    """JSON can carry a lone surrogate ("\\ud800") that no UTF-8 encoder (the tokenizer's) accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param!r} holds a lone UTF-16 surrogate, which is not text", param) from None
    return text


def _chat_text(message, i):
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
        raise APIError(400, f"messages[{i}] must be an object with role system, developer, user or assistant",
                       "messages")
    content = message.get("content")
    # Newer clients send content as a list of typed parts; text parts are all a
    # text-only model can take, so they are joined and anything else refused.
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
    # "developer" is OpenAI's newer name for the system role
    return {"role": CHAT_ROLES[message["role"]], "content": _unicode(content, "messages")}


def parse_request(llm: LLM, body, chat: bool, max_request_tokens: int | None = None):
    """Validate an OpenAI request body. Returns (prompt token ids, SamplingParams, options)."""
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    tok = llm.tokenizer
    if chat:
        messages = [_chat_text(m, i) for i, m in enumerate(body["messages"])]
        # tokenize=True encodes the template's markers as special tokens but the
        # users' text as plain text: a message cannot forge "<|im_end|>"
        ids = tok.apply_chat_template(messages, tokenize=True)
    else:
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required", "prompt")
        prompt = body["prompt"]
        # A raw completion prompt belongs to the caller, special tokens included
        # (as in LLM.generate); only chat messages are protected from forging them.
        ids = tok.encode(_unicode(prompt, "prompt"), allow_special=True) if isinstance(prompt, str) else list(prompt)
    try:                                # the library's checks: ids in the vocabulary, and at least one
        check_token_ids(ids, llm.config.vocab_size)
    except ValueError as e:
        raise APIError(400, str(e), "messages" if chat else "prompt") from None
    # 413 (too large) rather than 400: the request is well formed, just bigger
    # than the context (or KV pool) can ever hold, so retrying cannot help.
    if len(ids) >= llm.max_len:
        raise APIError(413, f"the prompt has {len(ids)} tokens; this server's context holds {llm.max_len}",
                       "messages" if chat else "prompt", "context_length_exceeded")
    served = os.path.basename(os.path.normpath(llm.path))
    if body.get("model") not in (None, served):
        raise APIError(404, f"the model {short(body['model'])} does not exist; this server serves {served!r}",
                       "model", "model_not_found")
    params = _sampling_params(llm, body, chat, len(ids), max_request_tokens)
    return ids, params, {"stream": bool(body.get("stream")), "model": served}


def _sampling_params(llm: LLM, body: dict, chat: bool, prompt_len: int, max_request_tokens: int | None):
    """The request's SamplingParams: API spellings mapped to the library's, then the
    limits that depend on this server (its context, its batch, its per-request cap)."""
    get = lambda k, default: default if body.get(k) is None else body[k]   # noqa: E731
    room = llm.max_len - prompt_len
    # OpenAI's defaults, so a client ported from OpenAI behaves the same:
    # completions stop at 16 tokens (or sooner if the context is nearly full),
    # chat runs to EOS (bounded by the context), temperature 1.
    mt_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    cap, n = max_request_tokens or DEFAULT_REQUEST_CONTEXTS * llm.max_len, get("n", 1)
    default = room if chat else min(16, room)
    if is_int(n) and n >= 1:            # a default the client did not choose must not break the cap
        default = max(1, min(default, cap // n))
    max_tokens = get(mt_name, default)
    # vLLM's rule: an explicit max_tokens the context cannot hold is refused, not
    # silently cut (a client asking for 10^8 tokens learns the real limit).
    if max_tokens >= 1 and prompt_len + max_tokens > llm.max_len:
        raise APIError(400, f"this model's context holds {llm.max_len} tokens, but {prompt_len} are in the prompt "
                       f"and {mt_name} asks for {max_tokens} more ({prompt_len + max_tokens} in all); "
                       f"ask for at most {room}", mt_name, "context_length_exceeded")
    if chat:
        if body.get("top_logprobs") is not None and not body.get("logprobs"):
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = get("top_logprobs", 0) if get("logprobs", False) else None
    else:
        logprobs = get("logprobs", None)
    top_k = get("top_k", 0)
    fields = dict(max_tokens=max_tokens, temperature=_float(get("temperature", 1.0), "temperature"),
                  top_p=_float(get("top_p", 1.0), "top_p"),
                  # -1 is vLLM's spelling of "off"; k beyond the vocabulary keeps every token anyway
                  top_k=0 if top_k == -1 else min(top_k, llm.config.vocab_size),
                  seed=get("seed", None), stop=[_unicode(s, "stop") for s in _as_list(get("stop", []))],
                  n=get("n", 1), ignore_eos=get("ignore_eos", False), logprobs=logprobs)
    params = _checked_params(fields, {"max_tokens": mt_name, "logprobs": "top_logprobs" if chat else "logprobs"})
    # Limits of this server rather than of sampling: seats in the batch, and the
    # work one request may ask for (n samples x max_tokens each, all in the batch).
    try:
        check_seats(params.n, llm.scheduler.max_num_seqs)
    except ValueError as e:
        raise APIError(400, str(e), "n") from None
    if params.n * params.max_tokens > cap:
        raise APIError(400, f"n x {mt_name} = {params.n} x {params.max_tokens} = {params.n * params.max_tokens} "
                       f"tokens; this server generates at most {cap} per request", "n" if params.n > 1 else mt_name,
                       "request_too_large")
    return params


# The default per-request cap on n x max_tokens, in contexts: n = 16 full-length
# samples, or n = 128 at an eighth of the context. Beyond that one request would
# hold its seats for many times the longest single answer.
DEFAULT_REQUEST_CONTEXTS = 16


def _as_list(stop):
    return [stop] if isinstance(stop, str) else stop


def _float(value, param: str) -> float:
    # JSON integers are unbounded: float(10**400) overflows, which is the client's error
    try:
        return float(value)
    except OverflowError:
        raise APIError(400, f"{param!r} is too large: {short(value)}", param) from None


def _checked_params(fields: dict, api_names: dict) -> SamplingParams:
    """SamplingParams(**fields), its ValueError turned into a 400 naming the API field.

    SamplingParams states every range once (LIMITS); to name the field at fault
    without parsing its message, each field is tried alone over the defaults."""
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        error = e
    for name, value in fields.items():
        try:
            SamplingParams(**{name: value})
        except (ValueError, TypeError) as e:
            param = api_names.get(name, name)
            raise APIError(400, str(e).replace(f"SamplingParams.{name}", repr(param)), param) from None
    raise APIError(400, str(error)) from None      # only a combination of fields is at fault


# ----------------------------------------------------------------------------
# Responses
# ----------------------------------------------------------------------------


def _logprobs_json(llm, token_ids: list, logprobs: list | None, chat: bool):
    """The OpenAI logprobs object for these tokens (logprobs: (value, {alternative: value}) each)."""
    if logprobs is None:
        return None
    tok = llm.tokenizer
    # A token is bytes, not always whole UTF-8 characters: show it with
    # replacement characters, and give the exact bytes too (chat's format).
    piece = lambda t: tok.token_bytes(t).decode("utf-8", errors="replace")   # noqa: E731
    items = list(zip(token_ids, logprobs))
    if chat:
        return {"content": [{"token": piece(t), "logprob": lp, "bytes": list(tok.token_bytes(t)),
                             "top_logprobs": [{"token": piece(a), "logprob": alp, "bytes": list(tok.token_bytes(a))}
                                              for a, alp in top.items()]} for t, (lp, top) in items]}
    return {"tokens": [piece(t) for t, _ in items], "token_logprobs": [lp for _, (lp, _) in items],
            "top_logprobs": [{piece(a): alp for a, alp in top.items()} for _, (_, top) in items]}


# ----------------------------------------------------------------------------
# HTTP plumbing: deadlines, size checks, JSON errors for everything
# ----------------------------------------------------------------------------


class _DeadlineReader(io.RawIOBase):
    """The socket's read side, with a deadline for a whole phase (the headers,
    the body) rather than for each recv: a client trickling one byte every few
    seconds passes any per-recv timeout and would hold its thread forever."""

    def __init__(self, sock: socket.socket):
        self.sock, self.until, self.got = sock, None, 0

    def readable(self):
        return True

    def readinto(self, buf) -> int:
        if self.until is not None:
            left = self.until - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            self.sock.settimeout(left)
        n = self.sock.recv_into(buf)
        self.got += n
        return n


class JSONRequestHandler(BaseHTTPRequestHandler):
    """http.server's handler made safe to expose: each phase of reading a
    request has a deadline, a body is refused by its declared size before it is
    read, every error (http.server's own included) is an OpenAI-style JSON
    object, and a method a path does not take gets 405 with Allow. The API
    itself is in Handler, below; the server's limits are attributes of Server."""
    protocol_version = "HTTP/1.1"       # keep-alive: a client's next request reuses the connection
    default_request_version = "HTTP/1.1"   # an unparsable request line still gets a status line (not HTTP/0.9's none)
    server_version = "nanoinfer"
    ROUTES = {"/health": "GET", "/metrics": "GET", "/v1/models": "GET",
              "/v1/completions": "POST", "/v1/chat/completions": "POST"}

    def log_message(self, fmt, *args):   # quiet by default; errors still reach stderr
        pass

    def setup(self):
        super().setup()
        self.rfile.close()               # http.server's plain reader, replaced by one with deadlines
        self._reader = _DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self):
        """Read one request within --header-timeout, then dispatch it."""
        reader, timeout = self._reader, self.server.header_timeout
        # The deadline starts before the request line, so an idle keep-alive
        # connection is closed too: it holds a thread and one of max_connections.
        reader.until, reader.got = time.monotonic() + timeout, 0
        self.command, self.requestline, self.request_version = "", "", "HTTP/1.1"
        self._body_unread = False
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if not self.raw_requestline:               # the client closed the connection
                self.close_connection = True
                return
            if len(self.raw_requestline) > 65536:
                self.close_connection = True
                return self._send_error(APIError(414, "the request line is too long"))
            if not self.parse_request():               # it answered already (via send_error)
                self.close_connection = True
                return
        except TimeoutError:
            self.close_connection = True
            # Silence for an idle connection (nothing was asked); 408 for a slow request.
            if reader.got:
                self._send_error(APIError(408, f"the request headers did not arrive within {timeout:g} s",
                                          code="timeout"))
            return
        except OSError:
            self.close_connection = True
            return
        self._dispatch()

    def end_headers(self):
        # From here the socket writes. A send may block --body-timeout at most on a
        # client that stopped reading; then it counts as gone (its request aborted).
        self._reader.until = None
        self.connection.settimeout(self.server.body_timeout)
        super().end_headers()

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (bad request line, 431 headers too large, ...) as JSON."""
        self.close_connection = True
        self._send_error(APIError(int(code), (message or HTTPStatus(code).phrase)[:200]))

    def _send_json(self, status: int, obj, headers: dict | None = None):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self._body_unread:         # the rest of the stream is an unread body, not a next request
            self.close_connection = True
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":    # a response to HEAD has no body, whatever its status
            self.wfile.write(data)

    def _send_error(self, e: APIError):
        try:
            self._send_json(e.status, error_json(e), e.headers)
        except OSError:               # the client is gone: nobody to tell
            self.close_connection = True

    def _linger(self, seconds: float = 1.0):
        """After refusing a request whose body we did not read: half-close, then
        read and drop what the client still sends, for a moment. Closing a socket
        with unread data resets the connection, and a reset can destroy our
        answer before the client has read it."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            end = time.monotonic() + seconds
            while (left := end - time.monotonic()) > 0:
                self.connection.settimeout(left)
                if not self.connection.recv(65536):
                    break
        except OSError:
            pass

    def _precheck(self) -> int:
        """Everything decided by the request line and headers, before any body is
        read: the route, the key, the method, draining, the body's size. Returns
        the body's length for a POST."""
        path, server = urlsplit(self.path).path, self.server
        self._body_unread = "Content-Length" in self.headers or "Transfer-Encoding" in self.headers
        allowed = self.ROUTES.get(path)
        if server.api_key and path.startswith("/v1/") and not self._authorized():
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if self.command not in ("GET", "POST") or (allowed and self.command != allowed):
            raise APIError(405, f"{path} does not take {self.command[:20]}; use {allowed or 'GET or POST'}",
                           code="method_not_allowed", headers={"Allow": allowed or "GET, POST"})
        if allowed is None:
            raise APIError(404, f"no such path: {path[:200]}")
        if self.command == "GET":
            return 0
        if server.draining:
            raise shutting_down()
        return self._content_length()

    def _authorized(self) -> bool:
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        # compare_digest's time does not depend on where the strings differ, so the
        # key cannot be guessed a byte at a time from response times.
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("latin-1", "replace"), self.server.api_key.encode())

    def _content_length(self) -> int:
        """The body's declared size, checked before reading it: 400 if missing or
        not a number, 413 if over --max-body-bytes (a 60 MB body is refused
        without receiving it, not read whole before a JSON error)."""
        if "Transfer-Encoding" in self.headers:
            raise APIError(400, "chunked request bodies are not supported: send Content-Length",
                           code="invalid_content_length")
        values = self.headers.get_all("Content-Length") or []
        if not values:
            raise APIError(400, "a POST needs a Content-Length header", code="invalid_content_length")
        value = values[0].strip()
        if len(set(values)) > 1 or not re.fullmatch(r"[0-9]+", value):
            raise APIError(400, f"Content-Length must be a number of bytes, got {short(', '.join(values))}",
                           code="invalid_content_length")
        limit = self.server.max_body_bytes
        if len(value) > 18 or int(value) > limit:
            raise APIError(413, f"the body has {value[:30]} bytes; this server takes at most {limit}",
                           code="body_too_large")
        return int(value)

    def handle_expect_100(self):
        # "Expect: 100-continue": the client waits for our go-ahead before sending
        # the body, so a refusal here costs it no upload at all.
        try:
            self._precheck()
        except APIError as e:
            self._send_error(e)
            self.close_connection = True
            return False
        return super().handle_expect_100()

    def _read_body(self, length: int) -> bytes:
        timeout = self.server.body_timeout
        self._reader.until = time.monotonic() + timeout     # the whole body, however it trickles in
        try:
            data = self.rfile.read(length)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="timeout") from None
        if len(data) < length:
            raise ConnectionAbortedError("the client closed before sending its whole body")
        self._body_unread = False
        return data

    def _dispatch(self):
        try:
            length = self._precheck()
            if self.command == "GET":
                self.get(urlsplit(self.path).path)
            else:
                self.post(urlsplit(self.path).path, length)
        except APIError as e:
            self._send_error(e)
        except OSError:                 # the client left, or stopped reading: nobody to answer
            self.close_connection = True
        except Exception as e:          # a bug: never a traceback to the client
            print(f"nanoinfer: error handling {self.command} {self.path[:200]}: {e!r}", file=sys.stderr)
            self._send_error(APIError(500, "internal server error"))
        if self._body_unread:
            self.close_connection = True
            self._linger()


def _parse_json(data: bytes):
    """The body as JSON: parse errors are 400s, not tracebacks."""
    def no_constant(name):              # NaN and Infinity are Python's extension, not JSON
        raise ValueError(f"{name} is not a JSON value")
    try:
        return json.loads(data or b"null", parse_constant=no_constant)
    except RecursionError:
        raise APIError(400, "the body is nested too deeply") from None
    except ValueError as e:             # JSONDecodeError, bad UTF-8, an integer over 4300 digits
        raise APIError(400, f"the body is not valid JSON: {short(str(e), 200)}") from None


# ----------------------------------------------------------------------------
# The API: one request's life
# ----------------------------------------------------------------------------

# How often a waiting handler looks whether its client is still there: a
# departed client's request keeps its seat and KV blocks at most this long.
CLIENT_CHECK_SECONDS = 0.2


class Handler(JSONRequestHandler):
    """One instance per connection, on the connection's own thread
    (ThreadingHTTPServer). It may block for as long as generation takes: the
    engine thread keeps stepping the batch meanwhile."""

    @property
    def engine(self) -> Engine:
        return self.server.engine

    def get(self, path: str):
        llm = self.engine.llm
        if path == "/health":
            if self.server.draining:   # a load balancer's probe: send new users elsewhere
                raise shutting_down()
            self._send_json(200, {"status": "ok"})
        elif path == "/v1/models":
            name = os.path.basename(os.path.normpath(llm.path))
            self._send_json(200, {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                              "owned_by": "nanoinfer", "max_model_len": llm.max_len}]})
        elif path == "/metrics":
            data = self.engine.metrics_text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    def post(self, path: str, length: int):
        server = self.server
        with server.count_lock:          # drain waits until no handler is answering
            server.busy += 1
        try:
            body = _parse_json(self._read_body(length))
            chat = path == "/v1/chat/completions"
            # Tokenize and validate here, on the handler's thread: the engine
            # thread's time belongs to the batch.
            ids, params, opts = parse_request(self.engine.llm, body, chat, server.max_request_tokens)
            rid, q = self.engine.submit(ids, params)
            self._next_check = time.monotonic() + CLIENT_CHECK_SECONDS
            # Wait until the engine took it: a refusal (e.g. by add_request) is still
            # a plain HTTP error, before a stream's 200 has been sent.
            if self._next(rid, q) is ACCEPTED:
                self._respond(rid, q, ids, params, opts, chat)
        finally:
            with server.count_lock:
                server.busy -= 1

    def _client_gone(self) -> bool:
        """True if the client closed its side (readable with nothing to read).

        Without this, a non-streaming request whose client gave up would keep
        its seat in the batch and its KV blocks until it finished generating;
        we only learn of a closed socket by looking (or by a failed write)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _next(self, rid, q):
        """The engine's next message for this request (ACCEPTED or an output);
        None if the client left (the request is then aborted); raises the
        engine's error as an APIError."""
        while True:
            try:
                item = q.get(timeout=CLIENT_CHECK_SECONDS)
            except queue.Empty:
                item = None
            # Look on a clock, not only when the queue is quiet: while a request
            # generates, an output arrives every step, so a look taken only after
            # 0.2 s without output never came, and non-streaming requests whose
            # clients had left ran to the end (issue 20).
            if time.monotonic() >= self._next_check:
                self._next_check = time.monotonic() + CLIENT_CHECK_SECONDS
                if self._client_gone():
                    self.engine.abort(rid)
                    return None
            if isinstance(item, APIError):
                raise item
            if isinstance(item, Exception):
                raise APIError(500, str(item))
            if item is not None and getattr(item, "error", None):   # the engine failed this request alone
                raise APIError(500, f"the request failed: {item.error}", code="request_failed")
            if item is not None:
                return item

    # -- a request's life: wait for outputs, write them --

    def _outputs(self, rid, q):
        """Yield RequestOutput snapshots until finished; stop if the client leaves."""
        while True:
            out = self._next(rid, q)
            if out is None:
                return
            yield out
            if out.finished:
                return

    def _respond(self, rid, q, ids, params, opts, chat):
        created, model = int(time.time()), opts["model"]
        obj_id = ("chatcmpl-" if chat else "cmpl-") + rid
        usage = lambda out: {"prompt_tokens": len(ids), "total_tokens": len(ids) + sum(   # noqa: E731
            len(c.token_ids) for c in out.outputs), "completion_tokens": sum(len(c.token_ids) for c in out.outputs)}
        head = (obj_id, created, model, usage)
        if opts["stream"]:
            self._respond_stream(rid, q, params, chat, head)
        else:
            self._respond_full(rid, q, chat, head)

    def _respond_full(self, rid, q, chat, head):
        (obj_id, created, model, usage), final = head, None    # only the last snapshot matters
        for final in self._outputs(rid, q):
            pass
        if final is None or not final.finished:
            return                                      # the client left
        choices = []
        for c in final.outputs:
            lp = _logprobs_json(self.engine.llm, c.token_ids, c.logprobs, chat)
            if chat:
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "text": c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason})
        self._send_json(200, {"id": obj_id, "object": "chat.completion" if chat else "text_completion",
                              "created": created, "model": model, "choices": choices, "usage": usage(final)})

    def _respond_stream(self, rid, q, params, chat, head):
        # Streaming: server-sent events. The response has no length, so the
        # connection closes after "data: [DONE]".
        # assignment: sse-stream
        obj_id, created, model, usage = head
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices, **extra):
            data = {"id": obj_id, "object": kind, "created": created, "model": model, "choices": choices, **extra}
            self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
            self.wfile.flush()
        try:
            if chat:    # the first chunk of each choice names the role
                event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(params.n)])
            final, done = None, set()
            for final in self._outputs(rid, q):
                # Each snapshot carries what the step added (new_text): the engine
                # already held back text that may still become a stop string, and
                # half a UTF-8 character, so every delta can be sent as it is.
                choices = []
                for c in final.outputs:
                    if c.index in done or not (c.new_text or c.finish_reason or c.new_logprobs):
                        continue                            # finished earlier, or nothing to show yet
                    if c.finish_reason:
                        done.add(c.index)
                    lp = _logprobs_json(self.engine.llm, c.new_token_ids, c.new_logprobs, chat)
                    choices.append({"index": c.index, "delta": {"content": c.new_text} if c.new_text else {},
                                    "logprobs": lp, "finish_reason": c.finish_reason} if chat else
                                   {"index": c.index, "text": c.new_text, "logprobs": lp,
                                    "finish_reason": c.finish_reason})
                if choices:
                    event(choices)
            if final is None or not final.finished:
                return
            event([], usage=usage(final))            # usage counts ride on a last, choice-less chunk
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except APIError as e:                         # failed or drained after the stream began:
            self._stream_error(e)                     # the status is sent, so the error is the last event
        except OSError:                               # the client left mid-stream, or stopped reading
            self.engine.abort(rid)                    # (send timeout): free its blocks
        # end assignment

    def _stream_error(self, e: APIError):
        """The end of a stream that failed: an error event, then [DONE] (as vLLM does)."""
        try:
            self.wfile.write(b"data: " + json.dumps(error_json(e)).encode() + b"\n\ndata: [DONE]\n\n")
        except OSError:
            pass


# ----------------------------------------------------------------------------
# The server: a cap on connections, and a graceful drain
# ----------------------------------------------------------------------------


class Server(ThreadingHTTPServer):
    """ThreadingHTTPServer (a thread per connection) with the limits its
    handlers enforce, a cap on open connections, and drain()."""
    daemon_threads = True        # a hung client connection must not keep the process alive at exit
    block_on_close = False       # server_close() must not wait for idle keep-alive connections

    def __init__(self, address, engine: Engine, *, api_key=None, max_body_bytes=4 << 20, max_request_tokens=None,
                 max_connections=512, header_timeout=10.0, body_timeout=30.0):
        for name, value in (("max_body_bytes", max_body_bytes), ("max_connections", max_connections),
                            ("header_timeout", header_timeout), ("body_timeout", body_timeout),
                            ("max_request_tokens", 1 if max_request_tokens is None else max_request_tokens)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        self.engine, self.api_key = engine, api_key or None
        self.max_body_bytes, self.max_request_tokens = max_body_bytes, max_request_tokens
        self.max_connections, self.header_timeout, self.body_timeout = max_connections, header_timeout, body_timeout
        self.draining = False
        self.count_lock = threading.Lock()
        self.open_connections = self.busy = 0        # connections with a thread; handlers answering a POST
        self._refused = deque()                     # (time, socket) answered 503, closed a moment later
        # The kernel's queue of connections not yet accepted. socketserver's default
        # of 5 overflows in any burst of connects while the accepting thread waits
        # for the GIL, and the kernel then drops or resets them (seen with 64 clients).
        self.request_queue_size = min(max_connections, socket.SOMAXCONN)
        super().__init__(address, Handler)

    # Each connection costs a thread (and its stack) for as long as it is open.
    # Beyond max_connections a new one is answered 503 at once by the accepting
    # thread, without a thread of its own, so a flood cannot exhaust threads.
    def process_request(self, request, client_address):
        with self.count_lock:
            full = self.open_connections >= self.max_connections
            self.open_connections += not full
        if full:
            return self._refuse(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            with self.count_lock:
                self.open_connections -= 1
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.count_lock:
                self.open_connections -= 1

    def _refuse(self, sock: socket.socket):
        # The answer fits the empty send buffer of a new socket, so a non-blocking
        # send never stalls the accept loop. The socket is closed a second later
        # (service_actions) after reading what the client sent: closing with
        # unread data resets the connection, which could destroy the answer.
        e = APIError(503, f"the server has {self.max_connections} open connections; try again later",
                     code="too_many_connections")
        body = json.dumps(error_json(e)).encode()
        head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        try:
            sock.setblocking(False)
            sock.send(head + body)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._refused.append((time.monotonic(), sock))
        while len(self._refused) > 1024:            # bounded: past that, close at once
            _close_quietly(self._refused.popleft()[1])

    def service_actions(self):                      # serve_forever calls this every poll (0.5 s)
        while self._refused and time.monotonic() - self._refused[0][0] > 1.0:
            _close_quietly(self._refused.popleft()[1])

    def server_close(self):
        super().server_close()
        while self._refused:
            _close_quietly(self._refused.popleft()[1])

    def drain(self, timeout: float, hurry: threading.Event | None = None) -> dict:
        """Graceful shutdown, before stopping serve_forever: from now on new
        requests get 503 (and /health too, so a load balancer moves users
        elsewhere); requests in flight get `timeout` seconds to finish (less if
        `hurry` is set); the rest are aborted, their clients told so (a JSON
        error, or a stream's error event), and every KV block goes back.
        Returns what happened: in_flight, aborted, kv_blocks_free, kv_blocks_total."""
        engine = self.engine
        self.draining = True
        in_flight = engine.start_draining()
        deadline = time.monotonic() + timeout
        while engine.num_live() and time.monotonic() < deadline and not (hurry and hurry.is_set()):
            time.sleep(0.02)
        aborted = engine.abort_all(shutting_down())
        # The handlers now write those errors; one whose client stopped reading
        # gives up after body_timeout (its send times out).
        grace = time.monotonic() + self.body_timeout + 1
        while self.busy and time.monotonic() < grace:
            time.sleep(0.02)
        bm = engine.llm.block_manager
        return {"in_flight": in_flight, "aborted": aborted, "kv_blocks_free": bm.num_free_blocks,
                "kv_blocks_total": bm.num_blocks}


def _close_quietly(sock: socket.socket):
    try:
        sock.setblocking(False)
        for _ in range(64):                         # drop what arrived (up to 4 MB), so close sends FIN, not RST
            if not sock.recv(65536):
                break
    except OSError:
        pass
    sock.close()


def make_server(llm: LLM, host: str = "127.0.0.1", port: int = 8000, max_waiting: int = 256, **limits) -> Server:
    """An HTTP server bound to (host, port) with its engine thread running;
    call serve_forever() on it (port 0 picks a free port: server.server_address).
    limits: api_key, max_body_bytes, max_request_tokens (n x max_tokens; None =
    16 contexts), max_connections, header_timeout, body_timeout (seconds)."""
    engine = Engine(llm, max_waiting)
    try:
        return Server((host, port), engine, **limits)
    except BaseException:
        engine.stop()
        raise


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
    return (f"nanoinfer: WARNING: listening on {host or 'every interface'} without an API key: anyone who can "
            f"reach this port can use it (set --api-key or NANOINFER_API_KEY)")


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def one_shot(llm: LLM, prompt: str, chat: bool, params: SamplingParams, out=None):
    """Generate for one prompt, printing text as it is produced.

    No server and no threads: the same add_request/step loop the engine thread
    runs, for one request, printing each step's new text (the engine holds
    back what may still become a stop string)."""
    out = out or sys.stdout
    if chat:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
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


def parse_args(argv=None):
    """The command line: every engine option of LLM, the serving limits, one-shot mode."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-bytes", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--quantization", choices=["int8"], default=None)
    ap.add_argument("--kv-cache-dtype", choices=["int8"], default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--speculative", default=None, help="'ngram' or a draft model directory")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="split every layer over N devices (N-1 worker processes, parallel.py)")
    srv = ap.add_argument_group("serving limits")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (default: "
                     "$NANOINFER_API_KEY, which keeps the key out of the process list)")
    srv.add_argument("--max-waiting", type=int, default=256, help="queued requests before answering 503")
    srv.add_argument("--max-connections", type=int, default=512, help="open connections before answering 503")
    srv.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger bodies get 413 (default 4 MiB)")
    srv.add_argument("--max-request-tokens", type=int, default=None,
                     help="n x max_tokens at most per request (default 16 x the context)")
    srv.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds for a request's line and headers to arrive (and for an idle keep-alive)")
    srv.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds for a request's body to arrive (and for a blocked send to a client)")
    srv.add_argument("--drain-seconds", type=float, default=30.0,
                     help="on SIGTERM/Ctrl-C, how long requests in flight may still run")
    one = ap.add_argument_group("one-shot")
    one.add_argument("--prompt", default=None, help="one-shot: generate for this prompt and exit")
    one.add_argument("--chat", action="store_true", help="one-shot: wrap --prompt in the chat template")
    one.add_argument("--max-tokens", type=int, default=256, help="one-shot: tokens to generate")
    one.add_argument("--temperature", type=float, default=0.0, help="one-shot: 0 = greedy")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # Every engine option of LLM is a flag, so a lesson's feature can be served
    # as well as benchmarked (e.g. --compile --quantization int8).
    llm = LLM(args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
              kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, compile=args.compile,
              speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
              tensor_parallel_size=args.tensor_parallel_size)
    if args.prompt is not None:
        one_shot(llm, args.prompt, args.chat, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
        llm.close()
        return
    api_key = args.api_key or os.environ.get("NANOINFER_API_KEY") or None
    server = make_server(llm, args.host, args.port, args.max_waiting, api_key=api_key,
                         max_connections=args.max_connections, max_body_bytes=args.max_body_bytes,
                         max_request_tokens=args.max_request_tokens, header_timeout=args.header_timeout,
                         body_timeout=args.body_timeout)
    # Loopback by default: exposing the server (--host 0.0.0.0) must be a
    # deliberate choice, and without a key a loud one.
    warning = exposure_warning(args.host, api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    host, port = server.server_address[:2]
    print(f"nanoinfer: serving {os.path.basename(os.path.normpath(llm.path))} on http://{host}:{port}/v1 "
          f"(Ctrl-C to stop){' with an API key' if api_key else ''}", flush=True)
    serve_until_signal(server, args.drain_seconds)


def serve_until_signal(server: Server, drain_seconds: float):
    """serve_forever on a thread until SIGTERM or SIGINT, then drain and stop.

    The main thread only waits: a signal handler must not block, and drain()
    needs the serving thread still answering (503s to newcomers, the rest of
    the streams in flight) while it waits."""
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(signum, frame):       # the first signal drains; a second one stops waiting
        (hurry if stop.is_set() else stop).set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    threading.Thread(target=server.serve_forever, name="nanoinfer-http", daemon=True).start()
    while not stop.wait(0.5):
        pass
    print(f"\nnanoinfer: draining: {server.engine.num_live()} requests in flight get up to {drain_seconds:g} s "
          f"(signal again to stop them now)", flush=True)
    report = server.drain(drain_seconds, hurry)
    server.shutdown()
    server.server_close()
    server.engine.stop()
    server.engine.llm.close()          # after the engine thread: tensor-parallel workers stop last
    print(f"nanoinfer: stopped ({report['in_flight']} in flight, {report['aborted']} aborted); "
          f"{report['kv_blocks_free']}/{report['kv_blocks_total']} KV blocks free", flush=True)


if __name__ == "__main__":
    main()
