"""
tokenizer.py -- byte-level BPE through tiktoken.

The lesson: text enters the model as integers. A byte-level BPE tokenizer
  1. splits the text into "words" with a regex (the pre-tokenizer), so that merges never
     cross word, digit or whitespace boundaries;
  2. turns each word into its UTF-8 bytes, one token per byte;
  3. repeatedly merges the adjacent pair whose merged bytes have the lowest rank (the order
     the merges were learned in) until no merge applies.
Decoding concatenates each token's bytes and decodes UTF-8. tiktoken does steps 1-3 in Rust,
given the vocabulary (bytes -> rank) and the regex of a Hugging Face `tokenizer.json`.

Place in the data flow: `encode` turns a prompt into the token ids a `Sequence` starts from;
`IncrementalDecoder` turns the sampled ids back into text as they arrive, never emitting half
a UTF-8 character; `apply_chat_template` wraps chat messages in the instruct model's format.
This file imports no other file of the tour.
"""
from __future__ import annotations

import codecs
import heapq
import re

import regex  # tiktoken's own dependency: \p{L} classes for the slow path
import tiktoken

from support import bytelevel, checkpoint, checks

# GPT-2's pre-tokenizer regex: contractions, words with an optional leading space, numbers,
# punctuation runs, whitespace (a run keeps its last space for the next word: "  hi" -> " ", " hi")
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# SmolLM2 splits every digit on its own BEFORE the GPT-2 regex. Folded into one: a single \p{N}
# comes first, and whitespace before a digit (already cut out) keeps all its spaces.
DIGITS_THEN_GPT2_PATTERN = (r"\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+"
                            r"|\s+(?![^\s\p{N}])|\s+")
# An id beyond the vocabulary decodes to U+FFFD, as invalid UTF-8 does: one character per id.
PLACEHOLDER = "\ufffd"


class Tokenizer:
    """encode / decode / chat template over a tiktoken.Encoding."""

    def __init__(self, vocab: dict[str, int], specials: dict[str, int], pattern: str,
                 eos_token: str | None = None, bos_token: str | None = None,
                 chat_template: str | None = None):
        # tokenizer.json writes each byte as a printable character (a space is 'Ġ': GPT-2's
        # bytes_to_unicode); support/bytelevel.py gives the tokens back as bytes. rank = id:
        # Hugging Face byte-level vocabularies number their ids in the merges' learned order.
        self.ranks = ranks = bytelevel.byte_ranks(vocab, specials)
        self.vocab_size = max([*vocab.values(), *specials.values()]) + 1
        self.pattern, self.specials = pattern, specials
        self.enc = tiktoken.Encoding("nanoinfer", pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens=specials)
        # Some bytes have no token (SmolLM2 lacks 21, e.g. 0x04 and 0xF1); tiktoken panics on
        # them, so encode()'s slow path drops them before merging, as the reference does.
        self.missing_bytes = bytes(b for b in range(256) if bytes([b]) not in ranks)
        # the most bytes one token covers: text of more than max_len * this cannot fit the context
        self.max_token_bytes = max(len(t) for t in [*ranks, *(s.encode() for s in specials)])
        self.id_to_special = {i: s for s, i in specials.items()}
        self.eos_token_id = vocab.get(eos_token, specials.get(eos_token)) if eos_token else None
        self.bos_token_id = vocab.get(bos_token, specials.get(bos_token)) if bos_token else None
        # ChatML's default system prompt, read from the checkpoint's own jinja template.
        self.chat_template = chat_template
        m = re.search(r"<\|im_start\|>system(?:\n|\\n)(.*?)<\|im_end\|>", chat_template or "", re.S)
        self.default_system_prompt = m.group(1) if m else None

    @classmethod
    def from_pretrained(cls, path: str) -> "Tokenizer":
        """Read a checkpoint directory's tokenizer.json (+ tokenizer_config.json)."""
        return cls(**checkpoint.read_tokenizer_files(path, GPT2_PATTERN, DIGITS_THEN_GPT2_PATTERN))

    # -- the lesson: BPE, one piece at a time ---------------------------------
    def _bpe(self, piece: bytes) -> list[int]:
        """The BPE merge loop on one piece (a pre-tokenized word): start from single bytes and
        keep merging the adjacent pair whose concatenation has the lowest rank (the leftmost on
        a tie). tiktoken runs this loop in Rust; encode() calls this one only for text tiktoken
        cannot take. Rescanning every pair after each merge costs O(n^2) on an n-byte word (a
        16 KB word: seconds); here the candidate pairs wait in a heap, and a merge only pushes
        the two pairs it creates: O(n log n)."""
        # assignment: bpe
        n = len(piece)
        parts = [piece[i:i + 1] for i in range(n)]     # part i starts at byte i (b"": merged away)
        nxt, prv = list(range(1, n + 1)), list(range(-1, n - 1))    # neighbours: a linked list
        heap = []                                       # (rank, position, left, right)

        def candidate(i):                               # the pair at part i, if it is a token
            j = nxt[i]
            if i >= 0 and j < n and (r := self.ranks.get(parts[i] + parts[j])) is not None:
                heapq.heappush(heap, (r, i, parts[i], parts[j]))
        for i in range(n - 1):
            candidate(i)
        while heap:
            r, i, a, b = heapq.heappop(heap)
            j = nxt[i]
            if j >= n or parts[i] != a or parts[j] != b:
                continue                                # stale: a part changed since it was pushed
            parts[i], parts[j] = a + b, b""             # merge j into i, unlink j
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            candidate(prv[i])                           # the two new pairs
            candidate(i)
        return [self.ranks[p] for p in parts if p]
        # end assignment

    # -- encode / decode ------------------------------------------------------
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Text -> token ids. Special-token strings ("<|im_end|>") are plain text unless
        allow_special=True: a user must not inject control tokens into someone's template."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        if self.unencodable(text) is None:                  # usually: all in Rust
            return self.enc.encode(text, allowed_special="all" if allow_special else set(),
                                   disallowed_special=())
        # Slow path in Python: split off specials, regex-split, drop missing bytes, merge with BPE.
        ids = []
        specials = "|".join(map(re.escape, self.specials)) if allow_special else ""
        for i, chunk in enumerate(re.split(f"({specials})", text) if specials else [text]):
            if i % 2:                                  # a captured special token
                ids.append(self.specials[chunk])
                continue
            for piece in regex.findall(self.pattern, chunk):
                piece = piece.encode("utf-8", errors="surrogatepass")
                ids += self._bpe(piece.translate(None, self.missing_bytes))
        return ids

    def unencodable(self, text: str) -> str | None:
        """The first character of text that holds a byte with no token (encode drops it, as the
        Hugging Face reference does), or None: a caller that must not lose it refuses the text."""
        utf8 = text.encode("utf-8", errors="surrogatepass")
        if len(utf8.translate(None, self.missing_bytes)) == len(utf8):
            return None
        missing = set(self.missing_bytes)
        return next(c for c in text if missing & set(c.encode("utf-8", "surrogatepass")))

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes; PLACEHOLDER's for an id beyond the vocabulary (legal: a "random:"
        Llama 3 preset samples 128256 ids, read with a 49152-token tokenizer); ValueError if < 0."""
        if token_id < 0:
            raise ValueError(f"token ids are non-negative, got {token_id}")
        try:
            return self.enc.decode_single_token_bytes(token_id)
        except (KeyError, OverflowError):     # beyond the vocabulary (or beyond 2^32)
            return PLACEHOLDER.encode("utf-8")

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Token ids -> text; invalid UTF-8 and ids beyond the vocabulary become U+FFFD."""
        ids = [i for i in ids if not (skip_special_tokens and i in self.id_to_special)]
        try:
            data = self.enc.decode_bytes(ids)             # all in Rust: the usual case
        except (KeyError, OverflowError):                 # an unknown (or negative) id somewhere
            data = b"".join(self.token_bytes(i) for i in ids)
        return data.decode("utf-8", errors="replace")

    # -- chat -----------------------------------------------------------------
    def _chat_parts(self, messages, add_generation_prompt):
        """ChatML as (text, is_special) pieces:
        <|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n"""
        checks.check_chat(messages, self.chat_template)   # ChatML; string roles and contents
        if messages[0]["role"] != "system" and self.default_system_prompt is not None:
            messages = [{"role": "system", "content": self.default_system_prompt}] + messages
        parts = []
        for m in messages:
            parts += [("<|im_start|>", True), (m["role"] + "\n" + m["content"], False),
                      ("<|im_end|>", True), ("\n", False)]
        if add_generation_prompt:
            parts += [("<|im_start|>", True), ("assistant\n", False)]
        return parts

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False):
        """Messages -> prompt string (encode it with allow_special=True), or with tokenize=True
        token ids, each content encoded as plain text: it cannot inject control tokens."""
        parts = self._chat_parts(messages, add_generation_prompt)
        if not tokenize:
            return "".join(text for text, _ in parts)
        return [i for text, special in parts
                for i in ([self.specials[text]] if special else self.encode(text))]


class IncrementalDecoder:
    """Streaming detokenization: feed token ids one by one, get the new text. A token may end
    inside a multi-byte UTF-8 character (emoji often span 2-4 tokens): Python's incremental
    decoder holds such a tail back, so all the text returned equals decode(all ids)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if self.skip and token_id in self.tok.id_to_special:
            return ""
        return self.utf8.decode(self.tok.token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: an incomplete trailing character becomes U+FFFD."""
        return self.utf8.decode(b"", final=True)
