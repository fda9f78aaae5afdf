"""A PostgreSQL cluster of its own, in a directory: the shared store of a local pool.

``initdb`` refuses to run as root, so as root the cluster belongs to the ``postgres``
user (Debian's packages create it) and its commands run through ``runuser``. The
cluster listens on loopback (or on the one address it is given: a database host of a pool
over several machines, reached from the hosts of its own subnets) and on a unix socket in
its own directory, and asks
every connection, local users' too, for the superuser's password (scram-sha-256); a
cluster made before pools had secrets (``trust``) is closed the same way at its next start.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from app.errors import ConfigError

SUPERUSER = "semantic"

log = logging.getLogger(__name__)


def _bindir() -> Path:
    """Where ``initdb`` and ``pg_ctl`` are: ``pg_config --bindir``, else the PATH."""
    pg_config = shutil.which("pg_config")
    if pg_config:
        bindir = Path(subprocess.check_output([pg_config, "--bindir"], text=True).strip())
        if (bindir / "initdb").exists():
            return bindir
    initdb = shutil.which("initdb")
    if initdb is None:
        raise ConfigError("PostgreSQL is not installed (initdb not found): apt-get install postgresql, "
                          "or set SEMANTIC_DATABASE_URL to an existing server")
    return Path(initdb).parent


_METHODS = frozenset({"trust", "reject", "scram-sha-256", "md5", "password", "gss", "sspi", "ident", "peer", "ldap",
                      "radius", "cert", "pam", "bsd"})


def _trusting(hba: Path) -> bool:
    """Whether a pg_hba.conf lets some connection in without a password."""
    return any(_trusts(line) for line in hba.read_text().splitlines())


def _trusts(line: str) -> bool:
    at = _method_at(line)
    return at is not None and line.split()[at] == "trust"


def _method_at(line: str) -> int | None:
    """Where a pg_hba.conf line's authentication method is among its fields (after the
    type, database, user and, for a host line, the address; None: a comment or blank)."""
    fields = line.split("#", 1)[0].split()
    if not fields or not fields[0].startswith(("local", "host")):
        return None
    return next((i for i in range(3, len(fields)) if fields[i] in _METHODS), None)


def _scram(line: str) -> str:
    """The line with a ``trust`` method replaced by ``scram-sha-256`` (its spacing kept)."""
    if not _trusts(line):
        return line
    at = _method_at(line)
    assert at is not None
    pieces = re.split(r"(\s+)", line)  # fields and the spaces between them, in turn
    words = [i for i, piece in enumerate(pieces) if piece and not piece.isspace()]
    pieces[words[at]] = "scram-sha-256"
    return "".join(pieces)


@dataclass(frozen=True, slots=True)
class LocalPostgres:
    """A cluster in ``root`` (``root/data``, its log and socket beside it) on ``host:port``; ``password``
    is the superuser's, set when the cluster is made (a pool keeps it: ``app.pool.secrets``).
    A ``host`` other than loopback also lets in, with the password, the hosts of the subnets
    that address is on (pg_hba.conf's ``samenet``)."""

    root: Path
    port: int
    password: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    host: str = "127.0.0.1"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "postgres.log"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{SUPERUSER}:{self.password}@{self.host}:{self.port}/{database}"

    def _run(self, *args: str) -> None:
        as_owner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run([*as_owner, *args], capture_output=True, text=True)
        if done.returncode != 0:
            output = (done.stderr or done.stdout).strip()
            raise ConfigError(f"{Path(args[0]).name} failed ({done.returncode}): {output}")

    def start(self, durable: bool = True) -> None:
        """Create the cluster on first use, then start it. ``durable=False`` (tests)
        turns off fsync: a crash of the machine may lose the cluster."""
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            self.root.chmod(0o700)
        bindir = _bindir()
        if not (self.data / "PG_VERSION").exists():
            self._initdb(bindir, durable)
        if self.host != "127.0.0.1":
            self._admit_samenet()
        options = f"-c listen_addresses={self.host} -p {self.port} -k {self.root}"
        if not durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(str(bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log_path), "-w",
                  "-o", options, "start")
        if _trusting(self.data / "pg_hba.conf"):
            self._close_trust(bindir)

    def _admit_samenet(self) -> None:
        """The hosts of this address's subnets may connect over TCP, with the password."""
        hba = self.data / "pg_hba.conf"
        line = "host    all             all             samenet                 scram-sha-256\n"
        if line not in hba.read_text():
            with hba.open("a") as out:
                out.write(line)

    def _close_trust(self, bindir: Path) -> None:
        """A cluster made before pools had secrets (``initdb -A trust``: every local user got
        in as superuser): give the superuser this cluster's password, then ask every
        connection for it (pg_hba.conf's ``trust`` becomes ``scram-sha-256``, reloaded)."""
        import psycopg
        from psycopg import sql

        log.warning("the pool's PostgreSQL (%s) let every local user in without a password; it now asks for "
                    "the pool's own (pool/secrets.json)", self.data)
        with psycopg.connect(host=str(self.root), port=self.port, user=SUPERUSER, dbname="postgres",
                             autocommit=True) as connection:
            connection.execute("SET password_encryption = 'scram-sha-256'")
            connection.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(SUPERUSER),
                                                                           sql.Literal(self.password)))
        hba = self.data / "pg_hba.conf"
        hba.write_text("".join(_scram(line) for line in hba.read_text().splitlines(keepends=True)))
        self._run(str(bindir / "pg_ctl"), "-D", str(self.data), "-w", "reload")

    def _initdb(self, bindir: Path, durable: bool) -> None:
        """Make the cluster: scram-sha-256 for every connection, the password read from a file
        (never a command line) that only the cluster's owner reads and that is gone after."""
        pwfile = self.root / ".pwfile"
        pwfile.unlink(missing_ok=True)
        with os.fdopen(os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            out.write(self.password + "\n")
        try:
            if os.geteuid() == 0:
                shutil.chown(pwfile, "postgres", "postgres")
            self._run(str(bindir / "initdb"), "-D", str(self.data), "-A", "scram-sha-256", "-U", SUPERUSER,
                      f"--pwfile={pwfile}", "-E", "UTF8", "--no-instructions", *([] if durable else ["--no-sync"]))
        finally:
            pwfile.unlink(missing_ok=True)

    def stop(self, mode: str = "fast") -> None:
        """Stop the cluster (``immediate`` skips the checkpoint, as a crash would)."""
        self._run(str(_bindir() / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def create_database(self, name: str) -> str:
        """A new, empty database; returns its URL."""
        import psycopg

        with psycopg.connect(host=self.host, port=self.port, user=SUPERUSER, password=self.password,
                             dbname="postgres", autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)
