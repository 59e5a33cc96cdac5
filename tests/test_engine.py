"""Tests of engine.py -- the engine assembled (LLM, EngineConfig).

engine.py holds no assignment of its own: it is the last lesson, which puts the
others together, and these tests grade the assignments it runs through (their
markers say which). What they hold LLM to:
  * a request that goes wrong fails ALONE (finish_reason "error" and its
    message), beside healthy requests whose tokens stay those of a run without
    it; a step that fails as a whole fails its requests, never the engine;
    nothing leaks a KV block;
  * abort, n > 1 by forking (shared prompt blocks), logprobs, and prompt
    logprobs equal to ONE dense forward pass over the prompt, chunked,
    preempted or speculative;
  * every option declared once (EngineConfig): LLM(**options) == LLM(config),
    a bad option refused with a message naming it;
  * the tour's rule: an engine step never enters support/, and support/
    imports nothing of the tour.
The scheduler itself (which sequences run, how many tokens each) is
tests/test_scheduler.py's.
"""
import pytest
import torch

from engine import LLM
from helpers import assert_dense_prompt_logprobs, assert_no_leak
from model import generate as dense_generate
from sampler import SampleRequest, SamplingParams, sample_key, sample_tokens
from sequence import PENDING


@pytest.fixture
def tiny_llm(tiny_path):
    return LLM(tiny_path, kv_cache_bytes=4 << 20)


# ------------------------------------------------------------- fault isolation

HEALTHY = ["healthy one", "healthy two two", "healthy three three three"]


def healthy_alone(path):
    llm = LLM(path, kv_cache_bytes=4 << 20)
    return [o.token_ids for o in llm.generate(HEALTHY, SamplingParams(max_tokens=12, ignore_eos=True))]


def run_beside(llm, bad_prompt, bad_params, steps_before=2):
    """Three healthy greedy requests start; the bad one joins while they run."""
    good = [llm.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in HEALTHY]
    done = {}
    for _ in range(steps_before):
        done.update({o.request_id: o for o in llm.step() if o.finished})
    bad = llm.add_request(bad_prompt, bad_params)
    while llm.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    return [done[r] for r in good], done[bad]


@pytest.mark.parametrize("bad", [dict(n=2, seed=2**64 - 1, temperature=1.0), dict(top_k=10**24, temperature=1.0),
                                 dict(seed=-2**63, temperature=1e-30), dict(temperature=1e6, top_p=1e-9),
                                 dict(stop=["z" * 1024] * 16, max_tokens=5),
                                 dict(temperature=1.0, top_p=1e-300), dict(temperature=1.0, top_p=5e-324, top_k=1)])
@pytest.mark.needs("engine", "sampler", "copy-on-write", "stop-strings")
def test_extreme_but_valid_params_run_beside_healthy_requests(tiny_path, bad):
    ref = healthy_alone(tiny_path)
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    good, out = run_beside(llm, "x", SamplingParams(**{"max_tokens": 3, **bad}))
    assert [o.token_ids for o in good] == ref, "a healthy request changed because of another"
    assert out.finish_reason == "length" and all(len(c.token_ids) == out.outputs[0].token_ids.__len__()
                                                 for c in out.outputs)
    assert_no_leak(llm)


@pytest.mark.needs("engine", "copy-on-write")
def test_n_beyond_the_batch_is_refused_at_once(tiny_path):
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"n=3.*max_num_seqs=2"):
        llm.generate(["Hi"], SamplingParams(n=3, temperature=1.0))
    assert_no_leak(llm)
    assert len(llm.generate(["Hi"], SamplingParams(n=2, temperature=1.0, max_tokens=3))[0].outputs) == 2


@pytest.mark.needs("engine")
def test_a_request_whose_text_fails_finishes_alone(tiny_path, monkeypatch):
    ref = healthy_alone(tiny_path)
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    from tokenizer import IncrementalDecoder
    push = IncrementalDecoder.push

    def broken(self, token):             # only the bad request's detokenizer breaks
        if self.tok is llm.tokenizer and getattr(self, "poisoned", False):
            raise UnicodeError("cannot decode this token")
        return push(self, token)
    monkeypatch.setattr(IncrementalDecoder, "push", broken)
    orig_add = llm.add_request

    def add(prompt, params=None, request_id=None):
        rid = orig_add(prompt, params, request_id)
        if prompt == "poison":
            llm.requests[rid].seqs[0].decoder.poisoned = True
        return rid
    llm.add_request = add
    good, out = run_beside(llm, "poison", SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in good] == ref
    assert out.finish_reason == "error" and "cannot decode" in out.error
    assert_no_leak(llm)


@pytest.mark.needs("engine")
def test_non_finite_logits_fail_only_their_request(tiny_path):
    ref = healthy_alone(tiny_path)
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    bad_seen = []

    def poison(module, inputs, output):  # NaN in the rows of the request that joined last
        if len(llm.requests) == 4 and not bad_seen:
            bad_seen.append(True)
            output[-1] = float("nan")
        return output
    h = llm.model.lm_head.register_forward_hook(poison)
    try:
        good, out = run_beside(llm, "gets NaN", SamplingParams(max_tokens=8, ignore_eos=True))
    finally:
        h.remove()
    assert bad_seen and out.finish_reason == "error" and "non-finite" in out.error
    assert [o.token_ids for o in good] == ref
    assert_no_leak(llm)


@pytest.mark.needs("engine", "sampler")
def test_a_sampler_error_fails_only_the_request_that_caused_it(tiny_path, monkeypatch):
    """The batched draw raises because of one request's parameters (here a
    filter that cannot take top_k=7): the step samples each request alone,
    fails only that one, and the others get the tokens they get alone."""
    import sampler
    ref = healthy_alone(tiny_path)
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    real = sampler.filtered_probs

    def picky(logits, temperature, top_k, top_p, min_p=None):
        if 7 in top_k:
            raise RuntimeError("this filter cannot take top_k=7")
        return real(logits, temperature, top_k, top_p, min_p)
    monkeypatch.setattr(sampler, "filtered_probs", picky)
    good, out = run_beside(llm, "x", SamplingParams(max_tokens=3, temperature=1.0, top_k=7))
    assert [o.token_ids for o in good] == ref, "a healthy request changed because of another's sampling error"
    assert out.finish_reason == "error" and "top_k=7" in out.error, out.error
    assert_no_leak(llm)


@pytest.mark.needs("engine")
def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(tiny_path, monkeypatch):
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    calls = {"n": 0}
    forward = llm.model.forward

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return forward(*a, **kw)
    monkeypatch.setattr(llm.model, "forward", flaky)
    outs = llm.generate(HEALTHY, SamplingParams(max_tokens=12, ignore_eos=True))
    assert all(o.finish_reason == "error" and "device fell over" in o.error for o in outs)
    assert_no_leak(llm)
    assert [o.token_ids for o in llm.generate(HEALTHY, SamplingParams(max_tokens=12, ignore_eos=True))] == \
        healthy_alone(tiny_path), "the engine must serve normally afterwards"


@pytest.mark.needs("engine")
def test_a_scheduler_that_keeps_failing_fails_requests_instead_of_spinning(tiny_path, monkeypatch):
    """If Scheduler.schedule itself raises (a bug, or a student's unfinished scheduler), nothing
    runs and no batch exists: each step fails the oldest waiting request, so generate ends
    with errors instead of looping forever; the engine then serves normally again."""
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    schedule = llm.scheduler.schedule

    def broken():
        raise RuntimeError("scheduler fell over")
    monkeypatch.setattr(llm.scheduler, "schedule", broken)
    outs = llm.generate(HEALTHY, SamplingParams(max_tokens=4))
    assert all(o.finish_reason == "error" and "scheduler fell over" in o.error for o in outs)
    assert_no_leak(llm)
    monkeypatch.setattr(llm.scheduler, "schedule", schedule)
    assert [o.token_ids for o in llm.generate(HEALTHY, SamplingParams(max_tokens=12, ignore_eos=True))] == \
        healthy_alone(tiny_path)


@pytest.mark.needs("engine")
def test_interrupted_generate_leaves_nothing_running(tiny_path, monkeypatch):
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    step, calls = llm.step, {"n": 0}

    def interrupted():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return step()
    monkeypatch.setattr(llm, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["long " * 20] * 4, SamplingParams(max_tokens=500, ignore_eos=True))
    assert_no_leak(llm)


@pytest.mark.assignment("sampler")
@pytest.mark.needs("engine", "copy-on-write")
def test_parallel_samples_share_prompt_blocks(tiny_llm):
    prompt = "a shared prompt " * 20                       # 80+ tokens: 5+ blocks
    params = SamplingParams(max_tokens=8, temperature=1.0, n=4, seed=0, ignore_eos=True)
    llm = tiny_llm
    rid = llm.add_request(prompt, params)
    used = 0
    while llm.has_unfinished_requests():
        llm.step()
        used = max(used, llm.block_manager.num_blocks - llm.block_manager.num_free_blocks)
    L = len(llm.tokenizer.encode(prompt))
    shared, own = L // 16, -(-(L + 8) // 16) - L // 16    # full prompt blocks; blocks each sample writes
    assert used == shared + 4 * own, f"4 samples used {used} blocks; sharing needs {shared + 4 * own}, " \
                                     f"4 separate requests {4 * (shared + own)}"
    out = llm.generate([prompt], params)[0]
    assert len(out.outputs) == 4 and len({tuple(c.token_ids) for c in out.outputs}) == 4, "n distinct samples"
    # Each sample is what the dense path (no cache, nothing shared) samples with
    # that sample's noise: a copy-on-write that lets one sample write into a
    # block another still reads changes the tokens of the other.
    ids = llm.tokenizer.encode(prompt)
    for c in out.outputs:
        assert c.token_ids == dense_sampled(llm.model, ids, params, sample_key(0, c.index), 8), \
            f"sample {c.index} differs from the dense path with the same noise"
    assert rid not in llm.requests, "a finished request is removed from the engine's requests"
    assert_no_leak(llm)


def dense_sampled(model, ids, params, key, n):
    """n tokens sampled on the dense path (no KV cache) with the noise of one
    sample stream: the engine's output for that sample must equal it."""
    out = []
    for position in range(n):
        logits = model(torch.tensor(ids + out), torch.arange(len(ids) + len(out)))[-1:]
        tokens, _, _ = sample_tokens(logits, [SampleRequest(0, [], params, key, position)])[0]
        out.append(int(tokens[0]))
    return out


@pytest.mark.needs("engine")
def test_abort_frees_blocks_at_once(tiny_llm):
    llm = tiny_llm
    keep = llm.add_request("keep going " * 10, SamplingParams(max_tokens=20, ignore_eos=True))
    gone = llm.add_request("abort me " * 30, SamplingParams(max_tokens=50, ignore_eos=True))
    llm.step(), llm.step()
    before = llm.block_manager.num_free_blocks
    llm.abort(gone)
    assert llm.block_manager.num_free_blocks > before, "abort must free the blocks immediately"
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            finished[out.request_id] = out
    assert finished[keep].finish_reason == "length" and gone not in finished
    assert_no_leak(llm)


@pytest.mark.needs("engine")
def test_bad_request_fails_alone(tiny_llm):
    llm = tiny_llm
    good = [llm.add_request(f"request {i}", SamplingParams(max_tokens=5, ignore_eos=True)) for i in range(3)]
    llm.step()
    for bad in ["", "x " * 5000, [1, 2, 10**9]]:
        with pytest.raises(ValueError):
            llm.add_request(bad)
    with pytest.raises(ValueError, match=r"U\+0004.*no token"):     # encoding would drop it silently
        llm.add_request("abc\x04def")
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    assert sorted(done) == sorted(good) and all(len(done[r].token_ids) == 5 for r in good)
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=3))
    assert_no_leak(llm)


@pytest.mark.needs("engine")
def test_prompt_longer_than_pool(tiny_path):
    llm = LLM(tiny_path, kv_cache_bytes=4 * 16 * 2 * 2 * 2 * 16 * 4)     # 4 blocks = 64 tokens
    with pytest.raises(ValueError, match="KV cache pool"):
        llm.add_request(list(range(100)))
    out = llm.generate([list(range(60))], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4, "stops when the pool is full"


@pytest.mark.needs("engine")
def test_logprobs(tiny_llm):
    out = tiny_llm.generate(["logprobs"], SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 4
    for tok, (lp, alts) in zip(out.token_ids, lps):
        assert lp <= 0 and len(alts) == 3
        assert max(alts.values()) == pytest.approx(lp, abs=1e-5), "greedy picks the most likely token"


# ------------------------------------------------------------- prompt logprobs
# The reference is ONE dense forward pass over the whole prompt (no cache, no
# chunks, no batch-mates): log_softmax of its float32 logits. Row p scores prompt
# token p + 1; entry 0 has nothing to condition on. Tolerance: 1e-5 plus one part in
# a million of the row's log-normalizer. log_softmax = x - logsumexp(x), the tiny
# model's logits reach 20 (a float32 ulp there: 1.9e-6), and paged attention sums in
# another order than the dense path: seen up to 1.24e-5 apart, so a flat 1e-5 fails.
PL_PROMPTS = [list(range(10, 30)), list(range(40, 61)), [7], [(5 * j) % 400 + 3 for j in range(13)]]


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 7},
                                    {"kv_cache_bytes": 8 * 4 * 512, "block_size": 4, "max_num_batched_tokens": 8},
                                    {"speculative": "ngram", "num_speculative_tokens": 3}],
                         ids=["one-pass", "chunked", "preempted", "speculative"])
@pytest.mark.needs("engine")
def test_prompt_logprobs_equal_a_dense_forward_pass(tiny_path, engine):
    """Chunked prefill, preemption (recompute: entries are stored per position, so
    none is duplicated or skipped) and speculative decoding change no value."""
    llm = LLM(tiny_path, **{"kv_cache_bytes": 4 << 20, **engine})
    outs = llm.generate(PL_PROMPTS, SamplingParams(max_tokens=6, prompt_logprobs=3, ignore_eos=True))
    if "block_size" in engine:      # 8 blocks of 4 tokens for 4 prompts of up to 21 + 6 tokens
        assert sum(o.metrics.preemptions for o in outs) >= 1, "the pool was meant to force preemption"
    for p, o in zip(PL_PROMPTS, outs):
        assert_dense_prompt_logprobs(llm.model, p, o.prompt_logprobs, 3)
        assert o.token_ids == dense_generate(llm.model, p, 6), "scoring the prompt changes no token"
    assert_no_leak(llm)


@pytest.mark.needs("engine", "copy-on-write")
def test_prompt_logprobs_belong_to_the_request_of_n_samples(tiny_path):
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    prompt = list(range(200, 240))
    params = dict(max_tokens=4, temperature=1.0, seed=3, n=2, ignore_eos=True)
    out = llm.generate([prompt], SamplingParams(prompt_logprobs=2, **params))[0]
    assert_dense_prompt_logprobs(llm.model, prompt, out.prompt_logprobs, 2)
    alone = llm.generate([prompt], SamplingParams(**params))[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs], "scoring changes no sample"
    assert len({tuple(c.token_ids) for c in out.outputs}) == 2
    assert_no_leak(llm)


@pytest.mark.needs("engine", "copy-on-write")
def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(tiny_path):
    """Score only (lm-eval's loglikelihood): the request finishes ("length") in
    the step of its last prompt chunk, samples nothing and frees its blocks."""
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20, max_num_batched_tokens=16)
    prompts = [list(range(300, 340)), [9]]                           # 40 tokens: chunks of 16, 16 and 8
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert llm.stats["steps"] == 3, "finished right after the last prompt chunk"
    for p, o in zip(prompts, outs):
        assert o.finished and o.finish_reason == "length" and o.token_ids == [] and o.text == ""
        assert o.metrics.output_tokens == 0 and o.metrics.first_token_time is None
        assert_dense_prompt_logprobs(llm.model, p, o.prompt_logprobs, 0)
    assert_no_leak(llm)
    two = llm.generate([prompts[0]], SamplingParams(max_tokens=0, prompt_logprobs=1, n=2))[0]
    assert [(c.token_ids, c.finish_reason) for c in two.outputs] == [([], "length")] * 2
    assert_dense_prompt_logprobs(llm.model, prompts[0], two.prompt_logprobs, 1)
    assert_no_leak(llm)


@pytest.mark.needs("engine")
def test_a_plain_request_beside_a_scored_one_is_unchanged_and_pays_nothing(tiny_path, monkeypatch):
    """A plain request's step computes the LM head for its one sampled row and
    waits for the device once; a scored prompt beside it adds only its own rows,
    and their logprobs come back with that same one wait (a step of prompt
    chunks only: one wait too)."""
    import sampler
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20, max_num_batched_tokens=12)
    rows, waits, forward, wait = [], [], llm._forward, sampler.Fetch.wait     # per step: logits rows, waits
    monkeypatch.setattr(llm, "_forward", lambda batch, r: rows.append(len(r)) or waits.append(0) or forward(batch, r))
    monkeypatch.setattr(sampler.Fetch, "wait", lambda self: waits.__setitem__(-1, waits[-1] + 1) or wait(self))
    plain, scored = list(range(50, 80)), list(range(400, 425))               # 30 and 25 tokens
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    alone = llm.generate([plain], greedy)[0]
    assert rows == waits == [0, 0, 1, 1, 1, 1, 1], "chunks of 12, 12 and 6 tokens, then 4 decodes"
    rows[:], waits[:] = [], []
    both = llm.generate([plain, scored], [greedy, SamplingParams(max_tokens=5, prompt_logprobs=2, ignore_eos=True)])
    assert both[0].token_ids == alone.token_ids and both[0].prompt_logprobs is None
    assert_dense_prompt_logprobs(llm.model, scored, both[1].prompt_logprobs, 2)
    assert sum(rows) == 5 + 5 + len(scored) - 1, "the sampled rows + one row per scored prompt token"
    assert waits == [int(r > 0) for r in rows], "one wait in every step that needs logits, none otherwise"
    assert_no_leak(llm)


# ---- paths the rest of this file does not reach

@pytest.mark.needs("engine")
def test_bad_engine_arguments_fail_with_a_message_naming_them(tiny_path):
    """Every argument LLM and generate check fails at once with an error that
    names it, and leaves the engine as it was; a single string prompt and a
    single stop string are accepted as one-element lists."""
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        LLM(tiny_path, kv_cache_bytes=1 << 20, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer"):
        LLM(tiny_path, kv_cache_bytes=1 << 20, max_num_batched_tokens=True)
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        LLM(tiny_path, kv_cache_bytes=1 << 20, dtype="float8")
    with pytest.raises(ValueError, match="compile=True with tensor_parallel_size"):
        LLM(tiny_path, kv_cache_bytes=1 << 20, compile=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="llm.int8.*use compile=False"):
        LLM(tiny_path, kv_cache_bytes=1 << 20, compile=True, quantization="llm.int8")
    with pytest.raises(ValueError, match="kv_cache_bytes=100 is too small"):
        LLM(tiny_path, kv_cache_bytes=100)
    with pytest.raises(ValueError, match="kv_cache_dtype must be None"):
        LLM(tiny_path, kv_cache_bytes=1 << 20, kv_cache_dtype="int4")
    llm = LLM(tiny_path, kv_cache_bytes=1 << 20)
    with pytest.raises(TypeError, match="a prompt is a string or a list of token ids"):
        llm.add_request({"text": "hi"})
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        llm.add_request("hi", {"max_tokens": 3})
    llm.add_request("hi", SamplingParams(max_tokens=1), request_id="same")
    with pytest.raises(ValueError, match="request id 'same' is already in use"):
        llm.add_request("hello", SamplingParams(max_tokens=1), request_id="same")
    llm.abort("same")
    with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams()] * 3)
    assert not llm.has_unfinished_requests() and llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    one = llm.generate("the one prompt", SamplingParams(max_tokens=4, ignore_eos=True, stop="never there"))
    assert len(one) == 1 and one[0].token_ids == dense_generate(llm.model, llm.tokenizer.encode("the one prompt"), 4)
    assert SamplingParams(stop="x").stop == ["x"]
    assert_no_leak(llm)


@pytest.mark.needs("engine")
def test_engine_options_are_one_config(tiny_path):
    """LLM(EngineConfig(...)) and LLM(**options) build the same engine (options given beside a
    config override it); EngineConfig refuses a value outside a field's range, naming it;
    and the engine has one way in, engine.py."""
    import dataclasses

    import scheduler
    from engine import EngineConfig
    a = LLM(EngineConfig(path=tiny_path, kv_cache_bytes=1 << 20, block_size=8, max_num_seqs=3))
    b = LLM(tiny_path, kv_cache_bytes=1 << 20, block_size=8, max_num_seqs=3)
    c = LLM(EngineConfig(path=tiny_path, kv_cache_bytes=1 << 20), block_size=8, max_num_seqs=3)
    assert a.engine_config == b.engine_config == c.engine_config
    assert (a.block_manager.block_size, a.scheduler.max_num_seqs) == (8, 3)
    assert a.block_manager.num_blocks == b.block_manager.num_blocks
    for name, bad in (("block_size", 0), ("num_speculative_tokens", 17), ("quantization", "int3"),
                      ("enable_prefix_caching", "yes"), ("kv_cache_bytes", 1.5)):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: bad})
    with pytest.raises(TypeError):
        LLM(tiny_path, kv_cache_byte=1 << 20)             # a misspelled option is no option
    assert all(f.metadata.get("help") for f in dataclasses.fields(EngineConfig))
    assert not hasattr(scheduler, "LLM"), "one way in: the engine is engine.py's (scheduler.py imports no engine)"


@pytest.mark.needs("engine")
def test_a_request_that_can_never_be_scheduled_fails_instead_of_spinning(tiny_path):
    """If nothing runs and the oldest waiting request still cannot be
    scheduled (here: every block is held outside the scheduler), the step
    fails that request with a message saying so rather than looping forever;
    once the blocks are back the engine serves exactly again."""
    llm = LLM(tiny_path, kv_cache_bytes=1 << 20, block_size=4)
    bm = llm.block_manager
    bm.allocate(-1, [1])
    bm.reserve(-1, 0, bm.num_blocks * 4)                     # a phantom owner of the whole pool
    out = llm.generate(["stranded"], SamplingParams(max_tokens=3))[0]
    assert out.finish_reason == "error" and "cannot be scheduled even in an empty engine" in out.error, out.error
    bm.free(-1)
    prompt = llm.tokenizer.encode("stranded")
    assert llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids == \
        dense_generate(llm.model, prompt, 3)
    assert_no_leak(llm)


@pytest.mark.needs("engine")
def test_a_lost_tensor_parallel_worker_fails_the_step_and_is_raised(tiny_path, monkeypatch):
    """A TensorParallelError (a worker died: nothing can run any more) fails
    the step's requests like any step error, frees their blocks, and is
    raised to the caller instead of being swallowed."""
    from parallel import TensorParallelError
    llm = LLM(tiny_path, kv_cache_bytes=1 << 20)

    def dead(*a, **kw):
        raise TensorParallelError("rank 1 (pid 4242) exited")
    monkeypatch.setattr(llm.model, "forward", dead)
    rid = llm.add_request("doomed", SamplingParams(max_tokens=3))
    with pytest.raises(TensorParallelError, match="rank 1"):
        llm.step()
    assert rid not in llm.requests
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.needs("engine", "copy-on-write")
def test_a_failure_in_one_sample_fails_its_siblings_in_the_same_step(tiny_path, monkeypatch):
    """n = 2: when the first sample's text fails, the request fails as a
    whole, and its second sample, sampled in that same step, is skipped
    instead of appended to a finished request; the healthy request goes on."""
    from tokenizer import IncrementalDecoder
    ref = healthy_alone(tiny_path)
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    push = IncrementalDecoder.push

    def broken(self, token):
        if getattr(self, "poisoned", False):
            raise UnicodeError("cannot decode this token")
        return push(self, token)
    monkeypatch.setattr(IncrementalDecoder, "push", broken)
    good = [llm.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in HEALTHY]
    bad = llm.add_request("twins", SamplingParams(max_tokens=8, n=2, temperature=0.7, seed=0))
    llm.requests[bad].seqs[0].decoder.poisoned = True
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    assert [done[r].token_ids for r in good] == ref
    assert done[bad].finish_reason == "error" and "cannot decode" in done[bad].error
    assert [c.finish_reason for c in done[bad].outputs] == ["error", "error"]
    assert done[bad].outputs[1].token_ids == [], "the sibling must not append a token after its request failed"
    assert_no_leak(llm)


# ---------------------------------------------------------------- the tour's rule: support/ is plumbing

@pytest.mark.needs("engine", "sampler", "copy-on-write", "stop-strings")
def test_an_engine_step_never_enters_support(tiny_path):
    """support/ is entered only while something is built (DESIGN.md): tracing
    every Python call of several engine steps (prefill, decodes, a stop
    string, n = 2 forking) finds none in support/, but many in the tour."""
    import os
    import sys
    llm = LLM(tiny_path, kv_cache_bytes=1 << 22)
    llm.add_request("The capital of France is", SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=1,
                                                               min_p=0.05, frequency_penalty=0.5))
    llm.add_request([1, 2, 3], SamplingParams(max_tokens=6, stop=["e"], repetition_penalty=1.2))
    support = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support") + os.sep
    entered, tour = set(), set()

    def tracer(frame, event, arg):
        path = os.path.abspath(frame.f_code.co_filename)
        (entered if path.startswith(support) else tour).add((os.path.basename(path), frame.f_code.co_name))
    sys.setprofile(tracer)
    try:
        while llm.has_unfinished_requests():
            llm.step()
    finally:
        sys.setprofile(None)
    assert ("engine.py", "step") in tour and ("scheduler.py", "schedule") in tour and ("model.py", "forward") in tour
    assert not entered, f"LLM.step entered support/: {sorted(entered)}"


def test_support_imports_nothing_of_the_tour():
    """Imports run one way: the tour may use support/, never the reverse."""
    import ast
    import glob
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tour = {os.path.basename(f)[:-3] for f in glob.glob(os.path.join(root, "*.py"))}
    for path in glob.glob(os.path.join(root, "support", "*.py")):
        for node in ast.walk(ast.parse(open(path).read())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [n for n in names if n.split(".")[0] in tour]
            assert not bad, f"{os.path.relpath(path, root)} imports the tour module(s) {bad}"


# ---- the overlapped step: step N+1 queued before step N's tokens are read

def _mixed_requests(tiny_path):
    """Prompts and params that stop every way: max_tokens, a stop token, a stop string, seeded
    sampling with n = 2 and logprobs, all joining at different steps (run_staggered_outputs)."""
    probe = LLM(tiny_path, kv_cache_bytes=1 << 20).generate([[5, 6, 7, 8] * 3],
                                                             SamplingParams(max_tokens=12, ignore_eos=True))[0]
    prompts = [[5, 6, 7, 8] * 3, [5, 6, 7, 8] * 3, [42] * 7, [9, 8, 7, 6, 5], [5, 6, 7, 8] * 3, [77]]   # 1, 4: the probe's
    params = [SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=16, stop_token_ids=[probe.token_ids[6]]),
              SamplingParams(max_tokens=24, temperature=0.8, seed=3, n=2, logprobs=2),
              SamplingParams(max_tokens=18, temperature=1.0, top_p=0.9, ignore_eos=True),
              SamplingParams(max_tokens=12, stop=[probe.text[4:7]], ignore_eos=True),
              SamplingParams(max_tokens=9)]
    return prompts, params


def run_staggered_outputs(llm, prompts, params, abort_at=None):
    """run_staggered, keeping whole outputs (text, reasons, logprobs of every sample); request 0
    aborted after `abort_at` steps."""
    ids, outs, step, pending = {}, {}, 0, list(enumerate(prompts))
    while pending or llm.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            ids[llm.add_request(p, params[i])] = i
        if step == abort_at:
            llm.abort(next(r for r, i in ids.items() if i == 0))
        for o in llm.step():      # the last output of each (an aborted one: the last before it)
            outs[ids[o.request_id]] = [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs]
        step += 1
    return [outs[i] for i in range(len(prompts))]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.needs("engine")
def test_the_overlapped_engine_gives_the_synchronous_engines_outputs(tiny_path, compiled):
    """overlap=True queues each step before reading the last one's tokens (a decode row reads its
    token on the device): the same tokens, text, finish reasons and logprobs as overlap=False for
    greedy and seeded sampling, n = 2, stop tokens and stop strings, max_tokens, requests joining
    at different steps and a pool small enough to preempt; eagerly and compiled (rows patched in
    the static inputs); no block leaks."""
    prompts, params = _mixed_requests(tiny_path)
    kw = dict(kv_cache_bytes=6 * 16 * 512, block_size=16, max_num_seqs=4, max_num_batched_tokens=24)
    sync = LLM(tiny_path, overlap=False, **kw)
    ref = run_staggered_outputs(sync, prompts, params)
    llm = LLM(tiny_path, overlap=True, compile=compiled, **kw)
    assert llm.overlap
    got = run_staggered_outputs(llm, prompts, params)
    for i, (a, b) in enumerate(zip(got, ref)):        # logprobs: another batch's rounding (1e-6)
        assert [x[:3] for x in a] == [x[:3] for x in b], f"request {i} ({params[i]}): overlapped {a} != {b}"
        for (*_, lp_a), (*_, lp_b) in zip(a, b):
            assert (lp_a is None) == (lp_b is None) and [list(t) for _, t in lp_a or []] == [list(t) for _, t in lp_b or []]
            assert [c for c, _ in lp_a or []] == pytest.approx([c for c, _ in lp_b or []], abs=1e-4)
    reasons = {r for out in ref for _, _, r, _ in out}
    assert reasons == {"length", "stop"}, f"the requests must stop both ways: {reasons}"
    assert sync.scheduler.num_preemptions > 0 and llm.scheduler.num_preemptions > 0, "the pool must preempt"
    assert PENDING not in {t for out in got for toks, _, _, _ in out for t in toks}
    if compiled:
        assert llm.stats["compiled_steps"] == llm.stats["steps"] and llm.stats["eager_steps"] == 0
    assert_no_leak(llm)


@pytest.mark.needs("engine")
def test_an_aborted_overlapped_request_keeps_a_prefix_and_leaks_nothing(tiny_path):
    """Aborted while its next token is in flight: what it streamed is a prefix of the synchronous
    run's (the token in flight is never emitted), every other request's output is unchanged, no
    block leaks."""
    prompts, params = _mixed_requests(tiny_path)
    params[0] = SamplingParams(max_tokens=40, ignore_eos=True)
    kw = dict(kv_cache_bytes=1 << 20, block_size=16, max_num_seqs=4)
    full = run_staggered_outputs(LLM(tiny_path, **kw), prompts, params)
    ref = run_staggered_outputs(LLM(tiny_path, overlap=False, **kw), prompts, params, abort_at=9)
    llm = LLM(tiny_path, overlap=True, **kw)
    got = run_staggered_outputs(llm, prompts, params, abort_at=9)
    (toks, _, reason, _), = got[0]
    assert reason is None and 0 < len(toks) <= len(ref[0][0][0]) and toks == full[0][0][0][:len(toks)]
    assert [[x[:3] for x in o] for o in got[1:]] == [[x[:3] for x in o] for o in ref[1:]]
    assert [[x[:3] for x in o] for o in got[1:]] == [[x[:3] for x in o] for o in full[1:]]
    assert_no_leak(llm)


@pytest.mark.needs("engine")
def test_step_n_plus_one_is_launched_before_step_n_is_read(tiny_path, monkeypatch):
    """The order of the overlapped engine: each step's forward is queued, then the LAST step's
    tokens are read (the wait), so the device never waits for the host's appends; the last step
    is read by the call that finds nothing more to run. Penalties need the last token on the host:
    that request's steps run in order."""
    import sampler
    events, forward, wait = [], LLM._forward, sampler.Fetch.wait
    monkeypatch.setattr(LLM, "_forward", lambda self, b, r: events.append("forward") or forward(self, b, r))
    monkeypatch.setattr(sampler.Fetch, "wait", lambda self: events.append("wait") or wait(self))
    llm = LLM(tiny_path, kv_cache_bytes=1 << 20, overlap=True)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert events == ["forward", "forward", "wait", "forward", "wait", "forward", "wait", "wait"], events
    events.clear()
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True, repetition_penalty=1.3))
    assert events == ["forward", "wait"] * 3, events
