"""Recurrent state (hybrid models): which cache entries are attention KV and which keep
state, checkpoints of that state at token positions, and which positions get one (MLX).

Hybrid models (Qwen3.5, Qwen3-Next, LFM2, Nemotron-H, Granite 4 hybrid, ...) keep, in some
layers, a fixed-size state (conv and SSM or linear-attention states: mlx-lm's
``ArraysCache``) instead of keys and values; Falcon-H1 keeps both in every layer (mlx-lm's
``CacheList(ArraysCache, KVCache)``: its mamba mixer and its attention side by side), and a
layout names each part of such an entry. Such a state cannot be cut back to a prefix,
so it is kept as **checkpoints**: every recurrent layer's arrays at one token position,
exactly as the model computed them (lossless, in their own dtype). A lease reuses the
attention KV up to the latest checkpoint at or before the matched prefix, and the
checkpoint's states; the rest of the prompt is computed again.

Where checkpoints are taken (``plan``): the end of each turn's prompt (all of it but the
last token, which decoding feeds; an exact repeat of a prompt reuses that many tokens),
the end of its reply (the cache as decoding hands it back), and, inside a long prefill,
block boundaries at 1, 2, 4, ... blocks before the prompt's end (an edit ``d`` tokens
before the end resumes at most about ``2 d`` tokens before the edit). The prefill's chunks
end exactly at those positions.

Shared checkpoints: a checkpoint at a block boundary B holds for every prompt whose first
B tokens are the same, which the id of the block ending at B names (it chains all earlier
tokens and the model). A turn that began from shared data alone (cold, or from shared
blocks and a shared checkpoint: ``manager.Lease.public``) keeps those its prefill took at
block boundaries with their blocks (``files.CacheFiles.write_shared_checkpoint``, the
checksum in the block's row); a new conversation of any agent resumes at the latest of
them its prompt's shared blocks reach (``CacheManager.lease``). They go with their
block's row; a turn shares at most as many as its plan has block boundaries.

Bounds (``keep``): at most ``MAX_CHECKPOINTS`` per conversation: the newest two (prompt
and reply end of the last turn) and, of the older ones still on the conversation's
tokens, those spaced geometrically back from its end. Bytes per checkpoint per model:
``CacheLayout.checkpoint_nbytes`` (docs/models.md lists them for the tested shapes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from app.cache.hashing import BLOCK_TOKENS

MAX_CHECKPOINTS = 6  # per conversation (the newest two and four spaced earlier)
MAX_SPACED = 4  # spaced checkpoints one prefill takes, at most

KV = "kv"  # an attention layer's entry in a layout (else: "state:<n arrays>")
PARTS = "+"  # joins the parts of a ``CacheList`` entry's kind, in its order: "state:2+kv"


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """What each entry of a model's cache list (``make_cache``) holds: attention keys and
    values (``KV``), recurrent state (``state:<n>``, an ``ArraysCache`` of n arrays), or
    both (a ``CacheList`` of such parts, its kind theirs joined by ``PARTS`` in order:
    Falcon-H1's ``state:2+kv``). ``attention`` and ``recurrent`` reach the parts of either
    kind wherever they are, ``assemble`` builds entries of every kind."""

    kinds: tuple[str, ...]

    @classmethod
    def attention_only(cls, n_layers: int) -> CacheLayout:
        return cls((KV,) * n_layers)

    @classmethod
    def of(cls, model: Any) -> CacheLayout:
        """The layout of ``model``'s caches. Raises ValueError naming a kind it cannot hold."""
        unsupported = unsupported_caches(model)
        if unsupported:
            raise ValueError(f"its layers keep {', '.join(unsupported)} state")
        make = getattr(model, "make_cache", None)
        if make is None:
            return cls.attention_only(len(model.layers))
        return cls.of_cache(make())

    @classmethod
    def of_cache(cls, cache: Sequence[Any]) -> CacheLayout:
        """The layout of a cache list (of the kinds ``unsupported_caches`` accepts)."""
        return cls(tuple(PARTS.join(KV if type(part) in (KVCache, RotatingKVCache) else f"state:{len(part.cache)}"
                                    for part in _parts_of(entry)) for entry in cache))

    @property
    def n_attention(self) -> int:
        return sum(part == KV for kind in self.kinds for part in kind.split(PARTS))

    @property
    def n_recurrent(self) -> int:
        """The recurrent parts (``ArraysCache``): the states one checkpoint holds."""
        return sum(part != KV for kind in self.kinds for part in kind.split(PARTS))

    @property
    def hybrid(self) -> bool:
        """Some layers keep recurrent state (reuse needs checkpoints)."""
        return self.n_recurrent > 0

    def _parts(self, cache: Sequence[Any]) -> list[tuple[str, Any]]:
        """(kind, cache) of every part of a working cache's entries, in order."""
        return [pair for entry, kind in zip(cache, self.kinds)
                for pair in zip(kind.split(PARTS), _parts_of(entry), strict=True)]

    def attention(self, cache: Sequence[Any]) -> list[Any]:
        """The attention parts of a working cache (``KVCache``), in order."""
        return [c for kind, c in self._parts(cache) if kind == KV] if self.hybrid else list(cache)

    def recurrent(self, cache: Sequence[Any]) -> list[Any]:
        """The recurrent parts (``ArraysCache``), in order."""
        return [c for kind, c in self._parts(cache) if kind != KV]

    def assemble(self, attention: list[Any], checkpoint: Checkpoint | None) -> list[Any]:
        """A working cache of this layout: ``attention``'s KV caches and fresh ``ArraysCache``
        parts holding ``checkpoint``'s states (empty ones without), each entry of several
        parts a ``CacheList`` of them."""
        if not self.hybrid:
            return attention
        kv = iter(attention)
        states = iter(checkpoint.states if checkpoint is not None else ())

        def part(kind: str) -> Any:
            if kind == KV:
                return next(kv)
            entry = ArraysCache(int(kind.split(":")[1]))
            if checkpoint is not None:
                entry.cache = list(next(states))  # type: ignore[arg-type, call-overload]  # arrays, not None
            return entry

        out = []
        for kind in self.kinds:
            parts = [part(p) for p in kind.split(PARTS)]
            out.append(parts[0] if len(parts) == 1 else CacheList(*parts))
        return out

    def checkpoint_nbytes(self, cache: Sequence[Any]) -> int:
        """Bytes of one checkpoint of a (prefilled) working cache."""
        return sum(c.nbytes for c in self.recurrent(cache))


def _parts_of(entry: Any) -> tuple[Any, ...]:
    """A cache entry's parts: a ``CacheList``'s caches, else the entry itself."""
    return tuple(entry.caches) if type(entry) is CacheList else (entry,)


def unsupported_caches(model: Any) -> list[str]:
    """The kinds of per-layer cache ``model`` needs that Semantic's caches cannot hold: all
    but attention keys and values (``KVCache``; ``RotatingKVCache``, a sliding window the
    engine keeps in full and masks) and recurrent state (``ArraysCache``, kept as
    checkpoints), alone or as the parts of a ``CacheList``, with at least one attention
    part in the model (a model of recurrent layers only is not served yet)."""
    make = getattr(model, "make_cache", None)
    parts = [part for entry in (make() if make is not None else []) for part in _parts_of(entry)]
    kinds = {type(c) for c in parts}
    unsupported = sorted({t.__name__ for t in kinds if t not in (KVCache, RotatingKVCache, ArraysCache)})
    if not unsupported and parts and kinds <= {ArraysCache}:
        unsupported = ["ArraysCache (and no attention layer)"]
    return unsupported


@dataclass(frozen=True)
class Checkpoint:
    """Every recurrent layer's state after the first ``n_tokens`` tokens: ``states[i]`` holds
    the arrays of the i-th recurrent part's ``ArraysCache`` (``CacheLayout.recurrent``), as
    the model computed them."""

    n_tokens: int
    states: tuple[tuple[mx.array, ...], ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for state in self.states for a in state)

    def to_numpy(self, prefix: str) -> tuple[dict[str, np.ndarray], list[list[str]]]:
        """Name -> numpy array (``prefix`` + layer.array), and each array's MLX dtype (a
        bfloat16 array is stored as its bits, uint16: numpy has no bfloat16)."""
        arrays: dict[str, np.ndarray] = {}
        dtypes: list[list[str]] = []
        for i, state in enumerate(self.states):
            dtypes.append([])
            for j, array in enumerate(state):
                name = str(array.dtype).removeprefix("mlx.core.")
                dtypes[-1].append(name)
                raw = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
                arrays[f"{prefix}{i}.{j}"] = np.array(raw, copy=False)
        return arrays, dtypes

    @classmethod
    def from_numpy(cls, n_tokens: int, arrays: dict[str, np.ndarray], prefix: str,
                   dtypes: list[list[str]]) -> Checkpoint:
        """Inverse of ``to_numpy``. Raises KeyError or ValueError if the arrays are not its."""
        states = []
        for i, names in enumerate(dtypes):
            state = []
            for j, name in enumerate(names):
                dtype = getattr(mx, name)
                if not isinstance(dtype, mx.Dtype):
                    raise ValueError(f"not a dtype: {name}")
                array = mx.array(arrays[f"{prefix}{i}.{j}"])
                state.append(array.view(dtype) if dtype == mx.bfloat16 else array.astype(dtype))
            states.append(tuple(state))
        return cls(n_tokens, tuple(states))


def capture(layout: CacheLayout, cache: Sequence[Any], n_tokens: int) -> Checkpoint:
    """The recurrent states of a working cache that holds ``n_tokens`` tokens (references:
    the model replaces a state's arrays at every step, never writes into them)."""
    states = tuple(tuple(entry.cache) for entry in layout.recurrent(cache))
    if any(a is None for state in states for a in state):
        raise ValueError("a recurrent layer holds no state yet")
    mx.eval([a for state in states for a in state])
    return Checkpoint(n_tokens, states)


def latest_at(checkpoints: Sequence[Checkpoint], n_tokens: int, usable: Any = None) -> Checkpoint | None:
    """The checkpoint at the most tokens not beyond ``n_tokens`` (and, if given, for which
    ``usable(n)`` holds), or None."""
    best = None
    for point in checkpoints:
        if point.n_tokens <= n_tokens and (usable is None or usable(point.n_tokens)):
            if best is None or point.n_tokens > best.n_tokens:
                best = point
    return best


def plan(start: int, end: int) -> tuple[int, ...]:
    """Positions a prefill of tokens ``[start, end)`` stops at to take a checkpoint: block
    boundaries 1, 2, 4, ... blocks before ``end`` (at most ``MAX_SPACED``), the last block
    boundary before ``end`` (where a prompt that is all shared start, a direct agent's
    system prompt, ends its last whole block: a shared checkpoint), then ``end``."""
    positions = {end} if end > start else set()
    distance = BLOCK_TOKENS
    while len(positions) <= MAX_SPACED and end - distance > start:
        at = (end - distance) // BLOCK_TOKENS * BLOCK_TOKENS
        if at > start:
            positions.add(at)
        distance *= 2
    last = (end - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    if start < last:
        positions.add(last)
    return tuple(sorted(positions))


def keep(checkpoints: Sequence[Checkpoint], limit: int = MAX_CHECKPOINTS) -> tuple[Checkpoint, ...]:
    """At most ``limit`` of ``checkpoints`` (one per position): the newest two, then, going
    back, each one at least twice as far from the newest as the last one kept."""
    by_position = sorted({p.n_tokens: p for p in checkpoints}.values(), key=lambda p: -p.n_tokens)
    if len(by_position) <= limit:
        return tuple(reversed(by_position))
    newest = by_position[0].n_tokens
    kept = by_position[:2]
    for point in by_position[2:]:
        if len(kept) >= limit:
            break
        if newest - point.n_tokens >= 2 * (newest - kept[-1].n_tokens):
            kept.append(point)
    return tuple(reversed(kept))


@dataclass
class CheckpointPlan:
    """The checkpoints a turn takes as it prefills (``positions``, absolute) and those it
    has (``taken``, the reused ones first). Owned by the turn's lease."""

    layout: CacheLayout
    positions: tuple[int, ...] = ()
    taken: list[Checkpoint] = field(default_factory=list)

    def chunk(self, at: int, n: int) -> int:
        """How many of the ``n`` tokens a prefill chunk starting at ``at`` takes: it ends at
        the next planned position."""
        due = [p for p in self.positions if at < p < at + n]
        return min(due) - at if due else n

    def after_prefill(self, cache: Sequence[Any], at: int) -> None:
        """Take a checkpoint if the cache, holding ``at`` tokens, is at a planned position."""
        if at in self.positions and all(p.n_tokens != at for p in self.taken):
            self.taken.append(capture(self.layout, cache, at))

    def kept(self, cache: Sequence[Any], n_tokens: int) -> tuple[Checkpoint, ...]:
        """The checkpoints a conversation keeps after the turn, its cache holding ``n_tokens``:
        those it had and took before there, and one of the cache as it is now (the reply's
        end), within ``MAX_CHECKPOINTS``."""
        return keep([*(p for p in self.taken if p.n_tokens < n_tokens), capture(self.layout, cache, n_tokens)])


def resume(layout: CacheLayout, attention: list[Any], n_reused: int,
           checkpoints: Sequence[Checkpoint]) -> tuple[list[Any], CheckpointPlan | None]:
    """A lease's working cache of ``layout``: ``attention``'s KV and, in a hybrid model, the
    recurrent state of the checkpoint at ``n_reused`` tokens among ``checkpoints`` (those up
    to there travel with the lease as its plan's). Attention only: ``attention``, no plan."""
    if not layout.hybrid:
        return attention, None
    taken = [p for p in checkpoints if p.n_tokens <= n_reused]
    point = next((p for p in taken if p.n_tokens == n_reused), None)
    assert point is not None or n_reused == 0, "a hybrid lease resumes at a checkpoint"
    return layout.assemble(attention, point), CheckpointPlan(layout, taken=taken)
