"""File-system faults during a save, reported with their real cause and path.

DCP's ``FileSystemWriter`` writes tensors through ``torch.save`` into a Python file object. When the disk
fills up, the ``OSError`` raised by that file's ``write`` is swallowed inside ``torch.save``'s zip writer,
and what comes out is ``unexpected pos 704 vs 598``. :class:`RecordingFileSystemWriter` hands DCP file
objects that remember the first ``OSError`` (errno, reason, path) before re-raising it, so the failure
can be reported as ``No space left on device: <path>``. When nothing was recorded, :func:`probe_free_space`
checks whether the file system is full.

The same file objects compute each file's SHA-256 from the bytes as they are written (DCP writes every file
front to back): the manifest's checksums cost no second read of a checkpoint (96 GB at 8B parameters). A file
that is written out of order (a ``seek`` away from its end) gets no record, and the save reads it
back instead.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem


def with_path(error: OSError, path: str | os.PathLike) -> OSError:
    """A copy of ``error`` that names ``path`` (a failed ``write`` or ``close`` carries no file name)."""
    return OSError(error.errno, error.strerror or str(error), str(path))


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """``shutil.copyfile``; an error while writing names ``dst`` (``copyfile``'s own does not)."""
    try:
        shutil.copyfile(src, dst)
    except OSError as e:
        raise (e if e.filename else with_path(e, dst)) from None


def describe(error: OSError) -> str:
    """``<reason>: <path>`` of an OSError, e.g. ``No space left on device: /runs/a/checkpoints/...``."""
    reason = error.strerror or (os.strerror(error.errno) if error.errno else type(error).__name__)
    return f"{reason}: {error.filename}" if error.filename else reason


def copy_file_hashed(
    src: str | os.PathLike, dst: str | os.PathLike, chunk_bytes: int = 1 << 20
) -> dict[str, Any]:
    """Copy ``src`` to ``dst``; return ``{"bytes", "sha256"}`` of the bytes written (hashed as they
    are written).

    Raises:
        OSError: reading ``src`` or writing ``dst`` failed; an error while writing names ``dst``.
    """
    h, size = hashlib.sha256(), 0
    with open(src, "rb") as fin:
        try:
            with open(dst, "wb") as fout:
                while block := fin.read(chunk_bytes):
                    fout.write(block)
                    h.update(block)
                    size += len(block)
        except OSError as e:
            raise (e if e.filename else with_path(e, dst)) from None
    return {"bytes": size, "sha256": h.hexdigest()}


class _RecordingFile:
    """A binary file object that appends the first ``OSError`` of any call to ``errors`` (with the path) and,
    when it closes after a front-to-back write, puts ``{"bytes", "sha256"}`` of what was written in
    ``records[name]``."""

    def __init__(self, raw: io.IOBase, path: Path, errors: list[OSError],
                 records: dict[str, dict[str, Any]]) -> None:
        self._raw, self._path, self._errors, self._records = raw, path, errors, records
        self._sha256, self._written, self._in_order, self._closed = hashlib.sha256(), 0, True, False

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._raw, name)(*args)
        except OSError as e:
            self._errors.append(OSError(e.errno, e.strerror or str(e), str(self._path)))
            self._in_order = False  # nothing is recorded for a file whose write failed
            raise

    def write(self, data: Any) -> int:
        n = self._call("write", data)
        view = memoryview(data).cast("B")
        n = len(view) if n is None else n
        self._sha256.update(view[:n])
        self._written += n
        return n

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        if self._closed:
            return
        self._call("close")
        self._closed = True
        if self._in_order:
            self._records[self._path.name] = {"bytes": self._written, "sha256": self._sha256.hexdigest()}

    def tell(self) -> int:
        return self._call("tell")

    def seek(self, *args: Any) -> int:
        pos = self._call("seek", *args)
        if pos != self._written:  # bytes would be written out of order: the running hash no longer applies
            self._in_order = False
        return pos

    def fileno(self) -> int:
        return self._raw.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def __enter__(self) -> _RecordingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _RecordingFileSystem(FileSystem):
    def __init__(self, errors: list[OSError], records: dict[str, dict[str, Any]]) -> None:
        super().__init__()
        self.errors, self.records = errors, records

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        try:
            raw = open(path, mode)  # noqa: SIM115 - closed by the wrapper
        except OSError as e:
            self.errors.append(OSError(e.errno, e.strerror, str(path)))
            raise
        if "w" not in mode:  # not a file this writer creates: nothing to hash
            with raw:
                yield raw  # type: ignore[misc]
            return
        self.records.pop(Path(path).name, None)
        with _RecordingFile(raw, Path(path), self.errors, self.records) as stream:
            yield stream  # type: ignore[misc]

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes .metadata.tmp, then renames it: the record follows
        record = self.records.pop(Path(path).name, None)
        if record is not None:
            self.records[Path(new_path).name] = record

    def rm_file(self, path: str | os.PathLike) -> None:
        super().rm_file(path)
        self.records.pop(Path(path).name, None)


class RecordingFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose files record the first ``OSError`` of this rank in ``self.errors`` and the
    size and SHA-256 of each file this rank wrote, computed while writing, in ``self.records`` (file name
    -> record)."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.errors: list[OSError] = []
        self.records: dict[str, dict[str, Any]] = {}
        self.fs = _RecordingFileSystem(self.errors, self.records)


def probe_free_space(path: Path, needed_bytes: int) -> OSError | None:
    """An ENOSPC error for ``path`` when its file system has fewer than ``needed_bytes`` free, else None."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize < needed_bytes:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return None
