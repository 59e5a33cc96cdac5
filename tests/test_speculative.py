"""Assignment: speculative.py -- draft, verify, exact rejection sampling.

To pass, implement:
  * rejection_sample(target_probs [k+1, V], draft_probs [k, V], draft_tokens [k]):
    accept draft i with probability min(1, q/p), resample the first rejection
    from normalize(max(q - p, 0)), add a bonus token when all are accepted.
    The emitted tokens must follow the TARGET distribution exactly (checked
    with a chi-square test over 100k samples), and the batched version must
    agree with it draw for draw;
  * NgramDrafter (prompt lookup) and ModelDrafter (a draft model with its own
    paged KV cache and rollback);
  * verification inside LLM.step: greedy outputs identical to the engine
    without speculation, caches rolled back past rejected drafts, no leaks.
"""
import os

import pytest
import torch
from helpers import save_checkpoint, tiny_model

from cache import AttentionContext
from engine import LLM
from sampler import Sampled, SamplingParams
from speculative import NgramDrafter, rejection_sample, rejection_sample_batched


def onehot(tokens, V):
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


# ------------------------------------------------------------ deterministic cases

@pytest.mark.assignment("rejection-sampling")
def test_all_accepted_gives_k_drafts_plus_bonus():
    V = 6
    target = onehot([2, 4, 1, 5], V)                   # the target agrees with every draft
    out = rejection_sample(target, onehot([2, 4, 1], V), torch.tensor([2, 4, 1]))
    assert out == [2, 4, 1, 5], "all k drafts accepted: the k drafts plus a bonus token from the last target row"


@pytest.mark.assignment("rejection-sampling")
def test_first_rejected_gives_exactly_one_corrected_token():
    V = 6
    target = onehot([3, 4, 1, 5], V)
    out = rejection_sample(target, onehot([2, 4, 1], V), torch.tensor([2, 4, 1]))
    assert out == [3], "greedy: stop at the first disagreement and emit the target's argmax"
    out = rejection_sample(onehot([2, 0, 1, 5], V), onehot([2, 4, 1], V), torch.tensor([2, 4, 1]))
    assert out == [2, 0], "accepted prefix, then the correction"


@pytest.mark.assignment("rejection-sampling")
def test_a_draft_the_target_never_emits_is_always_rejected():
    target = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    for seed in range(50):
        for draft in ([1.0, 0.0, 0.0], [0.0, 1.0, 0.0]):          # the draft's own p(x): 1, or 0 too
            out = rejection_sample(target, torch.tensor([draft]), torch.tensor([0]),
                                   torch.Generator().manual_seed(seed))
            assert len(out) == 1 and out[0] in (1, 2), \
                f"a draft the target gives probability 0 is always rejected (draft p = {draft})"


def random_dists(g, *shape):
    x = torch.rand(*shape, generator=g) ** 3
    return x / x.sum(-1, keepdim=True)


def residual_reference(target, draft, n_acc, n):
    """What the final token must be drawn from, written out: the normalized
    max(q - p, 0) at the first rejection, or the target's next row (bonus)."""
    if n_acc == n:
        return target[n]
    r = (target[n_acc] - draft[n_acc]).clamp(min=0)
    return r / r.sum()


@pytest.mark.assignment("rejection-sampling")
def test_batched_agrees_with_single_draw_for_draw():
    g = torch.Generator().manual_seed(0)
    B, K, V = 16, 4, 7
    target, draft = random_dists(g, B, K + 1, V), random_dists(g, B, K, V)
    tokens = torch.multinomial(draft.view(-1, V), 1, generator=g).view(B, K)
    num = [K, 1, 3, 2, 0] * 3 + [K]                        # ragged draft counts, none at all included
    accept_u = torch.ones(B, K)
    for b in range(B):                                     # the uniforms the single version will draw
        accept_u[b, :num[b]] = torch.rand(num[b], generator=torch.Generator().manual_seed(100 + b))
    n_acc, final = rejection_sample_batched(target, draft, tokens, torch.tensor(num), accept_u)
    for b in range(B):
        n = num[b]
        single = rejection_sample(target[b, :n + 1], draft[b, :n], tokens[b, :n],
                                  torch.Generator().manual_seed(100 + b))
        assert int(n_acc[b]) == len(single) - 1, f"row {b}: accepted {int(n_acc[b])} vs single {len(single) - 1}"
        assert single[:-1] == tokens[b, :len(single) - 1].tolist(), "the accepted tokens are a prefix of the drafts"
        ref = residual_reference(target[b], draft[b], int(n_acc[b]), n)
        torch.testing.assert_close(final[b] / final[b].sum(), ref, msg=f"row {b}: wrong final distribution")
        assert ref[single[-1]] > 0, f"row {b}: the single version drew a token the final distribution excludes"


@pytest.mark.assignment("rejection-sampling")
def test_batched_never_accepts_padding_and_keeps_q_when_nothing_is_left_to_resample():
    """Padding past num_drafts is no draft, however acceptable (q = p, uniforms 0): row 0 has 1
    of 3 drafts, so it accepts 1 and draws the bonus from q's row 1. A rejection where q = p
    (uniform 1: not < q / p = 1) leaves max(q - p, 0) = 0: the extra token is drawn from q."""
    g = torch.Generator().manual_seed(2)
    B, K, V = 2, 3, 5
    target = random_dists(g, B, K + 1, V)
    draft = target[:, :K].clone()                                         # q = p at every draft
    tokens = torch.multinomial(draft.view(-1, V), 1, generator=g).view(B, K)
    u = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    n_acc, final = rejection_sample_batched(target, draft, tokens, torch.tensor([1, 3]), u)
    assert n_acc.tolist() == [1, 0], f"accepted {n_acc.tolist()}: row 0 has ONE draft (the rest is padding)"
    torch.testing.assert_close(final[0], target[0, 1], msg="row 0: every draft accepted, the bonus row q")
    torch.testing.assert_close(final[1] / final[1].sum(), target[1, 0],
                               msg="row 1: q = p leaves no residual mass: the extra token comes from q")


@pytest.mark.assignment("rejection-sampling")
def test_batched_makes_its_masks_on_the_inputs_device():
    """The batched rule runs where its inputs are (on CUDA in the engine): a tensor it makes
    itself (the draft-count mask, torch.arange(K) without device=) on the CPU meets CUDA
    inputs and raises, a failure no CPU test sees. "meta" tensors stand in for CUDA (shapes
    and dtypes, no data): with draft probabilities and with None (a deterministic drafter),
    the results must come back on "meta", num_accepted [B] and final [B, V]."""
    B, K, V = 2, 3, 5
    target, draft = torch.empty(B, K + 1, V, device="meta"), torch.empty(B, K, V, device="meta")
    tokens = torch.zeros(B, K, dtype=torch.long, device="meta")
    num, u = torch.zeros(B, dtype=torch.long, device="meta"), torch.empty(B, K, dtype=torch.float64, device="meta")
    for probs in (draft, None):
        case = "draft_probs given" if probs is not None else "draft_probs None"
        try:
            n_acc, final = rejection_sample_batched(target, probs, tokens, num, u)
        except NotImplementedError:        # an unfinished assignment says so itself
            raise
        except RuntimeError as e:
            raise AssertionError(f"{case}: inputs on a device other than the CPU raise (a tensor made on the CPU, "
                                 f"torch.arange without device=?): {e}") from e
        assert n_acc.device.type == final.device.type == "meta", \
            f"{case}: results on {n_acc.device}, {final.device}, not the inputs' device"
        assert n_acc.shape == (B,) and final.shape == (B, V), \
            f"{case}: shapes {tuple(n_acc.shape)}, {tuple(final.shape)}, expected ({B},) and ({B}, {V})"


@pytest.mark.assignment("rejection-sampling")
def test_batched_compares_the_uniforms_at_their_own_precision():
    """Accept iff u < q / p, u as given (the sampler's uniforms are float64): rounded to q's
    float32 first, a u just below q / p rounds up to it and rejects a draft it must accept.
    Row 0: q = p = (0.5, 0.5), u = 1 - 2**-30, a valid uniform (< 1 = q / p): always accepted
    (float32 rounds it to 1.0, which is not < 1). Row 1: q = (0.25, 0.75), p = (0.5, 0.5),
    draft 0: q / p = 0.5 exactly, u = 0.5 - 2**-40 < 0.5 accepts (float32: 0.5, rejects)."""
    target = torch.tensor([[[0.5, 0.5], [0.25, 0.75]],
                           [[0.25, 0.75], [0.6, 0.4]]])                # [B=2, K+1=2, V=2]
    draft = torch.tensor([[[0.5, 0.5]], [[0.5, 0.5]]])
    u = torch.tensor([[1 - 2 ** -30], [0.5 - 2 ** -40]], dtype=torch.float64)
    n_acc, final = rejection_sample_batched(target, draft, torch.tensor([[1], [0]]), torch.tensor([1, 1]), u)
    assert n_acc.tolist() == [1, 1], \
        f"accepted {n_acc.tolist()}, expected [1, 1]: u < q / p in float64 accepts (u rounded to float32?)"
    torch.testing.assert_close(final, target[:, 1], msg="both drafts accepted: the extra token is the bonus row q")


@pytest.mark.assignment("rejection-sampling")
def test_batched_keeps_q_per_row_when_a_row_has_no_residual():
    """The no-residual fallback (max(q - p, 0) = 0 everywhere: a rejection of probability 0,
    here forced by u = 1 where q = p) is decided row by row: a batch where another row HAS a
    residual must not leave this row an all-zero distribution to draw from (nor hand a row
    with a residual its q). Rows, in order: q = p = (0.5, 0.5), u = 1: rejected, no residual,
    the extra token from q = (0.5, 0.5); q = (0.9, 0.1), p = (0.2, 0.8), draft 1, u = 0.99 >
    q / p = 0.125: rejected, residual (0.7, 0); again q = p, no residual. The same with
    draft_probs None (one-hot p): q one-hot at the draft has no residual, q = (0.3, 0.7) with
    draft 1 rejected has (0.3, 0)."""
    target = torch.tensor([[[0.5, 0.5], [0.3, 0.7]],
                           [[0.9, 0.1], [0.3, 0.7]],
                           [[0.5, 0.5], [0.1, 0.9]]])                  # [B=3, K+1=2, V=2]
    draft = torch.tensor([[[0.5, 0.5]], [[0.2, 0.8]], [[0.5, 0.5]]])
    u = torch.tensor([[1.0], [0.99], [1.0]], dtype=torch.float64)
    tokens, num = torch.tensor([[1], [1], [0]]), torch.tensor([1, 1, 1])
    n_acc, final = rejection_sample_batched(target, draft, tokens, num, u)
    assert n_acc.tolist() == [0, 0, 0], f"accepted {n_acc.tolist()}: u = 1 and u > q / p reject"
    torch.testing.assert_close(final, torch.tensor([[0.5, 0.5], [0.7, 0.0], [0.5, 0.5]]),
                               msg=lambda m: f"the extra token's distribution, per row (q where the residual "
                                             f"is empty, max(q - p, 0) where it is not): {m}")
    target = torch.tensor([[[0.0, 1.0], [0.3, 0.7]],
                           [[0.3, 0.7], [0.5, 0.5]]])
    n_acc, final = rejection_sample_batched(target, None, torch.tensor([[1], [1]]), torch.tensor([1, 1]),
                                            torch.tensor([[1.0], [0.99]], dtype=torch.float64))
    assert n_acc.tolist() == [0, 0], f"draft_probs None: accepted {n_acc.tolist()}: u = 1 and u > q rejects"
    torch.testing.assert_close(final, torch.tensor([[0.0, 1.0], [0.3, 0.0]]),
                               msg=lambda m: f"draft_probs None: the extra token's distribution, per row: {m}")


@pytest.mark.assignment("rejection-sampling")
def test_deterministic_drafts_match_one_hot_draft_probs():
    """draft_probs=None (an n-gram drafter) must equal passing the one-hots."""
    g = torch.Generator().manual_seed(5)
    B, K, V = 8, 3, 6
    target = random_dists(g, B, K + 1, V)
    tokens = torch.randint(0, V, (B, K), generator=g)
    u, n = torch.rand(B, K, generator=g), torch.tensor([3, 2, 1, 0, 3, 3, 2, 1])
    a = rejection_sample_batched(target, None, tokens, n, u)
    b = rejection_sample_batched(target, torch.nn.functional.one_hot(tokens, V).float(), tokens, n, u)
    assert torch.equal(a[0], b[0]), "draft_probs=None must accept the same drafts as one-hot draft probabilities"
    torch.testing.assert_close(a[1] / a[1].sum(-1, keepdim=True), b[1] / b[1].sum(-1, keepdim=True))


# ------------------------------------------------------- distribution exactness

def chi_square(counts, probs):
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", ["random", "draft_equals_target", "draft_has_zeros", "deterministic"])
@pytest.mark.assignment("rejection-sampling")
@pytest.mark.needs("sampler")
def test_every_position_follows_the_target_distribution(k, case):
    """100k trials of one verification pass: drafts sampled from p, the final
    token drawn by the engine's sampler. The token emitted at position i
    (given the pass got that far) must be distributed as q_i -- every drafted
    position, and the bonus token after k accepted drafts."""
    from sampler import draw
    g = torch.Generator().manual_seed(k * 7 + len(case))
    V, N = 5, 100_000
    target = random_dists(g, k + 1, V)
    if case == "random" or case == "deterministic":
        draft = random_dists(g, k, V)
    elif case == "draft_equals_target":
        draft = target[:k].clone()
    else:                                  # the draft puts no mass where the target has some
        draft = random_dists(g, k, V)
        draft[:, :2] = 0
        draft /= draft.sum(-1, keepdim=True)
    tokens = torch.multinomial(draft, N, replacement=True, generator=g).T       # [N, k]
    if case == "deterministic":            # an n-gram drafter: its draft has probability 1
        draft_probs = None
    else:
        draft_probs = draft.expand(N, -1, -1)
    n_acc, final = rejection_sample_batched(target.expand(N, -1, -1), draft_probs, tokens,
                                            torch.full((N,), k), torch.rand(N, k, generator=g))
    last = draw(final, torch.rand(N, generator=g, dtype=torch.float64))
    for i in range(k + 1):
        reached = n_acc >= i                                     # passes that emitted a token at position i
        at_i = torch.where(n_acc[reached] > i, tokens[reached, min(i, k - 1)], last[reached])
        counts = torch.bincount(at_i, minlength=V).float()
        stat, df = chi_square(counts, target[i])
        # 99.9th percentile of chi-square with df = 4 is 18.47
        assert stat < 18.47, f"position {i} ({int(reached.sum())} samples): chi-square {stat:.1f} (df {df}): " \
                             f"not distributed as the target"
    freq = torch.bincount(torch.where(n_acc > 0, tokens[:, 0], last), minlength=V).float() / N
    assert 0.5 * (freq - target[0]).abs().sum() < 0.01, \
        "the first emitted token is distributed as the target's first row"
    if case not in ("draft_equals_target", "deterministic"):
        assert 0.5 * (freq - draft[0]).abs().sum() > 0.05, "the test must be able to tell q from p"


# ---------------------------------------------------------------- the n-gram drafter

@pytest.mark.assignment("ngram-drafter")
def test_ngram_drafter_finds_the_most_recent_longest_match():
    d = NgramDrafter(n_max=3, n_min=1)
    assert d.propose_one([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1], "most recent occurrence wins"
    assert d.propose_one([5, 6, 1, 2, 8, 2], 3) == [8, 2], "falls back to shorter n-grams"
    assert d.propose_one([1, 2, 3], 2) == [], "no earlier occurrence, no draft"
    assert d.propose_one([1, 2, 3, 4, 9, 3, 4, 7, 2, 3, 4], 2) == [9, 3], "the LONGEST suffix n-gram first"


def ngram_reference(ids, k, n_max, n_min):
    """Prompt lookup written differently: for n from n_max down, the last
    start s < len - n where ids[s:s+n] equals the suffix, as a string search."""
    for n in range(n_max, n_min - 1, -1):
        if len(ids) <= n:
            continue
        starts = [s for s in range(len(ids) - n) if ids[s:s + n] == ids[-n:]]
        if starts:
            return ids[starts[-1] + n:starts[-1] + n + k]
    return []


@pytest.mark.assignment("ngram-drafter")
def test_ngram_drafter_against_a_reference_on_random_sequences():
    """Random token sequences over 2-4 symbols (many repeats), every n range
    and draft length: the drafts equal the reference's, never more than k. The symbols are ids
    whose decimal digits overlap (1, 11, 112, ...): a match is of whole ids, not of their text."""
    import random
    rng = random.Random(0)
    for _ in range(3000):
        n_min = rng.randint(1, 3)
        n_max = n_min + rng.randint(0, 3)
        symbols = rng.sample([0, 1, 2, 11, 12, 21, 112, 49151], rng.randint(2, 4))
        ids, k = [rng.choice(symbols) for _ in range(rng.randint(1, 25))], rng.randint(1, 6)
        got = NgramDrafter(n_max=n_max, n_min=n_min).propose_one(ids, k)
        assert got == ngram_reference(ids, k, n_max, n_min), f"n {n_min}..{n_max}, k {k}, ids {ids}: {got}"


# ------------------------------------------------------- inside the engine, real model

# ChatML written out: the instruct model copies the passage, so prompt lookup pays off.
COPY = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nRepeat the following text exactly, word for word:\n\nThe quick brown fox jumps "
        "over the lazy dog. The dog sleeps in the sun while the fox runs into the forest.<|im_end|>\n"
        "<|im_start|>assistant\n")
PROMPTS = [COPY, "What is the capital of France?", "1, 2, 3, 4, 5, 6,", "Hello " * 30]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_outputs(real_path):
    llm = LLM(real_path, kv_cache_bytes=64 << 20)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def assert_no_leak(llm):
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    llm.block_manager.check_invariants()
    if hasattr(llm.drafter, "bm"):
        assert llm.drafter.bm.num_free_blocks == llm.drafter.bm.num_blocks, "draft cache leaked"


@pytest.mark.timeout(600)
@pytest.mark.assignment("ngram-drafter")
@pytest.mark.needs("engine")
def test_ngram_greedy_is_exact_and_accepts_copies(real_path, plain_outputs):
    llm = LLM(real_path, kv_cache_bytes=64 << 20, speculative="ngram", num_speculative_tokens=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs, \
        "greedy n-gram speculation gives exactly plain decoding's tokens"
    m = outs[0].metrics
    assert m.draft_tokens > 0 and m.acceptance_rate > 0.5, f"copying: acceptance {m.acceptance_rate}"
    assert m.verify_steps < 12, "accepted drafts must save target passes (16 tokens)"
    assert_no_leak(llm)


@pytest.mark.timeout(600)
@pytest.mark.assignment("ngram-drafter")
@pytest.mark.needs("engine")
def test_ngram_greedy_is_exact_under_preemption(real_path, plain_outputs):
    llm = LLM(real_path, kv_cache_bytes=24 * 4 * 46080, block_size=4, speculative="ngram",
              num_speculative_tokens=3)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.scheduler.num_preemptions >= 1, "the pool was meant to force preemption"
    assert [o.token_ids for o in outs] == plain_outputs, "greedy speculation stays exact across preemptions"
    assert_no_leak(llm)


@pytest.mark.timeout(600)
@pytest.mark.needs("engine", "sampler")
def test_target_as_its_own_draft_accepts_everything(real_path, plain_outputs):
    llm = LLM(real_path, kv_cache_bytes=64 << 20, speculative=real_path, num_speculative_tokens=3)
    outs = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs[:2]
    assert llm.stats["accepted_tokens"] == llm.stats["draft_tokens"], "a perfect draft is never rejected"
    assert_no_leak(llm)


@pytest.fixture(scope="module")
def bad_draft_path(tmp_path_factory, real_path):
    """A tiny random model with SmolLM2's vocabulary: a draft that is nearly always wrong."""
    return save_checkpoint(tiny_model(seed=3, vocab_size=49152, max_seq_len=8192),
                           tmp_path_factory.mktemp("bad_draft"), tokenizer_from=real_path)


@pytest.mark.timeout(600)
@pytest.mark.needs("engine", "sampler")
def test_bad_draft_model_is_exact_and_rolls_back(real_path, plain_outputs, bad_draft_path):
    llm = LLM(real_path, kv_cache_bytes=64 << 20, speculative=bad_draft_path, num_speculative_tokens=3)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    assert llm.stats["accepted_tokens"] < llm.stats["draft_tokens"], "a random draft gets rejected"
    assert_no_leak(llm)


# ------------------------------------------------------------- cache rollback

@pytest.mark.needs("engine", "model", "sampler", "paged-attention")
def test_cache_holds_exactly_the_accepted_tokens(tiny_path, bad_draft_path):
    """Mid-run, the target's paged cache of every running sequence must equal
    what the dense path computes from its accepted tokens alone."""
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20, block_size=4, speculative=bad_draft_path,
              num_speculative_tokens=4)
    for p in ["rollback test one", "rollback two " * 5]:
        llm.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(6):
        llm.step()
    assert llm.stats["accepted_tokens"] < llm.stats["draft_tokens"]
    for seq in llm.scheduler.running:
        n = seq.num_computed
        assert n == len(seq.token_ids) - 1
        assert len(llm.block_manager.tables[seq.seq_id]) == -(-n // 4), "trailing blocks must be freed"
        # feed the pending token over the cache and compare with the dense path
        slots = llm.block_manager.append_slots(seq.seq_id, n, 1)
        ids, pos, ctx = AttentionContext.build(llm.cache, llm.block_manager,
                                               [(seq.seq_id, seq.token_ids[n:], n, slots)], [0], "cpu")
        paged = llm.model(ids, pos, ctx)[0]
        dense = llm.model(torch.tensor(seq.token_ids), torch.arange(len(seq.token_ids)))[-1]
        assert torch.allclose(paged, dense, atol=1e-4)


@pytest.mark.assignment("rejection-sampling")
@pytest.mark.needs("engine", "sampler", "copy-on-write", "ngram-drafter")
def test_sampled_speculation_with_forks_finishes_without_leaks(tiny_path):
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20, speculative="ngram", num_speculative_tokens=5)
    # repetition_penalty < 1 makes the random tiny model repeat itself: without it no n-gram recurs,
    # nothing is drafted, and this test would not reach the rejection rule at all
    p = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=0, ignore_eos=True, n=2,
                       repetition_penalty=0.5)
    outs = llm.generate(["a a a a b b b b a a a a b b"] * 3, p)
    assert all(len(c.token_ids) == 30 for o in outs for c in o.outputs), "every sample runs to max_tokens"
    assert all(o.finish_reason == "length" for o in outs), "ignore_eos: every request finishes by length"
    assert 0 < llm.stats["accepted_tokens"] < llm.stats["draft_tokens"], "sampled drafts were meant to be judged"
    assert_no_leak(llm)


# ------------------------------------------------------------------- bad input

@pytest.mark.needs("kv-cache-bytes")
def test_bad_speculative_configuration(tiny_path, tmp_path):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny_path, kv_cache_bytes=1 << 20, speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny_path, kv_cache_bytes=1 << 20, speculative="ngram", num_speculative_tokens=1000)
    with pytest.raises(ValueError, match="speculative must be"):
        LLM(tiny_path, kv_cache_bytes=1 << 20, speculative="medusa")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(tiny_path, kv_cache_bytes=1 << 20, speculative="ngram", num_speculative_tokens=8,
            max_num_batched_tokens=4)
    other = save_checkpoint(tiny_model(vocab_size=512), tmp_path / "other_vocab")
    with pytest.raises(ValueError, match="different vocabulary"):
        LLM(tiny_path, kv_cache_bytes=1 << 20, speculative=other)
    assert os.path.isdir(other)


# ---- paths the rest of this file does not reach

# Prompts on which the tiny model's greedy continuation repeats itself, so
# prompt lookup drafts and some drafts get accepted.
LOOPY = ["a a a a b b b b a a a a b b", "one two one two one two", "x y z x y z x y"]
LOOPY_GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def record_steps(monkeypatch, llm):
    """Spy on the engine's append phase: per step, (request id, drafts verified,
    the tokens the sampler emitted for it) for every sequence that sampled."""
    steps, resolve = [], llm._resolve

    def spy():
        f = llm.in_flight
        if f is not None:                # its tokens read here, handed on as host results
            f.sampled = f.sampled.result() if isinstance(f.sampled, Sampled) else f.sampled
            steps.append([(seq.request.request_id, len(ask.drafts), list(tokens))
                          for (seq, ask), (tokens, _, _) in zip(f.asks, f.sampled)])
        return resolve()
    monkeypatch.setattr(llm, "_resolve", spy)
    return steps


@pytest.fixture(scope="module")
def loopy_plain(tiny_path):
    return [o.token_ids for o in LLM(tiny_path, kv_cache_bytes=4 << 20).generate(LOOPY, LOOPY_GREEDY)]


@pytest.mark.needs("engine", "ngram-drafter", "stop-strings")
def test_a_stop_inside_a_verified_run_drops_the_tokens_after_it(tiny_path, loopy_plain, monkeypatch):
    """A verification step can emit several tokens (accepted drafts + one).
    When a stop string completes at one of them that is not the step's last,
    the tokens after it are dropped: the output is the plain greedy run's cut
    at that token, the text ends before the stop string, the other requests
    of the batch are untouched, and every block comes back."""
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20, speculative="ngram", num_speculative_tokens=4)
    steps = record_steps(monkeypatch, llm)
    rids = [llm.add_request(p, LOOPY_GREEDY) for p in LOOPY]
    while llm.has_unfinished_requests():
        llm.step()
    emitted = {rid: [] for rid in rids}
    for step in steps:
        for rid, _, tokens in step:
            emitted[rid].append(tokens)
    assert [sum(emitted[r], []) for r in rids] == loopy_plain, "speculation changed the greedy tokens"
    # A stop string that first completes at token e of the plain output, where
    # e is not the last token its verification step emitted: the text of the
    # last few tokens up to e, found nowhere earlier in the text.
    decode = llm.tokenizer.decode
    choice = None
    for i, rid in enumerate(rids):
        pos = 0
        for tokens in emitted[rid]:
            for e in range(pos, pos + len(tokens) - 1):
                text = decode(loopy_plain[i][:e + 1])
                for back in (1, 2, 3, 4):
                    stop = text[len(decode(loopy_plain[i][:max(0, e + 1 - back)])):]
                    if choice is None and stop.strip() and "\ufffd" not in text and text.find(stop) == len(text) - len(stop):
                        choice = (i, stop, e, text[:len(text) - len(stop)])
            pos += len(tokens)
    assert choice is not None, "no verification step emitted two tokens: the test needs accepted drafts"
    i, stop, e, text = choice
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20, speculative="ngram", num_speculative_tokens=4)
    steps = record_steps(monkeypatch, llm)
    params = [LOOPY_GREEDY] * len(LOOPY)
    params[i] = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop])
    outs = llm.generate(LOOPY, params)
    assert outs[i].finish_reason == "stop" and outs[i].token_ids == loopy_plain[i][:e + 1], \
        f"the output must end at token {e} of the plain run, where the stop string {stop!r} completes"
    assert outs[i].text == text, "the text ends just before the stop string"
    assert [o.token_ids for j, o in enumerate(outs) if j != i] == [t for j, t in enumerate(loopy_plain) if j != i]
    last = [tokens for step in steps for rid, _, tokens in step if rid == outs[i].request_id][-1]
    assert len(outs[i].token_ids) < len(sum([t for step in steps for rid, _, t in step
                                             if rid == outs[i].request_id], [])), \
        f"the stop must fall before the last token of its step (the step emitted {len(last)})"
    assert_no_leak(llm)


@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.needs("engine", "ngram-drafter")
def test_drafts_beyond_the_token_budget_are_dropped_and_output_is_exact(tiny_path, loopy_plain, monkeypatch, drafter):
    """With max_num_batched_tokens = 5 = k + 1 and five sequences decoding, a
    sequence whose 1 + drafts verification tokens no longer fit the step's
    budget drops its drafts and decodes one token (or waits for the next step
    once the budget is spent). The greedy output is still exactly the plain
    run's, no step goes over the budget, and nothing leaks. A draft model's cache then holds
    drafts nobody verified: the next proposal starts from the text, not from them."""
    budget = 5 if drafter == "ngram" else 6     # a model drafts all k: k + 2 leaves a decode 1 token
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20, speculative="ngram" if drafter == "ngram" else tiny_path,
              num_speculative_tokens=4, max_num_batched_tokens=budget)
    schedule, dropped, spent = llm.scheduler.schedule, [], []

    def spy():
        before = {s.seq_id: len(s.draft_tokens) for s in llm.scheduler.running}
        out = schedule()
        dropped.extend(it.seq.seq_id for it in out if before.get(it.seq.seq_id) and not it.seq.draft_tokens)
        spent.append(sum(it.count for it in out))
        return out
    monkeypatch.setattr(llm.scheduler, "schedule", spy)
    outs = llm.generate(LOOPY + ["a b a b a b a b", "c d c d"], LOOPY_GREEDY)
    assert [o.token_ids for o in outs[:3]] == loopy_plain, "dropping drafts must not change a greedy output"
    assert dropped, "no sequence ever had its drafts dropped: the budget was never short"
    assert max(spent) <= budget, f"a step scheduled {max(spent)} tokens over the budget of {budget}"
    assert llm.stats["accepted_tokens"] > 0
    assert_no_leak(llm)


@pytest.mark.needs("engine", "ngram-drafter")
def test_a_drafter_that_raises_fails_only_the_requests_whose_drafts_raise(tiny_path, loopy_plain, monkeypatch):
    """The drafter is asked for every sequence at once; if that raises, each
    request is retried alone and only those whose own drafting raises fail
    (finish_reason "error", the message says drafting failed). The others
    keep their exact greedy tokens, and every block comes back."""
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20, speculative="ngram", num_speculative_tokens=4)
    poison = llm.tokenizer.encode("zebra crossing", allow_special=True)
    propose = llm.drafter.propose

    def flaky(requests, sample_fn=None):
        if any(tokens[:len(poison)] == poison for _, tokens, _ in requests):
            raise RuntimeError("the drafter choked")
        return propose(requests, sample_fn)
    monkeypatch.setattr(llm.drafter, "propose", flaky)
    outs = llm.generate(LOOPY + ["zebra crossing zebra crossing"], LOOPY_GREEDY)
    assert [o.token_ids for o in outs[:3]] == loopy_plain, "the healthy requests must not notice"
    assert outs[3].finish_reason == "error" and "drafting failed" in outs[3].error and "choked" in outs[3].error
    assert_no_leak(llm)


def greedy_draft_sample(logits, idx, step):
    """A sample_fn for ModelDrafter.propose: the argmax, as one-hot probabilities."""
    tokens = logits.argmax(-1)
    return tokens.tolist(), torch.nn.functional.one_hot(tokens, logits.shape[-1]).float()


@pytest.mark.needs("model", "kv-cache-bytes", "paged-attention", "block-allocation", "decode-attention")
def test_model_drafter_drafts_the_draft_models_greedy_tokens_and_fewer_when_its_pool_is_full():
    """ModelDrafter with its own paged cache: every request's drafts are the
    draft model's own greedy continuation (the dense path is the reference),
    each request stops at its own k, a request the draft pool cannot hold gets
    fewer drafts (none here) instead of an error, and rollback / release give
    the blocks back."""
    from graphs import StepInputs
    from model import generate
    from speculative import ModelDrafter
    draft = tiny_model(seed=4)
    drafter = ModelDrafter(draft, num_blocks=4, block_size=4, device=torch.device("cpu"), dtype=torch.float32,
                           make_inputs=lambda bm: StepInputs(bm, torch.device("cpu")))
    a, b, c = [5, 9, 2, 7, 7, 1], [3, 3, 4, 8, 1], list(range(20, 31))        # 6 + 3 and 5 + 1 tokens: 4 blocks
    out = drafter.propose([(0, a, 3), (1, b, 1), (2, c, 2)], greedy_draft_sample)
    assert out[0][0] == generate(draft, a, 3) and out[1][0] == generate(draft, b, 1), \
        "the drafts must be the draft model's greedy tokens, k of them per request"
    assert out[0][1].shape == (3, draft.config.vocab_size)
    assert out[2] == ([], None), "a request whose tokens do not fit the draft pool gets no drafts"
    drafter.rollback(0, 6)                    # the target rejected all of a's drafts
    assert drafter.computed[0] == 6 and len(drafter.bm.tables[0]) == 2
    out = drafter.propose([(0, a + [4], 2)], greedy_draft_sample)   # resumes from the rolled-back cache
    assert out[0][0] == generate(draft, a + [4], 2)
    for sid in (0, 1, 2):
        drafter.release(sid)
    assert drafter.bm.num_free_blocks == 4 and not drafter.bm.tables


@pytest.mark.needs("engine", "sampler", "rejection-sampling")
def test_sampled_drafts_of_the_target_itself_are_always_accepted(tiny_path):
    """Sampling (temperature 0.8) with the target as its own draft model: the
    draft distribution p equals the target's q, so min(1, q/p) = 1 and every
    draft is accepted. Passing the draft's probabilities to the rejection rule
    is what makes it so: treated as one-hot, a draft would be accepted with
    probability q(x) only."""
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20, speculative=tiny_path, num_speculative_tokens=3)
    outs = llm.generate(["sampled self drafting", "another one"],
                        SamplingParams(max_tokens=16, temperature=0.8, seed=1, ignore_eos=True))
    assert all(len(o.token_ids) == 16 for o in outs)
    assert llm.stats["draft_tokens"] > 10 and llm.stats["accepted_tokens"] == llm.stats["draft_tokens"], \
        f"accepted {llm.stats['accepted_tokens']} of {llm.stats['draft_tokens']} drafts of a perfect draft model"
    assert_no_leak(llm)


@pytest.mark.needs("engine", "sampler", "ngram-drafter")
def test_logit_bias_holds_under_speculation(tiny_path):
    """logit_bias through the engine: greedy with n-gram drafts equals greedy without (the verified
    rows are biased, so a draft the bias demotes is rejected), a -100 token never comes out, the
    bias changes the text, and +100 forces a token whose repeats the drafter proposes and the
    verification accepts."""
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    spec = LLM(tiny_path, kv_cache_bytes=4 << 20, speculative="ngram", num_speculative_tokens=3)
    prompt = llm.tokenizer.encode("a b c a b c a b c a b")
    plain = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    bias = {plain[2]: -100.0, plain[5]: 3.0}
    p = SamplingParams(max_tokens=16, ignore_eos=True, logit_bias=bias)
    biased, drafted = (e.generate([prompt], p)[0].token_ids for e in (llm, spec))
    assert drafted == biased, "n-gram speculation changed a biased greedy output"
    assert plain[2] not in biased and biased != plain, (plain, biased)
    force = SamplingParams(max_tokens=16, ignore_eos=True, logit_bias={plain[5]: 100.0})   # t t t ...: drafts
    assert spec.generate([prompt], force)[0].token_ids == [plain[5]] * 16 == llm.generate([prompt], force)[0].token_ids
    assert spec.stats["accepted_tokens"] > 0, "the drafter's repeats were meant to be accepted"


@pytest.mark.needs("engine", "sampler", "ngram-drafter")
def test_allowed_token_ids_hold_under_speculation(tiny_path):
    """allowed_token_ids through the engine: greedy with n-gram drafts equals greedy without (a draft
    outside the set has target probability 0: rejected), and nothing outside the set comes out,
    greedy or sampled (speculation keeps the sampled distribution, not the draws)."""
    llm = LLM(tiny_path, kv_cache_bytes=4 << 20)
    spec = LLM(tiny_path, kv_cache_bytes=4 << 20, speculative="ngram", num_speculative_tokens=3)
    prompt = llm.tokenizer.encode("a b c a b c a b c a b")
    plain = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    allowed = sorted(set(plain[:4]) | set(prompt[:3]))
    for temp in (0.0, 0.9):
        p = SamplingParams(max_tokens=16, ignore_eos=True, allowed_token_ids=allowed, temperature=temp, seed=1)
        masked, drafted = (e.generate([prompt], p)[0].token_ids for e in (llm, spec))
        assert drafted == masked or temp > 0, "n-gram speculation changed a masked greedy output"
        assert set(masked) | set(drafted) <= set(allowed), (masked, drafted, allowed)
    assert_no_leak(spec)
