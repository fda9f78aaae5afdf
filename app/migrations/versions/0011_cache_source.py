"""cache source: where each request's reused prefix was read from

``requests.cache_source`` is the provenance the ``x-semantic-cache`` header gives
(``app.types.CacheSource``): ``memory``, ``disk``, ``tier`` (a pool's shared tier) or
``none``; with ``reuse_reason`` and ``n_cached_tokens`` it says where a turn's cache came
from. Rows from before this revision have none (NULL).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# The views over ``requests`` as 0007 left them: SQLite checks them when a batch rebuild
# renames tables, so the downgrade drops them around its rebuild and makes them again.
VIEWS: dict[str, str] = importlib.import_module("app.migrations.versions.0007_one_vocabulary").VIEWS


def upgrade() -> None:
    op.add_column("requests", sa.Column("cache_source", sa.String(16), nullable=True))


def downgrade() -> None:
    for view in VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {view}")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("cache_source")
    for view, body in VIEWS.items():
        op.execute(f"CREATE VIEW {view} AS {body}")
