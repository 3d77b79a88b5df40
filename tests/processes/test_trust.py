"""Attacks on the planes of real node processes on loopback, scripted.

- A sniffer on the link (a raw AF_PACKET socket on `lo`) reads what two
  nodes' planes carry during a chat: with plaintext planes (the hidden
  `--insecure-plaintext`, the control that proves the sniffer sees the
  traffic) it reads data-plane headers and session ids; with the default
  CurveZMQ planes, none of it.
- A flood of garbage, plaintext ZMTP and oversized frames on both planes
  of a serving node leaves it serving: chats still answer, nothing
  forged is delivered.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio
import zmq

from mesh.identity import Identity, curve_public_key
from mesh.transport import NODE_ID_PROPERTY
from runtime.cli.localswarm import LocalNode, LocalSwarm, all_see
from runtime.model.tiny import make_tiny_model
from tests.swarm_helpers import START_TIMEOUT_S, assert_no_internal_errors, wait_for

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me a secret about the volunteers."}]
READY_TIMEOUT_S = 60.0
ETH_P_ALL = 0x0003
ETHERNET_HEADER = 14
SESSION_ID = re.compile(rb"[0-9a-f]{32}")
"""A data-plane session id as it travels in a plaintext header."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / MODEL, layers=8, name=MODEL)


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


class Sniffer:
    """Every TCP payload byte on `lo` to or from some ports, read by a raw
    socket in a thread, as someone on the link would."""

    def __init__(self, ports: set[int]) -> None:
        self.ports = ports
        self.payload = bytearray()
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self._sock.bind(("lo", 0))
        self._sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame, (_, _, kind, *_) = self._sock.recvfrom(1 << 17)
            except TimeoutError:
                continue
            if kind == socket.PACKET_OUTGOING:
                continue  # loopback shows each packet twice; keep the incoming copy
            self._take(frame[ETHERNET_HEADER:])

    def _take(self, packet: bytes) -> None:
        if len(packet) < 20 or packet[0] >> 4 != 4 or packet[9] != socket.IPPROTO_TCP:
            return
        ip_header = (packet[0] & 0x0F) * 4
        total = struct.unpack("!H", packet[2:4])[0]
        tcp = packet[ip_header:total]
        if len(tcp) < 20:
            return
        source, destination = struct.unpack("!HH", tcp[:4])
        if source in self.ports or destination in self.ports:
            self.payload += tcp[(tcp[12] >> 4) * 4 :]

    @contextlib.contextmanager
    def running(self) -> Iterator[Sniffer]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()
            self._sock.close()


def _can_sniff() -> bool:
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL)).close()
    except (PermissionError, AttributeError, OSError):
        return False
    return True


async def _two_hop_swarm(swarm: LocalSwarm, model_dir: Path, *extra: str) -> list[LocalNode]:
    nodes = [
        swarm.new_node(args=["--model", str(model_dir), "--layers", span, *extra])
        for span in ("0:4", "4:8")
    ]
    await swarm.start_ready(nodes[0], timeout=START_TIMEOUT_S)
    await swarm.start_ready(nodes[1], [nodes[0].seed], timeout=START_TIMEOUT_S)

    def served(views: dict) -> bool:
        coverage = (views.get(nodes[0].name) or {}).get("coverage", {}).get(MODEL)
        return bool(coverage) and not coverage["gaps"]

    await wait_for(swarm, nodes[:1], served, READY_TIMEOUT_S, "the model covered")
    return nodes


async def _chat(client: httpx.AsyncClient, node: LocalNode) -> httpx.Response:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    return await client.post(node.api + "/v1/chat/completions", json=body)


def _plane_ports(nodes: list[LocalNode]) -> set[int]:
    return {_port(node.info[plane]) for node in nodes for plane in ("control", "data")}


async def _sniff_a_chat(swarm: LocalSwarm, nodes: list[LocalNode]) -> bytes:
    with Sniffer(_plane_ports(nodes)).running() as sniffer:
        async with httpx.AsyncClient(timeout=60) as client:
            response = await _chat(client, nodes[0])
        assert response.status_code == 200, response.text
        await trio.sleep(0.3)  # the last packets reach the raw socket
    return bytes(sniffer.payload)


@pytest.mark.slow
@pytest.mark.skipif(not _can_sniff(), reason="capturing loopback needs CAP_NET_RAW")
async def test_a_sniffer_on_the_link_reads_nothing_of_a_chat(
    swarm: LocalSwarm, model_dir: Path, tmp_path: Path
) -> None:
    # The control: plaintext planes, where the sniffer must see the headers.
    async with LocalSwarm(tmp_path / "plaintext", profile="local") as plain_swarm:
        plain = await _two_hop_swarm(plain_swarm, model_dir, "--insecure-plaintext")
        seen = await _sniff_a_chat(plain_swarm, plain)
    assert b"forward" in seen and b"session" in seen and SESSION_ID.search(seen)

    nodes = await _two_hop_swarm(swarm, model_dir)
    seen = await _sniff_a_chat(swarm, nodes)
    assert len(seen) > 1000, "the sniffer saw the encrypted chat go by"
    for marker in (b"forward", b"session", b"token", b"compute_us", b"tcp://127.0.0.1"):
        assert marker not in seen, marker
    assert not SESSION_ID.search(seen)
    await assert_no_internal_errors(swarm, nodes)


def _flood(node: LocalNode, rounds: int) -> dict[str, int]:
    """Garbage, plaintext ZMTP, and authenticated but oversized frames at
    both of `node`'s planes; how many of each went out."""
    sent = {"garbage": 0, "plaintext": 0, "oversized": 0}
    context = zmq.Context.instance()
    keys = Identity.generate().plane_keys()
    server_key = curve_public_key(bytes.fromhex(node.node_id))
    assert server_key is not None
    for plane in ("control", "data"):
        host, port = node.info[plane].removeprefix("tcp://").rsplit(":", 1)
        for _ in range(rounds):
            with (
                contextlib.suppress(OSError),
                socket.create_connection((host, int(port)), timeout=1) as raw,
            ):
                raw.sendall(b"\xff" + os.urandom(4096))
                sent["garbage"] += 1
        plaintext = context.socket(zmq.DEALER)
        member = context.socket(zmq.DEALER)
        try:
            for sock in (plaintext, member):
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, rounds * 2)
            member.setsockopt(zmq.CURVE_PUBLICKEY, keys.curve_public)
            member.setsockopt(zmq.CURVE_SECRETKEY, keys.curve_secret)
            member.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            member.setsockopt(zmq.METADATA, f"{NODE_ID_PROPERTY}:{keys.node_id.hex()}".encode())
            plaintext.connect(node.info[plane])
            member.connect(node.info[plane])
            big = os.urandom(8 * 1024 * 1024)
            for _ in range(rounds):
                with contextlib.suppress(zmq.Again):
                    plaintext.send(big, zmq.NOBLOCK)
                    sent["plaintext"] += 1
                with contextlib.suppress(zmq.Again):
                    # Over the control plane's frame cap; on the data plane
                    # a frame no hop asked for.
                    member.send_multipart([b"\x00" * 16, big], zmq.NOBLOCK)
                    sent["oversized"] += 1
        finally:
            plaintext.close(linger=0)
            member.close(linger=0)
    return sent


@pytest.mark.slow
async def test_a_flood_on_both_planes_leaves_the_node_serving(
    swarm: LocalSwarm, model_dir: Path
) -> None:
    nodes = await _two_hop_swarm(swarm, model_dir)
    async with httpx.AsyncClient(timeout=60) as client:
        before = await _chat(client, nodes[0])
        assert before.status_code == 200, before.text
        sent: dict[str, int] = {}

        async def flood() -> None:
            sent.update(await trio.to_thread.run_sync(_flood, nodes[1], 20))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            during = await _chat(client, nodes[0])
        after = await _chat(client, nodes[0])
    # The flood really went out, of every kind, at both planes.
    assert sent["garbage"] > 0 and sent["plaintext"] > 0 and sent["oversized"] > 0, sent
    assert nodes[1].running, nodes[1].log_tail()
    for response in (during, after):
        assert response.status_code == 200, response.text
        assert response.json()["choices"] == before.json()["choices"]
    await assert_no_internal_errors(swarm, nodes)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
async def test_a_crashed_node_restarted_as_its_unit_would_is_back_within_10_s(
    swarm: LocalSwarm,
) -> None:
    """The restart path `docs/deploy` relies on (systemd `Restart=always`,
    launchd `KeepAlive`): the same command, state dir and ports, right after
    a SIGKILL. The node is back, with its identity, as its peers see it,
    within 10 s of the crash."""
    seed = swarm.new_node("seed")
    await swarm.start_ready(seed, timeout=START_TIMEOUT_S)
    fixed = ["--listen", f"127.0.0.1:{_free_port()}", "--api", f"127.0.0.1:{_free_port()}"]
    unit = swarm.new_node("unit", args=fixed)
    first = await swarm.start_ready(unit, [seed.seed], timeout=START_TIMEOUT_S)
    pair = [seed, unit]
    await wait_for(swarm, pair, all_see(pair, pair, "alive"), 15.0, "both alive")

    crashed_at = trio.current_time()
    unit.kill()
    await unit.wait_exit(5)
    again = await swarm.start_ready(unit, [seed.seed], timeout=10.0)
    assert again["node_id"] == first["node_id"] and again["control"] == first["control"]

    def back(views: dict) -> bool:
        for member in (views.get(seed.name) or {}).get("members", []):
            if member["node_id"] == unit.node_id:
                return member["state"] == "alive" and member["incarnation"] >= again["incarnation"]
        return False

    await wait_for(swarm, [seed], back, 10.0, "the restarted node alive again")
    assert trio.current_time() - crashed_at <= 10.0
