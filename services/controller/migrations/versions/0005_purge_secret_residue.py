"""secret residue purged: what 0004 dropped is gone from the file and its WAL too

0004 dropped ``sessions.secret`` with ``secure_delete`` on, but the old rows stayed in the
write-ahead log (``controller.db-wal``) until a checkpoint, and a database migrated
before that revision may still hold them in free pages. The purge itself (a WAL
checkpoint, ``VACUUM``, and another checkpoint that truncates the WAL) cannot run inside
a transaction: Store.migrate runs it after the upgrade whenever a database that existed
before this revision is upgraded past it (services/controller/store.py ``purge``). This
revision only marks that it happened; it changes no table.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-10
"""

from __future__ import annotations

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

PURGED_AT = revision
"""Store.migrate purges a database whose revision before the upgrade was older."""


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
