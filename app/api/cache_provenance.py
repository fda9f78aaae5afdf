"""A turn's cache provenance as clients see it: the ``x-semantic-cache`` header on every
generation response and the direct agent API's ``cache`` field (docs/apis.md).

The cache manager decides it when it leases the turn's cache (``ReuseReport``: where the
reused prefix came from, how reuse ended, how many prompt tokens, the stored format); this
module only writes it out, one way for every protocol.
"""

from __future__ import annotations

from app.types import ReuseReport

CACHE_HEADER = "x-semantic-cache"
# A stream's headers went out before its lease was taken (it waited in the queue): not known yet.
PENDING = "source=pending"


def provenance(reuse: ReuseReport) -> dict[str, str | int]:
    """The provenance's fields: ``source`` (memory, disk, tier, none), ``reason`` (how
    reuse ended: extend, exact, diverge, sibling, shared, miss, off), ``tokens`` (prompt
    tokens read from the cache) and ``format`` (the stored KV format, ``kv_format``)."""
    return {"source": reuse.source, "reason": reuse.reason, "tokens": reuse.n_tokens,
            "format": reuse.kv_format or "none"}


def header_value(reuse: ReuseReport | None) -> str:
    """``source=disk; reason=extend; tokens=2176; format=q8``, or ``source=pending`` when
    the turn has no lease yet."""
    if reuse is None:
        return PENDING
    return "; ".join(f"{key}={value}" for key, value in provenance(reuse).items())
