"""The controller's store: SQLAlchemy 2 over SQLite by default (WAL) or any SQL URL.

Every function opens its own short transaction, so the API threads and the reconcile loop
share one Store safely. One table holds the runs of every kind (jobs, training sessions;
``Run.kind``): the ``*job*`` methods see the kinds the jobs routes show, the ``*session*``
ones the sessions, the ``*run*`` ones every kind. Status changes of every kind go through
:meth:`Store.advance` (the one state machine, services/controller/run_states.py), which
never moves a run back or out of a terminal status (only :meth:`Store.overrule_end`
corrects an end Ray contradicts): each is one conditional UPDATE whose row count says
whether it won.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from sqlalchemy import and_, create_engine, delete, event, func, insert, or_, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, defer, sessionmaker

from services.controller.run_states import earlier
from services.controller.tables import ACTIVE, JOB_KINDS, TERMINAL, MetricRow, Run, Sweep

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
PURGE_REVISION = "0005"
"""A database older than this may hold dropped session secrets: purged once upgraded
(migrations/versions/0005_purge_secret_residue.py)."""

LIGHT = (defer(Run.config_submitted), defer(Run.config_resolved), defer(Run.overrides))
"""Loader options that leave a job's (large) configs in the database."""
IS_JOB = Run.kind.in_(JOB_KINDS)
"""The runs the jobs routes show (a session has its own)."""
IS_SESSION = Run.kind == "session"
MetricTriple = tuple[int, float, dict[str, float | None]]
"""(step, unix time, {name: value}) of one training step."""


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        if url.startswith("sqlite:///") and not url.startswith("sqlite:///:memory:"):
            private_file(Path(url.removeprefix("sqlite:///")))
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


def private_file(path: Path) -> None:
    """``path`` (the database) made or kept 0600 in a folder it makes 0700, its WAL and
    shared-memory files 0600 (SQLite gives them the database's mode when it makes them):
    a database of tokens' metrics and configs, and once secrets, is its owner's alone."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:  # never through a link (chmod would follow one)
            descriptor = os.open(name, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue
        try:
            os.fchmod(descriptor, 0o600)
        finally:
            os.close(descriptor)


def pick_indices(count: int, max_points: int) -> list[int]:
    """At most ``max_points`` evenly spread indices of ``range(count)``, first and last kept."""
    if count <= max_points:
        return list(range(count))
    if max_points == 1:
        return [count - 1]
    return sorted({round(i * (count - 1) / (max_points - 1)) for i in range(max_points)})


def clean_metrics(metrics: dict[str, Any]) -> dict[str, float | None]:
    """Non-finite or non-numeric values become null (as in metrics.jsonl)."""
    out: dict[str, float | None] = {}
    for name, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        out[str(name)] = number if math.isfinite(number) else None
    return out


class Store:
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.version = 0
        """Bumped after every write: readers may cache what they built from a version."""

    @contextlib.contextmanager
    def _write(self) -> Iterator[Session]:
        """One write transaction; the version bumped after it."""
        try:
            with self.sessions.begin() as session:
                yield session
        finally:
            self.version += 1

    def migrate(self) -> None:
        """Alembic ``upgrade head`` on this database; one that held session secrets
        (revision before PURGE_REVISION) is then purged of their residue."""
        cfg = AlembicConfig()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        cfg.set_main_option("sqlalchemy.url", self.url.replace("%", "%%"))
        with self.engine.begin() as connection:
            before = MigrationContext.configure(connection).get_current_revision()
            cfg.attributes["connection"] = connection
            command.upgrade(cfg, "head")
        if before is not None and before < PURGE_REVISION:  # revisions are 0001, 0002, …
            self.purge()

    def purge(self) -> None:
        """Rewrite a SQLite database so that no deleted row survives in it or its WAL:
        checkpoint the WAL into the file, ``VACUUM`` (the file rebuilt without free
        pages), checkpoint again truncating the WAL to nothing. Outside a transaction
        (VACUUM cannot run in one); other databases: nothing to do here."""
        if self.engine.dialect.name != "sqlite":
            return
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.exec_driver_sql("VACUUM")
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        self.engine.dispose()

    def ping(self) -> bool:
        try:
            with self.engine.connect() as conn:
                conn.execute(select(1))
            return True
        except Exception:
            return False

    # ---- runs of every kind ----------------------------------------------------------------

    def add_run(self, run: Run) -> None:
        with self._write() as session:
            session.add(run)

    def get_run(self, run_id: str) -> Run | None:
        with self.sessions() as session:
            return session.get(Run, run_id)

    def runs_with_status(self, statuses: Iterable[str]) -> list[Run]:
        """Runs of every kind, oldest first, without their configs (the one queue reads
        ``queued``; what is admitted reads ACTIVE)."""
        with self.sessions() as session:
            return list(session.scalars(select(Run).options(*LIGHT)
                                        .where(Run.status.in_(list(statuses)))
                                        .order_by(Run.created_at, Run.id)))

    def runs_to_poll(self) -> list[Run]:
        """Runs of every kind that Ray runs, and ended ones whose end Ray has not
        confirmed yet (their logs are not saved: ``log_tail`` is null until then)."""
        query = select(Run).options(*LIGHT).where(or_(
            Run.status.in_(ACTIVE),
            and_(Run.status.in_(TERMINAL), Run.ray_submission_id.is_not(None),
                 Run.log_tail.is_(None))))
        with self.sessions() as session:
            return list(session.scalars(query.order_by(Run.created_at, Run.id)))

    # ---- jobs ----------------------------------------------------------------------------

    def add_jobs(self, jobs: Sequence[Run], sweep: Sweep | None = None) -> None:
        with self._write() as session:
            if sweep is not None:
                session.add(sweep)
                session.flush()
            session.add_all(jobs)

    def add_job_once(self, job: Run) -> Run:
        """Store ``job`` unless a job with its idempotency key exists; returns the stored
        one (the unique index settles two racing submits)."""
        from sqlalchemy.exc import IntegrityError

        try:
            self.add_jobs([job])
            return job
        except IntegrityError:
            with self.sessions() as session:
                first = session.scalar(select(Run).where(
                    Run.idempotency_key == job.idempotency_key))
            if first is None:
                raise
            return first

    def job_with_key(self, key: str) -> Run | None:
        with self.sessions() as session:
            return session.scalar(select(Run).where(Run.idempotency_key == key))

    def delete_job(self, job_id: str) -> bool:
        """Remove an ended job and its metric rows; False if it is not (or no longer)
        ended. One conditional DELETE, like every status change."""
        with self._write() as session:
            session.execute(delete(MetricRow).where(
                MetricRow.job_id == job_id,
                MetricRow.job_id.in_(select(Run.id).where(Run.id == job_id,
                                                          Run.status.in_(TERMINAL)))))
            result = session.execute(delete(Run).where(Run.id == job_id, IS_JOB,
                                                       Run.status.in_(TERMINAL)))
            return result.rowcount == 1

    def get_job(self, job_id: str) -> Run | None:
        """The run ``job_id`` if it is of a kind the jobs routes show."""
        run = self.get_run(job_id)
        return run if run is not None and run.kind in JOB_KINDS else None

    def list_jobs(self, *, status: Sequence[str] = (), name: str | None = None,
                  mode: str | None = None, sweep_id: str | None = None,
                  limit: int = 50, offset: int = 0) -> tuple[list[Run], int]:
        """Newest first; ``name`` matches a substring. The configs and logs are not loaded."""
        query = select(Run).options(*LIGHT, defer(Run.log_tail)).where(IS_JOB)
        if status:
            query = query.where(Run.status.in_(status))
        if name:
            query = query.where(Run.name.contains(name, autoescape=True))
        if mode:
            query = query.where(Run.mode == mode)
        if sweep_id:
            query = query.where(Run.sweep_id == sweep_id)
        with self.sessions() as session:
            total = session.scalar(query.with_only_columns(func.count(Run.id))
                                   .order_by(None)) or 0
            rows = session.scalars(query.order_by(Run.created_at.desc(), Run.id)
                                   .limit(limit).offset(offset)).all()
            return list(rows), total

    def jobs_with_status(self, statuses: Iterable[str]) -> list[Run]:
        """Without the configs (the reconcile loop never reads them)."""
        with self.sessions() as session:
            return list(session.scalars(select(Run).options(*LIGHT)
                                        .where(Run.status.in_(list(statuses)), IS_JOB)
                                        .order_by(Run.created_at, Run.id)))

    def jobs_to_poll(self) -> list[Run]:
        """:meth:`runs_to_poll` of the kinds the jobs routes show."""
        return [run for run in self.runs_to_poll() if run.kind in JOB_KINDS]

    def jobs_to_map(self) -> list[Run]:
        """Registered jobs whose Ray submission is not known yet (and might be ours)."""
        query = select(Run).options(*LIGHT).where(
            Run.source == "registered", Run.ray_submission_id.is_(None),
            Run.ray_job_id.is_not(None), Run.driver_pid.is_not(None), Run.log_tail.is_(None))
        with self.sessions() as session:
            return list(session.scalars(query))

    def output_dirs(self) -> list[str]:
        """Every run's folder (a new job's must not overlap any)."""
        with self.sessions() as session:
            return list(session.scalars(select(Run.output_dir)))

    def status_counts(self) -> dict[str, int]:
        with self.sessions() as session:
            rows = session.execute(select(Run.status, func.count()).where(IS_JOB)
                                   .group_by(Run.status))
            return {status: count for status, count in rows}

    def update_run(self, job_id: str, **values: Any) -> Run | None:
        """Set fields of a run of any kind (its status: :meth:`advance`)."""
        with self._write() as session:
            job = session.get(Run, job_id)
            if job is None:
                return None
            for key, value in values.items():
                setattr(job, key, value)
            job.updated_at = time.time()
            return job

    def transition(self, job_id: str, status: str, **values: Any) -> Run | None:
        """Move a run forward to ``status`` (with fields); a no-op if it is already there,
        further on, or ended. Returns the run as stored."""
        return self.advance(job_id, status, **values)[0]

    def advance(self, job_id: str, status: str, **values: Any) -> tuple[Run | None, bool]:
        """:meth:`transition`, and whether this call made the change. One conditional
        ``UPDATE ... WHERE id = ? AND status IN (<earlier statuses>)``: of two racing
        changes (cancel vs. succeed, cancel vs. start) exactly one wins, whole."""
        before = earlier(status)
        now = time.time()
        changes: dict[str, Any] = {**values, "status": status, "updated_at": now}
        if status == "running":
            changes["started_at"] = func.coalesce(Run.started_at, now)
        if status in TERMINAL:
            changes["finished_at"] = now
        with self._write() as session:
            result = session.execute(update(Run).where(Run.id == job_id,
                                                       Run.status.in_(before))
                                     .values(**changes).execution_options(
                                         synchronize_session=False))
            changed = result.rowcount == 1
        return self.get_run(job_id), changed

    def overrule_end(self, job_id: str, stored: str, status: str, **values: Any
                     ) -> Run | None:
        """Replace a stored end that Ray contradicts (its Ray job still ran until a cancel
        stopped it): ``stored`` -> ``status``, one conditional UPDATE like every status
        change, a no-op if the job is no longer ``stored``."""
        with self._write() as session:
            session.execute(update(Run).where(Run.id == job_id, Run.status == stored)
                            .values(**values, status=status, finished_at=time.time(),
                                    updated_at=time.time())
                            .execution_options(synchronize_session=False))
        return self.get_run(job_id)

    # ---- metrics -------------------------------------------------------------------------

    def add_metrics(self, job_id: str, rows: Sequence[MetricTriple]) -> int:
        """Insert (or replace, for a resumed job's repeated steps) rows of one job."""
        if not rows:
            return 0
        latest: dict[int, MetricTriple] = {row[0]: row for row in rows}
        with self._write() as session:
            job = session.get(Run, job_id)
            if job is None:
                raise KeyError(job_id)
            steps = sorted(latest)
            for start in range(0, len(steps), 500):
                chunk = steps[start:start + 500]
                session.execute(delete(MetricRow).where(MetricRow.job_id == job_id,
                                                        MetricRow.step.in_(chunk)))
            session.execute(insert(MetricRow), [
                {"job_id": job_id, "step": step, "time": t, "values": json.dumps(values)}
                for step, t, values in latest.values()])
            last_step, _, last_values = latest[steps[-1]]
            if job.last_step is None or last_step >= job.last_step:
                job.last_step = last_step
                job.reward_mean = last_values.get("reward/mean")
            job.updated_at = time.time()
        return len(latest)

    def read_metrics(self, job_id: str, start: int | None = None,
                     end: int | None = None) -> list[MetricTriple]:
        query = select(MetricRow.step, MetricRow.time, MetricRow.values).where(
            MetricRow.job_id == job_id)
        if start is not None:
            query = query.where(MetricRow.step >= start)
        if end is not None:
            query = query.where(MetricRow.step <= end)
        with self.sessions() as session:
            return [(step, t, json.loads(values)) for step, t, values in
                    session.execute(query.order_by(MetricRow.step))]

    def sample_metrics(self, job_id: str, max_points: int, start: int | None = None,
                       end: int | None = None) -> tuple[list[MetricTriple], int]:
        """(at most ``max_points`` rows evenly spread over the step range, first and last
        kept; how many rows the range holds). Only the step column of the range is read in
        full: the values of the rows left out never leave the database."""
        where = [MetricRow.job_id == job_id]
        if start is not None:
            where.append(MetricRow.step >= start)
        if end is not None:
            where.append(MetricRow.step <= end)
        with self.sessions() as session:
            steps = list(session.scalars(select(MetricRow.step).where(*where)
                                         .order_by(MetricRow.step)))
            picked = [steps[i] for i in pick_indices(len(steps), max_points)]
            rows: list[MetricTriple] = []
            for first in range(0, len(picked), 500):  # bounded IN lists
                chunk = picked[first:first + 500]
                rows.extend((step, t, json.loads(values)) for step, t, values in session.execute(
                    select(MetricRow.step, MetricRow.time, MetricRow.values)
                    .where(MetricRow.job_id == job_id, MetricRow.step.in_(chunk))
                    .order_by(MetricRow.step)))
        return rows, len(steps)

    def steps_between(self, job_id: str, first: int, last: int) -> list[int]:
        with self.sessions() as session:
            return list(session.scalars(select(MetricRow.step).where(
                MetricRow.job_id == job_id, MetricRow.step >= first, MetricRow.step <= last)))

    # ---- sweeps --------------------------------------------------------------------------

    def get_sweep(self, sweep_id: str) -> Sweep | None:
        with self.sessions() as session:
            return session.get(Sweep, sweep_id)

    def list_sweeps(self, limit: int = 50, offset: int = 0) -> tuple[list[Sweep], int]:
        with self.sessions() as session:
            total = session.scalar(select(func.count()).select_from(Sweep)) or 0
            rows = session.scalars(select(Sweep).order_by(Sweep.created_at.desc(), Sweep.id)
                                   .limit(limit).offset(offset)).all()
            return list(rows), total

    def sweep_jobs(self, sweep_id: str) -> list[Run]:
        with self.sessions() as session:
            return list(session.scalars(select(Run).where(Run.sweep_id == sweep_id, IS_JOB)
                                        .order_by(Run.created_at, Run.id)))

    # ---- training sessions ---------------------------------------------------------------

    def get_session(self, session_id: str) -> Run | None:
        run = self.get_run(session_id)
        return run if run is not None and run.kind == "session" else None

    def list_sessions(self, limit: int = 100) -> list[Run]:
        with self.sessions() as session:
            return list(session.scalars(select(Run).where(IS_SESSION).order_by(
                Run.created_at.desc(), Run.id).limit(limit)))

    def sessions_with_status(self, statuses: Iterable[str]) -> list[Run]:
        """Sessions in ``statuses``, oldest first."""
        with self.sessions() as session:
            return list(session.scalars(select(Run).where(
                IS_SESSION, Run.status.in_(list(statuses))).order_by(Run.created_at, Run.id)))
