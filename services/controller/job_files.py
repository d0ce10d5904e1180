"""What the controller reads from a job folder, and where it keeps its own copy of a
finished job's output.

A job folder is written by the job, and on a shared volume (KubeRay) by any Ray pod or
``ray job submit`` user of the same uid: its files may be links planted to make the
controller read its own secrets (``driver.log -> /proc/self/environ``) or write into its
own files. So every file of it is read through the one confinement rule
(rollout/confined.py), from the allowed root the folder resolves into, component by
component without following a link, and bounded (its last bytes). A link is refused
with a 409 naming the file; the linked file is neither read nor written.

The copy of a finished job's output goes to ``<data>/logs/<job id>.log``: a folder only
the controller writes (0700), the file created with O_EXCL|O_NOFOLLOW and renamed into
place, never into the job folder.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
from pathlib import Path, PurePosixPath

from fastapi import HTTPException

from rollout.confined import (
    DEFAULT_TAIL_BYTES,
    Escapes,
    create_owned,
    open_folder_inside,
    open_inside,
    read_inside,
)
from services.controller.settings import Settings

OWN_LOGS = "logs"
"""The controller's copies of finished jobs' output, under the data folder."""
JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
__all__ = ["DEFAULT_TAIL_BYTES", "Escapes", "append_job_file", "inside_root", "open_job_file",
           "own_log", "read_job_file", "read_own_log",
           "refused", "remove_job_folder", "save_own_log"]


def refused(err: Escapes) -> HTTPException:
    """The answer to a link (or a special file) in a job folder: 409 naming the file."""
    return HTTPException(409, f"{err}; the controller never reads or writes through it")


def inside_root(settings: Settings, output_dir: str | None) -> tuple[Path, PurePosixPath] | None:
    """(the allowed root, the folder relative to it) of a job folder; None for a folder
    outside every root (a registered job may name any folder: never read)."""
    if not output_dir:
        return None
    folder = Path(output_dir).expanduser().resolve()
    for root in settings.roots:
        if folder.is_relative_to(root):
            return root, PurePosixPath(folder.relative_to(root).as_posix())
    return None


def read_job_file(settings: Settings, output_dir: str | None, name: str,
                  tail: int | None = DEFAULT_TAIL_BYTES) -> bytes | None:
    """The last ``tail`` bytes (None: all) of ``<job folder>/name``, opened from its root
    without following any link; None when the folder is outside the roots or the file is
    missing or unreadable. Escapes (a link, a special file) is raised for the caller to
    refuse, naming ``name``."""
    where = inside_root(settings, output_dir)
    if where is None:
        return None
    root, folder = where
    try:
        return read_inside(root, folder / name, name, tail=tail)
    except Escapes:
        raise
    except OSError:
        return None


def own_log(settings: Settings, job_id: str) -> Path:
    """Where the controller keeps job ``job_id``'s finished output."""
    if not JOB_ID.fullmatch(job_id):  # ids are the controller's (hex); never a path
        raise ValueError(f"not a job id: {job_id!r}")
    return settings.data_dir / OWN_LOGS / f"{job_id}.log"


def save_own_log(settings: Settings, job_id: str, text: str) -> Path:
    """Write a finished job's output to :func:`own_log` (0600): a fresh file made with
    O_EXCL|O_NOFOLLOW, renamed over any older copy, so nothing is written through a link."""
    path = own_log(settings, job_id)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    with os.fdopen(create_owned(temporary), "w", encoding="utf-8") as out:
        out.write(text)
    os.replace(temporary, path)
    return path


def read_own_log(settings: Settings, job_id: str, tail: int = DEFAULT_TAIL_BYTES
                 ) -> bytes | None:
    """The last ``tail`` bytes of the controller's copy of a finished job's output."""
    path = own_log(settings, job_id)
    try:
        return read_inside(path.parent, path.name, f"{OWN_LOGS}/{path.name}", tail=tail)
    except FileNotFoundError:
        return None


def open_job_file(settings: Settings, output_dir: str | None, name: str,
                  flags: int = os.O_RDONLY) -> int | None:
    """A descriptor of ``<job folder>/name`` opened by the rule (no link followed, from
    the folder's root); None outside the roots or when missing. Escapes for a link."""
    where = inside_root(settings, output_dir)
    if where is None:
        return None
    root, folder = where
    try:
        return open_inside(root, folder / name, name, flags)
    except Escapes:
        raise
    except OSError:
        return None


def append_job_file(settings: Settings, output_dir: str | None, name: str, line: str) -> bool:
    """Append ``line`` to ``<job folder>/name`` (made 0600 if missing), never through a
    link; False when it cannot (outside the roots, a link, no folder)."""
    try:
        descriptor = open_job_file(settings, output_dir, name,
                                   os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except Escapes:
        return False
    if descriptor is None:
        return False
    with os.fdopen(descriptor, "a", encoding="utf-8") as out:
        out.write(line)
    return True


def _below_root(settings: Settings, output_dir: str) -> tuple[Path, tuple[str, ...]] | None:
    """(the allowed root, the components of the job folder below it) of ``output_dir`` as
    stored, not resolved: the first folder above it that is an allowed root, then the names
    under it as written (a link among them is met by the walk, not resolved away). None
    outside every root, or for a root itself."""
    folder = Path(os.path.abspath(Path(output_dir).expanduser()))
    roots = set(settings.roots)
    for above in reversed(folder.parents):  # from / down: the most names to check
        if above.resolve() in roots:
            parts = folder.relative_to(above).parts
            return (above.resolve(), parts) if parts else None
    return None


def remove_job_folder(settings: Settings, output_dir: str | None, remove: bool = True
                      ) -> bool:
    """Remove a job folder below an allowed root, never through a link: each folder from
    the root down is opened with O_NOFOLLOW, the job folder itself must be a real folder
    (lstat), and ``shutil.rmtree`` runs on it from its parent's descriptor (which refuses a
    link swapped in meanwhile and follows none inside). Escapes naming the link (nothing
    removed); False when outside the roots, a root itself, or missing. ``remove=False``
    only checks."""
    where = _below_root(settings, output_dir) if output_dir else None
    if where is None:
        return False
    root, parts = where
    label = str(Path(output_dir or ""))
    try:  # Escapes for a link on the way down
        directory = open_folder_inside(root, parts[:-1], label)
    except OSError:
        return False  # missing or unreadable: nothing to remove here
    try:
        try:
            mode = os.lstat(parts[-1], dir_fd=directory).st_mode
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(mode):
            _refuse_entry(directory, parts[-1], label)
            raise Escapes(f"{label}: not a folder; refused")
        if remove:
            shutil.rmtree(parts[-1], ignore_errors=True, dir_fd=directory)
        return True
    finally:
        os.close(directory)


def _refuse_entry(directory: int, part: str, label: str) -> None:
    """Escapes when ``part`` (in ``directory``) is a link or not a folder."""
    try:
        mode = os.lstat(part, dir_fd=directory).st_mode
    except OSError:
        return
    if stat.S_ISLNK(mode):
        raise Escapes(f"{label}: {part} is a symbolic link; a job folder is never removed "
                      "through a link")
    if not stat.S_ISDIR(mode):
        raise Escapes(f"{label}: {part} is not a folder; refused")
