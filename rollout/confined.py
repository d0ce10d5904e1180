"""Reading a folder someone else wrote: never through a link, never out of the folder.

The one confinement rule for every folder Tally did not write in this process — a
checkpoint, an export source, an adapter, a job or session folder, a reward-model
folder. Its owner may have planted links (``driver.log -> /proc/self/environ``) or
stored paths that climb out (a DCP ``relative_path`` of ``../../other-job/…``):

- a **stored path** (in a manifest, DCP metadata, an adapter config) must be relative,
  non-empty, and have no ``..`` component: :func:`stored_path`;
- a file is opened component by component from the folder with ``O_NOFOLLOW``
  (``openat``): no component may be a symbolic link, so the file read is the one inside
  the folder whatever was swapped in between (no check-then-open race):
  :func:`open_inside`, :func:`read_inside`;
- a folder is listed without following links, and any link in it is refused, naming
  it: :func:`regular_files`, :func:`copy_regular_files`.

The folder itself is the caller's (a path the user named, or the controller's own): it
may be reached through links, its contents may not. Standard library only: ``trainer/``
and ``services/`` both import it (it is a data-format rule, like ``rollout.batch``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

DEFAULT_TAIL_BYTES = 1 << 20
"""What a bounded read of a log returns by default: its last MiB."""


class Escapes(ValueError):
    """A path that leaves its folder: a link, an absolute path, a ``..``, or a file that is
    not a regular file. The message names the file and why."""


def stored_path(value: object, label: str) -> PurePosixPath:
    """``value`` (a path stored in a file someone else wrote) as a relative path that stays
    inside its folder; Escapes naming ``label`` otherwise."""
    text = str(value)
    if not text or "\x00" in text:
        raise Escapes(f"{label}: an empty or NUL-holding path {text!r}")
    path = PurePosixPath(text.replace("\\", "/"))
    if path.is_absolute() or text.startswith(("/", "\\")) or ":" in path.parts[0]:
        raise Escapes(f"{label}: names the absolute path {text!r}; a stored path must be "
                      "relative to its folder")
    if ".." in path.parts:
        raise Escapes(f"{label}: names {text!r}, which climbs out of its folder (..)")
    return path


def _parts(relative: str | os.PathLike[str], label: str) -> tuple[str, ...]:
    parts = tuple(p for p in stored_path(os.fspath(relative), label).parts if p != ".")
    if not parts:
        raise Escapes(f"{label}: names the folder itself, not a file in it")
    return parts


def open_inside(folder: str | os.PathLike[str], relative: str | os.PathLike[str],
                label: str | None = None, flags: int = os.O_RDONLY) -> int:
    """A file descriptor of ``folder/relative`` opened without following any link under
    ``folder`` (each component with ``O_NOFOLLOW``, from the one before); Escapes for a
    link or a non-regular file, FileNotFoundError for a missing one. The caller closes
    it (or hands it to ``os.fdopen``)."""
    label = label or os.fspath(relative)
    parts = _parts(relative, label)
    directory = open_folder_inside(folder, parts[:-1], label)
    try:
        try:
            descriptor = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK,
                                 0o600, dir_fd=directory)  # a file it creates: owner's only
        except OSError as err:
            _refuse_link(directory, parts[-1], label, err)
            raise
    finally:
        os.close(directory)
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise Escapes(f"{label}: not a regular file; refused")
    os.set_blocking(descriptor, True)
    return descriptor


def open_folder_inside(folder: str | os.PathLike[str], parts: tuple[str, ...],
                       label: str) -> int:
    """A descriptor of the folder ``folder/parts[0]/…`` (``folder`` itself for no parts),
    each component opened with ``O_NOFOLLOW`` from the one before: Escapes naming a link
    or a component that is no folder, FileNotFoundError for a missing one. The caller
    closes it."""
    directory = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    for part in parts:
        try:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                            dir_fd=directory)
        except OSError as err:
            try:
                _refuse_link(directory, part, label, err)
            finally:
                os.close(directory)
            raise
        os.close(directory)
        directory = inner
    return directory


def _refuse_link(directory: int, part: str, label: str, err: OSError) -> None:
    """Turn "it is a link" (ELOOP, or ENOTDIR for a link to a folder) into Escapes."""
    try:
        mode = os.lstat(part, dir_fd=directory).st_mode
    except OSError:
        return  # missing: the caller re-raises err (FileNotFoundError)
    if stat.S_ISLNK(mode):
        raise Escapes(f"{label}: {part} is a symbolic link; a link is never followed "
                      "out of its folder") from None
    if not stat.S_ISDIR(mode) and not stat.S_ISREG(mode):
        raise Escapes(f"{label}: {part} is not a regular file or folder; refused") from None


def read_inside(folder: str | os.PathLike[str], relative: str | os.PathLike[str],
                label: str | None = None, tail: int | None = None,
                limit: int | None = None) -> bytes:
    """The bytes of ``folder/relative`` read by :func:`open_inside`: its last ``tail``
    bytes, or (``limit``) at most its first ``limit`` bytes, or all of it."""
    with os.fdopen(open_inside(folder, relative, label), "rb") as file:
        if tail is not None:
            size = os.fstat(file.fileno()).st_size
            file.seek(max(0, size - tail))
            return file.read(tail)
        return file.read() if limit is None else file.read(limit)


def regular_files(folder: str | os.PathLike[str], label: str | None = None
                  ) -> Iterator[PurePosixPath]:
    """Every file under ``folder`` (relative, sorted per folder), walked without following
    links; Escapes naming the first link or special file met."""
    root = Path(folder)
    label = label or str(root)
    todo = [PurePosixPath()]
    while todo:
        here = todo.pop()
        with os.scandir(root / here) as entries:
            found = sorted(entries, key=lambda entry: entry.name)
        for entry in found:
            name = here / entry.name
            if entry.is_symlink():
                raise Escapes(f"{label}/{name}: is a symbolic link; a link is never "
                              "followed out of its folder")
            if entry.is_dir(follow_symlinks=False):
                todo.append(name)
            elif entry.is_file(follow_symlinks=False):
                yield name
            else:
                raise Escapes(f"{label}/{name}: not a regular file or folder; refused")


def copy_regular_files(source: str | os.PathLike[str], target: str | os.PathLike[str],
                       label: str | None = None, names: list[str] | None = None) -> None:
    """Copy ``source``'s regular files (``names``: only those, at its top) into
    ``target``, each read through :func:`open_inside`; a link or special file anywhere is
    refused (Escapes) before anything is written."""
    label = label or os.fspath(source)
    files = [PurePosixPath(n) for n in names] if names is not None else \
        list(regular_files(source, label))
    if names is not None:  # checked before any byte is copied
        for name in files:
            os.close(open_inside(source, name, f"{label}/{name}"))
    for name in files:
        out = Path(target) / name
        out.parent.mkdir(parents=True, exist_ok=True)
        data = read_inside(source, name, f"{label}/{name}")
        with os.fdopen(create_owned(out, 0o644), "wb") as file:
            file.write(data)


def create_owned(path: str | os.PathLike[str], mode: int = 0o600) -> int:
    """A new file at ``path`` for writing, never through a link or over an existing file
    (``O_CREAT|O_EXCL|O_NOFOLLOW``): where a process writes what only it should write."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
