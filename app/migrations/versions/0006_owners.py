"""owners: which server of a pool owns an agent's live cache, with an epoch

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "owners",
        sa.Column("agent_id", sa.String(128), nullable=False),
        sa.Column("server_id", sa.String(128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("taken_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("agent_id", name="pk_owners"),
    )


def downgrade() -> None:
    op.drop_table("owners")
