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
In support/server.py: /v1/models, /tokenize, /detokenize, /tokenizer_info,
/health, /metrics, the HTTP limits, error objects, the one-shot CLI. The
user's guide: docs/SERVING.md.

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
from typing import Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from scheduler import LLM, SamplingParams
from support.checks import check_seats
from support.server import (APIError, Metrics, Reply, Server, check_limits, check_model,
                            check_prompts, checked, error_json, exposure_warning, http_limits, llm_options,
                            one_shot, serve_arguments, serve_until_signal, shutting_down, side_routes, utf8)


# --- The OpenAI schema: what a request may say --------------------------------------------------------------
# pydantic checks names and JSON types before anything reaches the engine: an unknown field (a
# typo'd option must not be silently ignored) or a wrong type is a 400 naming it; strict: "5" is
# not 5, true is not 1; null means "the default", as in OpenAI's API. The RANGES of the sampling
# fields are SamplingParams' (its LIMITS), not here, so server and library cannot disagree.
class Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Schema):
    include_usage: bool | None = None         # a last chunk with the token counts
    continuous_usage_stats: bool | None = None   # vLLM's: with include_usage, the counts in every chunk too


class Sampling(Schema):                       # what both endpoints take
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None                  # 0, or -1 (vLLM's spelling): off
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's penalties and vLLM's extras (sampler.py applies them, vLLM's semantics)
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None


PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p")


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]   # one prompt (text or token ids), or a list
    echo: bool | None = None                  # each choice's text (and logprobs) starts with its prompt
    logprobs: int | None = None               # each token's logprob and its k most likely alternatives


class TextPart(Schema):
    type: Literal["text"]
    text: str


class Message(Schema):
    role: Literal["system", "developer", "user", "assistant"]   # developer: OpenAI's newer name for system
    content: str | list[TextPart]             # newer clients send typed parts: text is all a text model takes
    name: str | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None


# --- The engine thread --------------------------------------------------------------------------------------
ACCEPTED = object()     # the engine's first message on a request's queue: add_request took its prompts
GONE = object()         # the client hung up (put there by the route's own watcher)


class Engine:
    """Owns the LLM and runs llm.step() while there is work; the only thread
    that touches the LLM. Routes submit() and await their asyncio queue."""

    def __init__(self, llm: LLM, max_waiting: int = 256):
        self.llm, self.max_waiting, self.metrics = llm, max_waiting, Metrics()
        # Routes never call the LLM: they post messages here, and the engine thread applies
        # them between steps, so the scheduler, block manager and KV cache need no lock.
        self.inbox: queue.Queue = queue.Queue()     # ("add", rids, prompts, params, loop, q) | ("abort", rids) | ...
        self.queues: dict[str, tuple] = {}          # engine request id -> (event loop, asyncio.Queue) of its route
        self.lock, self.draining = threading.Lock(), False   # the lock guards live and draining
        self.live: set[str] = set()                 # submitted and not yet ended (a drain waits for these)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="nanoinfer-engine", daemon=True)
        self.thread.start()

    async def submit(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list[str], asyncio.Queue]:
        """Queue the prompts of one HTTP request together (they join the same step); returns
        their engine request ids and the one asyncio queue all their outputs arrive on."""
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        with self.lock:     # one lock with drain: a request is either refused or counted as in flight
            if self.draining:
                raise shutting_down()
            # Back-pressure: a request behind max_waiting others would likely time out anyway, and
            # an unbounded queue turns overload into unbounded memory and latency: refuse it.
            if len(self.llm.scheduler.waiting) + self.inbox.qsize() + len(prompts) > self.max_waiting:
                raise APIError(503, f"the server has {self.max_waiting} requests waiting; try again later",
                               code="server_overloaded", headers={"Retry-After": "1"})
            rids = [uuid.uuid4().hex for _ in prompts]   # unguessable: one client cannot abort another's
            self.live.update(rids)
            self.inbox.put(("add", rids, prompts, params, loop, q))
        if isinstance(item := await q.get(), APIError):   # the engine refused: still a plain HTTP error,
            raise item                                    # before a stream's 200 is sent
        return rids, q

    def abort(self, rids: list[str] | None, error: APIError | None = None):
        self.inbox.put(("abort", rids, error))

    def _loop(self):
        llm = self.llm
        if llm.decoder is not None:    # compile=True: CUDA graphs are recorded per thread, so
            llm.decoder.warmup()       # replay every bucket once here, before the first request
        while not self._stop.is_set():
            # Idle: sleep until a message arrives (the timeout bounds stop()'s wait). Busy: never block,
            # take what has arrived, then step: a new request joins the very next batch.
            try:
                msgs = [self.inbox.get(timeout=0.5) if not llm.has_unfinished_requests() else self.inbox.get_nowait()]
            except queue.Empty:
                msgs = []
            while not self.inbox.empty():
                msgs.append(self.inbox.get_nowait())
            for kind, *args in msgs:
                self._apply(kind, *args)
            if llm.has_unfinished_requests():
                self._step()

    def _send(self, rid: str, item):
        # An asyncio.Queue is not thread-safe: the put is scheduled on its event loop (between two awaits)
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
        """A request leaves the engine: its blocks are freed if it still runs, its route gets `error`."""
        self.llm.abort(rid)
        if error is not None:
            self._send(rid, error)
        self.queues.pop(rid, None)
        self.metrics.ended(rid, counter)
        with self.lock:
            self.live.discard(rid)

    def _step(self):
        try:
            outputs = self.llm.step()
        except Exception as e:   # an engine bug: fail the requests in the engine, keep serving
            print(f"nanoinfer: engine step failed: {e!r}", file=sys.stderr)
            error = APIError(500, f"internal engine error ({type(e).__name__}); request stopped", code="engine_error")
            for rid in list(self.queues):
                self._end(rid, error, "requests_failed_total")
            for rid in list(self.llm.requests):     # anything left without a route: free its blocks too
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

    def start_draining(self) -> int:      # from now on submit() refuses (503); returns how many are in flight
        with self.lock:
            self.draining = True
            return len(self.live)

    def stop(self):
        self._stop.set()
        self.inbox.put(("wake",))
        self.thread.join(timeout=10)


# --- A request, checked: OpenAI JSON -> prompts (token ids) + SamplingParams --------------------------------
# On the event loop, before anything reaches the engine: a bad request never
# costs the batch a step, and the engine thread's time belongs to the batch.
def completion_prompts(llm: LLM, body: CompletionRequest) -> list[tuple[list[int], str]]:
    """Each prompt as (token ids, its text or None). A completion prompt belongs to the caller, special
    tokens included (as in LLM.generate); only chat messages cannot forge them."""
    p, tok = body.prompt, llm.tokenizer
    batch = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else p    # one prompt, or a list
    return [(tok.encode(utf8(x, "prompt"), allow_special=True), x) if isinstance(x, str) else (x, None)
            for x in batch]


def chat_ids(llm: LLM, messages: list[Message]) -> list[int]:
    # tokenize=True encodes the template's markers as special tokens but the users'
    # text as plain text: a message cannot forge "<|im_end|>"
    return llm.tokenizer.apply_chat_template([{"role": "system" if m.role == "developer" else m.role, "content": utf8(
        m.content if isinstance(m.content, str) else "".join(part.text for part in m.content), "messages")}
        for m in messages], tokenize=True)


# The default cap on prompts x n x max_tokens per request, in contexts (n = 16 full-length samples,
# or 128 of an eighth): beyond it one request holds its seats for many times the longest answer.
DEFAULT_REQUEST_CONTEXTS = 16


def sampling_params(llm: LLM, body: Sampling, chat: bool, prompts: list, cap: int | None) -> SamplingParams:
    """The request's SamplingParams: API spellings mapped to the library's, then the
    limits of this server: its context, its batch's seats, its per-request cap."""
    mt_name = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
    longest, n, max_tokens = max(len(ids) for ids, _ in prompts), 1 if body.n is None else body.n, \
        getattr(body, mt_name)
    room, cap = llm.max_len - longest, cap or DEFAULT_REQUEST_CONTEXTS * llm.max_len
    if max_tokens is None:   # OpenAI's defaults: completions stop at 16 tokens, chat at EOS (both within the cap)
        max_tokens = max(1, min(room, room if chat else 16, cap // (len(prompts) * max(n, 1))))
    # vLLM's rule: a max_tokens the context cannot hold is refused, not cut (the client learns the limit)
    if longest + max_tokens > llm.max_len:
        raise APIError(400, f"this model's context holds {llm.max_len} tokens, but {longest} are in the prompt "
                       f"and {mt_name} asks for {max_tokens} more ({longest + max_tokens} in all); "
                       f"ask for at most {room}", mt_name, "context_length_exceeded")
    if chat and body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    k = ((body.top_logprobs or 0) if body.logprobs else None) if chat else body.logprobs
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    params = checked(SamplingParams, {"max_tokens": mt_name, "logprobs": "top_logprobs" if chat else "logprobs",
                                      "prompt_logprobs": "logprobs"},
                     max_tokens=max_tokens, n=n, temperature=1.0 if body.temperature is None else body.temperature,
                     top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                     # -1 is vLLM's "off"; a k beyond the vocabulary keeps every token anyway
                     top_k=0 if body.top_k in (None, -1) else min(body.top_k, llm.config.vocab_size),
                     stop=[utf8(s, "stop") for s in stop], ignore_eos=bool(body.ignore_eos), logprobs=k,
                     prompt_logprobs=k if not chat and body.echo else None,   # echo: the prompt's logprobs too
                     **{name: getattr(body, name) for name in PENALTIES if getattr(body, name) is not None})
    # This server's limits: seats in the batch, and the work (all n samples x max_tokens) one request holds
    try:
        check_seats(params.n, llm.scheduler.max_num_seqs)
    except ValueError as e:
        raise APIError(400, str(e), "n") from None
    if (total := len(prompts) * params.n * params.max_tokens) > cap:
        raise APIError(400, f"{len(prompts)} prompt(s) x n={params.n} x {mt_name}={params.max_tokens} = {total} "
                       f"tokens; this server generates at most {cap} per request", "n" if params.n > 1 else mt_name,
                       "request_too_large")
    return params


# --- Answers: RequestOutput snapshots -> OpenAI JSON, whole or streamed -------------------------------------
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


async def answer(request: Request, engine: Engine, rids: list, q: asyncio.Queue, reply: Reply) -> Response:
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
                return Response(status_code=499)   # nobody reads it (nginx's "client closed request")
            finished += out.finished
    finally:
        watcher.cancel()
        if finished < len(rids):       # the client left, or a prompt failed: stop them all
            engine.abort(rids)
    choices = [reply.choice(out, c, delta=False) for out in reply.outs.values() for c in out.outputs]
    return JSONResponse({**reply.head, "choices": sorted(choices, key=lambda c: c["index"]), "usage": reply.usage()})


def stream(engine: Engine, rids: list, q: asyncio.Queue, reply: Reply, opts: StreamOptions) -> StreamingResponse:
    """Server-sent events: "data: {json}\\n\\n" per chunk, holding what the step added to each
    choice, then "data: [DONE]". While it streams, Starlette waits for the client's
    disconnect and then cancels the generator: its finally clause aborts the requests."""
    # assignment: sse-stream
    head = {**reply.head, "object": "chat.completion.chunk" if reply.chat else "text_completion"}

    def event(choices, **extra) -> str:
        usage = {"usage": reply.usage()} if opts.include_usage and opts.continuous_usage_stats else {}
        return "data: " + json.dumps({**head, "choices": choices, **usage, **extra}) + "\n\n"

    async def events():
        finished, done = 0, set()
        try:
            if reply.chat:   # the first chunk of each choice names the role
                yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(reply.n)])
            while finished < len(rids):
                out = await next_output(q, reply)
                # Each snapshot carries what the step added (new_text); the engine already held back
                # text that may still become a stop string, and half UTF-8 characters: send it as is.
                choices = []
                for c in out.outputs:
                    if reply.index(out, c) in done or not (c.new_text or c.finish_reason or c.new_logprobs):
                        continue                     # finished earlier, or nothing to show yet
                    if c.finish_reason:
                        done.add(reply.index(out, c))
                    choices.append(reply.choice(out, c, delta=True))
                if choices:
                    yield event(choices)
                finished += out.finished
            if opts.include_usage:                   # on request, a last chunk without choices: the counts
                yield event([], usage=reply.usage())
            yield "data: [DONE]\n\n"
        except APIError as e:                        # failed or drained after the 200 was sent:
            yield "data: " + json.dumps(error_json(e)) + "\n\ndata: [DONE]\n\n"   # the error is the last event
        finally:
            if finished < len(rids):                 # the client left (or a prompt failed): free the blocks
                engine.abort(rids)
    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    # end assignment


# --- The routes: short async functions on the event loop ----------------------------------------------------
router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await generate(request, body, completion_prompts(request.app.state.engine.llm, body), chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    return await generate(request, body, [(chat_ids(request.app.state.engine.llm, body.messages), "")], chat=True)


async def generate(request: Request, body: Sampling, prompts: list, chat: bool):
    engine, state = request.app.state.engine, request.app.state
    check_prompts(engine.llm, prompts, "messages" if chat else "prompt", engine.max_waiting)
    check_model(state.model, body.model)
    params = sampling_params(engine.llm, body, chat, prompts, state.max_request_tokens)
    rids, q = await engine.submit([ids for ids, _ in prompts], params)
    reply = Reply(engine.llm, rids, prompts, params, chat, not chat and bool(body.echo), state.model)
    if body.stream:
        return stream(engine, rids, q, reply, body.stream_options or StreamOptions())
    return await answer(request, engine, rids, q, reply)


def make_server(llm: LLM, host: str = "127.0.0.1", port: int = 8000, max_waiting: int = 256, *,
                max_request_tokens: int | None = None, **http_limits) -> Server:
    """An HTTP server bound to (host, port) with its engine thread running: call serve_forever() (port 0:
    a free port, see server_address). max_request_tokens caps prompts x n x max_tokens (None: 16 contexts);
    http_limits: api_key, max_body_bytes, body_timeout, max_connections, keep_alive_timeout (Server's)."""
    check_limits(max_waiting=max_waiting, max_request_tokens=1 if max_request_tokens is None else max_request_tokens)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, strict_content_type=False)  # untyped: JSON
    server = Server(app, host, port, (router, side_routes), **http_limits)   # side: /v1/models, /tokenize, /health...
    app.state.engine = server.engine = Engine(llm, max_waiting)
    app.state.model, app.state.max_request_tokens = os.path.basename(os.path.normpath(llm.path)), max_request_tokens
    return server


# --- Command line -------------------------------------------------------------------------------------------
def main(argv=None):
    args = serve_arguments(argv, __doc__.split("\n")[1])
    # Every engine option of LLM is a flag, so a lesson's feature can be served
    # as well as benchmarked (e.g. --compile --quantization int8).
    llm = LLM(args.model, **llm_options(args))
    if args.prompt is not None:
        one_shot(llm, args.prompt, args.chat, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
        return llm.close()
    api_key = args.api_key or os.environ.get("NANOINFER_API_KEY") or None
    server = make_server(llm, args.host, args.port, args.max_waiting, max_request_tokens=args.max_request_tokens,
                         **http_limits(args, api_key))
    if warning := exposure_warning(args.host, api_key):   # loopback by default: exposing it is a choice
        print(warning, file=sys.stderr, flush=True)
    print(f"nanoinfer: serving {server.app.state.model} on http://{':'.join(map(str, server.server_address))}/v1 "
          f"(Ctrl-C to stop){' with an API key' if api_key else ''}", flush=True)
    serve_until_signal(server, args.drain_seconds)


if __name__ == "__main__":
    main()
