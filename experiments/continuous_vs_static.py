"""
continuous-vs-static -- continuous batching keeps every seat busy.

Claim (lecture): requests want different lengths; static batching runs a group to completion,
so its seats idle while the longest member finishes, and a new request waits for the whole
group. Continuous batching refills a seat at the very next step. Same engine, same number of
seats, same requests (log-uniform prompt and output lengths, all arriving at t = 0): the
baseline is the static run, measured right before the continuous one.
"""
from __future__ import annotations

import statistics
import time

from sampler import SamplingParams

from experiments.common import HETEROGENEOUS, model_config, seats, table, workload
from experiments.plan import Phase, decode, prefill

NAME = "continuous-vs-static"
WORKLOAD = {"cpu": dict(seats=16, engine={}), "cpu-quick": dict(seats=4, engine={}),
            "gpu": dict(seats=16, engine={}), "gpu-quick": dict(seats=16, engine={})}
# the requests: common.HETEROGENEOUS (64 of 16-256 tokens; the smoke run 8 of 4-32), shared with peer and serving


STEP_KINDS = ("graph_steps", "compiled_steps", "eager_steps")    # how each forward ran (engine.py)


def latency_stats(outs, t0, total_s, stats_before=None, stats_after=None):
    """Throughput and the two latencies a user feels: time to first token (queueing + prefill,
    from t0, when every request arrived) and time per output token after the first; with the
    engine's stats before and after, how many steps replayed a CUDA graph, ran the compiled
    blocks, or ran the eager model."""
    ttft = sorted(o.metrics.first_token_time - t0 for o in outs)
    tpot = [(o.metrics.finish_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
            for o in outs if len(o.token_ids) > 1]
    tokens = sum(len(o.token_ids) for o in outs)
    steps = {k: stats_after[k] - stats_before[k] for k in STEP_KINDS} if stats_before else {}
    return {"requests": len(outs), "output_tokens": tokens, "tokens_per_s": tokens / total_s,
            "ttft_mean_s": statistics.mean(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
            "tpot_mean_ms": statistics.mean(tpot) * 1e3, "seconds": total_s, **steps}


def run(b):
    w = b.sizes(WORKLOAD)
    llm, B = b.llm(**w.engine), w.seats
    prompts, lengths = workload(b, llm.config.vocab_size)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    with seats(llm, B):
        llm.generate([prompts[0]], params[0])                                   # warm-up
        # The only difference between the runs: when a seat may be refilled, at the end of
        # the group (static) or at the very next step (continuous).
        b.progress("continuous-vs-static: static groups")
        t0, outs, before = time.perf_counter(), [], dict(llm.stats)
        for i in range(0, len(prompts), B):                                     # a group runs to completion
            outs += llm.generate(prompts[i:i + B], params[i:i + B])
        static = latency_stats(outs, t0, time.perf_counter() - t0, before, llm.stats)
        b.progress("continuous-vs-static: continuous")
        t0, before = time.perf_counter(), dict(llm.stats)
        cont = latency_stats(llm.generate(prompts, params), t0, time.perf_counter() - t0, before, llm.stats)
    fig = {"requests": len(prompts), "batch": B, "static": static, "continuous": cont,
           "throughput_speedup": cont["tokens_per_s"] / static["tokens_per_s"]}
    rows = [[name, r["tokens_per_s"], r["ttft_mean_s"], r["ttft_p90_s"], r["tpot_mean_ms"]]
            for name, r in (("static", static), ("continuous", cont))]
    h = b.sizes(HETEROGENEOUS)
    text = (f"{len(prompts)} requests, prompt and output lengths log-uniform in [{h.lo}, {h.hi}], "
            f"all arriving at t=0, batch {B}.\n\n" +
            table(["batching", "output tokens/s", "mean TTFT (s)", "p90 TTFT (s)", "mean TPOT (ms)"], rows) +
            f"\n\nContinuous batching: {fig['throughput_speedup']:.2f}x the throughput of static batching." +
            "".join(f"\n{name}: {r['graph_steps']} steps replayed a CUDA graph, {r['compiled_steps']} ran the "
                    f"compiled blocks, {r['eager_steps']} the eager model." for name, r in (("static", static),
                                                                                         ("continuous", cont))))
    return fig, text


def static_and_continuous_steps(lengths, B) -> tuple[int, int]:
    """Decode steps of the two runs: a static group lasts its longest member; continuous batching
    steps until every token is out, B at a time (at least the longest request)."""
    static = sum(max(lengths[i:i + B]) for i in range(0, len(lengths), B))
    return static, max(max(lengths), -(-sum(lengths) // B))


def plan(s):
    w = s.sizes(WORKLOAD)
    o = s.options(**w.engine)
    prompts, lengths = workload(s, model_config(o["path"])[0].vocab_size)
    static, cont = static_and_continuous_steps(lengths, w.seats)
    longest = max(map(len, prompts)) + max(lengths)
    return [Phase([o], [prefill(o, 2 * sum(map(len, prompts)), longest / 2),
                        decode(o, static + cont, w.seats, longest / 2)], context=longest)]
