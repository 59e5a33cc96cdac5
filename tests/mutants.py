"""
tests/mutants.py -- a catalog of the bugs students really write, one small
patch each, to prove that every assignment's tests catch them.

    python tests/assignments.py mutants [--only a,b]

applies each bug ALONE to a temporary copy of the repository, runs only its
assignment's tests there (`pytest --assignment NAME -x`), and prints which
test caught it, or NOT CAUGHT. A grader that passes a wrong answer is worse
than none: every bug below must be caught by its OWN assignment's tests,
not by another lesson's file (its student would still get full marks).

Each entry is (assignment, file, mistake, old, new): `old` must occur exactly
once in `file` (usually inside the assignment's region: the code a student
writes), and `new` is what a student wrote instead. The bugs are chosen to
be plausible, not deletions a type checker would catch: an off-by-one, the
wrong axis or head mapping, a sign, a missing release, the wrong
distribution, a skipped clamp or rounding. The tests were strengthened to
catch the CLASS of each mistake (values pinned against independent
references), so a different bug of the same kind is caught too.

The `old` texts quote lines of the solution, so `student` leaves this file
out of the student version: it is the instructor's.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    assignment: str   # whose tests must catch it
    file: str         # the source file patched, relative to the repository root
    mistake: str      # one line: what the student got wrong
    old: str          # exact text of the solution (must occur once in file)
    new: str          # what the student wrote instead


BUGS = [
    # ------------------------------------------------------------ rmsnorm-rope (model.py)
    Bug("rmsnorm-rope", "model.py", "RMSNorm sums the squares instead of averaging them",
        "x.pow(2).mean(-1, keepdim=True)", "x.pow(2).sum(-1, keepdim=True)"),
    Bug("rmsnorm-rope", "model.py", "RMSNorm adds eps after the square root",
        "torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)",
        "1 / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)"),
    Bug("rmsnorm-rope", "model.py", "RoPE rotates the wrong way (sign of sin flipped)",
        "x1 * cos - x2 * sin, x2 * cos + x1 * sin", "x1 * cos + x2 * sin, x2 * cos - x1 * sin"),
    Bug("rmsnorm-rope", "model.py", "RoPE pairs interleaved dims (GGUF order) instead of i and i + d/2",
        "x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]", "x1, x2 = x[..., 0::2], x[..., 1::2]"),
    Bug("rmsnorm-rope", "model.py", "Llama 3.1 rope scaling: the blend weights swapped",
        "blended = (1 - smooth) * scaled / factor + smooth * scaled",
        "blended = smooth * scaled / factor + (1 - smooth) * scaled"),
    Bug("rmsnorm-rope", "model.py", "Llama 3.1 rope scaling: low_freq_factor and high_freq_factor swapped in the band",
        "medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)",
        "medium = (wavelen >= old_ctx / lo) & (wavelen <= old_ctx / hi)"),
    Bug("rmsnorm-rope", "model.py", "Llama 3.1 rope scaling: smooth factor from wavelen / old_ctx (inverted ratio)",
        "smooth = (old_ctx / wavelen - lo) / (hi - lo)", "smooth = (wavelen / old_ctx - lo) / (hi - lo)"),

    # ------------------------------------------------------------ gqa-attention (model.py)
    Bug("gqa-attention", "model.py", "query head h read from KV head h % n_kv (interleaved) instead of h // G",
        "qg = q.view(N, n_kv, H // n_kv, d)                               # [N, n_kv, G, d]",
        "qg = q.view(N, H // n_kv, n_kv, d).transpose(1, 2)"),
    Bug("gqa-attention", "model.py", "causal mask off by one: a token also sees the next one",
        "causal = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()",
        "causal = torch.ones(N, N, dtype=torch.bool, device=q.device).tril(1)"),
    Bug("gqa-attention", "model.py", "scores scaled by 1/d instead of 1/sqrt(d)",
        "scale = d ** -0.5 if scale is None else scale", "scale = d ** -1 if scale is None else scale"),
    Bug("gqa-attention", "model.py", "softmax over the query axis instead of the key axis",
        "probs = scores.softmax(dim=-1)", "probs = scores.softmax(dim=-2)"),

    # ------------------------------------------------------------ bpe (tokenizer.py)
    Bug("bpe", "tokenizer.py", "merges the pair of HIGHEST rank first",
        "heapq.heappush(heap, (r, i, parts[i], parts[j]))", "heapq.heappush(heap, (-r, i, parts[i], parts[j]))"),
    Bug("bpe", "tokenizer.py", "merges the leftmost mergeable pair, whatever its rank",
        "heapq.heappush(heap, (r, i, parts[i], parts[j]))", "heapq.heappush(heap, (0, i, parts[i], parts[j]))"),
    Bug("bpe", "tokenizer.py", "a stale pair is merged: its parts changed since it was pushed",
        "if j >= n or parts[i] != a or parts[j] != b:", "if j >= n:"),
    Bug("bpe", "tokenizer.py", "after a merge only the pair to its right is a new candidate",
        "            candidate(prv[i])                           # the two new pairs\n", ""),

    # ------------------------------------------------------------ kv-cache-bytes (cache.py)
    Bug("kv-cache-bytes", "cache.py", "forgets the factor 2: counts K but not V",
        "return 2 * cfg.kv_layers * cfg.n_kv_heads", "return cfg.kv_layers * cfg.n_kv_heads"),
    Bug("kv-cache-bytes", "cache.py", "counts query heads instead of KV heads (no GQA saving)",
        "cfg.n_kv_heads * cfg.head_dim * bytes_per_value", "cfg.n_heads * cfg.head_dim * bytes_per_value"),
    Bug("kv-cache-bytes", "cache.py", "bits instead of bytes per value",
        "bytes_per_value = torch.finfo(dtype).bits // 8", "bytes_per_value = torch.finfo(dtype).bits"),
    Bug("kv-cache-bytes", "cache.py", "rounds the block count up: the pool exceeds the budget",
        "return int(budget_bytes // (bytes_per_token * block_size))",
        "return math.ceil(budget_bytes / (bytes_per_token * block_size))"),

    # ------------------------------------------------------------ paged-attention (cache.py)
    Bug("paged-attention", "cache.py", "query positions off by one: a query does not see its own token",
        "q_pos = torch.arange(seq_len - n_q, seq_len, device=q.device)",
        "q_pos = torch.arange(seq_len - n_q - 1, seq_len - 1, device=q.device)"),
    Bug("paged-attention", "cache.py", "query positions counted from 0, ignoring the cached prefix",
        "q_pos = torch.arange(seq_len - n_q, seq_len, device=q.device)",
        "q_pos = torch.arange(n_q, device=q.device)"),
    Bug("paged-attention", "cache.py", "query head h read from KV head h % n_kv (interleaved grouping)",
        "qg = q[start:start + n_q].view(n_q, n_kv, H // n_kv, d)",
        "qg = q[start:start + n_q].view(n_q, H // n_kv, n_kv, d).transpose(1, 2)"),
    Bug("paged-attention", "cache.py", "scores not scaled by 1/sqrt(d)",
        "k.float()) * scale\n", "k.float())\n"),
    Bug("paged-attention", "cache.py", "the batch's query offset never advances (every sequence reads the first queries)",
        "        start += n_q\n    return torch.cat(outs)", "    return torch.cat(outs)"),

    # ------------------------------------------------------------ block-allocation (cache.py)
    Bug("block-allocation", "cache.py", "takes the MOST recently used free block (LIFO) instead of the least",
        "block, _ = self.free_blocks.popitem(last=False)", "block, _ = self.free_blocks.popitem()"),
    Bug("block-allocation", "cache.py", "frees a table head-first: a prompt's first blocks are evicted first",
        "for block in reversed(table):\n            self._release(block)",
        "for block in table:\n            self._release(block)"),
    Bug("block-allocation", "cache.py", "a released block goes to the evict-first end of the free list",
        "self.free_blocks[block] = None          # most recently used end: evicted last",
        "self.free_blocks[block] = None\n            self.free_blocks.move_to_end(block, last=False)"),
    Bug("block-allocation", "cache.py", "slot = block + offset (forgets to multiply by block_size)",
        "return [table[p // bs] * bs + p % bs for p in range(start, start + count)]",
        "return [table[p // bs] + p % bs for p in range(start, start + count)]"),
    Bug("block-allocation", "cache.py", "reserve grows the table one block too many on a block boundary",
        "while len(table) * bs < start + count:\n            table.append", 
        "while len(table) * bs <= start + count:\n            table.append"),
    Bug("block-allocation", "cache.py", "a reused free block keeps its prefix-cache entry (stale hit)",
        "        self._forget(block)                         # evicted from the prefix cache\n", ""),

    # ------------------------------------------------------------ prefix-caching (cache.py)
    Bug("prefix-caching", "cache.py", "reuses the block of the last token: a fully cached prompt computes nothing",
        "for i in range((len(token_ids) - 1) // bs):", "for i in range(len(token_ids) // bs):"),
    Bug("prefix-caching", "cache.py", "lookup hashes each block alone, not chained to its parent",
        "h = self._key(parent, tokens)\n                block = self.cached.get(h)",
        "h = self._key(None, tokens)\n                block = self.cached.get(h)"),
    Bug("prefix-caching", "cache.py", "trusts the hash: no comparison of the stored tokens (collisions)",
        "if block is None or self.block_key[block][1:] != (parent, tokens):", "if block is None:"),
    Bug("prefix-caching", "cache.py", "a revived cached block stays in the free list",
        "del self.free_blocks[block]      # revive a cached free block", "pass"),
    Bug("prefix-caching", "cache.py", "registers the partly filled last block too",
        "for i in range(done, num_computed // bs):", "for i in range(done, -(-num_computed // bs)):"),
    Bug("prefix-caching", "cache.py", "resuming registration restarts the hash chain from None",
        "done, parent = self.hashed.get(seq_id, (0, None))\n        for i in range(done, num_computed // bs):",
        "done, parent = self.hashed.get(seq_id, (0, None))[0], None\n        for i in range(done, num_computed // bs):"),
    Bug("prefix-caching", "cache.py", "hits are not counted (the hit rate stays 0)",
        "                self.prefix_hits += 1\n", ""),

    # ------------------------------------------------------------ copy-on-write (cache.py)
    Bug("copy-on-write", "cache.py", "fork sets each shared block's ref count to 2 instead of incrementing it",
        "self.ref_count[b] += 1\n        self.hashed[child_id]", "self.ref_count[b] = 2\n        self.hashed[child_id]"),
    Bug("copy-on-write", "cache.py", "fork aliases the parent's table (same list object)",
        "self.tables[child_id] = list(self.tables[parent_id])", "self.tables[child_id] = self.tables[parent_id]"),
    Bug("copy-on-write", "cache.py", "copy-on-write never releases the shared block (ref count leak)",
        "                self._release(table[i])\n                table[i] = new\n", "                table[i] = new\n"),
    Bug("copy-on-write", "cache.py", "copy-on-write records the copy backwards (dst, src)",
        "self.pending_copies.append((table[i], new))", "self.pending_copies.append((new, table[i]))"),
    Bug("copy-on-write", "cache.py", "copy-on-write swaps in the private block but never records the data copy",
        "                self.pending_copies.append((table[i], new))\n", ""),
    Bug("copy-on-write", "cache.py", "copy-on-write changes the table without telling the engine (stale table rows)",
        "                table[i] = new\n                self.changed.add(seq_id)\n", "                table[i] = new\n"),

    # ------------------------------------------------------------ sliding-window (model.py, cache.py)
    Bug("sliding-window", "model.py", "the window holds W + 1 positions (q - W <= k)",
        "return k_pos[None, :] > q_pos[:, None] - window", "return k_pos[None, :] >= q_pos[:, None] - window"),
    Bug("sliding-window", "model.py", "the window counted from the first query position, not from each query",
        "return k_pos[None, :] > q_pos[:, None] - window", "return k_pos[None, :] > q_pos[:1, None] - window"),
    Bug("sliding-window", "cache.py", "frees by the step's LAST new position: its first queries lose keys they see",
        "range((start - self.sliding_window + 1) // bs)", "range((start + count - self.sliding_window) // bs)"),
    Bug("sliding-window", "cache.py", "rounds up: frees the block that holds the oldest visible position",
        "range((start - self.sliding_window + 1) // bs)", "range(-(-(start - self.sliding_window + 1) // bs))"),
    Bug("sliding-window", "cache.py", "counts the window in whole blocks (W // block_size), rounding it down",
        "range((start - self.sliding_window + 1) // bs)", "range(start // bs - self.sliding_window // bs)"),
    Bug("sliding-window", "cache.py", "a freed block is never released (the footprint grows with the length)",
        "                self._release(table[i])\n                table[i] = self.null_block",
        "                table[i] = self.null_block"),
    Bug("sliding-window", "cache.py", "the null block's entries take no reference (free() then hands it out)",
        "                self.ref_count[self.null_block] += 1\n", ""),

    # ------------------------------------------------------------ scheduler-step (scheduler.py)
    Bug("scheduler-step", "scheduler.py", "a preempted sequence is requeued at the BACK of the waiting queue",
        "self.waiting.appendleft(seq)", "self.waiting.append(seq)"),
    Bug("scheduler-step", "scheduler.py", "preempts the OLDEST running sequence while the pool is short",
        "victim = self.running[-1]        # the newest", "victim = self.running[0]        # the newest"),
    Bug("scheduler-step", "scheduler.py", "a prefill chunk ignores the remaining token budget",
        "count = self._fit(seq, seq.num_computed, min(seq.remaining, budget))",
        "count = self._fit(seq, seq.num_computed, seq.remaining)"),
    Bug("scheduler-step", "scheduler.py", "decode tokens are not charged to the step's token budget",
        "            out.append(ScheduledSeq(seq, seq.num_computed, count))\n            budget -= count\n"
        "        return budget\n        # end assignment\n\n    def _prefills",
        "            out.append(ScheduledSeq(seq, seq.num_computed, count))\n"
        "        return budget\n        # end assignment\n\n    def _prefills"),
    Bug("scheduler-step", "scheduler.py", "seats counted as sequences: a prompt of n > 1 not yet forked holds one",
        "seats = sum(self._seats(s) for s in self.running)", "seats = len(self.running)"),
    Bug("scheduler-step", "scheduler.py", "seat limit off by one: max_num_seqs - 1 sequences run",
        "if seats + self._seats(seq) > self.max_num_seqs:",
        "if seats + self._seats(seq) >= self.max_num_seqs:"),
    Bug("scheduler-step", "scheduler.py", "a prompt still being scored (prompt_logprobs) reads the prefix cache",
        "use_prefix_cache=seq.request.num_scored == seq.num_prompt)", "use_prefix_cache=True)"),
    Bug("scheduler-step", "scheduler.py", "a preempted sequence keeps its num_computed (stale cache count)",
        "seq.num_computed = 0                 # its tokens stay",
        "pass                                 # its tokens stay"),

    # ------------------------------------------------------------ sampler (sampler.py)
    Bug("sampler", "sampler.py", "top-k keeps k + 1 tokens",
        "vals = sub.topk(max(top_k[i] for i in k_rows), dim=-1).values      # [Rk, kmax], descending\n"
        "        kth = vals.gather(1, torch.tensor([[top_k[i] - 1] for i in k_rows], device=dev))",
        "vals = sub.topk(max(top_k[i] for i in k_rows) + 1, dim=-1).values\n"
        "        kth = vals.gather(1, torch.tensor([[top_k[i]] for i in k_rows], device=dev))"),
    Bug("sampler", "sampler.py", "temperature multiplies the logits instead of dividing them",
        "logits = logits / temperature[:, None]", "logits = logits * temperature[:, None]"),
    Bug("sampler", "sampler.py", "top-p drops the token that crosses the threshold",
        "before = probs.cumsum(dim=-1) - probs ", "before = probs.cumsum(dim=-1) "),
    Bug("sampler", "sampler.py", "top-k keeps only the tokens strictly above the k-th (k - 1 tokens)",
        "logits[rows] = sub.masked_fill(sub < kth, float(\"-inf\"))",
        "logits[rows] = sub.masked_fill(sub <= kth, float(\"-inf\"))"),
    Bug("sampler", "sampler.py", "inverse CDF with right=False: a zero-probability token can be drawn",
        "torch.searchsorted(cdf, x, right=True)", "torch.searchsorted(cdf, x, right=False)"),
    Bug("sampler", "sampler.py", "draw ignores the total mass: unnormalized probs sampled wrong",
        "x = (u.double() * cdf[:, -1])[:, None]", "x = u.double()[:, None]"),
    Bug("sampler", "sampler.py", "noise counter forgets the stream spacing: streams overlap across positions",
        "(position * 3 + stream + 1) * GOLDEN", "(position + stream + 1) * GOLDEN"),
    Bug("sampler", "sampler.py", 'min-p keeps everything: the floor is not scaled by the top probability',
        'floor = probs.amax(dim=-1, keepdim=True) * m', 'floor = 0 * probs.amax(dim=-1, keepdim=True) + m'),
    Bug("sampler", "sampler.py", 'repetition penalty divides negative logits too (makes them more likely)',
        'x = torch.where(x > 0, x / rep, x * rep)', 'x = x / rep'),
    Bug("sampler", "sampler.py", "presence/frequency penalties count the prompt's tokens too (vLLM: the output only)",
        'n = count([r.token_ids[len(r.token_ids) - r.position:] for r in reqs])', 'n = count([r.token_ids for r in reqs])'),
    Bug("sampler", "sampler.py", 'verification rows ignore the drafts before them in the penalty history',
        'count([r.drafts[:j] for r', 'count([r.drafts[:0] for r'),
    Bug("sampler", "sampler.py", 'verification row j counts its own draft in its penalty history',
        'count([r.drafts[:j] for r', 'count([r.drafts[:j + 1] for r'),
    Bug("sampler", "sampler.py", "repetition penalty forgets the prompt's tokens",
        'rep = torch.where(in_prompt | seen,', 'rep = torch.where(seen,'),
    Bug("sampler", "sampler.py", 'min-p measured against the second most likely token',
        'floor = probs.amax(dim=-1, keepdim=True) * m', 'floor = probs.topk(2, dim=-1).values[:, 1:] * m'),
    Bug("sampler", "sampler.py", "logprobs computed from temperature-scaled logits",
        "logp = logits[to_device(ridx, logits.device)].log_softmax(dim=-1)",
        "logp = (logits[to_device(ridx, logits.device)] / 0.7).log_softmax(dim=-1)"),
    Bug("sampler", "sampler.py", "logit_bias subtracted instead of added",
        "x[s, :, list(bias)] += to_device(", "x[s, :, list(bias)] -= to_device("),
    Bug("sampler", "sampler.py", "logit_bias on the first verified row only (drafts judged unbiased)",
        "x[s, :, list(bias)] += to_device(", "x[s, :1, list(bias)] += to_device("),
    Bug("sampler", "sampler.py", "a request with logit_bias but no penalty is never biased",
        "return pens != (1, 0, 0) or bool(self.logit_bias) or masked",
        "return pens != (1, 0, 0) or masked"),
    Bug("sampler", "sampler.py", "logit_bias after the repetition penalty (vLLM biases first)",
        '    for s, r in enumerate(reqs):       # logit_bias first (vLLM\'s order), on every verified row\n        if bias := r.params.logit_bias:\n            x[s, :, list(bias)] += to_device(list(bias.values()), dev, x.dtype)\n    seen = n > 0\n    rep = torch.where(in_prompt | seen, param("repetition_penalty"), 1.0)\n    x = torch.where(x > 0, x / rep, x * rep)\n',
        '    seen = n > 0\n    rep = torch.where(in_prompt | seen, param("repetition_penalty"), 1.0)\n    x = torch.where(x > 0, x / rep, x * rep)\n    for s, r in enumerate(reqs):       # logit_bias first (vLLM\'s order), on every verified row\n        if bias := r.params.logit_bias:\n            x[s, :, list(bias)] += to_device(list(bias.values()), dev, x.dtype)\n'),

    # ------------------------------------------------------------ mla-absorb (model.py)
    Bug("mla-absorb", "model.py", "softmax scale of the latent's width 1/sqrt(r + R), not the heads' 1/sqrt(nope + R)",
        "o = ctx.attend(self.kv_layer, q, latent, None, self.scale)", "o = ctx.attend(self.kv_layer, q, latent, None)"),
    Bug("mla-absorb", "model.py", "W_UK and W_UV swapped: kv_b_proj's halves of a head read in the wrong order",
        "[self.nope, self.dv], dim=1)                                  # [H, nope, r], [H, dv, r]",
        "[self.dv, self.nope], dim=1)[::-1]"),
    Bug("mla-absorb", "model.py", "kv_b_proj's rows taken head-innermost (head h: rows h, h + H, ...)",
        "w_uk, w_uv = self.kv_b_proj.weight.view(self.n_heads, -1, self.r).split(",
        "w_uk, w_uv = self.kv_b_proj.weight.view(-1, self.n_heads, self.r).transpose(0, 1).split("),
    Bug("mla-absorb", "model.py", "V from the wrong slice: the cached vector is [k_R ; latent], V still its first r",
        "latent = torch.cat([c, k_rope[:, 0]], dim=-1)[:, None]", "latent = torch.cat([k_rope[:, 0], c], dim=-1)[:, None]"),
    Bug("mla-absorb", "model.py", "the absorbed query drops its RoPE part (scores from the latent alone)",
        "q = torch.cat([torch.einsum(\"nhd,hdr->nhr\", q_nope, w_uk), q_rope], dim=-1)",
        "q = torch.cat([torch.einsum(\"nhd,hdr->nhr\", q_nope, w_uk), 0 * q_rope], dim=-1)"),
    Bug("mla-absorb", "model.py", "the weighted latents leave through W_UK, not W_UV (equal widths: no shape error)",
        "return torch.einsum(\"nhr,hvr->nhv\", o, w_uv)", "return torch.einsum(\"nhr,hvr->nhv\", o, w_uk)"),

    # ------------------------------------------------------------ pruning (prune.py)
    Bug("pruning", "prune.py", "a group's query heads taken from offset group x d, as if it had one head",
        "qr = (grp[:, None] * g * d + ar).flatten()", "qr = (grp[:, None] * d + ar).flatten()"),
    Bug("pruning", "prune.py", "v's rows taken from k's block of qkv_proj",
        "(cfg.n_heads + cfg.n_kv_heads) * d + kv])", "cfg.n_heads * d + kv])"),
    Bug("pruning", "prune.py", "up keeps its first channels, not the kept ones (gate and up disagree)",
        "torch.cat([gate[ch], up[ch]])", "torch.cat([gate[ch], up[:len(ch)]])"),
    Bug("pruning", "prune.py", "layers kept in the order of their scores, not their order in the model",
        "for new, old in enumerate(top(scores[\"layers\"], shape.n_layers).tolist()):",
        "for new, old in enumerate(scores[\"layers\"].topk(shape.n_layers).indices.tolist()):"),
    Bug("pruning", "prune.py", "the lowest-scored channels kept (the sign of the score flipped)",
        "ch = top(scores[\"channels\"][old], shape.ffn_dim)", "ch = top(-scores[\"channels\"][old], shape.ffn_dim)"),

    # ------------------------------------------------------------ stop-strings (sampler.py)
    Bug("stop-strings", "sampler.py", "on a mismatch the match restarts from 0 instead of the failure table",
        "while k and s[k] != ch:\n                    k = self.fail[j][k - 1]",
        "if k and s[k] != ch:\n                    k = 0"),
    Bug("stop-strings", "sampler.py", "stop strings searched only in the new piece (state not carried over)",
        "k = self.state[j]\n", "k = 0\n"),
    Bug("stop-strings", "sampler.py", "of two stop strings ending at one character, reports the first listed",
        "hit, k = max(hit, k), self.fail[j][k - 1]", "hit, k = hit or k, self.fail[j][k - 1]"),
    Bug("stop-strings", "sampler.py", "end index off by one (the stop string's last character kept)",
        "return i + 1, hit", "return i + 2, hit"),
    Bug("stop-strings", "sampler.py", "partial looks at the first stop string only",
        "return max(self.state)", "return self.state[0]"),
    Bug("stop-strings", "sampler.py", "KMP fallback off by one (fail[k] instead of fail[k - 1])",
        "while k and s[k] != ch:\n                    k = self.fail[j][k - 1]",
        "while k and s[k] != ch:\n                    k = self.fail[j][k]"),

    # ------------------------------------------------------------ rejection-sampling (speculative.py)
    Bug("rejection-sampling", "speculative.py", "batched: resamples a rejection from q instead of max(q - p, 0)",
        "residual = (final - draft_probs[rows, at]).clamp(min=0)", "residual = final"),
    Bug("rejection-sampling", "speculative.py", "single: resamples a rejection from q instead of max(q - p, 0)",
        "residual = (target_probs[i] - draft_probs[i]).clamp(min=0)", "residual = target_probs[i]"),
    Bug("rejection-sampling", "speculative.py", "batched: accepts with probability p/q instead of q/p",
        "accept_u < q / p.clamp(min=1e-30)", "accept_u < p / q.clamp(min=1e-30)"),
    Bug("rejection-sampling", "speculative.py", "batched: counts every accepted draft, not the accepted prefix",
        "n_acc = accept.long().cumprod(dim=1).sum(dim=1)", "n_acc = accept.long().sum(dim=1)"),
    Bug("rejection-sampling", "speculative.py", "batched: the bonus token is drawn from the last draft's residual",
        "rejected = (n_acc < num_drafts)[:, None]", "rejected = (n_acc <= num_drafts)[:, None]"),
    Bug("rejection-sampling", "speculative.py", "batched: residual not clamped at 0 (negative mass)",
        "residual = (final - draft_probs[rows, at]).clamp(min=0)", "residual = final - draft_probs[rows, at]"),
    Bug("rejection-sampling", "speculative.py", "single: the bonus token is drawn from the last draft's row",
        "torch.multinomial(target_probs[k], 1, generator=generator)",
        "torch.multinomial(target_probs[k - 1], 1, generator=generator)"),
    Bug("rejection-sampling", "speculative.py", "deterministic drafts: zeroes the first draft's token, not the rejected one",
        "residual = final.scatter(1, draft_tokens[rows, at].long()", "residual = final.scatter(1, draft_tokens[rows, 0].long()"),

    # ------------------------------------------------------------ ngram-drafter (speculative.py)
    Bug("ngram-drafter", "speculative.py", "takes the OLDEST earlier occurrence instead of the most recent",
        "for start in range(L - n - 1, -1, -1):", "for start in range(L - n):"),
    Bug("ngram-drafter", "speculative.py", "tries the shortest n-gram first",
        "for n in range(self.n_max, self.n_min - 1, -1):", "for n in range(self.n_min, self.n_max + 1):"),
    Bug("ngram-drafter", "speculative.py", "never tries n = n_min (range end off by one)",
        "for n in range(self.n_max, self.n_min - 1, -1):", "for n in range(self.n_max, self.n_min, -1):"),
    Bug("ngram-drafter", "speculative.py", "proposes the matched n-gram itself instead of what followed it",
        "return token_ids[start + n:start + n + k]", "return token_ids[start:start + k]"),
    Bug("ngram-drafter", "speculative.py", "proposes one token too many (k + 1)",
        "return token_ids[start + n:start + n + k]", "return token_ids[start + n:start + n + k + 1]"),

    # ------------------------------------------------------------ int8 (quantize.py)
    Bug("int8", "quantize.py", "truncates toward zero instead of rounding",
        "q = torch.round(w.float() / scale).clamp(-QMAX, QMAX)", "q = (w.float() / scale).trunc().clamp(-QMAX, QMAX)"),
    Bug("int8", "quantize.py", "scale = absmax / 128 (the outlier clips to 127)",
        "absmax / QMAX, torch.ones_like(absmax)", "absmax / 128, torch.ones_like(absmax)"),
    Bug("int8", "quantize.py", "rounds half away from zero by adding 0.5 and truncating (wrong for negatives)",
        "q = torch.round(w.float() / scale).clamp(-QMAX, QMAX)", "q = (w.float() / scale + 0.5).trunc().clamp(-QMAX, QMAX)"),
    Bug("int8", "quantize.py", "an all-zero slice divides by a zero scale",
        "scale = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))", "scale = absmax / QMAX"),
    Bug("int8", "quantize.py", "dequantize divides by the scale",
        "return q.to(dtype) * scale.unsqueeze(dim).to(dtype)", "return q.to(dtype) / scale.unsqueeze(dim).to(dtype)"),
    Bug("int8", "quantize.py", "Int8Linear scales the bias too",
        "return y if self.bias is None else y + self.bias\n        # end assignment",
        "return y if self.bias is None else y + self.bias * self.scale\n        # end assignment"),
    Bug("int8", "quantize.py", "int8 KV cache: V dequantized with K's scales",
        "((self.k, self.k_scale), (self.v, self.v_scale))", "((self.k, self.k_scale), (self.v, self.k_scale))"),

    # ------------------------------------------------------------ int4 (quantize.py)
    Bug("int4", "quantize.py", "the group's range is not widened to hold 0 (an all-positive group clips)",
        "lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)", "lo, hi = g.amin(-1), g.amax(-1)"),
    Bug("int4", "quantize.py", "scale = (max - min) / 16 (16 levels, but 15 steps between them)",
        "scale = ((hi - lo) / 15).clamp(min=1e-5).half()", "scale = ((hi - lo) / 16).clamp(min=1e-5).half()"),
    Bug("int4", "quantize.py", "an all-zero group divides by a zero scale",
        "scale = ((hi - lo) / 15).clamp(min=1e-5).half()", "scale = ((hi - lo) / 15).half()"),
    Bug("int4", "quantize.py", "the zero point is truncated instead of rounded",
        "zero = torch.round(-lo / scale.float()).clamp(0, 15)", "zero = (-lo / scale.float()).trunc().clamp(0, 15)"),
    Bug("int4", "quantize.py", "the levels are rounded with the float32 scale, not the float16 one stored",
        "q = (torch.round(g / scale.float()[..., None])", "q = (torch.round(g / ((hi - lo) / 15).clamp(min=1e-5)[..., None])"),
    Bug("int4", "quantize.py", "pack puts column 2j in the HIGH nibble (unpack expects the low one)",
        "return q[:, 0::2] | (q[:, 1::2] << 4)", "return (q[:, 0::2] << 4) | q[:, 1::2]"),
    Bug("int4", "quantize.py", "unpack concatenates the nibbles (all low, then all high) instead of interleaving",
        "torch.stack((packed & 15, packed >> 4), dim=-1)", "torch.cat((packed & 15, packed >> 4), dim=-1)"),
    Bug("int4", "quantize.py", "dequantize adds the zero point instead of subtracting it",
        "(q.reshape(N, G, -1).to(dtype) - zero[..., None].to(dtype))", "(q.reshape(N, G, -1).to(dtype) + zero[..., None].to(dtype))"),

    # ------------------------------------------------------------ awq (quantize.py)
    Bug("awq", "quantize.py", "the activation statistic is max |x|, not the mean",
        "mean, ref = x.abs().mean(0), x @ weight.t()", "mean, ref = x.abs().amax(0), x @ weight.t()"),
    Bug("awq", "quantize.py", "the quantized weight is not divided back by s (errs on what the folded model does not compute)",
        "w = dequantize_int4(*quantize_int4(weight * s, group)) / s", "w = dequantize_int4(*quantize_int4(weight * s, group))"),
    Bug("awq", "quantize.py", "the scales are inverted: W divided by s before quantizing",
        "w = dequantize_int4(*quantize_int4(weight * s, group)) / s", "w = dequantize_int4(*quantize_int4(weight / s, group)) * s"),
    Bug("awq", "quantize.py", "the error is measured on the weights, not on the layer's outputs",
        "err = (x @ w.t() - ref).pow(2).mean().item()", "err = (w - weight).pow(2).mean().item()"),
    Bug("awq", "quantize.py", "the grid skips alpha 0 (never falls back to round-to-nearest)",
        "for alpha in [i / AWQ_GRID for i in range(AWQ_GRID)]:", "for alpha in [i / AWQ_GRID for i in range(1, AWQ_GRID)]:"),
    Bug("awq", "quantize.py", "s is not clamped: a dead channel (mean 0) makes s 0",
        "s = mean.pow(alpha).clamp(min=1e-4)", "s = mean.pow(alpha)"),

    # ------------------------------------------------------------ decode-attention (kernels.py)
    Bug("decode-attention", "kernels.py", "key mask off by one: a query does not see its own token",
        "visible = torch.arange(T, device=q.device)[None, None, :] <= q_pos[:, :, None]   # [B, Q, T]\n"
        "    if cache.sliding_window:            # Mistral",
        "visible = torch.arange(T, device=q.device)[None, None, :] < q_pos[:, :, None]\n"
        "    if cache.sliding_window:            # Mistral"),
    Bug("decode-attention", "kernels.py", "sliding window off by one: W + 1 positions (k >= q - W)",
        "> q_pos[:, :, None] - cache.sliding_window\n    if on_cuda", ">= q_pos[:, :, None] - cache.sliding_window\n    if on_cuda"),
    Bug("decode-attention", "kernels.py", "the compiled path's window off by one (k >= q - W)",
        "> q_pos[:, :, None] - cache.sliding_window\n    visible = visible[..., None, None]",
        ">= q_pos[:, :, None] - cache.sliding_window\n    visible = visible[..., None, None]"),
    Bug("decode-attention", "kernels.py", "on CUDA, SDPA still gets a mask AND enable_gqa (math backend)",
        "if on_cuda(q.device) or v.shape[-1] != d:", "if v.shape[-1] != d:"),
    Bug("decode-attention", "kernels.py", "ragged queries: positions from the padded Q, not each sequence's query_lens",
        "q_pos = seq_lens[:, None] - query_lens[:, None] + i", "q_pos = seq_lens[:, None] - Q + i"),
    Bug("decode-attention", "kernels.py", "K/V heads tiled (h % n_kv) instead of grouped (h // G)",
        "out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v,",
        "out = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat(1, H // n_kv, 1, 1), "
        "v.repeat(1, H // n_kv, 1, 1),"),
    Bug("decode-attention", "kernels.py", "gathered K/V viewed with heads before tokens (wrong axis order)",
        "k, v = (t.view(B, T, n_kv, t.shape[-1]).transpose(1, 2) for t in (k, v))",
        "k, v = (t.reshape(B, n_kv, T, t.shape[-1]) for t in (k, v))"),

    # ------------------------------------------------------------ tensor-parallel (parallel.py)
    Bug("tensor-parallel", "parallel.py", "row-parallel slices the OUTPUT rows instead of the input columns",
        "_narrow_(linear, \"weight\", 1, rank, world_size)          # W [out, in/N]",
        "_narrow_(linear, \"weight\", 0, rank, world_size)"),
    Bug("tensor-parallel", "parallel.py", "row-parallel keeps the bias inside the linear: added on every rank",
        "        linear.bias = None\n", ""),
    Bug("tensor-parallel", "parallel.py", "column-parallel leaves the int8 scales unsliced",
        "for name in (\"weight\", \"bias\", \"scale\"):", "for name in (\"weight\", \"bias\"):"),
    Bug("tensor-parallel", "parallel.py", "vocab-parallel embedding does not zero other ranks' ids",
        "        x = x.masked_fill(~mine[:, None], 0)                     # ... and are zeroed\n", ""),
    Bug("tensor-parallel", "parallel.py", "vocab-parallel embedding looks up global ids without the rank's offset",
        "x = self.embed(torch.where(mine, ids - self.start, 0))", "x = self.embed(torch.where(mine, ids % self.end, 0))"),

    # ------------------------------------------------------------ sse-stream (serve.py)
    Bug("sse-stream", "serve.py", 'no data: [DONE] at the end of the stream',
        '            yield "data: [DONE]\\n\\n"\n',
        ''),
    Bug("sse-stream", "serve.py", 'events end with one newline instead of a blank line',
        '**usage, **extra}) + "\\n\\n"',
        '**usage, **extra}) + "\\n"'),
    Bug("sse-stream", "serve.py", 'chat stream never names the role',
        '"delta": {"role": "assistant", "content": ""}',
        '"delta": {"content": ""}'),
    Bug("sse-stream", "serve.py", 'a finished choice keeps being sent in later chunks',
        '                    if c.finish_reason:\n                        done.add(reply.index(out, c))\n',
        ''),
    Bug("sse-stream", "serve.py", 'no usage chunk before [DONE] when stream_options.include_usage asks for it',
        '                yield event([], usage=reply.usage())',
        '                pass'),
    Bug("sse-stream", "serve.py", 'the usage chunk is sent even when nobody asked for it',
        '            if opts.include_usage:',
        '            if True:'),
    Bug("sse-stream", "serve.py", 'served as application/json instead of text/event-stream',
        'media_type="text/event-stream"',
        'media_type="application/json"'),
    Bug("sse-stream", "serve.py", 'a client that leaves mid-stream is not aborted: its request keeps its blocks until it finishes',
        '                engine.abort(rids)\n    return StreamingResponse',
        '                pass\n    return StreamingResponse'),
    Bug("sse-stream", "serve.py", 'an error after the stream began ends it silently instead of with an error event and [DONE]',
        '            yield "data: " + json.dumps(error_json(e)) + "\\n\\ndata: [DONE]\\n\\n"',
        '            return'),

    # ------------------------------------------------------------ roofline (model.py)
    Bug("roofline", "model.py", "forgets the LM head",
        "return cfg.n_layers * per_layer + 2 * d * cfg.vocab_size", "return cfg.n_layers * per_layer"),
    Bug("roofline", "model.py", "k and v projections sized by the query heads",
        "2 * d * kv * hd + h * hd * d", "2 * d * h * hd + h * hd * d"),
    Bug("roofline", "model.py", "attention counted once (QK^T only, not PV)",
        "4 * h * hd * context", "2 * h * hd * context"),
    Bug("roofline", "model.py", "one FLOP per weight instead of two (multiply and add)",
        "per_layer = 2 * (d * h * hd", "per_layer = (d * h * hd"),
    Bug("roofline", "model.py", "the SwiGLU MLP counted as two matrices instead of three",
        "3 * d * f", "2 * d * f"),
]
