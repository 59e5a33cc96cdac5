"""Assignment: serve.py -- the OpenAI-compatible server.

To pass, implement make_server(llm, host, port, max_waiting, **limits): a
FastAPI app on uvicorn whose one engine thread runs llm.step() while the
routes (async functions on the event loop) talk to it through queues (an
asyncio.Queue per HTTP request, fed with loop.call_soon_threadsafe), answering
  * POST /v1/completions and /v1/chat/completions in the OpenAI shapes,
    streaming as server-sent events that end with "data: [DONE]" and whose
    text concatenates to the non-streaming result; n > 1; stop strings; a
    prompt given as text, token ids, or a list of either (prompt i's sample j
    is choice i * n + j); echo, and logprobs over the prompt's tokens too (the
    first one null), equal to a dense forward pass's log_softmax; max_tokens 0
    with echo scores only; chat logprobs; the usage chunk only when
    stream_options.include_usage asks (with continuous_usage_stats, in every
    chunk too); vLLM's extras at their neutral values;
  * GET /v1/models (with root), /health, /metrics (Prometheus text),
    /tokenizer_info, POST /tokenize and /detokenize (vLLM's shapes);
  * every error as an OpenAI error object {"error": {message, type, param, code}}:
    400 (malformed JSON, wrong types, unknown fields, values SamplingParams
    refuses, empty prompt, prompt + max_tokens beyond the context, prompts x
    n x max_tokens over the cap, n over max_num_seqs, an unsupported extra),
    401 (API key), 404 (unknown path or model), 405 with Allow, 408 (a body
    too slow), 413 (a body over the limit, refused by its Content-Length
    before reading it or, chunked, as it streams past; a prompt longer than
    the context), 431 (a head over the bound), 500 (engine failure; a server
    bug, without its traceback), 503 (waiting queue full: with Retry-After;
    draining);
  * the sampling ranges of SamplingParams, not a copy of them;
  * a client that disconnects, streaming or not, gets its request aborted at
    once: the KV pool returns to all-free;
  * an exception in llm.step() fails the requests in flight with an error,
    and the server goes on;
  * a drain: new requests 503, requests in flight finish or end with an
    error, every block free; serve.py exits 0 on SIGTERM after draining.
What moved to uvicorn is checked as uvicorn's (a 400 for malformed HTTP and
oversized headers, 503 beyond --max-connections, the keep-alive timeout).
Greedy answers must equal offline LLM.generate, also under 64 and 256
concurrent clients. The exact bodies real clients sent (lm-evaluation-harness,
guidellm, vLLM's benchmark, the openai client: tests/fixtures/clients/) get
the offline values; with echo + logprobs the generated token is always the
last entry, EOS included (lm-eval drops it blindly). The servers run the tiny
random model on free loopback ports.
"""
import asyncio
import contextlib
import http.client
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine import LLM
from sampler import SamplingParams
from serve import exposure_warning, make_server, one_shot
from support.server import drain

import assignments  # noqa: E402  (tests/ is on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every test here talks to an engine thread (LLM() sizes its KV pool first): an
# unfinished engine assignment can stop it, and then nothing is answered.
pytestmark = pytest.mark.needs("engine")


@contextlib.contextmanager
def serving(llm, max_waiting=64, **limits):
    """A server on a free loopback port over `llm`, stopped on exit."""
    srv = make_server(llm, "127.0.0.1", 0, max_waiting=max_waiting, **limits)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        srv.engine.stop()


@pytest.fixture(scope="module")
def server(tiny_path):
    # max_num_seqs=128: SamplingParams' largest n fits the batch (and 128 clients run at once);
    # max_waiting=512: 256 clients at once are all queued, none refused
    llm = LLM(tiny_path, device="cpu", dtype="float32", max_num_seqs=128, kv_cache_bytes=1 << 24)
    with serving(llm, max_waiting=512) as srv:
        yield srv


@pytest.fixture(scope="module")
def small_llm(tiny_path):
    """A 2-seat engine for servers with special limits, one server at a time."""
    llm = LLM(tiny_path, device="cpu", dtype="float32", max_num_seqs=2, kv_cache_bytes=1 << 22)
    yield llm
    # In a student's copy a test blocked by an unfinished assignment (an SSE stream that raises
    # before its abort) may leave its request: that is its blocker's, not the last test's, failure.
    assert not llm.has_unfinished_requests() or assignments.unfinished(ROOT), "a test left requests in the engine"


@pytest.fixture(scope="module")
def offline(tiny_path):
    return LLM(tiny_path, device="cpu", dtype="float32", kv_cache_bytes=1 << 24)


def request(server, method, path, body=None, raw=None, headers=None, full=False):
    """One real HTTP exchange on a fresh connection: (status, JSON or text body[, headers])."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    payload = resp.read().decode()
    conn.close()
    if resp.getheader("Content-Type", "").startswith("application/json") and payload:
        payload = json.loads(payload)
    return (resp.status, payload, resp) if full else (resp.status, payload)


def raw_exchange(server, data: bytes, method="POST", timeout=10):
    """Send raw bytes, read one response: (status, headers, JSON or text body, seconds taken)."""
    t0 = time.monotonic()
    with socket.create_connection(server.server_address[:2], timeout=timeout) as sock:
        sock.sendall(data)
        resp = http.client.HTTPResponse(sock, method=method)
        resp.begin()
        body = resp.read().decode()
        resp.close()
    if resp.getheader("Content-Type", "").startswith("application/json") and body:
        body = json.loads(body)
    return resp.status, resp, body, time.monotonic() - t0


def post_bytes(body: dict, path="/v1/completions", extra=b"") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n".encode() + extra + b"\r\n" + data)


def assert_error(got, out, status, param=None, code=None):
    """An OpenAI-style error object with this status (and field, and code)."""
    assert got == status, f"expected HTTP {status}, got {got}: {out!r}"[:500]
    return error_object(out, param, code)


def error_object(out, param=None, code=None) -> dict:
    """{"error": {"message", "type", "param", "code"}} -> its inner object, checked."""
    assert isinstance(out, dict) and set(out.get("error", {})) >= {"message", "type", "param", "code"}, \
        f"not an OpenAI error object: {out!r}"[:500]
    error = out["error"]
    assert error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, f"the error names {error['param']!r}, not {param!r}: {out}"
    if code is not None:
        assert error["code"] == code, out
    return error


def sse(payload: str):
    """Parse server-sent events into JSON chunks; check the [DONE] terminator."""
    events = [line[len("data: "):] for line in payload.split("\n\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"stream does not end with [DONE]: {payload[-200:]!r}"
    return [json.loads(e) for e in events[:-1]]


def wait_all_free(llm, timeout=10.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if not llm.has_unfinished_requests() and llm.block_manager.num_free_blocks == llm.block_manager.num_blocks:
            return True
        time.sleep(0.005)
    return False


def wait_for(condition, timeout=10.0, what="condition"):
    t0 = time.time()
    while not condition():
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.01)


def metric(server, name):
    status, text = request(server, "GET", "/metrics")
    values = [float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert status == 200 and values, f"/metrics lacks {name}"
    return values[0]


class Stream:
    """A streaming request on its own connection (raw socket, so it can be dropped), read
    through http.client (the body is chunked); the first event has arrived when it returns."""

    def __init__(self, server, body, path="/v1/completions", extra=b""):
        self.sock = socket.create_connection(server.server_address[:2], timeout=30)
        self.sock.sendall(post_bytes({**body, "stream": True}, path, extra))
        self.resp = http.client.HTTPResponse(self.sock, method="POST")
        self.resp.begin()
        self.first = b""
        while b"data: " not in self.first:
            chunk = self.resp.read1(65536)
            assert chunk, "the server closed the stream early"
            self.first += chunk

    def rest(self) -> bytes:
        """Everything streamed, once the server has ended the stream."""
        data = self.first + self.resp.read()
        self.close()
        return data

    def close(self):
        self.resp.close()
        self.sock.close()


def start_stream(server, body, path="/v1/completions", extra=b"") -> Stream:
    return Stream(server, body, path, extra)


def stream_error(stream: bytes) -> dict:
    """The error object of a stream that ended in an error event followed by [DONE]."""
    events = [e[len("data: "):] for e in stream.decode().split("\n\n") if e.startswith("data: ")]
    assert len(events) >= 2 and events[-1] == "[DONE]", f"stream does not end with [DONE]: {events[-2:]}"
    return error_object(json.loads(events[-2]))


def select_readable(sock):
    return bool(select.select([sock], [], [], 0)[0])


def assert_ok(server):
    """The server still answers a normal request."""
    status, out = request(server, "POST", "/v1/completions", {"prompt": "still there", "max_tokens": 2})
    assert status == 200 and len(out["choices"]) == 1, out


def dense_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """log_softmax of a dense forward pass of the whole sequence (no cache, no batch): [len(ids), V]."""
    with torch.inference_mode():
        logits = llm.model(torch.tensor(ids, device=llm.device), torch.arange(len(ids), device=llm.device))
    return logits.float().log_softmax(-1)


def stream_texts(chunks: list, field="text") -> dict:
    """{choice index: its deltas joined} of SSE chunks."""
    texts = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            piece = c[field] if field == "text" else c["delta"].get("content", "")
            texts[c["index"]] = texts.get(c["index"], "") + piece
    return texts


# The clients' recorded bodies (tests/fixtures/clients/*.json: the tool, its version, the command, what it
# reads back). They name the default model; the server here runs the tiny random model with the same
# tokenizer, so each body's "model" becomes the served name (nothing else is changed).
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "clients")
TOL = 1e-5


def recorded(name: str) -> list[dict]:
    with open(os.path.join(FIXTURES, name + ".json")) as f:
        return json.load(f)["requests"]


@pytest.fixture(scope="module")
def served_name(server):
    status, out = request(server, "GET", "/v1/models")
    assert status == 200, out
    model = out["data"][0]
    # vLLM's shape: id = the served name, root = what it was loaded from (older `vllm bench serve`
    # versions read root, to load the tokenizer)
    assert isinstance(model.get("root"), str) and model["root"], f"/v1/models lacks 'root': {model}"
    return model["id"]


def replay(server, rec: dict, name: str):
    """Send one recorded request as the tool sent it (its headers too), the model renamed."""
    body = rec["body"]
    if isinstance(body, dict) and "model" in body:
        body = {**body, "model": name}
    headers = {k: v for k, v in rec["headers"].items() if k != "content-type"}
    status, out = request(server, rec["method"], rec["path"], body=body, headers=headers)
    if isinstance(body, dict) and body.get("stream") and status == 200:
        out = sse(out)
    return body, status, out


def by_index(choices: list) -> list:
    assert sorted(c["index"] for c in choices) == list(range(len(choices))), [c["index"] for c in choices]
    return sorted(choices, key=lambda c: c["index"])


def stream_parts(chunks: list, chat: bool = False, continuous: bool = False) -> tuple[dict, dict | None]:
    """SSE chunks -> ({choice index: concatenated text}, the usage chunk or None). The usage chunk
    has empty choices and comes last; no other chunk carries usage unless continuous stats asked."""
    texts, usage = {}, None
    for i, chunk in enumerate(chunks):
        if not chunk["choices"]:
            assert chunk.get("usage") and i == len(chunks) - 1, f"only the last chunk has no choices: {chunk}"
            usage = chunk["usage"]
        else:
            assert continuous or chunk.get("usage") is None, f"usage on a chunk with choices: {chunk}"
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + ((c["delta"].get("content") if chat else c["text"]) or "")
    return texts, usage


def chat_prompt_ids(llm, messages) -> list[int]:
    """The chat template's ids; content given as a list of text parts means their concatenation."""
    flat = [{**m, "content": "".join(p["text"] for p in m["content"]) if isinstance(m["content"], list)
             else m["content"]} for m in messages]
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(flat, add_generation_prompt=True),
                                allow_special=True)


# ----------------------------------------------------------------------------
# The API
# ----------------------------------------------------------------------------


@pytest.mark.needs("engine")
def test_completion_matches_offline_generate(server, offline):
    body = {"prompt": "The harbor town", "max_tokens": 12, "temperature": 0}
    status, out = request(server, "POST", "/v1/completions", body)
    assert status == 200, out
    ref = offline.generate(["The harbor town"], SamplingParams(max_tokens=12))[0]
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == ref.text
    assert out["choices"][0]["finish_reason"] == ref.finish_reason
    assert out["usage"] == {"prompt_tokens": len(ref.prompt_token_ids), "completion_tokens": len(ref.token_ids),
                            "total_tokens": len(ref.prompt_token_ids) + len(ref.token_ids)}
    # token ids as the prompt
    status, out2 = request(server, "POST", "/v1/completions", {**body, "prompt": ref.prompt_token_ids})
    assert status == 200 and out2["choices"][0]["text"] == ref.text


@pytest.mark.assignment("sse-stream")
@pytest.mark.needs("engine")
def test_streaming_concatenates_to_the_full_answer(server):
    for path, body in (("/v1/completions", {"prompt": "Once upon", "max_tokens": 20, "temperature": 0}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 20, "temperature": 0})):
        status, full = request(server, "POST", path, body)
        assert status == 200, full
        status, payload, resp = request(server, "POST", path, {**body, "stream": True,
                                                                "stream_options": {"include_usage": True}}, full=True)
        assert status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream"), \
            resp.getheader("Content-Type")
        assert resp.getheader("Cache-Control") == "no-cache", "a proxy must not buffer (or cache) the stream"
        chunks = sse(payload)
        if "chat" in path:
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant", \
                "the first chat chunk's delta carries the assistant role"
            assert full["choices"][0]["message"]["content"] == text, \
                "streamed chat deltas add up to the unstreamed message"
            assert {c["object"] for c in chunks} == {"chat.completion.chunk"}, \
                "every chat chunk is a chat.completion.chunk"
        else:
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            assert full["choices"][0]["text"] == text, "streamed text deltas add up to the unstreamed text"
        assert len([c for c in chunks if c["choices"]]) > 2, "the answer was not streamed in pieces"
        reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        assert reasons == [full["choices"][0]["finish_reason"]], \
            "finish_reason is sent once, equal to the unstreamed one"
        assert chunks[-1]["usage"] == full["usage"] and not chunks[-1]["choices"], \
            "the last chunk carries the unstreamed usage and no choices"
        assert all(c["choices"] and "usage" not in c for c in chunks[:-1]), "usage rides on the last chunk alone"
        # OpenAI's rule: no usage chunk unless stream_options.include_usage asks (a client that
        # reads choices[0] of every chunk breaks on it)
        status, payload = request(server, "POST", path, {**body, "stream": True})
        assert all(c["choices"] and "usage" not in c for c in sse(payload)), "a usage chunk nobody asked for"
        # vLLM's continuous_usage_stats: every chunk carries the counts so far
        status, payload = request(server, "POST", path, {**body, "stream": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}})
        counts = [c["usage"]["completion_tokens"] for c in sse(payload)]
        assert counts == sorted(counts) and counts[-1] == full["usage"]["completion_tokens"], \
            "continuous usage counts never decrease and end at the final completion_tokens"
        assert not sse(payload)[-1]["choices"] and sse(payload)[-1]["usage"] == full["usage"], \
            "with continuous usage too, the last chunk is the usage chunk (no choices)"
        # ... only together with include_usage, as in vLLM: alone, it adds usage nowhere
        status, payload = request(server, "POST", path, {**body, "stream": True,
                                                         "stream_options": {"continuous_usage_stats": True}})
        assert status == 200 and all(c["choices"] and "usage" not in c for c in sse(payload)), payload[-300:]
    # a step that adds no text sends no chunk: the stop string "<a token's text>@@" holds that token back
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    status, full = request(server, "POST", "/v1/completions", {**body, "logprobs": 0})
    token = next(t for t in full["choices"][0]["logprobs"]["tokens"][1:] if t.strip().isalnum())
    chunks = sse(request(server, "POST", "/v1/completions", {**body, "stream": True, "stop": [token + "@@"]})[1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"], "held-back text is sent later"
    assert all(c["choices"] for c in chunks) and len(chunks) < full["usage"]["completion_tokens"], \
        "a step whose text is all held back sends nothing (a chunk without choices breaks clients)"
    chunks = sse(request(server, "POST", "/v1/completions", {**body, "stream": True, "stop": [token + "@@"],
                                                             "logprobs": 0})[1])
    assert [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]] == \
        full["choices"][0]["logprobs"]["tokens"], "... but a held-back token's logprob is still sent, in its step"
    # two prompts, n = 2 samples each (seeded: the same as unstreamed), finishing at different steps:
    # each choice (index: prompt * n + sample) adds up to its text, its finish_reason sent once, last
    body = {"prompt": ["Once upon", "The sky"], "max_tokens": 12, "temperature": 1.0, "seed": 3, "n": 2,
            "stop": ["e"]}
    status, full = request(server, "POST", "/v1/completions", body)
    status, payload = request(server, "POST", "/v1/completions", {**body, "stream": True,
                                                                   "stream_options": {"include_usage": True}})
    chunks = sse(payload)
    assert sorted(c["index"] for c in full["choices"]) == [0, 1, 2, 3], full["choices"]
    for c in full["choices"]:
        mine = [ch for chunk in chunks for ch in chunk["choices"] if ch["index"] == c["index"]]
        assert "".join(ch["text"] for ch in mine) == c["text"], f"choice {c['index']}: deltas != its text"
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == [c["finish_reason"]], \
            f"choice {c['index']}: its finish_reason is sent once"
        assert mine[-1]["finish_reason"], f"choice {c['index']}: a chunk was sent after it finished"
    assert chunks[-1]["usage"] == full["usage"] and not chunks[-1]["choices"], \
        "the usage chunk counts all n choices and carries no choice"
    # chat, n = 2: each choice opens with its own role delta (the openai client builds one message
    # per index), and its content deltas add up to its message
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2}
    status, full = request(server, "POST", "/v1/chat/completions", chat)
    status, payload = request(server, "POST", "/v1/chat/completions", {**chat, "stream": True})
    for c in full["choices"]:
        mine = [ch["delta"] for chunk in sse(payload) for ch in chunk["choices"] if ch["index"] == c["index"]]
        assert mine[0].get("role") == "assistant", f"chat choice {c['index']}: its first delta names the role"
        assert "".join(d.get("content") or "" for d in mine) == c["message"]["content"], f"chat choice {c['index']}"


@pytest.mark.needs("engine", "sampler", "copy-on-write", "stop-strings", "sse-stream")
def test_n_stop_strings_logprobs_and_seed(server, offline):
    status, out = request(server, "POST", "/v1/completions",
                          {"prompt": "abc", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3})
    assert status == 200 and sorted(c["index"] for c in out["choices"]) == [0, 1, 2]
    status, again = request(server, "POST", "/v1/completions",
                            {"prompt": "abc", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3})
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in out["choices"]], "seeded n>1 not repeatable"
    # a stop string taken from the greedy answer cuts it there, in both modes
    ref = offline.generate(["Hello there"], SamplingParams(max_tokens=16))[0].text
    stop = ref[len(ref) // 2:len(ref) // 2 + 3]
    assert stop.strip(), "pick a prompt whose answer has text to stop on"
    body = {"prompt": "Hello there", "max_tokens": 16, "temperature": 0, "stop": [stop]}
    status, out = request(server, "POST", "/v1/completions", body)
    assert out["choices"][0]["text"] == ref[:ref.find(stop)] and out["choices"][0]["finish_reason"] == "stop"
    status, payload = request(server, "POST", "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in sse(payload) if c["choices"]) == ref[:ref.find(stop)]
    # logprobs: one entry per generated token, alternatives included, offsets into the text
    status, out = request(server, "POST", "/v1/completions",
                          {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "logprobs": 2})
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 5 and all(v <= 0 for v in lp["token_logprobs"])
    assert all(len(t) >= 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(5)]


@pytest.mark.needs("engine", "sampler", "copy-on-write", "sse-stream")
def test_prompt_lists_number_choices_per_prompt_and_sample(server, offline):
    """A prompt may be a list of strings or of token-id lists (lm-eval sends a list of id lists
    even for one prompt): prompt i's sample j is choice i * n + j, as OpenAI numbers them, each
    equal to offline generate of that prompt; the usage counts every prompt once."""
    prompts = ["The harbor town", "Once upon a time", "abc"]
    ids = [offline.tokenizer.encode(p) for p in prompts]
    refs = offline.generate(prompts, SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=2))
    want = {i * 2 + c.index: c.text for i, r in enumerate(refs) for c in r.outputs}
    base = {"max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 2}
    for prompt in (prompts, ids):
        status, out = request(server, "POST", "/v1/completions", {**base, "prompt": prompt})
        assert status == 200 and {c["index"]: c["text"] for c in out["choices"]} == want, out
        assert [c["index"] for c in out["choices"]] == list(range(6))
        assert out["usage"]["prompt_tokens"] == sum(map(len, ids))
        assert out["usage"]["completion_tokens"] == sum(len(c.token_ids) for r in refs for c in r.outputs)
        status, payload = request(server, "POST", "/v1/completions", {**base, "prompt": prompt, "stream": True})
        assert status == 200 and stream_texts(sse(payload)) == want
    status, out = request(server, "POST", "/v1/completions", {"prompt": [ids[0]], "max_tokens": 6, "temperature": 0})
    assert out["choices"][0]["text"] == offline.generate([ids[0]], SamplingParams(max_tokens=6))[0].text
    assert wait_all_free(server.engine.llm)


@pytest.mark.needs("engine", "sse-stream")
def test_echo_and_prompt_logprobs_equal_a_dense_forward_pass(server, offline):
    """echo puts the prompt first in the text; with logprobs its tokens are scored too, in
    OpenAI's shape: the first token's logprob and top_logprobs are null, every other token's
    is the dense forward pass's log_softmax (float32), text_offset indexes the text. lm-eval
    scores a choice exactly this way (max_tokens 1), or with max_tokens 0: score only."""
    tok = offline.tokenizer
    ids = tok.encode("The harbor town was quiet that night")
    for max_tokens in (0, 1, 3):
        body = {"prompt": [ids], "echo": True, "logprobs": 2, "max_tokens": max_tokens, "temperature": 0}
        status, out = request(server, "POST", "/v1/completions", body)
        assert status == 200, out
        gen = offline.generate([ids], SamplingParams(max_tokens=max_tokens))[0] if max_tokens else None
        every = ids + (gen.token_ids if gen else [])
        choice, dense = out["choices"][0], dense_logprobs(offline, every)
        lp = choice["logprobs"]
        assert choice["text"] == tok.decode(ids) + (gen.text if gen else "")
        assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == max_tokens
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(every)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [dense[j - 1, every[j]].item() for j in range(1, len(every))]
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
        best = [dense[j - 1].max().item() for j in range(1, len(every))]
        assert [max(t.values()) for t in lp["top_logprobs"][1:]] == pytest.approx(best, abs=1e-5)
        assert all(len(t) >= 2 for t in lp["top_logprobs"][1:])
        assert "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(every))]
        # streamed: the prompt in the first chunk, the same tokens and logprobs in all
        status, payload = request(server, "POST", "/v1/completions", {**body, "stream": True})
        chunks = sse(payload)
        assert chunks[0]["choices"][0]["text"].startswith(tok.decode(ids))
        assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
        streamed = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
        assert streamed == lp["token_logprobs"]
        assert [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]] == lp["text_offset"]
    # echo without logprobs: only the text; a string prompt is echoed as it was sent
    status, out = request(server, "POST", "/v1/completions", {"prompt": "The harbor", "echo": True, "max_tokens": 3,
                                                               "temperature": 0})
    ref = offline.generate(["The harbor"], SamplingParams(max_tokens=3))[0]
    assert out["choices"][0]["text"] == "The harbor" + ref.text and out["choices"][0]["logprobs"] is None
    assert wait_all_free(server.engine.llm)


@pytest.mark.needs("engine", "sampler")
def test_chat_logprobs_in_openai_chat_shape(server, offline):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}
    status, out = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200, out
    ids = offline.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    ref = offline.generate([ids], SamplingParams(max_tokens=4, logprobs=3))[0].outputs[0]
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx([lp for lp, _ in ref.logprobs], abs=1e-5)
    assert [bytes(c["bytes"]) for c in content] == [offline.tokenizer.token_bytes(t) for t in ref.token_ids]
    assert all(len(c["top_logprobs"]) == 3 and set(c["top_logprobs"][0]) == {"token", "logprob", "bytes"}
               for c in content)
    status, out = request(server, "POST", "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None})
    assert out["choices"][0]["logprobs"] is None


@pytest.mark.needs("engine", "sse-stream")
def test_benchmark_clients_payloads_and_sampling_extras(server, offline):
    """What `vllm bench serve` sends (repetition_penalty 1.0, logprobs null, ignore_eos,
    stream_options, chat content as text parts, max_completion_tokens) is served like
    offline generate; vLLM's sampling extras are accepted at their neutral values only."""
    prompt = "The harbor town"
    ids = offline.tokenizer.encode(prompt)
    ref = offline.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    body = {"model": server.app.state.model, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": 8,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0.0, "min_p": 0.0, "presence_penalty": 0, "frequency_penalty": 0.0, "top_k": -1,
            "top_p": 1.0, "user": "bench", "seed": None, "n": None, "stop": None}
    status, payload = request(server, "POST", "/v1/completions", body)
    chunks = sse(payload)
    assert stream_texts(chunks) == {0: ref.text} and chunks[-1]["usage"]["completion_tokens"] == 8
    chat = {"model": server.app.state.model, "messages": [{"role": "user", "content": [{"type": "text",
            "text": prompt}]}], "max_completion_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 0.0}
    chat_ids = offline.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
    status, payload = request(server, "POST", "/v1/chat/completions", chat)
    chunks = sse(payload)
    want = offline.generate([chat_ids], SamplingParams(max_tokens=8, ignore_eos=True))[0].text
    assert stream_texts(chunks, "delta") == {0: want} and chunks[-1]["usage"]["prompt_tokens"] == len(chat_ids)
    penalties = {"repetition_penalty": 1.3, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -1.0}
    status, out = request(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                              "ignore_eos": True, **penalties})
    want = offline.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, **penalties))[0].text
    assert status == 200 and out["choices"][0]["text"] == want, "penalties reach the engine's sampler"
    status, out = request(server, "GET", "/v1/models")
    model = out["data"][0]
    assert model["id"] == server.app.state.model and model["root"] == server.engine.llm.path
    assert model["max_model_len"] == server.engine.llm.max_len


@pytest.mark.needs("engine")
def test_tokenize_detokenize_and_tokenizer_info(server, offline):
    """vLLM's tokenizer endpoints at the server's root, as lm-eval's remote tokenizer uses them:
    /tokenizer_info names eos_token, /tokenize {prompt, add_special_tokens} gives the ids
    /v1/completions would use (a special token's text is that token), /detokenize inverts it."""
    tok = offline.tokenizer
    text = "Question: What is the capital of France?\nAnswer: Paris"
    status, info = request(server, "GET", "/tokenizer_info")
    eos = tok.id_to_special[tok.eos_token_id]
    assert status == 200 and info["eos_token"] == eos and info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == server.engine.llm.max_len
    status, out = request(server, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False,
                                                         "return_token_strs": True})
    assert status == 200 and out["tokens"] == tok.encode(text) and out["count"] == len(out["tokens"])
    assert "".join(out["token_strs"]) == text and out["max_model_len"] == server.engine.llm.max_len
    status, out = request(server, "POST", "/tokenize", {"prompt": eos, "add_special_tokens": False})
    assert out["tokens"] == [tok.eos_token_id], "lm-eval's eos_token_id is /tokenize(eos_token)[0]"
    status, out = request(server, "POST", "/detokenize", {"tokens": tok.encode(text)})
    assert status == 200 and out == {"prompt": text}
    assert_error(*request(server, "POST", "/detokenize", {"tokens": [-1]}), 400, "tokens")
    assert_error(*request(server, "POST", "/tokenize", {"prompt": "x", "bogus": 1}), 400, "bogus")
    assert_error(*request(server, "POST", "/tokenize", {"prompt": "x", "model": "gpt-7"}), 404, "model")


@pytest.mark.needs("engine")
def test_models_health_metrics_on_one_keep_alive_connection(server):
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=30)   # every request below reuses it

    def get(path, body=None):
        conn.request("POST" if body else "GET", path, body=json.dumps(body).encode() if body else None)
        resp = conn.getresponse()
        text = resp.read().decode()
        return resp.status, json.loads(text) if resp.getheader("Content-Type") == "application/json" else text
    status, out = get("/v1/models")
    assert status == 200 and out["data"][0]["id"] and out["object"] == "list"
    status, out = get("/health")
    assert status == 200 and out == {"status": "ok"}
    status, out = get("/v1/completions", {"prompt": "x", "max_tokens": 3, "temperature": 0})
    assert status == 200 and out["usage"]["completion_tokens"] == 3
    status, text = get("/metrics")
    conn.close()
    assert status == 200
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    for name in ("nanoinfer_requests_running", "nanoinfer_requests_waiting", "nanoinfer_kv_blocks_free",
                 "nanoinfer_kv_blocks_used", "nanoinfer_kv_blocks_cached", "nanoinfer_prompt_tokens_total",
                 "nanoinfer_generation_tokens_total", "nanoinfer_time_to_first_token_seconds_count",
                 "nanoinfer_inter_token_latency_seconds_count", "nanoinfer_requests_aborted_total",
                 "nanoinfer_requests_failed_total"):
        assert name in values, f"/metrics lacks {name}"
    assert values["nanoinfer_generation_tokens_total"] >= 3 and values["nanoinfer_prompt_tokens_total"] >= 1
    assert values["nanoinfer_time_to_first_token_seconds_count"] >= 1
    assert values['nanoinfer_time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        values["nanoinfer_time_to_first_token_seconds_count"]


# ----------------------------------------------------------------------------
# The clients people use: the exact bodies they sent, replayed
# ----------------------------------------------------------------------------
# lm-evaluation-harness 0.4.13, guidellm 0.8.1, the openai client and `vllm bench serve`'s request
# shapes, recorded from real runs (python scripts/clients.py runs the tools themselves; docs/SERVING.md).


@pytest.mark.needs("engine")
def test_lm_eval_loglikelihood_bodies(server, offline, served_name):
    """lm-eval scores a choice from `prompt` = a list of token-id lists, `echo`, `logprobs: 1`,
    `max_tokens: 1`: one choice per prompt, matched by `index`; tokens / token_logprobs /
    top_logprobs / text_offset over the prompt AND the generated token (it drops the last entry
    blindly); the first is null, every other a dense forward pass's log_softmax, equal to LLM's
    prompt_logprobs; the best of top_logprobs is that position's maximum (its is_greedy)."""
    for rec in recorded("lm_eval_loglikelihood"):
        body, status, out = replay(server, rec, served_name)
        assert status == 200, out
        prompts = body["prompt"]
        choices = by_index(out["choices"])
        assert len(choices) == len(prompts)
        ref = offline.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1))
        for ids, choice, r in zip(prompts, choices, ref):
            lp, n = choice["logprobs"], len(ids)
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == \
                len(lp["text_offset"]) == n + 1, "echo + 1 generated token: one entry per token"
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            dense = dense_logprobs(offline, ids + r.token_ids)
            want = [dense[j - 1, ids[j]].item() for j in range(1, n)] + [dense[n - 1].max().item()]
            assert lp["token_logprobs"][1:] == pytest.approx(want, abs=TOL)
            assert [p for p, _ in r.prompt_logprobs[1:]] == pytest.approx(lp["token_logprobs"][1:n], abs=TOL)
            best = [dense[j - 1].max().item() for j in range(1, n + 1)]
            assert [max(t.values()) for t in lp["top_logprobs"][1:]] == pytest.approx(best, abs=TOL)
            assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:]), "logprobs: 1 -> the best (+ the token)"
            # lm-eval's is_greedy compares floats exactly: a token that IS the best must equal it
            for j in range(1, n):
                if dense[j - 1].argmax().item() == ids[j]:
                    assert lp["token_logprobs"][j] == max(lp["top_logprobs"][j].values())
            prompt_text = offline.tokenizer.decode(ids)
            assert choice["text"] == prompt_text + r.text, "echo: the prompt's text, then the generated text"
            assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert out["usage"]["prompt_tokens"] == sum(map(len, prompts))
        assert out["usage"]["completion_tokens"] == len(prompts)


@pytest.mark.needs("engine")
def test_echo_logprobs_keep_the_generated_token_even_when_it_is_eos(tiny_path):
    """lm-eval sums token_logprobs[ctxlen:-1]: it drops the last entry blindly, as the one
    generated token. So that token must be there even when it is EOS, which ends the text and
    adds none. EOS is forced with the logits: its LM-head row (tied to its embedding; EOS is in
    no prompt) becomes twice the greedy token's, so EOS wins that position (the greedy logit > 0)."""
    llm = LLM(tiny_path, device="cpu", dtype="float32", max_num_seqs=4, kv_cache_bytes=1 << 22)
    tok, eos = llm.tokenizer, llm.tokenizer.eos_token_id
    ctx = tok.encode("Question: What is the capital of France?\nAnswer:")
    prompts = [ctx + tok.encode(" Paris"), ctx + tok.encode(" Rome")]
    last = dense_logprobs(llm, prompts[0])[-1]
    greedy = last.argmax().item()
    with torch.no_grad():
        w = llm.model.lm_head.weight                                         # [V, dim]
        w[eos] = 2 * w[greedy]
    dense = [dense_logprobs(llm, p + [eos]) for p in prompts]
    assert dense[0][len(prompts[0]) - 1].argmax().item() == eos, "EOS is not forced: pick another prompt"
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}
    try:
        with serving(llm) as srv:
            status, out = request(srv, "POST", "/v1/completions", body)
            assert status == 200, out
            assert wait_all_free(llm)
    finally:
        llm.close()
    choices = by_index(out["choices"])
    c, lp = choices[0], choices[0]["logprobs"]
    assert c["finish_reason"] == "stop" and c["text"] == tok.decode(prompts[0]), "EOS ends the text, adds none"
    assert lp["tokens"][-1] == tok.id_to_special[eos] and len(lp["token_logprobs"]) == len(prompts[0]) + 1
    assert lp["token_logprobs"][-1] == pytest.approx(dense[0][len(prompts[0]) - 1, eos].item(), abs=TOL)
    for p, choice, d in zip(prompts, choices, dense):       # what lm-eval computes, from either choice
        lps = choice["logprobs"]["token_logprobs"]
        assert len(lps) == len(p) + 1 and out["usage"]["completion_tokens"] == 2
        want = sum(d[j - 1, p[j]].item() for j in range(len(ctx), len(p)))
        assert sum(lps[len(ctx):-1]) == pytest.approx(want, abs=TOL)


@pytest.mark.needs("engine")
def test_lm_eval_generate_bodies(server, offline, served_name):
    """generate_until: token-id prompts, the task's stop strings plus EOS's: offline greedy text."""
    for rec in recorded("lm_eval_generate"):
        body, status, out = replay(server, rec, served_name)
        assert status == 200, out
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"], stop=body["stop"],
                                seed=body["seed"])
        ref = offline.generate(body["prompt"], params)
        choices = by_index(out["choices"])
        assert [c["text"] for c in choices] == [r.text for r in ref]
        assert [c["finish_reason"] for c in choices] == [r.finish_reason for r in ref]


@pytest.mark.needs("engine")
def test_lm_eval_chat_body(server, offline, served_name):
    for rec in recorded("lm_eval_chat"):
        body, status, out = replay(server, rec, served_name)
        assert status == 200, out
        prompt = offline.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
        ref = offline.generate(prompt, SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                                                      stop=body["stop"], seed=body["seed"]))[0]
        assert out["choices"][0]["message"]["content"] == ref.text


@pytest.mark.needs("engine")
def test_lm_eval_remote_tokenizer_endpoints(server, offline, served_name):
    """lm-eval's tokenizer auto-detection: /tokenizer_info, then /tokenize for every context."""
    tok = offline.tokenizer
    eos = tok.id_to_special[tok.eos_token_id]
    for rec in recorded("lm_eval_remote_tokenizer"):
        body, status, out = replay(server, rec, served_name)
        assert status == 200, out
        if rec["path"] == "/tokenizer_info":
            assert out["eos_token"] == eos and isinstance(out.get("chat_template"), str), out
        else:
            assert out["tokens"] == tok.encode(body["prompt"]) and out["count"] == len(out["tokens"]), out
    # what lm-eval's RemoteTokenizer sends next: eos_token_id = /tokenize(eos)[0]; decode = /detokenize
    status, out = request(server, "POST", "/tokenize", {"prompt": eos, "add_special_tokens": False})
    assert status == 200 and out["tokens"] == [tok.eos_token_id], out
    ids = tok.encode("Question: What is the capital of France?\nAnswer: Paris")
    status, out = request(server, "POST", "/detokenize", {"tokens": ids})
    assert status == 200 and out["prompt"] == tok.decode(ids), out


@pytest.mark.needs("engine", "sse-stream")
def test_guidellm_bodies(server, offline, served_name):
    """guidellm: content as text parts, max_completion_tokens, ignore_eos, include_usage with
    continuous_usage_stats; it sends no temperature (sampled): the checks are the token counts."""
    for name in ("guidellm_chat", "guidellm_completions"):
        for rec in recorded(name):
            body, status, out = replay(server, rec, served_name)
            assert status == 200, out
            if rec["method"] == "GET":
                continue
            chat = "messages" in body
            ids = chat_prompt_ids(offline, body["messages"]) if chat else offline.tokenizer.encode(body["prompt"])
            if body.get("stream"):
                continuous = body.get("stream_options", {}).get("continuous_usage_stats")
                texts, usage = stream_parts(out, chat, continuous)
                assert list(texts) == [0] and usage is not None, "include_usage: the usage chunk comes last"
                if continuous:         # vLLM's: every chunk carries the counts so far, rising to the last
                    counts = [c["usage"]["completion_tokens"] for c in out]
                    assert counts == sorted(counts) and counts[-1] == usage["completion_tokens"]
            else:
                usage = out["usage"]
            assert usage["completion_tokens"] == body.get("max_completion_tokens", body.get("max_tokens")), \
                "ignore_eos: every requested token is generated"
            assert usage["prompt_tokens"] == len(ids)


@pytest.mark.needs("engine", "sse-stream")
def test_vllm_bench_serve_bodies(server, offline, served_name):
    """vLLM's benchmark (temperature 0.0, repetition_penalty 1.0, ignore_eos): greedy text equal
    to offline, the usage chunk last."""
    for name in ("vllm_openai", "vllm_openai_chat"):
        for rec in recorded(name):
            body, status, out = replay(server, rec, served_name)
            assert status == 200, out
            chat = "messages" in body
            ids = chat_prompt_ids(offline, body["messages"]) if chat else offline.tokenizer.encode(body["prompt"])
            n = body.get("max_completion_tokens", body.get("max_tokens"))
            ref = offline.generate(ids, SamplingParams(max_tokens=n, ignore_eos=True))[0]
            texts, usage = stream_parts(out, chat)
            assert texts == {0: ref.text}
            assert usage == {**usage, "prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}


@pytest.mark.needs("engine", "sse-stream")
def test_openai_client_bodies(server, offline, served_name):
    reqs = recorded("openai_client")
    _, status, out = replay(server, reqs[0], served_name)                  # GET /v1/models
    assert status == 200 and out["data"][0]["id"] == served_name
    body, status, out = replay(server, reqs[1], served_name)               # a plain completion
    ref = offline.generate(body["prompt"], SamplingParams(max_tokens=body["max_tokens"]))[0]
    assert status == 200 and out["choices"][0]["text"] == ref.text
    body, status, out = replay(server, reqs[2], served_name)               # list prompt, echo, logprobs, stream
    assert status == 200
    texts, usage = stream_parts(out)
    refs = offline.generate(body["prompt"], SamplingParams(max_tokens=body["max_tokens"]))
    assert texts == {i: p + r.text for i, (p, r) in enumerate(zip(body["prompt"], refs))}, "echo: prompt first"
    assert usage["completion_tokens"] == sum(len(r.token_ids) for r in refs)
    body, status, out = replay(server, reqs[3], served_name)               # chat logprobs + top_logprobs
    assert status == 200, out
    ids = chat_prompt_ids(offline, body["messages"])
    ref = offline.generate(ids, SamplingParams(max_tokens=body["max_completion_tokens"],
                                               logprobs=body["top_logprobs"]))[0]
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx([lp for lp, _ in ref.outputs[0].logprobs], abs=TOL)
    assert all(len(c["top_logprobs"]) == body["top_logprobs"] for c in content)
    body, status, out = replay(server, reqs[4], served_name)               # a stream WITHOUT include_usage
    assert status == 200
    assert all(chunk["choices"] and chunk.get("usage") is None for chunk in out), \
        "no usage chunk unless stream_options.include_usage asks for it (OpenAI's rule)"


def concurrent_clients(server, offline, clients: int, lengths) -> None:
    """`clients` at once, every other one streaming: each answer equals LLM.generate's."""
    prompts = [f"Request number {i} says" for i in range(clients)]
    refs = [o.text for o in offline.generate(prompts, [SamplingParams(max_tokens=m) for m in lengths])]
    results = [None] * clients

    def client(i):
        body = {"prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0, "stream": i % 2 == 0}
        try:
            status, payload = request(server, "POST", "/v1/completions", body)
        except Exception as e:            # recorded, so the assertion below says what happened
            results[i] = repr(e)
            return
        if status == 200:
            results[i] = ("".join(c["choices"][0]["text"] for c in sse(payload) if c["choices"])
                          if i % 2 == 0 else payload["choices"][0]["text"])
        else:
            results[i] = (status, payload)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    wrong = [(i, results[i], refs[i]) for i in range(clients) if results[i] != refs[i]]
    assert not wrong, f"{len(wrong)} of {clients} clients got another answer than LLM.generate, e.g. {wrong[0]}"
    assert wait_all_free(server.engine.llm), "KV blocks still held after all clients finished"


@pytest.mark.assignment("sse-stream")
@pytest.mark.needs("engine")
def test_64_concurrent_clients_get_offline_answers(server, offline):
    concurrent_clients(server, offline, 64, [6 + i % 5 for i in range(64)])


@pytest.mark.needs("engine", "sse-stream")
def test_256_concurrent_clients_half_streaming_get_offline_answers(server, offline):
    """256 at once on one event loop, twice the batch's 128 seats: half wait for a seat."""
    concurrent_clients(server, offline, 256, [3 + i % 4 for i in range(256)])


# ----------------------------------------------------------------------------
# Bad requests: each fails alone, with an error object naming what to fix
# ----------------------------------------------------------------------------

DEEP = b"[" * 100000 + b"]" * 100000


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, None),        # not JSON, Python's extension
    ("/v1/completions", b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", 400, None),   # past int()'s digit limit
    ("/v1/completions", DEEP, 400, None),                                           # nested past the recursion limit
    ("/v1/completions", b"\xff\xfe{}", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": True}, 400, "max_tokens"),   # scoring needs logprobs
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 10 ** 400}, 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e999}', 400, "temperature"),  # JSON's inf
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2.5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "seed": 2 ** 64}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": "7"}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 10000}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * 100000]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1000}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1000, "echo": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"bogus": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": 1}, 400, "ignore_eos"),
    ("/v1/completions", {"prompt": "hi", "bogus_field": 1}, 400, "bogus_field"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0.0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3.0}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], ["a"]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, [2]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1], [99999999]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "\ud800 lone surrogate"}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\ud800"]}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi " * 3000}, 413, "prompt"),
    ("/v1/completions", {"prompt": ["hi", "hi " * 3000]}, 413, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-7"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "model": 7}, 400, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 1000}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10 ** 9},
     400, "max_completion_tokens"),
    ("/v1/nothing", {}, 404, None),
])
def test_bad_requests_get_error_objects(server, path, body, status, param):
    raw = body if isinstance(body, bytes) else None
    got, out = request(server, "POST", path, None if raw is not None else body, raw=raw)
    assert_error(got, out, status, param)
    assert_ok(server)


def test_a_body_that_is_not_json_says_what_it_was_sent_as(server):
    """A form or plain-text body: the 400 names the Content-Type it came with and the one to send
    (a JSON body under curl -d's form label included); a body in UTF-16 (which Python's JSON
    would guess) is not UTF-8, which JSON on the wire must be: a 400 too."""
    for data, ctype in ((b"prompt=hi&max_tokens=2", "application/x-www-form-urlencoded"),
                        (b"hi there", "text/plain")):
        got, out = request(server, "POST", "/v1/completions", raw=data, headers={"Content-Type": ctype})
        assert_error(got, out, 400)
        assert ctype in out["error"]["message"], out
    got, out = request(server, "POST", "/v1/completions", raw=b'"just a string"')
    assert_error(got, out, 400) and "JSON object" in out["error"]["message"]
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode("utf-16")
    got, out = request(server, "POST", "/v1/completions", raw=body)
    assert_error(got, out, 400, code="invalid_encoding")
    got, out = request(server, "POST", "/v1/completions", raw=b'{"prompt": "hi", "max_tokens": 2}',
                       headers={"Content-Type": "application/x-www-form-urlencoded"})   # curl -d's label
    assert_error(got, out, 400)
    assert "application/json" in out["error"]["message"], "the fix is named"
    assert_ok(server)


def test_max_tokens_beyond_the_context_names_both_numbers(server):
    llm = server.engine.llm
    prompt = llm.tokenizer.encode("The harbor town")
    t0 = time.monotonic()
    status, out = request(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 100000000})
    assert_error(status, out, 400, "max_tokens", "context_length_exceeded")
    assert time.monotonic() - t0 < 5, "refusing max_tokens=10^8 must not take long"
    message = out["error"]["message"]
    for number in (len(prompt), 100000000, llm.max_len):
        assert str(number) in message, f"the message should name {number}: {message}"
    # the boundary: prompt + max_tokens == the context is accepted, one more is refused
    room = llm.max_len - len(prompt)
    status, out = request(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": room + 1})
    assert_error(status, out, 400, "max_tokens")
    start_stream(server, {"prompt": prompt, "max_tokens": room, "ignore_eos": True}).close()   # accepted; leave
    assert wait_all_free(llm), "the abandoned full-context request was not aborted"


def test_sampling_ranges_are_samplingparams_own(server, monkeypatch):
    """The server's bounds are SamplingParams' bounds: the largest values it
    allows are accepted, one step past them refused, naming the field; and
    changing the range a SamplingParams field declares moves the server's bounds with it."""
    L = {name: f.metadata for name, f in SamplingParams.__dataclass_fields__.items()}
    L = {"n": L["n"]["le"], "logprobs": L["logprobs"]["le"], "prompt_logprobs": L["prompt_logprobs"]["le"],
         "stop": L["stop"]["items"], "stop_chars": L["stop"]["chars"], "seed": (L["seed"]["ge"], L["seed"]["le"])}
    lo, hi = L["seed"]
    base = {"prompt": "abc", "max_tokens": 2, "temperature": 0}
    accepted = [{"n": L["n"], "temperature": 1.0, "max_tokens": 1}, {"logprobs": L["logprobs"]},
                {"logprobs": min(L["logprobs"], L["prompt_logprobs"]), "echo": True},
                {"stop": [chr(ord("a") + i) * L["stop_chars"] for i in range(L["stop"])]},
                {"seed": hi, "temperature": 1.0}, {"seed": lo, "temperature": 1.0},
                {"temperature": 5.0}, {"top_k": 10 ** 30}, {"top_k": -1}]
    for extra in accepted:
        status, out = request(server, "POST", "/v1/completions", {**base, **extra})
        assert status == 200, f"{list(extra)} at SamplingParams' limit was refused: {out}"
    status, out = request(server, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": L["logprobs"]})
    assert status == 200, out
    refused = [({"n": L["n"] + 1}, "n"), ({"logprobs": L["logprobs"] + 1}, "logprobs"),
               ({"stop": ["s"] * (L["stop"] + 1)}, "stop"), ({"stop": ["s" * (L["stop_chars"] + 1)]}, "stop"),
               ({"seed": hi + 1}, "seed"), ({"seed": lo - 1}, "seed")]
    for extra, param in refused:
        status, out = request(server, "POST", "/v1/completions", {**base, **extra})
        assert_error(status, out, 400, param)
    # a huge top_k keeps every token: the same sample as top_k off, and no harm done
    sampled = {**base, "temperature": 1.0, "seed": 3, "max_tokens": 6}
    texts = [request(server, "POST", "/v1/completions", {**sampled, "top_k": k})[1]["choices"][0]["text"]
             for k in (0, 10 ** 30)]
    assert texts[0] == texts[1], "top_k beyond the vocabulary must mean 'all tokens'"
    # one source of truth: tightening SamplingParams tightens the server
    for key, bound, value in (("n", "le", 3), ("logprobs", "le", 2), ("prompt_logprobs", "le", 1),
                              ("stop", "items", 1)):
        f = SamplingParams.__dataclass_fields__[key]
        monkeypatch.setattr(f, "metadata", {**f.metadata, bound: value})
    for extra, param in (({"n": 4, "temperature": 1.0}, "n"), ({"logprobs": 3}, "logprobs"),
                         ({"logprobs": 2, "echo": True}, "logprobs"), ({"stop": ["a", "b"]}, "stop")):
        status, out = request(server, "POST", "/v1/completions", {**base, **extra})
        assert_error(status, out, 400, param)
    assert wait_all_free(server.engine.llm)


def test_a_new_sampling_field_is_one_declaration(monkeypatch):
    """A field added to SamplingParams with its range (here typical_p, the only edit) is at
    once a request field of both endpoints with its type (strict: "0.5" is refused), checked
    against its range by SamplingParams itself (a 400 naming the field), and passed through
    to the SamplingParams the server builds."""
    import dataclasses
    import types

    import pydantic

    import serve
    from sampler import knob
    from support.schema import request_models, sampling_fields
    from support.server import APIError
    Params = dataclasses.make_dataclass("SamplingParams", [("typical_p", float, knob(1.0, gt=0, le=1))],
                                        bases=(SamplingParams,))
    with pytest.raises(ValueError, match="typical_p must be a number in"):
        Params(typical_p=0)
    completion, chat = request_models(Params)
    assert "typical_p" in completion.model_fields and "typical_p" in chat.model_fields
    with pytest.raises(pydantic.ValidationError, match="typical_p"):
        completion(prompt="x", typical_p="0.5")
    monkeypatch.setattr(serve, "SamplingParams", Params)
    monkeypatch.setattr(serve, "SAMPLING_FIELDS", tuple(sampling_fields(Params)))
    llm = types.SimpleNamespace(max_len=100, config=types.SimpleNamespace(vocab_size=50),
                                scheduler=types.SimpleNamespace(max_num_seqs=4))
    prompts = [([1, 2], "x")]
    params = serve.sampling_params(llm, completion(prompt="x", typical_p=0.5), False, prompts, None)
    assert type(params) is Params and params.typical_p == 0.5
    with pytest.raises(APIError) as refused:
        serve.sampling_params(llm, chat(messages=[{"role": "user", "content": "x"}], typical_p=1.5),
                              True, prompts, None)
    assert refused.value.status == 400 and refused.value.param == "typical_p"


def test_every_engine_option_is_a_flag():
    """serve.py's engine flags are EngineConfig's fields: each has one, with its default and
    help, and the flags given build the same EngineConfig as the keyword arguments."""
    import dataclasses

    from engine import EngineConfig
    from support.server import engine_config, serve_arguments
    args = serve_arguments([], "test", EngineConfig)
    assert engine_config(args, EngineConfig) == EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        assert f.metadata["help"], f"{f.name} has no help"
    args = serve_arguments(["--model", "m", "--block-size", "8", "--no-enable-prefix-caching", "--compile",
                            "--kv-cache-dtype", "int8", "--kv-cache-bytes", "4096"], "test", EngineConfig)
    assert engine_config(args, EngineConfig) == EngineConfig(
        path="m", block_size=8, enable_prefix_caching=False, compile=True, kv_cache_dtype="int8",
        kv_cache_bytes=4096)
    with pytest.raises(SystemExit):
        serve_arguments(["--quantization", "int3"], "test", EngineConfig)


def test_request_token_cap_and_n_beyond_the_batch(small_llm):
    with serving(small_llm, max_request_tokens=60) as srv:
        base = {"prompt": "abc", "temperature": 1.0, "seed": 1}
        t0 = time.monotonic()
        status, out = request(srv, "POST", "/v1/completions", {**base, "n": 2, "max_tokens": 31})
        assert_error(status, out, 400, "n", "request_too_large")
        assert "60" in out["error"]["message"] and "62" in out["error"]["message"], out
        status, out = request(srv, "POST", "/v1/completions", {**base, "n": 2, "max_tokens": 30})
        assert status == 200 and len(out["choices"]) == 2, out
        # every prompt of a request counts: 3 prompts x 21 tokens > 60
        status, out = request(srv, "POST", "/v1/completions", {**base, "prompt": ["a", "b", "c"], "max_tokens": 21})
        assert_error(status, out, 400, "max_tokens", "request_too_large")
        # n beyond max_num_seqs (2) could never be scheduled: refused at once, naming both numbers
        for stream in (False, True):
            status, out = request(srv, "POST", "/v1/completions",
                                  {**base, "n": 3, "max_tokens": 5, "stream": stream})
            assert_error(status, out, 400, "n")
            assert "3" in out["error"]["message"] and "2" in out["error"]["message"], out
        assert time.monotonic() - t0 < 20, "the refusals must be quick"
        assert_ok(srv)
        assert wait_all_free(small_llm)


@pytest.mark.needs("engine", "sampler", "copy-on-write", "sse-stream")
def test_default_request_token_cap_is_16_contexts(server):
    llm, n = server.engine.llm, SamplingParams.__dataclass_fields__["n"].metadata["le"]
    per_sample = 16 * llm.max_len // n
    base = {"prompt": "abc", "temperature": 1.0, "seed": 1, "n": n}
    status, out = request(server, "POST", "/v1/completions", {**base, "max_tokens": per_sample + 1})
    assert_error(status, out, 400, "n", "request_too_large")
    start_stream(server, {**base, "max_tokens": per_sample}).close()   # exactly the cap: accepted
    # chat's default max_tokens (the rest of the context) shrinks to fit the cap instead of failing
    start_stream(server, {"messages": [{"role": "user", "content": "x"}], "n": n}, "/v1/chat/completions").close()
    assert wait_all_free(llm), "the abandoned requests were not aborted"


def test_engine_refusal_arrives_as_a_400(server, monkeypatch):
    """add_request's ValueError (e.g. the engine's own n > max_num_seqs check)
    is a 400 with its message, also for a stream (before any 200 is sent)."""
    llm = server.engine.llm
    real = llm.add_request

    def refuse(prompt, params=None, request_id=None):
        if params.max_tokens == 7:
            raise ValueError("n = 9 exceeds max_num_seqs = 8")
        return real(prompt, params, request_id=request_id)
    monkeypatch.setattr(llm, "add_request", refuse)
    for stream in (False, True):
        status, out = request(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 7, "stream": stream})
        assert_error(status, out, 400)
        assert "max_num_seqs" in out["error"]["message"], out
    # a batch of prompts fails as a whole: none of its requests is left running
    status, out = request(server, "POST", "/v1/completions", {"prompt": ["x", "y"], "max_tokens": 7})
    assert_error(status, out, 400)
    assert wait_all_free(llm)
    assert_ok(server)


def test_a_prompt_the_vocabulary_cannot_hold_is_refused_naming_the_character(server):
    """SmolLM2 has no token for 21 bytes (0x04, the lead byte of U+50000, ...). The reference
    tokenizer drops them silently; the server refuses the prompt (or the chat message) instead,
    with a 400 naming the character, and serves the next request."""
    for path, body, param in (("/v1/completions", {"prompt": "ab\x04cd", "max_tokens": 2}, "prompt"),
                              ("/v1/completions", {"prompt": ["ok", "x\U00050000y"], "max_tokens": 2}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi\x1d"}],
                                                        "max_tokens": 2}, "messages"),
                              ("/tokenize", {"prompt": "\x06"}, "prompt")):
        status, out = request(server, "POST", path, body)
        assert_error(status, out, 400, param)
        assert "U+" in out["error"]["message"] and "no token" in out["error"]["message"], out
    assert_ok(server)


def test_tokenizing_runs_off_the_event_loop_and_a_long_prompt_is_refused_unread(server, monkeypatch):
    """A prompt is encoded in a worker thread: while one is being tokenized, /health answers. A
    prompt of more bytes than the context's tokens can hold (each token covers at most
    max_token_bytes) is refused with context_length_exceeded before any tokenizer work."""
    tok = server.engine.llm.tokenizer
    encode, started, release = tok.encode, threading.Event(), threading.Event()

    def slow(text, **kw):
        started.set()
        release.wait(10)
        return encode(text, **kw)
    monkeypatch.setattr(tok, "encode", slow)
    worker = threading.Thread(target=request, args=(server, "POST", "/v1/completions",
                                                    {"prompt": "long", "max_tokens": 1}))
    worker.start()
    assert started.wait(10)
    assert request(server, "GET", "/health")[0] == 200, "the event loop waited for the tokenizer"
    release.set()
    worker.join(10)
    monkeypatch.setattr(tok, "encode", lambda *a, **k: pytest.fail("a hopeless prompt was tokenized"))
    size = server.engine.llm.max_len * tok.max_token_bytes + 1
    status, out = request(server, "POST", "/v1/completions", {"prompt": "a" * size, "max_tokens": 1})
    assert_error(status, out, 400, "prompt", "context_length_exceeded")


# ----------------------------------------------------------------------------
# HTTP-level limits: size, framing, methods, slowness, connections, keys
# ----------------------------------------------------------------------------


def test_body_size_is_checked_before_reading_and_while_streaming(server):
    limit = server.limits["max_body_bytes"]
    assert 1 << 20 <= limit <= 64 << 20, "the default body limit should be a few MB"
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    # an announced 1 GB body is refused at once, without sending (or reading) a byte of it
    status, resp, out, seconds = raw_exchange(server, head + b"Content-Length: 1000000000\r\n\r\n")
    assert_error(status, out, 413)
    assert seconds < 2
    # Expect: 100-continue gets the refusal instead of the go-ahead
    with socket.create_connection(server.server_address[:2], timeout=10) as sock:
        sock.sendall(head + b"Expect: 100-continue\r\nContent-Length: 1000000000\r\n\r\n")
        assert sock.recv(12) == b"HTTP/1.1 413", "a 100 Continue was sent for a body that will be refused"
    # a body just over the limit, actually sent, still gets its 413 (not a reset)
    status, out = request(server, "POST", "/v1/completions", raw=b" " * (limit + 1))
    assert_error(status, out, 413)
    # just under: read and parsed
    status, out = request(server, "POST", "/v1/completions",
                          {"prompt": "hi", "max_tokens": 1, "user": "u" * (limit - 100)})
    assert status == 200, out

    # a chunked body has no Content-Length: it is counted as it streams
    def chunked(data: bytes, size=65536) -> bytes:
        parts = [data[i:i + size] for i in range(0, len(data), size)]
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(
            b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    status, _, out, _ = raw_exchange(server, chunked(json.dumps({"prompt": "hi", "max_tokens": 1}).encode()))
    assert status == 200 and out["usage"]["completion_tokens"] == 1, out
    status, _, out, _ = raw_exchange(server, chunked(b" " * (limit + 1)))
    assert_error(status, out, 413)
    # no body at all: a JSON error; a malformed Content-Length: h11 (uvicorn) refuses the request
    status, _, out, _ = raw_exchange(server, head + b"\r\n")
    assert_error(status, out, 400)
    for bad in (b"Content-Length: abc\r\n", b"Content-Length: -5\r\n", b"Content-Length: +5\r\n",
                b"Content-Length: 1_0\r\n", b"Content-Length: 5, 6\r\n", b"Content-Length: 5\r\nContent-Length: 6\r\n"):
        status, _, out, _ = raw_exchange(server, head + bad + b"\r\n" + b"0\r\n\r\n")
        assert status == 400, (bad, status, out)
    assert_ok(server)


@pytest.mark.parametrize("method,path,allow", [
    ("HEAD", "/health", "GET"), ("OPTIONS", "/v1/completions", "POST"), ("PUT", "/v1/completions", "POST"),
    ("DELETE", "/v1/models", "GET"), ("PATCH", "/v1/chat/completions", "POST"), ("TRACE", "/metrics", "GET"),
    ("get", "/health", "GET"), ("GET", "/v1/completions", "POST"), ("POST", "/health", "GET"),
    ("POST", "/v1/models", "GET"), ("GET", "/tokenize", "POST")])
def test_other_methods_get_405_with_allow(server, method, path, allow):
    data = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}".encode()
    status, resp, out, _ = raw_exchange(server, data, method=method)
    assert status == 405, f"{method} {path}: {status} {out!r}"
    assert resp.getheader("Allow") == allow and resp.getheader("Content-Type") == "application/json"
    if method != "HEAD":                  # a response to HEAD has no body
        assert_error(status, out, 405)
    assert_ok(server)


@pytest.mark.parametrize("data,status", [
    (b"GARBAGE\r\n\r\n", 400), (b"GET /health HTTP/1.1\r\n\r\n", 400),                      # no Host
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 70000 + b"\r\n\r\n", 431),        # over max_header_bytes
    (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 20000 + b"\r\n", 431),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 1000000 + b"\r\n\r\n", 400)],     # still arriving
    ids=["garbage", "no-host", "big-header", "long-url", "many-headers", "huge-header"])
def test_malformed_http_and_oversized_heads_are_refused(server, data, status):
    """uvicorn's h11 parser answers a malformed request, or a head still arriving past
    max_header_bytes, with its own 400 (plain text) and closes that connection (a client still
    sending may see the reset first); a head over max_header_bytes that arrived whole gets a
    431 error object. The server goes on."""
    try:
        got, _, out, _ = raw_exchange(server, data)
    except (ConnectionResetError, BrokenPipeError):    # uvicorn answered 400 and closed while the client
        got, out = 400, "reset"                        # was still sending: the reset can overtake the answer
    assert got == status, (got, out)
    if status == 431:
        assert_error(got, out, 431)
    assert_ok(server)


def test_slow_bodies_time_out_without_delaying_others(small_llm):
    """The body must arrive within body_timeout, however it trickles in (408); other clients
    are served meanwhile (one event loop, no thread per connection). An idle keep-alive
    connection is closed after keep_alive_timeout (uvicorn's). A client slow to send its
    headers is head_timeout's (the next test)."""
    with serving(small_llm, body_timeout=1.0, keep_alive_timeout=1.0) as srv:
        addr = srv.server_address[:2]
        t0 = time.monotonic()
        slow_body = socket.create_connection(addr, timeout=10)
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        slow_headers = socket.create_connection(addr, timeout=10)
        slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")      # ... and nothing more
        status, out = request(srv, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200 and not select_readable(slow_body), \
            "a normal request must be answered while slow clients are still being waited for"
        resp = http.client.HTTPResponse(slow_body)
        resp.begin()
        assert_error(resp.status, json.loads(resp.read()), 408)
        assert time.monotonic() - t0 < 5, "the body timeout did not fire on time"
        # a client trickling a byte at a time cannot stretch the deadline
        trickle = socket.create_connection(addr, timeout=10)
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        t1, answer = time.monotonic(), b""
        for _ in range(1000):
            try:
                trickle.sendall(b" ")
            except OSError:
                break
            if select_readable(trickle):
                answer = trickle.recv(4096)
                break
            time.sleep(0.05)
        assert answer.startswith(b"HTTP/1.1 408"), f"a trickling client was not cut off: {answer[:80]!r}"
        assert time.monotonic() - t1 < 2.5
        # keep-alive: an idle connection after a response is closed by uvicorn
        idle = socket.create_connection(addr, timeout=10)
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        t2, data = time.monotonic(), b""
        while chunk := idle.recv(4096):
            data += chunk
        assert data.startswith(b"HTTP/1.1 200") and 0.5 < time.monotonic() - t2 < 4, "keep-alive timeout"
        for sock in (slow_body, slow_headers, trickle, idle):
            sock.close()
        assert_ok(srv)


def test_connections_that_send_no_whole_head_are_closed(small_llm):
    """--head-timeout: a connection that sends nothing, or a head that never ends, is closed once
    it passes (uvicorn alone kept them for ever, and enough of them took every seat under
    --max-connections: a 503 for everyone); a kept-alive connection gets the same deadline for
    its next head. Meanwhile and after, the others are served."""
    with serving(small_llm, max_connections=4, head_timeout=1.0, keep_alive_timeout=30.0) as srv:
        addr = srv.server_address[:2]
        held = [socket.create_connection(addr, timeout=10) for _ in range(2)]
        held[1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")          # ... and never the end
        time.sleep(0.2)
        status, _, _, _ = raw_exchange(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200, "two idle connections (the request's own the third of four): served"
        held.append(socket.create_connection(addr, timeout=10))
        time.sleep(0.2)
        status, _, _, _ = raw_exchange(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 503, "three idle connections and the request's own hold every seat"
        t0 = time.monotonic()
        assert all(sock.recv(1) == b"" for sock in held), "an idle connection must be closed"
        assert time.monotonic() - t0 < 3, "closed about head_timeout after it opened"
        assert request(srv, "GET", "/health")[0] == 200
        kept = socket.create_connection(addr, timeout=10)
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = http.client.HTTPResponse(kept)
        resp.begin()
        resp.read()
        t1 = time.monotonic()
        assert resp.status == 200 and kept.recv(1) == b"" and time.monotonic() - t1 < 3, \
            "a kept-alive connection's next head has head_timeout too, not keep_alive_timeout (30 s)"
        for sock in held + [kept]:
            sock.close()
        assert_ok(srv)


def test_a_burst_of_n_gt_1_requests_never_overfills_the_batch(tiny_path):
    """--max-num-seqs 8 and, at once, 6 requests with n = 4 and 10 with n = 1 (each prompt chunked
    over steps, so a request's samples fork steps after it was admitted): /metrics never shows
    more than 8 running sequences, and every request is answered with all its choices."""
    llm = LLM(tiny_path, device="cpu", dtype="float32", max_num_seqs=8, kv_cache_bytes=1 << 22,
              max_num_batched_tokens=16)
    with serving(llm) as srv:
        bodies = [{"prompt": [7 + i] * (20 + i), "max_tokens": 8, "n": 4 if i < 6 else 1,
                   "temperature": 0.8, "seed": i, "ignore_eos": True} for i in range(16)]
        answers, most = [None] * 16, 0

        def post(i):
            answers[i] = request(srv, "POST", "/v1/completions", bodies[i])
        threads = [threading.Thread(target=post, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            most = max(most, metric(srv, "nanoinfer_requests_running"))
        assert most <= 8, f"{most} sequences ran at once with --max-num-seqs 8"
        for i, (status, out) in enumerate(answers):
            assert status == 200 and len(out["choices"]) == bodies[i]["n"], (status, out)
        wait_all_free(llm)
        assert_ok(srv)


def test_connection_cap_answers_503(small_llm):
    """--max-connections is uvicorn's limit_concurrency: a request arriving while that many
    connections (its own included) are open gets uvicorn's 503; once they close, service resumes."""
    with serving(small_llm, max_connections=3) as srv:
        addr = srv.server_address[:2]
        held = [socket.create_connection(addr) for _ in range(2)]
        time.sleep(0.2)                   # the event loop accepts them
        status, resp, out, seconds = raw_exchange(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 503 and seconds < 2, (status, out)
        for sock in held:
            sock.close()
        wait_for(lambda: request(srv, "GET", "/health")[0] == 200, what="closed connections to be released")
        assert_ok(srv)


def test_api_key(small_llm):
    with serving(small_llm, api_key="s3cret") as srv:
        body = {"prompt": "x", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}, {"Authorization": "Bearer s3cret-and-more"},
                        {"Authorization": "Bearer \u00e9\u00e9"}):
            for method, path, data in (("GET", "/v1/models", None), ("POST", "/v1/completions", body),
                                       ("POST", "/tokenize", {"prompt": "x"}), ("GET", "/tokenizer_info", None)):
                status, out, resp = request(srv, method, path, data, headers=headers, full=True)
                assert_error(status, out, 401)
                assert resp.getheader("WWW-Authenticate", "").startswith("Bearer")
        # refused before the body is read: an unauthenticated client cannot make the server read 1 GB
        status, _, out, seconds = raw_exchange(srv, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                    b"Content-Length: 1000000000\r\n\r\n")
        assert_error(status, out, 401)
        assert seconds < 2
        for scheme in ("Bearer", "bearer"):
            status, out = request(srv, "POST", "/v1/completions", body, headers={"Authorization": f"{scheme} s3cret"})
            assert status == 200, out
        assert request(srv, "GET", "/health")[0] == 200, "/health must stay open for probes"
        assert request(srv, "GET", "/metrics")[0] == 200, "/metrics stays open for scrapers"
    assert exposure_warning("0.0.0.0", None) and exposure_warning("", None) and exposure_warning("10.1.2.3", None)
    assert "api" in exposure_warning("0.0.0.0", None).lower()
    for quiet in (("127.0.0.1", None), ("::1", None), ("localhost", None), ("0.0.0.0", "key")):
        assert exposure_warning(*quiet) is None, quiet


# ----------------------------------------------------------------------------
# Faults: departed clients, engine failures, back-pressure, shutdown
# ----------------------------------------------------------------------------


@pytest.mark.assignment("sse-stream")
@pytest.mark.needs("engine")
def test_disconnect_mid_stream_frees_the_blocks(server):
    llm = server.engine.llm
    assert wait_all_free(llm), "earlier requests must have freed every block"
    aborted = metric(server, "nanoinfer_requests_aborted_total")
    stream = start_stream(server, {"prompt": "a long story", "max_tokens": 400, "temperature": 0,
                                   "ignore_eos": True})
    t0 = time.monotonic()
    stream.close()                                       # ... and the client leaves
    assert wait_all_free(llm), "the aborted request's KV blocks were not freed"
    assert time.monotonic() - t0 < 0.5, "the departed client's request kept running"
    assert metric(server, "nanoinfer_requests_aborted_total") == aborted + 1, "the abort was not counted"
    # two prompts, a stop string only the first one's text holds: it finishes, then the client leaves
    base = {"prompt": ["a", "Once upon a time"], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    texts = [c["text"] for c in sorted(request(server, "POST", "/v1/completions", base)[1]["choices"],
                                       key=lambda c: c["index"])]
    stop = min((texts[0].find(c), c) for c in set(texts[0]) if c not in texts[1])[1]
    aborted = metric(server, "nanoinfer_requests_aborted_total")      # (the second runs past 200 tokens)
    stream = start_stream(server, {**base, "stop": [stop], "stream": True, "max_tokens": llm.max_len - 16})
    buf = stream.first
    while b'"finish_reason": "stop"' not in buf:
        buf += stream.resp.read1(65536)
    stream.close()
    t0 = time.monotonic()
    assert wait_all_free(llm) and time.monotonic() - t0 < 0.5, \
        "the prompt still running when its client left (after the other finished) kept running"
    assert metric(server, "nanoinfer_requests_aborted_total") == aborted + 1, "the second prompt was not aborted"


@pytest.mark.needs("engine")
def test_non_streaming_clients_that_leave_are_aborted_at_once(server):
    """Issue 20: four non-streaming requests (one of them a batch of three prompts) whose
    clients closed their sockets must stop generating at once, not run to the end, and
    free their blocks."""
    llm = server.engine.llm
    assert wait_all_free(llm)
    aborted = metric(server, "nanoinfer_requests_aborted_total")
    finished = metric(server, "nanoinfer_requests_finished_total")
    body = {"prompt": "a story", "max_tokens": llm.max_len - 8, "ignore_eos": True, "temperature": 0}
    socks = [socket.create_connection(server.server_address[:2]) for _ in range(4)]
    for i, sock in enumerate(socks):
        sock.sendall(post_bytes({**body, "prompt": ["a story", "b", "c"]} if i == 0 else body))
    wait_for(lambda: metric(server, "nanoinfer_generation_tokens_total") > 0 and
             len(llm.scheduler.running) == 6, what="the six requests to run")
    t0 = time.monotonic()
    for sock in socks:
        sock.close()
    assert wait_all_free(llm, timeout=5), "requests of departed clients kept generating"
    assert time.monotonic() - t0 < 0.5, "the departed clients' requests were not aborted at once"
    assert metric(server, "nanoinfer_requests_aborted_total") == aborted + 6
    assert metric(server, "nanoinfer_requests_finished_total") == finished, "they ran to the end instead"


@pytest.mark.needs("engine", "sse-stream")
def test_engine_step_failure_fails_its_requests_and_serving_goes_on(server, offline, monkeypatch):
    llm = server.engine.llm
    real_step, armed = llm.step, threading.Event()

    def flaky_step():
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected engine fault")
        return real_step()
    monkeypatch.setattr(llm, "step", flaky_step)
    body = {"prompt": "doomed", "max_tokens": 500, "ignore_eos": True, "temperature": 0}
    stream = start_stream(server, body)
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=request(server, "POST", "/v1/completions", body)))
    thread.start()
    wait_for(lambda: len(llm.requests) == 2, what="both requests in the engine")
    failed = metric(server, "nanoinfer_requests_failed_total")
    armed.set()
    error = stream_error(stream.rest())
    thread.join(30)
    assert error["type"] == "server_error", error
    assert_error(*result["r"], 500)
    assert metric(server, "nanoinfer_requests_failed_total") == failed + 2
    assert wait_all_free(llm), "a failed step left blocks held"
    status, out = request(server, "POST", "/v1/completions", {"prompt": "The harbor town", "max_tokens": 8,
                                                               "temperature": 0})
    ref = offline.generate(["The harbor town"], SamplingParams(max_tokens=8))[0].text
    assert status == 200 and out["choices"][0]["text"] == ref, "later requests are not served normally"


@pytest.mark.needs("engine", "sse-stream")
def test_a_request_the_engine_fails_alone_gets_an_error_and_others_go_on(server, offline, monkeypatch):
    """The engine finishes one request with finish_reason "error" (here: its
    text cannot be processed); its client gets an error, a stream beside it
    completes with exactly the offline answer."""
    import sequence
    llm = server.engine.llm
    poison = llm.tokenizer.encode("poison pill")
    add_text = sequence.Sequence.add_text

    def failing(self, delta):
        if self.request.prompt_ids == poison:
            raise UnicodeError("this text cannot be processed")
        return add_text(self, delta)
    monkeypatch.setattr(sequence.Sequence, "add_text", failing)
    good = {"prompt": "The harbor town", "max_tokens": 24, "temperature": 0}
    stream = start_stream(server, good)
    status, out = request(server, "POST", "/v1/completions", {"prompt": "poison pill", "max_tokens": 8})
    payload = stream.rest().decode()
    assert_error(status, out, 500)
    assert "cannot be processed" in out["error"]["message"]
    text = "".join(c["choices"][0]["text"] for c in sse(payload) if c.get("choices"))
    assert text == offline.generate(["The harbor town"], SamplingParams(max_tokens=24))[0].text
    assert wait_all_free(llm)


def test_full_waiting_queue_answers_503(small_llm):
    with serving(small_llm, max_waiting=1) as srv:
        results = []

        def client():
            results.append(request(srv, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 100,
                                                                    "ignore_eos": True, "temperature": 0},
                                   full=True))
        # two seats (max_num_seqs=2) and one waiting place: of 8 simultaneous clients some must get 503
        threads = [threading.Thread(target=client) for _ in range(8)]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        statuses = sorted(r[0] for r in results)
        assert 503 in statuses and 200 in statuses, statuses
        for status, out, resp in results:
            if status == 503:
                assert_error(status, out, 503)
                assert resp.getheader("Retry-After"), "a 503 for overload should say when to retry"
        # a batch of more prompts than could ever wait is a 400, not a 503 to retry
        assert_error(*request(srv, "POST", "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1}), 400,
                     "prompt")
        assert wait_all_free(small_llm)


@pytest.mark.assignment("sse-stream")
@pytest.mark.needs("engine")
def test_drain_finishes_in_flight_requests_and_aborts_the_rest(small_llm):
    with serving(small_llm) as srv:
        short = {}
        long_stream = start_stream(srv, {"prompt": "long", "max_tokens": 1500, "ignore_eos": True})
        thread = threading.Thread(target=lambda: short.update(r=request(srv, "POST", "/v1/completions", {
            "prompt": "short", "max_tokens": 60, "ignore_eos": True, "temperature": 0})))
        thread.start()
        wait_for(lambda: len(small_llm.requests) == 2, what="both requests in flight")
        hurry, report = threading.Event(), {}
        drainer = threading.Thread(target=lambda: report.update(drain(srv.engine, 30, hurry)))
        drainer.start()
        wait_for(lambda: srv.engine.draining, what="draining")
        assert_error(*request(srv, "POST", "/v1/completions", {"prompt": "late", "max_tokens": 2}), 503,
                     code="server_shutting_down")
        assert_error(*request(srv, "GET", "/health"), 503)
        thread.join(60)
        status, out = short["r"]
        assert status == 200 and out["choices"][0]["finish_reason"] == "length", "in flight, it should finish"
        assert out["usage"]["completion_tokens"] == 60, "an in-flight request runs to its max_tokens during a drain"
        hurry.set()                       # stop waiting for the long one
        drainer.join(30)
        assert stream_error(long_stream.rest())["code"] == "server_shutting_down", \
            "the aborted stream ends with a server_shutting_down error"
        assert report["in_flight"] == 2 and report["aborted"] == 1, report
        assert report["kv_blocks_free"] == report["kv_blocks_total"], report
        assert wait_all_free(small_llm), "after a drain every block is free"


@pytest.mark.needs("engine", "sampler", "sse-stream")     # a server process: its failures show only as timeouts
def test_sigterm_drains_and_exits_0(tiny_path):
    env = {**os.environ, "NANOINFER_API_KEY": "k", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "serve.py", "--model", tiny_path, "--port", "0", "--device", "cpu",
                             "--dtype", "float32", "--kv-cache-bytes", str(1 << 22), "--max-num-seqs", "4",
                             "--drain-seconds", "0.5"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not (m := re.search(r"http://([\d.]+):(\d+)/v1", lines[-1] if lines else "")):
            line = proc.stdout.readline()
            assert line, f"serve.py exited before serving: {''.join(lines)}"
            lines.append(line)

        class Addr:                        # what request() needs of a server
            server_address = (m.group(1), int(m.group(2)))
        auth = {"Authorization": "Bearer k"}
        assert request(Addr, "GET", "/v1/models")[0] == 401, "NANOINFER_API_KEY was not applied"
        body = {"prompt": "long", "max_tokens": 1500, "ignore_eos": True}
        stream = start_stream(Addr, body, extra=b"Authorization: Bearer k\r\n")
        full = {}
        thread = threading.Thread(target=lambda: full.update(r=request(Addr, "POST", "/v1/completions", body,
                                                                        headers=auth)))
        thread.start()
        wait_for(lambda: metric(Addr, "nanoinfer_requests_running") == 2, timeout=30, what="two running requests")
        proc.send_signal(signal.SIGTERM)
        payload = stream.rest()
        thread.join(30)
        assert proc.wait(timeout=30) == 0, "serve.py must exit 0 after draining"
        output = "".join(lines) + proc.stdout.read()
    finally:
        proc.kill() if proc.poll() is None else None
    assert stream_error(payload)["code"] == "server_shutting_down"
    assert_error(*full["r"], 503, code="server_shutting_down")
    assert full["r"][1]["error"]["type"] == "server_error", "shutting down is not overload"
    m = re.search(r"(\d+) aborted\); (\d+)/(\d+) KV blocks free", output)
    assert m and m.group(1) == "2" and m.group(2) == m.group(3), f"drain report: {output[-300:]}"


@pytest.mark.needs("engine")
def test_one_shot_prints_the_stream(tiny_path, offline, capsys):
    out = one_shot(offline, "The harbor town", False, SamplingParams(max_tokens=12))
    printed = capsys.readouterr().out
    assert printed == out.text + "\n"


# ---- paths the rest of this file does not reach

@pytest.mark.needs("engine")
def test_command_line_flags_reach_the_engine_and_the_server(tiny_path, monkeypatch, capsys):
    """serve.py's command line: every engine flag reaches LLM (pool size from
    --kv-cache-bytes by the lecture's formula, block size, seats, token
    budget, prefix caching, speculation), every serving flag reaches the
    server's limits (uvicorn's among them), the key comes from
    NANOINFER_API_KEY unless --api-key is given, a non-loopback bind without a
    key prints the warning, and --drain-seconds is what the signal handler drains with."""
    import serve
    from cache import kv_cache_bytes
    got = {}

    def captured(server, drain_seconds):          # instead of waiting for a signal
        got.update(server=server, drain=drain_seconds)
        server.server_close()
        server.engine.stop()
    monkeypatch.setattr(serve, "serve_until_signal", captured)
    monkeypatch.setenv("NANOINFER_API_KEY", "from-env")
    serve.main(["--model", tiny_path, "--host", "0.0.0.0", "--port", "0", "--device", "cpu", "--dtype", "float32",
                "--block-size", "8", "--kv-cache-bytes", str(3 << 20), "--max-num-seqs", "5",
                "--max-num-batched-tokens", "96", "--no-enable-prefix-caching", "--speculative", "ngram",
                "--num-speculative-tokens", "3", "--max-waiting", "7", "--max-connections", "9",
                "--max-body-bytes", "12345", "--max-request-tokens", "777", "--keep-alive-timeout", "1.5",
                "--body-timeout", "2.5", "--head-timeout", "3.5", "--drain-seconds", "4.5"])
    srv, llm = got["server"], got["server"].engine.llm
    per_token = kv_cache_bytes(llm.config, torch.float32)
    assert (llm.device.type, llm.dtype) == ("cpu", torch.float32)
    assert llm.block_manager.block_size == 8 and llm.block_manager.num_blocks == (3 << 20) // (per_token * 8)
    assert (llm.scheduler.max_num_seqs, llm.scheduler.max_num_batched_tokens) == (5, 96)
    assert llm.block_manager.enable_prefix_caching is False
    assert llm.speculation is not None and llm.speculation.k == 3
    assert srv.limits == {"api_key": "from-env", "max_body_bytes": 12345, "body_timeout": 2.5,
                          "max_connections": 9, "keep_alive_timeout": 1.5, "head_timeout": 3.5}
    assert (srv.engine.max_waiting, srv.app.state.max_request_tokens) == (7, 777)
    config = srv.uvicorn.config
    assert (config.limit_concurrency, config.timeout_keep_alive, config.http.head_timeout) == (9, 1.5, 3.5)
    assert got["drain"] == 4.5 and srv.server_address[1] > 0
    out, err = capsys.readouterr()
    assert f":{srv.server_address[1]}/v1" in out and "with an API key" in out, out
    assert "WARNING" not in err, "a key is set: no warning"
    # --api-key wins over the environment; without any key, 0.0.0.0 warns.
    serve.main(["--model", tiny_path, "--port", "0", "--device", "cpu", "--api-key", "from-flag"])
    assert got["server"].limits["api_key"] == "from-flag" and got["server"].engine.llm.block_manager.block_size == 16
    monkeypatch.delenv("NANOINFER_API_KEY")
    serve.main(["--model", tiny_path, "--host", "0.0.0.0", "--port", "0", "--device", "cpu",
                "--kv-cache-bytes", str(1 << 20)])
    assert got["server"].limits["api_key"] is None
    assert "WARNING: listening on 0.0.0.0 without an API key" in capsys.readouterr().err


@pytest.mark.needs("engine")
def test_command_line_one_shot_prints_the_offline_answer(tiny_path, offline, capsys):
    """serve.py --prompt: generates once with --max-tokens and --temperature
    and prints the text, the same as offline generate (with --chat: of the
    chat template's tokens), then exits without serving."""
    import serve
    for chat in (False, True):
        serve.main(["--model", tiny_path, "--device", "cpu", "--dtype", "float32", "--kv-cache-bytes", str(1 << 22),
                    "--prompt", "The harbor town", "--max-tokens", "9", "--temperature", "0"] + ["--chat"] * chat)
        tok = offline.tokenizer
        ids = tok.apply_chat_template([{"role": "user", "content": "The harbor town"}], tokenize=True) if chat \
            else tok.encode("The harbor town", allow_special=True)
        want = offline.generate([ids], SamplingParams(max_tokens=9))[0].text
        printed = capsys.readouterr().out
        assert printed.endswith(want + "\n") and "serving" not in printed, (chat, printed[-200:], want)


@pytest.mark.needs("engine")
def test_invalid_server_limits_are_refused_and_leave_no_engine_thread(small_llm):
    """make_server checks every limit before serving: a zero, negative or
    boolean limit is a ValueError naming it, and no engine thread is left
    running on the LLM."""
    def engine_threads():
        return [t for t in threading.enumerate() if t.name == "nanoinfer-engine" and t.is_alive()]
    before = len(engine_threads())
    for limits, name in [({"max_body_bytes": 0}, "max_body_bytes"), ({"max_connections": -1}, "max_connections"),
                         ({"keep_alive_timeout": True}, "keep_alive_timeout"), ({"body_timeout": 0}, "body_timeout"),
                         ({"max_request_tokens": 0}, "max_request_tokens"), ({"max_waiting": 0}, "max_waiting")]:
        with pytest.raises(ValueError, match=f"{name} must be a positive number"):
            make_server(small_llm, "127.0.0.1", 0, **limits)
    assert len(engine_threads()) == before, "a refused server must not leave an engine thread"


@pytest.mark.needs("engine")
def test_a_bug_in_a_handler_answers_500_without_a_traceback_and_serving_goes_on(small_llm, monkeypatch):
    """An unexpected exception while handling a request (a server bug) is
    answered with a 500 error object, never a traceback, and the next
    request is served normally."""
    import serve
    from support.server import APIError
    parse = serve.completion_prompts

    def buggy(llm, body):
        if body.prompt == "trigger":
            raise RuntimeError("boom at line 42")
        return parse(llm, body)
    monkeypatch.setattr(serve, "completion_prompts", buggy)
    with serving(small_llm) as srv:
        err = assert_error(*request(srv, "POST", "/v1/completions", {"prompt": "trigger", "max_tokens": 2}), 500)
        assert err["message"] == "internal server error" and "boom" not in err["message"]
        status, out = request(srv, "POST", "/v1/completions", {"prompt": "fine", "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2
        srv.engine.start_draining()              # from now on the engine itself refuses new requests
        with pytest.raises(APIError) as refused:
            asyncio.run(srv.engine.submit([[1, 2, 3]], SamplingParams(max_tokens=2)))
        assert refused.value.status == 503 and refused.value.code == "server_shutting_down"


@pytest.mark.needs("engine")
def test_chat_content_as_text_parts_equals_the_joined_string(server):
    """Newer clients send a message's content as a list of {"type": "text"}
    parts: the answer equals the one for the joined string; a part that is
    not text is refused with a 400 naming messages."""
    ask = lambda content: request(server, "POST", "/v1/chat/completions",   # noqa: E731
                                  {"messages": [{"role": "user", "content": content}], "max_tokens": 6,
                                   "temperature": 0})
    status, whole = ask("What is the capital of France?")
    assert status == 200, whole
    status, parts = ask([{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}])
    assert status == 200 and parts["choices"][0]["message"] == whole["choices"][0]["message"]
    assert parts["usage"] == whole["usage"]
    assert_error(*ask([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]), 400, param="messages")


# Values that ask for what this server does not do, one per documented field it does not implement.
SOMETHING = {"suffix": "!", "audio": {"voice": "alloy", "format": "wav"},
             "modalities": ["text", "audio"], "function_call": "auto", "functions": [{"name": "f"}],
             "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
             "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
             "web_search_options": {}, "moderation": {"model": "x"}, "store": True, "service_tier": "flex",
             "prompt_cache_retention": "24h"}


@pytest.mark.needs("engine", "sampler")      # logit_bias goes through the sampler's penalize
def test_every_documented_openai_field_is_accepted_at_null_and_named_when_unsupported(server):
    """Every field of the openai package's request types (CompletionCreateParams and chat's): sent at
    null, the request is served (no "extra inputs are not permitted"); a field this server does not
    implement, set to something, is a 400 naming it; hints (metadata, prompt_cache_key, ...) work as
    sent; best_of = n is served, best_of != n named; stream_options as the client sends them."""
    from openai.types import completion_create_params as completion_types
    from openai.types.chat import completion_create_params as chat_types
    for path, types, base in (("/v1/completions", completion_types, {"prompt": "Hello", "max_tokens": 2}),
                              ("/v1/chat/completions", chat_types,
                               {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})):
        fields = set(types.CompletionCreateParamsBase.__annotations__) | {"stream"}
        for name in sorted(fields - set(base)):
            status, out = request(server, "POST", path, {**base, name: None})
            assert status == 200, f"{path}: {name}: null refused: {out}"
        for name in sorted(fields & set(SOMETHING)):
            status, out = request(server, "POST", path, {**base, name: SOMETHING[name]})
            error = assert_error(status, out, 400, name)
            assert "not supported" in error["message"], (name, error)
    hints = {"metadata": {"run": "7"}, "parallel_tool_calls": False, "prompt_cache_key": "k",
             "safety_identifier": "u1", "user": "u1", "store": False, "service_tier": "auto",
             "response_format": {"type": "text"}, "tool_choice": "none", "tools": [], "modalities": ["text"],
             "stream_options": {"include_usage": True, "include_obfuscation": False}, "stream": True}
    status, _ = request(server, "POST", "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2, **hints})
    assert status == 200, "the fields that ask for nothing (or are hints) are served"
    status, out = request(server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": 2, "best_of": 2})
    assert status == 200 and len(out["choices"]) == 2, out
    assert_error(*request(server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "best_of": 3}), 400, "best_of")
    # logit_bias, OpenAI's shape (token ids as JSON strings): +100 forces a token, and bad maps are named
    status, out = request(server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "logit_bias": {"42": 100}})
    assert status == 200 and out["choices"][0]["text"] == server.engine.llm.tokenizer.decode([42] * 4), out
    for bad in ({"x": 1}, {"42": 101}, {"42": "a"}, {str(10**9): 1}):
        assert_error(*request(server, "POST", "/v1/completions", {"prompt": "Hi", "logit_bias": bad}), 400, "logit_bias")
    # allowed_token_ids (vLLM's extra field): only those tokens come out; an id past the vocabulary is named
    status, out = request(server, "POST", "/v1/completions",
                          {"prompt": "Hi", "max_tokens": 4, "temperature": 1.0, "seed": 3, "allowed_token_ids": [42, 43],
                           "logprobs": 0})
    assert status == 200 and set(out["choices"][0]["logprobs"]["tokens"]) <= {
        server.engine.llm.tokenizer.decode([t]) for t in (42, 43)}, out
    for bad in ([], [10**9], ["a"]):
        assert_error(*request(server, "POST", "/v1/completions", {"prompt": "Hi", "allowed_token_ids": bad}), 400,
                     "allowed_token_ids")


@pytest.mark.needs("engine", "sampler")
def test_structured_outputs_over_http_with_the_openai_client(server, served_name):
    """response_format (json_schema through the openai client's parse(), json_object), vLLM's guided_json,
    guided_regex, guided_choice and structured_outputs: every output that stops follows its grammar,
    streamed too; a grammar that does not compile, two at once or a malformed response_format is a 400
    naming the field."""
    import openai
    from pydantic import BaseModel, Field
    from typing import Literal

    class Verdict(BaseModel):                     # bounded: the tiny random model finishes it
        ok: bool
        score: int = Field(ge=0, le=9)
        label: Literal["spam", "ham"]

    host, port = server.server_address[:2]
    client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0)
    for seed in range(3):
        done = client.chat.completions.parse(model=served_name, messages=[{"role": "user", "content": "Judge this."}],
                                             response_format=Verdict, max_completion_tokens=40, temperature=1.0,
                                             seed=seed)
        choice = done.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Verdict), choice
    chat = {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 60, "temperature": 0.9, "seed": 1}
    status, out = request(server, "POST", "/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}})
    assert status == 200, out
    if out["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(out["choices"][0]["message"]["content"]), dict), out
    checks = {"guided_regex": ("[0-9]{2}-[ab]{3}", lambda t: re.fullmatch("[0-9]{2}-[ab]{3}", t)),
              "guided_choice": (["red", "green", "blue"], lambda t: t in ("red", "green", "blue")),
              "guided_json": ({"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"],
                               "additionalProperties": False}, lambda t: json.loads(t)["x"] in (1, 2)),
              "structured_outputs": ({"choice": ["up", "down"]}, lambda t: t in ("up", "down"))}
    for name, (value, check) in checks.items():
        status, out = request(server, "POST", "/v1/completions",
                              {"prompt": "Say:", "max_tokens": 30, "n": 2, "temperature": 1.0, name: value})
        assert status == 200, (name, out)
        for c in out["choices"]:
            assert c["finish_reason"] == "stop" and check(c["text"]), (name, c)
    vllm_style = [{"guided_json": {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]},
                   "guided_whitespace_pattern": "[ ]*", "guided_decoding_backend": "xgrammar"},
                  {"structured_outputs": {"choice": ["up", "down"], "json": None, "regex": None, "grammar": None,
                                          "json_object": False, "structural_tag": None, "whitespace_pattern": None,
                                          "disable_any_whitespace": False, "disable_additional_properties": False}}]
    for body in vllm_style:                      # older vLLM clients' extras; a client sending every field
        status, out = request(server, "POST", "/v1/completions", {"prompt": "Say:", "max_tokens": 30, **body})
        assert status == 200, (body, out)
    stream = client.completions.create(model=served_name, prompt="Pick:", max_tokens=10, stream=True,
                                       extra_body={"guided_choice": ["alpha", "beta"]})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) in ("alpha", "beta")
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
            "response_format"), ({"response_format": {"type": "json_schema"}}, "response_format"),
           ({"response_format": {"type": "yaml"}}, "response_format"), ({"guided_regex": "[0-9"}, "guided_regex"),
           ({"guided_choice": []}, "guided_choice"), ({"structured_outputs": {"json": 1}}, "structured_outputs"),
           ({"guided_regex": "a", "guided_choice": ["a"]}, None), ({"structural_tag": {"x": 1}}, "structural_tag"),
           ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
           ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
            "response_format")]
    for fields, param in bad:
        error = assert_error(*request(server, "POST", "/v1/chat/completions", {**chat, **fields}), 400, param)
        assert param is None or param in error["message"] or "structured" in error["message"], error


def test_langchain_structured_output_bodies(server, served_name):
    """LangChain's with_structured_output, as it sent them (scripts/langchain_structured.py): json_schema
    (strict, the pydantic schema), json_mode (json_object) and a streamed json_schema are served, and each
    output that stops parses (and, under a schema, validates: what LangChain then parses)."""
    import jsonschema
    for rec in recorded("langchain_structured"):
        body, status, out = replay(server, rec, served_name)
        assert status == 200, (body["response_format"], out)
        if body.get("stream"):
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in out if c["choices"])
            finish = [c["choices"][0]["finish_reason"] for c in out if c["choices"]][-1]
        else:
            text, finish = out["choices"][0]["message"]["content"], out["choices"][0]["finish_reason"]
        fmt = body["response_format"]
        assert finish in ("stop", "length") and (fmt["type"] == "json_object" or finish == "stop"), (fmt, finish, text)
        if finish == "stop":
            value = json.loads(text)
            assert isinstance(value, dict), text
            if fmt["type"] == "json_schema":
                jsonschema.validate(value, fmt["json_schema"]["schema"])


def test_the_server_describes_itself(server):
    """GET /openapi.json: the request models' schema (every documented field among the body's
    properties); GET /docs: FastAPI's page over it."""
    status, spec = request(server, "GET", "/openapi.json")
    assert status == 200 and {"/v1/completions", "/v1/chat/completions"} <= set(spec["paths"]), spec.get("paths")
    chat = spec["components"]["schemas"]["ChatRequest"]["properties"]
    assert {"messages", "max_completion_tokens", "logit_bias", "tools", "response_format", "metadata"} <= set(chat)
    status, page = request(server, "GET", "/docs")
    assert status == 200 and "openapi.json" in page, str(page)[:200]
