"""``python -m shardlm``: the same as the ``shardlm`` command."""

from shardlm.cli.main import main

raise SystemExit(main())
