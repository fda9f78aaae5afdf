"""Token bytes of a byte-level BPE ``tokenizer.json`` (``TokenBytes.from_tokenizer_json``):
each token of GPT-2's alphabet spells its bytes, any other token its own UTF-8 text."""

from __future__ import annotations

import json
from pathlib import Path

from app.engine.token_text import TokenBytes


def gpt2_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted, spelled out from its definition."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {char: b for b, char in chars.items()}


def test_byte_level_tokens_spell_their_bytes_and_others_their_text(tmp_path: Path) -> None:
    alphabet = gpt2_alphabet()
    outside = ["\n", " ", "\xad", "\x7f", "中", "\u2581", "\uffff", "é"]  # below U+0100 and above, not in it
    tokens = [*alphabet, "Ġthe", "ĠĊ", "Ã©", *outside, *(f"ab{c}" for c in outside), "ĀĠ中"]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"vocab": vocab}, "decoder": {"type": "ByteLevel"},
                                "added_tokens": [{"id": len(vocab), "content": "<|im_end|>"}]}))
    pieces = TokenBytes.from_tokenizer_json(path)
    for token, i in vocab.items():
        expected = bytes(alphabet[c] for c in token) if all(c in alphabet for c in token) else token.encode()
        assert pieces[i] == expected, token
    assert pieces[vocab["Ġthe"]] == b" the" and pieces[vocab["Ã©"]] == "é".encode()
    assert pieces[vocab["中"]] == "中".encode() and pieces[vocab["\n"]] == b"\n"
    assert pieces[len(vocab)] == b"<|im_end|>"
