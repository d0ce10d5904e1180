"""runs: jobs and training sessions in one table, ``kind`` saying which

``jobs`` is renamed ``runs`` (its rows, ids and metrics kept: the metrics' foreign key
follows the rename) and gains ``kind`` and a session's columns; every ``sessions`` row
moves into it as ``kind = 'session'`` with the same id, its status in the one state
machine's words (services/controller/run_states.py: starting -> pending, ready -> running,
ended -> succeeded), and ``sessions`` is dropped. A session still queued from before this
revision kept its launch parameters in a file of its folder, which the controller no
longer reads (a Ray pod may write there): it starts with the controller's idle timeout
and advertised address.

The downgrade moves the session rows back into a ``sessions`` table of revision 0005 and
renames ``runs`` to ``jobs`` again. Columns are added and dropped by ALTER TABLE, never by
a batch copy of the table: dropping the old copy would delete its metrics (ON DELETE
CASCADE).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

SESSION_COLUMNS = {"model": sa.Text, "world_size": sa.Integer, "step": sa.Integer,
                   "tokens": sa.Integer, "loss": sa.Float, "pending_calls": sa.Integer,
                   "saved_path": sa.Text, "idle_timeout_s": sa.Float, "advertise_host": sa.Text}
"""A session's columns of ``runs`` (nullable: null for the other kinds)."""
TO_RUN = ("CASE status WHEN 'starting' THEN 'pending' WHEN 'ready' THEN 'running' "
          "WHEN 'ended' THEN 'succeeded' ELSE status END")
TO_SESSION = ("CASE status WHEN 'pending' THEN 'starting' WHEN 'running' THEN 'ready' "
              "WHEN 'succeeded' THEN 'ended' WHEN 'cancelled' THEN 'ended' ELSE status END")
ENDED = "status IN ('ended', 'failed')"


def upgrade() -> None:
    op.rename_table("jobs", "runs")
    op.add_column("runs", sa.Column("kind", sa.String(16), nullable=False,
                                    server_default="job"))
    for name, kind in SESSION_COLUMNS.items():
        op.add_column("runs", sa.Column(name, kind(), nullable=True))
    op.create_index("ix_runs_kind", "runs", ["kind"])
    op.execute(
        "INSERT INTO runs (id, kind, name, status, mode, source, config_submitted, "
        "overrides, config_resolved, output_dir, ray_submission_id, num_steps, error, "
        "log_tail, created_at, finished_at, updated_at, model, world_size, step, tokens, "
        "loss, pending_calls, saved_path) "
        f"SELECT id, 'session', 'session', {TO_RUN}, '', 'controller', config_submitted, "
        "'[]', config_resolved, output_dir, ray_submission_id, 0, error, "
        f"CASE WHEN {ENDED} THEN '' END, created_at, "
        f"CASE WHEN {ENDED} THEN updated_at END, updated_at, model, world_size, step, "
        "tokens, loss, pending_calls, saved_path FROM sessions")
    op.drop_index("ix_sessions_status", "sessions")
    op.drop_table("sessions")


def downgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("config_submitted", sa.Text(), nullable=False),
        sa.Column("config_resolved", sa.Text(), nullable=False),
        sa.Column("output_dir", sa.Text(), nullable=False),
        sa.Column("ray_submission_id", sa.String(128), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("pending_calls", sa.Integer(), nullable=False),
        sa.Column("saved_path", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_sessions_status", "sessions", ["status"])
    op.execute(
        "INSERT INTO sessions (id, status, model, world_size, config_submitted, "
        "config_resolved, output_dir, ray_submission_id, step, tokens, loss, "
        "pending_calls, saved_path, error, created_at, updated_at) "
        f"SELECT id, {TO_SESSION}, COALESCE(model, ''), COALESCE(world_size, 1), "
        "config_submitted, config_resolved, output_dir, COALESCE(ray_submission_id, ''), "
        "COALESCE(step, 0), COALESCE(tokens, 0), loss, COALESCE(pending_calls, 0), "
        "saved_path, error, created_at, updated_at FROM runs WHERE kind = 'session'")
    op.execute("DELETE FROM runs WHERE kind = 'session'")
    op.drop_index("ix_runs_kind", "runs")
    for name in (*SESSION_COLUMNS, "kind"):
        op.drop_column("runs", name)
    op.rename_table("runs", "jobs")
