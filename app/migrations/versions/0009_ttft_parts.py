"""ttft parts: requests.ttft_ms counts from the request's arrival, and its parts are kept

``queue_ms`` (arrival until the engine thread took the request: reading and rendering it,
waiting for a place), ``restore_ms`` (the conversation's cache brought into memory: files
from disk or a pool's tier, the working copy built) and ``prefill_ms`` (the prompt's new
tokens computed, until the first token) add up to ``ttft_ms``. Rows from before this
revision have none (NULL), and their ``ttft_ms`` counted from the lease, after the restore.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

COLUMNS = ("queue_ms", "restore_ms", "prefill_ms")
# The views over ``requests`` as 0007 left them: SQLite checks them when a batch rebuild
# renames tables, so the downgrade drops them around its rebuild and makes them again.
VIEWS: dict[str, str] = importlib.import_module("app.migrations.versions.0007_one_vocabulary").VIEWS


def upgrade() -> None:
    for name in COLUMNS:
        op.add_column("requests", sa.Column(name, sa.Double(), nullable=True))


def downgrade() -> None:
    for view in VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {view}")
    with op.batch_alter_table("requests") as batch:
        for name in COLUMNS:
            batch.drop_column(name)
    for view, body in VIEWS.items():
        op.execute(f"CREATE VIEW {view} AS {body}")
