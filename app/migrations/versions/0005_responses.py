"""responses: stored Responses API responses; conversations.thread: the client's thread a conversation is

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("conversations") as batch:
        batch.add_column(sa.Column("thread", sa.String(300), nullable=True))
    op.create_table(
        "responses",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("agent_id", sa.String(128), nullable=False),
        sa.Column("conversation_id", sa.String(64), nullable=False),
        sa.Column("request_id", sa.String(64), nullable=True),
        sa.Column("previous_response_id", sa.String(64), nullable=True),
        sa.Column("n_messages", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("model", sa.String(256), nullable=True),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["agent_id"], ["agents.id"], name="fk_responses_agent_id_agents", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["conversation_id"], ["conversations.id"],
                                name="fk_responses_conversation_id_conversations", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["request_id"], ["requests.id"], name="fk_responses_request_id_requests",
                                ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name="pk_responses"),
    )
    for column in ("agent_id", "conversation_id", "request_id", "created_at"):
        op.create_index(f"ix_responses_{column}", "responses", [column])


def downgrade() -> None:
    for column in ("created_at", "request_id", "conversation_id", "agent_id"):
        op.drop_index(f"ix_responses_{column}", "responses")
    op.drop_table("responses")
    with op.batch_alter_table("conversations") as batch:
        batch.drop_column("thread")
