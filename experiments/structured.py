"""
structured -- structured outputs cost the constrained requests a mask a step, the others nothing.

Claim (vLLM and SGLang constrain decoding to a JSON schema with a grammar library; sampler.py
applies it): a grammar becomes, each step, a bitmask of the tokens that keep the output valid,
and every other logit goes to -inf. The mask is the host's work (llguidance, support/
structured.py; ~10-50 us a request at a 49k vocabulary), done while the device runs the step's
forward, so a batch in which half the requests follow a JSON schema runs at nearly the tokens/s
of the same batch unconstrained, the unconstrained half's tokens unchanged, and every
constrained output that finishes parses as its schema's JSON. Baseline, in the same run and
alternated with it: the same prompts unconstrained, each constrained request's twin asked for
exactly the tokens the constrained one produced (ignore_eos), so both runs have the same schedule:
same batch, same steps; only the grammar differs.
"""
from __future__ import annotations

import json
import statistics
import time

from sampler import SamplingParams
from support import structured

from experiments.common import table, trained
from experiments.plan import Phase, decode, prefill

NAME = "structured"
WORKLOAD = {"cpu": dict(requests=8, max_tokens=64, repeats=3, engine={}),
            "cpu-quick": dict(requests=4, max_tokens=24, repeats=1, engine={}),
            "gpu": dict(requests=16, max_tokens=48, repeats=2, engine={}),
            "gpu-quick": dict(requests=8, max_tokens=48, repeats=1, engine={})}
PROMPT_TOKENS = 48          # about what the chat template and a question take (the plan's figure)
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 40},
                         "role": {"enum": ["engineer", "teacher", "doctor", "artist", "other"]},
                         "skills": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                    "maxItems": 5}},
          "required": ["name", "age", "city", "role", "skills"], "additionalProperties": False}
ASKS = ["Describe a fictional person.", "Tell me about a doctor you know.", "Invent a character.",
        "Who is a famous artist?", "Describe your neighbour.", "Describe an engineer."]


def valid(text: str) -> bool:
    """The output parses, has every required field, and its enum and bounds hold (the grammar
    guarantees this; here it is checked, not assumed)."""
    try:
        x = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (set(x) == set(SCHEMA["required"]) and x["role"] in SCHEMA["properties"]["role"]["enum"]
            and isinstance(x["age"], int) and 0 <= x["age"] <= 120 and len(x["skills"]) <= 5)


class MaskClock:
    """Seconds spent computing grammar bitmasks (support/structured.Grammar.bitmask), while on."""

    def __enter__(self):
        self.seconds, original = 0.0, structured.Grammar.bitmask

        def timed(grammar, V):
            t0 = time.perf_counter()
            try:
                return original(grammar, V)
            finally:
                self.seconds += time.perf_counter() - t0
        self.original, structured.Grammar.bitmask = original, timed
        return self

    def __exit__(self, *exc):
        structured.Grammar.bitmask = self.original


def run(b):
    if structured.llguidance is None:          # e.g. a GPU machine set up without requirements.txt
        return {"skipped": structured.MISSING}, f"Skipped: {structured.MISSING}."
    w = b.sizes(WORKLOAD)
    llm = b.llm(**w.engine)      # the run's timing model: the grammar's cost beside ITS step
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": ASKS[i % len(ASKS)] + " Answer in JSON."}])
               for i in range(w.requests)]
    free = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True)          # greedy
    constrained = [SamplingParams(max_tokens=w.max_tokens, structured_outputs={"json": SCHEMA})
                   if i % 2 == 0 else free for i in range(w.requests)]
    times = {"constrained": [], "free": []}
    for r in range(w.repeats + 1):                 # the first round is the warm-up (and fixes the twins)
        b.progress(f"structured: round {r + 1} of {w.repeats + 1}")
        steps0 = llm.stats["steps"]
        with MaskClock() as clock:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, constrained)
            t_c = time.perf_counter() - t0
        steps = llm.stats["steps"] - steps0
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        twins = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]   # same tokens, no grammar
        t0 = time.perf_counter()
        base = llm.generate(prompts, twins)
        t_f = time.perf_counter() - t0
        if r:
            times["constrained"].append(t_c)
            times["free"].append(t_f)
    tokens = sum(lengths)
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    mine = [o.outputs[0] for o in outs[0::2]]
    fig = {"model": llm.path, "trained": trained(llm.path), "requests": w.requests,
           "constrained_requests": len(mine), "tokens": tokens, "steps": steps,
           "tokens_per_s_constrained": tps["constrained"], "tokens_per_s_free": tps["free"],
           "ratio": tps["constrained"] / tps["free"],
           "mask_ms_per_step": clock.seconds / steps * 1e3,
           "stopped": sum(c.finish_reason == "stop" for c in mine),
           "valid": sum(c.finish_reason == "stop" and valid(c.text) for c in mine),
           "unchanged": [o.token_ids for o in outs[1::2]] == [o.token_ids for o in base[1::2]],
           "same_lengths": [len(o.outputs[0].token_ids) for o in base] == lengths,
           "example": mine[0].text}
    return fig, text(fig)


def text(r: dict) -> str:
    note = "" if r["trained"] else " (random weights: the JSON is valid, its content noise)"
    rows = [["half follow a JSON schema", r["tokens_per_s_constrained"]], ["none (baseline)", r["tokens_per_s_free"]]]
    return (f"{r['requests']} greedy chat requests, half under a JSON schema (required fields, an enum, bounded "
            f"numbers, strings and an array), {r['tokens']} output tokens in {r['steps']} steps each run{note}.\n\n" +
            table(["constrained requests", "tokens/s"], rows) +
            f"\n\nWith the grammar: {r['ratio']:.2f}x the baseline's tokens/s; grammar masks "
            f"{r['mask_ms_per_step']:.2f} ms of host time a step; {r['valid']} of {r['stopped']} finished outputs "
            f"valid ({r['constrained_requests'] - r['stopped']} cut at max_tokens); the unconstrained half's tokens "
            f"{'unchanged' if r['unchanged'] else 'CHANGED'}. Example: {r['example'][:120]}")


def plan(s):
    w = s.sizes(WORKLOAD)
    o = s.options(**w.engine)
    runs = 2 * (w.repeats + 1)
    return [Phase([o], [prefill(o, runs * w.requests * PROMPT_TOKENS, PROMPT_TOKENS),
                        decode(o, runs * w.max_tokens, w.requests, PROMPT_TOKENS + w.max_tokens)],
                  context=PROMPT_TOKENS + w.max_tokens)]
