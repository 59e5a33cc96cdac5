"""
scheduler.py -- continuous batching: the engine loop.

The lesson: decode is memory-bound. Each step reads every weight once, so
one sequence at a time wastes the GPU: a decode matmul of B sequences does
2*B FLOPs per weight read (arithmetic intensity ~ B). Batching is the
single most important serving optimization. But requests arrive at
different times and want different lengths; "static" batching (run a group
to completion, then the next) leaves seats empty while the longest one
finishes. Continuous batching schedules at the granularity of ONE step:

    every step:  finished sequences leave, waiting ones join at once,
                 and the tokens of all running sequences form one flat batch.

Selective batching makes that possible: the MLPs and norms work on a flat
[N, D] tensor whatever sequence each token belongs to; only attention is
per sequence, over its own paged KV cache (cache.py).

One step of LLM.step():
    Scheduler.schedule()     which sequences run and how many tokens each:
                             1 per decoding sequence first (k+1 with drafts),
                             then prefill chunks, within max_num_batched_tokens;
                             preempts the newest sequence if the KV pool is full
    Transformer.forward      one pass over all N scheduled tokens
    sample()                 next token for each sequence whose prompt is done
    _append()                stop strings / EOS / max_tokens; free finished blocks

The public surface (DESIGN.md): SamplingParams, Sequence, Scheduler, LLM.
"""
from __future__ import annotations

import itertools
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from cache import AttentionContext, BlockManager, KVCache, apply_pending_copies, kv_cache_bytes, num_blocks_for_budget
from kernels import CompiledDecoder, choose_weight_layout, decode_step
from speculative import MAX_SPECULATIVE_TOKENS, ModelDrafter, NgramDrafter, rejection_sample_batched
from model import default_model_path, load_model
from quantize import Int8KVCache, int8_kv_cache_bytes, quantize_model
from tokenizer import IncrementalDecoder, Tokenizer

# ----------------------------------------------------------------------------
# Sampling parameters
# ----------------------------------------------------------------------------


@dataclass
class SamplingParams:
    """How to pick tokens for one request, and when to stop.

    Every field's range is stated once, here (LIMITS); the server validates
    requests with this same class, so the library and the API agree.
    """
    max_tokens: int = 64            # new tokens at most (per sample)
    temperature: float = 0.0        # 0 = greedy (argmax); otherwise softmax(logits / T)
    top_k: int = 0                  # keep the k most likely tokens (0 = all; k >= vocab = all)
    top_p: float = 1.0              # keep the smallest set with probability >= top_p
    seed: int | None = None         # same tokens whatever the batch (counter-based noise, see sampler)
    stop: list = field(default_factory=list)            # stop strings (cut from the text)
    stop_token_ids: list = field(default_factory=list)  # extra token ids that end generation
    ignore_eos: bool = False        # keep going past EOS (benchmarks)
    n: int = 1                      # parallel samples sharing the prompt (copy-on-write)
    logprobs: int | None = None     # None, or the chosen token's logprob + this many alternatives

    # The bounds, in one place. Integers that reach a tensor or a hash must fit
    # 64 bits; counts that cost memory or time per step are capped.
    LIMITS = {"max_tokens": 2**31 - 1, "n": 128, "logprobs": 20, "stop": 16, "stop_chars": 1024,
              "stop_token_ids": 1024, "seed": (-2**63, 2**64 - 1)}
    GREEDY_BELOW = 1e-5             # temperatures this small are greedy (logits / 1e-30 would overflow)

    def __post_init__(self):
        L = self.LIMITS

        def check(ok, name, what):
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {what}, got {_short(getattr(self, name))}")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool)
        check(is_int(self.max_tokens) and 1 <= self.max_tokens <= L["max_tokens"], "max_tokens",
              f"an integer in [1, {L['max_tokens']}]")
        check(is_num(self.temperature) and 0 <= self.temperature < math.inf, "temperature", "a finite number >= 0")
        check(is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)")   # clamped to the vocabulary
        check(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        lo, hi = L["seed"]
        check(self.seed is None or (is_int(self.seed) and lo <= self.seed <= hi), "seed",
              "None or an integer in [-2**63, 2**64 - 1]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check(isinstance(self.stop, (list, tuple)) and len(self.stop) <= L["stop"] and all(
              isinstance(s, str) and 0 < len(s) <= L["stop_chars"] for s in self.stop), "stop",
              f"a list of at most {L['stop']} non-empty strings of at most {L['stop_chars']} characters")
        self.stop = list(self.stop)
        check(isinstance(self.stop_token_ids, (list, tuple)) and len(self.stop_token_ids) <= L["stop_token_ids"]
              and all(is_int(t) and 0 <= t < 2**63 for t in self.stop_token_ids), "stop_token_ids",
              f"a list of at most {L['stop_token_ids']} token ids")
        self.stop_token_ids = list(self.stop_token_ids)
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool")
        check(is_int(self.n) and 1 <= self.n <= L["n"], "n", f"an integer in [1, {L['n']}]")
        check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= L["logprobs"]),
              "logprobs", f"None or an integer in [0, {L['logprobs']}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_BELOW


def _short(value, limit: int = 80) -> str:
    """repr of a value for an error message, cut short (a stop list can be megabytes)."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + f"... ({len(r)} characters)"


# ----------------------------------------------------------------------------
# The sampler
# ----------------------------------------------------------------------------

def probs_from_logits(logits, temperature, top_k, top_p):
    """Per-row temperature, top-k and top-p applied to logits [R, V] -> probabilities [R, V].

    Rows with temperature 0 get a one-hot on the argmax (greedy), so greedy
    and sampled rows share one code path (speculative verification uses the
    same distributions for target and draft).
    """
    R, V = logits.shape
    greedy = temperature == 0
    logits = logits / torch.where(greedy, 1.0, temperature)[:, None]
    # One descending sort serves both filters.
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    drop = rank >= k                                                     # top-k
    sorted_probs = sorted_logits.softmax(dim=-1)
    drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]  # top-p: mass before me >= p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))      # the top token is never dropped
    probs = torch.empty_like(logits).scatter_(1, order, sorted_logits.softmax(dim=-1))
    onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, probs)


def sample(probs, generators):
    """One token per row of probs [R, V], each row drawn with its own generator.

    Exponential race: with E_i ~ Exp(1) i.i.d., argmax_i p_i / E_i is an
    exact sample from p (the Gumbel-max trick in another guise). The noise
    of row r comes only from generators[r], so a seeded request gets the same
    tokens no matter which other rows share the batch. A one-hot row (greedy)
    returns its argmax whatever the noise.
    """
    noise = torch.stack([torch.empty(probs.shape[1], device=probs.device).exponential_(generator=g)
                         for g in generators])
    return (probs / noise).argmax(dim=-1)


# ----------------------------------------------------------------------------
# Sequences and requests
# ----------------------------------------------------------------------------

@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens served from the prefix cache
    preemptions: int = 0
    draft_tokens: int = 0           # speculative decoding: proposed ...
    accepted_tokens: int = 0        # ... and accepted by the target
    verify_steps: int = 0           # target passes that verified drafts

    @property
    def time_to_first_token(self):
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def acceptance_rate(self):
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


@dataclass
class Completion:
    """One sample of a request (n > 1 gives several)."""
    index: int
    text: str
    token_ids: list
    finish_reason: str | None       # "stop" | "length" | "abort" | None while running
    logprobs: list | None = None    # per token: (logprob, {alternative id: logprob})


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: list                   # [Completion] * n
    finished: bool
    metrics: RequestMetrics

    # The common case (n == 1) reads like one completion: outs[i].text
    @property
    def text(self):
        return self.outputs[0].text

    @property
    def token_ids(self):
        return self.outputs[0].token_ids

    @property
    def finish_reason(self):
        return self.outputs[0].finish_reason


WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class Request:
    """What a user asked for: a prompt, its params, and its n sequences."""

    def __init__(self, request_id, prompt_ids, params, arrival_time):
        self.request_id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.seqs: list[Sequence] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time, prompt_tokens=len(prompt_ids))

    @property
    def finished(self):
        return len(self.seqs) == self.params.n and all(s.status == FINISHED for s in self.seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt_ids,
                             [Completion(s.index, s.text, s.output_ids, s.finish_reason, s.logprobs)
                              for s in self.seqs], self.finished, self.metrics)


class Sequence:
    """One stream of tokens with its place in the KV cache.

    token_ids = prompt + generated so far. num_computed = how many of them
    have K/V in the cache. Each step feeds token_ids[num_computed:] (a
    prefill chunk, or the 1 token sampled last step) and, once the cache
    holds them all, samples the next token.
    """
    _ids = itertools.count()

    def __init__(self, request: Request, token_ids: list, index: int, generator, tokenizer):
        self.seq_id = next(Sequence._ids)
        self.request, self.params, self.index = request, request.params, index
        self.token_ids = list(token_ids)
        self.num_prompt = len(request.prompt_ids)
        self.num_computed = 0
        self.status = WAITING
        self.generator = generator
        self.draft_tokens: list[int] = []        # proposed this step (speculative decoding)
        self.draft_probs = None                  # their draft distributions [k, V] (None: one-hot)
        self.decoder = IncrementalDecoder(tokenizer)
        self.text = ""
        self.finish_reason = None
        self.logprobs = [] if request.params.logprobs is not None else None

    @property
    def output_ids(self):
        return self.token_ids[self.num_prompt:]

    @property
    def remaining(self) -> int:
        """Known tokens whose K/V are not yet in the cache."""
        return len(self.token_ids) - self.num_computed

    def __repr__(self):
        return f"Sequence({self.seq_id}, {self.status}, {self.num_computed}/{len(self.token_ids)})"


# ----------------------------------------------------------------------------
# The scheduler
# ----------------------------------------------------------------------------

@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int              # first position fed this step (= num_computed before the step)
    count: int              # tokens fed: a prefill chunk, 1, or 1 + len(drafts)
    slots: list             # their slots in the KV cache


class Scheduler:
    """FCFS waiting queue + running list, one token budget per step.

    Order of a step: (1) one token (1 + drafts) for every running sequence
    that is decoding, preempting the newest running sequence whenever the
    KV pool cannot give one its next slot; (2) the next chunk of running
    sequences still prefilling; (3) waiting sequences, oldest first, while
    seats (max_num_seqs), budget and free blocks last.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.release_hooks = []                  # called with a sequence whose blocks were freed

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _seats(self, seq):
        """Seats a sequence takes: a request with n > 1 forks when its prompt is done."""
        return seq.params.n if len(seq.request.seqs) == 1 and seq.params.n > 1 else 1

    def preempt(self, seq: Sequence):
        """Preemption by recompute: drop the cache, keep the tokens, requeue first."""
        self.running.remove(seq)
        self.bm.free(seq.seq_id)
        for hook in self.release_hooks:
            hook(seq)
        seq.num_computed, seq.status, seq.draft_tokens = 0, WAITING, []
        seq.request.metrics.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[ScheduledSeq]:
        # The token budget bounds the work of one forward pass: decode tokens are
        # cheap (memory-bound), prefill tokens are compute; chunking long prompts
        # keeps every step short so running sequences never stall behind a prompt.
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        scheduled = set()

        # (1) decoding sequences, oldest first: 1 token (+ drafts) each.
        for seq in [s for s in self.running if s.remaining == 1]:
            if seq not in self.running:        # preempted below as a victim
                continue
            count = 1 + len(seq.draft_tokens)
            if count > budget:
                seq.draft_tokens = []
                count = 1
                if budget == 0:
                    break
            while not self.bm.can_append(seq.seq_id, seq.num_computed, count):
                victim = self.running[-1]      # the newest sequence gives its blocks back
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status != RUNNING:
                continue
            out.append(ScheduledSeq(seq, seq.num_computed, count,
                                    self.bm.append_slots(seq.seq_id, seq.num_computed, count)))
            scheduled.add(seq)
            budget -= count

        # (2) running sequences in the middle of a chunked prefill.
        for seq in [s for s in self.running if s not in scheduled]:
            count = min(seq.remaining, budget)
            if count == 0 or not self.bm.can_append(seq.seq_id, seq.num_computed, count):
                continue
            out.append(ScheduledSeq(seq, seq.num_computed, count,
                                    self.bm.append_slots(seq.seq_id, seq.num_computed, count)))
            budget -= count

        # (3) admit waiting sequences in arrival order (no skipping ahead).
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + self._seats(seq) > self.max_num_seqs:
                break
            cached = self.bm.allocate(seq.seq_id, seq.token_ids)     # prefix cache hits
            count = min(len(seq.token_ids) - cached, budget)
            if not self.bm.can_append(seq.seq_id, cached, count):
                self.bm.free(seq.seq_id)                             # no room yet: try next step
                break
            self.waiting.popleft()
            seq.status, seq.num_computed = RUNNING, cached
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = time.perf_counter()
                seq.request.metrics.cached_tokens = cached
            self.running.append(seq)
            out.append(ScheduledSeq(seq, cached, count, self.bm.append_slots(seq.seq_id, cached, count)))
            budget -= count
        return out

    def finish(self, seq: Sequence):
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self.bm.tables:
            self.bm.free(seq.seq_id)
        for hook in self.release_hooks:
            hook(seq)
        seq.status = FINISHED


# ----------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------

class LLM:
    """Model + tokenizer + paged KV cache + scheduler + sampler.

    Offline use: llm.generate(prompts, params). Online use (serve.py):
    add_request() / step() / abort() from one engine thread.

    The options, each the lesson of its own file:
      quantization="int8"    int8 weight-only linears (quantize.py); on CPU,
                             dtype "auto" then means bf16 activations
      kv_cache_dtype="int8"  the KV pool stores int8 + a scale per token and head
      compile=True           pure decode steps through torch.compile with batch
                             buckets (kernels.py; CUDA graphs on a GPU)
      speculative="ngram" | draft model directory, num_speculative_tokens=k
    """

    def __init__(self, path=None, device="auto", dtype="auto", block_size=16, kv_cache_bytes=None,
                 max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=True,
                 quantization=None, kv_cache_dtype=None, compile=False, speculative=None,
                 num_speculative_tokens=4):
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if dtype == "auto":      # bf16 halves the bytes per step on GPU. On CPU float32, where
            # every path is bit-exact against the dense reference (bench.py measures bf16 too:
            # faster on the machine in the README); int8 takes bf16 activations (quantize.py)
            cpu_fp32 = self.device.type == "cpu" and quantization is None
            dtype = torch.float32 if cpu_fp32 else torch.bfloat16
        elif isinstance(dtype, str):
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if kv_cache_dtype not in (None, "int8"):
            raise ValueError(f"kv_cache_dtype must be None (the model's dtype) or 'int8', got {kv_cache_dtype!r}")
        self.path = path or default_model_path()
        self.model, self.config = load_model(self.path, device=self.device, dtype=dtype)
        if quantization is not None:       # int8 weights: a quarter of fp32's bytes per step
            quantize_model(self.model, quantization)
        self.tokenizer = Tokenizer.from_pretrained(self.path)
        self.dtype = dtype

        # Sizing the pool is the central memory trade-off of serving: every byte
        # given to the KV cache is a byte more of concurrent context.
        # The KV pool: as many blocks as the budget allows (the lecture's formula).
        int8_kv = kv_cache_dtype == "int8"
        per_token = int8_kv_cache_bytes(self.config) if int8_kv else globals()["kv_cache_bytes"](self.config, dtype)
        if kv_cache_bytes is None:
            if self.device.type == "cuda":   # most of what the weights left free
                kv_cache_bytes = int(0.8 * torch.cuda.mem_get_info(self.device)[0])
            else:
                kv_cache_bytes = 1 << 30     # 1 GiB on CPU; set kv_cache_bytes to change it
        num_blocks = num_blocks_for_budget(per_token, block_size, kv_cache_bytes)
        scratch = 1 if compile else 0      # kernels.py: padded rows write into a block no sequence owns
        if num_blocks < 1 + scratch:
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes} is too small for {1 + scratch} block(s) of "
                             f"{block_size} tokens ({per_token * block_size} bytes each)")
        self.cache = (Int8KVCache if int8_kv else KVCache)(self.config, num_blocks, block_size, self.device, dtype)
        num_blocks -= scratch              # the last block of the pool is the scratch block
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        # The longest sequence that can ever run: the context, or the whole pool.
        self.max_len = min(self.config.max_seq_len, num_blocks * block_size)
        c = self.config
        value = f"(1 B + 4/{c.head_dim} B of scale)" if int8_kv else f"{torch.finfo(dtype).bits // 8} B"
        print(f"nanoinfer: KV cache {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} "
              f"tokens; {per_token} B/token = 2*{c.n_layers} layers*{c.n_kv_heads} kv heads*{c.head_dim} dims"
              f"*{value}; {self.cache.total_bytes / 2**20:.1f} MiB allocated")

        # compile=True: pure decode steps run through torch.compile (kernels.py),
        # every batch-size bucket compiled now rather than in the middle of serving.
        self.decoder, self.compile_seconds, self.weight_layout = None, 0.0, "default"
        if compile:
            layout = self.weight_layout = choose_weight_layout(self.model)
            self.decoder = CompiledDecoder(self.model, self.cache, max_num_seqs,
                                           math.ceil(self.max_len / block_size), scratch_block=num_blocks)
            self.compile_seconds = self.decoder.warmup()
            print(f"nanoinfer: compiled decode for batch buckets {self.decoder.batch_sizes} and table widths "
                  f"{self.decoder.widths} in {self.compile_seconds:.1f} s (weight layout: {layout})")

        self.requests: dict[str, Request] = {}
        self._request_ids = itertools.count()
        self._rng = torch.Generator().manual_seed(0)   # seeds the unseeded requests
        self.stats = {"steps": 0, "batched_tokens": 0,     # forward passes, and tokens they processed
                      "draft_tokens": 0, "accepted_tokens": 0, "verify_steps": 0}
        self.drafter = self._make_drafter(speculative, num_speculative_tokens, max_num_batched_tokens)
        self.num_speculative_tokens = num_speculative_tokens
        if self.drafter is not None:    # a finished or preempted sequence leaves the draft cache too
            self.scheduler.release_hooks.append(lambda seq: self.drafter.release(seq.seq_id))

    def _make_drafter(self, speculative, k, max_num_batched_tokens):
        if speculative is None:
            return None
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if max_num_batched_tokens < k + 1:
            raise ValueError(f"speculation needs max_num_batched_tokens >= num_speculative_tokens + 1 = {k + 1}")
        if speculative == "ngram":
            return NgramDrafter()
        if not isinstance(speculative, str) or not os.path.isdir(speculative):
            raise ValueError(f"speculative must be None, 'ngram' or a draft model directory, got {speculative!r}")
        draft, cfg = load_model(speculative, device=self.device, dtype=self.dtype)
        vocab = Tokenizer.from_pretrained(speculative).ranks
        if cfg.vocab_size != self.config.vocab_size or vocab != self.tokenizer.ranks:
            raise ValueError(f"the draft model at {speculative} has a different vocabulary "
                             f"({cfg.vocab_size} tokens) than the target ({self.config.vocab_size})")
        return ModelDrafter(draft, self.block_manager.num_blocks, self.block_manager.block_size,
                            self.device, self.dtype)

    # -- requests --------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt (a string or token ids). Raises ValueError for a bad
        request without touching the engine's other requests."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, allow_special=True)   # the caller owns the whole prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < self.config.vocab_size for t in ids):
                raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        else:
            raise TypeError("a prompt is a string or a list of token ids")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_len:
            where = "context" if self.max_len == self.config.max_seq_len else "KV cache pool"
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's {where} holds "
                             f"{self.max_len}, which leaves no room to generate")
        request_id = str(next(self._request_ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, ids, params, time.perf_counter())
        req.seqs.append(Sequence(req, ids, 0, self._generator(params, 0), self.tokenizer))
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        return request_id

    def _generator(self, params, index):
        """Every sequence draws from its own generator: seed + sample index, or a fresh seed."""
        seed = params.seed + index if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
        return torch.Generator(device=self.device).manual_seed(seed)

    def abort(self, request_id: str):
        """Stop a request now and give its blocks back."""
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return
        for seq in req.seqs:
            if seq.status != FINISHED:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        req.metrics.finish_time = time.perf_counter()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step --------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass over all scheduled tokens, sample, append.

        Returns the current state of every request that made progress; a
        finished request is returned one last time (finished=True), then forgotten.
        """
        if self.drafter is not None:
            self._propose_drafts()
        # 1. schedule: who runs, how many tokens each (may preempt).
        batch = self.scheduler.schedule()
        if not batch:
            return []
        # 2. Which rows of the flat batch need logits: the last position of every
        # sequence whose cache will hold all its known tokens after this step
        # (it samples a next token), or all 1 + k positions of a verification.
        rows, offset = [], 0                       # (sequence, its rows)
        for item in batch:
            offset += item.count
            seq = item.seq
            if seq.draft_tokens:
                rows.append((seq, list(range(offset - item.count, offset))))
            elif item.start + item.count == len(seq.token_ids):
                rows.append((seq, [offset - 1]))
                rows += [(child, [offset - 1]) for child in self._fork(seq, item.start + item.count)]
        # 3. one forward pass over the flat batch of every scheduled token.
        flat_rows = [r for _, rs in rows for r in rs]
        logits = self._forward(batch, flat_rows)                      # [len(flat_rows), V]
        for item in batch:
            item.seq.num_computed = item.start + item.count
        probs = self._probs(logits, [seq for seq, rs in rows for _ in rs])

        # Decide each sequence's new tokens: a plain sample, or the verified drafts.
        new_tokens, i = {}, 0
        plain = [(seq, i0) for seq, i0 in self._row_starts(rows) if not seq.draft_tokens]
        if plain:
            toks = sample(probs[[i0 for _, i0 in plain]], [seq.generator for seq, _ in plain]).tolist()
            new_tokens.update({seq: [t] for (seq, _), t in zip(plain, toks)})
        verify = [(seq, i0) for seq, i0 in self._row_starts(rows) if seq.draft_tokens]
        if verify:
            new_tokens.update(self._verify(verify, probs))

        for seq, i0 in self._row_starts(rows):
            for j, token in enumerate(new_tokens[seq]):
                if seq.status != RUNNING:
                    break                          # stopped by an earlier token of this step
                self._append(seq, token, self._logprob(logits, i0 + j, token, seq.params.logprobs))

        # 4. bookkeeping: register newly full blocks in the prefix cache, and
        #    report every request that moved (finished ones for the last time).
        touched = {}
        for seq in [item.seq for item in batch] + [s for s, _ in rows]:
            if seq.status == RUNNING:              # full blocks become reusable prefixes
                self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed)
            touched[seq.request.request_id] = seq.request
        self.stats["steps"] += 1
        self.stats["batched_tokens"] += sum(item.count for item in batch)
        outputs = []
        for req in touched.values():
            outputs.append(req.output())
            if req.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    # Forking happens before the forward pass, after the parent's slots were
    # allocated: the children share exactly the blocks this step fills.
    def _fork(self, seq: Sequence, num_computed: int) -> list[Sequence]:
        """n > 1: when the prompt is done, add n - 1 sequences sharing its blocks."""
        req, children = seq.request, []
        while len(req.seqs) < req.params.n:
            child = Sequence(req, seq.token_ids, len(req.seqs), self._generator(req.params, len(req.seqs)),
                             self.tokenizer)
            child.status, child.num_computed = RUNNING, num_computed
            self.block_manager.fork(seq.seq_id, child.seq_id)     # ref counts up, nothing copied
            req.seqs.append(child)
            self.scheduler.running.append(child)
            children.append(child)
        return children

    def _forward(self, batch: list[ScheduledSeq], logits_rows: list[int]):
        """Flatten the scheduled tokens of all sequences into one forward pass."""
        work = [(it.seq.seq_id, (it.seq.token_ids[it.start:] + it.seq.draft_tokens)[:it.count], it.start, it.slots)
                for it in batch]   # a prefill chunk, or the last sampled token (+ drafts to verify)
        if all(len(w[1]) == 1 for w in work):
            # Pure decode (one token per sequence): the vectorized attention of
            # kernels.py, compiled when compile=True. Logits for every row.
            apply_pending_copies(self.cache, self.block_manager)
            args = ([w[1][0] for w in work], [w[2] for w in work], [w[3][0] for w in work],
                    [self.block_manager.tables[w[0]] for w in work])
            if self.decoder is not None and len(work) <= self.decoder.batch_sizes[-1]:
                logits = self.decoder(*args)
            else:
                logits = decode_step(self.model, self.cache, *args)
            return logits[logits_rows]
        input_ids, positions, ctx = AttentionContext.build(self.cache, self.block_manager, work,
                                                           logits_rows, self.device)
        return self.model(input_ids, positions, ctx)

    @staticmethod
    def _row_starts(rows):
        """(sequence, index of its first row in the logits) for each sampling sequence."""
        i = 0
        for seq, rs in rows:
            yield seq, i
            i += len(rs)

    def _probs(self, logits, seqs):
        """probs_from_logits with each row's own sampling parameters."""
        dev, p = logits.device, [s.params for s in seqs]
        if not seqs:
            return logits
        return probs_from_logits(
            logits, torch.tensor([x.temperature for x in p], device=dev, dtype=logits.dtype),
            torch.tensor([x.top_k for x in p], device=dev),
            torch.tensor([x.top_p for x in p], device=dev, dtype=logits.dtype))

    def _logprob(self, logits, row, token, n):
        """(log-probability of the token, {top-n alternatives}) under the raw model."""
        if n is None:
            return None
        logp = logits[row].log_softmax(dim=-1)
        top = logp.topk(n)
        return logp[token].item(), dict(zip(top.indices.tolist(), top.values.tolist()))

    # -- speculative decoding --------------------------------------------------------

    def _propose_drafts(self):
        """Ask the drafter for up to k tokens for every decoding sequence."""
        seqs, reqs = [], []
        for seq in self.scheduler.running:
            seq.draft_tokens, seq.draft_probs = [], None
            if seq.remaining != 1:
                continue                            # still prefilling
            # never draft past max_tokens or the context: the last token is the target's
            k = min(self.num_speculative_tokens, seq.params.max_tokens - len(seq.output_ids) - 1,
                    self.max_len - len(seq.token_ids) - 1)
            if k > 0:
                seqs.append(seq)
                reqs.append((seq.seq_id, seq.token_ids, k))

        def draft_sample(logits, idx):             # the draft model samples with each request's params
            probs = self._probs(logits, [seqs[i] for i in idx])
            return sample(probs, [seqs[i].generator for i in idx]), probs

        for seq, (tokens, probs) in zip(seqs, self.drafter.propose(reqs, draft_sample)):
            seq.draft_tokens, seq.draft_probs = tokens, probs

    # Verification pads every sequence's drafts to the longest, so the rule runs
    # as one batched tensor operation (speculative.rejection_sample_batched).
    def _verify(self, verify, probs):
        """Rejection-sample every verifying sequence at once; roll back the caches."""
        K = max(len(seq.draft_tokens) for seq, _ in verify)
        V = probs.shape[1]
        target = torch.zeros(len(verify), K + 1, V, device=probs.device)
        draft = torch.zeros(len(verify), K, V, device=probs.device)
        tokens = torch.zeros(len(verify), K, dtype=torch.long, device=probs.device)
        for b, (seq, i0) in enumerate(verify):
            m = len(seq.draft_tokens)
            target[b, :m + 1] = probs[i0:i0 + m + 1]
            tokens[b, :m] = torch.tensor(seq.draft_tokens)
            # a deterministic drafter (n-gram) proposes with probability 1: one-hot
            draft[b, :m] = seq.draft_probs if seq.draft_probs is not None else \
                torch.zeros(m, V, device=probs.device).scatter_(1, tokens[b, :m, None], 1.0)
        accepted = rejection_sample_batched(target, draft, tokens, [len(s.draft_tokens) for s, _ in verify],
                                            [seq.generator for seq, _ in verify])
        out = {}
        for (seq, _), acc in zip(verify, accepted):
            m = len(seq.draft_tokens)
            # K/V are valid for the fed last token and the accepted drafts; the
            # final token (correction or bonus) is fed next step like any sample.
            seq.num_computed = len(seq.token_ids) - 1 + len(acc)
            self.block_manager.truncate(seq.seq_id, seq.num_computed)
            self.drafter.rollback(seq.seq_id, seq.num_computed)
            met = seq.request.metrics
            met.draft_tokens, met.accepted_tokens, met.verify_steps = \
                met.draft_tokens + m, met.accepted_tokens + len(acc) - 1, met.verify_steps + 1
            self.stats["draft_tokens"] += m
            self.stats["accepted_tokens"] += len(acc) - 1
            self.stats["verify_steps"] += 1
            seq.draft_tokens, seq.draft_probs = [], None
            out[seq] = acc
        return out

    # Stop conditions are checked token by token, so that a speculative step that
    # accepted several tokens still stops exactly where plain decoding would.
    def _append(self, seq: Sequence, token: int, logprob=None):
        """Add a sampled token, stream its text, and check the stop conditions."""
        seq.token_ids.append(token)
        req, params = seq.request, seq.params
        req.metrics.output_tokens += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.perf_counter()
        if seq.logprobs is not None:
            seq.logprobs.append(logprob)
        delta = seq.decoder.push(token)
        seq.text += delta
        reason = None
        if (token == self.tokenizer.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "stop"
        elif params.stop:
            # Only text that ends in the new delta can complete a stop string.
            since = max(0, len(seq.text) - len(delta) - max(map(len, params.stop)) + 1)
            hits = [i for i in (seq.text.find(s, since) for s in params.stop) if i >= 0]
            if hits:
                seq.text = seq.text[:min(hits)]        # the stop string is not part of the output
                reason = "stop"
        if reason is None and (len(seq.output_ids) >= params.max_tokens or len(seq.token_ids) >= self.max_len):
            reason = "length"
            seq.text += seq.decoder.flush()             # an unfinished character becomes U+FFFD
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            if req.finished:
                req.metrics.finish_time = time.perf_counter()

    # -- offline API ---------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | list | None = None) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in input order.

        Every prompt is validated before any is queued, so a bad one raises
        ValueError (naming its index) and nothing is left behind in the engine.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                ids.append(self.add_request(prompt, p))
        except (ValueError, TypeError) as e:
            for rid in ids:
                self.abort(rid)
            raise type(e)(f"prompt {i}: {e}") from None
        final = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]
