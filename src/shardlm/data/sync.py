"""Waiting between the ranks of a preparation through the TCP store, never inside a collective.

Preparation can take hours; the training's process group times out after ``parallel.timeout_s``
(gloo: "Timed out waiting ... for recv operation"; NCCL: the watchdog kills the job). So ranks wait
for each other by polling keys of the store that torchrun's rendezvous already runs: non-blocking
``check``/``add`` calls every ``poll_s`` seconds, with a progress line every ``report_s`` seconds and
no deadline except ``timeout_s`` (default a week). A rank that fails sets an error key, and every
waiting rank raises a :class:`DataError` naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist

from shardlm.data.corpus import DataError

__all__ = ["StoreSync", "Sync", "check_same_data", "data_fingerprint", "default_store"]


def default_store() -> Any:
    """The store of the default process group (the torchrun rendezvous store).

    Raises:
        RuntimeError: no process group is running.
    """
    if not dist.is_initialized():
        raise RuntimeError("no process group: call init_distributed first")
    return dist.distributed_c10d._get_default_store()


class Sync(Protocol):
    """How the ranks of one preparation wait for each other (a single process needs none).

    :class:`StoreSync` implements it over the TCP store with its own long
    timeout, so no rank ever waits inside a collective bounded by ``parallel.timeout_s``.
    """

    rank: int
    world_size: int

    def publish(self, name: str) -> None:
        """Mark the event ``name`` as happened."""

    def wait(self, name: str, what: str) -> None:
        """Wait until ``name`` was published, reporting what it waits for; raise if another rank failed."""

    def count(self, name: str, amount: int = 1) -> int:
        """Add ``amount`` to the counter ``name`` and return its new value."""

    def wait_count(self, name: str, target: int, what: str, total: Callable[[], str]) -> None:
        """Wait until the counter ``name`` reaches ``target``, reporting ``total()`` as progress."""

    def fail(self, message: str) -> None:
        """Tell the other ranks that this one failed."""

    def sub(self, name: str) -> Sync:
        """A Sync for a preparation nested in this one (keys of its own)."""


class StoreSync:
    """:class:`Sync` over a ``torch.distributed`` store.

    Args:
        store: A ``torch.distributed.Store`` (TCPStore, or a PrefixStore over one).
        rank, world_size: This rank and the number of ranks taking part.
        key: Names this preparation (e.g. the output directory); keys are prefixed with it and with
            torchrun's restart count, so a restarted job does not see the old job's keys.
        poll_s: Seconds between polls.
        report_s: Seconds between progress lines (printed to stderr).
        timeout_s: Longest wait in seconds before giving up.
    """

    def __init__(self, store: Any, rank: int, world_size: int, key: str, poll_s: float = 0.2,
                 report_s: float = 30.0, timeout_s: float = 7 * 24 * 3600.0) -> None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = store
        self.rank, self.world_size = rank, world_size
        self.prefix = f"shardlm/prepare/{attempt}/{key}/"
        self.poll_s, self.report_s, self.timeout_s = poll_s, report_s, timeout_s

    def sub(self, name: str) -> StoreSync:
        """The same ranks and store, with keys of their own (one preparation inside another)."""
        other = StoreSync(self.store, self.rank, self.world_size, "", self.poll_s, self.report_s,
                          self.timeout_s)
        other.prefix = f"{self.prefix}{name}/"
        return other

    def _key(self, name: str) -> str:
        return self.prefix + name

    def publish(self, name: str) -> None:
        self.store.set(self._key(name), "1")

    def share(self, name: str, value: str) -> None:
        """Publish the text ``value`` under ``name`` (rank 0's decision, read by :meth:`wait_value`)."""
        self.store.set(self._key(name), value)

    def wait_value(self, name: str, what: str) -> str:
        """Wait until ``name`` was shared (reporting what it waits for) and return its text."""
        self.wait(name, what)
        return self.store.get(self._key(name)).decode()

    def count(self, name: str, amount: int = 1) -> int:
        return int(self.store.add(self._key(name), amount))

    def fail(self, message: str) -> None:
        try:
            self.store.set(self._key("error"), f"rank {self.rank}: {message}")
        except Exception:  # noqa: BLE001 - the store may be gone; the error itself is raised by the caller
            pass

    def _check_error(self) -> None:
        if self.store.check([self._key("error")]):
            raise DataError("data preparation failed on another rank: "
                            f"{self.store.get(self._key('error')).decode()}")

    def _poll(self, done: Callable[[], bool], what: str, progress: Callable[[], str] | None) -> None:
        start = last = time.monotonic()
        while not done():
            self._check_error()
            now = time.monotonic()
            if now - start > self.timeout_s:
                raise DataError(f"rank {self.rank}: gave up waiting for {what} after {now - start:.0f} s")
            if now - last >= self.report_s:
                last = now
                extra = f" ({progress()})" if progress is not None else ""
                print(f"prepare: rank {self.rank} waiting for {what}{extra}, {now - start:.0f} s",
                      file=sys.stderr, flush=True)
            time.sleep(self.poll_s)

    def wait(self, name: str, what: str) -> None:
        self._poll(lambda: bool(self.store.check([self._key(name)])), what, None)

    def wait_count(self, name: str, target: int, what: str, total: Callable[[], str]) -> None:
        self._poll(lambda: self.count(name, 0) >= target, what, total)


def data_fingerprint(out_dir: str) -> str:
    """What this process sees of the prepared data at ``out_dir``: its content hash, or why there is none."""
    root = pathlib.Path(out_dir).expanduser()
    try:
        meta = json.loads((root / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"missing ({type(exc).__name__})"
    if "content_sha256" in meta:
        return str(meta["content_sha256"])
    return hashlib.sha256((root / "meta.json").read_bytes()).hexdigest()  # written before content hashes


def check_same_data(out_dir: str, rank: int, world_size: int) -> str:
    """Every rank checks that it sees the same prepared data (one all-gather at start-up, after preparation).

    Multi-node runs need ``data.dir`` (and ``run.dir``) on a file system every node shares.

    Returns:
        The content hash all ranks see.

    Raises:
        DataError: on every rank, naming the ranks and hosts whose view differs from rank 0's.
    """
    mine = (data_fingerprint(out_dir), socket.gethostname())
    views: list[Any] = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(views, mine)
    else:
        views = [mine]
    ref = views[0][0]
    odd = [f"rank {r} on {host} ({view[:12]})" for r, (view, host) in enumerate(views) if view != ref]
    if odd or ref.startswith("missing"):
        raise DataError(
            f"the ranks do not see the same prepared data at {out_dir}: rank 0 on {views[0][1]} sees "
            f"{ref[:12]}, but {', '.join(odd) or 'so does every rank'}. data.dir and run.dir must be on a "
            "file system that every node shares (NFS, Lustre, ...)")
    return ref
