"""The converters behind `shardmesh` flags (argparse `type=`).

Each turns one flag's text into its value, or raises ArgumentTypeError with
the words a usage error shows; a `--config` file's values go through the
same converters (`runtime.cli.config_file`), so both follow one set of
rules. They import nothing heavy at module level: building the parser must
stay fast. A converter's return annotation tells a config file whether the
key takes a TOML number.
"""

from __future__ import annotations

import argparse
from typing import Final, NewType

from runtime.node.hostport import (
    EndpointError,
    HostPort,
    Seed,
    api_url,
    parse_hostport,
    parse_seed,
)

DURATION_UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
SIZE_UNITS: Final = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
"""`--max-memory`'s suffixes: binary, as memory is sold and reported."""
ByteSize = NewType("ByteSize", int)
"""A size written with a unit (`8G`): not a plain number, so a config file
spells it as the command line does, a string (`runtime.cli.config_file`)."""


def hostport(text: str) -> HostPort:
    try:
        return parse_hostport(text)
    except EndpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def seed(text: str) -> Seed:
    try:
        return parse_seed(text)
    except EndpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def url(text: str) -> str:
    try:
        return api_url(text)
    except EndpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def duration(text: str) -> float:
    """`90`, `30m`, `24h`, `7d` as seconds."""
    unit = DURATION_UNITS.get(text[-1:].lower())
    try:
        value = float(text[:-1] if unit else text) * (unit or 1.0)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 90s, 30m, 24h, 7d")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds >= 0")
    return value


def size(text: str) -> ByteSize:
    """`8G`, `512M`, `1.5g`, `1048576` as bytes."""
    unit = SIZE_UNITS.get(text[-1:].lower())
    try:
        value = float(text[:-1] if unit else text) * (unit or 1)
    except ValueError:
        value = 0.0
    if not 1 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 8G, 512M or 1048576")
    return ByteSize(int(value))


def layer_span(text: str) -> tuple[int, int]:
    """`A:B` -> (A, B). Only the syntax is checked here: whether the span
    fits the model is the doctor's `span` check, reported like any refusal."""
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(start), int(end)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not A:B (e.g. 0:4)") from None


def node_id(text: str) -> str:
    from mesh.identity import node_id_from_text, node_id_text  # cryptography: only when used

    try:
        return node_id_text(node_id_from_text(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a node id: {exc}") from None


def setting(text: str) -> tuple[str, int | float]:
    from runtime.cli.policy_client import parse_setting  # httpx: only when used

    try:
        return parse_setting(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
