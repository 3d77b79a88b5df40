"""`runtime.cli.argtypes`: each flag's converter, and the words of its usage error."""

from __future__ import annotations

import argparse

import pytest

from runtime.cli import argtypes
from runtime.node.hostport import EndpointError, api_url, parse_hostport


def test_endpoint_spellings() -> None:
    assert parse_hostport("tcp://127.0.0.1:7000").zmq() == "tcp://127.0.0.1:7000"
    assert parse_hostport("[::1]:7000").zmq() == "tcp://[::1]:7000"
    assert api_url("127.0.0.1:8080") == "http://127.0.0.1:8080"
    assert api_url("http://node.example:8080/") == "http://node.example:8080"
    for bad in ("::1:7000", "host:", ":7000", "[::1]7000", "[nothex]:1"):
        with pytest.raises(EndpointError):
            parse_hostport(bad)


def test_endpoints_become_usage_errors() -> None:
    assert argtypes.hostport("127.0.0.1:7000").text() == "127.0.0.1:7000"
    assert argtypes.url("127.0.0.1:8080") == "http://127.0.0.1:8080"
    assert argtypes.seed(f"{'a' * 64}@127.0.0.1:7000").at.text() == "127.0.0.1:7000"
    for convert, bad in (
        (argtypes.hostport, "nonsense"),
        (argtypes.url, "localhost"),
        (argtypes.seed, "127.0.0.1:7000"),
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            convert(bad)


def test_sizes_are_binary_and_durations_take_units() -> None:
    assert argtypes.size("8G") == 8 * 2**30
    assert argtypes.size("1.5g") == 3 * 2**29
    assert argtypes.size("512M") == 512 * 2**20
    assert argtypes.size("1048576") == 2**20
    assert [argtypes.duration(t) for t in ("90", "90s", "30m", "24h", "7d")] == [
        90.0, 90.0, 1800.0, 86400.0, 7 * 86400.0,
    ]  # fmt: skip
    for bad in ("0", "lots", "-1G", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
            argtypes.size(bad)
    for bad in ("0", "soon", "-5m"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a duration"):
            argtypes.duration(bad)


def test_numbers_spans_and_ids() -> None:
    assert argtypes.positive_int("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="0 is not a positive integer"):
        argtypes.positive_int("0")
    with pytest.raises(argparse.ArgumentTypeError, match="'x' is not an integer"):
        argtypes.positive_int("x")
    assert argtypes.seconds("0") == 0.0
    for bad in ("-1", "inf", "soon"):
        with pytest.raises(argparse.ArgumentTypeError, match="number of seconds"):
            argtypes.seconds(bad)
    assert argtypes.layer_span("0:4") == (0, 4)
    for bad in ("4", "a:b", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="is not A:B"):
            argtypes.layer_span(bad)
    assert argtypes.node_id("AB" * 32) == "ab" * 32
    with pytest.raises(argparse.ArgumentTypeError, match="is not a node id"):
        argtypes.node_id("ab")
    assert argtypes.setting("max_copies=3") == ("max_copies", 3)
    with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=VALUE"):
        argtypes.setting("nope=1")
