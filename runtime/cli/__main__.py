"""`python -m runtime.cli`: the same as the `shardmesh` script."""

from runtime.cli.main import main

raise SystemExit(main())
