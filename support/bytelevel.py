"""
support/bytelevel.py -- how a Hugging Face byte-level vocabulary is stored (not a lesson).

tokenizer.json must hold raw bytes in JSON strings, so a byte-level BPE vocabulary writes each
byte as one printable character (GPT-2's bytes_to_unicode: a space is 'Ġ', a newline 'Ċ').
tokenizer.py merges bytes; byte_ranks turns the stored vocabulary back into them.
Imports nothing of the tour.
"""
from __future__ import annotations


def unicode_to_byte() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable ASCII and Latin-1 bytes stand for themselves,
    the other 68 bytes (controls, space, ...) shift in order to U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def byte_ranks(vocab: dict[str, int], specials) -> dict[bytes, int]:
    """tokenizer.json's vocab (stored token -> id) as tiktoken's mergeable ranks
    (token bytes -> id), special tokens left out (tiktoken takes those apart)."""
    u2b = unicode_to_byte()
    return {bytes(u2b[ch] for ch in tok): i for tok, i in vocab.items() if tok not in specials}
