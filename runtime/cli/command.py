"""What every `shardmesh` command module shares: the program's name, the
shape of a command's run function, and its one-line runtime error.

A command module (`runtime.cli.commands`) adds its parser in `register` and
names its run function with `set_defaults(run=...)`; `runtime.cli.main`
calls it. A run function returns the exit code: 0 done, 1 a runtime error
(one line on stderr, from `fail`), 2 a usage error (argparse's own, or
`parser.error`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Final, TypeAlias

PROG: Final = "shardmesh"

Run: TypeAlias = Callable[[argparse.Namespace, argparse.ArgumentParser], int]
"""A command's body: its parsed arguments and the top-level parser (for a
usage error), to the exit code."""

Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What `register` adds its command to: the parser's `add_subparsers()`."""


def fail(command: str, message: str, code: int = 1) -> int:
    """Say on stderr what went wrong, in one line naming the command
    (`shardmesh status: error: cannot reach ...`); returns `code`."""
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return code
