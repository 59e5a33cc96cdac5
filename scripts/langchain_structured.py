"""
scripts/langchain_structured.py -- LangChain's structured-output helpers against serve.py, by hand.

What it protects: "structured outputs work" meaning what LangChain's `with_structured_output` sends
and parses, not what our tests happen to send. It serves the default model in this process, runs
`ChatOpenAI(...).with_structured_output(Movie, method=M, include_raw=True).invoke(...)` for
M = json_schema and json_mode, then `.stream(...)` with json_schema, prints what LangChain parsed
and writes every request it sent (an httpx event hook) to the fixture that tests/test_serve.py
replays: tests/fixtures/clients/langchain_structured.json.

    python -m venv --system-site-packages ~/.venvs/langchain
    ~/.venvs/langchain/bin/pip install langchain-openai==1.7.4
    ~/.venvs/langchain/bin/python scripts/langchain_structured.py [OUT.json]
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Literal

import httpx
import langchain_core
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import LLM  # noqa: E402
from serve import make_server  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "clients", "langchain_structured.json")


class Movie(BaseModel):
    """A movie recommendation."""
    title: str = Field(max_length=40)
    year: int = Field(ge=1900, le=2030)
    genre: Literal["drama", "comedy", "horror", "documentary"]


def main(out: str = OUT) -> None:
    srv = make_server(LLM(kv_cache_bytes=256 << 20), "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    base = "http://%s:%d/v1" % srv.server_address[:2]
    name = httpx.get(base + "/models").json()["data"][0]["id"]
    log = []

    def record(request):
        log.append({"method": request.method, "path": request.url.path,
                    "headers": {k: v for k, v in request.headers.items() if k in ("accept", "content-type", "user-agent")},
                    "body": json.loads(request.content) if request.content else None})

    chat = ChatOpenAI(model=name, base_url=base, api_key="none", temperature=0, max_tokens=120,
                      http_client=httpx.Client(event_hooks={"request": [record]}))
    results = {}
    for method in ("json_schema", "json_mode"):
        try:
            got = chat.with_structured_output(Movie, method=method, include_raw=True).invoke(
                "Recommend a movie. Answer in JSON with title, year and genre.")
            results[method] = {"parsed": got["parsed"] and got["parsed"].model_dump(), "raw": got["raw"].content,
                               "parsing_error": got["parsing_error"] and repr(got["parsing_error"])}
        except Exception as e:                   # e.g. the openai client's LengthFinishReasonError
            results[method] = {"exception": repr(e)[:300]}
    chunks = list(chat.with_structured_output(Movie, method="json_schema").stream("Recommend a comedy."))
    results["json_schema_stream"] = {"chunks": len(chunks), "last": chunks[-1].model_dump() if chunks else None}
    print(json.dumps(results, indent=1))
    for r in log:
        if isinstance(r["body"], dict) and "model" in r["body"]:
            r["body"]["model"] = "SmolLM2-135M-Instruct"
    fixture = {"tool": f"langchain-openai 1.7.4 (langchain-core {langchain_core.__version__}, openai 3.51.0)",
               "command": "python scripts/langchain_structured.py",
               "recorded": f"{time.strftime('%Y-%m-%d')}, against python serve.py with the default model "
                           "(SmolLM2-135M-Instruct)",
               "note": "json_schema sends response_format json_schema, strict, the pydantic schema made strict "
                       "(additionalProperties false); json_mode sends response_format json_object. What LangChain "
                       "got back: " + json.dumps(results),
               "requests": log}
    with open(out, "w") as f:
        json.dump(fixture, f, indent=1)
    srv.shutdown()
    srv.server_close()
    srv.engine.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
