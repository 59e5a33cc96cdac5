"""
speculative.py -- draft, verify, and exact rejection sampling.

The lesson: a decode step is memory-bound, so feeding the target model k+1 tokens costs about
as much as feeding it 1 (the weights are read once either way). If a cheap drafter guesses the
next k tokens, the target checks them all in ONE pass, like a short prefill, and keeps the
longest prefix it agrees with: every pass yields 1 to k+1 tokens.

The rule that keeps the target's distribution EXACTLY (Leviathan et al. 2023, Chen et al.
2023), with target probabilities q and draft probabilities p:
    accept draft token x with probability min(1, q(x) / p(x));
    at the first rejection, sample a replacement from normalize(max(q - p, 0)) and stop;
    if all k are accepted, sample a bonus token from q at k+1.
(Why: P(output = x) = p(x) min(1, q/p) + P(reject) * residual(x) = q(x).)
Greedy decoding is the special case of one-hot q and p: accept while the draft is the target's
argmax, then emit the argmax. With an acceptance rate a per token, a pass yields
(1 - a^(k+1)) / (1 - a) tokens on average, so the expected speedup is that over c, the cost
of a step that drafts and verifies, in plain decode steps (1 + k*r when a draft token costs r
target passes; bench.py measures c): speedup = (1 - a^(k+1)) / ((1 - a) * c), as in the README.

Place in the data flow: LLM.step() (engine.py, engine.Speculation) asks a drafter for up to k
tokens per decoding sequence, runs the target once over each one's 1 + k tokens, verifies all
k+1 rows at once (rejection_sample_batched, via sampler.py) and truncates the KV caches past
the accepted tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from cache import BlockManager, Work, new_kv_cache
from model import load_model
from support import checks
from tokenizer import Tokenizer

MAX_SPECULATIVE_TOKENS = 16


# --- The rejection rule ------------------------------------------------------
def rejection_sample(target_probs, draft_probs, draft_tokens, generator=None) -> list[int]:
    """Accept a prefix of the draft and add one token of the target's own: target_probs [k+1, V],
    draft_probs [k, V], draft_tokens [k] -> 1..k+1 tokens; k uniforms, then one multinomial, from
    `generator`. The readable one-sequence rule: the tests hold rejection_sample_batched to it."""
    # assignment: rejection-sampling
    k = len(draft_tokens)
    u = torch.rand(k, generator=generator, device=target_probs.device)
    out = []
    for i in range(k):
        x = int(draft_tokens[i])
        q, p = target_probs[i, x], draft_probs[i, x]
        if p > 0 and u[i] < q / p or p == 0 and q > 0:   # min(1, q/p) without dividing by 0
            out.append(x)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
        # q == p leaves nothing to resample from (rejection had probability 0): keep q
        final = residual if residual.sum() > 0 else target_probs[i]
        return out + [int(torch.multinomial(final, 1, generator=generator))]
    return out + [int(torch.multinomial(target_probs[k], 1, generator=generator))]
    # end assignment


def rejection_sample_batched(target_probs, draft_probs, draft_tokens, num_drafts, accept_u):
    """The same rule for B sequences, sequence b with num_drafts[b] (a [B] tensor) drafts:
    target_probs [B, K+1, V]; draft_probs [B, K, V], or None for a deterministic drafter (n-gram:
    p one-hot); draft_tokens, accept_u (uniforms) [B, K], padded. Returns num_accepted [B] and
    final [B, V], the unnormalized distribution of the extra token (max(q - p, 0) at the first
    rejection, else the bonus row q), which the caller draws with its counter-based noise."""
    # B sequences, K drafts
    B, K, dev = target_probs.shape[0], target_probs.shape[1] - 1, target_probs.device
    if not K:                                                     # plain sampling: q itself
        return torch.zeros(B, dtype=torch.long, device=dev), target_probs[:, 0]
    rows = torch.arange(B, device=dev)
    # assignment: rejection-sampling
    idx = draft_tokens.long().clamp(min=0)[..., None]                      # [B, K, 1]
    q = target_probs[:, :K].gather(-1, idx)[..., 0]                         # [B, K]: q(x_i)
    p = torch.ones_like(q) if draft_probs is None else draft_probs.gather(-1, idx)[..., 0]
    accept = torch.where(p > 0, accept_u < q / p.clamp(min=1e-30), q > 0)   # u < min(1, q/p)
    accept &= torch.arange(K, device=q.device)[None] < num_drafts[:, None]
    n_acc = accept.long().cumprod(dim=1).sum(dim=1)                         # accepted prefix [B]
    final = target_probs[rows, n_acc]                                        # [B, V]: q at the stop
    rejected = (n_acc < num_drafts)[:, None]                     # else: the bonus row, q itself
    at = n_acc.clamp(max=K - 1)
    if draft_probs is None:          # max(q - onehot(x), 0) = q with x's entry zeroed (q(x) <= 1)
        residual = final.scatter(1, draft_tokens[rows, at].long().clamp(min=0)[:, None], 0.0)
    else:
        residual = (final - draft_probs[rows, at]).clamp(min=0)
    # a residual with no mass means rejection had probability 0: keep q
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, final)
    return n_acc, torch.where(rejected, residual, final)
    # end assignment


# --- Drafters: propose([(seq_id, token_ids, k)]) -> [(draft tokens, draft probs or None)]
class NgramDrafter:
    """Prompt lookup: if the last n tokens occurred earlier in this sequence, guess that what
    followed them then follows them now. No model; drafts are deterministic (p one-hot).
    It shines when the output copies its input: editing, summarizing, refactoring code."""

    def __init__(self, n_max: int = 4, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min

    def propose_one(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens for a sequence: for n from n_max down to n_min, its last n tokens
        searched for in the tokens before them; at the most recent match, the (at most k) tokens
        that followed it; [] if no n matches."""
        # assignment: ngram-drafter
        L = len(token_ids)
        for n in range(self.n_max, self.n_min - 1, -1):      # longest match first
            if L <= n:
                continue
            suffix = token_ids[-n:]
            for start in range(L - n - 1, -1, -1):           # the most recent earlier occurrence
                if token_ids[start:start + n] == suffix:
                    return token_ids[start + n:start + n + k]
        return []
        # end assignment

    def propose(self, requests, sample_fn=None):
        return [(self.propose_one(tokens, k), None) for _, tokens, k in requests]

    def rollback(self, seq_id, num_tokens=None):
        pass                                                  # stateless: nothing to roll back

    release = rollback                                        # ... nor to release


class ModelDrafter:
    """A smaller model with the same tokenizer drafts k tokens autoregressively in its own paged
    KV cache (its own BlockManager over the same sequence ids, fed by make_inputs(bm), the
    engine's graphs.StepInputs), so each draft step feeds only new tokens. rollback() truncates
    it to the tokens the target kept."""

    def __init__(self, model, num_blocks: int, block_size: int, device, dtype, make_inputs):
        self.model, self.device = model, device
        self.cache = new_kv_cache(model.config, num_blocks, block_size, device, dtype)
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.inputs = make_inputs(self.bm)
        self.computed: dict[int, int] = {}                    # seq_id -> tokens in the draft cache

    @torch.inference_mode()
    def propose(self, requests, sample_fn):
        """-> [(tokens, probs [len(tokens), V])]; sample_fn(logits [R, V], request indices, step)
        -> (tokens [R], probs [R, V]), with each one's params."""
        out = [([], []) for _ in requests]
        for sid, tokens, _ in requests:     # drafts the target never verified (the scheduler
            self.rollback(sid, len(tokens) - 1)   # dropped them) leave the cache: feed >= 1 token
        # Step 0 feeds what the draft cache lacks (usually 1-2 tokens); then the last draft.
        feed = {i: tokens[self.computed.get(sid, 0):]
                for i, (sid, tokens, k) in enumerate(requests) if k > 0}
        for step in range(max((k for _, _, k in requests), default=0)):
            work, active = [], []
            for i, new in feed.items():
                sid, tokens, _ = requests[i]
                if sid not in self.bm.tables:
                    self.bm.allocate(sid, tokens)
                start = self.computed.get(sid, 0)
                if not self.bm.can_append(sid, start, len(new)):
                    continue                                   # draft pool full: fewer drafts
                self.bm.reserve(sid, start, len(new))
                work.append(Work(sid, new, start))
                self.computed[sid] = start + len(new)
                active.append(i)
            if not work:
                break
            # logits at each sequence's last token; device(): input_ids, positions, ctx
            hb = self.inputs.host(work, np.cumsum([len(w.tokens) for w in work]) - 1)
            tokens, probs = sample_fn(self.model(*self.inputs.device(hb, self.cache)), active, step)
            for j, i in enumerate(active):
                out[i][0].append(int(tokens[j]))
                out[i][1].append(probs[j])
            feed = {i: [out[i][0][-1]] for i in active if step + 1 < requests[i][2]}
        return [(t, torch.stack(p) if p else None) for t, p in out]

    def rollback(self, seq_id, num_tokens):
        """Keep only the first num_tokens tokens' K/V (the rest were rejected)."""
        if seq_id in self.computed and self.computed[seq_id] > num_tokens:
            self.computed[seq_id] = num_tokens
            self.bm.truncate(seq_id, num_tokens)

    def release(self, seq_id):
        self.computed.pop(seq_id, None)
        if seq_id in self.bm.tables:
            self.bm.free(seq_id)


def make_drafter(c, target, tokenizer, pool_blocks: int, make_inputs):
    """The drafter of engine options `c` (engine.EngineConfig, checked): c.speculative is None,
    "ngram", or the directory of a draft model sharing the target's vocabulary (its paged cache:
    pool_blocks blocks, on the target's device and dtype)."""
    if c.speculative is None:
        return None
    if c.speculative == "ngram":           # prompt lookup: no model, drafts from the text itself
        return NgramDrafter()
    draft, cfg = load_model(c.speculative, device=c.device, dtype=c.dtype)
    draft_tokenizer = Tokenizer.from_pretrained(c.speculative)
    checks.check_same_vocabulary(c.speculative, cfg, draft_tokenizer, target, tokenizer)
    return ModelDrafter(draft, pool_blocks, c.block_size, c.device, c.dtype, make_inputs)
