"""
serve.py -- serving many users: an OpenAI-compatible HTTP server, and a one-shot CLI.

The lesson: continuous batching pays off when requests arrive at different
times. A server turns arrivals into engine steps:

    event loop (uvicorn + FastAPI, one thread)         engine thread (one)
      route: check the JSON (pydantic), tokenize         loop:
      engine.submit(prompts, params) ---inbox------->      add new requests, aborts
      await q.get() <--loop.call_soon_threadsafe-----      llm.step()  (one batch of all)
      answer JSON, or stream SSE chunks as text grows      each output to its request's queue

Only the engine thread touches the LLM (it is not thread-safe). Routes talk to
it through queues: a thread-safe queue.Queue in; per HTTP request an
asyncio.Queue out, which belongs to the event loop, so the engine hands each
output over with loop.call_soon_threadsafe. A route waits with `await`: a
thousand requests wait on one thread while the engine steps the batch. Time
to first token = queueing (the batch is full) + prefill; the gap between
streamed tokens = one engine step of the whole batch.

A request is bounded before it costs the batch anything (schema, sampling
ranges, context, seats, a token cap, a bounded queue); a client that leaves
has its request aborted at once. SIGTERM drains: new requests get 503, those
in flight get --drain-seconds, the rest end with an error, exit status 0.
Routes here: POST /v1/completions and /v1/chat/completions ("stream": SSE).
Their request bodies are made from SamplingParams' own fields
(support/schema.py). In support/server.py: /v1/models, /tokenize,
/detokenize, /tokenizer_info, /health, /metrics, the HTTP limits, error
objects, the command line (a flag per EngineConfig field), the one-shot CLI.
The user's guide: docs/SERVING.md.

    python serve.py [--model PATH] [--port 8000] [--api-key KEY] [limits] [engine options]
    python serve.py [--chat] --prompt "Once upon a time"        # one-shot, streamed to stdout
"""
from __future__ import annotations

import asyncio
import json
import os
import queue
import sys
import threading
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from engine import LLM, EngineConfig
from sampler import SamplingParams
from support.checks import check_seats
from support.schema import Message, StreamOptions, request_models, sampling_fields, unsupported
from support.server import (APIError, Metrics, Reply, Server, check_limits, check_model,
                            check_prompts, checked, engine_config, error_json, exposure_warning,
                            http_limits, one_shot, prompt_text, serve_arguments,
                            serve_until_signal, shutting_down, side_routes,
                            structured_outputs, token_keyed, token_list, utf8)

# What a request may say: OpenAI's bodies, whose sampling fields are SamplingParams' own
# fields with their types (support/schema.py); their ranges SamplingParams checks itself.
CompletionRequest, ChatRequest = request_models(SamplingParams)
SAMPLING_FIELDS = tuple(sampling_fields(SamplingParams))


# --- The engine thread ------------------------------------------------------
ACCEPTED = object()   # the engine's first message on a request's queue: its prompts were added
GONE = object()       # the client hung up (put there by the route's own watcher)


class Engine:
    """Owns the LLM and runs llm.step() while there is work; the only thread
    that touches the LLM. Routes submit() and await their asyncio queue."""

    def __init__(self, llm: LLM, max_waiting: int = 256):
        self.llm = llm
        self.max_waiting = max_waiting
        self.metrics = Metrics(llm)
        # Routes never call the LLM: they post messages here, and the engine thread applies
        # them between steps, so the scheduler, block manager and KV cache need no lock.
        # ("add", rids, prompts, params, loop, q) | ("abort", rids, error) | ("wake",)
        self.inbox: queue.Queue = queue.Queue()
        self.queues: dict[str, tuple] = {}   # engine request id -> its route's (event loop, queue)
        self.lock = threading.Lock()         # guards live and draining
        self.draining = False
        self.live: set[str] = set()          # submitted, not yet ended (a drain waits for these)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="nanoinfer-engine", daemon=True)
        self.thread.start()

    async def submit(self, prompts: list[list[int]], params: SamplingParams):
        """Queue the prompts of one HTTP request together (they join the same step); returns
        their engine request ids and the one asyncio queue all their outputs arrive on."""
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        with self.lock:     # one lock with drain: a request is either refused or in flight
            if self.draining:
                raise shutting_down()
            # Back-pressure: a request behind max_waiting others would likely time out anyway,
            # and an unbounded queue turns overload into unbounded memory and latency.
            waiting = len(self.llm.scheduler.waiting) + self.inbox.qsize()
            if waiting + len(prompts) > self.max_waiting:
                raise APIError(503, f"the server has {self.max_waiting} requests waiting; try "
                               f"again later", code="server_overloaded",
                               headers={"Retry-After": "1"})
            rids = [uuid.uuid4().hex for _ in prompts]   # unguessable: no client aborts another's
            self.live.update(rids)
            self.inbox.put(("add", rids, prompts, params, loop, q))
        # the engine refused: still a plain HTTP error, before a stream's 200 is sent
        if isinstance(item := await q.get(), APIError):
            raise item
        return rids, q

    def abort(self, rids: list[str] | None, error: APIError | None = None):
        self.inbox.put(("abort", rids, error))

    def _loop(self):
        llm = self.llm
        if llm.decoder is not None:    # compile=True: CUDA graphs are recorded per thread, so
            llm.decoder.warmup()       # replay every bucket once here, before the first request
        while not self._stop.is_set():
            # Idle: sleep until a message arrives (the timeout bounds stop()'s wait). Busy: never
            # block, take what has arrived, then step: a new request joins the very next batch.
            try:
                busy = llm.has_unfinished_requests()
                msgs = [self.inbox.get_nowait() if busy else self.inbox.get(timeout=0.5)]
            except queue.Empty:
                msgs = []
            while not self.inbox.empty():
                msgs.append(self.inbox.get_nowait())
            for kind, *args in msgs:
                self._apply(kind, *args)
            if llm.has_unfinished_requests():
                self._step()

    def _send(self, rid: str, item):
        # An asyncio.Queue is not thread-safe: the put is scheduled on its event loop
        loop, q = self.queues[rid]
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:           # that loop has closed: the server stopped, nobody waits
            pass

    def _apply(self, kind: str, *args):
        """One message from a route (or from drain), applied between two steps."""
        if kind == "add":
            rids, prompts, params, loop, q = args
            self.queues.update((rid, (loop, q)) for rid in rids)
            try:
                for rid, ids in zip(rids, prompts):
                    self.llm.add_request(ids, params, request_id=rid)
            except (ValueError, TypeError) as e:       # a bad request fails alone, as a 400
                for rid in rids:
                    self._end(rid, APIError(400, str(e)) if rid == rids[0] else None)
                return
            self._send(rids[0], ACCEPTED)
        elif kind == "abort":          # the client left (or drain: every request, told `error`)
            rids, error = args
            for rid in list(self.queues) if rids is None else rids:
                if rid in self.queues:     # a finished request is ignored
                    self._end(rid, error, "requests_aborted_total")

    def _end(self, rid: str, error: Exception | None = None, counter: str | None = None):
        """A request leaves the engine: its blocks freed if it still runs; its route gets
        `error`."""
        self.llm.abort(rid)
        self.metrics.ended(rid, counter)   # counted before its route hears (a client that saw
        with self.lock:                    # its error sees it counted)
            self.live.discard(rid)
        if error is not None:
            self._send(rid, error)
        self.queues.pop(rid, None)

    def _step(self):
        try:
            outputs = self.llm.step()
        except Exception as e:   # an engine bug: fail the requests in the engine, keep serving
            print(f"nanoinfer: engine step failed: {e!r}", file=sys.stderr)
            error = APIError(500, f"internal engine error ({type(e).__name__}); request stopped",
                             code="engine_error")
            for rid in list(self.queues):
                self._end(rid, error, "requests_failed_total")
            for rid in list(self.llm.requests):     # anything left without a route: free it too
                self.llm.abort(rid)
            return
        # Every request that moved gets a snapshot of its whole state (text so far, tokens,
        # finish reason, and what this step added); its route formats it.
        for out in outputs:
            self.metrics.observe(out)
            if out.request_id in self.queues:
                self._send(out.request_id, out)
                if out.finished:
                    self._end(out.request_id)

    def start_draining(self) -> int:
        """From now on submit() refuses (503); returns how many requests are in flight."""
        with self.lock:
            self.draining = True
            return len(self.live)

    def stop(self):
        self._stop.set()
        self.inbox.put(("wake",))
        self.thread.join(timeout=10)


# --- A request, checked: OpenAI JSON -> prompts (token ids) + SamplingParams ---
# On the event loop, before anything reaches the engine: a bad request never
# costs the batch a step, and the engine thread's time belongs to the batch.
def completion_prompts(llm: LLM, body) -> list[tuple[list[int], str]]:
    """Each prompt as (token ids, its text or None). A completion prompt belongs to the caller,
    special tokens included (as in LLM.generate); only chat messages cannot forge them."""
    p = body.prompt
    batch = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else p   # one, or a list
    return [(llm.tokenizer.encode(prompt_text(llm, x, "prompt"), allow_special=True), x)
            if isinstance(x, str) else (x, None) for x in batch]


def chat_ids(llm: LLM, messages: list[Message]) -> list[int]:
    # tokenize=True encodes the template's markers as special tokens but the users'
    # text as plain text: a message cannot forge "<|im_end|>"
    chat = []
    for m in messages:
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        role = "system" if m.role == "developer" else m.role
        chat.append({"role": role, "content": utf8(text, "messages")})
    prompt_text(llm, "".join(m["content"] for m in chat), "messages")    # before the tokenizer
    return llm.tokenizer.apply_chat_template(chat, tokenize=True)


# The default cap on prompts x n x max_tokens per request, in contexts (n = 16 full-length
# samples, or 128 of an eighth): beyond it one request holds its seats for many answers' time.
DEFAULT_REQUEST_CONTEXTS = 16


def sampling_params(llm: LLM, body, chat: bool, prompts: list, cap: int | None) -> SamplingParams:
    """The request's SamplingParams: its sampling fields as sent, the API's own spellings mapped
    to the library's, then the limits of this server: its context, its batch's seats, its
    per-request cap."""
    mt_name = "max_tokens"
    if chat and body.max_completion_tokens is not None:
        mt_name = "max_completion_tokens"
    n = 1 if body.n is None else body.n
    max_tokens = getattr(body, mt_name)
    longest = max(len(ids) for ids, _ in prompts)
    room = llm.max_len - longest
    cap = cap or DEFAULT_REQUEST_CONTEXTS * llm.max_len
    if max_tokens is None:   # OpenAI's defaults: completions stop at 16 tokens, chat at EOS
        max_tokens = max(1, min(room, room if chat else 16, cap // (len(prompts) * max(n, 1))))
    # vLLM's rule: a max_tokens the context cannot hold is refused, not cut (the client learns
    # the limit)
    if longest + max_tokens > llm.max_len:
        raise APIError(400, f"this model's context holds {llm.max_len} tokens, but {longest} are "
                       f"in the prompt and {mt_name} asks for {max_tokens} more "
                       f"({longest + max_tokens} in all); ask for at most {room}",
                       mt_name, "context_length_exceeded")
    refused = unsupported(body, chat)      # a documented field set to what this server lacks
    if refused:
        raise APIError(400, refused[1], refused[0])
    if chat and body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    k = ((body.top_logprobs or 0) if body.logprobs else None) if chat else body.logprobs
    structured, structured_name = structured_outputs(body)   # response_format, guided_json, ...
    sent = {name: getattr(body, name) for name in SAMPLING_FIELDS
            if getattr(body, name) is not None}
    stop = sent.get("stop", [])
    spelled = {
        "max_tokens": max_tokens, "n": n, "logprobs": k,
        "temperature": sent.get("temperature", 1.0),    # OpenAI's default samples
        # -1 is vLLM's "off"; a k beyond the vocabulary keeps every token anyway
        "top_k": 0 if body.top_k in (None, -1) else min(body.top_k, llm.config.vocab_size),
        "stop": [utf8(s, "stop") for s in ([stop] if isinstance(stop, str) else stop)],
        "prompt_logprobs": k if not chat and body.echo else None,   # echo: the prompt's too
        "logit_bias": token_keyed(body.logit_bias, "logit_bias", V := llm.config.vocab_size),
        "allowed_token_ids": token_list(body.allowed_token_ids, "allowed_token_ids", V),
        "structured_outputs": structured,
    }
    api_names = {"max_tokens": mt_name, "logprobs": "top_logprobs" if chat else "logprobs",
                 "prompt_logprobs": "logprobs", "structured_outputs": structured_name}
    params = checked(SamplingParams, api_names, **{**sent, **spelled})
    # This server's limits: seats in the batch, and the work (all n samples x max_tokens) one
    # request holds
    try:
        check_seats(params.n, llm.scheduler.max_num_seqs)
    except ValueError as e:
        raise APIError(400, str(e), "n") from None
    if (total := len(prompts) * params.n * params.max_tokens) > cap:
        raise APIError(400, f"{len(prompts)} prompt(s) x n={params.n} x {mt_name}="
                       f"{params.max_tokens} = {total} tokens; this server generates at most "
                       f"{cap} per request", "n" if params.n > 1 else mt_name, "request_too_large")
    return params


# --- Answers: RequestOutput snapshots -> OpenAI JSON, whole or streamed -------
async def next_output(q: asyncio.Queue, reply: Reply):
    """The engine's next output for this HTTP request (or GONE); raises what failed it."""
    item = await q.get()
    if isinstance(item, APIError):
        raise item
    if item is not GONE:
        if item.error:                 # the engine failed this request alone
            raise APIError(500, f"the request failed: {item.error}", code="request_failed")
        reply.outs[item.request_id] = item
    return item


async def answer(request: Request, engine: Engine, rids: list, q: asyncio.Queue,
                 reply: Reply) -> Response:
    """Wait for every prompt's last output, then answer in one JSON body. A client that leaves is
    noticed at once: uvicorn hands the disconnect to a receive() waiting beside us, which puts
    GONE on the queue; the requests are aborted, not left holding seats and KV blocks."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        q.put_nowait(GONE)
    watcher, finished = asyncio.create_task(watch()), 0
    try:
        while finished < len(rids):
            if (out := await next_output(q, reply)) is GONE:
                return Response(status_code=499)   # nobody reads it (nginx's "client closed")
            finished += out.finished
    finally:
        watcher.cancel()
        if finished < len(rids):       # the client left, or a prompt failed: stop them all
            engine.abort(rids)
    choices = [reply.choice(out, c, delta=False) for out in reply.outs.values()
               for c in out.outputs]
    choices.sort(key=lambda c: c["index"])
    return JSONResponse({**reply.head, "choices": choices, "usage": reply.usage()})


def stream(engine: Engine, rids: list, q: asyncio.Queue, reply: Reply,
           opts: StreamOptions) -> StreamingResponse:
    """Server-sent events: "data: {json}\\n\\n" per chunk, holding what the step added to each
    choice, then "data: [DONE]". While it streams, Starlette waits for the client's
    disconnect and then cancels the generator: its finally clause aborts the requests."""
    # assignment: sse-stream
    head = {**reply.head, "object": "chat.completion.chunk" if reply.chat else "text_completion"}

    def event(choices, **extra) -> str:
        every = opts.include_usage and opts.continuous_usage_stats
        usage = {"usage": reply.usage()} if every else {}
        return "data: " + json.dumps({**head, "choices": choices, **usage, **extra}) + "\n\n"

    async def events():
        finished, done = 0, set()
        try:
            if reply.chat:   # the first chunk of each choice names the role
                yield event([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None} for i in range(reply.n)])
            while finished < len(rids):
                out = await next_output(q, reply)
                # Each snapshot carries what the step added (new_text); the engine already held
                # back text that may still become a stop string, and half UTF-8 characters.
                choices = []
                for c in out.outputs:
                    news = c.new_text or c.finish_reason or c.new_logprobs
                    if reply.index(out, c) in done or not news:
                        continue                     # finished earlier, or nothing to show yet
                    if c.finish_reason:
                        done.add(reply.index(out, c))
                    choices.append(reply.choice(out, c, delta=True))
                if choices:
                    yield event(choices)
                finished += out.finished
            if opts.include_usage:    # on request, a last chunk without choices: the counts
                yield event([], usage=reply.usage())
            yield "data: [DONE]\n\n"
        except APIError as e:         # failed or drained after the 200: the error is the last event
            yield "data: " + json.dumps(error_json(e)) + "\n\ndata: [DONE]\n\n"
        finally:
            if finished < len(rids):  # the client left (or a prompt failed): free the blocks
                engine.abort(rids)
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
    # end assignment


# --- The routes: short async functions on the event loop ---------------------
router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    # tokenizing in a worker thread: never on the event loop, which every client shares
    prompts = await run_in_threadpool(completion_prompts, request.app.state.engine.llm, body)
    return await generate(request, body, prompts, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    prompts = [(await run_in_threadpool(chat_ids, request.app.state.engine.llm, body.messages), "")]
    return await generate(request, body, prompts, chat=True)


async def generate(request: Request, body, prompts: list, chat: bool):
    engine, state = request.app.state.engine, request.app.state
    check_prompts(engine.llm, prompts, "messages" if chat else "prompt", engine.max_waiting)
    check_model(state.model, body.model)
    params = sampling_params(engine.llm, body, chat, prompts, state.max_request_tokens)
    rids, q = await engine.submit([ids for ids, _ in prompts], params)
    echo = not chat and bool(body.echo)
    reply = Reply(engine.llm, rids, prompts, params, chat, echo, state.model)
    if body.stream:
        return stream(engine, rids, q, reply, body.stream_options or StreamOptions())
    return await answer(request, engine, rids, q, reply)


def make_server(llm: LLM, host: str = "127.0.0.1", port: int = 8000, max_waiting: int = 256, *,
                max_request_tokens: int | None = None, **http_limits) -> Server:
    """An HTTP server bound to (host, port) with its engine thread running: call serve_forever()
    (port 0: a free port, see server_address). max_request_tokens caps prompts x n x max_tokens
    (None: 16 contexts); http_limits: api_key, max_body_bytes, body_timeout, max_connections,
    keep_alive_timeout (Server's)."""
    cap = 1 if max_request_tokens is None else max_request_tokens
    check_limits(max_waiting=max_waiting, max_request_tokens=cap)
    # untyped bodies are JSON too (strict_content_type=False)
    app = FastAPI(redoc_url=None, strict_content_type=False)     # /docs, /openapi.json: the schema
    # side_routes: /v1/models, /tokenize, /health, /metrics ... (support/server.py)
    server = Server(app, host, port, (router, side_routes), **http_limits)
    app.state.engine = server.engine = Engine(llm, max_waiting)
    app.state.model = os.path.basename(os.path.normpath(llm.path))
    app.state.max_request_tokens = max_request_tokens
    return server


# --- Command line ------------------------------------------------------------
def main(argv=None):
    args = serve_arguments(argv, __doc__.split("\n")[1], EngineConfig)
    # Every field of EngineConfig is a flag, so a lesson's feature can be served
    # as well as benchmarked (e.g. --compile --quantization int8).
    llm = LLM(engine_config(args, EngineConfig))
    if args.prompt is not None:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        one_shot(llm, args.prompt, args.chat, params)
        return llm.close()
    api_key = args.api_key or os.environ.get("NANOINFER_API_KEY") or None
    server = make_server(llm, args.host, args.port, args.max_waiting,
                         max_request_tokens=args.max_request_tokens, **http_limits(args, api_key))
    # loopback by default: exposing the server is a choice, warned about
    if warning := exposure_warning(args.host, api_key):
        print(warning, file=sys.stderr, flush=True)
    where = ":".join(map(str, server.server_address))
    print(f"nanoinfer: serving {server.app.state.model} on http://{where}/v1 "
          f"(Ctrl-C to stop){' with an API key' if api_key else ''}", flush=True)
    serve_until_signal(server, args.drain_seconds)


if __name__ == "__main__":
    main()
