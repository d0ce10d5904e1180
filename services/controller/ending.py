"""A submitted job's end is Ray's to say.

A job the controller submitted runs as a Ray job, so Ray's job status is the truth about
whether it still runs. An end reported through ``POST /api/jobs/{id}/status`` (by its
driver, or by anyone while no API token is set) that Ray contradicts is refused: the
reconcile loop records the end when Ray's job ends (services/controller/reconcile.py).
A cancel stops a Ray job that still runs, whatever the store says of it.
"""

from __future__ import annotations

from services.controller.ray_jobs import JobBackend
from services.controller.tables import ACTIVE, TERMINAL, Run


def contradicted_end(backend: JobBackend, job: Run, status: str) -> str | None:
    """Why ``status`` (an end) cannot be recorded for ``job`` now, or None when nothing
    contradicts it; raises BackendUnavailable when Ray cannot be asked."""
    if job.source != "controller" or job.status in TERMINAL:
        return None  # started elsewhere (its driver's word is all there is), or ended
    if job.status == "queued":
        return f"job {job.id} is queued: Ray has not started it (cancel it to drop it)"
    if not job.ray_submission_id:
        return None
    info = backend.info(job.ray_submission_id)
    if info is None or info.status == status:
        return None  # Ray has no record to contradict it, or agrees
    if info.status in ACTIVE:
        return (f"Ray reports job {job.id} {info.status} (Ray job {job.ray_submission_id}): "
                "its end is recorded when the Ray job ends; cancel the job to stop it")
    return f"Ray reports job {job.id} {info.status}, not {status}"


def stop_in_ray(backend: JobBackend, job: Run) -> bool:
    """Stop the job's Ray job unless Ray already confirmed its end (``log_tail`` is set
    then); True when Ray was running it. Raises BackendUnavailable."""
    if not job.ray_submission_id or (job.status in TERMINAL and job.log_tail is not None):
        return False
    return backend.stop(job.ray_submission_id)
