"""``shardlm train --nproc-per-node N [--nnodes ...] --config FILE [overrides]``: torchrun started for
the user.

The launch runs torchrun's own launcher (``torch.distributed.run``) in this process, so the ranks write
straight to this terminal (the progress bar stays a bar) and the outcome is ours to report: torchrun's
``ChildFailedError`` banner and its log lines are left out, the ranks' own one-line ``error: ...`` is the last
line of the output, and the exit code is the failed rank's (2 for bad input, 5 for a run stopped by a signal
after its checkpoint...; see :mod:`shardlm.errors`). A rank that crashed or was killed gets one line here
naming it. ``torchrun -m shardlm.train`` keeps working; this is the same launch with fewer words.

Signals: Ctrl-C in a terminal reaches this process only (torchrun starts each rank in a session of its own).
The first SIGINT, SIGTERM or SIGUSR1 is passed on to the ranks, which finish the step, save a checkpoint,
print the command that resumes and exit 5 (:mod:`shardlm.checkpoint.dcp`); the ranks get
``--shutdown-timeout`` seconds for it. A second Ctrl-C is passed on too and stops them at once (exit 130).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from shardlm.errors import STOPPED_EXIT_CODE, ConfigError

#: exit code after a second Ctrl-C stopped the ranks at once (128 + SIGINT, as a shell reports it)
INTERRUPTED_EXIT_CODE = 130
#: exit codes with which a rank has printed its own ``error: ...`` line or its resume command
#: (shardlm.cli.errors)
SHARDLM_EXIT_CODES = (2, 3, 4, 5, INTERRUPTED_EXIT_CODE)
#: signals passed on to the ranks (torchrun's own handling of them is switched off for this launch)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``train`` on the ``shardlm`` command's subparsers."""
    p = sub.add_parser("train", allow_abbrev=False,
                       help="train: start N ranks with torchrun (or one process); --config FILE and "
                            "--section.key=value overrides follow, as for torchrun -m shardlm.train",
                       description="Start torchrun for shardlm.train. Everything not listed here (--config, "
                                   "--resume, --section.key=value) goes to the ranks.")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                   help="ranks on this machine (1: train in this process, no torchrun)")
    p.add_argument("--nnodes", default="1", help="machines (torchrun's --nnodes: N or MIN:MAX)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=None,
                   help="this machine's rank (static rendezvous)")
    p.add_argument("--master-addr", "--master_addr", default=None, help="rank 0's host (static rendezvous)")
    p.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="rank 0's port (static rendezvous)")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default=None,
                   help="torchrun's rendezvous backend (c10d)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, help="host:port of the rendezvous")
    p.add_argument("--rdzv-id", "--rdzv_id", default=None, help="the job's id, the same on every machine")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="times torchrun (Ray, with --ray) restarts the ranks after a failure (they resume "
                        "from the newest checkpoint)")
    p.add_argument("--shutdown-timeout", "--shutdown_timeout", type=int, default=300,
                   help="seconds the ranks get, after a signal, to save and stop before they are killed")
    p.add_argument("--ray", action="store_true",
                   help="start the ranks as Ray Train workers instead of torchrun (needs shardlm[ray]; "
                        "the workers add --resume=auto)")
    p.add_argument("--num-workers", "--num_workers", type=int, default=None,
                   help="with --ray: ranks (Ray workers), one CPU or GPU each")
    p.add_argument("--ray-address", "--ray_address", default=None,
                   help="with --ray: the Ray cluster to join (auto, ray://HOST:10001; default RAY_ADDRESS, "
                        "else a local cluster of this machine)")
    p.add_argument("--ray-storage", "--ray_storage", default=None,
                   help="with --ray: Ray Train's storage_path for its own records (default ~/ray_results; "
                        "checkpoints stay in the run directory)")
    p.set_defaults(fn=cmd_train, takes_overrides=True)


def launch_options(args: argparse.Namespace) -> list[str]:
    """This launch's own options as given (defaults left out): the launcher part of the resume command."""
    out = [f"--nproc-per-node={args.nproc_per_node}"] if args.nproc_per_node != 1 else []
    for name in ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint",
                 "rdzv_id", "max_restarts"):
        value, default = getattr(args, name), {"nnodes": "1", "max_restarts": 0}.get(name)
        if value is not None and value != default:
            out.append(f"--{name.replace('_', '-')}={value}")
    return out


def torchrun_argv(args: argparse.Namespace, rest: list[str]) -> list[str]:
    """torchrun's command line for this launch: ``--standalone`` on one machine without a rendezvous given."""
    argv = [f"--nproc-per-node={args.nproc_per_node}", f"--max-restarts={args.max_restarts}",
            # the rest: Forwarder
            f"--shutdown-timeout={args.shutdown_timeout}", "--signals-to-handle=SIGHUP,SIGQUIT"]
    multi = args.nnodes != "1" or args.rdzv_endpoint or args.master_addr
    if not multi:
        argv.append("--standalone")
    for name in ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint",
                 "rdzv_id"):
        value = getattr(args, name)
        if multi and value is not None:
            argv.append(f"--{name.replace('_', '-')}={value}")
    return [*argv, "-m", "shardlm.train", *rest]


def child_pids() -> list[int]:
    """The processes whose parent is this one (the ranks torchrun started here), from ``/proc/<pid>/stat``."""
    me, out = os.getpid(), []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:  # field 4, after the command name in parentheses
            out.append(int(name))
    return out


class Forwarder:
    """Signal handlers that pass SIGINT/SIGTERM/SIGUSR1 on to the ranks and count the Ctrl-Cs."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._old: dict[int, Any] = {}
        self._forwarding = False  # a handler is passing a signal on (a signal may interrupt it)
        self._pending: int | None = None  # a signal that arrived meanwhile

    def __enter__(self) -> Forwarder:
        for sig in FORWARDED:
            self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():  # once stopping on a signal, more of them change nothing
            signal.signal(sig, signal.SIG_IGN if self.received else handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Count the signal and pass it on to the ranks. A signal that arrives while one is being passed on
        is counted and passed on once more by the handler it interrupted (a burst of signals, Ctrl-C held
        down on a loaded machine, nests no handlers); the next one outside a handler is passed on again."""
        self.received.append(signum)
        if self._forwarding:
            self._pending = signum
            return
        self._forwarding, sig = True, signum
        try:
            for _ in range(2):  # this signal, then at most one that arrived meanwhile
                self._pending = None
                for pid in child_pids():
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                if self._pending is None:
                    break
                sig = self._pending
        finally:
            self._forwarding = False

    @property
    def interrupted_twice(self) -> bool:
        """Whether a second signal followed a Ctrl-C (the ranks then stopped at once)."""
        return len(self.received) > 1 and signal.SIGINT in self.received


def outcome(codes: dict[int, int], forwarder: Forwarder | None = None) -> tuple[int, str | None]:
    """(exit code, line to print or None) from the failed ranks' exit codes ``{global rank: code}`` (negative:
    the signal that killed it).

    A shardlm exit code (:data:`SHARDLM_EXIT_CODES`; its rank printed its own line) of the lowest such rank
    wins, then the lowest crashed rank's (its traceback is above), over ranks that torchrun killed afterwards;
    when every rank was killed, the lowest one's, as exit 128 + signal (as a shell shows it).
    """
    if STOPPED_EXIT_CODE in codes.values():  # the ranks saved and printed the resume command; the Ctrl-C
        return STOPPED_EXIT_CODE, None  # they took may be the launcher's second (the first can reach no rank)
    if forwarder is not None and forwarder.interrupted_twice:
        return (
            INTERRUPTED_EXIT_CODE,
            "error: stopped at once (Ctrl-C twice): this step was not saved; the newest "
            "complete checkpoint, if any, is the one --resume=auto takes",
        )
    own = sorted(r for r, c in codes.items() if c in SHARDLM_EXIT_CODES)
    ctrl_c = forwarder is not None and signal.SIGINT in forwarder.received
    # a rank's 130 under torchrun is silent (cli/errors.py run_cli: the launcher says it)
    if own and not (ctrl_c and codes[own[0]] == INTERRUPTED_EXIT_CODE):
        return codes[own[0]], None
    if ctrl_c and {-signal.SIGINT, INTERRUPTED_EXIT_CODE} & set(codes.values()):
        # Ctrl-C before the training loop had started (imports, data, model): nothing to save yet
        return INTERRUPTED_EXIT_CODE, "error: stopped by Ctrl-C before training began (no checkpoint written)"
    crashed = sorted(r for r, c in codes.items() if c > 0)  # before the ranks torchrun killed afterwards
    rank = crashed[0] if crashed else min(codes)
    code = codes[rank]
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        hint = "; out of memory?" if code == -signal.SIGKILL else ""
        return 128 - code, f"error: rank {rank} was killed by {name} (exit code {code}{hint})"
    return code, f"error: rank {rank} failed with exit code {code} (its traceback is above)"


def cmd_train_ray(args: argparse.Namespace, rest: list[str]) -> int:
    """``shardlm train --ray --num-workers N``: the ranks as Ray Train workers
    (:func:`shardlm.integrations.ray.train`).

    Raises:
        ConfigError: ``--num-workers`` without ``--ray`` or missing with it, torchrun's own options given with
            ``--ray``, or what :func:`shardlm.integrations.ray.train` raises (Ray not installed first).
    """
    from shardlm.integrations import ray as ray_launch

    if not args.ray:
        raise ConfigError("--num-workers is for Ray Train workers: add --ray (or use --nproc-per-node N to "
                          "start N ranks with torchrun)")
    ray_launch.require_ray()
    torchrun_given = [o for o in launch_options(args) if not o.startswith("--max-restarts=")]
    if torchrun_given:
        raise ConfigError(f"--ray starts the ranks as Ray workers: {' '.join(torchrun_given)} is torchrun's; "
                          "give --num-workers N (and --ray-address for a cluster)")
    if args.num_workers is None:
        raise ConfigError("--ray needs --num-workers N: the number of ranks (Ray workers)")
    return ray_launch.train(None, rest, num_workers=args.num_workers, address=args.ray_address,
                            max_failures=args.max_restarts, storage_path=args.ray_storage)


def quiet_torchrun_logs() -> None:
    """Leave out torchrun's own log lines (``Sending process ... closing signal``, ``failed (exitcode:
    2)``...): the outcome is reported once, by :func:`outcome`."""
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run",
                            "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    """Train: in this process for one rank on one machine, else under torchrun (see the module docstring)."""
    from shardlm.checkpoint.run import LAUNCH_ENV

    if args.ray or args.num_workers is not None:
        return cmd_train_ray(args, rest)
    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    os.environ[LAUNCH_ENV] = shlex.join(["shardlm", "train", *launch_options(args)])
    if args.nproc_per_node == 1 and args.nnodes == "1" and not (args.rdzv_endpoint or args.master_addr):
        from shardlm.cli.train import main as train_main

        return train_main(rest)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    targs = torchrun.parse_args(torchrun_argv(args, rest))
    quiet_torchrun_logs()
    with Forwarder() as forwarder:
        try:
            torchrun.run(targs)
        except ChildFailedError as e:
            code, line = outcome({rank: f.exitcode for rank, f in e.failures.items()}, forwarder)
        except SignalException as e:  # SIGHUP / SIGQUIT: torchrun stopped the ranks
            code, line = 128 + int(e.sigval), f"error: stopped by {signal.Signals(e.sigval).name}"
        else:
            return 0
    if line:
        print(line, file=sys.stderr, flush=True)
    return code
