"""Is a committed checkpoint whole, and is it confined? Its manifests, written at commit
and checked at every start, and the confinement rule applied to it.

    manifest.json         every file: size and CRC-32, and the listing's digest
    shards/manifest.json  every shard file's size and CRC-32

A start checks every size and the CRC-32 of the small files (:data:`SMALL_FILE_BYTES`);
``tally checkpoint verify`` reads every byte. :func:`confine` runs first: a link anywhere
in the folder, or a stored path (a manifest's name, DCP's ``relative_path``) that is
absolute or climbs out, is refused naming the file and the path (rollout/confined.py),
before anything else of the folder is read: a hostile folder, never loaded and never a
reason to fall back to an older checkpoint, unlike a damaged one (:func:`unreadable`).
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path
from typing import Any

import torch

from rollout.confined import Escapes, open_inside, read_inside, regular_files, stored_path
from trainer.checkpoint import (
    CRITIC_DIR,
    MANIFEST,
    MODEL_DIR,
    SHARDS_DIR,
    TRAINER_STATE,
    is_sharded,
)
from trainer.dcp_metadata import SafeFileSystemReader, UnsafeMetadata


def _digest(path: Path) -> dict[str, int]:
    return _digest_inside(path.parent, path.name)


def _digest_inside(folder: Path, name: str, crc: bool = True) -> dict[str, int]:
    """``folder/name``'s size and (``crc``) CRC-32, opened without following a link
    (Escapes for a link, a stored ``name`` that climbs out, or a special file)."""
    with os.fdopen(open_inside(folder, name), "rb") as handle:
        found = {"bytes": os.fstat(handle.fileno()).st_size}
        if crc:
            value = 0
            while chunk := handle.read(1 << 24):
                value = zlib.crc32(chunk, value)
            found["crc32"] = value
    return found


FOLDER_MANIFEST = "manifest.json"
"""At a checkpoint's top: {"files": {relative path: {"bytes": n, "crc32": c}}, "digest":
sha256 of the files listing} for every file of the checkpoint (shards, .metadata, trainer
state, driver state, rollouts in flight, model_config/, adapter/), written by
:func:`commit_checkpoint` (a shard's CRC is taken from shards/manifest.json, not re-read)."""
SMALL_FILE_BYTES = 16 << 20
"""A start checks every file's size and the CRC-32 of those under this size (the driver's
and trainer's state, configs): cheap at any model size. ``tally checkpoint verify`` (or
``full=True``) reads every byte, shards included (84 GB at 7 B)."""


def _listing_digest(files: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_manifest(folder: Path) -> None:
    shard_manifest = folder / SHARDS_DIR / MANIFEST
    shard_digests = (json.loads(shard_manifest.read_text())["files"]
                     if shard_manifest.is_file() else {})
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        if name == FOLDER_MANIFEST:
            continue
        # shards/manifest.json names the top-level shards only (a critic's has its own)
        known = shard_digests.get(path.name) if path.parent == folder / SHARDS_DIR else None
        files[name] = (dict(known) if known and known["bytes"] == path.stat().st_size
                       else _digest(path))
    (folder / FOLDER_MANIFEST).write_text(
        json.dumps({"files": files, "digest": _listing_digest(files)}, indent=1))


def check_manifest(folder: Path, full: bool = False) -> None:
    """Every file of the folder manifest present at its size, the listing at its digest,
    the small files (``full``: every file) at their CRC-32; each name a relative path
    inside the folder, opened without following a link (Escapes otherwise). A
    checkpoint written before the manifest existed has none: nothing to do here."""
    if not (folder / FOLDER_MANIFEST).is_file():
        return
    manifest = json.loads(read_inside(folder, FOLDER_MANIFEST))
    files = manifest["files"]
    if "digest" in manifest and manifest["digest"] != _listing_digest(files):
        raise ValueError(f"{FOLDER_MANIFEST}: its listing does not match its digest "
                         "(edited since it was written)")
    for name in files:
        stored_path(name, FOLDER_MANIFEST)  # every name, before any file is opened
    for name, want in files.items():
        try:
            found = _digest_inside(folder, name, crc=False)
        except FileNotFoundError:
            raise FileNotFoundError(f"{name}: missing (listed in {FOLDER_MANIFEST})"
                                    ) from None
        if found["bytes"] != want["bytes"]:
            raise ValueError(f"{name}: {found['bytes']} bytes, {FOLDER_MANIFEST} says "
                             f"{want['bytes']}")
        if ("crc32" in want and (full or want["bytes"] < SMALL_FILE_BYTES)
                and _digest_inside(folder, name)["crc32"] != want["crc32"]):
            raise ValueError(f"{name}: its CRC-32 does not match {FOLDER_MANIFEST}'s "
                             f"({want['crc32']:08x}): changed since it was written")


def confine(folder: str | Path) -> None:
    """Refuse (Escapes, or UnsafeMetadata for a pickle that carries code) a checkpoint
    that reaches outside its folder: a link or special file anywhere in it, a name in
    manifest.json or shards/manifest.json, or a DCP ``relative_path``, that is absolute
    or climbs out (..). A hostile folder, not a damaged one: a resume refuses it rather
    than falling back to an older checkpoint. Missing or malformed files are left to
    :func:`unreadable`."""
    folder = Path(folder)
    for _ in regular_files(folder, folder.name):
        pass  # the walk raises at the first link
    for shards in (folder / SHARDS_DIR, folder / CRITIC_DIR / SHARDS_DIR):
        if (shards / ".metadata").is_file():
            SafeFileSystemReader(str(shards)).read_metadata()  # checks each relative_path
    for manifest in (FOLDER_MANIFEST, f"{SHARDS_DIR}/{MANIFEST}",
                     f"{CRITIC_DIR}/{SHARDS_DIR}/{MANIFEST}"):
        if (folder / manifest).is_file():
            for name in _manifest_names(folder, manifest):
                stored_path(name, manifest)


def escapes(folder: str | Path) -> str | None:
    """Why :func:`confine` refuses ``folder`` (one line naming the file and the path),
    or None."""
    try:
        confine(folder)
    except (Escapes, UnsafeMetadata) as err:
        return str(err)
    except (OSError, ValueError):
        return None  # damaged, not hostile: unreadable() says so
    return None


def _manifest_names(folder: Path, manifest: str) -> list[str]:
    try:
        files = json.loads(read_inside(folder, manifest))["files"]
        return [str(name) for name in files]
    except (ValueError, KeyError, TypeError):
        return []  # malformed: unreadable() names it


def unreadable(path: str | Path, full: bool = False) -> str | None:
    """Why the trainer's part of a committed checkpoint cannot be loaded (a missing,
    truncated or corrupt file), or None, so the ranks are never asked to load a broken
    one: the folder manifest (:func:`check_manifest`), every shard at its size in
    shards/manifest.json and, under SMALL_FILE_BYTES (``full``: every one), at its
    CRC-32, every file DCP's metadata names present, the trainer state (mmap). A start
    uses the cheap check, ``tally checkpoint verify`` the full one. The driver's part is checked by
    services/driver/checkpoint.py."""
    path = Path(path)
    try:
        confine(path)  # before anything else is read
        check_manifest(path, full)
        if is_sharded(path):
            _check_shards(path / SHARDS_DIR, full)
        else:  # the Megatron backend's format
            from safetensors import safe_open

            with safe_open(str(path / MODEL_DIR / "model.safetensors"),
                           framework="pt") as weights:
                list(weights.keys())
        torch.load(path / TRAINER_STATE, weights_only=True, mmap=True)
        if (path / CRITIC_DIR).is_dir():
            _check_shards(path / CRITIC_DIR / SHARDS_DIR, full)
            torch.load(path / CRITIC_DIR / TRAINER_STATE, weights_only=True, mmap=True)
    except Exception as err:  # any failure to read is the answer
        return f"{type(err).__name__}: {str(err).strip()[:300]}"
    return None


def _check_shards(shards: Path, full: bool) -> None:
    label = f"{shards.name}/{MANIFEST}"
    files = json.loads(read_inside(shards, MANIFEST))["files"]
    for name in files:
        stored_path(name, label)
    for name, want in sorted(files.items()):
        try:
            size = _digest_inside(shards, name, crc=False)["bytes"]
        except FileNotFoundError:
            raise FileNotFoundError(f"{name}: missing") from None
        read = full or size < SMALL_FILE_BYTES  # as the folder manifest: cheap when small
        if size != want["bytes"] or (read and _digest_inside(shards, name) != want):
            raise ValueError(f"{name}: {size} bytes that do not match the manifest "
                             f"({want['bytes']} bytes, CRC-32 {want['crc32']:08x})")
    metadata = SafeFileSystemReader(str(shards)).read_metadata()  # refuses a stored
    named = {info.relative_path for info in (metadata.storage_data or {}).values()}
    if missing := sorted(named - set(files)):  # path that leaves the folder
        raise FileNotFoundError(f"{missing[0]}: named by the DCP metadata, not written")
