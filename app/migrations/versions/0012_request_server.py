"""request server: which server ran each request

``requests.server_id`` names the server that ran the request (``effective_server_id``), so
that a server's start can mark the rows it left ``running`` (a crash, a kill, a full disk)
as ``interrupted`` without touching the requests other servers of a pool are running. Rows
from before this revision have none (NULL).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

VIEWS: dict[str, str] = importlib.import_module("app.migrations.versions.0007_one_vocabulary").VIEWS


def upgrade() -> None:
    op.add_column("requests", sa.Column("server_id", sa.String(128), nullable=True))


def downgrade() -> None:
    for view in VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {view}")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("server_id")
    for view, body in VIEWS.items():
        op.execute(f"CREATE VIEW {view} AS {body}")
