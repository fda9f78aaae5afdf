"""record checksums: a conversation's record file is verified against the index, as blocks are

``caches.record_checksum`` holds the sha256 of the record file (tokens, text, char ends and
the private tail's KV) that ``record_path`` names, written in the transaction that points
the row at the file. A record read back (from this disk or from a pool's shared tier) must
match it: a file rewritten with its own checksum recomputed is refused. Rows from before
this revision have none (NULL): their record files are checked against their own checksum
alone, as before, until the conversation's next turn writes a new record.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("caches", sa.Column("record_checksum", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("caches") as batch:
        batch.drop_column("record_checksum")
