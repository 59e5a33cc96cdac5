"""
engine.py -- the engine assembled: the last lesson puts the others together.

The lesson: an inference engine is a loop of four steps over a batch that changes every
step, each one of the earlier files:

    1. schedule   Scheduler.schedule() (scheduler.py): which sequences run, how many tokens
                  each, their KV blocks reserved (cache.py)
    2. forward    one Transformer.forward (model.py) over all N scheduled tokens, as a flat
                  batch; compiled (graphs.py) or split over devices (parallel.py)
    3. sample     sampler.py picks each sequence's token (or judges its drafts,
                  speculative.py), with ONE wait for the device
    4. append     Sequence.append (sequence.py): stop strings, EOS, max_tokens; finished
                  sequences give their blocks back

On a GPU steps 1, 2, 3 only QUEUE work, and step 4 waits for it: done in that order, the
device idles while the host appends, detokenizes and schedules (~0.5 ms a step at batch 1,
a tenth of an 8B step). So the overlapped engine (overlap=True, with compile by default) runs
step N+1's 1-3 BEFORE step N's 4: the sequences that sampled at step N feed a token the host
has not seen yet. It holds a PENDING place in token_ids (lengths, positions and the noise
count it) and the forward reads its value on the device (InFlight). A sequence that stops at
step N's token has computed one more row, never read. Where the host must see the tokens
first (drafting, penalties, prompt logprobs) the steps run in order.

A request that goes wrong alone finishes alone (finish_reason "error"); an error no single
request explains fails the step's requests, never the engine (Isolation). Building one is
the other half: the weights (quantized, or sharded over workers), the KV pool sized by the
lecture's bytes-per-token formula from the memory the weights left, the compiled step, the
drafter. Every option is declared once, in EngineConfig, with its default and its range.

    llm = LLM("path/or/random:preset", max_num_seqs=64)   # or LLM(EngineConfig(...))
    llm.generate(["prompt", ...], SamplingParams(max_tokens=64))

"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import random
import sys
import time

import numpy as np
import torch

from cache import Work, apply_pending_copies, kv_cache_bytes, local_pool, num_blocks_for_budget
from graphs import MAX_ROWS, CompiledDecoder, StepInputs, new_block_manager, step_inputs
from model import default_model_path, load_model
from parallel import TensorParallelError, TensorParallelGroup
from quantize import int8_kv_cache_bytes, make_kv_cache, quantize_model
from sampler import (Sampled, SamplingParams, batch_then_each, draft_sampler, launch_isolated,
                     prompt_logprobs, sample_requests, to_device)
from scheduler import ScheduledSeq, Scheduler
from sequence import FINISHED, PENDING, RUNNING, Request, RequestOutput, Sequence
from speculative import MAX_SPECULATIVE_TOKENS, make_drafter
from support import checks
from support.calibration import calibration_ids
from support.checkpoint import tokenizer_path
from support.structured import make_grammar
from support.timing import choose_weight_layout, step_memory
from tokenizer import Tokenizer


# --- Every option of the engine, once ------------------------------------------
def option(default, help: str, **bounds):
    """A field of EngineConfig: its default, its range (ge / le / choices, checked by
    support/checks.py as SamplingParams' are) and one line of help for serve.py's flag."""
    return dataclasses.field(default=default, metadata={"help": help, **bounds})


@dataclasses.dataclass
class EngineConfig:
    """The engine's options: LLM(EngineConfig(...)) and LLM(**options) are the same, and
    serve.py makes a flag of each field (--block-size for block_size). Each is a lesson."""
    path: str | os.PathLike | None = option(None, "checkpoint directory or random:PRESET "
                                            "(default: the embedded SmolLM2-135M-Instruct)",
                                            flag="--model")
    device: str | torch.device = option("auto", "'auto' (CUDA if there is one), 'cpu', 'cuda:1'")
    dtype: str | torch.dtype = option("auto", "'auto' (bfloat16 on CUDA, float32 on a CPU), "
                                      "'float32', 'bfloat16' or 'float16'")
    block_size: int = option(16, "tokens per KV block (cache.py)", ge=1)
    kv_cache_bytes: int | None = option(None, "bytes of the KV pool (default: 90 percent of the "
                                        "GPU memory the weights left; 1 GiB on a CPU)", ge=1)
    max_num_seqs: int = option(64, "sequences in one batch at most (scheduler.py)", ge=1)
    max_num_batched_tokens: int = option(2048, "tokens in one step at most (prefill chunks)", ge=1)
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of cached prefixes (cache.py)")
    quantization: str | None = option(None, "'int8', 'fp8', 'int4', 'awq' (int4 with AWQ "
                                      "scales) weight-only, or 'fp8-dynamic', 'llm.int8' (8-bit "
                                      "activations too) linears (quantize.py; on a CPU, dtype "
                                      "'auto' is then bfloat16)",
                                      choices=(None, "int8", "fp8", "fp8-dynamic", "llm.int8",
                                               "int4", "awq"))
    kv_cache_dtype: str | None = option(None, "int8: the KV pool stores int8 and a scale per "
                                        "token and head (quantize.py)", choices=(None, "int8"))
    compile: bool = option(False, "every step of up to graphs.MAX_ROWS tokens through "
                           "torch.compile, padded to buckets (graphs.py; CUDA graphs on a GPU)")
    speculative: str | None = option(None, "'ngram' (prompt lookup) or a draft model directory "
                                     "(speculative.py)")
    num_speculative_tokens: int = option(4, "drafts per step (k)", ge=1, le=MAX_SPECULATIVE_TOKENS)
    tensor_parallel_size: int = option(1, "split every layer over N devices (parallel.py; "
                                       "llm.close() stops the workers)", ge=1)
    overlap: bool | None = option(None, "queue step N+1 before reading step N's tokens: the "
                                  "host's work hides behind the device's (None: with compile)")

    def __post_init__(self):
        checks.check_engine_config(self)   # ranges, and the options that cannot go together


# --- Fault isolation: a request that goes wrong fails alone -------------------------
class Isolation:
    """LLM's fault isolation (its base class): a request that goes wrong finishes alone, with
    finish_reason "error" and its blocks freed, and a step that fails as a whole fails only
    its requests. Reads LLM's scheduler, block_manager, requests, failed, batch, in_flight."""

    @contextlib.contextmanager
    def isolation(self):
        """Around a step: an error that no single request explains (those were failed alone,
        by _fail) fails this step's requests (and the step in flight's), blocks freed; the engine
        keeps serving. Before anything was scheduled: the running ones, else the oldest waiting
        one (a step that keeps failing still makes progress). A lost tensor-parallel worker is
        raised too."""
        try:
            yield
        except Exception as e:
            print(f"nanoinfer: engine step failed: {e!r}", file=sys.stderr)
            self.block_manager.pending_copies.clear()       # its requests fail: drop their copies
            sch, flight, self.in_flight = self.scheduler, self.in_flight, None
            victims = [it.seq for it in self.batch + (flight.batch if flight else [])]
            for seq in victims or list(sch.running) or list(sch.waiting)[:1]:
                self._fail(seq.request, f"engine step failed: {e!r}")
            if isinstance(e, TensorParallelError):
                raise

    def _fail(self, req: Request, message: str):
        """A request that went wrong finishes alone: finish_reason "error", blocks freed."""
        if req.request_id not in self.failed:
            self.failed[req.request_id] = self._finish_request(req, "error", message)

    def _finish_request(self, req: Request, reason: str, error: str | None = None) -> Request:
        self.requests.pop(req.request_id, None)
        for seq in req.seqs:
            if seq.status != FINISHED:
                self.scheduler.finish(seq)
                seq.finish_reason = reason
        req.error = error
        req.metrics.finish_time = time.perf_counter()
        return req

    def _nothing_scheduled(self):
        """With nothing running, the oldest waiting request can never fit: fail it, not spin."""
        if not self.scheduler.running and self.scheduler.waiting:
            seq, blocks = self.scheduler.waiting[0], self.block_manager.num_blocks
            self._fail(seq.request, f"request {seq.request.request_id} cannot be scheduled even in "
                       f"an empty engine ({len(seq.token_ids)} tokens, {blocks} blocks)")


# --- The engine ----------------------------------------------------------------
class LLM(Isolation):
    """Model + tokenizer + paged KV cache + scheduler + sampler. Offline: llm.generate(prompts,
    params); online (serve.py): add_request() / step() / abort() from one engine thread."""

    def __init__(self, config: EngineConfig | str | None = None, **options):
        c = dataclasses.replace(config if isinstance(config, EngineConfig)
                                else EngineConfig(path=config), **options)   # LLM(path, **options)
        device, dtype = checks.resolve_device_dtype(c.device, c.dtype, c.quantization)
        path = os.fspath(c.path) if c.path else default_model_path()
        self.engine_config = c = dataclasses.replace(c, path=path, device=device, dtype=dtype)
        self.path, self.device, self.dtype = path, device, dtype
        self.model, self.config, self.tp = load_engine_model(c)
        self.tokenizer = Tokenizer.from_pretrained(tokenizer_path(self.path))
        self._build_pool(c)
        self.overlap = c.compile if c.overlap is None else c.overlap
        self.in_flight: InFlight | None = None       # the step whose tokens are still on the device
        self.requests: dict[str, Request] = {}
        self.failed: dict[str, Request] = {}         # this step's requests that failed alone
        self.batch: list[ScheduledSeq] = []          # this step's work (for isolation)
        self._request_ids = itertools.count()
        self._rng = random.Random(0)                 # the seeds of unseeded requests
        self.stats = {"steps": 0, "batched_tokens": 0,     # forward passes, tokens they processed
                      "draft_tokens": 0, "accepted_tokens": 0, "verify_steps": 0,
                      "graph_steps": 0, "compiled_steps": 0, "eager_steps": 0}   # how each ran
        self.drafter = make_drafter(c, self.config, self.tokenizer, self.block_manager.num_blocks,
                                    lambda bm: StepInputs(bm, self.device))
        self.speculation = None if self.drafter is None else Speculation(
            self.drafter, c.num_speculative_tokens, self.stats, self.scheduler)

    def _build_pool(self, c: EngineConfig):
        """The KV pool, its block manager and scheduler, and the compiled step (compile=True)."""
        max_query_len = c.num_speculative_tokens + 1 if c.speculative else 1   # verify: k + 1
        # compile=True first settles what else stays in memory: the weights' layout, the step's
        # (CUDA: its graphs' pool too, measured before the pool is sized)
        self.weight_layout = choose_weight_layout(self.model) if c.compile else "default"
        reserve = (compiled_step_reserve(self.model, self.config, c, max_query_len)
                   if c.compile and c.kv_cache_bytes is None and c.device.type == "cuda" else 0)
        # the pool takes what the weights left: it bounds the batch AND the longest sequence;
        # compile=True: 1 scratch block more (graphs.py: padded rows write a block no one owns)
        # tensor parallel: every rank allocates its slice of the pool
        allocate = self.tp and (lambda n: self.tp.allocate_cache(n, c.block_size, c.kv_cache_dtype))
        self.cache, num_blocks = make_kv_pool(self.tp.config if self.tp else self.config, c,
                                              int(c.compile), allocate, reserve)
        self.block_manager = new_block_manager(self.cache, num_blocks, c.enable_prefix_caching,
                                               self.config.sliding_window)
        self.scheduler = Scheduler(self.block_manager, c.max_num_seqs, c.max_num_batched_tokens)
        self.inputs = step_inputs(self.block_manager, self.device)
        # the longest sequence that can run: the model's context, or the whole pool
        self.max_len = min(self.config.max_seq_len, num_blocks * c.block_size)
        self.decoder, self.compile_seconds = None, 0.0
        if c.compile:    # every bucket compiled now, rather than in the middle of serving
            self.decoder = d = compiled_decoder(self.model, self.cache, c, self.max_len, num_blocks,
                                                max_query_len)
            self.compile_seconds = seconds = d.warmup()
            print(f"nanoinfer: compiled steps of {d.query_sizes} tokens per sequence for batch "
                  f"buckets {d.batch_sizes}, mixed steps of up to {d.row_sizes[-1]} rows, "
                  f"table widths {d.widths}: {len(d.keys)} buckets in {seconds:.1f} s")

    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (a string or token ids); a bad request raises ValueError and touches
        nothing."""
        params, ids = params or SamplingParams(), prompt
        if isinstance(prompt, str):     # special tokens allowed: the caller owns the whole prompt
            checks.check_prompt_text(prompt, self.tokenizer, self.max_len)
            ids = self.tokenizer.encode(prompt, allow_special=True)
        # types, the vocabulary, room to generate, n <= max_num_seqs seats (support/checks.py)
        ids = checks.check_request(ids, params, SamplingParams, self.config, self.max_len,
                                   self.scheduler.max_num_seqs)
        request_id = checks.new_request_id(request_id, self.requests, self._request_ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
        grammar = make_grammar(params.structured_outputs, self.tokenizer)   # None: unconstrained
        req = Request(request_id, ids, params, time.perf_counter(), seed, grammar)
        req.seqs.append(Sequence(req, ids, 0, self.tokenizer))   # n > 1: forked after the prompt
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

    # -- one step: schedule, forward, sample, append --------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Returns the requests that made progress (a finished one for the last time);
        overlapped, the step before's (the module's docstring)."""
        self.failed, self.batch, touched = {}, [], {}
        with self.isolation():
            if self.in_flight and not (self.overlap and self.in_flight.can_overlap(self)):
                touched = self._resolve()            # this step needs the last one's tokens here
            # Drafts come first: a sequence verifying k drafts feeds k + 1 tokens this
            # step, and the scheduler must count them against the token budget.
            if self.speculation is not None:
                self.speculation.propose(self.scheduler.running, self.max_len, self._fail)
            self.batch = batch = self.scheduler.schedule()          # 1. who runs, how many tokens
            if not batch and not self.in_flight and not touched:
                self._nothing_scheduled()
            if batch:
                asks, rows, scored = sample_requests(batch, self.scheduler, self.tokenizer)
                logits = self._forward(batch, rows)                 # 2. one pass over every token
                launched = self._launch(logits, batch, asks, scored)   # 3. sampling, queued
            touched |= self._resolve()              # 4. the last step's tokens, while this runs
            if batch:
                self.in_flight = launched
                if not self.overlap or scored:      # prompt logprobs: read in the same step
                    touched |= self._resolve()      # (synchronous: 3's one wait, then 4)
        return [req.output() for req in (touched | self.failed).values()]

    def _forward(self, batch: list[ScheduledSeq], logits_rows: list[int]):
        """One forward pass over the flat batch of every scheduled token. A token fed from a
        PENDING place (sampled by the step in flight) is read where it is: on the device."""
        copies = list(self.block_manager.pending_copies)
        apply_pending_copies(self.cache, self.block_manager)     # copy-on-write before any write
        # None: logits for every row of the flat batch
        select = None if logits_rows == list(range(sum(it.count for it in batch))) else logits_rows
        hb = self.inputs.host([Work(it.seq.seq_id, it.tokens, it.start) for it in batch], select)
        pending = self.in_flight.pending_rows(hb, batch) if self.in_flight else None
        # compiled: every step that fits a bucket, mixed ones as rows (graphs.py); else eager
        layout = self.decoder and self.decoder.layout(hb.query_lens, hb.seq_lens, len(logits_rows))
        if layout:
            self.stats["graph_steps" if self.decoder.cuda else "compiled_steps"] += 1
            return self.decoder(hb.input_ids, hb.positions, hb.slot_mapping,
                                self.inputs.tables[hb.rows], hb.query_lens, select, layout,
                                pending)
        self.stats["eager_steps"] += 1
        input_ids, positions, ctx = self.inputs.device(hb, self.cache)
        if pending is not None:                  # rows, the in-flight row each reads, the tokens
            rows, src, next_ids = pending
            input_ids[to_device(rows, self.device)] = next_ids[to_device(src, self.device)]
        if self.tp is not None:        # every rank runs its slice; rank 0 gets the gathered logits
            return self.tp.forward(input_ids, positions, ctx, copies=copies)
        return self.model(input_ids, positions, ctx)             # [len(logits_rows), V]

    def _launch(self, logits, batch, asks, scored) -> InFlight:
        """Step 3, queued (sampler.launch_isolated): every sequence's new tokens, and the logprobs
        of the prompt positions scored this step, for ONE wait in _resolve."""
        ids = [t for req, first, count in scored for t in req.prompt_ids[first:first + count]]
        top = max((req.params.prompt_logprobs for req, _, _ in scored), default=0)
        lp = list(prompt_logprobs(logits, ids, top)) if scored else []
        sampled = launch_isolated(logits, asks, self._fail, lp)   # lp: host lists after the wait
        self.stats["steps"] += 1
        self.stats["batched_tokens"] += sum(item.count for item in batch)
        return InFlight(batch, asks, sampled, scored, lp, self.max_len)

    def _resolve(self) -> dict:
        """Step 4 for the step in flight: its tokens to the host (its one wait), each appended
        (stop strings, EOS, max_tokens); an error in one fails it alone. The requests touched."""
        f = self.in_flight
        if f is None:
            return {}
        new = f.results()                          # the one wait; prompt logprobs stored too
        live = set(self.requests)            # not one aborted since it launched: it was reported
        # the batch's prompt blocks, kept if it ends; a scored prompt ends
        for seq in (item.seq for item in f.batch):
            if seq.status == RUNNING and not seq.draft_tokens:
                self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_settled)
                if not seq.params.max_tokens and seq.remaining == 0:
                    self._finish_request(seq.request, "length")
        for (seq, ask), (tokens, logprobs, finite) in zip(f.asks, new):
            try:
                if seq.status == FINISHED:
                    continue                       # failed, aborted or stopped since it launched
                if not finite:
                    raise FloatingPointError("the model gave non-finite logits for this request")
                if ask.drafts:
                    self.speculation.verified(seq, len(tokens) - 1, self.block_manager)
                place = None if ask.drafts else seq.num_prompt + ask.position   # its PENDING place
                for j, token in enumerate(tokens):
                    if seq.status == FINISHED:
                        break                      # stopped by an earlier token of this step
                    self._append(seq, token, None if logprobs is None else logprobs[j], place)
            except Exception as e:
                self._fail(seq.request, f"{type(e).__name__}: {e}")
        self.in_flight, touched = None, {}
        seqs = [item.seq for item in f.batch] + [seq for seq, _ in f.asks]
        for seq in dict.fromkeys(s for s in seqs if s.request.request_id in live):     # once each
            if seq.status == RUNNING:              # full blocks become reusable prefixes
                self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_settled)
            elif seq.request.finished:
                self.requests.pop(seq.request.request_id, None)
            touched[seq.request.request_id] = seq.request
        return touched

    def _append(self, seq: Sequence, token: int, logprob=None, place=None):
        """Add a sampled token (at its PENDING place, if it holds one); finish the sequence if it
        hit a stop condition. Checked token by token, so a speculative step stops exactly where
        plain decoding would."""
        metrics = seq.request.metrics
        metrics.output_tokens += 1
        metrics.first_token_time = metrics.first_token_time or time.perf_counter()
        eos = self.tokenizer.eos_token_id
        reason = (seq.append(token, logprob, eos, self.max_len) if place is None
                  else seq.settle(place, token, logprob, eos, self.max_len))
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            if seq.request.finished:
                metrics.finish_time = time.perf_counter()


class InFlight:
    """A launched step: its sampling queued, its tokens not yet on the host. From its launch its
    tokens count as computed, each sampled one holds a PENDING place; after a sequence's last
    (max_tokens, the context) nothing is fed: no step computes a token past it."""

    def __init__(self, batch, asks, sampled, scored, lp, max_len: int):
        self.batch, self.asks, self.sampled = batch, asks, sampled   # sampled: Sampled or results
        self.scored, self.lp = scored, lp            # prompt positions scored, their logprobs
        self.place_of: dict[int, int] = {}           # seq_id -> its row of sampled.next_ids
        for item in batch:
            item.seq.num_computed = item.start + item.count
        for s, (seq, ask) in enumerate(asks):
            if not ask.drafts and seq.status == RUNNING:        # drafts: appended when judged
                seq.token_ids.append(PENDING)
                seq.in_flight += 1
                self.place_of[seq.seq_id] = s
                if seq.num_output >= seq.params.max_tokens or len(seq.token_ids) >= max_len:
                    seq.num_computed = len(seq.token_ids)

    def can_overlap(self, llm) -> bool:
        """May the next step be scheduled before this one is read? Not where the host needs its
        tokens first: drafting (proposals extend them), penalties (they count them), or a
        sampling that already ran synchronously."""
        return (llm.speculation is None and isinstance(self.sampled, Sampled)
                and not any(a.params.penalized for _, a in self.asks))

    def results(self) -> list:
        """The sampled tokens on the host (the one wait); the scored prompt positions' logprobs
        stored in their requests."""
        new = self.sampled.result() if isinstance(self.sampled, Sampled) else self.sampled
        per_row = zip(*self.lp)                        # (logprob, top values, their ids) per row
        for req, first, count in self.scored:
            k = req.params.prompt_logprobs
            req.prompt_logprobs[first:first + count] = [
                (c, dict(zip(i[:k], v[:k]))) for c, v, i in itertools.islice(per_row, count)]
            req.num_scored = first + count
        return new

    def pending_rows(self, hb, batch):
        """The flat batch's rows fed a PENDING token, and the row of next_ids each reads (None:
        none)."""
        rows = np.flatnonzero(hb.input_ids == PENDING)
        if not len(rows):
            return None
        seq_of_row = np.repeat(np.arange(len(batch)), hb.query_lens)[rows]
        src = np.array([self.place_of[batch[i].seq.seq_id] for i in seq_of_row])
        return rows, src, self.sampled.next_ids


# --- Speculative decoding's bookkeeping ------------------------------------------
class Speculation:
    """Drafts before a step, bookkeeping after it (the step's one pass verifies them)."""

    def __init__(self, drafter, k: int, stats: dict, scheduler: Scheduler):
        # drafts per step at most, the engine's counters
        self.drafter, self.k, self.stats = drafter, k, stats
        # a sequence's blocks freed: its draft cache too
        scheduler.release_hooks.append(lambda seq: drafter.release(seq.seq_id))

    def propose(self, running, max_len: int, fail):
        """Up to k drafts for every decoding sequence, never past max_tokens or the context (the
        last token is the target's). A drafter error fails only the requests whose drafts raise."""
        asks = []
        for seq in running:
            seq.draft_tokens, seq.draft_probs = [], None
            k = min(self.k, seq.params.max_tokens - seq.num_output - 1,
                    max_len - len(seq.token_ids) - 1)
            if seq.remaining == 1 and k > 0 and seq.grammar is None:   # a grammar: no drafts
                asks.append((seq, (seq.seq_id, seq.token_ids, k)))
        def propose(part):     # draft_sampler: each request's own params and noise
            return self.drafter.propose([a for _, a in part], draft_sampler(part))
        drafts = batch_then_each(propose, asks, fail, "drafting", ([], None))
        for (seq, _), (tokens, probs) in zip(asks, drafts):
            if seq.status == RUNNING:
                seq.draft_tokens, seq.draft_probs = list(tokens), probs

    def verified(self, seq, n_accepted: int, block_manager):
        """After the target's pass: keep the cache of the accepted drafts only."""
        # K/V hold the fed token and the accepted drafts; the last (correction or bonus) is fed
        # next step
        m, seq.num_computed = len(seq.draft_tokens), len(seq.token_ids) + n_accepted
        block_manager.truncate(seq.seq_id, seq.num_computed)
        self.drafter.rollback(seq.seq_id, seq.num_computed)
        metrics = seq.request.metrics
        for name, n in (("draft_tokens", m), ("accepted_tokens", n_accepted), ("verify_steps", 1)):
            setattr(metrics, name, getattr(metrics, name) + n)   # this request ...
            self.stats[name] += n                                # ... and the engine
        seq.draft_tokens, seq.draft_probs = [], None


# --- Building an engine: the model, the KV pool, the compiled step ---------------
def load_engine_model(c: EngineConfig):
    """(model, config, tp). tp is None on one device; with N > 1 this process is rank 0 of a
    parallel.py group whose workers hold the other slices, and model is rank 0's slice."""
    if c.tensor_parallel_size != 1:   # the group shards (and quantizes) on every rank
        tp = TensorParallelGroup(c.path, c.tensor_parallel_size, c.device, c.dtype, c.quantization)
        model, config = tp.model, tp.full_config
    else:
        tp, (model, config) = None, load_model(c.path, device=c.device, dtype=c.dtype)
        if c.quantization is not None:     # fewer bytes a weight: fewer bytes read per step
            quantize_model(model, c.quantization, None if c.quantization != "awq" else
                           calibration_ids(Tokenizer.from_pretrained(tokenizer_path(c.path))))
    checks.say_random_weights(c.path, config.random_seed)
    return model, config, tp


def make_kv_pool(cfg, c: EngineConfig, scratch: int = 0, allocate=None, reserve: int = 0):
    """(cache, usable blocks): as many blocks as c.kv_cache_bytes allows. Serving's central
    memory trade-off: every byte of KV cache is more concurrent context. With tensor
    parallelism cfg is one rank's shard and allocate(n) makes every rank's pool: the same
    budget per device holds N times the tokens. `scratch` blocks: a compiled step's padding;
    `reserve`: the bytes it keeps beside the pool."""
    device, dtype, int8 = torch.device(c.device), c.dtype, c.kv_cache_dtype == "int8"
    # bytes per token = 2 (K and V) * layers * kv_heads * head_dim * bytes per value (+ scales)
    per_token = int8_kv_cache_bytes(cfg) if int8 else kv_cache_bytes(cfg, dtype)
    # default: on CUDA 90% of what the weights left, less `reserve`; on a CPU 1 GiB
    budget = c.kv_cache_bytes or (int(0.9 * torch.cuda.mem_get_info(device)[0]) - reserve
                                  if device.type == "cuda" else 1 << 30)
    local, local_bytes = local_pool(cfg, c, dtype)   # local + global layers: a window per seat
    budget -= local_bytes
    num_blocks = num_blocks_for_budget(per_token, c.block_size, budget)
    checks.check_pool_size(num_blocks, 1 + scratch, budget, c.block_size, per_token)
    cache = allocate(num_blocks) if allocate is not None else make_kv_cache(   # dtype, or int8
        cfg, num_blocks, c.block_size, c.kv_cache_dtype, device, dtype, local)
    usable = num_blocks - scratch
    checks.say_pool(cfg, usable, c.block_size, per_token, int8, dtype, cache.total_bytes)
    return cache, usable


def compiled_step_reserve(model, cfg, c: EngineConfig, max_query_len: int) -> int:
    """CUDA (the caller's condition): the bytes compiled steps keep beside the KV pool, their
    graphs' pool included: the largest bucket, run on a one-block pool before the real pool is
    sized (support/timing.py step_memory)."""
    def largest_step():     # tables as wide as the model's context
        pool = make_kv_cache(cfg, 1, c.block_size, c.kv_cache_dtype, c.device, c.dtype)
        return compiled_decoder(model, pool, c, cfg.max_seq_len, 0, max_query_len).scratch_step()
    return step_memory(largest_step, c.device, graphs=True)


def compiled_decoder(model, cache, c: EngineConfig, max_len: int, scratch_block: int,
                     max_query_len: int) -> CompiledDecoder:
    """compile=True's step (graphs.py): steps of <= max_query_len tokens per sequence, and mixed
    steps of up to graphs.MAX_ROWS tokens (never past the token budget) as rows, through
    torch.compile, tables wide enough for max_len tokens. Not warmed up yet."""
    return CompiledDecoder(model, cache, c.max_num_seqs, -(-max_len // c.block_size), scratch_block,
                           (1, max_query_len), min(MAX_ROWS, c.max_num_batched_tokens))
