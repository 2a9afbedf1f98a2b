"""A checkpoint's summary without loading its tensors (``shardlm inspect``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardlm.checkpoint.manifest import check_files, read_manifest
from shardlm.checkpoint.safe_load import read_metadata
from shardlm.errors import CheckpointError, UnsafeCheckpointError


def inspect_checkpoint(ckpt: str | Path) -> dict[str, Any]:
    """Describe a checkpoint without loading its tensors.

    Returns a dict with ``step``, ``world_size`` (of the run that wrote it), ``tensors`` (a list of
    ``(name, shape, dtype)``), ``other_items`` (names of non-tensor items), ``total_bytes`` (all
    files), and ``checksums`` (``"ok"`` or the list of problems).

    Raises:
        CheckpointError: not a checkpoint, or its metadata cannot be read safely.
    """
    path = Path(ckpt)
    manifest = read_manifest(path)
    problems = check_files(path, manifest, sorted(manifest["files"]))
    try:
        metadata = read_metadata(path / ".metadata")
    except (UnsafeCheckpointError, OSError) as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    tensors, others = [], []
    for name, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            tensors.append((name, tuple(entry.size), str(entry.properties.dtype).removeprefix("torch.")))
        else:
            others.append(name)
    return {
        "path": str(path), "step": manifest.get("step"), "world_size": manifest.get("world_size"),
        "tensors": tensors, "other_items": others,
        "total_bytes": sum(int(f["bytes"]) for f in manifest["files"].values()),
        "files": len(manifest["files"]), "checksums": problems or "ok",
    }


def format_inspection(report: dict[str, Any]) -> str:
    """The text ``shardlm inspect`` prints for a :func:`inspect_checkpoint` report."""
    lines = [
        f"checkpoint  {report['path']}",
        f"step        {report['step']}",
        f"world size  {report['world_size']} (the run that wrote it; it loads at any world size)",
        f"files       {report['files']}, {report['total_bytes']:,} bytes",
        "checksums   " + ("ok (SHA-256 of every file matches the manifest)" if report["checksums"] == "ok"
                          else "FAILED: " + "; ".join(report["checksums"])),
        f"tensors     {len(report['tensors'])}, plus {len(report['other_items'])} plain values",
    ]
    width = max((len(n) for n, _, _ in report["tensors"]), default=0)
    for name, shape, dtype in report["tensors"]:
        lines.append(f"  {name:<{width}}  {dtype:<8} {list(shape)}")
    return "\n".join(lines)
