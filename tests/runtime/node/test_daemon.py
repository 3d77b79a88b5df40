"""The composition root in this process: a founding node wired, up, and stopped by SIGTERM.

Real planes on loopback, a real sqlite Raft store, the real HTTP API; no
model (the node serves no shard). Swarms of node processes are in
tests/processes/test_node.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
import trio

from consensus.storage import RaftStorage
from mesh.identity import Identity, node_id_text
from runtime.node.daemon import RAFT_STORE, Node, serve_node
from runtime.node.hostport import HostPort
from runtime.node.options import NodeOptions, NodeStartupError
from runtime.node.state_dir import StateDir, read_ready

LOOPBACK = HostPort("127.0.0.1", 0)


def options(state_dir: Path, **kwargs: object) -> NodeOptions:
    return NodeOptions(listen=LOOPBACK, state_dir=state_dir, profile="local", **kwargs)  # type: ignore[arg-type]


async def test_a_node_comes_up_serves_its_status_and_leaves_on_sigterm(tmp_path: Path) -> None:
    identity = Identity.load_or_create(tmp_path)
    with StateDir(tmp_path) as state, RaftStorage.open(tmp_path / RAFT_STORE) as storage:
        node = Node(options(tmp_path), state, identity, storage)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            ready = read_ready(tmp_path, os.getpid())
            assert ready is not None and ready["node_id"] == node_id_text(identity.node_id)
            assert set(node.addresses) == {"control", "data", "api", "relay"}, "it offers a relay"
            assert ready["api"] == node.addresses["api"]
            async with httpx.AsyncClient(timeout=10) as client:
                reply = await client.get(node.addresses["api"] + "/v1/network/status")
            assert reply.status_code == 200
            status = reply.json()
            assert status["node_id"] == node_id_text(identity.node_id)
            assert status["profile"] == "local" and status["addresses"] == node.addresses
            assert "ledger_follower" in status and isinstance(status["drops"], dict)
            own = next(m for m in status["members"] if m["self"])
            assert own["record"]["addresses"]["api"] == node.addresses["api"], "record published"
            assert own["record"]["addresses"]["relay"] == node.addresses["relay"]
            assert status["relays"]["offered"]["reservations"] == 0
            # A founder alone has nobody to dial it back yet.
            assert status["reachability"]["says"] == "checking reachability…"
            assert own["record"]["reach"] == "unknown"
            os.kill(os.getpid(), signal.SIGTERM)  # the node's receiver takes it
            with trio.fail_after(30):
                while read_ready(tmp_path) is not None:
                    await trio.sleep(0.05)
        assert read_ready(tmp_path) is None, "the ready file goes with the node"


async def test_a_bad_invitation_stops_the_node_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(NodeStartupError, match="--invite: not an invitation"):
        await serve_node(options(tmp_path, invite="not-a-token"))


async def test_a_damaged_raft_store_stops_the_node_with_one_line(tmp_path: Path) -> None:
    (tmp_path / RAFT_STORE).write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(NodeStartupError):
        await serve_node(options(tmp_path))
