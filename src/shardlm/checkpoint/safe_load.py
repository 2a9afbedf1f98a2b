"""Reading DCP checkpoints without running code from them.

``torch.distributed.checkpoint``'s ``FileSystemReader`` reads the ``.metadata`` file with a plain
``pickle.load`` and non-tensor items with ``torch.load(weights_only=False)``: a checkpoint someone
hands you could run any code at load. Here the metadata is read by an allow-list unpickler (only
DCP's own metadata dataclasses, ``torch.Size``, dtypes and paths may be built; anything else, such
as ``os.system`` or ``builtins.eval``, raises :class:`UnsafeCheckpointError` before it is called),
and non-tensor items are read with ``torch.load(weights_only=True)``. Tensors were already read
with ``weights_only=True`` by DCP itself.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from shardlm.errors import UnsafeCheckpointError

#: (module, name) pairs the metadata unpickler may resolve; every other global is refused
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # maps the string "torch.strided" to the layout object
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})


class SafeMetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` resolves only :data:`ALLOWED_GLOBALS` and torch dtypes.

    Raises:
        UnsafeCheckpointError: on any other global, before it is imported or called.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"refusing to load {module}.{name}: the metadata may only hold DCP metadata, sizes and dtypes")


def read_metadata(path: str | os.PathLike) -> Metadata:
    """Read a DCP ``.metadata`` file with :class:`SafeMetadataUnpickler`.

    Raises:
        UnsafeCheckpointError: the pickle names a global outside the allow-list, or is not DCP metadata.
        OSError: the file cannot be read.
    """
    data = Path(path).read_bytes()
    try:
        metadata = SafeMetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed pickle: one clear message
        raise UnsafeCheckpointError(
            f"{path}: not a readable DCP metadata file ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that reads ``.metadata`` with :func:`read_metadata` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor items with ``torch.load(weights_only=True)``.

    Only plain values (numbers, strings, bools, lists, tuples, dicts) and tensors can come back.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
