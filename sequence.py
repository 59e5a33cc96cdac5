"""
sequence.py -- a request's life: what the engine tracks for each prompt.

The lesson: the engine batches SEQUENCES, not requests, and a sequence is little more than a
growing list of token ids plus one number:

    token_ids     = prompt + generated so far
    num_computed  = how many of them already have K and V in the cache

Each step feeds token_ids[num_computed:] (a prompt chunk: prefill; last step's token: decode)
and, once the cache holds them all, samples the next token. Preemption (scheduler.py) just sets
num_computed back to 0: the tokens survive, their cache is recomputed. Text goes out as it is
made (a character can span tokens: tokenizer.IncrementalDecoder), minus what may still become a
stop string (sampler.StopStrings). n > 1 samples are n sequences sharing the prompt's KV blocks.

Place in the data flow: LLM.add_request makes a Request and its first Sequence, the Scheduler
moves sequences between waiting and running, and LLM.step (engine.py) appends each sampled
token here (step 4) and reports RequestOutputs.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from sampler import StopStrings, sample_key
from tokenizer import IncrementalDecoder

# The place of a token sampled by a step still in flight (engine.py's overlap): counted by every
# length and position now, its value read from the device later (Sequence.settle).
PENDING = -1

# A sequence's life: WAITING -> RUNNING -> FINISHED.
WAITING = "waiting"         # queued, or preempted: it holds no KV blocks
RUNNING = "running"         # holds KV blocks, fed every step
FINISHED = "finished"       # its blocks given back


class Sequence:
    """One stream of tokens (token_ids, num_computed: see above), its text and stop conditions."""
    _ids = itertools.count()

    def __init__(self, request: Request, token_ids: list, index: int, tokenizer):
        # one counter for the whole engine: the BlockManager keys block tables by seq_id, and
        # the n samples of one request need tables of their own after they fork
        self.seq_id = next(Sequence._ids)
        self.request, self.params = request, request.params
        self.index = index                       # which of the request's n samples
        self.token_ids, self.num_prompt = list(token_ids), len(request.prompt_ids)
        self.num_computed = 0        # nothing cached yet: the first steps are the prompt's prefill
        self.status = WAITING
        # its counter-based noise (sampler): the same seed gives the same tokens whatever else
        # shares the batch, and whether or not this sequence was preempted and recomputed
        self.key = sample_key(request.seed, index)
        self.draft_tokens: list[int] = []        # proposed this step (speculative decoding)
        self.draft_probs = None                  # their draft distributions [k, V] (None: one-hot)
        # structured outputs: its own place in the request's grammar (n samples go their ways)
        self.grammar = request.grammar.fork() if request.grammar is not None else None
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = StopStrings(self.params.stop) if self.params.stop else None
        self.pieces: list[str] = []              # the text, in the pieces released so far
        self.pending = ""                        # decoded text held back: may start a stop string
        self.finish_reason = None
        self.logprobs = [] if self.params.logprobs is not None else None
        self._reported = (0, 0)                  # (tokens, pieces) already in an output
        self.in_flight = 0                       # PENDING places at the end of token_ids

    num_output = property(lambda self: len(self.token_ids) - self.num_prompt)   # places included
    remaining = property(lambda self: len(self.token_ids) - self.num_computed)   # fed next step
    # tokens with K/V in the cache AND known to the host: what the prefix cache may hash
    num_settled = property(lambda self: min(self.num_computed,
                                            len(self.token_ids) - self.in_flight))

    def add_text(self, delta: str) -> bool:
        """Stream decoded text through the stop strings; what can no longer change goes to
        self.pieces, the tail that may still become one waits. True if a stop string completed
        (the text is cut just before it)."""
        # Why hold text back: "Obs" may be the start of the stop string "Observation". Sent
        # early, a stream could never take it back; held, it costs only the stop's length.
        text = self.pending + delta
        hit = self.stops.feed(delta) if self.stops else None     # (end, length) or None
        if hit is not None:
            cut = len(self.pending) + hit[0] - hit[1]   # the stop string itself is never output
        else:
            cut = len(text) - (self.stops.partial if self.stops else 0)
        self.pending = "" if hit is not None else text[cut:]
        if cut > 0:
            self.pieces.append(text[:cut])
        return hit is not None

    def append(self, token: int, logprob, eos_token_id, max_len: int) -> str | None:
        """Add a token, stream its text; why the sequence stops ("stop" | "length"), or None."""
        self.token_ids.append(token)      # num_computed lags by one: its K/V come next step
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        p = self.params
        # structured outputs: the grammar takes every token; once complete (nothing but EOS may
        # follow) it stops the output as EOS does
        done = self.grammar is not None and self.grammar.consume(token)
        # token by token: a speculative step stops exactly where plain decoding would have
        hit = self.add_text(self.decoder.push(token))                    # a stop string completed
        # EOS is kept in token_ids (as Hugging Face does) but decodes to no text: IncrementalDecoder
        # skips special tokens
        if hit or done or (token == eos_token_id and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif self.num_output >= p.max_tokens or len(self.token_ids) >= max_len:
            reason = "length"
        else:
            return None
        if not hit:    # the text ends here: release the held-back tail and an unfinished character
            tail, self.pending = self.pending + self.decoder.flush(), ""
            if tail:
                self.pieces.append(tail)
        return reason

    def settle(self, place: int, token: int, logprob, eos_token_id, max_len: int) -> str | None:
        """append() for a token whose PENDING place is token_ids[place] (a later step's places
        may follow it): appended there, the later places kept unless the sequence stops."""
        later = self.token_ids[place + 1:]
        del self.token_ids[place:]
        reason = self.append(token, logprob, eos_token_id, max_len)
        self.in_flight = 0 if reason else len(later)
        self.token_ids += [] if reason else later
        return reason

    def snapshot(self) -> Completion:
        """This sequence as a Completion, with the tokens and text pieces since the last one (what
        a stream sends): a step costs O(new tokens), not O(text so far)."""
        # Streams send deltas: re-joining the whole text every step would make a long answer
        # cost O(length^2) over its life, more than its decode steps at a few thousand tokens.
        t0, p0 = self._reported
        n, p = self.num_output - self.in_flight, len(self.pieces)
        self._reported = (n, p)
        new_lp = None if self.logprobs is None else self.logprobs[t0:n]
        new_ids = self.token_ids[self.num_prompt + t0:self.num_prompt + n]
        return Completion(self, "".join(self.pieces[p0:p]), new_ids, new_lp)

    def __repr__(self):
        return f"Sequence({self.seq_id}, {self.status}, {self.num_computed}/{len(self.token_ids)})"


class Request:
    """What a user asked for: a prompt, its params, and its n sequences."""

    def __init__(self, request_id, prompt_ids, params, arrival_time, seed: int, grammar=None):
        self.request_id, self.prompt_ids = request_id, prompt_ids
        self.params, self.seed = params, seed
        self.grammar = grammar   # structured outputs: the grammar unstarted; each sample forks it
        self.seqs: list[Sequence] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time, prompt_tokens=len(prompt_ids))
        self.error: str | None = None
        # entry i: (logprob of prompt[i] given prompt[:i], {id: logprob}), filled as prefill
        # chunks are computed; the first num_scored are known (entry 0: nothing conditions it)
        self.prompt_logprobs = None if params.prompt_logprobs is None else [None] * len(prompt_ids)
        self.num_scored = 1 if self.prompt_logprobs else len(prompt_ids)

    @property
    def finished(self) -> bool:
        # n > 1: the other samples exist only once the prompt is prefilled (they fork then), so
        # "all seqs finished" alone would be true too early
        return len(self.seqs) == self.params.n and all(s.status == FINISHED for s in self.seqs)

    def output(self) -> RequestOutput:
        scores = self.prompt_logprobs if self.num_scored == len(self.prompt_ids) else None
        return RequestOutput(self.request_id, self.prompt_ids, [s.snapshot() for s in self.seqs],
                             self.finished, self.metrics, self.error, scores)


# --- What the engine reports -------------------------------------------------
# What serving is judged by, stamped as a request moves: time to first token = queueing +
# prefill; each output token after it costs a decode step; cached tokens and preemptions say why.
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

    time_to_first_token = property(lambda m: None if m.first_token_time is None
                                   else m.first_token_time - m.arrival_time)
    acceptance_rate = property(lambda m: m.accepted_tokens / m.draft_tokens
                               if m.draft_tokens else None)


class Completion:
    """One sample of a request, as of the step that reported it. new_*: what this step added (all
    new_text joined is the final text). text / token_ids / logprobs: everything so far, read
    lazily: token ids and text pieces only grow, so a snapshot is just their lengths then."""

    def __init__(self, seq: Sequence, new_text: str, new_token_ids: list, new_logprobs):
        self._seq, self.index, self.finish_reason = seq, seq.index, seq.finish_reason
        self._tokens, self._pieces = seq.num_output - seq.in_flight, len(seq.pieces)
        self.new_text, self.new_token_ids, self.new_logprobs = new_text, new_token_ids, new_logprobs

    text = property(lambda self: "".join(self._seq.pieces[:self._pieces]))
    token_ids = property(lambda self: self._seq.token_ids[self._seq.num_prompt:][:self._tokens])

    @property
    def logprobs(self):
        """Per token: (logprob, {alternative id: logprob}); None if not asked for."""
        return None if self._seq.logprobs is None else self._seq.logprobs[:self._tokens]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: list                   # [Completion] * n
    finished: bool
    metrics: RequestMetrics
    error: str | None = None        # why the request failed (finish_reason "error")
    prompt_logprobs: list | None = None     # per prompt token (entry 0: None), once all known

    # The common case (n == 1) reads like one completion: outs[i].text
    text = property(lambda self: self.outputs[0].text)
    token_ids = property(lambda self: self.outputs[0].token_ids)
    finish_reason = property(lambda self: self.outputs[0].finish_reason)
