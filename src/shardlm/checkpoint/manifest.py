"""The checkpoint manifest: what makes a ``step-<N>`` directory a complete, verifiable checkpoint.

A checkpoint is written under a temporary name (``.tmp-step-<N>``), then ``manifest.json`` (step,
world size, config, per-file sizes and SHA-256 checksums) is written last, and only then is the
directory renamed to ``step-<N>``. So a directory named ``step-<N>`` with a manifest is complete;
anything else (a killed save) is never picked by ``--resume=auto``. At load the files are checked
against the manifest, which catches a truncated file or one flipped byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from shardlm.errors import CheckpointError
from shardlm.json_file import read_json

MANIFEST = "manifest.json"
FORMAT = "shardlm-checkpoint"
VERSION = 1
STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-"


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in ``chunk_bytes`` chunks (FIPS 180-4, via hashlib)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of one file."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename inside it) to disk, where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(ckpt_dir: Path, info: dict[str, Any], files: dict[str, dict[str, Any]]) -> Path:
    """Write ``manifest.json`` into ``ckpt_dir`` atomically (temp file, fsync, rename) and return its path.

    ``info`` holds step, world size, config...; ``files`` maps each file name to :func:`file_record`.

    Raises:
        OSError: the file cannot be written (naming its path, also for a full disk).
    """
    data = {"format": FORMAT, "version": VERSION, **info, "files": dict(sorted(files.items()))}
    tmp = ckpt_dir / f"{MANIFEST}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a failed write or close names no file: name it
        raise OSError(e.errno, e.strerror or str(e), str(tmp)) from None
    os.replace(tmp, ckpt_dir / MANIFEST)
    return ckpt_dir / MANIFEST


def read_manifest(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a checkpoint directory.

    Raises:
        CheckpointError: the path is not a directory, has no manifest (not a checkpoint, or an
            unfinished save), or the manifest is not a shardlm manifest.
    """
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint: no such directory")
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"{path} is not a complete shardlm checkpoint: {MANIFEST} not found "
                              "(not a checkpoint, or a save that did not finish)")
    manifest = read_json(path / MANIFEST, CheckpointError, expect=object)
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise CheckpointError(f"{path / MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path / MANIFEST} has version {manifest.get('version')}; this shardlm reads "
                              f"{VERSION}")
    return manifest


def check_files(ckpt_dir: Path, manifest: dict[str, Any], names: list[str]) -> list[str]:
    """Check ``names`` (a subset of the manifest's files) for presence, size and SHA-256; return problems.

    Returns one human-readable line per bad file, empty when all are intact.
    """
    problems = []
    for name in names:
        expected = manifest["files"][name]
        path = ckpt_dir / name
        if not path.is_file():
            problems.append(f"file {name} is missing")
        elif path.stat().st_size != expected["bytes"]:
            problems.append(f"file {name} has {path.stat().st_size} bytes, the manifest says "
                            f"{expected['bytes']} (truncated or overwritten)")
        elif sha256_file(path) != expected["sha256"]:
            problems.append(f"file {name} fails its SHA-256 checksum (corrupted)")
    return problems


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``ckpt_root`` (``step-<N>`` with a manifest), oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for p in ckpt_root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint under ``ckpt_root``, or None."""
    found = list_checkpoints(ckpt_root)
    return found[-1][1] if found else None
