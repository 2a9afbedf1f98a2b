"""``torchrun --nproc_per_node=N -m shardlm.train --config FILE [--section.key=value ...]``."""

from shardlm.cli.train import main

if __name__ == "__main__":
    raise SystemExit(main())
