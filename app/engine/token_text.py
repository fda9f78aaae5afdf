"""Exact text of token sequences, incrementally, with character ends. Pure.

Cache records need, for generated tokens, the exact string they spell in the
conversation (special tokens as their literal text, as the chat template
writes them) and where each token ends. mlx-lm's streaming detokenizers are
made for display (they may trim a leading space), so this module decodes from
each token's raw bytes instead.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import TYPE_CHECKING

from app.errors import InvalidModelFile

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPM_SPACE = "\u2581"


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return {char: b for b, char in table.items()}


def _byte_level_translation() -> dict[int, str]:
    """A ``str.translate`` table that turns a byte-level token into its bytes as Latin-1
    characters: each character of GPT-2's alphabet to the character of its byte, and every
    other character below U+0100 to U+FFFF, so that a token with any character outside the
    alphabet fails to encode as Latin-1 (characters above U+00FF outside it fail as they are)."""
    decoder = _byte_level_decoder()
    table = {ord(char): chr(b) for char, b in decoder.items()}
    for code in range(256):
        table.setdefault(code, "\uffff")
    return table


def _decoder_kinds(decoder: dict | None) -> set[str]:
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return {str(d.get("type")) for d in decoder.get("decoders", [])}
    return {str(decoder.get("type"))}


class TokenBytes:
    """Each token id's raw bytes, for byte-level BPE and byte-fallback SentencePiece."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = pieces
        self.longest = max((len(p) for p in pieces), default=1) or 1  # bytes, so also characters

    @classmethod
    def from_tokenizer_json(cls, path: Path) -> TokenBytes:
        """Build from a ``tokenizer.json``.

        Raises:
            InvalidModelFile: its decoder is neither byte-level nor SentencePiece
                byte fallback, so exact token text cannot be derived.
        """
        data = json.loads(path.read_text())
        return cls._build(data["model"]["vocab"], {t["id"]: t["content"] for t in data.get("added_tokens", [])},
                          _decoder_kinds(data.get("decoder")), str(path))

    @classmethod
    def from_tokenizer(cls, backend: Tokenizer, where: str) -> TokenBytes:
        """Build from a loaded Hugging Face ``tokenizers.Tokenizer`` (a fast tokenizer's
        ``backend_tokenizer``): the pieces ``from_tokenizer_json`` reads from its file, without
        parsing the file a second time (33 MB for Gemma 3's 262K tokens). ``where`` names it in errors.

        Raises:
            InvalidModelFile: as ``from_tokenizer_json``.
        """
        decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else None
        return cls._build(backend.get_vocab(with_added_tokens=False),
                          {i: token.content for i, token in backend.get_added_tokens_decoder().items()},
                          _decoder_kinds(decoder), where)

    @classmethod
    def _build(cls, vocab: dict[str, int], added: dict[int, str], kinds: set[str], where: str) -> TokenBytes:
        pieces = [b""] * (max([*vocab.values(), *added]) + 1)
        if "ByteLevel" in kinds:
            table = _byte_level_translation()
            for token, i in vocab.items():
                try:  # every character in GPT-2's alphabet: its bytes
                    pieces[i] = token.translate(table).encode("latin-1")
                except UnicodeEncodeError:  # not a byte-level piece: its own text
                    pieces[i] = token.encode()
        elif "ByteFallback" in kinds or "Metaspace" in kinds:
            for token, i in vocab.items():
                if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                    pieces[i] = bytes([int(token[3:5], 16)])
                else:
                    pieces[i] = token.replace(SPM_SPACE, " ").encode()
        else:
            raise InvalidModelFile(f"{where}: decoder {sorted(kinds)} is not supported for cache records")
        for i, content in added.items():
            pieces[i] = content.encode()
        return cls(pieces)

    def __getitem__(self, token: int) -> bytes:
        return self._pieces[token]


class TextTracker:
    """Decode tokens one at a time, assigning each the character offset where it ends.

    A token that stops inside a UTF-8 character gets its end when the
    character completes, like a tokenizer's offsets for the same bytes.
    """

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = 0
        self.text_parts: list[str] = []
        self.ends: list[int] = []
        self._length = 0

    def add(self, token: int) -> str:
        """Feed one token; returns the text it completed."""
        text = self._decoder.decode(self._bytes[token])
        self._pending += 1
        self._length += len(text)
        self.text_parts.append(text)
        if not self._decoder.getstate()[0]:  # no partial character left
            self.ends.extend([self._length] * self._pending)
            self._pending = 0
        return text

    def finish(self) -> str:
        """Flush a dangling partial character (as U+FFFD, never matched again)."""
        text = self._decoder.decode(b"", final=True)
        self._length += len(text)
        self.text_parts.append(text)
        self.ends.extend([self._length] * self._pending)
        self._pending = 0
        return text

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def spells(token_bytes: TokenBytes, tokens: tuple[int, ...] | list[int], text: str) -> bool:
    """Whether ``tokens`` decode to exactly ``text`` (the reuse invariant, checked)."""
    try:
        return b"".join(token_bytes[t] for t in tokens).decode("utf-8") == text
    except (UnicodeDecodeError, IndexError):
        return False
