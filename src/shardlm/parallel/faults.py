"""Naming the ranks and host of a lost node when a collective fails, instead of hanging.

gloo reports a dead peer only as a closed connection ("Read error [10.0.0.7]:41234: Connection
reset by peer") and NCCL as a timeout: neither says which rank or machine is gone. shardlm keeps
its own rank-to-host map, gathered once at start-up (rank, local rank, node rank = torchrun's
``GROUP_RANK``, hostname, pid), and each rank increments a heartbeat counter in the c10d store from
a background thread. That store is the TCPStore at ``MASTER_ADDR:MASTER_PORT`` that torchrun hosts
on the first node (https://pytorch.org/docs/stable/elastic/run.html).

When a collective raises (at once when the peer's connection closes; after ``parallel.timeout_s``,
the process-group timeout, when a node vanishes silently), the rank watches the counters for a few
heartbeat intervals. Ranks whose counter stopped are lost; :class:`NodeLost` names them with their
node and host. A rank that is alive but itself blocked in the failed collective keeps beating (its
heartbeat thread runs while gloo/NCCL wait with the GIL released), so only the dead are named. When
the store itself is gone, the first node (which hosts it) is the one lost.

The heartbeat thread does not wait for a collective to fail: while the training loop runs (inside
:meth:`FaultMonitor.watch`) it also reads the counter of the next rank in a ring (rank r watches
r + 1 mod N, so each rank is watched once and the store serves three small requests per rank per
interval). A counter that stopped for :func:`heartbeat_timeout` (30 s at the default
``parallel.timeout_s = 600``; never less than 15 s, so a loaded machine does not look dead) makes the
watcher name every silent rank, publish the message in the store for the others, print it once per
surviving node and end the process with :data:`NODE_LOST_EXIT_CODE`. So a frozen or dead peer is
reported within the heartbeat timeout even when the collectives would wait ``parallel.timeout_s``, and
under NCCL too, whose watchdog would otherwise tear the process down without naming anyone.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from shardlm.config import ParallelConfig
from shardlm.errors import NODE_LOST_EXIT_CODE, NodeLost
from shardlm.parallel.dist import DistInfo

#: substrings of the RuntimeError messages gloo, NCCL and c10d raise when a peer is gone or silent
_COMMUNICATION_MARKERS = ("gloo", "nccl", "connection", "timed out", "timeout", "c10d", "peer")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RankHost:
    """Where one rank runs: global rank, rank on its node, node rank (torchrun's GROUP_RANK), host, pid."""

    rank: int
    local_rank: int
    node_rank: int
    hostname: str
    pid: int


def this_rank_host(rank: int) -> RankHost:
    """This process's :class:`RankHost`, from torchrun's ``LOCAL_RANK`` and ``GROUP_RANK``."""
    return RankHost(rank, int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("GROUP_RANK", "0")),
                    socket.gethostname(), os.getpid())


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between heartbeats: timeout / 30, clamped to [0.2, 2] s (2 s at the default 600 s timeout)."""
    return min(2.0, max(0.2, timeout_s / 30))


def heartbeat_timeout(timeout_s: float) -> float:
    """Seconds of silence after which the heartbeat watch reports a peer lost: 15 intervals, at least 15 s
    (30 s at the default 600 s collective timeout), detection and naming included."""
    return max(15.0, 15 * heartbeat_interval(timeout_s))


def is_communication_failure(error: BaseException) -> bool:
    """True for the errors a dead or silent peer causes: ``torch.distributed.DistError`` (NCCL, store,
    network) or a plain RuntimeError from gloo/c10d (closed connection, timeout)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return type(error) is RuntimeError and any(m in text for m in _COMMUNICATION_MARKERS)


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"`` (sorted, consecutive runs as ranges)."""
    parts: list[str] = []
    for r in sorted(ranks):
        if parts and r == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{r}"
        else:
            parts.append(str(r))
    return ", ".join(parts)


def describe_ranks(hosts: list[RankHost], all_hosts: list[RankHost] | None = None) -> str:
    """``node 1 (host gpu-07): ranks 8-15`` per node, joined with ``; ``.

    With ``all_hosts`` (every rank of the job), a node of which only some ranks are in ``hosts`` is
    written ``rank 3 of node 0 (host gpu-01)``: the node itself is not lost.
    """
    by_node: dict[int, list[RankHost]] = {}
    for h in hosts:
        by_node.setdefault(h.node_rank, []).append(h)
    parts = []
    for node, members in sorted(by_node.items()):
        host = f"host {', '.join(sorted({h.hostname for h in members}))}"
        ranks = f"rank{'s' if len(members) > 1 else ''} {rank_ranges([h.rank for h in members])}"
        whole = all_hosts is None or len(members) == sum(h.node_rank == node for h in all_hosts)
        parts.append(f"node {node} ({host}): {ranks}" if whole else f"{ranks} of node {node} ({host})")
    return "; ".join(parts)


class FaultMonitor:
    """The rank-to-host map and the heartbeats of one run; :meth:`watch` turns a failed collective
    caused by lost ranks into :class:`NodeLost`.

    Build it with :meth:`start` on every rank (it gathers the map: a collective). Disabled (``watch``
    re-raises errors unchanged) for one rank or without torchrun's ``MASTER_ADDR``/``MASTER_PORT``.
    """

    def __init__(self, hosts: list[RankHost], rank: int, interval_s: float,
                 store_factory: Callable[[], dist.Store] | None, token: str, store_address: str = "",
                 timeout_s: float | None = None) -> None:
        self.hosts = hosts
        self.rank = rank
        self.interval_s = interval_s
        self.token = token
        self.store_address = store_address
        #: silence after which the watch reports a peer lost (see :func:`heartbeat_timeout`)
        self.timeout_s = max(15.0, 15 * interval_s) if timeout_s is None else timeout_s
        self._store = store_factory() if store_factory else None  # diagnosis (main thread)
        self._stop = threading.Event()
        self._watching = threading.Event()  # set while the body of watch() runs
        self._lock = threading.Lock()
        self._claimed: str | None = None  # "watcher" or "main": who is reporting a loss
        #: the message this rank printed when its watch ended the job (None: it printed nothing)
        self.reported: str | None = None
        #: how the watch ends the process (``os._exit``; unit tests record the call instead)
        self.exit_process: Callable[[int], Any] = os._exit
        self._thread: threading.Thread | None = None
        if store_factory is not None:
            beat_store = store_factory()  # a second client: the thread never shares a connection
            self._beat(beat_store)  # the first heartbeat before any collective can fail
            self._thread = threading.Thread(target=self._beat_loop, args=(beat_store,), daemon=True,
                                            name="shardlm-heartbeat")
            self._thread.start()

    @classmethod
    def start(cls, info: DistInfo, pcfg: ParallelConfig) -> FaultMonitor:
        """Gather the rank-to-host map (``all_gather_object``, a collective) and start this rank's heartbeat.

        The heartbeat keys carry rank 0's random token, so a restarted job (torchrun keeps its store
        across restarts) never reads an earlier attempt's counters.
        """
        me = this_rank_host(info.rank)
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if info.world_size == 1 or not addr or not port:
            return cls([me], info.rank, heartbeat_interval(pcfg.timeout_s), None, "")
        mine = {**asdict(me), "token": uuid.uuid4().hex}
        gathered: list[dict[str, Any]] = [{} for _ in range(info.world_size)]
        dist.all_gather_object(gathered, mine)
        hosts = [RankHost(**{k: v for k, v in g.items() if k != "token"}) for g in gathered]
        interval = heartbeat_interval(pcfg.timeout_s)
        store_timeout = timedelta(seconds=max(5.0, 10 * interval))

        def connect() -> dist.Store:
            return dist.TCPStore(addr, int(port), is_master=False, timeout=store_timeout,
                                 wait_for_workers=False)

        return cls(hosts, info.rank, interval, connect, gathered[0]["token"], f"{addr}:{port}",
                   heartbeat_timeout(pcfg.timeout_s))

    @property
    def enabled(self) -> bool:
        """True when heartbeats run (more than one rank, under torchrun)."""
        return self._store is not None

    # ---- store keys ------------------------------------------------------------------------
    def _key(self, kind: str, rank: int) -> str:
        return f"shardlm/{self.token}/{kind}/{rank}"

    def _beat(self, store: dist.Store) -> None:
        store.add(self._key("heartbeat", self.rank), 1)

    def _beat_loop(self, store: dist.Store) -> None:
        """Beat every interval; while watching, also watch the next rank in the ring and the job's
        lost key."""
        watched = (self.rank + 1) % len(self.hosts)
        last, changed = -1, time.monotonic()
        while not self._stop.wait(self.interval_s):
            # silence that starts the naming: the naming itself takes 3 intervals, the polling up to 1 more
            silent_s = max(self.interval_s, self.timeout_s - 4 * self.interval_s)
            try:
                self._beat(store)
                if not self._watching.is_set() or watched == self.rank:
                    last, changed = -1, time.monotonic()
                    continue
                if store.check([self._key("lost", 0)]):  # another rank named the lost ranks: end here too
                    report = json.loads(store.get(self._key("lost", 0)))
                    self._end_job(report["message"], report["lost"], store, published=True)
                    return
                count = store.add(self._key("heartbeat", watched), 0)
                if count != last:
                    last, changed = count, time.monotonic()
                elif time.monotonic() - changed >= silent_s and not self._finished(store, watched):
                    lost, message = self._lost_message(store, time.monotonic() - changed)
                    if not lost:  # everyone beats again (a slow rank, not a lost one): keep watching
                        last, changed = -1, time.monotonic()
                        continue
                    self._end_job(message, lost, store, published=False)
                    return
            except (RuntimeError, OSError, ValueError):
                # the store is gone; the main thread's diagnosis reports it
                return

    def _finished(self, store: dist.Store, rank: int) -> bool:
        """Whether ``rank`` left the training loop itself (normally, or with an error it recorded)."""
        return bool(store.check([self._key("stopped", rank)]) or store.check([self._key("failed", rank)]))

    def _lost_message(self, store: dist.Store, silent_s: float) -> tuple[list[int], str]:
        """The ranks that stopped beating (watched for 3 intervals more) and the message naming them
        (``[]``, ``""`` when every rank beats again)."""
        lost, failed = self.find_lost(store=store)
        if not lost:
            return [], ""
        by_rank = {h.rank: h for h in self.hosts}
        message = (f"lost {describe_ranks([by_rank[r] for r in lost], self.hosts)}: no heartbeat for "
                   f"{silent_s + 3 * self.interval_s:.1f} s (noticed by rank {self.rank}'s heartbeat watch, "
                   "before any collective timed out)")
        if failed:
            message += "; ranks that failed on their own: " + "; ".join(
                f"rank {r}: {m}" for r, m in failed.items()
            )
        return lost, message + (". The process or machine of those ranks died or froze: check that node's "
                                "log; relaunch the job (torchrun --max-restarts resumes from the last "
                                "checkpoint)")

    def _end_job(self, message: str, lost: list[int], store: dist.Store, published: bool) -> None:
        """Report ``message`` (one rank per surviving node prints it) and end this process with code 4.

        Called from the heartbeat thread; the main thread may be blocked in a collective that would wait
        ``parallel.timeout_s``, so the process ends with ``os._exit`` (no teardown of the process group,
        which could block on the lost peer). A rank that does not print waits a moment first, so that
        torchrun, which stops the other workers once one exits, does not stop a reporter before it prints.
        """
        with self._lock:
            if self._claimed is not None or self._stop.is_set():
                return  # the main thread is reporting, or the loop has ended
            self._claimed = "watcher"
        if not published:
            try:
                store.set(self._key("lost", 0), json.dumps({"message": message, "lost": lost}))
            except Exception:  # noqa: BLE001 - the others will notice by themselves
                pass
        me = next(h for h in self.hosts if h.rank == self.rank)
        survivors = [h.rank for h in self.hosts if h.node_rank == me.node_rank and h.rank not in lost]
        if self.rank == min(survivors, default=self.rank):
            self.reported = message
            print(f"error: {message}", file=sys.stderr, flush=True)
        else:
            time.sleep(3.0)
        sys.stdout.flush()
        sys.stderr.flush()
        self.exit_process(NODE_LOST_EXIT_CODE)

    def _count(self, rank: int, store: dist.Store | None = None) -> int:
        return (store or self._store).add(self._key("heartbeat", rank), 0)

    def _failure(self, rank: int, store: dist.Store | None = None) -> str | None:
        store = store or self._store
        key = self._key("failed", rank)
        return store.get(key).decode(errors="replace") if store.check([key]) else None

    # ---- diagnosis -------------------------------------------------------------------------
    def find_lost(self, watch_s: float | None = None,
                  store: dist.Store | None = None) -> tuple[list[int], dict[int, str]]:
        """Ranks whose heartbeat did not advance within ``watch_s`` (default 3 intervals), and the
        failure messages other ranks recorded ({rank: message}; those ranks are not lost). ``store``: the
        client to use (default the main thread's).

        Raises:
            dist.DistStoreError, RuntimeError: the store cannot be reached.
        """
        watch_s = 3 * self.interval_s if watch_s is None else watch_s
        others = [h.rank for h in self.hosts if h.rank != self.rank]
        first = {r: self._count(r, store) for r in others}
        silent = set(others)
        deadline = time.monotonic() + watch_s
        while silent and time.monotonic() < deadline:
            time.sleep(self.interval_s / 4)
            silent = {r for r in silent if self._count(r, store) == first[r]}
        failed = {r: msg for r in others if (msg := self._failure(r, store)) is not None}
        return sorted(silent - failed.keys()), failed

    def diagnose(self, error: BaseException) -> NodeLost | None:
        """After a failed collective: a :class:`NodeLost` naming the lost ranks, or None if none is lost."""
        by_rank = {h.rank: h for h in self.hosts}
        me = by_rank[self.rank]
        cause = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        try:
            self._store.set(self._key("failed", self.rank), f"communication failure ({cause})")
            lost, failed = self.find_lost()
        except Exception as store_error:  # noqa: BLE001 - the store's host (the first node) is gone
            store_node = by_rank[0].node_rank
            lost_hosts = [h for h in self.hosts if h.node_rank == store_node]
            if me.node_rank == store_node:
                return None  # our own node hosts the store: not a remote loss, report the original error
            message = (f"lost the node hosting the c10d store {self.store_address}: "
                       f"{describe_ranks(lost_hosts)} (store error: {type(store_error).__name__}: "
                       f"{str(store_error).splitlines()[0][:200] if str(store_error) else ''}); a collective "
                       f"failed with {cause}")
        else:
            if not lost:
                return None
            lost_hosts = [by_rank[r] for r in lost]
            message = (f"lost {describe_ranks(lost_hosts, self.hosts)}: no heartbeat for "
                       f"{3 * self.interval_s:.1f} s after a collective failed with {cause}")
            own = {r: m for r, m in failed.items() if not m.startswith("communication failure")}
            if own:
                message += "; ranks that failed on their own: " + "; ".join(
                    f"rank {r}: {m}" for r, m in own.items()
                )
        message += (". The process or machine of those ranks died: check that node's log; relaunch the job "
                    "(torchrun --max-restarts resumes from the last checkpoint)")
        survivors = [h.rank for h in self.hosts if h.node_rank == me.node_rank and h not in lost_hosts]
        return NodeLost(message, lost_hosts, report_here=self.rank == min(survivors, default=self.rank))

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Run the body; a communication failure caused by lost ranks becomes :class:`NodeLost`.

        Any other exception, or a communication failure with every rank still beating, is re-raised
        unchanged (after recording it in the store, so other ranks can name it).
        """
        self._watching.set()
        try:
            yield
        except Exception as error:
            self._watching.clear()
            if not self.enabled:
                raise
            if not is_communication_failure(error):
                try:
                    self._store.set(self._key("failed", self.rank), f"{type(error).__name__}: {error}"[:500])
                except Exception:  # noqa: BLE001 - best effort; the original error matters more
                    pass
                raise
            with self._lock:
                watcher_reports = self._claimed == "watcher"
                self._claimed = self._claimed or "main"
            if watcher_reports:  # the heartbeat thread is ending the process with its message
                time.sleep(3600)
            lost = self.diagnose(error)
            if lost is None:
                raise
            raise lost from error
        finally:
            self._watching.clear()

    def close(self) -> None:
        """Stop the heartbeat thread, telling the other ranks' watchers that this rank left on purpose."""
        with self._lock:
            self._stop.set()
        if self._store is not None and self._thread is not None:
            try:
                self._store.set(self._key("stopped", self.rank), "1")
            except Exception:  # noqa: BLE001 - the store is gone: nobody is left to watch
                pass
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1)
            self._thread = None


def guard_collectives(method: F) -> F:
    """Decorate a method of an object with a ``fault_monitor`` attribute: run it under
    :meth:`FaultMonitor.watch`, and stop the heartbeat when it returns or raises."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        monitor: FaultMonitor | None = getattr(self, "fault_monitor", None)
        if monitor is None:
            return method(self, *args, **kwargs)
        try:
            with monitor.watch():
                return method(self, *args, **kwargs)
        finally:
            monitor.close()

    return wrapper  # type: ignore[return-value]
