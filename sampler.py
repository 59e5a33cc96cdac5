"""
sampler.py -- sampling that costs what a request asks for.

The lesson: sampling is per request (temperature, top-k/p, min-p, penalties, logit bias, a
grammar, a seed), yet it runs as ONE batched operation per step, each row paying only for what
it asks: greedy rows are one argmax (no sort, softmax or noise); top-k rows pay for a topk,
top-p < 1 for a sort, penalties for counting their history, a logit bias for its few entries,
a structured output (JSON schema, regex, choice) for its grammar's mask: the tokens that keep
the output valid, every other logit -inf. Each sampled row draws with ONE uniform, by inverse CDF.

The uniforms are counter-based, a pure function u = hash(key, output position, stream) like
JAX's or Philox's counters (a per-request torch.Generator is sequential state: one launch per
row, and other noise after preemption). The key mixes the seed with the sample index: a seeded
request draws the same noise whatever the batch, even preempted, and its n samples differ. Its
tokens are the same wherever its logits round the same: a batch of another shape rounds the
matmuls and attention differently (~1e-6 in float32), and a draw that close to the boundary
between two tokens takes the other (docs/ENGINE.md: about 1 token in 1,000).

Place in the data flow: step 3 of LLM.step (engine.py) calls sample_tokens once on the logits
rows of every sampling sequence (drafts judged by speculative.py's rejection rule); step 4
streams each sequence's text through its StopStrings.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from speculative import rejection_sample_batched
from support.checks import check_sampling_params

# --- What a request asks for -------------------------------------------------
def knob(default, **bounds):
    """A field of SamplingParams with its range (support/checks.py), from which serve.py's
    request schema is made too: a new option is one line here, plus the code that uses it."""
    kw = {"default_factory": list} if default is list else {"default": default}
    return field(**kw, metadata=bounds)


@dataclass
class SamplingParams:
    """How to pick tokens for one request, and when to stop: each option is written down once."""
    max_tokens: int = knob(64, ge=0, le=2**31 - 1)    # per sample; 0: prompt_logprobs only
    temperature: float = knob(0.0, ge=0)          # 0 = greedy (argmax); else softmax(logits / T)
    top_k: int = knob(0, ge=0)                    # keep the k most likely (0 or k >= vocab: all)
    top_p: float = knob(1.0, gt=0, le=1)          # keep the smallest set with probability >= top_p
    seed: int | None = knob(None, ge=-2**63, le=2**64 - 1)    # None: a seed of its own
    stop: str | list[str] = knob(list, items=16, chars=1024)      # stop strings (cut from the text)
    stop_token_ids: list[int] = knob(list, items=1024, ge=0, le=2**63 - 1)   # also end generation
    ignore_eos: bool = knob(False)                # keep going past EOS (benchmarks)
    n: int = knob(1, ge=1, le=128)                # samples sharing the prompt (copy-on-write)
    logprobs: int | None = knob(None, ge=0, le=20)    # the chosen token's + this many others
    prompt_logprobs: int | None = knob(None, ge=0, le=20)    # the same for the prompt: scoring
    min_p: float = knob(0.0, ge=0, le=1)          # keep p >= min_p * the top token's p (0 = off)
    # vLLM's and OpenAI's penalties (1, 0, 0: off); the rule: penalize, below
    repetition_penalty: float = knob(1.0, ge=0.01, le=100)
    presence_penalty: float = knob(0.0, ge=-2, le=2)
    frequency_penalty: float = knob(0.0, ge=-2, le=2)
    logit_bias: dict[int, float] | None = knob(None, items=1024, ge=-100, le=100)   # id -> + logit
    allowed_token_ids: list[int] | None = knob(None, items=1 << 20, ge=0, le=2**63 - 1)   # vLLM's
    # vLLM's structured outputs, one of: {"json": schema}, {"json_object": True}, {"regex": r},
    # {"choice": [...]}, {"grammar": lark}; the output follows it (penalize, below)
    structured_outputs: dict | None = knob(None)

    GREEDY_BELOW = 1e-5         # temperatures this small are greedy (logits / 1e-30 would overflow)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]             # one stop string: a list of one
        check_sampling_params(self)             # ValueError naming the field outside its range

    greedy = property(lambda self: self.temperature < self.GREEDY_BELOW)

    @property
    def penalized(self) -> bool:        # if not, nothing is counted (or biased) for this request
        pens = (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        masked = self.allowed_token_ids is not None or self.structured_outputs is not None
        return pens != (1, 0, 0) or bool(self.logit_bias) or masked


# --- Counter-based noise -----------------------------------------------------
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15          # 2^64 / golden ratio: SplitMix64's increment
# A position's independent noise streams: its draw, its draft's acceptance test, the draft's draw
DRAW, ACCEPT, DRAFT = 0, 1, 2


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that scrambles every bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


def sample_key(seed: int, index: int) -> int:
    """The 64-bit key of one sample stream: a request's seed and its sample index."""
    return _mix64((_mix64(seed & MASK64) + (index + 1) * GOLDEN) & MASK64)


def uniform(key: int, position: int, stream: int = DRAW) -> float:
    """u in [0, 1): the noise of output position `position` of a sample stream,
    the (position * 3 + stream)-th output of a SplitMix64 generator started at key."""
    # assignment: sampler
    return (_mix64((key + (position * 3 + stream + 1) * GOLDEN) & MASK64) >> 11) * 2.0 ** -53
    # end assignment


# --- Filtering and the draw --------------------------------------------------
def filtered_probs(logits, temperature, top_k: list[int], top_p: list[float], min_p=None):
    """Probabilities [R, V] of sampled rows after temperature, min-p, top-k, then top-p (vLLM's
    order): logits [R, V] float32, temperature [R]; top_k (0 = off), top_p (1 = off), min_p (0 =
    off) host lists, so no round trip decides which rows to filter. Ties at a threshold stay."""
    # assignment: sampler
    V, dev = logits.shape[1], logits.device
    logits = logits / temperature[:, None]
    m_rows = [i for i, m in enumerate(min_p or ()) if m > 0]
    if m_rows:              # min-p: keep p >= min_p * max p, a cut that follows the certainty
        rows = torch.tensor(m_rows, device=dev)
        probs = logits[rows].softmax(dim=-1)
        m = torch.tensor([[min_p[i]] for i in m_rows], device=dev)
        floor = probs.amax(dim=-1, keepdim=True) * m
        logits[rows] = logits[rows].masked_fill(probs < floor, float("-inf"))
    k_rows = [i for i, k in enumerate(top_k) if 0 < k < V]
    if k_rows:                                      # top-k: keep logits >= the k-th largest
        rows = torch.tensor(k_rows, device=dev)
        sub = logits[rows]
        vals = sub.topk(max(top_k[i] for i in k_rows), dim=-1).values      # [Rk, kmax], descending
        kth = vals.gather(1, torch.tensor([[top_k[i] - 1] for i in k_rows], device=dev))
        logits[rows] = sub.masked_fill(sub < kth, float("-inf"))
    p_rows = [i for i, p in enumerate(top_p) if p < 1]
    if p_rows:                                      # top-p: the smallest prefix with mass >= p
        rows = torch.tensor(p_rows, device=dev)
        sub = logits[rows]
        sorted_logits = sub.sort(dim=-1, descending=True).values
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs                      # the mass strictly before each
        p = torch.tensor([top_p[i] for i in p_rows], device=dev, dtype=probs.dtype)
        # clamp: the top token always stays (a top_p such as 1e-300 rounds to 0 in float32)
        n_keep = (before < p[:, None]).sum(dim=-1, keepdim=True).clamp(min=1)
        logits[rows] = sub.masked_fill(sub < sorted_logits.gather(1, n_keep - 1), float("-inf"))
    return logits.softmax(dim=-1)
    # end assignment


def draw(probs, u):
    """Inverse-CDF sampling, one uniform per row: probs [R, V] (unnormalized is fine), u [R]
    -> tokens [R]: the first token whose cumulative probability exceeds u * total, so a token
    of probability 0 is never chosen. float64: a p ~ 1e-9 tail token keeps its chance."""
    # assignment: sampler
    cdf = probs.double().cumsum(dim=-1)                                      # [R, V]
    x = (u.double() * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp(max=probs.shape[1] - 1)
    # end assignment


# --- The step's one call: every sequence's tokens, with ONE wait for the device ---
@dataclass
class SampleRequest:
    """What one sequence asks of this step's sampler (built on the host)."""
    row: int                       # its first row in the logits
    drafts: list                   # draft tokens to verify (empty: a plain sample)
    params: SamplingParams
    key: int                       # sample_key of the sequence
    position: int                  # output index of the first token it will get
    token_ids: list = ()           # the sequence so far (prompt, `position` outputs): penalties
    draft_probs: torch.Tensor | None = None   # [len(drafts), V] of a draft model (None: one-hot)
    grammar: object = None         # a structured request's place in its grammar (sequence.py)


def sample_tokens(logits, reqs: list[SampleRequest], also=()):
    """Every sequence's new tokens: a sample, or the accepted drafts + one. Sequence s owns
    logits rows row_s .. row_s + k_s (k_s drafts): plain sampling is verification with k = 0.
    Returns per sequence, on the host after the step's one wait: (tokens, raw-logit logprobs
    or None, finite). `also`: more device tensors for that wait, replaced by host lists."""
    return launch_sample(logits, reqs, also).result()


def launch_sample(logits, reqs: list[SampleRequest], also=()) -> Sampled:
    """sample_tokens without its wait: every op queued on the device and the copies to the host
    too; the tokens are read at .result(). Meanwhile .next_ids [S] holds each sequence's first
    new token ON THE DEVICE, where the next step's forward can read it (engine.py's overlap)."""
    S, K, dev = len(reqs), max(len(r.drafts) for r in reqs), logits.device   # most drafts: K
    n = np.array([len(r.drafts) for r in reqs])
    # ridx [S, K+1]: the logits row of each sequence's position j (past its drafts: its last)
    ridx = np.array([r.row for r in reqs])[:, None] + np.minimum(np.arange(K + 1)[None], n[:, None])
    drafts = np.array([r.drafts + [-1] * (max(K, 1) - len(r.drafts)) for r in reqs])   # -1: none
    idx, d, n_t = (to_device(a, dev) for a in (ridx, drafts, n))
    best, argmax = logits.max(dim=-1)                  # [R]: greedy tokens, and a NaN/inf check
    pen = [s for s, r in enumerate(reqs) if r.params.penalized]   # nobody asks: not one op more
    scores = logits                                    # the logprobs stay the raw logits'
    if pen:                                            # penalties move greedy choices too
        scores = penalize(logits, [reqs[s] for s in pen], ridx[pen])
        argmax = scores.argmax(dim=-1)
    tokens = argmax[idx]                               # [S, K+1]: the target's argmax per position
    n_acc = torch.zeros(S, dtype=torch.long, device=dev)
    if K:                                              # greedy rule: accept while draft == argmax
        agree = (tokens[:, :K] == d[:, :K]) & (torch.arange(K, device=dev)[None] < n_t[:, None])
        n_acc = agree.long().cumprod(dim=1).sum(dim=1)
    if sampled := [s for s, r in enumerate(reqs) if not r.params.greedy]:
        sel = to_device(sampled, dev)
        tokens[sel], n_acc[sel] = _sample_rows(scores, [reqs[s] for s in sampled], ridx[sampled],
                                               d[sampled], n_t[sampled])
    finite = torch.isfinite(best[idx]).all(dim=1)
    want_lp = [s for s, r in enumerate(reqs) if r.params.logprobs is not None]
    top = max((reqs[s].params.logprobs for s in want_lp), default=0)
    lp = _logprobs(logits, ridx[want_lp], tokens[want_lp], top) if want_lp else []
    packed = torch.cat([tokens, n_acc[:, None], finite[:, None].long()], dim=1)   # [S, K + 3]
    return Sampled(reqs, want_lp, Fetch((packed, *lp, *also)), also, tokens[:, 0])


class Sampled:
    """A step's sampling, queued on the device; result() is the step's one wait."""

    def __init__(self, reqs, want_lp, copies: Fetch, also, next_ids):
        self.reqs, self.want_lp, self.copies, self.also = reqs, want_lp, copies, also
        self.next_ids = next_ids                     # [S] on the device: each one's first new token

    def result(self) -> list:
        """Per sequence (tokens, logprobs or None, finite), on the host."""
        packed, *rest = self.copies.wait()        # packed [S, K + 3], then logprobs, then also
        if self.also:
            self.also[:] = rest[len(rest) - len(self.also):]
        chosen, values, ids = rest[:3] if self.want_lp else ([], [], [])
        K = max(len(r.drafts) for r in self.reqs)
        # a row: K + 1 tokens (the judged drafts + one), then n accepted, then finite
        out = [(row[:row[K + 1] + 1], None, bool(row[K + 2])) for row in packed]
        for j, s in enumerate(self.want_lp):      # per token: (chosen logprob, {other: logprob})
            (tokens, _, finite), k = out[s], self.reqs[s].params.logprobs
            out[s] = (tokens, [(chosen[j][i], dict(zip(ids[j][i][:k], values[j][i][:k])))
                               for i in range(len(tokens))], finite)
        return out


def _sample_rows(logits, reqs, ridx, d, n):
    """Sampled (temperature > 0) sequences: filtered q, the rejection rule, one draw each."""
    (S, K1), dev = ridx.shape, logits.device
    rows = to_device(ridx.reshape(-1), dev)
    per_row = lambda name: [getattr(r.params, name) for r in reqs for _ in range(K1)]   # noqa: E731
    temp = to_device(per_row("temperature"), dev, logits.dtype)
    probs = filtered_probs(logits[rows], temp, per_row("top_k"), per_row("top_p"), per_row("min_p"))
    probs = probs.view(S, K1, -1)                                                    # [S, K+1, V]
    with_p = [s for s, r in enumerate(reqs) if r.draft_probs is not None]    # a draft model's p
    dp = torch.zeros(S, K1 - 1, probs.shape[-1], device=dev) if with_p else None
    for s in with_p:
        dp[s, :len(reqs[s].drafts)] = reqs[s].draft_probs
    noise = [[[uniform(r.key, r.position + j, stream) for stream in (DRAW, ACCEPT)]
              for j in range(K1)] for r in reqs]
    u = to_device(noise, dev, torch.float64)                                         # [S, K+1, 2]
    n_acc, final = rejection_sample_batched(probs, dp, d[:, :K1 - 1], n, u[:, :K1 - 1, 1])
    # the extra token lands at output position + n_acc: that position's DRAW noise
    final_tok = draw(final, u[:, :, 0].gather(1, n_acc[:, None])[:, 0])
    j = torch.arange(K1, device=dev)[None]
    drafts = torch.cat([d[:, :K1 - 1], d.new_zeros(S, 1)], dim=1)
    return torch.where(j < n_acc[:, None], drafts, final_tok[:, None]), n_acc


def penalize(logits, reqs: list[SampleRequest], ridx):
    """logits with the rows ridx [S, K+1] of S sequences biased and penalized (vLLM's rules): each
    logit_bias[id] added to its token's logit; a token seen in the prompt or output has its logit
    divided by repetition_penalty if > 0, else multiplied by it; then logit -= presence * (count
    > 0) + frequency * count, counting OUTPUT tokens. Verification row j also counts drafts
    0..j-1: each position sees its own history, so verifying is exact. Last, allowed_token_ids
    and a grammar (structured outputs): every token they do not allow at -inf (a draft outside
    them has target probability 0: rejected). The grammar's mask is computed on the host while
    the device runs the step's forward; its cost is per structured request, not per batch."""
    (S, K1), V, dev = ridx.shape, logits.shape[1], logits.device

    def count(parts):    # [len(parts), V]: how often each part holds each token (one scatter-add)
        flat = np.concatenate([np.asarray(p, dtype=np.int64) + i * V for i, p in enumerate(parts)])
        ones = torch.ones(len(flat), device=dev)
        counts = torch.zeros(len(parts) * V, device=dev)
        return counts.index_add_(0, to_device(flat, dev), ones).view(-1, V)

    def param(name):     # [S, 1, 1]: each sequence's value of one penalty
        return to_device([getattr(r.params, name) for r in reqs], dev)[:, None, None]
    in_prompt = count([r.token_ids[:len(r.token_ids) - r.position] for r in reqs]).view(S, 1, V) > 0
    # assignment: sampler
    n = count([r.token_ids[len(r.token_ids) - r.position:] for r in reqs]).view(S, 1, V) \
        + count([r.drafts[:j] for r in reqs for j in range(K1)]).view(S, K1, V)   # + drafts before
    x = logits[torch.as_tensor(ridx, device=dev)]                                  # [S, K+1, V]
    for s, r in enumerate(reqs):       # logit_bias first (vLLM's order), on every verified row
        if bias := r.params.logit_bias:
            x[s, :, list(bias)] += to_device(list(bias.values()), dev, x.dtype)
    seen = n > 0
    rep = torch.where(in_prompt | seen, param("repetition_penalty"), 1.0)
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - param("presence_penalty") * seen - param("frequency_penalty") * n
    # end assignment
    for s, r in enumerate(reqs):      # allowed_token_ids (vLLM's): every other token at -inf
        if (ids := r.params.allowed_token_ids) is not None:
            x[s, :, ~torch.isin(torch.arange(V, device=dev), to_device(ids, dev))] = float("-inf")
        if r.grammar is not None:     # a grammar: the tokens it allows next, one bit each. Bit b
            # of int32 word w is token 32 w + b (support/structured.py computes it on the host)
            bits = to_device(r.grammar.bitmask(V), dev)[:, None] >> torch.arange(32, device=dev)
            x[s, :, (bits & 1).flatten()[:V] == 0] = float("-inf")    # & 1: bit 31's sign too
    return logits.index_put((to_device(ridx.reshape(-1), dev),), x.flatten(0, 1).to(logits.dtype))


def _logprobs(logits, ridx, tokens, top: int):
    """Logprobs from the RAW logits (no temperature or filtering, as OpenAI and vLLM report
    them): the chosen tokens' [S', K+1], and the top alternatives' values and ids."""
    logp = logits[to_device(ridx, logits.device)].log_softmax(dim=-1)               # [S', K+1, V]
    # the chosen tokens' logprobs, then the top alternatives' values and ids (topk's pair)
    return [logp.gather(-1, tokens[..., None])[..., 0], *logp.topk(max(top, 1), dim=-1)]


def prompt_logprobs(logits, next_tokens: list[int], top: int) -> list:
    """The same, in float32, for the LAST len(next_tokens) logits rows, each scored against the
    prompt token after it: only [R] + 2 x [R, top] wait for the fetch (the [R, V] rows die)."""
    rows, n = logits[-len(next_tokens):].float(), len(next_tokens)
    return _logprobs(rows, np.arange(n), to_device(next_tokens, logits.device), top)


def to_device(data, dev, dtype=None) -> torch.Tensor:
    """Host data (a list, numpy) on `dev` without waiting for it: a CUDA copy from pageable
    memory first waits for every queued kernel (the forward); from pinned memory it is queued."""
    t = torch.as_tensor(data, dtype=dtype)
    return t.pin_memory().to(dev, non_blocking=True) if torch.device(dev).type == "cuda" else t


class Fetch:
    """Copies to the host, queued (pinned, non-blocking) behind what made the tensors, and an
    event after them: wait() waits for THESE tensors only, not for work queued later (the
    overlapped engine's next forward)."""

    def __init__(self, tensors):
        self.host = [t.to("cpu", non_blocking=True) for t in tensors]
        self.event = torch.cuda.Event() if tensors and tensors[0].is_cuda else None
        if self.event is not None:                                  # pragma: no cover (CUDA)
            self.event.record(torch.cuda.current_stream(tensors[0].device))

    def wait(self) -> list:
        if self.event is not None:
            self.event.synchronize()                                # pragma: no cover (CUDA)
        return [h.tolist() for h in self.host]


# --- Who samples, from which logits rows (step 3's side of the step) ----------
def sample_requests(batch, scheduler, tokenizer):
    """Which sequences sample this step, from which logits rows: the last row of a sequence
    whose cache then holds all its tokens, or the 1 + k rows of a verification (a prompt of a
    request with n > 1 forks here). After those, the rows of the prompt positions a request
    scores (prompt_logprobs): scored = [(request, first, count)]."""
    # asks: (sequence, SampleRequest) of each sequence that samples; rows: the logits rows they
    # sample from, in that order; scored: (request, first prompt position, count) scored this
    # step; prompt_rows: the logits rows of those prompt positions
    asks, rows, scored, prompt_rows, end = [], [], [], [], 0
    for item in batch:
        seq, req = item.seq, item.seq.request
        # position p scores prompt token p + 1 (a recompute after preemption skips scored ones)
        first = max(item.start, req.num_scored - 1)
        last = min(item.start + item.count, seq.num_prompt - 1)
        if first < last:
            scored.append((req, first + 1, last - first))
            prompt_rows += range(end + first - item.start, end + last - item.start)
        end += item.count                      # this sequence's tokens end here in the flat batch
        if seq.draft_tokens:
            asks.append((seq, SampleRequest(len(rows), list(seq.draft_tokens), seq.params, seq.key,
                                            seq.num_output, seq.token_ids, seq.draft_probs)))
            rows += range(end - item.count, end)
        elif item.start + item.count == len(seq.token_ids):   # n > 1: the samples share a row
            forked = [seq] + scheduler.fork(seq, item.start + item.count, tokenizer)
            if seq.params.max_tokens:          # max_tokens=0 only scores its prompt: no sample
                asks += [(s, SampleRequest(len(rows), [], s.params, s.key, s.num_output,
                                           s.token_ids, grammar=s.grammar)) for s in forked]
                rows.append(end - 1)
    return asks, rows + prompt_rows, scored


# --- Fault isolation: the whole batch at once, else each request alone -------
def batch_then_each(run, asks: list, fail, what: str, skipped) -> list:
    """run(asks) -> one result per (sequence, ask), for the whole batch. If it raises, the cause is
    unknown: run each alone, and fail(request, message) those whose own run raises (`skipped`)."""
    try:
        return run(asks) if asks else []
    except Exception:
        out = []
        for one in asks:
            try:
                out += run([one])
            except Exception as e:
                fail(one[0].request, f"{what} failed: {type(e).__name__}: {e}")
                out.append(skipped)
        return out


def launch_isolated(logits, asks, fail, also=()):
    """sample_isolated without its wait: the whole batch's Sampled; if launching the batch raises,
    sample_isolated's results (each request alone, on the host already)."""
    try:
        if asks:
            return launch_sample(logits, [a for _, a in asks], also)
    except Exception:
        pass
    return sample_isolated(logits, asks, fail, also)


def sample_isolated(logits, asks, fail, also=()):
    """sample_tokens via batch_then_each: the noise depends only on the request, so alone = batched.
    `also` rides the whole batch's wait, else (no asks, or the batch raised) is fetched alone."""
    def run(part):
        return sample_tokens(logits, [a for _, a in part], also if part is asks else ())
    new = batch_then_each(run, asks, fail, "sampling", ([], None, True))   # skipped: it failed
    if also and torch.is_tensor(also[0]):
        also[:] = Fetch(also).wait()
    return new


def draft_sampler(asks):
    """The draft model samples with each request's params (not min-p or penalties: any draft p
    keeps verification exact) and noise (stream DRAFT); greedy requests take its argmax, one-hot."""
    seqs = [seq for seq, _ in asks]

    def draft_sample(logits, idx, step):   # logits [R, V] of the requests idx, at draft step `step`
        ps, dev = [seqs[i].params for i in idx], logits.device
        temp = [max(p.temperature, SamplingParams.GREEDY_BELOW) for p in ps]
        probs = filtered_probs(logits.float(), torch.tensor(temp, device=dev),
                               [p.top_k for p in ps], [p.top_p for p in ps])
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(torch.tensor([[p.greedy] for p in ps], device=dev), one_hot, probs)
        noise = [uniform(seqs[i].key, seqs[i].num_output + step, DRAFT) for i in idx]
        return draw(probs, torch.tensor(noise, device=dev)).tolist(), probs
    return draft_sample


# --- Stop strings, matched as the text streams -------------------------------
class StopStrings:
    """Knuth-Morris-Pratt over the streaming text: O(new characters) per step. state[j]: how
    many leading characters of stop string j the text now ends with. A new character extends
    that match or falls back along j's failure table (the longest proper prefix that is also
    a suffix). The largest state is the trailing text that may still become a stop string."""

    def __init__(self, stops: list[str]):
        self.stops, self.state = stops, [0] * len(stops)
        self.fail = [self._failure(s) for s in stops]

    @staticmethod
    def _failure(s: str) -> list[int]:
        f, k = [0] * len(s), 0
        for i in range(1, len(s)):
            while k and s[i] != s[k]:
                k = f[k - 1]
            k += s[i] == s[k]
            f[i] = k
        return f

    def feed(self, text: str):
        """Advance over text. Returns (end, length) of the first stop string
        completed in it (end is an index into text, exclusive), or None."""
        # assignment: stop-strings
        for i, ch in enumerate(text):
            hit = 0
            for j, s in enumerate(self.stops):
                k = self.state[j]
                while k and s[k] != ch:
                    k = self.fail[j][k - 1]
                k += s[k] == ch
                if k == len(s):
                    hit, k = max(hit, k), self.fail[j][k - 1]
                self.state[j] = k
            if hit:                   # several end here: the longest started first
                return i + 1, hit
        return None
        # end assignment

    @property
    def partial(self) -> int:
        """Trailing characters that may still turn into a stop string."""
        # assignment: stop-strings
        return max(self.state)
        # end assignment
