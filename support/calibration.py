"""The text AWQ calibrates on (quantize.awq_scale): English prose shipped with the project,
written for it and distinct from the evaluation text (tests/fixtures/eval_text.txt), so that
perplexity there is measured on text calibration did not see."""
from __future__ import annotations

import os

CALIBRATION_TEXT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                     "calibration_text.txt")
CALIBRATION_TOKENS = 256    # a few hundred tokens: AWQ's statistics are per channel means


def calibration_text() -> str:
    with open(CALIBRATION_TEXT_PATH, encoding="utf-8") as f:
        return f.read()


def calibration_ids(tokenizer, tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The first `tokens` token ids of the calibration text, by `tokenizer` (the model's)."""
    return tokenizer.encode(calibration_text())[:tokens]
