"""The background loop that keeps the store in step with Ray and the job folders.

Each pass (every ``reconcile_interval_s``, or at once when woken by a submit):

1. poll Ray for every pending/running run of every kind (one poller): a job's new
   status, and on its end its logs are saved to ``<data>/logs/<job id>.log``
   (services/controller/job_files.py: the controller's own folder, never the job's; a
   stopped driver's stack dumps left out) and, for a failure, its cause (one line,
   services/controller/job_logs.py) and the last log lines stored; a session ready, ended
   or failed as its server or Ray says (session_rows.py ``poll_session``);
2. find the Ray submission of jobs that registered themselves (``ray job submit``);
3. start queued runs, one first-come-first-served queue over every kind (a job while
   fewer than ``max_running_jobs`` run), when the cluster has room for their whole
   placement group (one that waits says so: in its events, and in its API answer);
4. back-fill metrics from each job's ``metrics.jsonl`` (the source of truth), so steps
   the driver could not send while the controller was down still arrive.

The calls block (Ray's HTTP client, SQLite), so a pass runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import time
from pathlib import Path

from services.config.job import JobConfig
from services.controller.capacity import Capacity
from services.controller.job_env import run_env
from services.controller.job_files import Escapes, append_job_file, open_job_file, save_own_log
from services.controller.job_logs import driver_failure, failure_cause, without_stop_dumps
from services.controller.ray_jobs import BackendUnavailable, JobBackend, RayJobInfo
from services.controller.run_states import JOB_KINDS, QUEUED
from services.controller.session_rows import (
    poll_session,
    save_before_the_head_stops,
    start_queued,
)
from services.controller.settings import Settings
from services.controller.store import MetricTriple, Store, clean_metrics
from services.controller.tables import ACTIVE, TERMINAL, Run
from services.driver.run_dir import EVENTS_FILE, JOB_CONFIG_FILE, METRICS_FILE, event_line
from services.runtime.placement import AUTOSCALING_ENV, job_needs, never_fits

log = logging.getLogger("tally.controller")
TAIL_LINES = 40


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


class Reconciler:
    def __init__(self, store: Store, backend: JobBackend, settings: Settings) -> None:
        self.store, self.backend, self.settings = store, backend, settings
        self.offsets: dict[str, int] = {}
        self.needs_cache: dict[str, dict[str, float]] = {}
        self.waiting: dict[str, str] = {}
        """The last 'waiting for resources' message per queued run (its API shows it)."""
        self.errors = 0
        self.backfilled = 0
        self.wake = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None

    def poke(self) -> None:
        """Run a pass soon (callable from any thread)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.wake.set)

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        while True:
            try:
                await asyncio.to_thread(self.tick)
            except Exception:  # keep the loop alive; the next pass retries
                self.errors += 1
                log.exception("reconcile pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.settings.reconcile_interval_s)
            self.wake.clear()

    def tick(self) -> None:
        self.find_registered()
        self.poll_ray()
        self.submit_queued()
        for job in self.store.jobs_with_status(ACTIVE):
            self.backfill(job)

    # ---- 1. status -----------------------------------------------------------------------

    def poll_ray(self) -> None:
        """The one poller: every run Ray runs (or whose end it has not confirmed), of
        every kind."""
        for job in self.store.runs_to_poll():
            if job.kind == "session":
                if poll_session(self.store, self.backend, self.settings, job) is None:
                    self.errors += 1
                    return
                continue
            if not job.ray_submission_id:
                continue  # registered, run outside our Ray: its driver reports
            try:
                info = self.backend.info(job.ray_submission_id)
            except BackendUnavailable:
                self.errors += 1
                return
            if info is None:
                self.lost(job)
            elif info.status in TERMINAL:
                self.finalize(job, info)
            elif info.status != job.status and job.status in ACTIVE:
                self.store.transition(job.id, info.status, ray_job_id=info.ray_job_id)

    def lost(self, job: Run) -> None:
        if job.status in ACTIVE:
            self.backfill(job)
            self.store.transition(job.id, "failed", log_tail="", error=(
                "Ray has no record of this job any more (its Ray cluster was stopped or "
                "restarted); metrics up to the last step received are kept"))
        else:
            self.store.update_run(job.id, log_tail="")

    def finalize(self, job: Run, info: RayJobInfo) -> None:
        """Ray says the job ended: last metrics, logs saved (the controller's copy), status, and
        for a failure the error and the last log lines."""
        self.backfill(job)
        logs = None
        try:
            logs = self.backend.logs(job.ray_submission_id or "")
        except BackendUnavailable:
            self.errors += 1
            return  # the next pass tries again
        logs = without_stop_dumps(logs) if logs is not None else None
        if logs is not None:  # never into the job folder: a link there would be followed
            try:
                save_own_log(self.settings, job.id, logs)
            except (OSError, ValueError):
                log.warning("cannot save the logs of job %s", job.id)
        failed = info.status == "failed" or job.status == "failed"
        log_tail = tail(logs or "") if failed else ""
        said = driver_failure(self.settings, job.output_dir, since=job.created_at or 0.0)
        cause = failure_cause(logs, info.message, said) if failed else None  # one line
        if job.status in TERMINAL:  # the driver (or a cancel) got there first
            self.store.update_run(job.id, log_tail=log_tail, error=job.error or cause)
            return
        self.store.transition(job.id, info.status, error=cause, log_tail=log_tail)

    # ---- 2. registered jobs --------------------------------------------------------------

    def find_registered(self) -> None:
        """A registered job's Ray submission, from its (Ray job id, driver PID); one that
        ended without being found ran on another cluster: stop looking."""
        for job in self.store.jobs_to_map():
            try:
                submission = self.backend.find_submission(job.ray_job_id or "",
                                                          job.driver_pid or 0)
            except BackendUnavailable:
                self.errors += 1
                return
            if submission:
                self.store.update_run(job.id, ray_submission_id=submission)
            elif job.status in TERMINAL:
                self.store.update_run(job.id, log_tail="")

    # ---- 3. queue ------------------------------------------------------------------------

    def submit_queued(self) -> None:
        """Queued runs of every kind in one queue, oldest first: a job while fewer than
        ``max_running_jobs`` run, each when the cluster can hold its whole gang
        (services/controller/capacity.py); the first that waits holds the rest."""
        queued = self.store.runs_with_status((QUEUED,))
        if not queued:
            return
        slots = self.settings.max_running_jobs - len(self.running_jobs())
        try:
            usage = getattr(self.backend, "resources", lambda: None)()  # None: unknown
            capacity = Capacity(usage, self.admitted_needs())
        except BackendUnavailable:
            self.errors += 1
            return
        autoscales = bool(os.environ.get(AUTOSCALING_ENV))
        for item in queued:
            is_job = item.kind in JOB_KINDS
            if is_job and slots <= 0:
                return  # the job holds the queue until a Ray slot is free
            needs = self.needs(item)
            message = capacity.shortfall(needs)
            if message is not None and capacity.never_fits(needs) and not autoscales:
                self.refuse_never_fits(item, capacity.total)  # answered at once
                continue
            if message is not None:
                self.note_waiting(item, message)
                if capacity.never_fits(needs):
                    continue  # never blocks the queue (an autoscaling cluster may grow)
                return  # first come, first served: later jobs and sessions wait behind it
            started = (self.submit(item) if is_job
                       else start_queued(self.store, self.backend, self.settings, item))
            if not started:
                return
            self.waiting.pop(item.id, None)
            capacity.take(needs)
            slots -= is_job

    def refuse_never_fits(self, item: Run, total: dict[str, float]) -> None:
        """Fail a queued run (a session: the cluster shrank) larger than the whole
        cluster, saying what it needs, what the cluster has in all and the fields to lower
        (the driver's own rule, services/placement.never_fits, over the cluster's total)."""
        stored = self.store.get_run(item.id)
        try:
            config = JobConfig.model_validate_json(stored.config_resolved if stored else "")
        except ValueError:
            return
        why = never_fits(config, [total]) or "the job can never fit this Ray cluster"
        self.store.transition(item.id, "failed", log_tail="", error=why)

    def running_jobs(self) -> list[Run]:
        """The jobs this controller submitted that Ray runs (or is about to)."""
        return [j for j in self.store.jobs_with_status(ACTIVE) if j.source == "controller"]

    def admitted_needs(self) -> list[dict[str, float]]:
        """What the running jobs and the live training sessions hold (or are about to):
        what a queued run must fit beside."""
        return [self.needs(run) for run in self.store.runs_with_status(ACTIVE)
                if run.kind == "session" or run.source == "controller"]

    def needs(self, job: Run) -> dict[str, float]:
        """The resources of a run's whole placement group (cached; {} if unreadable)."""
        if job.id not in self.needs_cache:
            stored = self.store.get_run(job.id)
            try:
                config = JobConfig.model_validate_json(stored.config_resolved if stored else "")
                self.needs_cache[job.id] = job_needs(config)
            except ValueError:
                self.needs_cache[job.id] = {}
        return self.needs_cache[job.id]

    def note_waiting(self, job: Run, message: str) -> None:
        """A ``waiting`` event in the run's folder (where the driver writes its own), once
        per distinct message, and the message kept here (the API answers show it)."""
        if self.waiting.get(job.id) == message:
            return
        self.waiting[job.id] = message
        if job.kind == "session":
            return  # its folder is the session server's own (it writes no events)
        with contextlib.suppress(OSError):  # as run_dir.write_event, but never via a link
            append_job_file(self.settings, job.output_dir, EVENTS_FILE,
                            event_line("waiting", message))

    def submit(self, job: Run) -> bool:
        """Submit one queued job to Ray; False when Ray is unreachable (retry later)."""
        config_file = Path(job.output_dir) / JOB_CONFIG_FILE
        if not config_file.is_file():
            self.store.transition(job.id, "failed", error=f"{config_file} is missing")
            return True
        submission_id = job.ray_submission_id or f"tally-{job.id}"
        self.store.update_run(job.id, ray_submission_id=submission_id)
        python = shlex.quote(self.settings.python)
        entrypoint = (f"{python} -m services.train {shlex.quote(str(config_file))} "
                      f"--output-dir {shlex.quote(job.output_dir)}")
        try:
            self.backend.submit(submission_id, entrypoint, run_env(self.settings, job),
                                {"tally_job_id": job.id, "name": job.name})
        except BackendUnavailable:
            self.errors += 1
            return False
        except RuntimeError as err:
            if "already exists" not in str(err):
                self.store.transition(job.id, "failed", error=f"Ray refused the job: {err}")
                return True
        job_now = self.store.transition(job.id, "pending")
        if job_now is not None and job_now.status == "cancelled":  # cancelled meanwhile
            self.backend.stop(submission_id)
        return True

    # ---- 4. back-fill --------------------------------------------------------------------

    def backfill(self, job: Run) -> int:
        """Insert the rows of ``metrics.jsonl`` the store does not hold yet."""
        try:  # outside the allowed roots (a registered job's folder): None, never read
            descriptor = open_job_file(self.settings, job.output_dir, METRICS_FILE)
        except Escapes as err:  # a link: never followed
            log.warning("job %s: %s", job.id, err)
            return 0
        if descriptor is None:
            return 0
        with os.fdopen(descriptor, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            offset = self.offsets.get(job.id, 0)
            if size < offset:  # rewritten (a resume truncates it): read again
                offset = 0
            if size == offset:
                return 0
            file.seek(offset)
            data = file.read(size - offset)
        complete = data[:data.rfind(b"\n") + 1]
        self.offsets[job.id] = offset + len(complete)
        rows: list[MetricTriple] = []
        for line in complete.decode("utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
                step = int(row["step"])
                if 0 <= step < job.num_steps:  # as ingest: no step the job cannot have
                    rows.append((step, float(row.get("time") or time.time()),
                                 clean_metrics(row.get("metrics") or {})))
            except (ValueError, KeyError, TypeError):
                continue
        if not rows:
            return 0
        have = set(self.store.steps_between(job.id, min(r[0] for r in rows),
                                            max(r[0] for r in rows)))
        missing = [row for row in rows if row[0] not in have]
        if missing:
            self.store.add_metrics(job.id, missing)
            self.backfilled += len(missing)
        return len(missing)

    def backfill_unfinished(self) -> None:
        """At startup: every job whose last step the store may lack."""
        for job in self.store.jobs_with_status(("running", "pending", *TERMINAL)):
            if job.last_step is None or job.last_step < job.num_steps - 1:
                self.backfill(job)

    def shutdown_embedded(self) -> None:
        """The embedded head stops with the controller: its jobs end with it, its
        training sessions after saving their state."""
        save_before_the_head_stops(self.store, self.settings)
        for job in self.store.jobs_with_status(ACTIVE):
            if job.source == "controller":
                self.backfill(job)
                self.store.transition(job.id, "failed", log_tail="", error=(
                    "the controller stopped, and with it the Ray head it had started"))
