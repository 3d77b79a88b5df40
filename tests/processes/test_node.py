"""Real `shardmesh node` processes on 127.0.0.1 (issue 2's acceptance).

Every node is a subprocess speaking ZeroMQ (encrypted, CurveZMQ) to the
others; the tests only watch them through `GET /v1/network/status`, as an
operator would. Waits are bounded by `trio.fail_after`; the `swarm` fixture
kills whatever is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cbor2
import pytest
import trio
import zmq
from zmq.utils.monitor import recv_monitor_message

from mesh.config import MembershipConfig
from mesh.identity import Identity, curve_public_key
from mesh.messages import Envelope, Gossip, Ping, Record, record_signing_bytes
from mesh.records import Addresses, NodeRecord, encode_record_body
from mesh.transport import NODE_ID_PROPERTY
from mesh.wire import (
    MAX_CONTROL_MESSAGE_BYTES,
    MAX_DEPTH,
    DecodeError,
    decode_envelope,
    encode_envelope,
)
from runtime.cli.localswarm import (
    LocalNode,
    LocalSwarm,
    Views,
    all_see,
    member_field,
    member_states,
)
from tests.swarm_helpers import (
    CONVERGE_TIMEOUT_S,
    OBSERVATION_SLACK_S,
    START_TIMEOUT_S,
    assert_no_internal_errors,
    crash_and_time_death,
    start_swarm,
    wait_for,
)

POLL_S = 0.05


@pytest.mark.slow
async def test_five_nodes_converge_detect_a_crash_and_take_back_a_restart(
    swarm: LocalSwarm,
) -> None:
    nodes = await start_swarm(swarm, 5)
    victim, survivors = nodes[-1], nodes[:-1]
    before = await swarm.status(victim)
    assert before is not None
    old_incarnation = before["incarnation"]

    # Crash: SIGKILL, so no leave is announced.
    bound = MembershipConfig.local().detection_bound(len(nodes))
    took = await crash_and_time_death(
        swarm, victim, survivors, bound, "every survivor marks the crashed node dead"
    )
    assert took <= bound + OBSERVATION_SLACK_S, (
        f"detection took {took:.2f}s, over the local profile's bound {bound:.2f}s"
    )

    # Restart with the same state dir, joining through another node this time.
    info = await swarm.start_ready(victim, [survivors[1].seed], timeout=START_TIMEOUT_S)
    assert info["node_id"] == before["node_id"]
    assert info["incarnation"] > old_incarnation

    def back_alive(views: Views) -> bool:
        for observer in survivors:
            view = views.get(observer.name)
            incarnation = member_field(view, victim.node_id, "incarnation")
            if member_states(view).get(victim.node_id) != "alive":
                return False
            if incarnation is None or incarnation < info["incarnation"]:
                return False
        return True

    await wait_for(swarm, survivors, back_alive, CONVERGE_TIMEOUT_S, "survivors take it back")
    await wait_for(
        swarm, [victim], all_see([victim], survivors, "alive"), CONVERGE_TIMEOUT_S, "it sees all"
    )

    # Its new record (new addresses) replaces the one from its previous life.
    # The record is gossiped apart from the alive update waited on above, so
    # a survivor may hold the new incarnation a moment before the new record.
    def new_record(views: Views) -> bool:
        for observer in survivors:
            record = member_field(views.get(observer.name), victim.node_id, "record")
            if record is None or record.get("addresses", {}).get("api") != victim.api:
                return False
        return True

    await wait_for(swarm, survivors, new_record, CONVERGE_TIMEOUT_S, "its new record everywhere")
    await assert_no_internal_errors(swarm, nodes)


@pytest.mark.slow
async def test_sigterm_leaves_gracefully_and_exits_zero(swarm: LocalSwarm) -> None:
    nodes = await start_swarm(swarm, 3)
    leaver, rest = nodes[0], nodes[1:]
    leaver.signal(signal.SIGTERM)
    assert await leaver.wait_exit(10) == 0
    # A leave is announced, not detected: it arrives long before any timeout.
    took = await wait_for(swarm, rest, all_see(rest, [leaver], "left"), 5.0, "leave seen")
    assert took < MembershipConfig.local().suspicion_min_timeout(3)
    codes = [await swarm.stop(node) for node in rest]
    assert codes == [0, 0]


async def test_a_pinned_node_runs_every_thread_on_its_cores(swarm: LocalSwarm) -> None:
    # The pipeline benchmark's --pin gives each node its own cores; all of a
    # node's threads (event loop, libzmq's I/O thread, hypercorn's) must obey.
    core = min(os.sched_getaffinity(0))
    node = swarm.new_node(cpus=[core])
    await swarm.start_ready(node, timeout=START_TIMEOUT_S)
    assert node.process is not None
    tasks = Path(f"/proc/{node.process.pid}/task")
    allowed = {
        line.split(":", 1)[1].strip()
        for task in tasks.iterdir()
        for line in (task / "status").read_text().splitlines()
        if line.startswith("Cpus_allowed_list:")
    }
    assert len(list(tasks.iterdir())) > 1  # really several threads
    assert allowed == {str(core)}
    # Kept across a restart, like the node's own flags.
    assert await swarm.stop(node) == 0
    await swarm.start_ready(node, timeout=START_TIMEOUT_S)
    assert os.sched_getaffinity(node.process.pid) == {core}


# --- bad input ----------------------------------------------------------------

FAKE_ADDR = "tcp://127.0.0.1:9"  # nothing answers there; no valid message here asks for a reply


def _record(subject: Identity, seq: int, signer: Identity | None = None) -> Record:
    body = encode_record_body(
        NodeRecord(addresses=Addresses(control=FAKE_ADDR, data=FAKE_ADDR), started_at=0.0)
    )
    signature = (signer or subject).sign(record_signing_bytes(subject.node_id, seq, body))
    return Record(subject.node_id, seq, body, signature)


def _gossip(sender: Identity, *updates: Record) -> bytes:
    return encode_envelope(Envelope(sender.node_id, FAKE_ADDR, Gossip(tuple(updates))))


def _mutated(payload: bytes, mutate: Callable[[dict[int, Any]], None]) -> bytes:
    """A valid envelope re-encoded after `mutate` edits its raw CBOR map."""
    raw = cbor2.loads(payload)
    mutate(raw)
    return cbor2.dumps(raw)


def bad_inputs() -> list[tuple[str, Identity, list[bytes]]]:
    """(expected drop reason, the member that sends it, payloads sent in
    order) for every kind of bad input. Each case has a sender of its own,
    as from distinct hostile members, and every envelope names that sender,
    except in the case that is about exactly that."""
    someone, forger = Identity.generate(), Identity.generate()
    cut, big, deep, typo, mistyped, forging, replaying, impostor = (
        Identity.generate() for _ in range(8)
    )

    def ping(sender: Identity) -> bytes:
        return encode_envelope(Envelope(sender.node_id, FAKE_ADDR, Ping(1, someone.node_id)))

    def unknown_type(raw: dict[int, Any]) -> None:
        raw[1] = 99

    def wrong_field_type(raw: dict[int, Any]) -> None:
        raw[4][0] = "one"  # Ping's seq must be an unsigned integer

    return [
        ("malformed_cbor", cut, [b"\xa5\x00\x01\x01"]),  # a 5-entry map cut short
        ("oversized", big, [b"\x00" * (MAX_CONTROL_MESSAGE_BYTES + 1)]),
        ("too_deep", deep, [b"\x81" * (MAX_DEPTH + 4) + b"\x00"]),
        ("unknown_type", typo, [_mutated(ping(typo), unknown_type)]),
        ("bad_field", mistyped, [_mutated(ping(mistyped), wrong_field_type)]),
        # A record about `someone`, signed by `forger`.
        ("bad_signature", forging, [_gossip(forging, _record(someone, 1, signer=forger))]),
        # The sender's own record seq 5, then an older seq 3 replayed.
        (
            "stale_record",
            replaying,
            [_gossip(replaying, _record(replaying, 5)), _gossip(replaying, _record(replaying, 3))],
        ),
        # A well-formed ping that names `someone` as its sender: a member
        # speaking as another node.
        ("sender_not_peer", impostor, [ping(someone)]),
    ]


CORE_REASONS = ("bad_signature", "stale_record")
"""Well-formed messages the membership core refuses."""
NODE_REASONS = ("sender_not_peer",)
"""Well-formed messages the node refuses before its core sees them; the
rest fail to decode."""


def status_reason(reason: str) -> str:
    """How the status document names a drop: by its source, then the reason."""
    if reason in CORE_REASONS:
        return "membership." + reason
    return ("node." if reason in NODE_REASONS else "wire.") + reason


def test_bad_inputs_are_what_the_decoder_says() -> None:
    """The crafted bytes fail where the test means them to (pure, fast)."""
    for reason, sender, payloads in bad_inputs():
        if reason in CORE_REASONS or reason in NODE_REASONS:
            for payload in payloads:  # well-formed; the node or its core refuses them
                named = decode_envelope(payload).sender
                assert (named == sender.node_id) == (reason not in NODE_REASONS), reason
            continue
        with pytest.raises(DecodeError) as caught:
            decode_envelope(payloads[0])
        assert caught.value.reason == reason


def member_socket(context: zmq.Context, member: Identity, node: LocalNode) -> zmq.Socket:
    """A DEALER to `node`'s control plane that completes the CURVE
    handshake as `member`: it proves `member`'s plane key and names its id,
    as any member of an open swarm may."""
    keys = member.plane_keys()
    server_key = curve_public_key(bytes.fromhex(node.node_id))
    assert server_key is not None
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.curve_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.curve_secret)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    sock.setsockopt(zmq.METADATA, f"{NODE_ID_PROPERTY}:{keys.node_id.hex()}".encode())
    sock.connect(node.info["control"])
    return sock


HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


async def handshake_events(monitor: zmq.Socket, timeout: float) -> set[int]:
    """The events a socket's monitor reports until its first failed
    handshake, or until `timeout`."""
    seen: set[int] = set()
    with trio.move_on_after(timeout):
        while not any(event & HANDSHAKE_FAILED for event in seen):
            try:
                seen.add(recv_monitor_message(monitor, zmq.NOBLOCK)["event"])
            except zmq.Again:
                await trio.sleep(POLL_S)
    return seen


async def test_bad_input_is_dropped_counted_and_survived(swarm: LocalSwarm) -> None:
    nodes = await start_swarm(swarm, 2)
    target = nodes[0]
    cases = bad_inputs()
    expected = {status_reason(reason) for reason, _, _ in cases}
    context = zmq.Context()
    sockets = []
    try:
        # A plaintext peer cannot complete a handshake with the CURVE
        # plane, so none of its junk (every case's bytes) is ever read.
        plaintext = context.socket(zmq.DEALER)
        sockets.append(plaintext)
        plaintext.setsockopt(zmq.LINGER, 0)
        monitor = plaintext.get_monitor_socket()
        sockets.append(monitor)
        plaintext.connect(target.info["control"])
        # Its queue closes when the handshake fails (a race with these
        # sends): what it would not take was never going to be read either.
        with contextlib.suppress(zmq.Again):
            for _, _, payloads in cases:
                for payload in payloads:
                    plaintext.send(payload, flags=zmq.NOBLOCK)
        events = await handshake_events(monitor, 10.0)
        assert any(event & HANDSHAKE_FAILED for event in events), events
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events, events
        view = await swarm.status(target)
        assert view is not None
        assert not expected & set(view["drops"]), view["drops"]

        # The same junk from members, authenticated: read, then dropped and
        # counted. One connection per case, as from distinct hostile peers:
        # whatever one case does to its connection cannot hide the next.
        for _, sender, payloads in cases:
            sock = member_socket(context, sender, target)
            sockets.append(sock)
            for payload in payloads:
                sock.send(payload, flags=zmq.NOBLOCK)

        def counted(views: Views) -> bool:
            view = views.get(target.name)
            return view is not None and expected <= set(view["drops"])

        await wait_for(swarm, [target], counted, 10.0, f"drops counted for {sorted(expected)}")
    finally:
        for sock in sockets:
            sock.close(0)
        context.term()

    view = await swarm.status(target)
    assert view is not None
    for reason in expected:
        assert view["drops"][reason] >= 1, (reason, view["drops"])
    # Each undecodable payload went once over an authenticated connection
    # (no honest peer sends one): the plaintext copies were never read.
    for reason in expected - {status_reason(r) for r in CORE_REASONS + NODE_REASONS}:
        assert view["drops"][reason] == 1, (reason, view["drops"])
    # Still running and still a member of the swarm, in both directions.
    assert target.running
    await wait_for(swarm, nodes, all_see(nodes, nodes, "alive"), 5.0, "membership intact")
    await assert_no_internal_errors(swarm, nodes)
