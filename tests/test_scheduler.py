"""Assignment: scheduler.py -- continuous batching.

To pass, implement:
  * Scheduler.schedule / preempt: decode tokens first (1 + drafts each),
    then prefill chunks, then admissions in FCFS order, within
    max_num_batched_tokens and max_num_seqs; preempt the NEWEST running
    sequence when the KV pool cannot give a decoding sequence its next
    slot, and requeue it at the FRONT of the waiting queue. A request still
    scoring its prompt (prompt_logprobs) needs the logits of every prompt
    position: admit it with BlockManager.allocate(..., use_prefix_cache=False).
(given) LLM (engine.py) runs it: one forward pass per step for all running
sequences. The engine's own guarantees (requests that fail alone, abort, n > 1,
prompt logprobs, its options) are tests/test_engine.py's; the sampler and stop
strings are tests/test_sampler.py's.
The reference for exactness is model.generate: the dense path with no cache.
"""
import time

import pytest

from cache import BlockManager
from model import generate as dense_generate
from engine import LLM
from helpers import assert_dense_prompt_logprobs, assert_no_leak
from sampler import SamplingParams
from scheduler import Scheduler
from sequence import Request, Sequence

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


GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


# ------------------------------------------------------ exactness on the real model

@pytest.mark.timeout(600)   # the module's dense reference: 6 prompts, no cache (~7 s alone)
@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("engine", "model")
def test_batch_equals_dense_one_by_one(real_llm, dense_reference):
    outs = real_llm.generate(PROMPTS, GREEDY)
    for i, (o, ref) in enumerate(zip(outs, dense_reference)):
        assert o.token_ids == ref, f"prompt {i}: batched {o.token_ids} != dense {ref}"
        assert o.text == real_llm.tokenizer.decode(ref, skip_special_tokens=True), "streamed text must equal decoding the same tokens"
    assert_no_leak(real_llm)


@pytest.mark.timeout(600)   # the module's dense reference: 6 prompts, no cache (~7 s alone)
@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("engine", "model")
def test_exact_under_preemption(real_path, dense_reference):
    # 46 blocks of 4 tokens: the longest prompt alone needs 40, so the
    # others must evict it (or each other) and recompute later.
    llm = LLM(real_path, kv_cache_bytes=46 * 4 * 46080, block_size=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.scheduler.num_preemptions >= 1, "the pool was meant to force preemption"
    assert [o.token_ids for o in outs] == dense_reference, "preemption by recompute changed a greedy output (the dense reference)"
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
        assert o.token_ids == dense_generate(llm.model, p, 20), "many preemptions changed a greedy output (the dense reference)"
    assert_no_leak(llm)


@pytest.mark.timeout(600)   # the module's dense reference: 6 prompts, no cache (~7 s alone)
@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("engine", "model")
def test_exact_with_tiny_prefill_chunks(real_path, dense_reference):
    llm = LLM(real_path, kv_cache_bytes=64 << 20, max_num_batched_tokens=7)
    schedule, steps = llm.scheduler.schedule, []
    llm.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]      # record every step's batch
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == dense_reference, "prefill in tiny chunks changed a greedy output (the dense reference)"
    sizes = [sum(item.count for item in batch) for batch in steps]
    assert max(sizes) <= 7, f"a step scheduled {max(sizes)} tokens over the budget of 7"
    assert sizes.count(7) > len(sizes) // 2, "the budget should be filled while prompts wait"
    assert_no_leak(llm)


def run_twice(path, dense_reference, prefix_caching: bool) -> int:
    """The prompts twice through one engine: the dense tokens both times, no leak; the
    prompt tokens the second run found cached."""
    llm = LLM(path, kv_cache_bytes=64 << 20, enable_prefix_caching=prefix_caching)
    first = llm.generate(PROMPTS, GREEDY)
    again = llm.generate(PROMPTS, GREEDY)     # with caching: long prompts now hit cached blocks
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == dense_reference
    assert_no_leak(llm)
    return sum(o.metrics.cached_tokens for o in again)


@pytest.mark.timeout(600)   # the module's dense reference: 6 prompts, no cache (~7 s alone)
@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("engine", "model")
def test_exact_with_prefix_caching(real_path, dense_reference):
    cached = run_twice(real_path, dense_reference, prefix_caching=True)
    assert cached > 200, f"the second run found only {cached} prompt tokens cached"


# Without prefix caching the engine never reaches that code: this run grades nothing
# of prefix-caching (it passes whatever the assignment holds), so it only needs it.
@pytest.mark.timeout(600)   # the module's dense reference: 6 prompts, no cache (~7 s alone)
@pytest.mark.needs("engine", "model", "prefix-caching")
def test_exact_without_prefix_caching(real_path, dense_reference):
    assert run_twice(real_path, dense_reference, prefix_caching=False) == 0


# ------------------------------------------------------ the engine on a tiny model

@pytest.fixture
def tiny_llm(tiny_path):
    return LLM(tiny_path, kv_cache_bytes=4 << 20)


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("engine", "model")
def test_prefills_that_fill_the_pool_do_not_deadlock(tiny_path):
    """Two long prompts chunked into a pool that holds one of them: each holds
    part of the pool, neither can go on. The newest must give way."""
    llm = LLM(tiny_path, kv_cache_bytes=8 * 4 * 512, block_size=4, max_num_batched_tokens=8)
    prompts = [list(range(10, 30)), list(range(40, 60))]                  # 20 tokens = 5 blocks each
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert llm.scheduler.num_preemptions >= 1, "a pool that holds one prompt: the newest must be preempted to make progress"
    for p, o in zip(prompts, outs):
        assert o.token_ids == dense_generate(llm.model, p, 6), "after the deadlock is broken, each output is the dense reference's"
    assert_no_leak(llm)


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("engine", "copy-on-write")
def test_a_burst_of_n_gt_1_requests_never_exceeds_the_seats(tiny_path):
    """max_num_seqs counts SEATS: a request with n = 4 holds 4 from its admission on, though its
    samples fork only when its prompt is done (a limit that counted running sequences let 6
    requests with n = 4 and 10 with n = 1 put 17 sequences into a batch of 8). Every request
    still completes, with all its samples, and no block leaks."""
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20, max_num_seqs=8, max_num_batched_tokens=16)
    rids = [llm.add_request([7 + i] * (20 + i), SamplingParams(max_tokens=6, n=4 if i < 6 else 1,
                                                               ignore_eos=True))   # chunked prompts
            for i in range(16)]
    most, done = 0, {}
    while llm.has_unfinished_requests():
        outs = llm.step()
        most = max(most, len(llm.scheduler.running))
        done.update((o.request_id, o) for o in outs if o.finished)
    assert most == 8, f"{most} sequences ran at once with max_num_seqs = 8"
    assert sorted(done) == sorted(rids), "every request of the burst must finish"
    assert all(len(done[r].outputs) == (4 if i < 6 else 1) for i, r in enumerate(rids)), "each request gets its n samples"
    assert all(len(c.token_ids) == 6 for o in done.values() for c in o.outputs), "each sample gets its max_tokens tokens"
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
    assert all(len(o.token_ids) == 1 + i % 16 for i, o in enumerate(outs)), "each request gets exactly its max_tokens tokens (one forward pass per step for all)"
    assert calls["model"] == calls["mlp"] == llm.stats["steps"], "one batched pass per step, no per-sequence MLP"
    assert llm.stats["steps"] < 64, "sequences must share steps"
    assert_no_leak(llm)


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("engine", "prefix-caching")
def test_prompt_logprobs_read_no_prefix_cache_but_fill_it(tiny_path):
    """A cached prefix has no logits for the tokens it skips: a scored prompt
    computes every position (no cache lookup at all), yet its full blocks serve others."""
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    bm, prompt = llm.block_manager, list(range(100, 167))            # 4 full blocks + 3 tokens
    scored = SamplingParams(max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    first = llm.generate([prompt], scored)[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert plain.metrics.cached_tokens == 64 and plain.prompt_logprobs is None, "the scored prompt's blocks serve"
    queries, hits = bm.prefix_queries, bm.prefix_hits
    again = llm.generate([prompt], scored)[0]
    assert (bm.prefix_queries, bm.prefix_hits) == (queries, hits) and again.metrics.cached_tokens == 0, "a request scoring its prompt reads no prefix-cache entry (queries, hits and cached_tokens unchanged)"
    for out in (first, again):
        assert_dense_prompt_logprobs(llm.model, prompt, out.prompt_logprobs, 1)
        assert out.token_ids == plain.token_ids, "prompt logprobs must not change the generated tokens"
    assert_no_leak(llm)


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
        sched.waiting.append(s)
    b1 = sched.schedule()
    assert [(i.seq, i.count) for i in b1] == [(seqs[0], 6), (seqs[1], 4)], "FCFS, chunked to the budget"
    fake_step(sched, b1)
    b2 = sched.schedule()
    # decode for seq 0 first, then the rest of seq 1's prompt, then seq 2 (seats: 3 max)
    assert [(i.seq, i.count) for i in b2] == [(seqs[0], 1), (seqs[1], 2), (seqs[2], 6)], "decodes first (1 token each), then the prefill chunk that fits the budget left, in arrival order"
    assert sum(i.count for i in b2) <= 10 and seqs[3] in sched.waiting, "the budget (10 tokens) is never exceeded and the next waiting one waits"


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("block-allocation", "prefix-caching")
def test_scheduler_preempts_the_newest_sequence(real_tokenizer):
    bm = BlockManager(4, 4)                 # 16 token slots
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    seqs = make_seqs(real_tokenizer, [4, 4, 4])
    for s in seqs:
        sched.waiting.append(s)
    fake_step(sched, sched.schedule())      # three 4-token prompts: 3 full blocks
    seqs[2].draft_tokens = [5, 5]           # drafts of a step that will never verify them
    fake_step(sched, sched.schedule())      # decodes: seq 0 gets the last block, 1 and 2 cannot
    assert sched.num_preemptions >= 1, "the pool cannot give every decode its next block: something must be preempted"
    assert seqs[2].status == "waiting" and sched.waiting[0] is seqs[2], "newest goes back to the front"
    assert seqs[0].status == "running", "the OLDEST running sequence keeps running (the newest is preempted)"
    assert seqs[2].num_computed == 0 and len(seqs[2].token_ids) == 5, "generated tokens are kept for recompute"
    assert seqs[2].draft_tokens == [], "a preempted sequence's drafts are dropped (its cache is gone)"


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("block-allocation", "prefix-caching")
def test_decodes_stop_at_the_budget_and_a_stuck_pool_preempts_the_newest(real_tokenizer):
    """(1) Three decodes and a budget of 2 tokens: two run, the third waits a step (never an
    overdrawn budget). (2) Two prompts half prefilled in a full pool, no decode: schedule() is
    stuck, so it preempts the NEWEST (its blocks freed, the release hooks told: the drafter drops
    its state) and the oldest goes on."""
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=3, max_num_batched_tokens=3)
    seqs = make_seqs(real_tokenizer, [1, 1, 1])
    sched.waiting.extend(seqs)
    fake_step(sched, sched.schedule())                      # three 1-token prompts: all decode now
    sched.max_num_batched_tokens = 2
    assert [(i.seq, i.count) for i in sched.schedule()] == [(seqs[0], 1), (seqs[1], 1)], \
        "a budget of 2 tokens schedules two decodes (oldest first); the third waits for the next step"
    bm = BlockManager(2, 4)                                 # 2 blocks: one each, both full
    sched, released = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100), []
    sched.release_hooks.append(released.append)
    seqs = make_seqs(real_tokenizer, [8, 8])
    for s in seqs:                                          # each has fed 4 of its 8 prompt tokens
        bm.allocate(s.seq_id, s.token_ids)
        bm.reserve(s.seq_id, 0, 4)
        s.num_computed, s.status = 4, "running"
        sched.running.append(s)
    out = sched.schedule()
    assert [(i.seq, i.start, i.count) for i in out] == [(seqs[0], 4, 4)], \
        "stuck: the newest gives its block back and the oldest finishes its prompt in it"
    assert list(sched.waiting) == [seqs[1]] and seqs[1].status == "waiting" and released == [seqs[1]], \
        "the newest running sequence is preempted (to the front of the queue), and the release hooks see it"


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("block-allocation", "prefix-caching")
def test_each_limit_holds_back_only_what_it_must(real_tokenizer):
    """(1) A decode whose 1 + k tokens fill the budget exactly keeps its drafts; one token less of
    budget drops them. (2) Prompts admitted in one step take n seats each (n > 1 forks). (3) A prefill
    with no room in the pool is passed over, not a wall: a newer one with room still runs, and nothing
    is preempted (the pool is not stuck)."""
    for budget, want in ((3, 3), (2, 1)):
        sched = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=budget)
        seq, = make_seqs(real_tokenizer, [1])
        sched.waiting.append(seq)
        fake_step(sched, sched.schedule())
        seq.draft_tokens = [5, 5]
        assert [i.count for i in sched.schedule()] == [want], \
            f"1 token + 2 drafts against a budget of {budget}: {want} tokens scheduled"
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=4, max_num_batched_tokens=100)
    seqs = make_seqs(real_tokenizer, [5, 5], n=3)
    sched.waiting.extend(seqs)
    assert [i.seq for i in sched.schedule()] == seqs[:1] and list(sched.waiting) == seqs[1:], \
        "a prompt of n = 3 takes 3 seats of 4: the next one (3 more) waits"
    bm = BlockManager(2, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = make_seqs(real_tokenizer, [8, 6])
    for s, done in zip(seqs, (4, 2)):                       # the older one's block is full
        bm.allocate(s.seq_id, s.token_ids)
        bm.reserve(s.seq_id, 0, done)
        s.num_computed, s.status = done, "running"
        sched.running.append(s)
    assert [(i.seq, i.start, i.count) for i in sched.schedule()] == [(seqs[1], 2, 2)], \
        "the older prefill has no room; the newer one fills the 2 slots left in its block"
    assert sched.num_preemptions == 0, "a step that schedules work preempts nobody"


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("block-allocation", "prefix-caching", "copy-on-write")
def test_preemption_and_admission_touch_only_what_they_must(real_tokenizer):
    """(1) Two samples of one prompt share a full pool: preempting the newest frees nothing
    shared, so the scheduler goes on preempting until the decode fits (never a reserve from an
    empty pool). (2) A running sequence with nothing to feed (its token still on the device: the
    overlapped engine) is not stuck: no preemption. (3) With no budget left nothing is admitted, not
    even looked up: the prefix cache's counters and LRU order stay as they were."""
    bm = BlockManager(2, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    parent, = make_seqs(real_tokenizer, [8], n=2)
    sched.waiting.append(parent)
    fake_step(sched, sched.schedule())                      # 8 prompt tokens: both blocks
    child, = sched.fork(parent, 8, real_tokenizer)
    out = sched.schedule()                                  # each needs a third block: none is free
    assert sched.num_preemptions == 2 and [(i.seq, i.start, i.count) for i in out] == [(parent, 0, 8)], \
        "the child's blocks are shared, so preempting it frees none: the parent yields too (and restarts)"
    assert list(sched.waiting) == [child] and bm.check_invariants() is None
    sched = Scheduler(BlockManager(8, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seq, = make_seqs(real_tokenizer, [5])
    sched.waiting.append(seq)
    sched.schedule()
    seq.num_computed = len(seq.token_ids)                   # computed; its sampled token not back yet
    assert sched.schedule() == [] and sched.num_preemptions == 0, "nothing to feed is not stuck"
    bm = BlockManager(16, 4)
    cached = list(range(1, 10))
    bm.allocate(99, cached)
    bm.append_slots(99, 0, 9)
    bm.cache_full_blocks(99, cached, 9)
    bm.free(99)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=1)
    a, b = make_seqs(real_tokenizer, [1, 9])
    b.token_ids[:] = cached
    sched.waiting.append(a)
    fake_step(sched, sched.schedule())                      # a decodes now: the whole 1-token budget
    sched.waiting.append(b)
    queries, lru = bm.prefix_queries, list(bm.free_blocks)
    assert [i.seq for i in sched.schedule()] == [a] and b.seq_id not in bm.tables
    assert (bm.prefix_queries, list(bm.free_blocks)) == (queries, lru), \
        "no budget left: the waiting prompt is not looked up (no hits counted, its blocks not moved)"


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("block-allocation", "prefix-caching")
def test_preempted_sequence_goes_back_to_the_front_of_the_queue(real_tokenizer):
    """Fairness: a preempted sequence arrived before everything still waiting,
    so it returns to the FRONT of the queue and is readmitted first."""
    bm = BlockManager(3, 4)                 # 12 token slots
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = make_seqs(real_tokenizer, [4, 4, 4, 4])
    for s in seqs:
        sched.waiting.append(s)
    first = sched.schedule()                # two seats: seqs 0 and 1 prefill, 2 and 3 wait
    assert [i.seq for i in first] == seqs[:2] and list(sched.waiting) == seqs[2:], "two seats: the first two arrivals prefill, the others wait in order"
    fake_step(sched, first)
    # Both decode into a new block, one is free: seq 1 (the newest) yields its
    # block. It arrived before seqs 2 and 3, so it is first in line again, and
    # the block it gave back is enough to restart its prompt in the same step.
    admitted = seqs[1].request.metrics.first_scheduled_time
    second = sched.schedule()
    assert seqs[1].request.metrics.first_scheduled_time == admitted, \
        "readmission after a preemption keeps the first admission's metrics (TTFT, cached_tokens)"
    assert sched.num_preemptions == 1 and seqs[1].request.metrics.preemptions == 1, "one preemption, counted in the scheduler and in the request's metrics"
    assert [(i.seq, i.start, i.count) for i in second] == [(seqs[0], 4, 1), (seqs[1], 0, 4)], \
        "the preempted sequence must go back to the FRONT of the waiting queue, before later arrivals"
    assert list(sched.waiting) == [seqs[2], seqs[3]], "the later arrivals still wait behind the preempted one, in order"


@pytest.mark.assignment("scheduler-step")
@pytest.mark.needs("block-allocation", "prefix-caching")
def test_a_failed_admission_records_no_metrics(real_tokenizer):
    """A request's metrics say when it was FIRST ADMITTED (first_scheduled_time: the end of its
    queueing, TTFT's first part) and how many prompt tokens the prefix cache gave it then
    (cached_tokens). An attempt that finds no room in the pool is not an admission: the metrics are
    recorded after the fit check, or a request that waits looks scheduled, and keeps the stale
    cached_tokens of that attempt. A pool of 2 blocks of 4: prompt a (8 tokens) fills it, prompt b
    (5 tokens, its first block a's) does not fit and waits, its metrics untouched; a's blocks
    enter the prefix cache and a finishes; b is then admitted with a 4-token hit, and only then
    are its metrics recorded: that step's time, 4 cached tokens."""
    bm = BlockManager(2, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_seqs(real_tokenizer, [8, 5])
    b.token_ids[:] = [1, 2, 3, 4, 20]                       # a's first block, then a token of its own
    sched.waiting.extend([a, b])
    batch = sched.schedule()
    assert [(i.seq, i.start, i.count) for i in batch] == [(a, 0, 8)] and list(sched.waiting) == [b], \
        "a fills the pool; b does not fit and waits"
    assert b.request.metrics.first_scheduled_time is None and b.request.metrics.cached_tokens == 0, \
        (f"b was never admitted, yet its metrics say first_scheduled_time={b.request.metrics.first_scheduled_time}, "
         f"cached_tokens={b.request.metrics.cached_tokens}: metrics recorded before the fit check?")
    assert a.request.metrics.first_scheduled_time is not None, "an admitted request records first_scheduled_time"
    fake_step(sched, batch)
    bm.cache_full_blocks(a.seq_id, a.token_ids, 8)          # what the engine does after the step
    sched.finish(a)                                         # its blocks are free, still cached
    before = time.perf_counter()
    batch = sched.schedule()
    assert [(i.seq, i.start, i.count) for i in batch] == [(b, 4, 1)], \
        "b is admitted with a's first block from the prefix cache: 1 token to compute"
    assert b.request.metrics.first_scheduled_time is not None and b.request.metrics.first_scheduled_time >= before, \
        "first_scheduled_time is the time of the real admission, not of the attempt that found no room"
    assert b.request.metrics.cached_tokens == 4, \
        f"cached_tokens {b.request.metrics.cached_tokens}: the admission's prefix hit is 4 tokens (a stale attempt's 0?)"
