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
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``read_metadata`` never runs the pickle's code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as handle:
            data = handle.read()
        metadata = load_metadata(data, f"{Path(str(self.path)).name}/{Path(str(path)).name}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
