"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('agents',
    sa.Column('id', sa.String(length=128), nullable=False),
    sa.Column('origin', sa.String(length=16), nullable=False),
    sa.Column('parent_id', sa.String(length=128), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('last_access_at', sa.DateTime(), nullable=False),
    sa.Column('ttl_seconds', sa.Integer(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('metadata_json', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['parent_id'], ['agents.id'], name=op.f('fk_agents_parent_id_agents'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_agents'))
    )
    with op.batch_alter_table('agents', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_agents_last_access_at'), ['last_access_at'], unique=False)

    op.create_table('blocks',
    sa.Column('hash', sa.String(length=64), nullable=False),
    sa.Column('model_fingerprint', sa.String(length=64), nullable=False),
    sa.Column('parent_hash', sa.String(length=64), nullable=True),
    sa.Column('n_tokens', sa.Integer(), nullable=False),
    sa.Column('path', sa.String(), nullable=True),
    sa.Column('nbytes', sa.Integer(), nullable=False),
    sa.Column('checksum', sa.String(length=64), nullable=True),
    sa.Column('ref_count', sa.Integer(), nullable=False),
    sa.Column('tier', sa.String(length=8), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('last_access_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('hash', name=op.f('pk_blocks'))
    )
    with op.batch_alter_table('blocks', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_blocks_last_access_at'), ['last_access_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_blocks_model_fingerprint'), ['model_fingerprint'], unique=False)

    op.create_table('job_runs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('name', sa.String(length=32), nullable=False),
    sa.Column('started_at', sa.DateTime(), nullable=False),
    sa.Column('finished_at', sa.DateTime(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('result', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_runs'))
    )
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_job_runs_name'), ['name'], unique=False)

    op.create_table('caches',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('agent_id', sa.String(length=128), nullable=False),
    sa.Column('model_fingerprint', sa.String(length=64), nullable=False),
    sa.Column('n_tokens', sa.Integer(), nullable=False),
    sa.Column('tier', sa.String(length=8), nullable=False),
    sa.Column('record_path', sa.String(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('updated_at', sa.DateTime(), nullable=False),
    sa.Column('last_access_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['agent_id'], ['agents.id'], name=op.f('fk_caches_agent_id_agents'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_caches')),
    sa.UniqueConstraint('agent_id', 'model_fingerprint', name=op.f('uq_caches_agent_id_model_fingerprint'))
    )
    with op.batch_alter_table('caches', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_caches_last_access_at'), ['last_access_at'], unique=False)

    op.create_table('requests',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('agent_id', sa.String(length=128), nullable=True),
    sa.Column('protocol', sa.String(length=16), nullable=False),
    sa.Column('model', sa.String(length=256), nullable=True),
    sa.Column('served_model', sa.String(length=256), nullable=True),
    sa.Column('stream', sa.Boolean(), nullable=False),
    sa.Column('n_input_tokens', sa.Integer(), nullable=True),
    sa.Column('n_cached_tokens', sa.Integer(), nullable=True),
    sa.Column('n_output_tokens', sa.Integer(), nullable=True),
    sa.Column('match_outcome', sa.String(length=16), nullable=True),
    sa.Column('ttft_ms', sa.Double(), nullable=True),
    sa.Column('total_ms', sa.Double(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('stop_reason', sa.String(length=32), nullable=True),
    sa.Column('error_type', sa.String(length=64), nullable=True),
    sa.Column('error_message', sa.String(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('finished_at', sa.DateTime(), nullable=True),
    sa.ForeignKeyConstraint(['agent_id'], ['agents.id'], name=op.f('fk_requests_agent_id_agents'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_requests'))
    )
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_requests_agent_id'), ['agent_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_requests_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_requests_status'), ['status'], unique=False)

    op.create_table('cache_blocks',
    sa.Column('cache_id', sa.Integer(), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('block_hash', sa.String(length=64), nullable=False),
    sa.ForeignKeyConstraint(['block_hash'], ['blocks.hash'], name=op.f('fk_cache_blocks_block_hash_blocks')),
    sa.ForeignKeyConstraint(['cache_id'], ['caches.id'], name=op.f('fk_cache_blocks_cache_id_caches'),
                            ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('cache_id', 'position', name=op.f('pk_cache_blocks'))
    )
    with op.batch_alter_table('cache_blocks', schema=None) as batch_op:
        batch_op.create_index('ix_cache_blocks_block_hash', ['block_hash'], unique=False)

    op.create_table('messages',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('agent_id', sa.String(length=128), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('content', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('n_tokens', sa.Integer(), nullable=True),
    sa.Column('request_id', sa.String(length=64), nullable=True),
    sa.ForeignKeyConstraint(['agent_id'], ['agents.id'], name=op.f('fk_messages_agent_id_agents'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['request_id'], ['requests.id'], name=op.f('fk_messages_request_id_requests'),
                            ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_messages')),
    sa.UniqueConstraint('agent_id', 'position', name=op.f('uq_messages_agent_id_position'))
    )
    with op.batch_alter_table('messages', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_messages_request_id'), ['request_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('messages', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_messages_request_id'))

    op.drop_table('messages')
    with op.batch_alter_table('cache_blocks', schema=None) as batch_op:
        batch_op.drop_index('ix_cache_blocks_block_hash')

    op.drop_table('cache_blocks')
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_requests_status'))
        batch_op.drop_index(batch_op.f('ix_requests_created_at'))
        batch_op.drop_index(batch_op.f('ix_requests_agent_id'))

    op.drop_table('requests')
    with op.batch_alter_table('caches', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_caches_last_access_at'))

    op.drop_table('caches')
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_job_runs_name'))

    op.drop_table('job_runs')
    with op.batch_alter_table('blocks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_blocks_model_fingerprint'))
        batch_op.drop_index(batch_op.f('ix_blocks_last_access_at'))

    op.drop_table('blocks')
    with op.batch_alter_table('agents', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_agents_last_access_at'))

    op.drop_table('agents')
