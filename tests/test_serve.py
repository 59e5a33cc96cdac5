"""Assignment: serve.py -- the OpenAI-compatible server.

To pass, implement make_server(llm, host, port): an HTTP server whose one
engine thread runs llm.step() while handler threads talk to it through
queues, answering
  * POST /v1/completions and /v1/chat/completions in the OpenAI shapes,
    streaming as server-sent events that end with "data: [DONE]" and whose
    text concatenates to the non-streaming result; n > 1; stop strings;
  * GET /v1/models, /health, /metrics (Prometheus text);
  * bad input with an OpenAI error object: 400 (malformed JSON, wrong types,
    unknown fields, out-of-range values, empty prompt), 413 (prompt longer
    than the context), 404 (unknown path or model), 503 (waiting queue full);
  * a client that disconnects mid-stream gets its request aborted: the KV
    pool returns to all-free.
Greedy answers must equal offline LLM.generate, also under 16 concurrent
clients. The server runs the tiny random model, on a free loopback port.
"""
import http.client
import json
import socket
import threading
import time

import pytest

from scheduler import LLM, SamplingParams
from serve import _holdback, make_server, one_shot


@pytest.fixture(scope="module")
def server(tiny_path):
    llm = LLM(tiny_path, device="cpu", dtype="float32", max_num_seqs=8, kv_cache_bytes=1 << 24)
    srv = make_server(llm, "127.0.0.1", 0, max_waiting=64)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    srv.engine.stop()


@pytest.fixture(scope="module")
def offline(tiny_path):
    return LLM(tiny_path, device="cpu", dtype="float32", kv_cache_bytes=1 << 24)


def request(server, method, path, body=None, raw=None):
    """One real HTTP exchange on a fresh connection: (status, JSON or text body)."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = resp.read().decode()
    conn.close()
    if resp.getheader("Content-Type", "").startswith("application/json"):
        payload = json.loads(payload)
    return resp.status, payload


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
        time.sleep(0.05)
    return False


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


def test_streaming_concatenates_to_the_full_answer(server):
    for path, body in (("/v1/completions", {"prompt": "Once upon", "max_tokens": 20, "temperature": 0}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 20, "temperature": 0})):
        status, full = request(server, "POST", path, body)
        assert status == 200, full
        status, payload = request(server, "POST", path, {**body, "stream": True})
        assert status == 200
        chunks = sse(payload)
        if "chat" in path:
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert full["choices"][0]["message"]["content"] == text
        else:
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            assert full["choices"][0]["text"] == text
        assert len([c for c in chunks if c["choices"]]) > 2, "the answer was not streamed in pieces"
        reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        assert reasons == [full["choices"][0]["finish_reason"]]
        assert chunks[-1]["usage"] == full["usage"]


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
    # logprobs: one entry per generated token, alternatives included
    status, out = request(server, "POST", "/v1/completions",
                          {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "logprobs": 2})
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 5 and all(v <= 0 for v in lp["token_logprobs"])
    assert all(len(t) >= 2 for t in lp["top_logprobs"])


def test_models_health_metrics(server):
    status, out = request(server, "GET", "/v1/models")
    assert status == 200 and out["data"][0]["id"] and out["object"] == "list"
    status, out = request(server, "GET", "/health")
    assert status == 200 and out == {"status": "ok"}
    request(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3, "temperature": 0})
    status, text = request(server, "GET", "/metrics")
    assert status == 200
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    for name in ("nanoinfer_requests_running", "nanoinfer_requests_waiting", "nanoinfer_kv_blocks_free",
                 "nanoinfer_kv_blocks_used", "nanoinfer_kv_blocks_cached", "nanoinfer_prompt_tokens_total",
                 "nanoinfer_generation_tokens_total", "nanoinfer_time_to_first_token_seconds_count",
                 "nanoinfer_inter_token_latency_seconds_count"):
        assert name in values, f"/metrics lacks {name}"
    assert values["nanoinfer_generation_tokens_total"] >= 3 and values["nanoinfer_prompt_tokens_total"] >= 1
    assert values["nanoinfer_time_to_first_token_seconds_count"] >= 1
    assert values['nanoinfer_time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        values["nanoinfer_time_to_first_token_seconds_count"]


def test_concurrent_clients_get_offline_answers(server, offline):
    prompts = [f"Request number {i} says" for i in range(16)]
    refs = [o.text for o in offline.generate(prompts, [SamplingParams(max_tokens=10 + i % 5) for i in range(16)])]
    results = [None] * 16

    def client(i):
        body = {"prompt": prompts[i], "max_tokens": 10 + i % 5, "temperature": 0, "stream": i % 2 == 0}
        status, payload = request(server, "POST", "/v1/completions", body)
        assert status == 200
        results[i] = ("".join(c["choices"][0]["text"] for c in sse(payload) if c["choices"])
                      if i % 2 == 0 else payload["choices"][0]["text"])
    # 16 clients at once, half streaming: they share the engine's batches
    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert results == refs
    assert wait_all_free(server.engine.llm)


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "bogus_field": 1}, 400, "bogus_field"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999999]}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi " * 3000}, 413, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-7"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/nothing", {}, 404, None),
])
def test_bad_requests_get_error_objects(server, path, body, status, param):
    raw = body if isinstance(body, bytes) else None
    got, out = request(server, "POST", path, None if raw else body, raw=raw)
    assert got == status, out
    assert isinstance(out, dict) and set(out["error"]) >= {"message", "type", "param", "code"}
    assert "Traceback" not in out["error"]["message"]
    if param:
        assert out["error"]["param"] == param
    # the server still answers normally
    ok, _ = request(server, "GET", "/health")
    assert ok == 200


def test_unknown_get_path_is_404(server):
    status, out = request(server, "GET", "/v2/anything")
    assert status == 404 and "error" in out


def test_disconnect_mid_stream_frees_the_blocks(server):
    llm = server.engine.llm
    assert wait_all_free(llm)
    host, port = server.server_address[:2]
    body = json.dumps({"prompt": "a long story", "max_tokens": 400, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection((host, port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = b""
    while b"data: " not in received:                     # wait until the stream has started
        chunk = sock.recv(4096)
        assert chunk, "the server closed the stream early"
        received += chunk
    sock.close()                                         # ... and the client leaves
    assert wait_all_free(llm), "the aborted request's KV blocks were not freed"
    status, out = request(server, "GET", "/metrics")
    aborted = [line for line in out.splitlines() if line.startswith("nanoinfer_requests_aborted_total ")]
    assert aborted and float(aborted[0].split()[1]) >= 1, "the abort was not counted"


def test_full_waiting_queue_answers_503(tiny_path):
    llm = LLM(tiny_path, device="cpu", dtype="float32", max_num_seqs=1, kv_cache_bytes=1 << 22)
    srv = make_server(llm, "127.0.0.1", 0, max_waiting=1)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        statuses = []

        def client():
            statuses.append(request(srv, "POST", "/v1/completions",
                                    {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "temperature": 0})[0])
        # one seat (max_num_seqs=1) and one waiting place: of 6 simultaneous clients some must get 503
        threads = [threading.Thread(target=client) for _ in range(6)]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        assert 503 in statuses and 200 in statuses, statuses
        assert wait_all_free(llm)
    finally:
        srv.shutdown()
        srv.server_close()
        srv.engine.stop()


def test_holdback_and_one_shot(tiny_path, offline, capsys):
    assert _holdback("hello wor", ["world"]) == 3 and _holdback("hello", ["xyz"]) == 0
    out = one_shot(offline, "The harbor town", False, SamplingParams(max_tokens=12))
    printed = capsys.readouterr().out
    assert printed == out.text + "\n"
