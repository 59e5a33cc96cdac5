"""Assignment: scheduler.py -- continuous batching.

To pass, implement:
  * SamplingParams with validation (ValueError naming the field);
  * probs_from_logits (temperature, top-k, top-p per row) and sample (one
    generator per row, so a seeded request ignores its batch-mates);
  * Scheduler.schedule: decode tokens first, then prefill chunks, then
    admissions in FCFS order, within max_num_batched_tokens and
    max_num_seqs; preempt the NEWEST running sequence when the KV pool
    cannot give a decoding sequence its next slot;
  * LLM.generate / add_request / step / abort: one forward pass per step for
    all running sequences, stop conditions, n > 1 by forking, no leaks.
The reference for exactness is model.generate: the dense path with no cache.
"""
import pytest
import torch
from conftest import tiny_model

from cache import BlockManager
from model import generate as dense_generate
from scheduler import (ACCEPT, DRAW, LLM, Request, SampleRequest, SamplingParams, Scheduler, Sequence, StopStrings,
                       draw, filtered_probs, sample_key, sample_tokens, uniform)

# Prompts of very different lengths (3 to ~220 tokens) for the real model.
PROMPTS = [
    "Hi",
    "What is the capital of France?",
    "The history of the printing press begins in the fifteenth century, when " * 12,
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a land far away, there lived a dragon who " * 4,
]
MAX_NEW = 10


@pytest.fixture(scope="module")
def real_llm(real_path):
    return LLM(real_path, kv_cache_bytes=64 << 20)


@pytest.fixture(scope="module")
def dense_reference(real_llm):
    """Each prompt alone, on the dense path, no cache: the ground truth."""
    tok = real_llm.tokenizer
    return [dense_generate(real_llm.model, tok.encode(p, allow_special=True), MAX_NEW) for p in PROMPTS]


def assert_no_leak(llm):
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks leaked"
    bm.check_invariants()
    assert not llm.scheduler.running and not llm.scheduler.waiting and not llm.requests


GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


# ------------------------------------------------------ exactness on the real model

@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("engine", "model")
def test_batch_equals_dense_one_by_one(real_llm, dense_reference):
    outs = real_llm.generate(PROMPTS, GREEDY)
    for i, (o, ref) in enumerate(zip(outs, dense_reference)):
        assert o.token_ids == ref, f"prompt {i}: batched {o.token_ids} != dense {ref}"
        assert o.text == real_llm.tokenizer.decode(ref, skip_special_tokens=True)
    assert_no_leak(real_llm)


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("engine", "model")
def test_exact_under_preemption(real_path, dense_reference):
    # 46 blocks of 4 tokens: the longest prompt alone needs 40, so the
    # others must evict it (or each other) and recompute later.
    llm = LLM(real_path, kv_cache_bytes=46 * 4 * 46080, block_size=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.scheduler.num_preemptions >= 1, "the pool was meant to force preemption"
    assert [o.token_ids for o in outs] == dense_reference
    assert_no_leak(llm)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("engine", "model")
def test_exact_under_many_preemptions(tiny_path, prefix_caching):
    """Block size 1 and a pool of 120 tokens for 12 sequences growing to ~40:
    the newest running sequence is evicted again and again."""
    llm = LLM(tiny_path, kv_cache_bytes=120 * 2 * 2 * 2 * 16 * 4, block_size=1,
              enable_prefix_caching=prefix_caching)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(10 + 2 * i)] for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert llm.scheduler.num_preemptions >= 5, f"only {llm.scheduler.num_preemptions} preemptions"
    for p, o in zip(prompts, outs):
        assert o.token_ids == dense_generate(llm.model, p, 20)
    assert_no_leak(llm)


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("engine", "model")
def test_exact_with_tiny_prefill_chunks(real_path, dense_reference):
    llm = LLM(real_path, kv_cache_bytes=64 << 20, max_num_batched_tokens=7)
    schedule, steps = llm.scheduler.schedule, []
    llm.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]      # record every step's batch
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == dense_reference
    sizes = [sum(item.count for item in batch) for batch in steps]
    assert max(sizes) <= 7, f"a step scheduled {max(sizes)} tokens over the budget of 7"
    assert sizes.count(7) > len(sizes) // 2, "the budget should be filled while prompts wait"
    assert_no_leak(llm)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.assignment("prefix-caching")
@pytest.mark.needs("engine", "model")
def test_exact_with_and_without_prefix_caching(real_path, dense_reference, prefix_caching):
    llm = LLM(real_path, kv_cache_bytes=64 << 20, enable_prefix_caching=prefix_caching)
    first = llm.generate(PROMPTS, GREEDY)
    again = llm.generate(PROMPTS, GREEDY)     # with caching: long prompts now hit cached blocks
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == dense_reference
    cached = sum(o.metrics.cached_tokens for o in again)
    assert (cached > 200) == prefix_caching, f"cached prompt tokens: {cached}"
    assert_no_leak(llm)


# ------------------------------------------------------ the engine on a tiny model

@pytest.fixture
def tiny_llm(tiny_path):
    return LLM(tiny_path, kv_cache_bytes=4 << 20)


@pytest.mark.assignment("sampler")
@pytest.mark.needs("engine")
def test_seeded_sampling_ignores_the_batch(tiny_path):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = LLM(tiny_path, kv_cache_bytes=4 << 20).generate(["a seeded request"], params)[0].token_ids
    busy = LLM(tiny_path, kv_cache_bytes=4 << 20, max_num_batched_tokens=3)   # split prefill, busy batch
    others = [SamplingParams(max_tokens=15, temperature=1.0, ignore_eos=True)] * 5
    outs = busy.generate(["noise " * i for i in range(1, 6)] + ["a seeded request"], others + [params])
    assert outs[-1].token_ids == alone
    unseeded = busy.generate(["a seeded request"] * 2, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))
    assert unseeded[0].token_ids != unseeded[1].token_ids, "unseeded requests must not share randomness"


@pytest.mark.assignment("sampler")
@pytest.mark.needs("engine", "copy-on-write", "stop-strings")
def test_seeded_request_repeats_in_a_mixed_batch_and_after_preemption(tiny_path):
    """Counter-based noise: the same seeded request gives the same tokens alone,
    among 16 mixed requests (greedy, sampled, top-k/top-p, n > 1, stop
    strings), and when it is preempted and recomputed halfway."""
    params = SamplingParams(max_tokens=24, temperature=1.0, top_k=40, top_p=0.95, seed=2**64 - 1, ignore_eos=True)
    prompt = "the seeded one"
    alone = LLM(tiny_path, kv_cache_bytes=4 << 20).generate([prompt], params)[0].token_ids
    mixed = [SamplingParams(max_tokens=5 + i, temperature=[0.0, 0.7, 1.3][i % 3], top_k=[0, 5, 0, 30][i % 4],
                            top_p=[1.0, 0.8][i % 2], n=1 + (i % 5 == 0), stop=["z"] if i % 4 == 3 else [],
                            ignore_eos=True, seed=i if i % 2 else None) for i in range(15)]
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20, max_num_batched_tokens=16)
    outs = llm.generate([f"noise {i} " * (1 + i % 4) for i in range(15)] + [prompt], mixed + [params])
    assert outs[-1].token_ids == alone, "a seeded request must not depend on its batch-mates"
    # 12 blocks of 4 tokens (512 B per token) for 4 sequences of ~30 tokens: the newest (the seeded one) is preempted
    tight = LLM(tiny_path, kv_cache_bytes=12 * 4 * 512, block_size=4)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = tight.generate(["one two three", "four five six", "seven eight", prompt], [greedy] * 3 + [params])
    assert outs[-1].metrics.preemptions >= 1, "the pool was meant to preempt the seeded request"
    assert outs[-1].token_ids == alone, "a preempted seeded request must repeat its tokens"
    assert_no_leak(tight)


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("engine", "model")
def test_prefills_that_fill_the_pool_do_not_deadlock(tiny_path):
    """Two long prompts chunked into a pool that holds one of them: each holds
    part of the pool, neither can go on. The newest must give way."""
    llm = LLM(tiny_path, kv_cache_bytes=8 * 4 * 512, block_size=4, max_num_batched_tokens=8)
    prompts = [list(range(10, 30)), list(range(40, 60))]                  # 20 tokens = 5 blocks each
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert llm.scheduler.num_preemptions >= 1
    for p, o in zip(prompts, outs):
        assert o.token_ids == dense_generate(llm.model, p, 6)
    assert_no_leak(llm)


def test_prefix_of_a_one_token_request_and_a_fully_cached_prompt(tiny_path):
    """A request that finishes in its prefill step still leaves its full blocks
    in the prefix cache; a prompt entirely in the cache recomputes only its
    last block (its last token needs logits) and gives the dense tokens."""
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    prompt = list(range(100, 164))                                # 64 tokens = 4 full blocks
    first = llm.generate([prompt], SamplingParams(max_tokens=1))[0]
    assert first.metrics.cached_tokens == 0
    again = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert again.metrics.cached_tokens == 48, f"cached {again.metrics.cached_tokens}: expected 3 of 4 blocks"
    assert again.token_ids == dense_generate(llm.model, prompt, 8)
    assert_no_leak(llm)


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


@pytest.mark.needs("engine", "sampler", "copy-on-write")
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
    import scheduler
    ref = healthy_alone(tiny_path)
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    real = scheduler.filtered_probs

    def picky(logits, temperature, top_k, top_p):
        if 7 in top_k:
            raise RuntimeError("this filter cannot take top_k=7")
        return real(logits, temperature, top_k, top_p)
    monkeypatch.setattr(scheduler, "filtered_probs", picky)
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


def within(seconds, fn, what):
    """Run fn in a daemon thread and fail, instead of hanging the whole suite,
    if it has not returned in time (an endless loop in student code)."""
    import threading
    box = {}

    def run():
        try:
            box["ok"] = fn()
        except BaseException as e:                  # noqa: B902  re-raised in the test's thread
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"{what} (still running after {seconds} s)")
    if "error" in box:
        raise box["error"]


@pytest.mark.assignment("stop-strings")
def test_stop_strings_against_brute_force():
    """StopStrings fed random text in random pieces (stop strings that overlap
    themselves and each other, over a 2-3 letter alphabet) against str.find:
    the first stop string completed, in the piece where it completes, with
    the end relative to that piece; before it, `partial` is the longest
    prefix of a stop string the text ends with (what must be held back)."""
    within(60, _brute_force_stop_strings, "StopStrings.feed never returned: an endless loop in the "
           "failure-table fallback? (each fallback must make the match shorter)")


def _brute_force_stop_strings():
    import random
    rng = random.Random(0)
    for trial in range(400):
        alphabet = "ab" if trial % 2 else "abc"
        stops = list({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
                      for _ in range(rng.randint(1, 3))})
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        matcher, seen = StopStrings(stops), ""
        while text:
            piece = text[:rng.randint(1, 4)]
            text = text[len(piece):]
            got, want = matcher.feed(piece), first_stop(stops, seen + piece)
            if want is not None:
                want = (want[0] - len(seen), want[1])
            assert got == want, f"stops {stops}, text {seen!r} + piece {piece!r}: feed gave {got}, expected {want}"
            if got is not None:
                break                          # the engine stops at the first stop string
            seen += piece
            assert matcher.partial == open_match(stops, seen), \
                f"stops {stops}, text {seen!r}: partial {matcher.partial}, expected {open_match(stops, seen)}"


@pytest.mark.assignment("stop-strings")
@pytest.mark.needs("engine")
def test_streamed_deltas_add_up_and_never_show_a_stop_string(tiny_llm):
    """new_text of every step concatenates to the final text; text that later
    turns out to be a stop string is never streamed (hold-back), also when the
    stop string spans several tokens."""
    llm = tiny_llm
    base = llm.generate(["stream test"], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    ids = base.token_ids
    pieces = [llm.tokenizer.decode(ids[:i + 1]) for i in range(len(ids))]
    i = next(i for i in range(5, len(ids)) if len(pieces[i]) - len(pieces[i - 2]) >= 3 and
             pieces[i - 2] == llm.tokenizer.decode(ids[:i - 1]))
    stop = pieces[i][len(pieces[i - 2]) - 1:len(pieces[i]) - 1]     # spans the last two tokens before i + 1
    llm.add_request("stream test", SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))
    streamed, final = "", None
    while llm.has_unfinished_requests():
        for o in llm.step():
            streamed += o.outputs[0].new_text
            assert stop not in streamed, "a stop string must never reach the stream"
            final = o
    assert final.finish_reason == "stop" and streamed == final.text == base.text[:base.text.index(stop)]


@pytest.mark.assignment("copy-on-write")
@pytest.mark.needs("engine", "sampler")
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
    assert rid not in llm.requests
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


def first_stop(stops, text):
    """Brute force: (end, length) of the earliest-ending stop string in text,
    the longest of those ending there; None if none occurs."""
    ends = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    return (min(ends)[0], -min(ends)[1]) if ends else None


def open_match(stops, text):
    """Brute force: the longest proper prefix of a stop string that text ends with."""
    return max(k for s in stops for k in range(len(s)) if text.endswith(s[:k]))


@pytest.mark.assignment("stop-strings")
@pytest.mark.needs("engine")
def test_stop_conditions(tiny_llm):
    llm = tiny_llm
    base = llm.generate(["stop test"], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 30
    # a stop token id ends generation right after it appears
    target = base.token_ids[5]
    o = llm.generate(["stop test"], SamplingParams(max_tokens=30, stop_token_ids=[target]))[0]
    assert o.finish_reason == "stop" and o.token_ids == base.token_ids[:base.token_ids.index(target) + 1]
    # a stop string is cut from the text
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    o = llm.generate(["stop test"], SamplingParams(max_tokens=30, stop=[stop], ignore_eos=True))[0]
    assert o.finish_reason == "stop" and o.text == text[:text.index(stop)]
    # EOS stops unless ignore_eos; the tiny model rarely says EOS, so make it the stop point
    eos = llm.tokenizer.eos_token_id
    llm.tokenizer.eos_token_id = target
    try:
        o = llm.generate(["stop test"], SamplingParams(max_tokens=30))[0]
        assert o.finish_reason == "stop" and o.token_ids[-1] == target
        o = llm.generate(["stop test"], SamplingParams(max_tokens=30, ignore_eos=True))[0]
        assert o.token_ids == base.token_ids
    finally:
        llm.tokenizer.eos_token_id = eos
    assert_no_leak(llm)


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


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("engine")
def test_one_forward_pass_per_step_for_64_prompts(tiny_llm):
    llm = tiny_llm
    calls = {"model": 0, "mlp": 0}
    h1 = llm.model.register_forward_hook(lambda *a: calls.__setitem__("model", calls["model"] + 1))
    h2 = llm.model.layers[0].mlp.register_forward_hook(lambda *a: calls.__setitem__("mlp", calls["mlp"] + 1))
    try:
        prompts = [("word " * (1 + (i * 37) % 90)) for i in range(64)]
        outs = llm.generate(prompts, [SamplingParams(max_tokens=1 + i % 16, ignore_eos=True) for i in range(64)])
    finally:
        h1.remove(), h2.remove()
    assert all(len(o.token_ids) == 1 + i % 16 for i, o in enumerate(outs))
    assert calls["model"] == calls["mlp"] == llm.stats["steps"], "one batched pass per step, no per-sequence MLP"
    assert llm.stats["steps"] < 64, "sequences must share steps"
    assert_no_leak(llm)


@pytest.mark.needs("engine")
def test_logprobs(tiny_llm):
    out = tiny_llm.generate(["logprobs"], SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 4
    for tok, (lp, alts) in zip(out.token_ids, lps):
        assert lp <= 0 and len(alts) == 3
        assert max(alts.values()) == pytest.approx(lp, abs=1e-5), "greedy picks the most likely token"


# ------------------------------------------------------------- sampling params

@pytest.mark.parametrize("field,value", [("max_tokens", -1), ("max_tokens", 0), ("temperature", -0.1),
                                         ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("n", 0),
                                         ("seed", "x"), ("stop", [""]), ("logprobs", 100),
                                         ("max_tokens", 2.5), ("temperature", float("nan")),
                                         ("temperature", 10**400), ("seed", 2**64), ("seed", -2**63 - 1),
                                         ("stop", ["z" * 1025]), ("stop", ["a"] * 17), ("n", 129)])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


# --------------------------------------------------------------------- sampler

def reference_probs(logits, temperature, top_k, top_p):
    """softmax(logits / T), then top-k, then top-p on the renormalized rest,
    written out the obvious way (one row, Python sorting)."""
    p = (logits / temperature).softmax(-1)
    order = p.argsort(descending=True).tolist()
    keep = order[:top_k] if top_k else order
    mass = p[keep] / p[keep].sum()
    n_keep, total = 0, 0.0
    while total < top_p and n_keep < len(keep):       # smallest prefix with mass >= top_p
        total += float(mass[n_keep])
        n_keep += 1
    ref = torch.zeros_like(p)
    ref[keep[:n_keep]] = p[keep[:n_keep]]
    return ref / ref.sum()


@pytest.mark.assignment("sampler")
def test_filtered_probs_against_a_direct_reference():
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 2
    rows = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.6), (1.0, 49, 0.3)]
    probs = filtered_probs(logits.clone(), torch.tensor([r[0] for r in rows]), [r[1] for r in rows],
                           [r[2] for r in rows])
    for i, (t, k, p) in enumerate(rows):
        ref = reference_probs(logits[i], t, k, p)
        assert torch.allclose(probs[i], ref, atol=1e-6), f"row {i} (T={t}, top_k={k}, top_p={p}) differs"
        assert (probs[i] > 0).sum() == (ref > 0).sum(), f"row {i}: wrong number of tokens kept"


def ask(row, params, key=0, drafts=(), position=0):
    return SampleRequest(row, list(drafts), params, key, position)


@pytest.mark.assignment("sampler")
def test_greedy_rows_are_the_argmax_and_skip_filtering(monkeypatch):
    torch.manual_seed(1)
    logits = torch.randn(16, 1000)
    calls = []
    monkeypatch.setattr("scheduler.filtered_probs", lambda *a: calls.append(a) or filtered_probs(*a))
    out = sample_tokens(logits, [ask(i, SamplingParams()) for i in range(16)])
    assert [t for t, _, _ in out] == [[int(x)] for x in logits.argmax(-1)]
    assert not calls, "greedy rows must not sort, filter or draw"
    # The full path agrees: top_k=1 keeps only the argmax, whatever the noise.
    out = sample_tokens(logits, [ask(i, SamplingParams(temperature=1.0, top_k=1), key=i) for i in range(16)])
    assert [t for t, _, _ in out] == [[int(x)] for x in logits.argmax(-1)] and calls


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.5, 0, 0.7), (1.0, 5, 0.8)])
@pytest.mark.assignment("sampler")
def test_sampled_rows_follow_the_filtered_distribution(t, k, p):
    """200k draws through sample_tokens (each its own key) against the reference."""
    torch.manual_seed(2)
    logits = torch.randn(1, 8) * 1.5
    n = 200_000
    params = SamplingParams(temperature=t, top_k=k, top_p=p)
    toks = [x[0][0] for x in sample_tokens(logits.expand(n, -1), [ask(i, params, key=i) for i in range(n)])]
    counts = torch.bincount(torch.tensor(toks), minlength=8).float()
    ref = reference_probs(logits[0], t, k, p)
    assert counts[ref == 0].sum() == 0, "a filtered-out token was drawn"
    exp = ref[ref > 0] * n
    stat = float(((counts[ref > 0] - exp) ** 2 / exp).sum())
    assert stat < 26.1, f"chi-square {stat:.1f} (df <= 7, 99.9th percentile 24.3): not the filtered distribution"


@pytest.mark.assignment("sampler")
def test_draw_is_the_inverse_cdf_of_unnormalized_rows():
    """draw(probs, u): the first token whose cumulative mass exceeds u * total,
    worked out by hand on unnormalized rows (the residuals of speculative
    decoding are not normalized); a zero-probability token is never drawn,
    not even at u = 0 or right at a boundary."""
    probs = torch.tensor([[0.0, 2.0, 0.0, 6.0, 0.0],        # cdf 0, 2, 2, 8, 8
                          [0.5, 0.0, 0.25, 0.0, 0.25]])     # cdf .5, .5, .75, .75, 1
    cases = [(0.0, 1, 0), (0.2499, 1, 0), (0.25, 3, 0.5), (0.5, 3, 0.6), (0.9999, 3, 0.9999)]
    for u0, tok0, u1 in cases:
        got = draw(probs, torch.tensor([u0, u1], dtype=torch.float64)).tolist()
        want1 = 0 if u1 < 0.5 else 2 if u1 < 0.75 else 4
        assert got == [tok0, want1], f"u = {u0}, {u1}: drew {got}, the inverse CDF gives {[tok0, want1]}"


def splitmix64(state: int):
    """SplitMix64 written out (Steele, Lea and Flood 2014): the reference
    generator whose (position * 3 + stream)-th output `uniform` must be."""
    mask = (1 << 64) - 1
    while True:
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & mask
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
        yield (z ^ (z >> 31)) >> 11       # the top 53 bits: a double in [0, 1) times 2^53


@pytest.mark.assignment("sampler")
def test_noise_is_the_splitmix64_stream_of_its_key():
    for key in (0, 12345, sample_key(7, 3), 2**64 - 1):
        gen = splitmix64(key)
        ref = [next(gen) * 2.0 ** -53 for _ in range(3 * 40)]
        got = [uniform(key, p, s) for p in range(40) for s in (DRAW, ACCEPT, 2)]
        assert got == ref, f"key {key}: uniform(key, position, stream) must be output position * 3 + stream"


@pytest.mark.assignment("sampler")
def test_noise_is_a_function_of_key_position_and_stream():
    assert uniform(5, 3) == uniform(5, 3), "counter-based: the same (key, position) gives the same noise"
    us = [uniform(sample_key(7, 0), i) for i in range(20000)]
    assert all(0 <= u < 1 for u in us) and abs(sum(us) / len(us) - 0.5) < 0.01
    assert len({uniform(sample_key(s, i), 0) for s in range(50) for i in range(4)}) == 200, \
        "seeds and sample indices must give different noise"
    assert uniform(9, 0, DRAW) != uniform(9, 0, ACCEPT)
    assert sample_key(2**64 - 1, 0) != sample_key(0, 0) and 0 <= sample_key(-2**63, 5) < 2**64


@pytest.mark.assignment("sampler")
def test_logprobs_are_log_softmax_of_the_raw_logits():
    torch.manual_seed(3)
    logits = torch.randn(3, 40) * 3
    out = sample_tokens(logits, [ask(0, SamplingParams(logprobs=3)),
                                 ask(1, SamplingParams(temperature=0.5, logprobs=2, top_k=3), key=4),
                                 ask(2, SamplingParams(temperature=2.0))])
    ref = logits.log_softmax(-1)
    for i in range(2):
        (tok,), info, _ = out[i]
        lp, alts = info[0]
        assert lp == pytest.approx(float(ref[i, tok]), abs=1e-5), f"row {i}: logprob must ignore temperature"
        top = ref[i].topk(3 - i)
        assert alts == pytest.approx(dict(zip(top.indices.tolist(), top.values.tolist())), abs=1e-5)
    assert out[2][1] is None


@pytest.mark.needs("sampler")
def test_non_finite_logits_are_flagged_per_row():
    logits = torch.randn(3, 10)
    logits[1, 4] = float("nan")
    out = sample_tokens(logits, [ask(i, SamplingParams(temperature=float(i))) for i in range(3)])
    assert [finite for _, _, finite in out] == [True, False, True]


# ---------------------------------------------------------- scheduler unit tests

def make_seqs(tok, lengths, n=1, max_tokens=100):
    seqs = []
    for i, L in enumerate(lengths):
        req = Request(str(i), list(range(1, L + 1)), SamplingParams(max_tokens=max_tokens, n=n), 0.0, seed=0)
        req.seqs.append(Sequence(req, req.prompt_ids, 0, tok))
        seqs.append(req.seqs[0])
    return seqs


def fake_step(sched, batch):
    """What the engine does after a forward pass: count the tokens as computed
    and append a token to every sequence that finished its prompt."""
    for item in batch:
        item.seq.num_computed = item.start + item.count
        if item.seq.num_computed == len(item.seq.token_ids):
            item.seq.token_ids.append(7)


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("block-allocation", "prefix-caching")
def test_scheduler_admits_in_order_within_the_token_budget(real_tokenizer):
    bm = BlockManager(100, 4)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=10)
    seqs = make_seqs(real_tokenizer, [6, 6, 6, 6])
    for s in seqs:
        sched.add(s)
    b1 = sched.schedule()
    assert [(i.seq, i.count) for i in b1] == [(seqs[0], 6), (seqs[1], 4)], "FCFS, chunked to the budget"
    fake_step(sched, b1)
    b2 = sched.schedule()
    # decode for seq 0 first, then the rest of seq 1's prompt, then seq 2 (seats: 3 max)
    assert [(i.seq, i.count) for i in b2] == [(seqs[0], 1), (seqs[1], 2), (seqs[2], 6)]
    assert sum(i.count for i in b2) <= 10 and seqs[3] in sched.waiting


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("block-allocation", "prefix-caching")
def test_scheduler_preempts_the_newest_sequence(real_tokenizer):
    bm = BlockManager(4, 4)                 # 16 token slots
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    seqs = make_seqs(real_tokenizer, [4, 4, 4])
    for s in seqs:
        sched.add(s)
    fake_step(sched, sched.schedule())      # three 4-token prompts: 3 full blocks
    fake_step(sched, sched.schedule())      # decodes: seq 0 gets the last block, 1 and 2 cannot
    assert sched.num_preemptions >= 1
    assert seqs[2].status == "waiting" and sched.waiting[0] is seqs[2], "newest goes back to the front"
    assert seqs[0].status == "running"
    assert seqs[2].num_computed == 0 and len(seqs[2].token_ids) == 5, "generated tokens are kept for recompute"


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


@pytest.mark.assignment("stop-strings")
def test_stop_string_matching_equals_a_naive_search():
    """StopStrings.feed over random text fed in random pieces, against
    str.find: the same first stop string (the longest of those ending at the
    same place), at the same place; `partial` equals the longest suffix of the
    text so far that starts some stop string. Stop strings with repeated
    prefixes (aab, abab) exercise the failure function's fallbacks."""
    import random

    from scheduler import StopStrings
    rng = random.Random(3)
    for trial in range(400):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        ends = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
        want = min(ends) if ends else None                     # earliest end; then the longest
        ss, seen, got = StopStrings(stops), 0, None
        while seen < len(text) and got is None:
            piece = text[seen:seen + rng.randint(1, 4)]
            hit = ss.feed(piece)
            if hit is None:
                seen += len(piece)
                prefix = text[:seen]
                held = max([k for s in stops for k in range(1, min(len(s), len(prefix)) + 1)
                            if prefix.endswith(s[:k])] + [0])
                assert ss.partial == held, f"{stops} after {prefix!r}: holds back {ss.partial}, not {held}"
            else:
                got = (seen + hit[0], -hit[1])
        assert got == want, f"stops {stops} in {text!r}: got {got}, want {want}"


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("block-allocation", "prefix-caching")
def test_preempted_sequence_goes_back_to_the_front_of_the_queue(real_tokenizer):
    """Fairness: a preempted sequence arrived before everything still waiting,
    so it returns to the FRONT of the queue and is readmitted first."""
    bm = BlockManager(3, 4)                 # 12 token slots
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = make_seqs(real_tokenizer, [4, 4, 4, 4])
    for s in seqs:
        sched.add(s)
    first = sched.schedule()                # two seats: seqs 0 and 1 prefill, 2 and 3 wait
    assert [i.seq for i in first] == seqs[:2] and list(sched.waiting) == seqs[2:]
    fake_step(sched, first)
    # Both decode into a new block, one is free: seq 1 (the newest) yields its
    # block. It arrived before seqs 2 and 3, so it is first in line again, and
    # the block it gave back is enough to restart its prompt in the same step.
    second = sched.schedule()
    assert sched.num_preemptions == 1 and seqs[1].request.metrics.preemptions == 1
    assert [(i.seq, i.start, i.count) for i in second] == [(seqs[0], 4, 1), (seqs[1], 0, 4)], \
        "the preempted sequence must go back to the FRONT of the waiting queue, before later arrivals"
    assert list(sched.waiting) == [seqs[2], seqs[3]]
