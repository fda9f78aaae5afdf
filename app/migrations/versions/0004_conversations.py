"""conversations: an agent holds several, each with its own history and cache; cache-miss diagnostics

Every existing agent with history or a cache gets one conversation holding
both (history kept). Messages stored before this have no digest, so a resent
old conversation is not recognised as such: its next request starts a new
conversation, which still reads the old conversation's cache as its prefix.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# Views read `requests`; SQLite checks them when a batch rebuild renames tables.
history_views = importlib.import_module("app.migrations.versions.0002_history_views").VIEWS
NEW_VIEWS = {
    "conversation_turns": """
        SELECT r.agent_id, r.conversation_id, count(*) AS turns, sum(r.n_input_tokens) AS input_tokens,
               sum(r.n_cached_tokens) AS cached_tokens, sum(r.n_output_tokens) AS output_tokens,
               round(1.0 * sum(r.n_cached_tokens) / nullif(sum(r.n_input_tokens), 0), 4) AS hit_rate,
               min(r.created_at) AS first_turn_at, max(r.created_at) AS last_turn_at
        FROM requests r WHERE r.status = 'ok' AND r.conversation_id IS NOT NULL
        GROUP BY r.agent_id, r.conversation_id""",
    "cache_misses": """
        SELECT id AS request_id, created_at, agent_id, conversation_id, match_outcome, reuse_reason,
               n_cached_tokens, n_input_tokens, n_reused_chars, diverge_offset, diverge_part,
               diverge_stored, diverge_new, round(ttft_ms) AS ttft_ms
        FROM requests WHERE status = 'ok' AND reuse_reason IS NOT NULL
          AND reuse_reason NOT IN ('extend', 'exact')""",
}


def _drop_views(names) -> None:  # type: ignore[no-untyped-def]
    for name in names:
        op.execute(f"DROP VIEW IF EXISTS {name}")


def _create_views(views: dict[str, str]) -> None:
    for name, body in views.items():
        op.execute(f"CREATE VIEW {name} AS {body}")


def upgrade() -> None:
    _drop_views(history_views)
    op.create_table(
        "conversations",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("agent_id", sa.String(128), nullable=False),
        sa.Column("system_digest", sa.String(32), nullable=True),
        sa.Column("snapshot", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("last_access_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["agent_id"], ["agents.id"], name="fk_conversations_agent_id_agents",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_conversations"),
    )
    op.create_index("ix_conversations_agent_id", "conversations", ["agent_id"])
    op.create_index("ix_conversations_last_access_at", "conversations", ["last_access_at"])
    # One conversation per agent that has history or a cache.
    random_hex = ("substr(md5(random()::text || a.id), 1, 20)" if op.get_bind().dialect.name == "postgresql"
                  else "lower(hex(randomblob(10)))")
    op.execute(f"""
        INSERT INTO conversations (id, agent_id, system_digest, created_at, last_access_at)
        SELECT 'conv_' || {random_hex}, a.id, NULL, a.created_at, a.last_access_at
        FROM agents a
        WHERE EXISTS (SELECT 1 FROM messages m WHERE m.agent_id = a.id)
           OR EXISTS (SELECT 1 FROM caches c WHERE c.agent_id = a.id)""")
    owner = "(SELECT c.id FROM conversations c WHERE c.agent_id = {table}.agent_id)"

    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("conversation_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("digest", sa.String(32), nullable=True))
    op.execute(f"UPDATE messages SET conversation_id = {owner.format(table='messages')}")
    with op.batch_alter_table("messages") as batch:
        batch.alter_column("conversation_id", existing_type=sa.String(64), nullable=False)
        batch.drop_constraint("uq_messages_agent_id_position", type_="unique")
        batch.create_unique_constraint("uq_messages_conversation_id_position", ["conversation_id", "position"])
        batch.create_foreign_key("fk_messages_conversation_id_conversations", "conversations",
                                 ["conversation_id"], ["id"], ondelete="CASCADE")
        batch.create_index("ix_messages_agent_id", ["agent_id"])
        batch.create_index("ix_messages_digest", ["digest"])

    with op.batch_alter_table("caches") as batch:
        batch.add_column(sa.Column("conversation_id", sa.String(64), nullable=True))
    op.execute(f"UPDATE caches SET conversation_id = {owner.format(table='caches')}")
    with op.batch_alter_table("caches") as batch:
        batch.alter_column("conversation_id", existing_type=sa.String(64), nullable=False)
        batch.drop_constraint("uq_caches_agent_id_model_fingerprint", type_="unique")
        batch.create_unique_constraint("uq_caches_conversation_id_model_fingerprint",
                                       ["conversation_id", "model_fingerprint"])
        batch.create_foreign_key("fk_caches_conversation_id_conversations", "conversations",
                                 ["conversation_id"], ["id"], ondelete="CASCADE")
        batch.create_index("ix_caches_agent_id", ["agent_id"])

    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("conversation_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("reuse_reason", sa.String(32), nullable=True))
        batch.add_column(sa.Column("n_reused_chars", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("diverge_offset", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("diverge_part", sa.String(64), nullable=True))
        batch.add_column(sa.Column("diverge_stored", sa.String(), nullable=True))
        batch.add_column(sa.Column("diverge_new", sa.String(), nullable=True))
        batch.create_foreign_key("fk_requests_conversation_id_conversations", "conversations",
                                 ["conversation_id"], ["id"], ondelete="SET NULL")
        batch.create_index("ix_requests_conversation_id", ["conversation_id"])
    op.execute("""
        UPDATE requests SET conversation_id = (SELECT c.id FROM conversations c WHERE c.agent_id = requests.agent_id)
        WHERE agent_id IS NOT NULL""")
    _create_views({**history_views, **NEW_VIEWS})


def downgrade() -> None:
    """Back to one history per agent: conversations are concatenated in the order they started."""
    _drop_views([*history_views, *NEW_VIEWS])
    with op.batch_alter_table("requests") as batch:
        batch.drop_index("ix_requests_conversation_id")
        batch.drop_constraint("fk_requests_conversation_id_conversations", type_="foreignkey")
        for column in ("diverge_new", "diverge_stored", "diverge_part", "diverge_offset", "n_reused_chars",
                       "reuse_reason", "conversation_id"):
            batch.drop_column(column)
    # Keep each agent's most recently used cache (the old schema holds one per agent and model;
    # a tie goes to the newest row), with the block lists of the others and the reference counts
    # they held (foreign keys are off while migrating: nothing cascades by itself).
    keep = """SELECT (SELECT c2.id FROM caches c2
                      WHERE c2.agent_id = c.agent_id AND c2.model_fingerprint = c.model_fingerprint
                      ORDER BY c2.last_access_at DESC, c2.id DESC LIMIT 1)
              FROM caches c GROUP BY c.agent_id, c.model_fingerprint"""
    op.execute(f"DELETE FROM cache_blocks WHERE cache_id NOT IN ({keep})")
    op.execute(f"DELETE FROM caches WHERE id NOT IN ({keep})")
    op.execute("UPDATE blocks SET ref_count = (SELECT count(*) FROM cache_blocks cb WHERE cb.block_hash = blocks.hash)")
    with op.batch_alter_table("caches") as batch:
        batch.drop_index("ix_caches_agent_id")
        batch.drop_constraint("fk_caches_conversation_id_conversations", type_="foreignkey")
        batch.drop_constraint("uq_caches_conversation_id_model_fingerprint", type_="unique")
        batch.create_unique_constraint("uq_caches_agent_id_model_fingerprint", ["agent_id", "model_fingerprint"])
        batch.drop_column("conversation_id")
    with op.batch_alter_table("messages") as batch:  # PostgreSQL checks it row by row while positions shift
        batch.drop_constraint("uq_messages_conversation_id_position", type_="unique")
    # Each conversation's messages follow those of the agent's earlier conversations. The
    # shift reads no position (the rows change under the statement as it runs).
    op.execute("""
        UPDATE messages SET position = position + (
            SELECT count(*) FROM messages m2 JOIN conversations c2 ON c2.id = m2.conversation_id
            JOIN conversations c ON c.id = messages.conversation_id
            WHERE m2.agent_id = messages.agent_id
              AND (c2.created_at < c.created_at OR (c2.created_at = c.created_at AND c2.id < c.id)))""")
    with op.batch_alter_table("messages") as batch:
        batch.drop_index("ix_messages_digest")
        batch.drop_index("ix_messages_agent_id")
        batch.drop_constraint("fk_messages_conversation_id_conversations", type_="foreignkey")
        batch.create_unique_constraint("uq_messages_agent_id_position", ["agent_id", "position"])
        batch.drop_column("digest")
        batch.drop_column("conversation_id")
    op.drop_index("ix_conversations_last_access_at", "conversations")
    op.drop_index("ix_conversations_agent_id", "conversations")
    op.drop_table("conversations")
    _create_views(history_views)
