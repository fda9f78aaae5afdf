"""Rebuild a Hugging Face `tokenizers` tokenizer from a GGUF file's vocabulary.

GGUF files carry the tokenizer as metadata (``tokenizer.ggml.*``): the token
strings, their types, BPE merges (byte-level BPE) or scores (SentencePiece-style
vocabularies), the pre-tokenizer kind, BOS/EOS ids and the chat template. This
module turns that metadata into a ``tokenizer.json`` that reproduces
llama.cpp's tokenization of the same file, which is what a user holding the
GGUF expects. Pure: no MLX, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from app.errors import InvalidModelFile

# llama.cpp token types (llama_token_type).
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# Pre-tokenizer regexes for byte-level BPE vocabularies, as llama.cpp applies
# them for each ``tokenizer.ggml.pre`` kind.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class GgufVocab:
    """The tokenizer metadata of one GGUF file."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece-style)
    pre: str
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_space_prefix: bool
    chat_template: str | None


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        # Digits one by one, then the GPT-2 split (HF's SmolLM2 tokenizer).
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    regex = {"gpt-2": _GPT2_REGEX, "default": _GPT2_REGEX, "llama-bpe": _LLAMA3_REGEX,
             "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}.get(pre)
    if regex is None:
        raise InvalidModelFile(f"unsupported byte-level pre-tokenizer {pre!r} in tokenizer.ggml.pre")
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated"), byte_level]
    )


def _spm_merges(vocab: GgufVocab) -> list[tuple[str, str]]:
    """Merges equivalent to llama.cpp's score-driven SentencePiece BPE.

    llama.cpp repeatedly merges the adjacent pair whose concatenation is the
    highest-scoring vocabulary entry. Ranking every (left, right) split of each
    normal token by the merged token's score gives the same order to HF's BPE.
    """
    assert vocab.scores is not None
    ids = {t: i for i, t in enumerate(vocab.tokens) if vocab.token_types[i] == TOKEN_NORMAL}
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for piece, piece_id in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            left_id, right_id = ids.get(left), ids.get(right)
            if left_id is not None and right_id is not None:
                ranked.append((-vocab.scores[piece_id], piece_id, left_id, right_id, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _added_tokens(vocab: GgufVocab) -> list[AddedToken]:
    """Control tokens are special; user-defined ones are matched verbatim in text."""
    added = []
    for token, kind in zip(vocab.tokens, vocab.token_types):
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            added.append(AddedToken(token, special=kind == TOKEN_CONTROL, normalized=False))
    return added


def _build_byte_level(vocab: GgufVocab) -> Tokenizer:
    if vocab.merges is None:
        raise InvalidModelFile("byte-level BPE vocabulary has no tokenizer.ggml.merges")
    merges = [(left, right) for left, right in (m.split(" ", 1) for m in vocab.merges)]
    token_ids = {t: i for i, t in enumerate(vocab.tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=token_ids, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(vocab.pre)
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets=False: offsets must cover every character (cache records rely on it).
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _build_sentencepiece(vocab: GgufVocab) -> Tokenizer:
    if vocab.scores is None:
        raise InvalidModelFile("SentencePiece vocabulary has no tokenizer.ggml.scores")
    token_ids = {t: i for i, t in enumerate(vocab.tokens)}
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    tokenizer = Tokenizer(
        models.BPE(vocab=token_ids, merges=_spm_merges(vocab), unk_token=unk,
                   fuse_unk=True, byte_fallback=True)
    )
    steps: list[normalizers.Normalizer] = []
    if vocab.add_space_prefix:
        steps.append(normalizers.Prepend(SPM_SPACE))
    steps.append(normalizers.Replace(" ", SPM_SPACE))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode_steps)
    return tokenizer


def build_tokenizer(vocab: GgufVocab) -> Tokenizer:
    """Build the `tokenizers` equivalent of a GGUF vocabulary.

    Raises:
        InvalidModelFile: for a tokenizer model or pre-tokenizer kind this
            importer does not know (rather than a silently wrong tokenizer).
    """
    if vocab.model == "gpt2":
        tokenizer = _build_byte_level(vocab)
    elif vocab.model == "llama":
        tokenizer = _build_sentencepiece(vocab)
    else:
        raise InvalidModelFile(f"unsupported tokenizer.ggml.model {vocab.model!r}")
    tokenizer.add_tokens(_added_tokens(vocab))
    if vocab.add_bos and vocab.bos_id is not None:
        bos = vocab.tokens[vocab.bos_id]
        bos_processor: Any = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_id)]
        )
        if vocab.model == "gpt2":
            bos_processor = processors.Sequence([tokenizer.post_processor, bos_processor])
        tokenizer.post_processor = bos_processor
    return tokenizer
