"""
scripts/clients.py -- the clients people actually use, run for real against serve.py (by hand).

What it protects: "OpenAI-compatible" meaning what the standard tools need, not what our own tests
happen to send. `python scripts/clients.py [--model DIR] [--limit N] [--only NAMES]` starts serve.py
in its own process on a free loopback port and runs, each in its own process:
  * lm-evaluation-harness `local-completions`: loglikelihood on tests/fixtures/lm_eval/nanoinfer_mc
    (token-id prompts, `echo`, `logprobs: 1`, `max_tokens: 1`, batches of 4) and generate_until on
    nanoinfer_gen; again with lm-eval's tokenizer auto-detection, which then uses the server's
    /tokenizer_info and /tokenize; and `local-chat-completions` on nanoinfer_gen;
  * guidellm: chat completions synchronous, text completions with concurrent streams;
  * `vllm bench serve`'s request shapes for its `openai` and `openai-chat` backends, replayed here
    with aiohttp as vLLM sends them (vllm itself does not install usefully on a CPU machine);
  * the official `openai` client (models, list prompts, echo + logprobs, score only, streams, chat logprobs);
then scores the same lm-eval documents OFFLINE through LLM with prompt logprobs
(tests/fixtures/lm_eval/score_offline.py, in its own process, outside the clients' virtual environment)
and prints one table: each tool, its outcome, and server vs offline (accuracy, the largest
|loglikelihood difference|, generations equal).

The heavy clients live in a virtual environment of their own (they pull datasets, pandas, ...):
    python -m venv --system-site-packages ~/.venvs/clients
    ~/.venvs/clients/bin/pip install torch==2.13.0 "lm-eval[api]==0.4.13" transformers "guidellm==0.8.1" openai
torch first and pinned, or pip pulls a multi-gigabyte CUDA build. --venv names that environment
(default: $NANOINFER_CLIENTS_VENV, else ~/.venvs/clients); every client runs in it. None of this
runs in CI: tests/test_serve.py replays the JSON bodies these tools sent (tests/fixtures/clients/)
against an in-process server. Results and commands: docs/SERVING.md.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)            # run by hand as a script: support/ sits at the repository root
TASKS = os.path.join("tests", "fixtures", "lm_eval")           # relative to ROOT: the YAMLs' data_files are
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
TOOLS = ("lm_eval", "guidellm", "vllm", "openai")
LL_TOLERANCE = 1e-4                 # issue 26: server loglikelihoods equal offline ones within this


# --- The server under test ---------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def start_server(model: str | None, log_path: str, extra=()) -> tuple[subprocess.Popen, str]:
    """serve.py in its own process (float32 on the CPU, as the offline scorer): (process, base URL),
    once /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "serve.py", "--port", str(port), "--device", "cpu", "--dtype", "float32", *extra]
    cmd += ["--model", model] if model else []
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 600   # the first start converts the model
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve.py exited with {proc.returncode} before serving: see {log_path}")
        try:
            get_json(base + "/health", timeout=2)
            return proc, base
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"serve.py did not answer /health in time: see {log_path}")


def stop_server(proc: subprocess.Popen) -> int:
    """SIGTERM (serve.py drains and exits 0), then the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def run(cmd: list, log_path: str, timeout: float = 3600, env: dict | None = None) -> int:
    """One tool in its own process, its output in log_path; the exit code (124: timed out)."""
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(map(str, cmd)) + "\n")
        log.flush()
        try:
            return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  env={**os.environ, **OFFLINE_ENV, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            return 124


# --- lm-evaluation-harness ---------------------------------------------------
def lm_eval(venv: str, out: str, kind: str, model_args: dict, tasks: str, limit, extra=()) -> dict:
    """One lm_eval run; its per-document samples by task: {task: [sample, ...]} (+ "rc")."""
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    cmd = [os.path.join(venv, "bin", "lm_eval"), "--model", kind, "--model_args", args, "--include_path", TASKS,
           "--tasks", tasks, "--output_path", out, "--log_samples", *extra]
    cmd += ["--limit", str(limit)] if limit else []
    rc = run(cmd, out + ".log")
    samples = {}
    for path in glob.glob(os.path.join(out, "**", "samples_*.jsonl"), recursive=True):
        task = os.path.basename(path)[len("samples_"):].rsplit("_", 1)[0]
        with open(path) as f:
            samples[task] = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
    return {"rc": rc, **samples}


def mc_from_samples(samples: list) -> dict:
    """lm-eval's multiple-choice samples -> {doc_id: ([loglikelihood per choice], acc, [is_greedy per choice])}."""
    return {s["doc_id"]: ([float(r[0][0]) for r in s["resps"]], s["acc"], [r[0][1] == "True" for r in s["resps"]])
            for s in samples}


def same_contexts(server: list, offline: list) -> bool:
    """lm-eval rendered the same prompt strings as the offline scorer (its logged arguments)."""
    ref = {d["doc_id"]: d["context"] for d in offline}
    return all(a["arg_0"] == ref[s["doc_id"]] for s in server for a in s["arguments"].values())


def compare_mc(server: list, offline: list) -> tuple[str, bool]:
    got, ref = mc_from_samples(server), {d["doc_id"]: (d["ll"], d["acc"]) for d in offline}
    diff = max(abs(a - b) for i in got for a, b in zip(got[i][0], ref[i][0], strict=True))
    acc_s = sum(g[1] for g in got.values()) / len(got)
    greedy = sum(got[i][2] == ref_greedy for i, ref_greedy in ((d["doc_id"], d["greedy"]) for d in offline)
                 if i in got)
    acc_o = sum(ref[i][1] for i in got) / len(got)
    norm = {d["doc_id"]: d["acc_norm"] for d in offline}
    norm_s, norm_o = (sum(x) / len(server) for x in zip(*((s["acc_norm"], norm[s["doc_id"]]) for s in server)))
    ok = diff <= LL_TOLERANCE and acc_s == acc_o and norm_s == norm_o and greedy == len(got) and \
        same_contexts(server, offline)
    return (f"{len(got)} docs, {sum(map(len, (g[0] for g in got.values())))} choices: acc {acc_s:.3f} "
            f"(offline {acc_o:.3f}), acc_norm {norm_s:.3f} ({norm_o:.3f}), max |d loglik| {diff:.2e}, "
            f"is_greedy equal in {greedy}/{len(got)} docs"), ok


def compare_gen(server: list, offline: list, chat: bool = False) -> tuple[str, bool]:
    ref = {d["doc_id"]: d for d in offline}
    same = sum(s["resps"][0][0] == ref[s["doc_id"]]["text"] for s in server)
    em_s = sum(s["exact_match"] for s in server) / len(server)
    em_o = sum(ref[s["doc_id"]]["exact_match"] for s in server) / len(server)
    ok = same == len(server) and (chat or same_contexts(server, offline))   # chat logs messages as JSON
    return (f"{len(server)} docs: exact_match {em_s:.3f} (offline {em_o:.3f}), "
            f"{same}/{len(server)} texts equal offline"), ok


def run_lm_eval(venv, base, name, tokdir, out, limit, offline: dict) -> list:
    rows, common = [], {"model": name, "num_concurrent": 2, "max_retries": 1, "timeout": 600}
    done = lm_eval(venv, os.path.join(out, "lm_eval_completions"), "local-completions",
                   {**common, "base_url": base + "/v1/completions", "tokenizer": tokdir,
                    "tokenizer_backend": "huggingface"}, "nanoinfer_mc,nanoinfer_gen", limit, ["--batch_size", "4"])
    for task, what, compare in (("nanoinfer_mc", "loglikelihood", compare_mc), ("nanoinfer_gen", "generate_until",
                                                                                compare_gen)):
        got = done.get(task)
        text, ok = compare(got, offline[task]) if got else (f"no samples (exit {done['rc']})", False)
        rows.append((f"lm-eval local-completions {what}", text, ok and done["rc"] == 0))
    auto = lm_eval(venv, os.path.join(out, "lm_eval_remote_tokenizer"), "local-completions",
                   {**common, "base_url": base + "/v1/completions"}, "nanoinfer_gen", limit)
    got = auto.get("nanoinfer_gen")
    text, ok = compare_gen(got, offline["nanoinfer_gen"]) if got else (f"no samples (exit {auto['rc']})", False)
    rows.append(("lm-eval local-completions, /tokenize", text, ok and auto["rc"] == 0))
    chat = lm_eval(venv, os.path.join(out, "lm_eval_chat"), "local-chat-completions",
                   {**common, "base_url": base + "/v1/chat/completions"}, "nanoinfer_gen", limit,
                   ["--apply_chat_template"])
    got = chat.get("nanoinfer_gen")
    text, ok = compare_gen(got, offline["chat"], chat=True) if got else (f"no samples (exit {chat['rc']})", False)
    rows.append(("lm-eval local-chat-completions", text, ok and chat["rc"] == 0))
    return rows


# --- guidellm -----------------------------------------------------------------
def run_guidellm(venv, base, name, tokdir, out, count: int) -> list:
    """Chat completions synchronously, then text completions with 4 concurrent streams."""
    rows = []
    for label, fmt, profile in (("guidellm chat, synchronous", "/v1/chat/completions", "kind=synchronous"),
                                ("guidellm completions, 4 streams", "/v1/completions", "kind=concurrent,streams=4")):
        path = os.path.join(out, "guidellm_" + fmt.strip("/").replace("/", "_") + ".json")
        cmd = [os.path.join(venv, "bin", "guidellm"), "run",
               "--backend", f"kind=openai_http,target={base},model={name},request_format={fmt}",
               "--tokenizer", f"kind=huggingface_auto,model={tokdir}",
               "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
               "--profile", profile, "--constraint", f"kind=max_requests,count={count}",
               "--output", f"kind=json,path={path}", "--disable-console-interactive"]
        rc = run(cmd, path + ".log")
        try:
            with open(path) as f:
                bench = json.load(f)["benchmarks"][0]
        except (OSError, ValueError, KeyError, IndexError):
            rows.append((label, f"no result (exit {rc})", False))
            continue
        totals = bench["metrics"]["request_totals"]
        tokens = bench["metrics"]["output_token_count"]["successful"]
        ttft = bench["metrics"]["time_to_first_token_ms"]["successful"]["median"]
        itl = bench["metrics"]["inter_token_latency_ms"]["successful"]["median"]
        errors = {r.get("info", {}).get("error", "")[:120] for r in bench["requests"]["errored"]}
        rows.append((label, f"{totals['successful']}/{totals['total']} ok, {totals['errored']} errors, "
                            f"{tokens['mean']:.0f} output tokens each, median TTFT {ttft:.0f} ms, ITL {itl:.0f} ms" +
                            (f"; {sorted(errors)}" if errors else ""),
                     rc == 0 and totals["successful"] == totals["total"] == count and tokens["mean"] == 32))
    return rows


# --- vLLM's benchmark request shapes (run in the clients' venv: aiohttp, transformers) --------
def vllm_prompts(tokdir: str, n: int, input_len: int, seed: int = 0) -> list[str]:
    """vLLM's "random" dataset: runs of consecutive non-special token ids from a random offset,
    decoded to text, re-encoded and cut to input_len tokens, decoded again."""
    import numpy as np
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokdir)
    allowed = np.array(sorted(set(range(tok.vocab_size)) - set(tok.all_special_ids)))
    rng, prompts = np.random.default_rng(seed), []
    for i, offset in enumerate(rng.integers(0, tok.vocab_size, size=n)):
        ids = allowed[(offset + i + np.arange(input_len)) % len(allowed)].tolist()
        ids = tok.encode(tok.decode(ids), add_special_tokens=False)[:input_len]
        prompts.append(tok.decode(ids))
    return prompts


def vllm_payload(backend: str, model: str, prompt: str, output_len: int) -> dict:
    """The JSON body of vllm/benchmarks/lib/endpoint_request_func.py for `vllm bench serve
    --dataset-name random` (which sets ignore_eos; temperature 0.0 is its default)."""
    if backend == "openai":
        body = {"model": model, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": output_len,
                "logprobs": None, "stream": True, "stream_options": {"include_usage": True}}
    else:
        body = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                "max_completion_tokens": output_len, "stream": True, "stream_options": {"include_usage": True}}
    return {**body, "ignore_eos": True, "temperature": 0.0}


async def _vllm_one(session, url, body, rid) -> dict:
    """One request the way vLLM's client reads it: success = a chunk with choices arrived; output
    tokens from the usage chunk. Also records what vLLM does not check: [DONE], usage placement."""
    out = {"ok": False, "text": "", "usage": None, "done": False, "status": None, "error": ""}
    t0 = time.perf_counter()
    async with session.post(url, json=body, headers={"x-request-id": rid}) as resp:
        out["status"] = resp.status
        if resp.status != 200:
            out["error"] = (await resp.text())[:300]
            return out
        buf = ""
        async for chunk in resp.content.iter_any():
            buf += chunk.decode()
            while "\n\n" in buf:
                event, buf = buf.split("\n\n", 1)
                data = event.strip().removeprefix("data: ")
                if data == "[DONE]":
                    out["done"] = True
                elif data and not data.startswith(":"):
                    msg = json.loads(data)
                    if msg.get("choices"):
                        c = msg["choices"][0]
                        out["ttft"] = out.get("ttft") or time.perf_counter() - t0
                        out["text"] += (c.get("text") if "text" in c else c["delta"].get("content")) or ""
                        out["ok"] = True
                    elif msg.get("usage"):
                        out["usage"] = msg["usage"]
    return out


def replay_vllm(base: str, model: str, tokdir: str, backend: str, n: int, concurrency: int,
                input_len: int = 64, output_len: int = 32) -> dict:
    """n requests of one vLLM backend, `concurrency` at a time, over one keep-alive connection pool."""
    import asyncio

    import aiohttp
    path = "/v1/completions" if backend == "openai" else "/v1/chat/completions"
    bodies = [vllm_payload(backend, model, p, output_len) for p in vllm_prompts(tokdir, n, input_len)]

    async def main():
        sem = asyncio.Semaphore(concurrency)
        conn = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session:
            async def one(i, body):
                async with sem:
                    return await _vllm_one(session, base + path, body, f"bench-nanoinfer-{i}")
            return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))

    t0 = time.perf_counter()
    outs = asyncio.run(main())
    return {"backend": backend, "seconds": time.perf_counter() - t0, "bodies": bodies, "outputs": outs}


def run_vllm(venv, base, name, tokdir, out, count: int) -> list:
    rows = []
    for backend in ("openai", "openai-chat"):
        path = os.path.join(out, f"vllm_{backend}.json")
        rc = run([os.path.join(venv, "bin", "python"), "scripts/clients.py", "--replay-vllm", backend,
                  "--url", base, "--served-name", name, "--tokenizer", tokdir, "--limit", str(count),
                  "--out", path], path + ".log")
        try:
            with open(path) as f:
                res = json.load(f)
            outs, seconds = res["outputs"], res["seconds"]
        except (OSError, ValueError, KeyError):
            rows.append((f"vllm bench serve shapes, {backend}", f"no result (exit {rc})", False))
            continue
        ok = [o for o in outs if o["ok"] and o["done"] and o["usage"]]
        tokens = sorted({o["usage"]["completion_tokens"] for o in ok})
        bad = sorted({f"{o['status']} {o['error'][:80]}" for o in outs if o not in ok})
        rows.append((f"vllm bench serve shapes, {backend}",
                     f"{len(ok)}/{len(outs)} ok (usage, [DONE]), completion_tokens {tokens}, 4 at a time: "
                     f"{sum(o['usage']['completion_tokens'] for o in ok) / seconds:.1f} output tok/s"
                     + (f"; {bad}" if bad else ""),
                     len(ok) == len(outs) == count and tokens == [32]))
    return rows


# --- the official openai client -------------------------------------------------
def openai_checks(base: str, name: str) -> dict:
    """The openai package as a user calls it (run in the clients' venv): models, completions (a list
    of prompts, echo + logprobs, score only), a stream with and without the usage chunk, chat logprobs."""
    import openai
    c = openai.OpenAI(base_url=base + "/v1", api_key=os.environ.get("NANOINFER_API_KEY", "none"), max_retries=0)
    checks = {"models": c.models.list().data[0].id == name}
    r = c.completions.create(model=name, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=4,
                             temperature=0, echo=True, logprobs=1)
    checks["list prompt + echo"] = ([ch.index for ch in r.choices] == [0, 1] and
                                    r.choices[0].text.startswith("The capital of France is") and
                                    r.choices[0].logprobs.token_logprobs[0] is None)
    r = c.completions.create(model=name, prompt="The capital of France is", max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    checks["score only (max_tokens 0)"] = (r.usage.completion_tokens == 0 and lp.token_logprobs[0] is None and
                                           len(lp.tokens) == r.usage.prompt_tokens)
    chunks = list(c.completions.create(model=name, prompt="Hello", max_tokens=4, stream=True))
    checks["stream, no usage chunk"] = all(ch.choices and ch.usage is None for ch in chunks)
    chunks = list(c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            stream=True, stream_options={"include_usage": True}))
    checks["chat stream + usage"] = chunks[-1].usage is not None and not chunks[-1].choices
    r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=4,
                                  temperature=0, logprobs=True, top_logprobs=2)
    checks["chat logprobs"] = len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    return {"version": openai.__version__, "checks": checks}


def run_openai(venv, base: str, name: str, out: str) -> list:
    path = os.path.join(out, "openai.json")
    rc = run([os.path.join(venv, "bin", "python"), "scripts/clients.py", "--check-openai", "--url", base,
              "--served-name", name, "--out", path], path + ".log")
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        return [("openai client", f"no result (exit {rc})", False)]
    failed = [k for k, v in res["checks"].items() if not v]
    return [(f"openai client {res['version']}", f"{len(res['checks']) - len(failed)}/{len(res['checks'])} checks" +
             (f", failed: {failed}" if failed else ""), rc == 0 and not failed)]


# --- offline scoring, and the whole run ---------------------------------------
def score_offline(model, out, limit) -> dict:
    """tests/fixtures/lm_eval/score_offline.py in its own process (it imports the tour)."""
    path = os.path.join(out, "offline.json")
    cmd = [sys.executable, os.path.join(TASKS, "score_offline.py"), "--out", path]
    cmd += (["--model", model] if model else []) + (["--limit", str(limit)] if limit else [])
    if run(cmd, path + ".log") != 0:
        raise RuntimeError(f"offline scoring failed: see {path}.log")
    with open(path) as f:
        return json.load(f)


def print_table(rows: list, file=sys.stdout):
    w = max(len(r[0]) for r in rows)
    for tool, text, ok in rows:
        print(f"{'ok  ' if ok else 'FAIL'}  {tool:<{w}}  {text}", file=file)


def run_all(args) -> int:
    venv = args.venv
    tools = args.only.split(",") if args.only else TOOLS
    if not os.path.exists(os.path.join(venv, "bin")):
        raise SystemExit(f"no clients venv at {venv!r}: see this file's docstring (--venv, $NANOINFER_CLIENTS_VENV)")
    os.makedirs(args.out, exist_ok=True)
    tokdir = args.tokenizer or (args.model if args.model and os.path.isdir(args.model) else None)
    if tokdir is None:
        from support.default_model import default_model_path
        tokdir = default_model_path()
    offline = score_offline(args.model, args.out, args.limit) if "lm_eval" in tools else {}
    proc, base = start_server(args.model, os.path.join(args.out, "serve.log"))
    rows = []
    try:
        name = get_json(base + "/v1/models")["data"][0]["id"]
        count = args.requests
        if "lm_eval" in tools:
            rows += run_lm_eval(venv, base, name, tokdir, args.out, args.limit, offline)
        if "guidellm" in tools:
            rows += run_guidellm(venv, base, name, tokdir, args.out, count)
        if "vllm" in tools:
            rows += run_vllm(venv, base, name, tokdir, args.out, count)
        if "openai" in tools:
            rows += run_openai(venv, base, name, args.out)
    finally:
        rc = stop_server(proc)
    rows.append(("serve.py SIGTERM", f"exit code {rc}", rc == 0))
    print_table(rows)
    with open(os.path.join(args.out, "clients.json"), "w") as f:
        json.dump([{"tool": t, "result": r, "ok": ok} for t, r, ok in rows], f, indent=1)
    return 0 if all(ok for *_, ok in rows) else 1


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Run lm-eval, guidellm, vLLM's benchmark shapes and the openai "
                                             "client against serve.py, and compare with offline scoring.")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    ap.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer directory for the clients")
    ap.add_argument("--venv", default=os.environ.get("NANOINFER_CLIENTS_VENV", os.path.expanduser("~/.venvs/clients")))
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(TOOLS)}")
    ap.add_argument("--limit", type=int, default=None, help="lm-eval documents per task (default: all)")
    ap.add_argument("--requests", type=int, default=8, help="requests per guidellm / vLLM run")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "nanoinfer-clients"),
                    help="logs, the tools' own outputs, offline.json and clients.json")
    ap.add_argument("--replay-vllm", choices=["openai", "openai-chat"], help=argparse.SUPPRESS)
    ap.add_argument("--check-openai", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--served-name", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check_openai:             # the child run_openai starts inside the clients' venv
        with open(args.out, "w") as f:
            json.dump(openai_checks(args.url, args.served_name), f, indent=1)
        return 0
    if args.replay_vllm:              # the child run_vllm starts inside the clients' venv
        res = replay_vllm(args.url, args.served_name, args.tokenizer, args.replay_vllm, args.limit or 8,
                          concurrency=4)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return 0
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
