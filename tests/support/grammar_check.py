"""Whether an llguidance grammar accepts a text, on a tokenizer of one token per byte (no model)."""

from __future__ import annotations

import json

import llguidance


def _byte_tokenizer() -> llguidance.LLTokenizer:
    """A tokenizer with one token per byte (GPT-2's byte-level alphabet) and an end token."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    chars |= {b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in chars)}
    vocab = {chars[b]: b for b in range(256)}
    spec = {"version": "1.0", "normalizer": None, "post_processor": None,
            "added_tokens": [{"id": 256, "content": "</s>", "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True}],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": False},
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            "model": {"type": "BPE", "vocab": {**vocab, "</s>": 256}, "merges": []}}
    return llguidance.LLTokenizer(json.dumps(spec), eos_token=256)


BYTES = _byte_tokenizer()


def allows(grammar: str, text: str) -> bool:
    """Whether ``grammar`` accepts ``text`` whole."""
    matcher = llguidance.LLMatcher(BYTES, grammar, log_level=0)
    return matcher.consume_tokens(BYTES.tokenize_str(text)) and matcher.is_accepting()


def allows_start(grammar: str, text: str) -> bool:
    """Whether ``grammar`` accepts a text starting with ``text``."""
    matcher = llguidance.LLMatcher(BYTES, grammar, log_level=0)
    return matcher.consume_tokens(BYTES.tokenize_str(text)) and not matcher.is_error()
