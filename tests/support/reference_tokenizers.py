"""Independent re-implementations of llama.cpp's two tokenizers, for tests.

They follow llama.cpp's algorithms directly on the GGUF vocabulary (special
tokens split out first, then regex + rank-ordered merges for byte-level BPE,
or score-ordered bigram merging with byte fallback for SentencePiece), so the
imported `tokenizers` JSON can be checked against the file's own vocabulary
without compiling llama.cpp.
"""

from __future__ import annotations

import regex

from app.catalog.gguf_tokenizer import (
    SPM_SPACE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED, GgufVocab,
)

SMOLLM_PIECES = [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"]


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _split_special(text: str, vocab: GgufVocab) -> list[tuple[bool, str]]:
    """Split out control and user-defined tokens, longest first (llama.cpp)."""
    specials = sorted(
        (t for t, k in zip(vocab.tokens, vocab.token_types) if k in (TOKEN_CONTROL, TOKEN_USER_DEFINED)),
        key=len, reverse=True,
    )
    parts: list[tuple[bool, str]] = [(False, text)]
    for special in specials:
        out: list[tuple[bool, str]] = []
        for is_special, chunk in parts:
            if is_special or special not in chunk:
                out.append((is_special, chunk))
                continue
            pieces = chunk.split(special)
            for i, piece in enumerate(pieces):
                if piece:
                    out.append((False, piece))
                if i < len(pieces) - 1:
                    out.append((True, special))
        parts = out
    return parts


class ReferenceBpe:
    def __init__(self, vocab: GgufVocab) -> None:
        self.vocab = vocab
        self.ids = {t: i for i, t in enumerate(vocab.tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(vocab.merges or [])}
        self.byte_map = _bytes_to_unicode()

    def _words(self, text: str) -> list[str]:
        words = [text]
        for pattern in SMOLLM_PIECES:
            words = [w for word in words for w in self._split_keep(pattern, word)]
        return words

    @staticmethod
    def _split_keep(pattern: str, text: str) -> list[str]:
        out, last = [], 0
        for m in regex.finditer(pattern, text):
            if m.start() > last:
                out.append(text[last:m.start()])
            out.append(m.group())
            last = m.end()
        if last < len(text):
            out.append(text[last:])
        return out

    def _bpe(self, word: str) -> list[str]:
        symbols = [self.byte_map[b] for b in word.encode("utf-8")]
        while len(symbols) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 60), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 60:
                break
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        return symbols

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for is_special, chunk in _split_special(text, self.vocab):
            if is_special:
                ids.append(self.ids[chunk])
                continue
            for word in self._words(chunk):
                ids += [self.ids[s] for s in self._bpe(word)]
        return ids


class ReferenceSpm:
    def __init__(self, vocab: GgufVocab) -> None:
        self.vocab = vocab
        self.ids = {t: i for i, t in enumerate(vocab.tokens)}
        self.normal = {t for t, k in zip(vocab.tokens, vocab.token_types) if k == TOKEN_NORMAL}

    def _spm(self, text: str) -> list[int]:
        symbols = list(text.replace(" ", SPM_SPACE))
        scores = self.vocab.scores
        while len(symbols) > 1:
            best = None
            for i in range(len(symbols) - 1):
                merged = symbols[i] + symbols[i + 1]
                if merged in self.normal:
                    score = scores[self.ids[merged]]
                    if best is None or score > best[0]:
                        best = (score, i)
            if best is None:
                break
            i = best[1]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        ids: list[int] = []
        for s in symbols:
            if s in self.ids:
                ids.append(self.ids[s])
            else:
                ids += [self.ids[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
        return ids

    def encode(self, text: str) -> list[int]:
        ids = [self.vocab.bos_id] if self.vocab.add_bos else []
        for is_special, chunk in _split_special(text, self.vocab):
            ids += [self.ids[chunk]] if is_special else self._spm(chunk)
        return ids
