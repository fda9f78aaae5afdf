"""views over history: turns per agent, cache hit rate per agent, tokens per day

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

VIEWS = {
    "agent_turns": """
        SELECT agent_id, count(*) AS turns, sum(n_input_tokens) AS input_tokens,
               sum(n_output_tokens) AS output_tokens, min(created_at) AS first_turn_at,
               max(created_at) AS last_turn_at
        FROM requests WHERE status = 'ok' AND agent_id IS NOT NULL GROUP BY agent_id""",
    "agent_cache_hits": """
        SELECT agent_id, sum(n_cached_tokens) AS cached_tokens, sum(n_input_tokens) AS input_tokens,
               round(1.0 * sum(n_cached_tokens) / nullif(sum(n_input_tokens), 0), 4) AS hit_rate
        FROM requests WHERE status = 'ok' AND agent_id IS NOT NULL GROUP BY agent_id""",
    "tokens_per_day": """
        SELECT date(created_at) AS day, count(*) AS requests, sum(n_input_tokens) AS input_tokens,
               sum(n_cached_tokens) AS cached_tokens, sum(n_output_tokens) AS output_tokens
        FROM requests WHERE status = 'ok' GROUP BY date(created_at)""",
}


def upgrade() -> None:
    for name, body in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {body}")


def downgrade() -> None:
    for name in VIEWS:
        op.execute(f"DROP VIEW {name}")
