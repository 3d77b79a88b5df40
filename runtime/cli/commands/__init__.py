"""One module per `shardmesh` command.

Each has `register(commands)`, which adds the command's parser and names
its run function with `set_defaults(run=...)` (`runtime.cli.command.Run`);
`runtime.cli.main` builds the parser from them and calls the run function
the command line chose. A command module imports at its top only what
building the parser needs; what running it needs (trio, httpx, torch, the
node daemon, the simulator) it imports inside its run function, so that
`shardmesh --help` and a usage error stay fast.
"""
