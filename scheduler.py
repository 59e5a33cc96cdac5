"""
scheduler.py -- continuous batching: the engine loop.

The lesson: decode is memory-bound. Each step reads every weight once, so a
decode matmul over B sequences does 2*B FLOPs per weight read (arithmetic
intensity ~ B): batching is the most important serving optimization. But
requests arrive at different times and want different lengths; "static"
batching (run a group to completion, then the next) leaves seats empty while
the longest one finishes. Continuous batching schedules ONE step at a time:

    every step:  finished sequences leave, waiting ones join at once,
                 and the tokens of all running sequences form one flat batch.

Selective batching makes that possible: the MLPs and norms work on a flat
[N, D] tensor whatever sequence each token belongs to; only attention is
per sequence, over its own paged KV cache (cache.py, kernels.py).

Place in the data flow: text -> Tokenizer.encode -> add_request (a Request
with its Sequences, queued) -> LLM.step() until done -> RequestOutput.
LLM.step() has four parts, and this file reads in their order:
    1. schedule   Scheduler.schedule(): which sequences run, how many tokens each
    2. forward    LLM._forward: one Transformer.forward over all N scheduled tokens
    3. sample     sample_requests() picks logits rows (+ prompt rows to score); sampler.py draws or verifies
                  drafts, with ONE wait for the device
    4. append     LLM._append_all / Sequence.append: stop strings, EOS, max_tokens;
                  finished sequences free their blocks
A request that goes wrong alone (its drafts, text, logits) finishes alone: "error".
SamplingParams is sampler.py's: `from scheduler import LLM, SamplingParams`.
"""
from __future__ import annotations

import itertools
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass

import torch

from cache import BlockManager, apply_pending_copies, kv_cache_bytes, num_blocks_for_budget
from kernels import CompiledDecoder, StepInputs
from model import default_model_path, load_model
from parallel import TensorParallelError, TensorParallelGroup
from quantize import int8_kv_cache_bytes, make_kv_cache, quantize_model
from sampler import SampleRequest, SamplingParams, batch_then_each, draft_sampler, prompt_logprobs, sample_isolated
from sequence import FINISHED, RUNNING, WAITING, Request, RequestOutput, Sequence
from speculative import make_drafter
from support import checks
from support.checkpoint import tokenizer_path
from support.timing import choose_weight_layout, step_memory
from tokenizer import Tokenizer

# --- Part 1: the scheduler ----------------------------------------------------
@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int              # first position fed this step (= num_computed before the step)
    count: int              # tokens fed: a prefill chunk, 1, or 1 + len(drafts)

    @property
    def tokens(self) -> list[int]:
        """The token ids fed: a prefill chunk, or the last sampled token (+ drafts to verify)."""
        return (self.seq.token_ids[self.start:] + self.seq.draft_tokens)[:self.count]


class Scheduler:
    """FCFS waiting queue + running list, one token budget per step. A step takes
    (1) 1 token (1 + drafts) of every decoding sequence, (2) the next chunk of every
    prefilling one, (3) waiting sequences, oldest first, while seats, budget and free
    blocks last. When the pool runs short, the NEWEST running sequence gives its
    blocks back, so the oldest always finishes."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()      # FCFS; a preempted sequence rejoins at the front
        self.running: list[Sequence] = []            # oldest first: the last one is preempted first
        self.num_preemptions = 0
        self.release_hooks = []                  # called with a sequence whose blocks were freed

    def _seats(self, seq):
        """Seats a sequence takes: a request with n > 1 forks when its prompt is done."""
        return seq.params.n if len(seq.request.seqs) == 1 and seq.params.n > 1 else 1

    def _fit(self, seq, start: int, count: int) -> int:
        """How many of `count` tokens from `start` the pool can take now (no shared blocks)."""
        table, bs = self.bm.tables[seq.seq_id], self.bm.block_size
        return max(0, min(count, len(table) * bs - start + self.bm.num_free_blocks * bs))

    def preempt(self, seq: Sequence):
        """Preemption by recompute: drop the cache, keep the tokens, requeue first."""
        # assignment: scheduler-step
        self.running.remove(seq)
        self.bm.free(seq.seq_id)
        for hook in self.release_hooks:
            hook(seq)
        seq.num_computed, seq.status, seq.draft_tokens = 0, WAITING, []
        seq.request.metrics.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        # end assignment

    def schedule(self) -> list[ScheduledSeq]:
        # assignment: scheduler-step
        for _ in range(len(self.running) + 1):
            out = self._schedule_once()
            if out or not self.running:
                return out
            self.preempt(self.running[-1])      # stuck: every running sequence waits for blocks
        return []
        # end assignment

    def _schedule_once(self) -> list[ScheduledSeq]:
        # assignment: scheduler-step
        # The token budget bounds one forward pass: decode tokens are cheap (memory-bound), prefill
        # tokens are compute; chunked prompts keep each step short, so no decode stalls behind one.
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []

        # (1) decoding sequences, oldest first: 1 token (+ drafts) each.
        for seq in [s for s in self.running if s.remaining == 1]:
            if seq.status != RUNNING:            # preempted below as a victim
                continue
            count = 1 + len(seq.draft_tokens)
            if count > budget:                   # no room to verify: drop the drafts
                seq.draft_tokens, seq.draft_probs, count = [], None, 1
                if budget == 0:
                    break
            while not self.bm.can_append(seq.seq_id, seq.num_computed, count):
                victim = self.running[-1]        # the newest sequence gives its blocks back
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status != RUNNING:
                continue
            self.bm.reserve(seq.seq_id, seq.num_computed, count)
            out.append(ScheduledSeq(seq, seq.num_computed, count))
            budget -= count
        scheduled = {item.seq for item in out}

        # (2) running sequences in the middle of a chunked prefill.
        for seq in [s for s in self.running if s not in scheduled]:
            count = self._fit(seq, seq.num_computed, min(seq.remaining, budget))
            if count == 0:
                continue
            self.bm.reserve(seq.seq_id, seq.num_computed, count)
            out.append(ScheduledSeq(seq, seq.num_computed, count))
            budget -= count

        # (3) admit waiting sequences in arrival order (no skipping ahead).
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + self._seats(seq) > self.max_num_seqs:
                break
            cached = self.bm.allocate(seq.seq_id, seq.token_ids,     # prefix cache hits; not for a prompt
                                      use_prefix_cache=seq.request.num_scored == seq.num_prompt)  # to score
            count = self._fit(seq, cached, min(len(seq.token_ids) - cached, budget))
            if count == 0:
                self.bm.free(seq.seq_id)                             # no room yet: try next step
                break
            self.waiting.popleft()
            seq.status, seq.num_computed = RUNNING, cached
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = time.perf_counter()
                seq.request.metrics.cached_tokens = cached
            self.running.append(seq)
            self.bm.reserve(seq.seq_id, cached, count)
            out.append(ScheduledSeq(seq, cached, count))
            budget -= count
        return out
        # end assignment

    def fork(self, seq: Sequence, num_computed: int, tokenizer) -> list[Sequence]:
        """n > 1: when the prompt is done, add n - 1 sequences sharing its blocks. This runs before
        the forward pass, after the parent's slots were reserved: the children share what it fills."""
        req, children = seq.request, []
        while len(req.seqs) < req.params.n:
            child = Sequence(req, seq.token_ids, len(req.seqs), tokenizer)
            child.status, child.num_computed = RUNNING, num_computed
            self.bm.fork(seq.seq_id, child.seq_id)               # ref counts up, nothing copied
            req.seqs.append(child)
            self.running.append(child)
            children.append(child)
        return children

    def finish(self, seq: Sequence):
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self.bm.tables:
            self.bm.free(seq.seq_id)
        for hook in self.release_hooks:
            hook(seq)
        seq.status = FINISHED


# --- Part 3: who samples, and speculative decoding's side -------------------
def sample_requests(batch, scheduler, tokenizer):
    """Which sequences sample this step, from which logits rows: the last row of each sequence
    whose cache will then hold all its tokens, or all 1 + k rows of a verification. A prompt
    of a request with n > 1 forks here (copy-on-write). Then the rows of the prompt positions
    a request scores (prompt_logprobs), after all those: scored = [(request, first entry, count)]."""
    asks, rows, scored, prompt_rows, end = [], [], [], [], 0
    for item in batch:
        seq, req = item.seq, item.seq.request
        # position p scores prompt token p + 1: this chunk's positions not scored yet (a recompute skips them)
        first, last = max(item.start, req.num_scored - 1), min(item.start + item.count, seq.num_prompt - 1)
        if first < last:
            scored.append((req, first + 1, last - first))
            prompt_rows += range(end + first - item.start, end + last - item.start)
        end += item.count                      # this sequence's tokens end here in the flat batch
        if seq.draft_tokens:
            asks.append((seq, SampleRequest(len(rows), list(seq.draft_tokens), seq.params, seq.key,
                                            seq.num_output, seq.token_ids, seq.draft_probs)))
            rows += range(end - item.count, end)
        elif item.start + item.count == len(seq.token_ids):
            forked = [seq] + scheduler.fork(seq, item.start + item.count, tokenizer)   # children share the row
            if seq.params.max_tokens:          # max_tokens=0 only scores its prompt: nothing to sample
                asks += [(s, SampleRequest(len(rows), [], s.params, s.key, s.num_output, s.token_ids)) for s in forked]
                rows.append(end - 1)
    return asks, rows + prompt_rows, scored


class Speculation:
    """Drafts before a step, bookkeeping after it (the step's one pass verifies them)."""

    def __init__(self, drafter, k: int, stats: dict, scheduler: Scheduler):
        self.drafter, self.k, self.stats = drafter, k, stats
        scheduler.release_hooks.append(lambda seq: drafter.release(seq.seq_id))   # freed: the draft cache too

    def propose(self, running, max_len: int, fail):
        """Up to k drafts for every decoding sequence, never past max_tokens or the context (the last
        token is the target's). A drafter error fails only the requests whose own drafts raise."""
        asks = []
        for seq in running:
            seq.draft_tokens, seq.draft_probs = [], None
            k = min(self.k, seq.params.max_tokens - seq.num_output - 1, max_len - len(seq.token_ids) - 1)
            if seq.remaining == 1 and k > 0:
                asks.append((seq, (seq.seq_id, seq.token_ids, k)))
        drafts = batch_then_each(lambda part: self.drafter.propose([a for _, a in part], draft_sampler(part)),
                                 asks, fail, "drafting", ([], None))   # draft_sampler: each request's params
        for (seq, _), (tokens, probs) in zip(asks, drafts):
            if seq.status == RUNNING:
                seq.draft_tokens, seq.draft_probs = list(tokens), probs

    def verified(self, seq, n_accepted: int, block_manager):
        """After the target's pass: keep the cache of the accepted drafts only."""
        m = len(seq.draft_tokens)
        seq.num_computed = len(seq.token_ids) + n_accepted    # K/V hold the fed token + accepted drafts;
        block_manager.truncate(seq.seq_id, seq.num_computed)  # the last (correction or bonus) is fed next step
        self.drafter.rollback(seq.seq_id, seq.num_computed)
        for name, n in (("draft_tokens", m), ("accepted_tokens", n_accepted), ("verify_steps", 1)):
            setattr(seq.request.metrics, name, getattr(seq.request.metrics, name) + n)   # this request ...
            self.stats[name] += n                                                     # ... and the engine
        seq.draft_tokens, seq.draft_probs = [], None


# --- The engine ---------------------------------------------------------------
class LLM:
    """Model + tokenizer + paged KV cache + scheduler + sampler. Offline: llm.generate(prompts,
    params); online (serve.py): add_request() / step() / abort() from one engine thread.
    Options, each its own file's lesson:
      quantization="int8"    int8 weight-only linears (quantize.py; on CPU dtype "auto" is bf16)
      kv_cache_dtype="int8"  the KV pool stores int8 + a scale per token and head
      compile=True           steps of <= k+1 tokens per sequence through torch.compile and
                             padded buckets (kernels.py; CUDA graphs on a GPU)
      speculative="ngram" | draft model directory, num_speculative_tokens=k (speculative.py)
      tensor_parallel_size=N every layer split over N devices (parallel.py); llm.close() stops them"""

    def __init__(self, path=None, device="auto", dtype="auto", block_size=16, kv_cache_bytes=None,
                 max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=True,
                 quantization=None, kv_cache_dtype=None, compile=False, speculative=None,
                 num_speculative_tokens=4, tensor_parallel_size=1):
        self.device, self.dtype = checks.resolve_device_dtype(device, dtype, quantization)
        checks.check_engine_options(max_num_seqs, max_num_batched_tokens, compile, tensor_parallel_size)
        self.path = path or default_model_path()
        self.model, self.config, self.tp = load_engine_model(self.path, self.device, self.dtype, quantization,
                                                             tensor_parallel_size, compile)
        self.tokenizer = Tokenizer.from_pretrained(tokenizer_path(self.path))
        max_query_len = num_speculative_tokens + 1 if speculative else 1     # verify steps: k + 1 tokens
        # compile=True settles what else stays in memory first: the weights' layout (rewritten one
        # layer at a time) and, on CUDA, the compiled step's bytes (its graphs' pool included).
        self.weight_layout = choose_weight_layout(self.model) if compile else "default"
        reserve = compiled_step_reserve(self.model, self.config, self.dtype, self.device, block_size, kv_cache_dtype,
                                        max_num_seqs, max_query_len) if compile and kv_cache_bytes is None else 0
        # The KV pool takes the memory the weights left, in blocks of the lecture's
        # bytes per token (make_kv_pool): it bounds the batch AND the longest sequence.
        scratch = 1 if compile else 0      # kernels.py: padded rows write into a block no sequence owns
        self.cache, num_blocks = make_kv_pool(
            self.tp.config if self.tp else self.config, self.dtype, self.device, block_size, kv_cache_bytes,
            kv_cache_dtype, scratch, self.tp and (lambda n: self.tp.allocate_cache(n, block_size, kv_cache_dtype)),
            reserve=reserve)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching, self.config.sliding_window)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.inputs = StepInputs(self.block_manager, self.device)
        self.max_len = min(self.config.max_seq_len, num_blocks * block_size)   # the longest that can run
        self.decoder, self.compile_seconds = None, 0.0
        if compile:
            self.decoder, self.compile_seconds = make_compiled_decoder(
                self.model, self.cache, max_num_seqs, self.max_len, block_size, num_blocks, max_query_len)
        self.requests: dict[str, Request] = {}
        self._request_ids, self._rng = itertools.count(), random.Random(0)   # rng: seeds of unseeded requests
        self.stats = {"steps": 0, "batched_tokens": 0,     # forward passes, and tokens they processed
                      "draft_tokens": 0, "accepted_tokens": 0, "verify_steps": 0}
        self.drafter = make_drafter(speculative, num_speculative_tokens, max_num_batched_tokens, self.config,
                                    self.tokenizer, num_blocks, block_size, self.device, self.dtype,
                                    lambda bm: StepInputs(bm, self.device))
        self.speculation = None if self.drafter is None else \
            Speculation(self.drafter, num_speculative_tokens, self.stats, self.scheduler)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt (a string or token ids); a bad request raises ValueError, touching nothing."""
        params = params or SamplingParams()
        # a string with special tokens allowed: the caller owns the whole prompt
        ids = self.tokenizer.encode(prompt, allow_special=True) if isinstance(prompt, str) else prompt
        # types, the vocabulary, room to generate, n <= max_num_seqs seats: ValueError/TypeError (support/)
        ids = checks.check_request(ids, params, SamplingParams, self.config, self.max_len,
                                   self.scheduler.max_num_seqs)
        request_id = checks.new_request_id(request_id, self.requests, self._request_ids)   # unique: a str
        seed = params.seed if params.seed is not None else self._rng.getrandbits(64)   # the request's noise
        req = Request(request_id, ids, params, time.perf_counter(), seed)
        req.seqs.append(Sequence(req, ids, 0, self.tokenizer))   # with n > 1, forked when the prompt is done
        self.requests[request_id] = req
        self.scheduler.waiting.append(req.seqs[0])               # FCFS: at the back of the queue
        return request_id

    def abort(self, request_id: str):
        """Stop a request now and give its blocks back."""
        if str(request_id) in self.requests:
            self._finish_request(self.requests[str(request_id)], "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self):
        """Stop the tensor-parallel workers (also done at interpreter exit)."""
        if self.tp is not None:
            self.tp.close()

    def _fail(self, req: Request, message: str) -> Request:
        """A request that went wrong finishes alone: finish_reason "error", blocks freed."""
        return self._finish_request(req, "error", message)

    def _finish_request(self, req: Request, reason: str, error: str | None = None) -> Request:
        self.requests.pop(req.request_id, None)
        for seq in req.seqs:
            if seq.status != FINISHED:
                self.scheduler.finish(seq)
                seq.finish_reason = reason
        req.error = error
        req.metrics.finish_time = time.perf_counter()
        return req

    # -- one step: schedule, forward, sample, append --------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Returns the requests that made progress (a finished one for the last time)."""
        failed: dict[str, Request] = {}
        fail = lambda req, msg: failed.setdefault(req.request_id, self._fail(req, msg))   # noqa: E731
        # Drafts come first: a sequence verifying k drafts feeds k + 1 tokens this
        # step, and the scheduler must count them against the token budget.
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running, self.max_len, fail)
        # An error that no single request explains fails this step's requests
        # (their blocks freed); the engine itself keeps serving the others.
        batch = []
        try:
            batch = self.scheduler.schedule()                     # 1. who runs, how many tokens each
            if not batch:        # with nothing running, the oldest waiting request can never fit
                if not self.scheduler.running and self.scheduler.waiting:     # fail it rather than spin
                    seq = self.scheduler.waiting[0]
                    fail(seq.request, checks.unschedulable(seq.request.request_id, len(seq.token_ids),
                                                           self.block_manager.num_blocks))
                return [r.output() for r in failed.values()]
            asks, rows, scored = sample_requests(batch, self.scheduler, self.tokenizer)   # who samples, which rows
            logits = self._forward(batch, rows)                   # 2. one pass over every scheduled token
            lp = prompt_logprobs(logits, [t for r, i, n in scored for t in r.prompt_ids[i:i + n]],
                                 max(r.params.prompt_logprobs for r, _, _ in scored)) if scored else ()
            new = sample_isolated(logits, asks, fail, lp)         # 3. one wait for the device (lp's too)
            per_row = zip(*lp)                                    # (logprob, top values, their ids) per row
            for req, first, count in scored:
                k, req.num_scored = req.params.prompt_logprobs, first + count
                req.prompt_logprobs[first:first + count] = [(c, dict(zip(i[:k], v[:k])))
                                                            for c, v, i in itertools.islice(per_row, count)]
        except Exception as e:                                    # no single request explains it
            print(f"nanoinfer: engine step failed: {e!r}", file=sys.stderr)
            self.block_manager.pending_copies.clear()         # its requests fail: drop their copies
            for seq in [it.seq for it in batch] if batch else list(self.scheduler.running):
                fail(seq.request, f"engine step failed: {e!r}")
            if isinstance(e, TensorParallelError):    # a lost worker: nothing can run any more
                raise
            return [r.output() for r in failed.values()]
        return self._append_all(batch, asks, new, fail, failed)   # 4. append, stop, report

    def _forward(self, batch: list[ScheduledSeq], logits_rows: list[int]):
        """One forward pass over the flat batch of every scheduled token."""
        copies = list(self.block_manager.pending_copies)
        apply_pending_copies(self.cache, self.block_manager)     # copy-on-write before anyone writes
        N = sum(item.count for item in batch)
        select = None if logits_rows == list(range(N)) else logits_rows     # None: every row's logits
        hb = self.inputs.host([(it.seq.seq_id, it.tokens, it.start) for it in batch], select)
        if self.decoder is not None and self.decoder.fits(hb.query_lens):   # decodes, verifications
            return self.decoder(hb.input_ids, hb.positions, hb.slot_mapping, self.inputs.tables[hb.rows],
                                hb.query_lens, select)
        input_ids, positions, ctx = self.inputs.device(hb, self.cache)
        if self.tp is not None:            # every rank runs its slice; rank 0 gets the gathered logits
            return self.tp.forward(input_ids, positions, ctx, copies=copies)
        return self.model(input_ids, positions, ctx)             # [len(logits_rows), V]

    def _append_all(self, batch, asks, new, fail, failed) -> list[RequestOutput]:
        """Append each sequence's new tokens; an error in one (its text, its logits) fails it alone."""
        for item in batch:
            seq = item.seq
            seq.num_computed = item.start + item.count
            if seq.status == RUNNING and not seq.draft_tokens:   # prompt blocks now: kept even if it ends
                self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed)
                if not seq.params.max_tokens and seq.remaining == 0:     # scored its prompt: done
                    self._finish_request(seq.request, "length")
        for (seq, ask), (tokens, logprobs, finite) in zip(asks, new):
            try:
                if seq.status != RUNNING:
                    continue                       # its request failed earlier this step
                if not finite:
                    raise FloatingPointError("the model produced non-finite logits for this request")
                if ask.drafts:
                    self.speculation.verified(seq, len(tokens) - 1, self.block_manager)
                for j, token in enumerate(tokens):
                    if seq.status != RUNNING:
                        break                      # stopped by an earlier token of this step
                    self._append(seq, token, None if logprobs is None else logprobs[j])
            except Exception as e:
                fail(seq.request, f"{type(e).__name__}: {e}")
        touched = dict(failed)
        for seq in [item.seq for item in batch] + [seq for seq, _ in asks]:
            if seq.status == RUNNING:              # full blocks become reusable prefixes
                self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed)
            elif seq.request.finished:
                self.requests.pop(seq.request.request_id, None)
            touched[seq.request.request_id] = seq.request
        self.stats["steps"] += 1
        self.stats["batched_tokens"] += sum(item.count for item in batch)
        return [req.output() for req in touched.values()]

    def _append(self, seq: Sequence, token: int, logprob=None):
        """Add a sampled token; finish the sequence if it hit a stop condition. Checked token
        by token, so a speculative step stops exactly where plain decoding would."""
        metrics = seq.request.metrics
        metrics.output_tokens += 1
        metrics.first_token_time = metrics.first_token_time or time.perf_counter()
        reason = seq.append(token, logprob, self.tokenizer.eos_token_id, self.max_len)
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            if seq.request.finished:
                metrics.finish_time = time.perf_counter()

    def generate(self, prompts, params: SamplingParams | list | None = None) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in input order. A bad
        prompt raises ValueError naming its index; an interrupted call aborts its requests."""
        prompts, params = checks.generate_inputs(prompts, params)    # lists of one length
        ids, final = [], {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                with checks.naming(f"prompt {i}"):          # its ValueError or TypeError, prefixed
                    ids.append(self.add_request(prompt, p))
            while len(final) < len(ids):
                final.update((out.request_id, out) for out in self.step() if out.finished)
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        return [final[rid] for rid in ids]


# --- Building an engine: the model, the KV pool, the compiled path -----------
def load_engine_model(path, device, dtype, quantization, tensor_parallel_size: int, compile: bool):
    """(model, config, tp). tp is None on one device; with N > 1 this process is rank 0 of a
    parallel.py group whose workers hold the other slices, and model is rank 0's slice."""
    tp = None
    if tensor_parallel_size != 1:
        tp = TensorParallelGroup(path, tensor_parallel_size, device, dtype, quantization)
        model, config = tp.model, tp.full_config       # the group shards (and quantizes) on every rank
    else:
        model, config = load_model(path, device=device, dtype=dtype)
        if quantization is not None:                   # int8 weights: a quarter of fp32's bytes per step
            quantize_model(model, quantization)
    if config.random_seed is not None:
        print(f"nanoinfer: {path}: RANDOM weights (published shapes, seed {config.random_seed}): "
              "timings are real, the text is noise")
    return model, config, tp


def make_kv_pool(cfg, dtype, device, block_size: int, budget: int | None, kv_cache_dtype, scratch: int,
                 allocate=None, reserve: int = 0):
    """The KV pool: as many blocks as the byte budget allows; returns (cache, usable blocks).
    The central memory trade-off of serving: every byte given to the KV cache is more
    concurrent context. With tensor parallelism cfg is one rank's shard and allocate(num_blocks)
    makes every rank's pool: the same budget per device holds N times the tokens."""
    # bytes per token = 2 (K and V) * layers * kv_heads * head_dim * bytes per value (+ int8's scales)
    per_token = int8_kv_cache_bytes(cfg) if kv_cache_dtype == "int8" else kv_cache_bytes(cfg, dtype)
    if budget is None:     # CUDA: 90% of what the weights left free, less a compiled step's `reserve`; CPU: 1 GiB
        budget = int(0.9 * torch.cuda.mem_get_info(device)[0]) - reserve if device.type == "cuda" else 1 << 30
    num_blocks = num_blocks_for_budget(per_token, block_size, budget)
    checks.check_pool_size(num_blocks, 1 + scratch, budget, block_size, per_token)
    cache = allocate(num_blocks) if allocate else \
        make_kv_cache(cfg, num_blocks, block_size, kv_cache_dtype, device, dtype)   # model dtype or int8
    value = f"(1 B + 4/{cfg.head_dim} B of scale)" if kv_cache_dtype == "int8" else f"{dtype.itemsize} B"
    print(f"nanoinfer: KV cache {num_blocks - scratch} blocks x {block_size} tokens = "
          f"{(num_blocks - scratch) * block_size} tokens; {per_token} B/token = 2*{cfg.n_layers} layers*"
          f"{cfg.n_kv_heads} kv heads*{cfg.head_dim} dims*{value}; {cache.total_bytes / 2**20:.1f} MiB allocated")
    return cache, num_blocks - scratch     # scratch blocks: a compiled step's padded rows (kernels.py)


def compiled_step_reserve(model, cfg, dtype, device, block_size, kv_cache_dtype, max_num_seqs, max_query_len) -> int:
    """CUDA: the bytes compiled steps keep beside the KV pool, their graphs' pool included: the largest
    bucket, run on a one-block pool before the real pool is sized (support/timing.py step_memory)."""
    pool = lambda: make_kv_cache(cfg, 1, block_size, kv_cache_dtype, device, dtype)   # noqa: E731
    return 0 if device.type != "cuda" else step_memory(lambda: CompiledDecoder(
        model, pool(), max_num_seqs, math.ceil(cfg.max_seq_len / block_size), 0, (1, max_query_len)).scratch_step(),
        device, graphs=True)


def make_compiled_decoder(model, cache, max_num_seqs: int, max_len: int, block_size: int, scratch_block: int,
                          max_query_len: int = 1):
    """compile=True: steps of <= max_query_len tokens per sequence through torch.compile
    (kernels.py), every bucket compiled now rather than in the middle of serving."""
    decoder = CompiledDecoder(model, cache, max_num_seqs, -(-max_len // block_size), scratch_block, (1, max_query_len))
    seconds = decoder.warmup()
    print(f"nanoinfer: compiled steps of {decoder.query_sizes} tokens per sequence for batch buckets "
          f"{decoder.batch_sizes} and table widths {decoder.widths} in {seconds:.1f} s")
    return decoder, seconds
