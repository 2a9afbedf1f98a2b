"""``torchrun --nproc_per_node=N -m shardlm.eval --model DIR --data PATH``: the same as ``shardlm eval``."""

from shardlm.cli.eval import main
from shardlm.parallel.dist import exit_process

if __name__ == "__main__":
    exit_process(main())  # see there: skips a teardown that can abort after gloo
