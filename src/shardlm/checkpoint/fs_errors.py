"""File-system faults during a save, reported with their real cause and path.

DCP's ``FileSystemWriter`` writes tensors through ``torch.save`` into a Python file object. When the disk
fills up, the ``OSError`` raised by that file's ``write`` is swallowed inside ``torch.save``'s zip writer,
and what comes out is ``unexpected pos 704 vs 598``. :class:`RecordingFileSystemWriter` hands DCP file
objects that remember the first ``OSError`` (errno, reason, path) before re-raising it, so the failure
can be reported as ``No space left on device: <path>``. When nothing was recorded, :func:`probe_free_space`
checks whether the file system is full.
"""

from __future__ import annotations

import errno
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


class _RecordingFile:
    """A binary file object that appends the first ``OSError`` of any call to ``errors`` (with the path)."""

    def __init__(self, raw: io.IOBase, path: Path, errors: list[OSError]) -> None:
        self._raw, self._path, self._errors = raw, path, errors

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._raw, name)(*args)
        except OSError as e:
            self._errors.append(OSError(e.errno, e.strerror or str(e), str(self._path)))
            raise

    def write(self, data: Any) -> int:
        return self._call("write", data)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._call("close")

    def tell(self) -> int:
        return self._call("tell")

    def seek(self, *args: Any) -> int:
        return self._call("seek", *args)

    def fileno(self) -> int:
        return self._raw.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def __enter__(self) -> _RecordingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _RecordingFileSystem(FileSystem):
    def __init__(self, errors: list[OSError]) -> None:
        super().__init__()
        self.errors = errors

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        try:
            raw = open(path, mode)  # noqa: SIM115 - closed by the wrapper
        except OSError as e:
            self.errors.append(OSError(e.errno, e.strerror, str(path)))
            raise
        with _RecordingFile(raw, Path(path), self.errors) as stream:
            yield stream  # type: ignore[misc]


class RecordingFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose files record the first ``OSError`` of this rank in ``self.errors``."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.errors: list[OSError] = []
        self.fs = _RecordingFileSystem(self.errors)


def probe_free_space(path: Path, needed_bytes: int) -> OSError | None:
    """An ENOSPC error for ``path`` when its file system has fewer than ``needed_bytes`` free, else None."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize < needed_bytes:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return None
