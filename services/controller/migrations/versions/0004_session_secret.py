"""sessions.secret dropped: a session's secret is derived from the controller's key

The controller recomputes each session server's bearer secret as HMAC(its key, id)
(services/controller/session_secret.py); the database holds nothing to steal. A session
still live from before this revision took a secret that can no longer be recomputed: it
is marked failed, saying so (its Ray job is left as it is).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":  # the dropped bytes zeroed, not only freed
        op.execute("PRAGMA secure_delete = ON")
    op.execute(sa.text(
        "UPDATE sessions SET status = 'failed', error = :why "
        "WHERE status IN ('starting', 'ready')").bindparams(why=(
            "the controller was upgraded (its session secrets are no longer stored): "
            "this session cannot be reached; start a new one")))
    with op.batch_alter_table("sessions") as batch:
        batch.drop_column("secret")


def downgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("secret", sa.String(64), nullable=False,
                                   server_default=""))
