"""Assignment: sampler.py -- sampling that costs what a request asks for.

To pass, implement:
  * uniform(key, position, stream): counter-based noise, the
    (position * 3 + stream)-th output of SplitMix64 started at the key, so a
    seeded request draws the same noise whatever its batch and after
    preemption (and the tiny model's seeded tokens are the same);
  * filtered_probs: temperature, then min-p, top-k, then top-p per row
    (vLLM's order, against a direct reference), and draw: the inverse CDF of
    (unnormalized) rows with one uniform per row, never a zero-probability token;
  * penalize: logit_bias added first (every row of a verification), then
    vLLM's penalties (repetition over prompt and output; presence
    and frequency over the output), row j of a verification counting drafts
    0..j-1 too, so greedy tokens equal a naive loop of dense forward passes
    and verification stays exact;
  * (given) sample_tokens puts them together: greedy rows are one argmax,
    only sampled rows filter and draw, only penalized rows count their
    history; logprobs come from the raw logits; allowed_token_ids and a
    grammar's bitmask (structured outputs: bit t % 32 of word t // 32 is
    token t) set every other logit to -inf, so outputs follow their JSON
    schema, regex or choice list;
  * StopStrings: Knuth-Morris-Pratt over streamed text: feed returns the
    first stop string completed, partial how much text must be held back;
    the engine cuts a stop string from the text and never streams it.
SamplingParams refuses every value outside the range each field declares, naming it
(max_tokens=0 only with prompt_logprobs: a request that scores its prompt).
"""
import json
import re

import pytest
import torch

from sampler import (ACCEPT, DRAW, SampleRequest, SamplingParams, StopStrings, draw, filtered_probs, sample_key,
                     sample_tokens, uniform)
from engine import LLM


def assert_no_leak(llm):
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks leaked"
    bm.check_invariants()
    assert not llm.scheduler.running and not llm.scheduler.waiting and not llm.requests


# ------------------------------------------------------------- sampling params

@pytest.mark.parametrize("field,value", [("max_tokens", -1), ("max_tokens", 0), ("temperature", -0.1),
                                         ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("n", 0),
                                         ("seed", "x"), ("stop", [""]), ("logprobs", 100),
                                         ("max_tokens", 2.5), ("temperature", float("nan")),
                                         ("temperature", 10**400), ("seed", 2**64), ("seed", -2**63 - 1),
                                         ("stop", ["z" * 1025]), ("stop", ["a"] * 17), ("n", 129),
                                         ("prompt_logprobs", -1), ("prompt_logprobs", 21),
                                         ("prompt_logprobs", True), ("prompt_logprobs", 1.0),
                                         ("min_p", -0.1), ("min_p", 1.5), ("min_p", True),
                                         ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
                                         ("repetition_penalty", float("inf")), ("presence_penalty", 2.5),
                                         ("presence_penalty", "1"), ("frequency_penalty", -2.01),
                                         ("frequency_penalty", float("nan"))])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_max_tokens_zero_only_with_prompt_logprobs():
    """Zero new tokens is a request that only scores its prompt: it needs prompt_logprobs."""
    with pytest.raises(ValueError, match=r"max_tokens must be an integer in \[1, .*0 only with prompt_logprobs"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
    top = SamplingParams.__dataclass_fields__["prompt_logprobs"].metadata["le"]
    assert SamplingParams(prompt_logprobs=top).prompt_logprobs == top == 20
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(max_tokens=0, prompt_logprobs=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1, prompt_logprobs=1)

# ----------------------------------------------------------------- the noise

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
    assert all(0 <= u < 1 for u in us) and abs(sum(us) / len(us) - 0.5) < 0.01, \
        "uniform noise lies in [0, 1) and averages 0.5"
    assert len({uniform(sample_key(s, i), 0) for s in range(50) for i in range(4)}) == 200, \
        "seeds and sample indices must give different noise"
    assert uniform(9, 0, DRAW) != uniform(9, 0, ACCEPT), "different streams at one position give different noise"
    assert sample_key(2**64 - 1, 0) != sample_key(0, 0) and 0 <= sample_key(-2**63, 5) < 2**64, \
        "sample_key gives distinct keys in [0, 2^64), negative seeds included"

# ---------------------------------------------------- filtering and the draw

def reference_probs(logits, temperature, top_k, top_p, min_p=0.0):
    """softmax(logits / T), then min-p (p >= min_p * max p), top-k, then top-p on
    the renormalized rest, written out the obvious way (one row, Python sorting)."""
    p = (logits / temperature).softmax(-1)
    p = torch.where(p >= min_p * p.max(), p, torch.zeros_like(p))
    order = [i for i in p.argsort(descending=True).tolist() if p[i] > 0]
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
    rows = [(1.0, 0, 1.0, 0), (0.7, 5, 1.0, 0), (1.3, 0, 0.8, 0), (0.9, 7, 0.6, 0), (1.0, 49, 0.3, 0),
            (1.0, 0, 1.0, 0.05), (0.6, 0, 1.0, 0.3), (1.5, 6, 1.0, 0.1), (1.2, 0, 0.7, 0.02), (2.0, 9, 0.9, 0.2)]
    probs = filtered_probs(logits.repeat(2, 1), torch.tensor([r[0] for r in rows]), [r[1] for r in rows],
                           [r[2] for r in rows], [r[3] for r in rows])
    for i, (t, k, p, m) in enumerate(rows):
        ref = reference_probs(logits[i % 5], t, k, p, m)
        assert torch.allclose(probs[i], ref, atol=1e-6), f"row {i} (T={t}, top_k={k}, top_p={p}, min_p={m}) differs"
        assert (probs[i] > 0).sum() == (ref > 0).sum(), f"row {i}: wrong number of tokens kept"
    assert torch.equal(probs[:5], filtered_probs(logits.clone(), torch.tensor([r[0] for r in rows[:5]]),
                                                 [r[1] for r in rows[:5]], [r[2] for r in rows[:5]])), \
        "min_p = 0 (or absent) must change nothing"
    kept = [int((probs[i] > 0).sum()) for i in range(5, 10)]
    assert all(0 < n < 50 for n in kept), f"the min_p rows must cut some tokens and keep some: {kept}"
    # exactly at the thresholds: probabilities 1/2, 1/4, 1/4 (exact in float32). top-p keeps a token
    # iff the mass BEFORE it is < p: at p = 1/2 the first alone (the 1/4s tie each other, not it);
    # min-p keeps a token iff p >= min_p * max p: at min_p = 1/2 the 1/4s sit on the floor and stay
    row, one = torch.tensor([[0.0, -0.6931471805599453, -0.6931471805599453]]), torch.ones(1)
    assert filtered_probs(row, one, [0], [0.5]).tolist() == [[1.0, 0.0, 0.0]], "top_p = 1/2: the first token's mass reaches p"
    assert filtered_probs(row, one, [0], [1.0], [0.5]).tolist() == [[0.5, 0.25, 0.25]], "min_p: a token ON the floor stays"
    every = filtered_probs(logits[:2], torch.ones(2), [0, 0], [1.0, 1.0])
    assert torch.equal(filtered_probs(logits[:2], torch.ones(2), [50, 500], [1.0, 1.0]), every), \
        "top_k >= the vocabulary keeps every token (as top_k = 0)"
    for tiny in (1e-300, 1e-50, 1e-45):                 # valid top_p that round to 0 (or below the first mass)
        assert filtered_probs(row, one, [0], [tiny]).tolist() == [[1.0, 0.0, 0.0]], \
            f"top_p = {tiny}: the most likely token is always kept"


@pytest.mark.assignment("sampler")
def test_filtered_probs_stays_on_the_logits_device():
    """Every tensor filtered_probs makes (the rows it filters, the min-p and top-p thresholds,
    top-k's index) must be made on the logits' device: one made on the CPU (torch.tensor(...)
    with no device=) fails on CUDA logits, though every CPU test passes. The "meta" device
    (shapes only, no data) checks it without a GPU: mixing a CPU tensor into a meta computation
    raises a device mismatch. Each filter alone, then all three in one batch."""
    V = 50
    cases = [("min_p", [0, 0, 0], [1.0, 1.0, 1.0], [0.1, 0.0, 0.2]),
             ("top_k", [5, 0, 7], [1.0, 1.0, 1.0], None),
             ("top_p", [0, 0, 0], [0.9, 1.0, 0.5], None),
             ("min_p, top_k and top_p", [5, 0, 3], [0.9, 0.8, 1.0], [0.1, 0.05, 0.0])]
    for what, top_k, top_p, min_p in cases:
        logits = torch.empty(3, V, device="meta")
        try:
            probs = filtered_probs(logits, torch.ones(3, device="meta"), top_k, top_p, min_p)
        except NotImplementedError:        # an unfinished assignment says so itself
            raise
        except (RuntimeError, ValueError, TypeError) as e:     # the device mismatch
            pytest.fail(f"{what} on device='meta' logits raised {type(e).__name__}: {str(e)[:200]} "
                        "(a tensor made without device=logits.device?)")
        assert probs.device.type == "meta" and probs.shape == (3, V), \
            f"{what}: probabilities must stay on the logits' device, shape [R, V]: got {probs.device}, {tuple(probs.shape)}"


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
    tail = torch.zeros(1, 1000, dtype=torch.float32)
    tail[0, 0], tail[0, 1] = 1.0, 3e-8                  # below float32's resolution next to 1
    got = draw(tail, torch.tensor([1 - 1.5e-8], dtype=torch.float64)).item()
    assert got == 1, f"a tail token below float32's resolution must be drawable (drew {got}): the CDF in float64"

# ---------------------------------------- sample_tokens: the step's one call

def ask(row, params, key=0, drafts=(), position=0):
    return SampleRequest(row, list(drafts), params, key, position)


@pytest.mark.assignment("sampler")
def test_greedy_rows_are_the_argmax_and_skip_filtering(monkeypatch):
    torch.manual_seed(1)
    logits = torch.randn(16, 1000)
    calls = []
    monkeypatch.setattr("sampler.filtered_probs", lambda *a: calls.append(a) or filtered_probs(*a))
    out = sample_tokens(logits, [ask(i, SamplingParams()) for i in range(16)])
    assert [t for t, _, _ in out] == [[int(x)] for x in logits.argmax(-1)], \
        "greedy (temperature 0) rows return the argmax"
    assert not calls, "greedy rows must not sort, filter or draw"
    # The full path agrees: top_k=1 keeps only the argmax, whatever the noise.
    out = sample_tokens(logits, [ask(i, SamplingParams(temperature=1.0, top_k=1), key=i) for i in range(16)])
    assert [t for t, _, _ in out] == [[int(x)] for x in logits.argmax(-1)] and calls, \
        "top_k=1 returns the argmax through the full sampling path"


@pytest.mark.parametrize("t,k,p,m", [(1.0, 0, 1.0, 0), (0.7, 4, 1.0, 0), (1.5, 0, 0.7, 0), (1.0, 5, 0.8, 0),
                                     (1.0, 0, 0.95, 0.1)])
@pytest.mark.assignment("sampler")
def test_sampled_rows_follow_the_filtered_distribution(t, k, p, m):
    """200k draws through sample_tokens (each its own key) against the reference."""
    torch.manual_seed(2)
    logits = torch.randn(1, 8) * 1.5
    n = 200_000
    params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
    toks = [x[0][0] for x in sample_tokens(logits.expand(n, -1), [ask(i, params, key=i) for i in range(n)])]
    counts = torch.bincount(torch.tensor(toks), minlength=8).float()
    ref = reference_probs(logits[0], t, k, p, m)
    assert counts[ref == 0].sum() == 0, "a filtered-out token was drawn"
    exp = ref[ref > 0] * n
    stat = float(((counts[ref > 0] - exp) ** 2 / exp).sum())
    assert stat < 26.1, f"chi-square {stat:.1f} (df <= 7, 99.9th percentile 24.3): not the filtered distribution"


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
        assert alts == pytest.approx(dict(zip(top.indices.tolist(), top.values.tolist())), abs=1e-5), \
            "top logprobs are the top entries of the raw logits' log_softmax"
    assert out[2][1] is None, "no logprobs requested: none returned"


@pytest.mark.needs("sampler")
def test_non_finite_logits_are_flagged_per_row():
    logits = torch.randn(3, 10)
    logits[1, 4] = float("nan")
    out = sample_tokens(logits, [ask(i, SamplingParams(temperature=float(i))) for i in range(3)])
    assert [finite for _, _, finite in out] == [True, False, True]

# ------------------------------------------------------------------ penalties

def reference_penalties(row, prompt, output, p):
    """vLLM's penalties on one logits row, a plain loop over the tokens seen (float64):
    repetition_penalty for tokens of the prompt or the output (divide a positive logit,
    multiply a negative one), then presence and frequency for the output's tokens."""
    row = row.double().clone()
    for t in set(prompt) | set(output):
        x, c = float(row[t]), output.count(t)
        x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        row[t] = x - p.presence_penalty * (c > 0) - p.frequency_penalty * c
    return row


def reference_verify(logits, prompt, output, drafts, p):
    """Greedy verification one position at a time: row j is penalized with the history
    up to it (the output so far + the drafts accepted before it)."""
    out = []
    for j in range(len(drafts) + 1):
        out.append(int(reference_penalties(logits[j], prompt, output + out, p).argmax()))
        if j == len(drafts) or out[-1] != drafts[j]:
            return out


PENALIZED = [SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.8),
             SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7),
             SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=0.7, frequency_penalty=-1.0),
             SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.3, presence_penalty=-0.5,
                            frequency_penalty=2.0)]


@pytest.mark.assignment("sampler")
def test_penalized_verification_rows_see_their_own_history():
    """sample_tokens with drafts and penalties, greedy, against reference_verify: the
    drafts are the raw argmax of each row, so only the penalties (counting the drafts
    before each row) decide how many are accepted; half the trials have only negative
    logits (which repetition_penalty multiplies). A sampled request with top_k = 1
    verifies through the rejection rule and must give the same tokens."""
    torch.manual_seed(7)
    V, prompt, output = 12, [1, 2, 3, 3], [4, 5, 4]
    for trial in range(60):
        K = 1 + trial % 4
        drafts = torch.randint(0, 6, (K,)).tolist()
        logits = torch.randn(K + 1, V) - 8 * (trial % 2)                # odd trials: every logit < 0
        logits[torch.arange(K), drafts] += 1.5 + trial % 3            # the raw argmax: the draft
        p = PENALIZED[trial % 4]
        want = reference_verify(logits, prompt, output, drafts, p)
        top1 = SamplingParams(temperature=1.0, top_k=1, repetition_penalty=p.repetition_penalty,
                              presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty)
        reqs = [SampleRequest(0, drafts, q, 3, len(output), prompt + output) for q in (p, top1)]
        for (got, _, _), how in zip(sample_tokens(logits, reqs), ("greedy", "sampled with top_k=1")):
            assert got == want, f"trial {trial}, {how}, drafts {drafts}: got {got}, one position at a time {want}"


@pytest.mark.assignment("sampler")
def test_logit_bias_is_added_before_the_penalties_on_every_verified_row():
    """SamplingParams.logit_bias {id: b}: sample_tokens gives exactly the tokens of the same request
    without it on logits with b added by hand (greedy and seeded sampling; drafts to verify, whose
    acceptance the bias decides; with and without penalties, which come after the bias as in vLLM);
    {id: 100} forces the token, {id: -100} never lets it out."""
    torch.manual_seed(3)
    V, prompt, output = 40, [1, 2, 3], [4, 5]
    for trial in range(24):
        K = trial % 3
        logits = torch.randn(K + 1, V)
        drafts = logits[:K].argmax(-1).tolist()             # the raw argmaxes: the bias decides
        bias = {int(t): float(b) for t, b in zip(torch.randperm(V)[:6], torch.randn(6) * 4)}
        pens = dict(repetition_penalty=1.3, presence_penalty=0.5) if trial % 2 else {}
        by_hand = logits.clone()
        by_hand[:, list(bias)] += torch.tensor(list(bias.values()))
        for temp in (0.0, 0.8):
            got, want = (sample_tokens(x, [SampleRequest(0, drafts, SamplingParams(
                temperature=temp, seed=5, logit_bias=b, **pens), 3, len(output), prompt + output)])[0][0]
                for x, b in ((logits, bias), (by_hand, None)))
            assert got == want, f"trial {trial}, T {temp}, {pens}: {got} with logit_bias, {want} with it added by hand"
    logits = torch.randn(3, V)
    top = int(logits[0].argmax())
    force, ban = ({7: 100.0}, {top: -100.0})
    assert [t for row in range(3) for t in sample_tokens(logits, [ask(row, SamplingParams(logit_bias=force))])[0][0]] \
        == [7, 7, 7], "logit_bias {7: 100} makes 7 the greedy choice"
    assert sample_tokens(logits, [ask(0, SamplingParams(logit_bias=ban))])[0][0] != [top], "{top: -100} bans it"
    row = torch.full((1, V), -5.0)                  # the order: bias, then the repetition penalty
    row[0, 1], row[0, 9] = 1.0, 2.5                 # token 1 is in the prompt, 9 is not
    got = sample_tokens(row, [SampleRequest(0, [], SamplingParams(logit_bias={1: 2.0}, repetition_penalty=1.3),
                                            3, 0, [1, 2, 3])])[0][0]
    assert got == [9], "bias first: (1 + 2) / 1.3 = 2.31 < 2.5 (the penalty first would give 1 / 1.3 + 2 = 2.77)"


@pytest.mark.assignment("sampler")
def test_logit_bias_stays_with_its_own_request_in_a_batch():
    """A logit_bias belongs to ONE request: in a batch of penalized requests (penalize handles
    them together, one [S, K+1, V] tensor), request s's bias moves request s's rows only, never a
    batch-mate's (x[:, ...] for x[s, ...] adds {7: 100} to every row: each batch-mate then picks 7).
    Each request's greedy tokens against an independent reference: its own bias added by hand,
    then reference_penalties, request by request; batch-mates with no bias, one with a bias of
    its own, one with drafts to verify."""
    torch.manual_seed(11)
    V, prompt, output = 40, [1, 2, 3], [4, 5]
    specs = [dict(logit_bias={7: 100.0}),                           # forces 7 on its own rows only
             dict(presence_penalty=0.5),                            # penalized, no bias of its own
             dict(repetition_penalty=1.3, logit_bias={3: -100.0, 11: 6.0}),
             dict(frequency_penalty=0.7)]
    for trial in range(6):
        logits = torch.randn(8, V) * 2
        logits[:, 7] = logits.min() - 1                             # 7 never wins on merit
        drafts = [] if trial % 2 else [int(logits[3].argmax())]     # request 3's raw argmax; odd: none
        reqs, want, row = [], [], 0
        for s, spec in enumerate(specs):
            p = SamplingParams(**spec)
            d = drafts if s == 3 else []
            reqs.append(SampleRequest(row, d, p, 3, len(output), prompt + output))
            rows = logits[row:row + len(d) + 1].clone()
            for t, b in (p.logit_bias or {}).items():
                rows[:, t] += b
            toks = []                                               # greedy verification, by hand
            for j in range(len(d) + 1):
                toks.append(int(reference_penalties(rows[j], prompt, output + toks, p).argmax()))
                if j == len(d) or toks[-1] != d[j]:
                    break
            want.append(toks)
            row += len(d) + 1
        got = [t for t, _, _ in sample_tokens(logits[:row], reqs)]
        assert got[0] == [7], f"trial {trial}: logit_bias {{7: 100}} must force 7 for its own request: got {got[0]}"
        for s in range(1, len(specs)):
            assert got[s] == want[s], (f"trial {trial}, request {s} ({specs[s]}): got {got[s]}, its own logits "
                                       f"and penalties give {want[s]} (another request's logit_bias leaked into its rows?)")


@pytest.mark.needs("sampler")
def test_allowed_token_ids_masks_every_other_token():
    """SamplingParams.allowed_token_ids (vLLM's): sample_tokens gives exactly the tokens of the same
    request on logits with every other token set to -inf by hand (greedy and seeded sampling, drafts
    to verify, with a penalty and a bias beside it); every token out is allowed; an allowed set of
    one token forces it; a batch-mate without it is untouched."""
    torch.manual_seed(4)
    V, prompt, output = 40, [1, 2, 3], [4, 5]
    for trial in range(24):
        K = trial % 3
        logits = torch.randn(K + 1, V)
        drafts = logits[:K].argmax(-1).tolist()             # raw argmaxes: often outside the set
        allowed = torch.randperm(V)[:5].tolist()
        extra = dict(repetition_penalty=1.3, logit_bias={allowed[0]: 1.5}) if trial % 2 else {}
        by_hand = torch.full_like(logits, float("-inf"))
        by_hand[:, allowed] = logits[:, allowed]
        for temp in (0.0, 0.8):
            got, want = (sample_tokens(x, [SampleRequest(0, drafts, SamplingParams(
                temperature=temp, seed=5, allowed_token_ids=a, **extra), 3, len(output), prompt + output)])[0][0]
                for x, a in ((logits, allowed), (by_hand, None)))
            assert got == want, f"trial {trial}, T {temp}: {got} with allowed_token_ids, {want} masked by hand"
            assert set(got) <= set(allowed), f"a token outside allowed_token_ids came out: {got}"
    logits = torch.randn(2, V)
    free = sample_tokens(logits, [ask(1, SamplingParams())])[0][0]
    out = sample_tokens(logits, [ask(0, SamplingParams(allowed_token_ids=[11])), ask(1, SamplingParams())])
    assert out[0][0] == [11] and out[1][0] == free, "one allowed token is forced; the batch-mate unchanged"
    from types import SimpleNamespace

    from support.checks import check_request
    for bad in ([-1], []):              # not a token id; nothing allowed (None: everything)
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="allowed_token_ids"):          # a token the model does not have
        check_request([1], SamplingParams(allowed_token_ids=[V]), SamplingParams,
                      SimpleNamespace(vocab_size=V, max_seq_len=64), 64, 4)


def penalized_batch(llm):
    """Prompts and params for the penalty tests: every penalty, a repeated prompt, a plain greedy
    batch-mate; "x y": the tiny model's greedy text repeats itself there, so every penalty changes it."""
    a, b, c = (llm.tokenizer.encode(t) for t in ("x y", "a b c a b c a b", "the cat the cat"))
    return [a, a, b, a, c, c], PENALIZED + [PENALIZED[2], SamplingParams(max_tokens=8, ignore_eos=True)]


@pytest.mark.assignment("sampler")
@pytest.mark.needs("engine")
def test_greedy_penalties_equal_a_naive_dense_loop(tiny_path):
    """LLM.generate with penalties (chunked prefill, a plain greedy batch-mate) gives the tokens
    of a naive loop: a dense forward pass over the whole sequence per token, reference_penalties
    on its last row, argmax."""
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20, max_num_batched_tokens=6)
    ids, params = penalized_batch(llm)
    outs = llm.generate(ids, params)
    for prompt, p, out in zip(ids[:5], params, outs):
        seq = list(prompt)
        for _ in range(p.max_tokens):
            row = llm.model(torch.tensor(seq), torch.arange(len(seq)))[-1]       # dense: no cache, no batch
            seq.append(int(reference_penalties(row, prompt, seq[len(prompt):], p).argmax()))
        assert out.token_ids == seq[len(prompt):], f"{p}: the engine's tokens differ from the naive loop"
    plain = {tuple(x): o.token_ids for x, o in zip(ids, llm.generate(ids, params[-1]))}
    assert all(o.token_ids != plain[tuple(x)] for x, o in zip(ids[:5], outs)), "each penalty was meant to matter"


@pytest.mark.assignment("ngram-drafter")
@pytest.mark.needs("engine", "sampler")
def test_speculation_keeps_penalized_greedy_tokens(tiny_path):
    """The same penalized batch with n-gram and draft-model speculation: verification row j
    counts drafts 0..j-1 in its penalty history, so the tokens are the plain engine's. (Greedy
    rows verify by argmax: rejection sampling is never called, so this grades the drafter.)"""
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20, max_num_batched_tokens=6)
    ids, params = penalized_batch(llm)
    outs = [o.token_ids for o in llm.generate(ids, params)]
    for drafter in ("ngram", tiny_path):     # the target as its own draft: its drafts ignore the penalties
        spec = LLM(tiny_path, kv_cache_bytes=4 << 20, speculative=drafter, num_speculative_tokens=3)
        assert [o.token_ids for o in spec.generate(ids, params)] == outs, f"{drafter}: speculation changed a token"
        assert 0 < spec.stats["accepted_tokens"] < spec.stats["draft_tokens"], f"{drafter}: no draft was judged"


@pytest.mark.needs("engine", "sampler")
def test_neutral_penalties_and_min_p_change_nothing_and_cost_nothing(tiny_path, monkeypatch):
    """repetition_penalty 1, presence and frequency 0, min_p 0 (what benchmarks send) are the
    defaults: the same tokens, greedy or seeded, and no penalty work when nobody asks."""
    import sampler
    calls = []
    real = sampler.penalize
    monkeypatch.setattr(sampler, "penalize", lambda *a: calls.append(a) or real(*a))
    neutral = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0)
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    for base in (SamplingParams(max_tokens=8, ignore_eos=True),
                 SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, top_p=0.9, seed=5)):
        plain = llm.generate(["neutral values"], base)[0].token_ids
        assert llm.generate(["neutral values"], SamplingParams(**{**vars(base), **neutral}))[0].token_ids == plain
    assert not calls, "no request asked for penalties: none may be computed"
    llm.generate(["neutral values"], SamplingParams(max_tokens=2, repetition_penalty=1.1))
    assert calls, "a penalized request must go through penalize"
    assert_no_leak(llm)

# --------------------------------------------- seeded sampling in the engine

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
    assert outs[-1].token_ids == alone, "a seeded request's tokens must not depend on the batch it runs in"
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

# -------------------------------------------------------------- stop strings

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


def first_stop(stops, text):
    """Brute force: (end, length) of the earliest-ending stop string in text,
    the longest of those ending there; None if none occurs."""
    ends = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    return (min(ends)[0], -min(ends)[1]) if ends else None


def open_match(stops, text):
    """Brute force: the longest proper prefix of a stop string that text ends with."""
    return max(k for s in stops for k in range(len(s)) if text.endswith(s[:k]))


@pytest.mark.assignment("stop-strings")
def test_stop_string_matching_equals_a_naive_search():
    """StopStrings.feed over random text fed in random pieces, against
    str.find: the same first stop string (the longest of those ending at the
    same place), at the same place; `partial` equals the longest suffix of the
    text so far that starts some stop string. Stop strings with repeated
    prefixes (aab, abab) exercise the failure function's fallbacks."""
    import random
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
    assert final.finish_reason == "stop" and streamed == final.text == base.text[:base.text.index(stop)], \
        "a stop string ends the request: the stream equals the text, cut before the stop string"


@pytest.mark.assignment("stop-strings")
@pytest.mark.needs("engine")
def test_stop_conditions(tiny_llm):
    llm = tiny_llm
    base = llm.generate(["stop test"], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 30, \
        "without a stop condition a request runs to max_tokens (finish_reason length)"
    # a stop token id ends generation right after it appears
    target = base.token_ids[5]
    o = llm.generate(["stop test"], SamplingParams(max_tokens=30, stop_token_ids=[target]))[0]
    assert o.finish_reason == "stop" and o.token_ids == base.token_ids[:base.token_ids.index(target) + 1], \
        "a stop token id ends generation right after it and stays in token_ids"
    # a stop string is cut from the text
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    o = llm.generate(["stop test"], SamplingParams(max_tokens=30, stop=[stop], ignore_eos=True))[0]
    assert o.finish_reason == "stop" and o.text == text[:text.index(stop)], \
        "a stop string ends generation and is cut from the text"
    # EOS stops unless ignore_eos; the tiny model rarely says EOS, so make it the stop point
    eos = llm.tokenizer.eos_token_id
    llm.tokenizer.eos_token_id = target
    try:
        o = llm.generate(["stop test"], SamplingParams(max_tokens=30))[0]
        assert o.finish_reason == "stop" and o.token_ids[-1] == target, \
            "EOS ends generation (finish_reason stop) unless ignore_eos"
        o = llm.generate(["stop test"], SamplingParams(max_tokens=30, ignore_eos=True))[0]
        assert o.token_ids == base.token_ids, "ignore_eos: EOS must not stop generation"
    finally:
        llm.tokenizer.eos_token_id = eos
    assert_no_leak(llm)

# ------------------------------------- structured outputs: a grammar as a mask

class AllowOnly:
    """A stand-in grammar (support/structured.Grammar's interface) that allows a fixed set of tokens:
    its bitmask is built here, independently, bit t % 32 of int32 word t // 32."""

    def __init__(self, allowed):
        self.allowed = sorted(allowed)

    def bitmask(self, V):
        words = [0] * -(-V // 32)
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


@pytest.mark.needs("sampler")
def test_a_grammar_mask_keeps_exactly_the_tokens_it_allows():
    """A grammar's bitmask (SampleRequest.grammar) turns into -inf logits: sample_tokens gives exactly the
    tokens of the same request on logits masked by hand, greedy and seeded, with a bias beside it and a
    batch-mate verifying drafts (so the rows are [S, K+1]); tokens 31 and 63 (the words' sign bits) and a
    vocabulary that is no multiple of 32 included; the unconstrained batch-mate is unchanged."""
    torch.manual_seed(7)
    V = 70
    for trial in range(16):
        allowed = {31, 63} | set(torch.randperm(V)[:3].tolist()) if trial % 2 else set(torch.randperm(V)[:4].tolist())
        logits = torch.randn(4, V)
        by_hand = logits.clone()
        by_hand[0, [t for t in range(V) if t not in allowed]] = float("-inf")
        drafts = logits[1:3].argmax(-1).tolist()
        extra = dict(logit_bias={max(allowed): 2.0}) if trial % 3 == 0 else {}
        for temp in (0.0, 0.9):
            p = SamplingParams(temperature=temp, seed=trial, structured_outputs={"regex": "x"}, **extra)
            free = SamplingParams(temperature=temp, seed=99)
            mate = SampleRequest(1, drafts, free, 5, 2)
            got = sample_tokens(logits, [SampleRequest(0, [], p, 3, 4, grammar=AllowOnly(allowed)), mate])
            plain = SamplingParams(temperature=temp, seed=trial, **extra)
            want = sample_tokens(by_hand, [SampleRequest(0, [], plain, 3, 4), mate])
            assert got[0][0] == want[0][0], f"trial {trial}, T {temp}: {got[0][0]} under the grammar, {want[0][0]} by hand"
            assert set(got[0][0]) <= allowed, f"a token the grammar does not allow came out: {got[0][0]} not in {allowed}"
            assert got[1][0] == want[1][0], "the unconstrained batch-mate's tokens must not change"
    one = sample_tokens(torch.randn(1, V), [SampleRequest(0, [], SamplingParams(structured_outputs={"regex": "x"}),
                                                          0, 0, grammar=AllowOnly({63}))])
    assert one[0][0] == [63], "a grammar that allows one token (bit 31 of its word) forces it"


@pytest.mark.parametrize("spec,match", [({"json": {"type": "objectx"}}, "objectx"), ({"regex": "[0-9"}, "regex"),
                                        ({"json": "{not json"}, "not valid JSON"), ({"choice": []}, "choice"),
                                        ({"json": {}, "regex": "a"}, "exactly one"), ({"yaml": "a"}, "exactly one"),
                                        ({"json_object": False}, "json_object"), ({"grammar": "start: nope"}, "grammar"),
                                        ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
                                        ({"json": "false"}, "accepts no value"),
                                        ({"json": False}, "accepts no value")])
def test_a_grammar_that_does_not_compile_is_refused_with_params(spec, match):
    """SamplingParams(structured_outputs=...) compiles the grammar when it is made: a bad one is a ValueError
    naming the field and the problem, before anything reaches the engine."""
    with pytest.raises(ValueError, match="structured_outputs") as e:
        SamplingParams(structured_outputs=spec)
    assert match in str(e.value), str(e.value)


def test_vllm_structured_output_options_shape_the_json(real_tokenizer):
    """structured_outputs takes vLLM's options beside its one kind (a client that sends every field sends the
    others at null or false): JSON is json.dumps' layout by default, compact with disable_any_whitespace, any
    whitespace the pattern allows with whitespace_pattern; objects are open (JSON Schema) unless
    disable_additional_properties closes every one; structural_tag is refused by name."""
    from support.structured import make_grammar

    def accepts(spec, text):
        grammar = make_grammar(spec, real_tokenizer)
        try:
            for t in real_tokenizer.encode(text):
                grammar.consume(t)
        except ValueError:                                  # a token the grammar refuses
            return False
        return grammar.matcher.is_accepting()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "o": {"type": "object"}}, "required": ["a"]}
    nulls = {"regex": None, "choice": None, "grammar": None, "json_object": False, "structural_tag": None,
             "disable_any_whitespace": False, "disable_additional_properties": False, "whitespace_pattern": None}
    assert accepts({"json": schema, **nulls}, '{"a": 1, "b": 2}'), "a schema's objects are open by default"
    closed = {"json": schema, "disable_additional_properties": True}
    assert not accepts(closed, '{"a": 1, "b": 2}') and not accepts(closed, '{"a": 1, "o": {"x": 1}}')
    assert accepts(closed, '{"a": 1, "o": {}}')
    assert accepts({"json": schema}, '{"a": 1}') and not accepts({"json": schema}, '{"a":1}'), "json.dumps' layout"
    assert accepts({"json": schema, "disable_any_whitespace": True}, '{"a":1}')
    assert not accepts({"json": schema, "disable_any_whitespace": True}, '{"a": 1}')
    assert accepts({"json": schema, "whitespace_pattern": r"[ \n]*"}, '{\n  "a": 1\n}')
    named = {"type": "object", "properties": {"enum": {"type": "object"}}}   # a property named as a keyword
    assert not accepts({"json": named, "disable_additional_properties": True}, '{"enum": {"x": 1}}')
    assert accepts({"json": {"type": "array", "uniqueItems": False}}, '[1, 1]'), "uniqueItems: false asks nothing"
    for anything in (True, "true", {}):                     # JSON Schema's true (and {}): any JSON value
        assert all(accepts({"json": anything}, v) for v in ('[1, "a"]', '{"k": null}', '2.5')), anything
    with pytest.raises(ValueError, match="structural_tag"):
        SamplingParams(structured_outputs={"regex": "a", "structural_tag": "<t>"})


def json_checker(schema):
    import jsonschema

    def check(text):
        jsonschema.validate(json.loads(text), schema)       # raises with what is wrong
        return True
    return check


@pytest.mark.needs("engine", "sampler", "copy-on-write")
def test_structured_outputs_hold_in_the_engine_with_forks_drafts_preemption_and_overlap(tiny_path):
    """The tiny random model under grammars (a regex, a choice, a bounded JSON schema) behind free requests:
    every constrained output that stops is valid, each of n = 2 samples follows its own grammar state, an
    n-gram drafter proposes nothing for them, and their tokens are a roomy synchronous engine's when the
    pool preempts them or the engine overlaps its steps; the free requests' tokens are those of a run
    without the constrained ones."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tag": {"enum": ["a", "bb", "ccc"]}},
              "required": ["ok", "n", "tag"], "additionalProperties": False}
    specs = [{"regex": r"[0-9]{3}-[a-z]{2,12}"}, {"choice": ["yes", "no", "maybe"]}, {"json": schema}]
    checks = [lambda t: bool(re.fullmatch(r"[0-9]{3}-[a-z]{2,12}", t)), lambda t: t in ("yes", "no", "maybe"),
              json_checker(schema)]
    prompts = [f"{w} " * 40 for w in ("free", "text", "code", "answer", "json")]    # 40 tokens each

    def params(T):
        free = [SamplingParams(max_tokens=40, temperature=T, seed=9, ignore_eos=True)] * 2
        return free + [SamplingParams(max_tokens=40, temperature=T, seed=i, n=2, structured_outputs=s)
                       for i, s in enumerate(specs)]

    alone = LLM(tiny_path, kv_cache_bytes=4 << 20)
    free_alone = {T: [o.token_ids for o in alone.generate(prompts[:2], params(T)[:2])] for T in (0.0, 0.8)}
    reference = None
    per_token = 512                                   # the tiny model's K and V bytes per token (float32)
    for options in (dict(kv_cache_bytes=4 << 20), dict(kv_cache_bytes=4 << 20, speculative="ngram"),
                    dict(kv_cache_bytes=4 << 20, overlap=True),
                    dict(kv_cache_bytes=12 * 16 * per_token, max_num_batched_tokens=8)):   # 12 blocks: preempts
        llm = LLM(tiny_path, **options)
        outs = {T: llm.generate(prompts, params(T)) for T in (0.0, 0.8)}
        for T, out in outs.items():
            for o, check, spec in zip(out[2:], checks, specs):
                for c in o.outputs:
                    assert c.finish_reason in ("stop", "length"), (options, c.finish_reason, o.error)
                    assert c.finish_reason == "length" or check(c.text), f"{options}, T {T}: {c.text!r} breaks {spec}"
            if T == 0 or "speculative" not in options:    # sampled drafts: the same distribution, other tokens
                assert [o.token_ids for o in out[:2]] == free_alone[T], f"{options}: the free requests' tokens changed"
        got = {T: [[c.token_ids for c in o.outputs] for o in out[2:]] for T, out in outs.items()}
        reference = reference or got
        assert got == reference, f"{options}: the constrained tokens differ from the roomy synchronous engine's"
        if options.get("speculative"):
            assert all(o.metrics.draft_tokens == 0 for o in outs[0.0][2:]), "a constrained request must not be drafted"
        if options.get("max_num_batched_tokens"):
            assert any(o.metrics.preemptions for T in outs for o in outs[T][2:]), "the tight pool must preempt one"
        assert_no_leak(llm)
    stopped = sum(c.finish_reason == "stop" for T in reference for o in outs[T][2:] for c in o.outputs)
    assert stopped >= 6, f"only {stopped} of 12 constrained outputs finished: the grammar never ended them"
    assert len({tuple(map(tuple, o)) for o in reference[0.8]}) > 1


@pytest.mark.needs("engine", "sampler")
def test_a_grammar_that_fails_mid_request_fails_its_request_alone(tiny_path):
    """A grammar that raises while its mask is made (the library in an error state), or that refuses a token:
    its request finishes with finish_reason "error" naming the cause; the constrained and free requests beside
    it finish as they would alone; no KV block leaks."""
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    params = [SamplingParams(max_tokens=8, structured_outputs={"regex": "[a-z]{4,8}"}),
              SamplingParams(max_tokens=8, structured_outputs={"choice": ["yes", "no"]}),
              SamplingParams(max_tokens=8, ignore_eos=True)]
    prompts = ["one", "two", "three"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for breaks in ("bitmask", "consume"):
        rids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        grammar = llm.requests[rids[0]].seqs[0].grammar

        def broken(*args):
            raise RuntimeError(f"the grammar's {breaks} broke")
        setattr(grammar, breaks, broken)
        done = {}
        while llm.has_unfinished_requests():
            done.update((o.request_id, o) for o in llm.step() if o.finished)
        bad = done[rids[0]]
        assert bad.outputs[0].finish_reason == "error" and f"{breaks} broke" in bad.error, (breaks, bad.error)
        assert [done[r].outputs[0].token_ids for r in rids[1:]] == alone[1:], f"{breaks}: a batch-mate changed"
        assert_no_leak(llm)


@pytest.mark.needs("engine", "sampler", "copy-on-write")
def test_real_model_structured_outputs_validate(real_path):
    """The default model (SmolLM2-135M-Instruct) under JSON schemas (required fields, enums, bounded numbers
    and strings, arrays, a nested object), JSON mode, a regex and a choice list, greedy and sampled: every
    output that finishes with "stop" parses and validates, at max_tokens 200 at least 3 in 4 do, and one
    cut at max_tokens ends with finish_reason "length"."""
    schemas = [
        {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                          "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                          "genre": {"enum": ["drama", "comedy", "horror", "documentary"]}},
         "required": ["title", "year", "genre"], "additionalProperties": False},
        {"type": "object", "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 30},
                                          "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
                                          "forecast": {"type": "array", "items": {"enum": ["sun", "rain", "snow"]},
                                                       "minItems": 1, "maxItems": 3}},
         "required": ["city", "temperature_c", "forecast"], "additionalProperties": False},
        {"type": "object", "properties": {"owner": {"type": "object", "properties": {
            "first": {"type": "string", "maxLength": 20}, "last": {"type": "string", "maxLength": 20}},
            "required": ["first", "last"], "additionalProperties": False}, "pets": {"type": "integer", "minimum": 0}},
         "required": ["owner", "pets"], "additionalProperties": False},
    ]
    asks = ["Recommend a movie.", "What is the weather like in Oslo?", "Describe a pet owner."]
    llm = LLM(real_path, kv_cache_bytes=256 << 20)
    tok = llm.tokenizer
    prompts, params, checks = [], [], []
    for i, (schema, q) in enumerate(zip(schemas, asks)):
        for T in (0.0, 0.7):
            prompts.append(tok.apply_chat_template([{"role": "user", "content": q + " Answer in JSON."}]))
            params.append(SamplingParams(max_tokens=200, temperature=T, seed=i, structured_outputs={"json": schema}))
            checks.append(json_checker(schema))
    for T in (0.0, 0.7):     # greedy, this model repeats keys until max_tokens: 40 here, to keep the test short
        prompts.append(tok.apply_chat_template([{"role": "user", "content": "Give me a JSON object about a car."}]))
        params.append(SamplingParams(max_tokens=40 if T == 0 else 200, temperature=T, seed=5,
                                     structured_outputs={"json_object": True}))
        checks.append(lambda t: isinstance(json.loads(t), dict))
    prompts += [tok.apply_chat_template([{"role": "user", "content": "Is the sky blue?"}])] * 2
    params += [SamplingParams(max_tokens=20, temperature=T, seed=6, structured_outputs={"choice": ["yes", "no"]})
               for T in (0.0, 0.7)]
    checks += [lambda t: t in ("yes", "no")] * 2
    prompts.append(tok.apply_chat_template([{"role": "user", "content": "Write a date."}]))
    params.append(SamplingParams(max_tokens=20, temperature=0.7, seed=7,
                                 structured_outputs={"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"}))
    checks.append(lambda t: bool(re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", t)))
    outs = llm.generate(prompts, params)
    stopped = 0
    for o, check, p in zip(outs, checks, params):
        c = o.outputs[0]
        assert c.finish_reason in ("stop", "length"), o.error
        if c.finish_reason == "stop":
            stopped += 1
            assert check(c.text), f"{c.text!r} breaks {p.structured_outputs}"   # json: raises what is wrong
    assert stopped >= 0.75 * len(outs), f"only {stopped} of {len(outs)} structured outputs finished in 200 tokens"
    cut = llm.generate([prompts[0]], SamplingParams(max_tokens=5, structured_outputs={"json": schemas[0]}))[0]
    assert cut.outputs[0].finish_reason == "length" and cut.outputs[0].text.startswith("{"), cut.outputs[0].text
    assert_no_leak(llm)
