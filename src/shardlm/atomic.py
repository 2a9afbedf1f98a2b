"""Writing files: a directory atomically (build it under a temporary name, then rename it into place), and
safetensors files whose mode follows the umask."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from safetensors.torch import save_file


def current_umask() -> int:
    """The process's file mode creation mask (read by setting it and setting it back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, with the file's mode following the umask like every other file.

    safetensors creates its file owner-only (``-rw-------``); here it becomes ``0o666 & ~umask`` (0644
    under the usual umask 022), so others on a shared cluster can read the model as they can its config.

    Raises:
        OSError: the file cannot be written, with its errno, reason and path (safetensors reports a full
            disk as ``SafetensorError: ... No space left on device (os error 28)``).
    """
    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as e:  # noqa: BLE001 - SafetensorError: an I/O error carries its errno only in the text
        found = re.search(r"os error (\d+)", str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None
    os.chmod(path, 0o666 & ~current_umask())


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``out``; on success it replaces ``out`` in one rename.

    If the body raises (or the process dies), ``out`` is left as it was: the previous directory, if
    any, is only moved aside once the new one is complete, and put back if the final rename fails.
    Readers therefore see either the old directory or the complete new one, never a half-written one.

    Raises:
        NotADirectoryError: a parent of ``out`` is a file.
        OSError: ``out``'s parent cannot be created or written (e.g. permissions).
    """
    out = Path(out)
    for ancestor in out.absolute().parents:  # the nearest existing one must be a directory
        if ancestor.exists():
            if not ancestor.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, f"cannot create {out}: a parent is a file",
                                         str(ancestor))
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    # mkdtemp makes it owner-only; the result is an ordinary directory
    os.chmod(tmp, 0o777 & ~current_umask())
    old: Path | None = None
    try:
        yield tmp
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
        os.replace(tmp, out)
    except BaseException:
        if old is not None and not out.exists():
            os.replace(old / out.name, out)  # restore the previous directory
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
