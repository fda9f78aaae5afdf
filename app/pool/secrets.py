"""A local pool's secrets: its PostgreSQL password and its S3 tier's keys, random per pool and
kept in ``pool/secrets.json``, which only its owner can read (0600).

They live as long as the pool's cluster and bucket, across ``pool up`` runs: a cluster made
with one password is not reachable with another, so a file that cannot be read is an error
to fix, never a reason to make new ones.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from app.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolSecrets:
    postgres_password: str
    s3_access_key: str
    s3_secret_key: str

    @classmethod
    def generate(cls) -> PoolSecrets:
        return cls(secrets.token_urlsafe(24), f"semantic-{secrets.token_hex(8)}", secrets.token_urlsafe(32))


def pool_secrets(path: Path) -> PoolSecrets:
    """The secrets kept in ``path``, made (random) and written 0600 on first use."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read(path)
    made = PoolSecrets.generate()
    with os.fdopen(descriptor, "w") as out:
        json.dump(asdict(made), out)
        out.flush()
        os.fsync(out.fileno())
    return made


def _read(path: Path) -> PoolSecrets:
    if path.stat().st_mode & 0o077:
        log.warning("%s was readable by others; it is now readable by its owner only", path)
        path.chmod(0o600)
    try:
        values = json.loads(path.read_text())
        return PoolSecrets(**{f.name: str(values[f.name]) for f in fields(PoolSecrets)})
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is not a pool's secrets file ({exc}); restore it, or remove it together with "
                          "the pool's database cluster and S3 directory") from None
