"""
serving -- users arrive one by one: the latency/throughput trade-off as users feel it.

Claim (lecture): at a low arrival rate each user finds an idle engine (fast first token, small
batches, low throughput); as the rate nears what the engine sustains, batches grow (throughput
up) and requests queue (first tokens late); past it the queue grows without bound. The knee is
where latency turns up. Baseline: the capacity, measured by sending every user at once; then
Poisson arrivals at fractions of it (vLLM's benchmark_serving, in miniature), over HTTP against
serve.py, half the users streaming. Needs fastapi and uvicorn (skipped without them).
"""
from __future__ import annotations

import http.client
import itertools
import json
import math
import random
import threading
import time

from experiments.common import figure, model_config, seats, table, workload
from experiments.continuous_vs_static import static_and_continuous_steps
from experiments.plan import Phase, decode, prefill

NAME = "serving"
# users per rate (seats for half of them: a burst queues, as on a loaded server, or no knee shows);
# fractions of the capacity for the Poisson rates (a run at f lasts ~1/f of the burst: the CPU skips 0.25)
WORKLOAD = {"cpu": dict(users=16, fractions=(0.5, 1.0, 1.5), limit_s=600, engine={}),
            "cpu-quick": dict(users=6, fractions=(0.5,), limit_s=120, engine={}),
            "gpu": dict(users=32, fractions=(0.5, 0.75, 1.0, 1.5), limit_s=600, engine={}),
            "gpu-quick": dict(users=32, fractions=(0.5, 1.0), limit_s=300, engine={})}
KNEE_FACTOR = 2.0     # the knee: the first rate whose streaming users' p99 TTFT is over twice the lowest rate's
SKIPPED = "needs fastapi and uvicorn (pip install -r requirements.txt)"


def percentile(xs, p: float):
    """The nearest-rank p-th percentile (p in [0, 100]): a value that occurred (p99 of < 100 values: the largest)."""
    xs = sorted(xs)
    return xs[max(0, min(len(xs) - 1, math.ceil(p / 100 * len(xs)) - 1))] if xs else float("nan")


def http_request(host: str, port: int, body: dict, timeout: float) -> dict:
    """One request as its user sees it: sent, first text, last text, end, and the tokens it got."""
    rec = {"stream": body["stream"], "ok": False, "tokens": 0, "first": None, "last": None}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        rec["sent"] = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec["error"] = f"HTTP {resp.status}: {resp.read()[:200]!r}"
        elif body["stream"]:
            for line in resp:                    # server-sent events: "data: {json}", blank lines between
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = chunk["error"]["message"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    rec["last"] = time.perf_counter()
                    rec["first"] = rec["first"] or rec["last"]      # TTFT: the first chunk with text
                if chunk.get("usage"):
                    rec["tokens"] = chunk["usage"]["completion_tokens"]
        else:                                    # the user sees nothing before the whole answer
            rec["tokens"] = json.loads(resp.read())["usage"]["completion_tokens"]
            rec["first"] = rec["last"] = time.perf_counter()
        rec["end"] = time.perf_counter()
        rec["ok"] = "error" not in rec and rec["first"] is not None
    except (OSError, ValueError, KeyError) as e:   # refused, reset, timed out, or a malformed answer
        rec["error"] = repr(e)
    finally:
        conn.close()
    return rec


def rate_stats(recs: list, bodies: list, start: float) -> dict:
    """A rate's figures. TTFT and TPOT are the streaming users' ((last - first text) / (tokens - 1):
    the decode step they see); a non-streaming user sees nothing before the whole answer: its latency."""
    done = [r for r in recs if r is not None and r["ok"]]
    stream = [r for r in done if r["stream"]]
    seconds = max([r["end"] for r in done], default=start) - start
    ttft = [r["first"] - r["sent"] for r in stream]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in stream if r["tokens"] > 1]
    latency, tokens = [r["end"] - r["sent"] for r in done if not r["stream"]], sum(r["tokens"] for r in done)
    return {"requests": len(bodies), "completed": len(done), "streaming": sum(x["stream"] for x in bodies),
            "requested_tokens": sum(x["max_tokens"] for x in bodies), "output_tokens": tokens,
            "seconds": seconds, "requests_per_s": len(done) / seconds if seconds else 0.0,
            "output_tokens_per_s": tokens / seconds if seconds else 0.0,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50) * 1e3, "tpot_p99_ms": percentile(tpot, 99) * 1e3,
            "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
            "e2e_max_s": max((r["end"] - r["sent"] for r in done), default=0.0),
            "ttft_le_e2e": all(r["sent"] <= r["first"] <= r["end"] for r in done),
            "errors": [r["error"] for r in recs if r is not None and "error" in r][:5]}


def load_run(b, addr, vocab: int, n: int, rate: float, seed: int, limit_s: float) -> dict:
    """n requests of the workload (seed), arriving as a Poisson process of `rate` per second (math.inf:
    all at once: independent exponential gaps of mean 1 / rate), half streaming; a thread per user."""
    prompts, lengths = workload(b, vocab, seed=seed)
    bodies = [{"prompt": p, "max_tokens": m, "temperature": 0.0, "ignore_eos": True, "stream": i % 2 == 0,
               **({"stream_options": {"include_usage": True}} if i % 2 == 0 else {})}   # the usage chunk counts
              for i, (p, m) in enumerate(zip(prompts[:n], lengths[:n]))]
    rng = random.Random(seed)
    gaps = [0.0 if rate == math.inf else rng.expovariate(rate) for _ in bodies[1:]]
    offsets = list(itertools.accumulate([0.0] + gaps))
    recs, start = [None] * len(bodies), time.perf_counter() + 0.05    # every thread exists before the first send
    deadline = start + offsets[-1] + limit_s

    def user(i):
        time.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        recs[i] = http_request(*addr, bodies[i], timeout=max(1.0, deadline - time.perf_counter()))
    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:                            # bounded: a request still running at the deadline failed
        t.join(max(0.0, deadline - time.perf_counter()))
    return {"rate_per_s": None if rate == math.inf else rate, "seed": seed, **rate_stats(recs, bodies, start)}


def runs_at_rates(b, w, srv, llm) -> tuple[list, float]:
    """All at once first (the capacity), then Poisson rates at fractions of it; the burst listed last."""
    addr, vocab = srv.server_address[:2], llm.config.vocab_size
    http_request(*addr, {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0, "stream": True,
                         "stream_options": {"include_usage": True}}, w.limit_s)                     # warm-up
    b.progress("serving: all at once")
    burst = load_run(b, addr, vocab, w.users, math.inf, seed=1, limit_s=w.limit_s)
    capacity, runs = burst["requests_per_s"], []
    for i, f in enumerate(w.fractions):
        b.progress(f"serving: Poisson arrivals at {f:.2f} x capacity")
        runs.append({"fraction_of_capacity": f, **load_run(b, addr, vocab, w.users, f * capacity, 2 + i, w.limit_s)})
    return runs + [{"fraction_of_capacity": None, **burst}], capacity


def run(b):
    try:
        import uvicorn  # noqa: F401  (serve.py's server)
        from serve import make_server          # fastapi: only this experiment needs it
    except ImportError:
        return {"skipped": SKIPPED}, f"Skipped: {SKIPPED}."
    w = b.sizes(WORKLOAD)
    llm, n = b.llm(**w.engine), w.users
    # In-process: the server's threads and the users' share this process (and its GIL) with the
    # engine thread; the users' work is small (a JSON parse per chunk).
    with seats(llm, n // 2):
        srv = make_server(llm, "127.0.0.1", 0, max_waiting=1024)
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        try:
            runs, capacity = runs_at_rates(b, w, srv, llm)
        finally:
            srv.shutdown()
            srv.server_close()
            srv.engine.stop()
    bm, base = llm.block_manager, runs[0]["ttft_p99_s"]
    knee = next((r for r in runs[1:] if r["ttft_p99_s"] > KNEE_FACTOR * base), None)
    fig = {"capacity_requests_per_s": capacity, "seats": n // 2, "knee_factor": KNEE_FACTOR, "runs": runs,
           "knee_rate_per_s": None if knee is None else knee["rate_per_s"], "knee_all_at_once": knee is runs[-1],
           "kv_blocks_free": bm.num_free_blocks, "kv_blocks_total": bm.num_blocks,
           "pool_all_free": bm.num_free_blocks == bm.num_blocks}
    rows = [["all at once" if r["rate_per_s"] is None else f"{r['rate_per_s']:.3g} ({r['fraction_of_capacity']:g}x)",
             f"{r['completed']}/{r['requests']}", r["requests_per_s"], r["output_tokens_per_s"], r["ttft_p50_s"],
             r["ttft_p99_s"], r["tpot_p50_ms"], r["tpot_p99_ms"], r["latency_p50_s"], r["latency_p99_s"]]
            for r in runs]
    knee_text = (f"none: p99 TTFT stayed within {KNEE_FACTOR:g}x of the lowest rate's" if knee is None else
                 "all at once" if knee is runs[-1] else
                 f"{knee['rate_per_s']:.3g} requests/s ({knee['fraction_of_capacity']:g}x capacity)")
    return fig, (f"{n} users per rate, half streaming (SSE), over HTTP on loopback, {n // 2} seats in the batch; "
                 "prompt and output lengths from the continuous-vs-static workload (a fresh draw per rate). Poisson "
                 f"arrivals at fractions of the capacity measured by sending all at once ({capacity:.3g} requests/s). "
                 "TTFT: the first streamed chunk with text; TPOT: (last - first text) / (tokens - 1), streaming "
                 f"users; latency: the whole answer, the other users. p99 of {n // 2} values is their maximum.\n\n" +
                 table(["arrival rate (req/s)", "completed", "req/s", "output tokens/s", "TTFT p50 (s)",
                        "TTFT p99 (s)", "TPOT p50 (ms)", "TPOT p99 (ms)", "latency p50 (s)", "latency p99 (s)"], rows) +
                 f"\n\nThe knee (p99 TTFT over {KNEE_FACTOR:g}x the lowest rate's): {knee_text}. After shutdown "
                 f"{bm.num_free_blocks}/{bm.num_blocks} KV blocks are free.")


def plan(s):
    w = s.sizes(WORKLOAD)
    o = s.options(**w.engine)
    prompts, lengths = workload(s, model_config(o["path"])[0].vocab_size)
    _, steps = static_and_continuous_steps(lengths[:w.users], w.users // 2)
    # a run at f x capacity spreads its arrivals over ~1/f of the burst's time, at a smaller batch
    bursts = 1 + sum(1 / f for f in w.fractions)
    longest = max(map(len, prompts)) + max(lengths)
    return [Phase([o], [prefill(o, (1 + len(w.fractions)) * sum(map(len, prompts[:w.users])), longest / 2),
                        decode(o, bursts * steps, w.users // 2, longest / 2)], context=longest)]


def plot(r: dict):
    fig, (ax,) = figure(r, "Serving: time to first token turns up as arrivals reach capacity (the knee)")
    poisson = [x for x in r["runs"] if x["rate_per_s"] is not None]
    burst = [x for x in r["runs"] if x["rate_per_s"] is None]
    # "All at once" has no rate: drawn to the right of the highest one, and labelled.
    far = 1.3 * max([x["rate_per_s"] for x in poisson] + [r["capacity_requests_per_s"]])
    runs, xs = poisson + burst, [x["rate_per_s"] for x in poisson] + [far] * len(burst)
    ax.plot(xs, [x["ttft_p50_s"] for x in runs], "o-", label="TTFT p50")
    ax.plot(xs, [x["ttft_p99_s"] for x in runs], "s-", label="TTFT p99")
    ax.set(xlabel="arrival rate (requests/s, Poisson)", ylabel="time to first token (s)")
    ax.set_xticks(xs, [f"{x:.3g}" for x in xs[:len(poisson)]] + ["all at once"] * len(burst))
    ax.axvline(r["capacity_requests_per_s"], color="grey", ls=":", label="capacity (all at once)")
    if r.get("knee_rate_per_s") is not None or r.get("knee_all_at_once"):
        knee = far if r.get("knee_all_at_once") else r["knee_rate_per_s"]
        ax.axvline(knee, color="C3", ls="--", label=f"knee: p99 TTFT > {r['knee_factor']:g}x the lowest rate's")
    tw = ax.twinx()
    tw.plot(xs, [x["output_tokens_per_s"] for x in runs], "^:", color="C2", label="throughput")
    tw.set_ylabel("output tokens/s")
    ax.legend(*[a + b for a, b in zip(ax.get_legend_handles_labels(), tw.get_legend_handles_labels())],
              fontsize=8, loc="upper left")
    return fig
