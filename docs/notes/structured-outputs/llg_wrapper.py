"""Alternative: an LLTokenizer over nanoinfer's own Tokenizer (no tokenizer.json parse by llguidance)."""
import time
import llguidance as llg
from common import *
nt = nano_tokenizer()
inv = {v: k for k, v in nt.ranks.items()}

class NanoForLLG:
    """What llguidance.TokenizerWrapper reads: tokens (bytes by id; a special token is its name
    behind a 0xFF byte, llguidance's convention), eos/bos ids, special ids, and __call__ = encode."""
    def __init__(self, t):
        self.tokens = [inv.get(i) or (b"\xff" + t.id_to_special[i].encode()) for i in range(t.vocab_size)]
        self.eos_token_id, self.bos_token_id = t.eos_token_id, t.bos_token_id
        self.special_token_ids = sorted(t.id_to_special)
        self._t = t
    def __call__(self, s):
        return self._t.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)

t0 = time.perf_counter()
tok = llg.LLTokenizer(llg.TokenizerWrapper(NanoForLLG(nt)))
print(f"LLTokenizer(TokenizerWrapper(nanoinfer Tokenizer)): {(time.perf_counter() - t0) * 1e3:.1f} ms; "
      f"vocab {tok.vocab_size} eos {tok.eos_tokens} specials {[i for i in range(20) if tok.is_special_token(i)]}")
ref = llg.LLTokenizer(open(TOK_JSON).read(), eos_token=EOS)
g = llg.LLMatcher.grammar_from_json_schema(SCHEMA_STR)
import torch
a = torch.zeros((1, 1536), dtype=torch.int32); b = a.clone()
ma, mb = llg.LLMatcher(tok, g), llg.LLMatcher(ref, g)
same = True
for t in nt.encode(VALID_SCHEMA_OUT):
    ma.unsafe_compute_mask_ptr(a.data_ptr(), a.numel() * 4); mb.unsafe_compute_mask_ptr(b.data_ptr(), b.numel() * 4)
    same &= torch.equal(a, b); ma.consume_token(t); mb.consume_token(t)
print("masks identical to the tokenizer.json route along the whole valid output:", same)
