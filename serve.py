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
    GET  /v1/models, /health, /metrics (Prometheus text format)
"stream": true answers with server-sent events, "data: {json}\\n\\n" per
chunk, ending with "data: [DONE]". Errors are OpenAI-style error objects:
400 bad request, 413 prompt too long, 404 unknown path or model, 503 when
the waiting queue is full. A client that disconnects has its request
aborted, so its KV blocks go back to the pool at once.

    python serve.py [--model PATH] [--host 127.0.0.1] [--port 8000] [engine options]
    python serve.py --prompt "Once upon a time"          # one-shot, streamed to stdout
    python serve.py --chat --prompt "What is the capital of France?"
Only the standard library is used (http.server, threading, queue, json).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from scheduler import LLM, SamplingParams

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


class Overloaded(Exception):
    """The waiting queue is full (HTTP 503)."""


class Engine:
    """Owns the LLM and runs llm.step() while there is work; the only thread
    that touches the LLM. Handlers submit() and read their queue."""

    def __init__(self, llm: LLM, max_waiting: int = 256):
        self.llm, self.max_waiting = llm, max_waiting
        # Handlers never call the LLM: they post messages here, and the engine
        # thread applies them between steps, so no lock is needed around the
        # scheduler, the block manager or the KV cache.
        self.inbox: queue.Queue = queue.Queue()        # ("add", rid, ids, params, q) | ("abort", rid)
        self.streams: dict[str, queue.Queue] = {}      # request id -> its handler's queue
        self.lock = threading.Lock()                   # guards the metrics below
        self.prompt_tokens = self.generation_tokens = self.finished = self.aborted = 0
        self.ttft = Histogram("nanoinfer_time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.itl = Histogram("nanoinfer_inter_token_latency_seconds", "Time between streamed tokens.",
                             LATENCY_BUCKETS)
        self._last = {}                                # request id -> (time, tokens) of its last output
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="nanoinfer-engine", daemon=True)
        self.thread.start()

    def submit(self, ids: list[int], params: SamplingParams) -> tuple[str, queue.Queue]:
        """Queue a request; its RequestOutput snapshots (or an exception) arrive on the queue."""
        # Back-pressure: refuse rather than queue without bound. A request that
        # would wait behind max_waiting others would likely time out anyway, and
        # an unbounded queue turns overload into unbounded memory and latency.
        # (Reading the deque's length from this thread is safe; being off by one
        # under a race only moves the limit by one.)
        if len(self.llm.scheduler.waiting) + self.inbox.qsize() >= self.max_waiting:
            raise Overloaded(f"the server has {self.max_waiting} requests waiting; try again later")
        rid, q = uuid.uuid4().hex, queue.Queue()     # unguessable ids: one client cannot abort another's
        self.inbox.put(("add", rid, ids, params, q))
        return rid, q

    def abort(self, rid: str):
        self.inbox.put(("abort", rid))

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
                if msg[0] == "add":
                    _, rid, ids, params, q = msg
                    try:
                        llm.add_request(ids, params, request_id=rid)
                        self.streams[rid] = q
                        self._last[rid] = (time.perf_counter(), 0)
                    except (ValueError, TypeError) as e:       # a bad request fails alone
                        q.put(e)
                # An abort may race with the request finishing: only live ones count.
                elif msg[0] == "abort" and msg[1] in self.streams:
                    llm.abort(msg[1])
                    self.streams.pop(msg[1])
                    self._last.pop(msg[1], None)
                    with self.lock:
                        self.aborted += 1
            if not llm.has_unfinished_requests():
                continue
            try:
                outputs = llm.step()
            except Exception as e:                           # an engine bug: fail the running requests, keep serving
                print(f"nanoinfer: engine step failed: {e!r}", file=sys.stderr)
                for rid, q in list(self.streams.items()):
                    llm.abort(rid)
                    q.put(RuntimeError("internal engine error"))
                self.streams.clear()
                continue
            # Every request that moved gets a snapshot of its whole state (text so
            # far, tokens, finish reason); the handler computes what is new.
            for out in outputs:
                self._observe(out)
                q = self.streams.get(out.request_id)
                if q is not None:
                    q.put(out)
                if out.finished:
                    self.streams.pop(out.request_id, None)

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
                        ("requests_aborted_total", "Requests aborted (client gone).", self.aborted)]
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


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def _is_int(x):
    # JSON true is a Python bool, and bool is a subclass of int: "max_tokens": true
    # must be a type error, not 1 token.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# field -> (check, what it must be). Fields of the OpenAI API we accept.
# One table instead of scattered ifs: every field is checked the same way and
# the error names the field (OpenAI's "param"), so a client sees exactly what
# to fix. Validation happens here, in the handler thread, before anything
# reaches the engine: a bad request never costs the batch a step.
COMMON_FIELDS = {
    "model": (lambda v: isinstance(v, str), "a string"),
    "max_tokens": (lambda v: v is None or (_is_int(v) and v >= 1), "an integer >= 1"),
    "temperature": (lambda v: v is None or (_is_num(v) and 0 <= v <= 2), "a number in [0, 2]"),
    "top_p": (lambda v: v is None or (_is_num(v) and 0 < v <= 1), "a number in (0, 1]"),
    "top_k": (lambda v: v is None or (_is_int(v) and v >= -1), "an integer >= -1 (0 or -1: off)"),
    "seed": (lambda v: v is None or _is_int(v), "an integer"),
    "n": (lambda v: v is None or (_is_int(v) and 1 <= v <= 16), "an integer in [1, 16]"),
    "stream": (lambda v: v is None or isinstance(v, bool), "a boolean"),
    "stream_options": (lambda v: v is None or isinstance(v, dict), "an object"),
    "stop": (lambda v: v is None or (isinstance(v, str) and v) or (isinstance(v, list) and len(v) <= 4 and all(
        isinstance(s, str) and s for s in v)), "a non-empty string or a list of at most 4"),
    "ignore_eos": (lambda v: v is None or isinstance(v, bool), "a boolean"),
    "user": (lambda v: isinstance(v, str), "a string"),
    "presence_penalty": (lambda v: v is None or v == 0, "0 (penalties are not supported)"),
    "frequency_penalty": (lambda v: v is None or v == 0, "0 (penalties are not supported)"),
}
COMPLETION_FIELDS = {**COMMON_FIELDS,
                     "prompt": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(map(_is_int, v))),
                                "a string or a list of token ids"),
                     "logprobs": (lambda v: v is None or (_is_int(v) and 0 <= v <= 5), "an integer in [0, 5]"),
                     "echo": (lambda v: v is None or v is False, "false (echo is not supported)")}
CHAT_FIELDS = {**COMMON_FIELDS,
               "messages": (lambda v: isinstance(v, list) and len(v) > 0, "a non-empty list of messages"),
               "logprobs": (lambda v: v is None or isinstance(v, bool), "a boolean"),
               "top_logprobs": (lambda v: v is None or (_is_int(v) and 0 <= v <= 20), "an integer in [0, 20]"),
               "max_completion_tokens": (lambda v: v is None or (_is_int(v) and v >= 1), "an integer >= 1")}


def _check_fields(body, fields):
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for key, value in body.items():
        if key not in fields:       # as OpenAI does: a typo'd option must not be silently ignored
            raise APIError(400, f"unrecognized request argument: {key!r}", key)
        ok, what = fields[key]
        if not ok(value):
            raise APIError(400, f"{key!r} must be {what}, got {value!r}", key)


def _chat_text(message, i):
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
        raise APIError(400, f"messages[{i}] must be an object with role system, user or assistant", "messages")
    content = message.get("content")
    # Newer clients send content as a list of typed parts; text parts are all a
    # text-only model can take, so they are joined and anything else refused.
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
    return {"role": message["role"], "content": content}


def parse_request(llm: LLM, body, chat: bool):
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
        ids = tok.encode(prompt, allow_special=True) if isinstance(prompt, str) else list(prompt)
        if any(not 0 <= t < llm.config.vocab_size for t in ids):
            raise APIError(400, f"token ids must be in [0, {llm.config.vocab_size})", "prompt")
    if not ids:
        raise APIError(400, "the prompt is empty", "messages" if chat else "prompt")
    # 413 (too large) rather than 400: the request is well formed, just bigger
    # than the context (or KV pool) can ever hold, so retrying cannot help.
    if len(ids) >= llm.max_len:
        raise APIError(413, f"the prompt has {len(ids)} tokens; this server's context holds {llm.max_len}",
                       "messages" if chat else "prompt", "context_length_exceeded")
    served = os.path.basename(os.path.normpath(llm.path))
    if body.get("model") not in (None, served):
        raise APIError(404, f"the model {body['model']!r} does not exist; this server serves {served!r}",
                       "model", "model_not_found")
    get = lambda k, default: default if body.get(k) is None else body[k]   # noqa: E731
    room = llm.max_len - len(ids)
    # OpenAI's defaults, so a client ported from OpenAI behaves the same:
    # completions stop at 16 tokens, chat runs to EOS (bounded by the context),
    # temperature 1. top_k -1 is vLLM's spelling of "off".
    max_tokens = get("max_completion_tokens", get("max_tokens", room if chat else 16))
    logprobs = (get("top_logprobs", 0) if get("logprobs", False) else None) if chat else get("logprobs", None)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=float(get("temperature", 1.0)),
                                top_p=float(get("top_p", 1.0)), top_k=max(0, get("top_k", 0)),
                                seed=get("seed", None), stop=get("stop", []), n=get("n", 1),
                                ignore_eos=get("ignore_eos", False), logprobs=logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return ids, params, {"stream": get("stream", False), "model": served}


# ----------------------------------------------------------------------------
# Responses
# ----------------------------------------------------------------------------


def _holdback(text: str, stops: list[str]) -> int:
    """How many trailing characters might still become a stop string (not sent yet).

    Streamed text cannot be taken back: if the text ends in "wor" and "world"
    is a stop string, those 3 characters wait until the next token shows
    whether the stop string completes (and is cut) or not (and they are sent).
    """
    return max([k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])], default=0)


def _logprobs_json(llm, completion, start: int, chat: bool):
    """The OpenAI logprobs object for the tokens from `start` on."""
    if completion.logprobs is None:
        return None
    tok = llm.tokenizer
    # A token is bytes, not always whole UTF-8 characters: show it with
    # replacement characters, and give the exact bytes too (chat's format).
    piece = lambda t: tok.token_bytes(t).decode("utf-8", errors="replace")   # noqa: E731
    items = list(zip(completion.token_ids[start:], completion.logprobs[start:]))
    if chat:
        return {"content": [{"token": piece(t), "logprob": lp, "bytes": list(tok.token_bytes(t)),
                             "top_logprobs": [{"token": piece(a), "logprob": alp, "bytes": list(tok.token_bytes(a))}
                                              for a, alp in top.items()]} for t, (lp, top) in items]}
    return {"tokens": [piece(t) for t, _ in items], "token_logprobs": [lp for _, (lp, _) in items],
            "top_logprobs": [{piece(a): alp for a, alp in top.items()} for _, (_, top) in items]}


class Handler(BaseHTTPRequestHandler):
    """One instance per request, on the connection's own thread
    (ThreadingHTTPServer). It may block for as long as generation takes: the
    engine thread keeps stepping the batch meanwhile."""
    protocol_version = "HTTP/1.1"       # keep-alive: a client's next request reuses the connection
    server_version = "nanoinfer"
    engine: Engine                      # set by make_server

    def log_message(self, fmt, *args):   # quiet by default; errors still reach stderr
        pass

    # -- plumbing --

    def _send_json(self, status: int, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: APIError):
        kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
                503: "server_overloaded"}.get(e.status, "server_error")
        self._send_json(e.status, {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}})

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

    def do_GET(self):
        llm, path = self.engine.llm, self.path.split("?")[0]
        if path == "/health":
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
        else:
            self._send_error(APIError(404, f"no such path: {path}"))

    def do_POST(self):
        path = self.path.split("?")[0]
        try:
            if path not in ("/v1/completions", "/v1/chat/completions"):
                raise APIError(404, f"no such path: {path}")
            length = int(self.headers.get("Content-Length") or 0)
            try:                            # parse errors become 400s, not tracebacks
                body = json.loads(self.rfile.read(length) or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"the body is not valid JSON: {e}") from None
            chat = path == "/v1/chat/completions"
            # Tokenize and validate here, on the handler's thread: the engine
            # thread's time belongs to the batch.
            ids, params, opts = parse_request(self.engine.llm, body, chat)
            try:
                rid, q = self.engine.submit(ids, params)
            except Overloaded as e:
                raise APIError(503, str(e)) from None
            self._respond(rid, q, ids, params, opts, chat)
        except APIError as e:
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            pass                                            # nobody left to answer
        except Exception as e:                              # never a traceback to the client
            print(f"nanoinfer: error handling {path}: {e!r}", file=sys.stderr)
            self._send_error(APIError(500, "internal server error"))

    # -- a request's life: wait for outputs, write them --

    def _outputs(self, rid, q):
        """Yield RequestOutput snapshots until finished; abort if the client leaves."""
        while True:
            try:   # wake up every 0.2 s even without output, to notice a departed client
                out = q.get(timeout=0.2)
            except queue.Empty:
                if self._client_gone():
                    self.engine.abort(rid)
                    return
                continue
            # The engine reports add_request's rejection (or an engine failure) on
            # the same queue as outputs, so the handler has one place to wait.
            if isinstance(out, ValueError):
                raise APIError(400, str(out))
            if isinstance(out, Exception):
                raise APIError(500, str(out))
            yield out
            if out.finished:
                return

    def _respond(self, rid, q, ids, params, opts, chat):
        created, model = int(time.time()), opts["model"]
        obj_id = ("chatcmpl-" if chat else "cmpl-") + rid
        usage = lambda out: {"prompt_tokens": len(ids), "total_tokens": len(ids) + sum(   # noqa: E731
            len(c.token_ids) for c in out.outputs), "completion_tokens": sum(len(c.token_ids) for c in out.outputs)}
        if not opts["stream"]:
            final = None                                    # only the last snapshot matters
            for final in self._outputs(rid, q):
                pass
            if final is None or not final.finished:
                return                                      # the client left
            choices = []
            for c in final.outputs:
                lp = _logprobs_json(self.engine.llm, c, 0, chat)
                if chat:
                    choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                    "logprobs": lp, "finish_reason": c.finish_reason})
                else:
                    choices.append({"index": c.index, "text": c.text, "logprobs": lp,
                                    "finish_reason": c.finish_reason})
            self._send_json(200, {"id": obj_id, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": model, "choices": choices, "usage": usage(final)})
            return
        # Streaming: server-sent events. The response has no length, so the
        # connection closes after "data: [DONE]".
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        kind = "chat.completion.chunk" if chat else "text_completion"
        # Snapshots carry each choice's whole text; per choice we remember how much
        # was sent, so each event carries only the new piece (the delta).
        sent_text, sent_tokens, done = {}, {}, set()

        def event(choices, **extra):
            data = {"id": obj_id, "object": kind, "created": created, "model": model, "choices": choices, **extra}
            self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
            self.wfile.flush()
        try:
            if chat:    # the first chunk of each choice names the role
                event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(params.n)])
            final = None
            for final in self._outputs(rid, q):
                choices = []
                for c in final.outputs:
                    if c.index in done:
                        continue
                    finished = c.finish_reason is not None
                    # Send only what can no longer change: all of it once finished,
                    # else all but a possible start of a stop string (_holdback).
                    stable = len(c.text) if finished else len(c.text) - _holdback(c.text, params.stop)
                    start = sent_text.get(c.index, 0)
                    delta = c.text[start:stable] if stable > start else ""
                    lp = _logprobs_json(self.engine.llm, c, sent_tokens.get(c.index, 0), chat)
                    if not delta and not finished:          # e.g. half a UTF-8 character, held back
                        continue
                    sent_text[c.index], sent_tokens[c.index] = max(start, stable), len(c.token_ids)
                    reason = c.finish_reason if finished else None
                    choices.append({"index": c.index, "delta": {"content": delta} if delta else {},
                                    "logprobs": lp, "finish_reason": reason} if chat else
                                   {"index": c.index, "text": delta, "logprobs": lp, "finish_reason": reason})
                    if finished:
                        done.add(c.index)
                if choices:
                    event(choices)
            if final is None or not final.finished:
                return
            event([], usage=usage(final))            # usage counts ride on a last, choice-less chunk
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.engine.abort(rid)                    # the client left mid-stream: free its blocks


def make_server(llm: LLM, host: str = "127.0.0.1", port: int = 8000, max_waiting: int = 256):
    """An HTTP server bound to (host, port) with its engine thread running;
    call serve_forever() on it (port 0 picks a free port: server.server_address)."""
    engine = Engine(llm, max_waiting)
    # http.server builds a handler per request from a class, so the engine is
    # bound as a class attribute of a subclass made for this server.
    handler = type("BoundHandler", (Handler,), {"engine": engine})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True        # a hung client connection must not keep the process alive at exit
    server.engine = engine
    return server


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def one_shot(llm: LLM, prompt: str, chat: bool, params: SamplingParams, out=None):
    """Generate for one prompt, printing text as it is produced.

    No server and no threads: the same add_request/step loop the engine thread
    runs, for one request, printing the stable part of each snapshot (the
    same rule as streaming: a possible start of a stop string waits)."""
    out = out or sys.stdout
    if chat:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
    else:
        ids = llm.tokenizer.encode(prompt, allow_special=True)
    rid, sent = llm.add_request(ids, params), 0
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.request_id == rid:
                c = o.outputs[0]
                stable = len(c.text) if o.finished else len(c.text) - _holdback(c.text, params.stop)
                if stable > sent:
                    out.write(c.text[sent:stable])
                    out.flush()
                    sent = stable
    out.write("\n")
    return o


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--port", type=int, default=8000)
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
    ap.add_argument("--max-waiting", type=int, default=256, help="queued requests before answering 503")
    ap.add_argument("--prompt", default=None, help="one-shot: generate for this prompt and exit")
    ap.add_argument("--chat", action="store_true", help="one-shot: wrap --prompt in the chat template")
    ap.add_argument("--max-tokens", type=int, default=256, help="one-shot: tokens to generate")
    ap.add_argument("--temperature", type=float, default=0.0, help="one-shot: 0 = greedy")
    args = ap.parse_args(argv)
    # Every engine option of LLM is a flag, so a lesson's feature can be served
    # as well as benchmarked (e.g. --compile --quantization int8).
    llm = LLM(args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
              kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, compile=args.compile,
              speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens)
    if args.prompt is not None:
        one_shot(llm, args.prompt, args.chat, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
        return
    # Loopback by default: this server has no authentication, so exposing it
    # (--host 0.0.0.0) must be a deliberate choice.
    server = make_server(llm, args.host, args.port, args.max_waiting)
    host, port = server.server_address[:2]
    print(f"nanoinfer: serving {os.path.basename(os.path.normpath(llm.path))} on http://{host}:{port}/v1 "
          f"(Ctrl-C to stop)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("\nnanoinfer: shutting down")
    finally:                                        # serve_forever has returned: close the socket
        signal.signal(signal.SIGINT, signal.SIG_IGN)    # a second Ctrl-C must not interrupt the shutdown
        server.server_close()
        server.engine.stop()


if __name__ == "__main__":
    main()
