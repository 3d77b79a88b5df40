"""The command line: shardmesh and its subcommands, the demo, a local swarm."""
