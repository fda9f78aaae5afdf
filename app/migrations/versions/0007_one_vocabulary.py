"""one vocabulary: how cache reuse ended is requests.reuse_reason alone (match_outcome goes);
messages.n_tokens, which nothing wrote, goes

``match_outcome`` said the same as ``reuse_reason`` in fewer words (``sibling`` was
``shared``, ``off`` was ``miss``). Rows from before 0004 have only ``match_outcome``:
its value, already a word of the reason vocabulary, moves into ``reuse_reason``.
The ``cache_misses`` view loses its ``match_outcome`` column; the views over
``requests`` are dropped and made again around the table's rebuild (SQLite checks
them when a batch rebuild renames tables, PostgreSQL refuses to drop a column a view
reads). ``messages.n_tokens`` was never written (NULL, or a fork's copy of NULL).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_0004 = importlib.import_module("app.migrations.versions.0004_conversations")
OLD_VIEWS = {**_0004.history_views, **_0004.NEW_VIEWS}
VIEWS = {**OLD_VIEWS, "cache_misses": """
        SELECT id AS request_id, created_at, agent_id, conversation_id, reuse_reason,
               n_cached_tokens, n_input_tokens, n_reused_chars, diverge_offset, diverge_part,
               diverge_stored, diverge_new, round(ttft_ms) AS ttft_ms
        FROM requests WHERE status = 'ok' AND reuse_reason IS NOT NULL
          AND reuse_reason NOT IN ('extend', 'exact')"""}


def _drop_views(names: dict[str, str]) -> None:
    for name in names:
        op.execute(f"DROP VIEW IF EXISTS {name}")


def _create_views(views: dict[str, str]) -> None:
    for name, body in views.items():
        op.execute(f"CREATE VIEW {name} AS {body}")


def upgrade() -> None:
    _drop_views(OLD_VIEWS)
    op.execute("UPDATE requests SET reuse_reason = match_outcome "
               "WHERE reuse_reason IS NULL AND match_outcome IS NOT NULL")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("match_outcome")
    _create_views(VIEWS)
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("n_tokens")


def downgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("n_tokens", sa.Integer(), nullable=True))
    _drop_views(VIEWS)
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("match_outcome", sa.String(16), nullable=True))
    op.execute("UPDATE requests SET match_outcome = CASE reuse_reason WHEN 'sibling' THEN 'shared' "
               "WHEN 'off' THEN 'miss' ELSE reuse_reason END WHERE reuse_reason IS NOT NULL")
    _create_views(OLD_VIEWS)
