"""``torchrun --nproc_per_node=N -m shardlm.train --config FILE [--section.key=value ...]``."""

from shardlm.cli.train import main
from shardlm.parallel.dist import exit_process

if __name__ == "__main__":
    exit_process(main())  # see there: skips a teardown that can abort after gloo
