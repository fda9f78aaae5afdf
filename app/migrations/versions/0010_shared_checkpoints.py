"""shared checkpoints: a hybrid model's recurrent state at a block boundary, kept with the block

A checkpoint of a hybrid model's recurrent state taken at a block boundary B holds for every
conversation whose first B tokens are the same, and the id of the block that ends at B names
exactly those tokens (and the model). ``blocks.checkpoint_path`` names the file holding the
state after that block (``<hash>.state.safetensors`` beside the block's file),
``checkpoint_checksum`` its sha256 (written in the transaction that points the row at the
file, verified on every read, as ``checksum`` is for the block) and ``checkpoint_nbytes``
its size (counted in the disk budget). The file goes when the block's row goes. Rows from
before this revision have none (NULL): their blocks hold no shared state.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("blocks", sa.Column("checkpoint_path", sa.String(), nullable=True))
    op.add_column("blocks", sa.Column("checkpoint_checksum", sa.String(64), nullable=True))
    op.add_column("blocks", sa.Column("checkpoint_nbytes", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("blocks") as batch:
        batch.drop_column("checkpoint_nbytes")
        batch.drop_column("checkpoint_checksum")
        batch.drop_column("checkpoint_path")
