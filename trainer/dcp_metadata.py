"""Reading DCP's ``shards/.metadata`` without running what it holds.

torch.distributed.checkpoint writes ``.metadata`` as a pickle, and its FileSystemReader
reads it with ``pickle.load``: a checkpoint folder from anywhere could run any code at a
resume or an export. :class:`SafeFileSystemReader` reads it with :class:`MetadataUnpickler`,
whose ``find_class`` admits only the globals a real DCP metadata names (found by listing
the globals of a saved FSDP2 model + AdamW state; torch 2.13):

    torch.distributed.checkpoint.metadata   Metadata, MetadataIndex, StorageMeta, …
    torch.distributed.checkpoint.filesystem _StorageInfo
    torch                                   Size, and dtype / layout / memory_format values
    torch.serialization                     _get_layout (a name -> torch.layout lookup)
    pathlib                                 PosixPath, PurePosixPath (StorageMeta.checkpoint_id)
    collections                             OrderedDict

Anything else is refused: ``shards/.metadata: refuses posix.system (…)``.

The reader is also confined (rollout/confined.py): every ``relative_path`` the metadata
names must be relative and stay in the folder (``../../other-job/shards/__0_0.distcp``
and ``/etc/…`` are refused by ``read_metadata``, naming the path, before any shard is
read), and every file — the metadata and the shards — is opened component by component
from the folder's parent without following a link (a ``shards`` folder that is a link
is refused too).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from rollout.confined import Escapes, open_inside, stored_path

METADATA_FILE = ".metadata"
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
    "torch": {"Size"},
}
"""Module -> the names :class:`MetadataUnpickler` resolves (besides torch's dtype, layout
and memory_format values, checked by type)."""


class UnsafeMetadata(pickle.UnpicklingError):
    """A ``.metadata`` that names a global no DCP metadata holds."""


class MetadataUnpickler(pickle.Unpickler):
    """A pickle.Unpickler resolving only :data:`ALLOWED` (and torch dtypes/layouts)."""

    def __init__(self, handle: Any, label: str) -> None:
        super().__init__(handle)
        self.label = label

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(
                getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format):
            return getattr(torch, name)
        raise UnsafeMetadata(
            f"{self.label}: refuses {module}.{name} (not a class a DCP metadata holds: "
            "a checkpoint is data, never code to run)")


def load_metadata(data: bytes, label: str = f"shards/{METADATA_FILE}") -> Metadata:
    """``data`` (a .metadata file's bytes) as DCP Metadata, through the restricted
    unpickler; UnsafeMetadata naming ``label`` for a foreign global, ValueError for
    anything that is not Metadata."""
    try:
        metadata = MetadataUnpickler(io.BytesIO(data), label).load()
    except UnsafeMetadata:
        raise
    except Exception as err:
        raise ValueError(f"{label}: not a DCP metadata ({type(err).__name__}: "
                         f"{str(err).strip()[:200]})") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{label}: holds a {type(metadata).__name__}, not a DCP Metadata")
    return metadata


class ConfinedFileSystem(FileSystem):
    """DCP's FileSystem whose reads open ``path`` through :func:`open_inside` from
    ``root``: a path that is not under ``root`` (an absolute ``relative_path``), climbs out
    of it (``..``) or passes a link is refused (Escapes)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str
                      ) -> Generator[io.IOBase, None, None]:
        if "r" not in mode or any(flag in mode for flag in "wa+"):
            raise Escapes(f"{path}: a checkpoint is only read here, never written")
        try:  # lexical on purpose: a ".." stays in it, and open_inside refuses it
            relative = Path(path).relative_to(self.root)
        except ValueError:
            raise Escapes(f"{path}: outside the checkpoint folder {self.root}") from None
        with os.fdopen(open_inside(self.root, relative), "rb") as stream:
            yield stream  # type: ignore[misc]


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``read_metadata`` never runs the pickle's code and refuses a
    stored path that leaves the folder; every read is confined to the folder."""

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        # from the parent: the shards folder itself must not be a link either
        self.fs = ConfinedFileSystem(Path(os.path.abspath(self.path)).parent)
        self.path = Path(os.path.abspath(self.path))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as handle:
            data = handle.read()
        label = f"{Path(str(self.path)).name}/{Path(str(path)).name}"
        metadata = load_metadata(data, label)
        for info in (metadata.storage_data or {}).values():
            stored_path(getattr(info, "relative_path", ""), f"{label}: relative_path")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
