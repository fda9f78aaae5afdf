"""A local pool's stores ask for secrets of their own (issue 35, item 8): its PostgreSQL
refuses a connection without the password (TCP and unix socket alike; before: ``initdb -A
trust`` let every local user in), its S3 tier refuses the keys once fixed in the source,
and the secrets are random per pool, kept 0600 and the same across restarts.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import boto3
import botocore.exceptions
import psycopg
import pytest

from app.errors import ConfigError
from app.pool.postgres import SUPERUSER
from app.pool.secrets import pool_secrets
from app.pool.seaweed import BUCKET, LocalS3, stop
from support.servers import free_port, free_ports

OLD_FIXED_KEYS = ("semantic", "semantic-local-pool")


def test_a_pools_secrets_are_random_kept_0600_and_stable(tmp_path: Path) -> None:
    first = pool_secrets(tmp_path / "a.json")
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o600
    assert pool_secrets(tmp_path / "a.json") == first
    other = pool_secrets(tmp_path / "b.json")
    assert {first.postgres_password, first.s3_secret_key}.isdisjoint({other.postgres_password, other.s3_secret_key})
    assert (first.s3_access_key, first.s3_secret_key) != OLD_FIXED_KEYS


def test_a_damaged_secrets_file_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "secrets.json"
    path.write_text(json.dumps({"postgres_password": "x"}))
    with pytest.raises(ConfigError, match="secrets"):
        pool_secrets(path)
    assert json.loads(path.read_text()) == {"postgres_password": "x"}  # never replaced: the cluster needs it


def test_the_pools_postgres_asks_every_connection_for_the_password(postgres) -> None:  # type: ignore[no-untyped-def]
    for where in ("127.0.0.1", str(postgres.root)):  # TCP, then the unix socket
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(host=where, port=postgres.port, user=SUPERUSER, dbname="postgres", connect_timeout=5)
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(host=where, port=postgres.port, user=SUPERUSER, password="guessed", dbname="postgres",
                            connect_timeout=5)
    with psycopg.connect(host="127.0.0.1", port=postgres.port, user=SUPERUSER, password=postgres.password,
                         dbname="postgres", connect_timeout=5) as connection:
        assert connection.execute("select 1").fetchone() == (1,)


def test_the_pools_s3_refuses_the_keys_once_fixed_in_the_source(tmp_path: Path) -> None:
    keys = pool_secrets(tmp_path / "secrets.json")
    s3 = LocalS3(tmp_path / "s3", free_ports(LocalS3.N_PORTS), keys.s3_access_key, keys.s3_secret_key)
    weed = s3.start(tmp_path / "s3.log")
    try:
        def client(access: str, secret: str):  # type: ignore[no-untyped-def]
            return boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=access,
                                aws_secret_access_key=secret, region_name="us-east-1")

        with pytest.raises(botocore.exceptions.ClientError):
            client(*OLD_FIXED_KEYS).put_object(Bucket=BUCKET, Key="probe", Body=b"x")
        client(keys.s3_access_key, keys.s3_secret_key).put_object(Bucket=BUCKET, Key="probe", Body=b"x")
    finally:
        stop(weed)


def test_a_cluster_made_before_pools_had_secrets_asks_for_the_password_once_started() -> None:
    """A pool's cluster made with ``initdb -A trust`` (before item 8) is closed at its next
    start: the superuser gets the pool's password, every line of pg_hba.conf asks for it, and
    a connection without it is refused (before: it stayed open to every local user)."""
    import tempfile

    from app.pool.postgres import LocalPostgres, _bindir

    root = Path(tempfile.mkdtemp(prefix="semantic-pg-old-"))
    root.chmod(0o755)  # as root the cluster belongs to the postgres user, who must reach it
    old = LocalPostgres(root / "pg", free_port(), password="not-set-then")
    old.root.mkdir()
    if os.geteuid() == 0:
        shutil.chown(old.root, "postgres", "postgres")
    old._run(str(_bindir() / "initdb"), "-D", str(old.data), "-A", "trust", "-U", SUPERUSER, "-E", "UTF8",
             "--no-instructions", "--no-sync")
    with_secret = LocalPostgres(old.root, old.port, password="the-pools-own")
    with_secret.start(durable=False)
    try:
        assert "trust" not in [line.split()[-1] for line in (old.data / "pg_hba.conf").read_text().splitlines()
                               if line.strip() and not line.startswith("#")]
        for where in ("127.0.0.1", str(old.root)):
            with pytest.raises(psycopg.OperationalError, match="password"):
                psycopg.connect(host=where, port=old.port, user=SUPERUSER, password="guessed", dbname="postgres",
                                connect_timeout=5)
            with psycopg.connect(host=where, port=old.port, user=SUPERUSER, password="the-pools-own",
                                 dbname="postgres", connect_timeout=5) as connection:
                assert connection.execute("select 1").fetchone() == (1,)
        with_secret.stop()
        with_secret.start(durable=False)  # started again: nothing left to close, the password holds
        psycopg.connect(host="127.0.0.1", port=old.port, user=SUPERUSER, password="the-pools-own",
                        dbname="postgres", connect_timeout=5).close()
    finally:
        with_secret.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)
