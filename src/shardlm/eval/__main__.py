"""``torchrun --nproc_per_node=N -m shardlm.eval --model DIR --data PATH``: the same as ``shardlm eval``."""

from shardlm.cli.eval import main

if __name__ == "__main__":
    raise SystemExit(main())
