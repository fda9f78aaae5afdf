"""Content addresses of full KV blocks: a sha256 chain. Pure.

A block's id hashes the model fingerprint (the salt: weights, tokenizer,
template and KV format), its parent block's id and its token ids, so equal ids
mean equal KV content and identical prefixes share blocks across conversations.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", str)

# Tokens per KV block (the one definition; app.cache.blocks asserts mlx-lm agrees).
BLOCK_TOKENS = 256


def scoped_fingerprint(fingerprint: str, scope: str) -> str:
    """The fingerprint of caches that belong to ``scope`` alone ("" = no scope: the fingerprint
    itself). Servers of a pool share one database but, until the shared block tier exists,
    not their files: each scopes its caches by its server id, so no server reads (or retires)
    rows that point into another's directory."""
    return fingerprint if not scope else hashlib.sha256(f"{fingerprint}\0{scope}".encode()).hexdigest()


def private_fingerprint(fingerprint: str, salt: str) -> str:
    """The fingerprint under which blocks whose KV data this home did not compute (an imported
    archive's), or computed on top of such data (the blocks an imported conversation's turns
    fill: ``records.ConversationCache.salt``), are addressed: their ids chain from it, so no
    prompt of another agent, hashed under ``fingerprint``, ever reaches them, whatever tokens
    they cover."""
    return scoped_fingerprint(fingerprint, f"private:{salt}")


def block_hash(fingerprint: str, parent: str | None, tokens: Sequence[int]) -> BlockHash:
    digest = hashlib.sha256()
    digest.update(fingerprint.encode())
    digest.update((parent or "root").encode())
    digest.update(array("q", tokens).tobytes())
    return BlockHash(digest.hexdigest())


def chain_hashes(fingerprint: str, tokens: Sequence[int], block_tokens: int) -> list[BlockHash]:
    """The ids of every full block of ``tokens``, in order."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = block_hash(fingerprint, parent, tokens[start:start + block_tokens])
        hashes.append(parent)
    return hashes
