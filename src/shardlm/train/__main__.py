"""``torchrun --nproc_per_node=N -m shardlm.train --config FILE [--section.key=value ...]``."""

import signal

# Ctrl-C (or the launcher's SIGINT) while this rank still imports torch ends it as an uncaught Ctrl-C ends
# Python (killed by SIGINT), without one traceback per rank: the launcher (shardlm.cli.launch.outcome) or
# torchrun reports it once. The default action, not a KeyboardInterrupt: one raised while Python runs a
# callback (the import machinery's weakref callbacks) is printed as 'Exception ignored' and the import goes on
_during_imports = signal.signal(signal.SIGINT, signal.SIG_DFL)
from shardlm.cli.train import main  # noqa: E402
from shardlm.parallel.dist import exit_process  # noqa: E402

signal.signal(signal.SIGINT, _during_imports)

if __name__ == "__main__":
    exit_process(main())  # see there: skips a teardown that can abort after gloo
