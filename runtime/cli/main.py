"""The `shardmesh` command line: the parser, and the dispatch to a command.

Each command lives in its own module under `runtime/cli/commands/`
(`COMMANDS`), which adds its parser and names its run function; `main`
parses the command line and calls that function. The flags several
commands share are in `runtime.cli.flags`. Usage errors exit
2 with the usage line, as argparse does; runtime errors (state dir in use,
port taken, node unreachable, a model folder that cannot be read) exit 1
with one line on stderr saying what went wrong. `doctor` exits 0 only when
the shard is admitted. See docs/design/cli.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from runtime.cli.command import PROG
from runtime.cli.commands import (
    chat,
    demo,
    doctor,
    invite,
    lab,
    manifest,
    node,
    policy,
    serve,
    simulate,
    status,
    tiny_model,
    voters,
)
from runtime.cli.flags import NODE_COMMANDS

COMMANDS = (
    node,
    serve,
    status,
    chat,
    demo,
    simulate,
    tiny_model,
    manifest,
    policy,
    voters,
    invite,
    doctor,
    lab,
)
"""The command modules, in the order `shardmesh --help` lists them."""


def package_version() -> str:
    """The installed package's version (`importlib.metadata`), else says so."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PROG)
    except PackageNotFoundError:
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """`--version`: asks the package metadata only when given, so that
    every other command starts without looking it up."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(f"{PROG} {package_version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The whole parser: every command's, each with its run function."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="A peer-to-peer swarm that serves large language models.",
    )
    parser.add_argument(
        "--version", action=_VersionAction, help="print the version of shardmesh and exit"
    )
    commands = parser.add_subparsers(dest="command", title="commands", required=True)
    for command in COMMANDS:
        command.register(commands)
    return parser


def parse_arguments(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """`parser.parse_args`, with `node --config FILE`'s (or `serve`'s)
    values as defaults (so flags still win); a bad file exits 2 with one
    line, as a usage error."""
    from runtime.cli.config_file import ConfigError, apply_config

    argv = sys.argv[1:] if argv is None else list(argv)
    for command in NODE_COMMANDS:
        try:
            apply_config(parser, build_parser, argv, command)
        except ConfigError as exc:
            parser.exit(2, f"{PROG} {command}: error: {exc}\n")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shardmesh` console script; returns the exit code."""
    parser = build_parser()
    args = parse_arguments(parser, argv)
    code: int = args.run(args, parser)
    return code


if __name__ == "__main__":
    sys.exit(main())
