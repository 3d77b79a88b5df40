"""Attacks on Raft in real node processes on loopback, scripted.

Issue 14's "one message takes over consensus": a key that never joined, and
a key that joined as an ordinary member (never made eligible, so it is not
even a learner: it follows the ledger by the leader's notice),
send every node of a three-voter swarm an InstallSnapshot with a huge term
that names the attacker as the only voter, over an attacker's ledger, then
the same with garbage as the ledger, a vote request and an append with
that term. Nothing may move: no term, no configuration, no ledger; no node
crashes, and one restarts cleanly afterwards (nothing forged was persisted).

The ordinary member's id is made to sort first (a key starting with a zero
byte takes ~256 tries), the id the old autopilot promoted first: it never
enters the configuration while the eligible nodes vote.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import trio
import zmq

from consensus.codec import encode_raft
from consensus.commands import Found, SetPolicy, encode_command
from consensus.ledger import PlacementLedger
from consensus.log import Entry, EntryKind, Snapshot
from consensus.raft import AppendEntries, InstallSnapshot, Message, RequestVote, encode_config
from mesh.identity import KEY_FILE, Identity
from mesh.messages import (
    Alive,
    Consensus,
    Envelope,
    PushPull,
    alive_signing_bytes,
    consensus_signing_bytes,
)
from mesh.wire import encode_envelope
from runtime.cli.localswarm import LocalNode, LocalSwarm, Views
from tests.processes.test_node import member_socket
from tests.swarm_helpers import (
    START_TIMEOUT_S,
    assert_no_internal_errors,
    start_swarm,
    start_tiny_model_node,
    wait_for,
)

FORGED_TERM = 10**15
SETTLE_TIMEOUT_S = 40.0
"""Three voters promoted one at a time (2 s stabilization each, local
profile), and the low-id member added as a learner, on a loaded machine."""
WATCH_S = 6.0
"""How long the forged messages get to do harm before the views are read:
many election timeouts and several voter-policy rounds of the local profile."""


def low_id_identity(state_dir: Path) -> Identity:
    """A key whose node id starts with a zero byte, written where a node
    started on `state_dir` will load it (as an attacker would make one)."""
    while True:
        seed = os.urandom(32)
        identity = Identity.from_seed(seed)
        if identity.node_id[0] == 0:
            break
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(seed)
    return identity


def forged_messages(attacker: bytes, to: bytes) -> list[Message]:
    """Each a way one message used to take over or wedge a node."""
    ledger = PlacementLedger()
    ledger.apply(1, encode_command(Found(attacker, "open", time.time())))
    ledger.apply(2, encode_command(SetPolicy((("idle_release_s", 1.0),), time.time())))
    only_attacker = frozenset({attacker})
    takeover = Snapshot(10**6, FORGED_TERM, only_attacker, frozenset(), ledger.snapshot())
    garbage = Snapshot(10**6, FORGED_TERM, only_attacker, frozenset(), os.urandom(64))
    config = Entry(FORGED_TERM, 1, EntryKind.CONFIG, encode_config(only_attacker, frozenset()))
    return [
        InstallSnapshot(to=to, term=FORGED_TERM, leader=attacker, snapshot=takeover),
        InstallSnapshot(to=to, term=FORGED_TERM, leader=attacker, snapshot=garbage),
        RequestVote(
            to=to, term=FORGED_TERM, candidate=attacker, last_index=10**9, last_term=FORGED_TERM
        ),
        AppendEntries(
            to=to,
            term=FORGED_TERM,
            leader=attacker,
            prev_index=0,
            prev_term=0,
            entries=(config,),
            commit=1,
        ),
    ]


def send_forged(
    context: zmq.Context, attacker: Identity, nodes: list[LocalNode]
) -> list[zmq.Socket]:
    """Every forged message to every node, each signed by `attacker` and
    sent over a CURVE connection that proves its key (as an open swarm lets
    any key connect): only who the sender is can refuse them. The caller
    keeps the sockets until the messages are through: a socket that is
    garbage-collected closes, and with LINGER 0 drops what it still holds."""
    sockets = []
    for node in nodes:
        sock = member_socket(context, attacker, node)
        sockets.append(sock)
        for message in forged_messages(attacker.node_id, bytes.fromhex(node.node_id)):
            payload = encode_raft(message)
            signature = attacker.sign(consensus_signing_bytes(attacker.node_id, payload))
            envelope = Envelope(
                attacker.node_id, "tcp://127.0.0.1:9", Consensus(payload, signature)
            )
            sock.send(encode_envelope(envelope))
    return sockets


def raft_of(view: dict[str, Any] | None) -> dict[str, Any]:
    return (view or {}).get("raft", {})


async def test_forged_raft_messages_from_a_stranger_and_a_member_move_nothing(
    swarm: LocalSwarm,
) -> None:
    nodes = await start_swarm(swarm, 3)
    founder = nodes[0]
    mallory = swarm.new_node("mallory")
    member = low_id_identity(mallory.state_dir)
    await swarm.start_ready(mallory, [founder.seed], timeout=START_TIMEOUT_S)
    assert mallory.node_id == member.node_id.hex() < min(n.node_id for n in nodes)
    ids = {n.node_id for n in nodes}

    def settled(views: Views) -> bool:
        return all(
            set(raft_of(view)["voters"]) == ids and not raft_of(view)["learners"]
            for view in (views.get(n.name) for n in nodes)
            if view is not None
        ) and all(views.get(n.name) is not None for n in nodes)

    # Mallory is a member, but not eligible: not even a learner.
    await wait_for(swarm, nodes, settled, SETTLE_TIMEOUT_S, "3 eligible voters, mallory outside")
    before = await swarm.views(nodes)
    assert all(mallory.node_id not in raft_of(v)["eligible"] for v in before.values())

    def counted(reason: str, at_least: int = 1) -> Callable[[Views], bool]:
        return lambda views: all(
            (view or {}).get("drops", {}).get(f"raft.{reason}", 0) >= at_least
            for view in views.values()
        )

    context = zmq.Context()
    try:
        stranger = Identity.generate()
        sockets = send_forged(context, stranger, nodes)  # a key that never joined
        await wait_for(swarm, nodes, counted("not_in_configuration"), 20.0, "stranger refused")
        sockets += send_forged(context, member, nodes)  # a member of the swarm
        await wait_for(swarm, nodes, counted("not_in_configuration", 8), 20.0, "member refused")
        await trio.sleep(WATCH_S)  # time for harm: many election timeouts
    finally:
        context.destroy(linger=0)

    after = await swarm.views(nodes)
    for node in nodes:
        view = after[node.name]
        assert view is not None, f"{node.name} stopped answering\n{node.log_tail()}"
        assert view["term"] < 1000, (node.name, view["term"])
        assert set(view["raft"]["voters"]) == ids, node.name  # mallory never promoted
        assert view["leader"] in ids
        assert view["swarm"]["id"] == founder.node_id  # the ledger is the swarm's own
        assert "idle_release_s" not in view["policy_settings"]
    await assert_no_internal_errors(swarm, nodes)

    # The swarm still decides: an operator's policy change commits.
    async with httpx.AsyncClient(timeout=15) as client:
        headers = {**founder.admin_headers(), "content-type": "application/json"}
        with trio.fail_after(20):
            while True:
                answer = await client.post(
                    founder.api + "/v1/network/policy",
                    json={"idle_release_s": 900},
                    headers=headers,
                )
                if answer.status_code != 503:
                    break
                await trio.sleep(0.2)
        assert answer.status_code == 200 and answer.json()["accepted"], answer.text

    # Nothing forged reached a disk: a follower killed now restarts from its
    # store (a kill, not a graceful stop: a voter that leaves is removed from
    # the configuration at once, which would change what the store says).
    follower = next(n for n in nodes if n.node_id != after[founder.name]["leader"])
    follower.kill()
    await follower.wait_exit(10.0)
    await swarm.start_ready(follower, [founder.seed], timeout=START_TIMEOUT_S)
    view = await swarm.status(follower)
    assert view is not None and view["term"] < 1000
    assert set(view["raft"]["voters"]) == ids


async def shardmesh(*args: str) -> trio.CompletedProcess[bytes]:
    """One real `shardmesh` CLI process; its exit status and output."""
    command = [sys.executable, "-m", "runtime.cli", *args]
    return await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)


async def test_voters_lost_for_good_leave_a_hint_and_the_operator_refounds(
    swarm: LocalSwarm,
) -> None:
    founder, second = await start_swarm(swarm, 2, eligible=False)
    listed = await shardmesh("voters", "list", "--api", founder.api)
    assert listed.returncode == 0, listed.stderr
    assert "no failover" in listed.stderr.decode()  # one eligible node: the founder
    added = await shardmesh(
        "voters", "add", second.node_id, "--api", founder.api, "--state-dir", str(founder.state_dir)
    )
    assert added.returncode == 0, added.stderr
    assert f"{second.node_id[:12]} may become a voter" in added.stdout.decode()

    def two_voters(views: Views) -> bool:
        return all(len(raft_of(v).get("voters", [])) == 2 for v in views.values())

    await wait_for(swarm, [founder, second], two_voters, SETTLE_TIMEOUT_S, "two voters")
    founder.kill()  # gone for good: the quorum of two is lost with it

    def leaderless(views: Views) -> bool:
        view = views.get(second.name)
        return view is not None and view["leader"] is None

    await wait_for(swarm, [second], leaderless, SETTLE_TIMEOUT_S, "no leader")

    early = await shardmesh(
        "voters", "refound", "--api", second.api, "--state-dir", str(second.state_dir)
    )
    assert early.returncode == 1 and "waits" in early.stderr.decode()

    def hinted(views: Views) -> bool:
        return bool(raft_of(views.get(second.name)).get("refound_hint"))

    await wait_for(swarm, [second], hinted, SETTLE_TIMEOUT_S, "the refound hint")
    view = await swarm.status(second)
    assert view is not None and view["leader"] is None
    assert "shardmesh voters refound" in view["raft"]["refound_hint"]

    # Only the node's own operator may refound it.
    async with httpx.AsyncClient(timeout=10) as client:
        refused = await client.post(
            second.api + "/v1/network/refound", json={}, headers={**founder.admin_headers()}
        )
    assert refused.status_code == 401, refused.text

    done = await shardmesh(
        "voters", "refound", "--api", second.api, "--state-dir", str(second.state_dir)
    )
    assert done.returncode == 0, done.stderr
    assert "is the only voter" in done.stdout.decode()
    view = await swarm.status(second)
    assert view is not None and view["leader"] == second.node_id
    assert view["raft"]["voters"] == [second.node_id] and view["raft"]["refound_hint"] is None
    policy = await shardmesh(
        "policy", "--api", second.api, "--state-dir", str(second.state_dir),
        "--set", "idle_release_s=900",
    )  # fmt: skip
    assert policy.returncode == 0, policy.stderr


FAKE_KEYS = 1000
FLOOD_CHUNK = 200
"""Alive updates per push-pull: 200 signed updates stay well under a frame."""
FLOOD_WATCH_S = 12.0


async def test_a_thousand_fake_keys_change_no_configuration_and_chat_goes_on(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    """One process makes 1,000 keys and announces each as alive at an address
    of its own (signed by each key, as an Alive must be), through one member
    connection. The introduction bound makes a burst of them candidates
    (one introducer brings in 64 new ids a minute), none answers its ping,
    so none is ever a member (docs/design/membership.md#introductions), let
    alone eligible, so none enters Raft: the configuration and the leader's
    term do not move, and chat answers throughout."""
    entry = await start_tiny_model_node(swarm, tmp_path, "tiny")
    others = [swarm.new_node() for _ in range(2)]
    await swarm.start_many(others, [entry.seed], timeout=START_TIMEOUT_S)
    nodes = [entry, *others]
    await swarm.make_eligible(entry, others, timeout=START_TIMEOUT_S)

    def settled(views: Views) -> bool:
        return all(len(raft_of(v).get("voters", [])) == 3 for v in views.values())

    await wait_for(swarm, nodes, settled, SETTLE_TIMEOUT_S, "three voters")
    before = await swarm.views(nodes)
    term = before[entry.name]["term"]

    attacker = Identity.generate()
    fakes = [Identity.generate() for _ in range(FAKE_KEYS)]
    alives = [
        Alive(f.node_id, 1, f"tcp://127.0.0.1:{20000 + i}", f.sign(alive_signing_bytes(
            f.node_id, 1, f"tcp://127.0.0.1:{20000 + i}")))
        for i, f in enumerate(fakes)
    ]  # fmt: skip
    context = zmq.Context()
    try:
        sockets = [member_socket(context, attacker, node) for node in nodes]
        for sock in sockets:
            for start in range(0, FAKE_KEYS, FLOOD_CHUNK):
                states = tuple(alives[start : start + FLOOD_CHUNK])
                flood = PushPull(join=True, reply=False, states=states, records=())
                envelope = Envelope(attacker.node_id, "tcp://127.0.0.1:9", flood)
                sock.send(encode_envelope(envelope))
        fake_ids = {f.node_id.hex() for f in fakes}

        learned = 0  # the most fake ids any node held as members
        async with httpx.AsyncClient(timeout=30) as client:
            deadline = trio.current_time() + FLOOD_WATCH_S
            while trio.current_time() < deadline:
                answer = await client.post(
                    entry.api + "/v1/chat/completions",
                    json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 4, "temperature": 0},
                )  # fmt: skip
                assert answer.status_code == 200, answer.text
                views = await swarm.views(nodes)  # a status of 1,000 members each: not too often
                for node in nodes:
                    members = {m["node_id"] for m in (views[node.name] or {}).get("members", [])}
                    learned = max(learned, len(members & fake_ids))
                    raft = raft_of(views[node.name])
                    assert set(raft["voters"]) == {n.node_id for n in nodes}, node.name
                    assert not set(raft["learners"]) & fake_ids, node.name
                    # At most one election: a 2-core machine under the flood can
                    # stall a node past the local profile's 300 ms timeout once
                    # (the attack churned the term from 7 to 74).
                    assert views[node.name]["term"] <= term + 1, node.name
                    assert views[node.name]["leader"] in {n.node_id for n in nodes}
                await trio.sleep(1.0)
        # The introduction bound let a burst be candidates (64 a minute from
        # one introducer), never members: none of them answered a ping.
        assert learned == 0, learned
    finally:
        context.destroy(linger=0)
    await assert_no_internal_errors(swarm, nodes)
