"""What `shardmesh node` was asked to do: checked up front; its two planes bound."""

from __future__ import annotations

import socket
from collections import Counter
from pathlib import Path

import pytest

from mesh.identity import Identity
from runtime.node.hostport import HostPort
from runtime.node.options import (
    CONTROL_FRAME_LIMIT,
    NodeOptions,
    NodeStartupError,
    Provision,
    first_leaf,
    open_node_planes,
)

LOOPBACK = HostPort("127.0.0.1", 0)


def options(tmp_path: Path, **kwargs: object) -> NodeOptions:
    return NodeOptions(listen=kwargs.pop("listen", LOOPBACK), state_dir=tmp_path, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"swarm": "secret"}, "unknown swarm mode"),
        ({"profile": "moon"}, "unknown profile"),
        ({"max_memory": 0}, "at least one byte"),
        ({"listen": HostPort("0.0.0.0", 7000)}, "give --advertise HOST"),
        ({"provision": Provision(Path("m"))}, "by auto-join"),
    ],
)
def test_contradictions_are_refused_before_anything_starts(
    tmp_path: Path, kwargs: dict[str, object], why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        options(tmp_path, **kwargs)


def test_a_wildcard_listen_with_an_advertised_host_is_fine(tmp_path: Path) -> None:
    opts = options(tmp_path, listen=HostPort("0.0.0.0", 7000), advertise="node.example")
    assert opts.advertised("tcp://0.0.0.0:7001") == "tcp://node.example:7001"
    assert opts.api_bind == HostPort("0.0.0.0", 0), "an advertised API listens where it is reached"


def test_the_api_binds_loopback_unless_told(tmp_path: Path) -> None:
    assert options(tmp_path).api_bind == HostPort("127.0.0.1", 0)
    assert options(tmp_path, api=HostPort("10.0.0.1", 8000)).api_bind == HostPort("10.0.0.1", 8000)
    assert options(tmp_path).advertised("tcp://127.0.0.1:5") == "tcp://127.0.0.1:5"


def test_first_leaf_unwraps_nested_groups() -> None:
    inner = NodeStartupError("port in use")
    group = BaseExceptionGroup("outer", [BaseExceptionGroup("inner", [inner]), ValueError()])
    assert first_leaf(group) is inner


async def test_the_planes_bind_on_loopback_under_the_nodes_keys(tmp_path: Path) -> None:
    keys = Identity.generate().plane_keys()
    async with open_node_planes(options(tmp_path), Counter(), keys) as (control, data):
        assert control.address.startswith("tcp://127.0.0.1:")
        assert data.address.startswith("tcp://127.0.0.1:")
        assert control.address != data.address
        assert control.keys.node_id == data.keys.node_id == keys.node_id
    assert CONTROL_FRAME_LIMIT > 0


async def test_a_taken_port_is_one_clear_startup_error(tmp_path: Path) -> None:
    keys = Identity.generate().plane_keys()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = options(tmp_path, listen=HostPort("127.0.0.1", port))
        with pytest.raises(NodeStartupError, match=f"cannot listen on tcp://127.0.0.1:{port}"):
            async with open_node_planes(busy, Counter(), keys):
                pass
