"""``torchrun --nproc_per_node=N -m shardlm.data --config FILE [--workers W] [--section.key=value ...]``.

The same as ``shardlm prepare``; under torchrun every rank (on every node) encodes its share.
"""

import sys

from shardlm.cli.main import main
from shardlm.parallel.dist import exit_process

if __name__ == "__main__":
    exit_process(main(["prepare", *sys.argv[1:]]))
