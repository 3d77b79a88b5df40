"""Endpoints as users type them: one parser, one set of spellings, clear refusals."""

from __future__ import annotations

import pytest

from runtime.node.hostport import EndpointError, HostPort, Seed, api_url, parse_hostport, parse_seed

NODE = "ab" * 32


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:7000", HostPort("127.0.0.1", 7000)),
        ("tcp://10.0.0.2:1", HostPort("10.0.0.2", 1)),
        (" node.example:443 ", HostPort("node.example", 443)),
        ("[::1]:9000", HostPort("::1", 9000)),
        ("0.0.0.0:0", HostPort("0.0.0.0", 0)),
    ],
)
def test_the_spellings_it_takes(text: str, expected: HostPort) -> None:
    assert parse_hostport(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("localhost", "is not HOST:PORT"),
        (":80", "has no host"),
        ("host:http", "is not a number"),
        ("host:70000", "out of range"),
        ("::1:80", "brackets"),
        ("[::1]80", r"is not \[IPV6\]:PORT"),
        ("[nothost]:80", "is not an IPv6 address"),
    ],
)
def test_what_it_refuses_and_why(text: str, why: str) -> None:
    with pytest.raises(EndpointError, match=why):
        parse_hostport(text)


def test_port_zero_only_where_the_os_picks() -> None:
    with pytest.raises(EndpointError, match="out of range"):
        parse_hostport("h:0", allow_zero_port=False)


def test_the_forms_each_consumer_wants() -> None:
    v4, v6 = HostPort("10.0.0.1", 80), HostPort("::1", 81)
    assert (v4.text(), v4.zmq(), v4.http()) == (
        "10.0.0.1:80",
        "tcp://10.0.0.1:80",
        "http://10.0.0.1:80",
    )
    assert (v6.text(), v6.zmq()) == ("[::1]:81", "tcp://[::1]:81")
    assert parse_hostport(v6.zmq()) == v6, "what it writes, it reads back"
    assert HostPort("0.0.0.0", 1).is_wildcard and HostPort("::", 1).is_wildcard
    assert not v4.is_wildcard


def test_a_seed_is_an_id_and_a_dialable_address() -> None:
    seed = parse_seed(f"{NODE}@10.0.0.1:7000")
    assert seed == Seed(bytes.fromhex(NODE), HostPort("10.0.0.1", 7000))
    assert parse_seed(seed.text()) == seed
    with pytest.raises(EndpointError, match="NODE_ID@HOST:PORT"):
        parse_seed("10.0.0.1:7000")
    with pytest.raises(EndpointError, match="not a node id"):
        parse_seed("abcd@10.0.0.1:7000")
    with pytest.raises(EndpointError, match="out of range"):
        parse_seed(f"{NODE}@10.0.0.1:0")


def test_api_url_takes_an_endpoint_or_a_url() -> None:
    assert api_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert api_url("https://node.example/") == "https://node.example"
    with pytest.raises(EndpointError):
        api_url("127.0.0.1:0")
