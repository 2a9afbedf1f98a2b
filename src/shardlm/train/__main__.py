"""``torchrun --nproc_per_node=N -m shardlm.train --config FILE [--section.key=value ...]``."""

import os
import signal

try:
    from shardlm.cli.train import main
    from shardlm.parallel.dist import exit_process
except KeyboardInterrupt:  # Ctrl-C (or the launcher's SIGINT) while this rank still imports torch
    # end as an uncaught Ctrl-C ends Python (killed by SIGINT), without one traceback per rank: the
    # launcher (shardlm.cli.launch.outcome) or torchrun reports it once
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)

if __name__ == "__main__":
    exit_process(main())  # see there: skips a teardown that can abort after gloo
