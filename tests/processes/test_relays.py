"""Relays with real `shardmesh node` processes in the WAN lab (issue 29, item 3).

Three public sites run bare nodes: the founder and entry in `a`, relays in
`b` and `e`; two home sites, `c` behind a port-preserving NAT router and
`d` behind a symmetric one, serve the model's two halves. Nothing can dial
`c` or `d`: each learns it is behind NAT, reserves at two relays (its seed
`b` first, then `e`) and advertises `b`'s ports, so the swarm's own ping
reaches it and it becomes a member (docs/design/membership.md#introductions).
A greedy chat entered at `a` streams, over the chain c -> d (both reached
only through relays), the text transformers' greedy `generate` gives in
this process; a longer one still does when relay `b` is SIGKILLed after a
few chunks (the home nodes move to `e`). The entry, reachable, gets direct
paths past both NATs (`runtime.node.direct_paths`): the home nodes dial it
back. A capture in each relay's
namespace (`runtime.lab.capture`) shows that all it relayed was ZMTP with
CURVE, no plaintext header in it, or the home nodes' HTTP API: the entry
holds no copy of the model and fetches its tokenizer through the relay.
Root only: elsewhere it skips, saying why no lab can be built.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import trio

from runtime.cli.chat_client import sse_chunks
from runtime.cli.localswarm import LocalNode, LocalSwarm, SwarmError, Views, all_see
from runtime.lab.netns import Lab
from runtime.lab.topology import WAN_IF
from runtime.model.tiny import make_tiny_model
from tests.processes.test_inference import MESSAGES, MODEL, model_ready, reference_text
from tests.processes.test_wan import print_logs, streamed_text
from tests.runtime.lab.fixtures import MakeLab, make_lab  # noqa: F401 - the fixture
from tests.swarm_helpers import wait_for

SPEC = {
    "seed": 29,
    "link": {"delay_ms": 2, "jitter_ms": 0, "loss": 0.0},
    "sites": [
        {"name": "a"},
        {"name": "b"},
        {"name": "e"},
        {"name": "c", "nat": "port-preserving"},
        {"name": "d", "nat": "symmetric"},
    ],
}
"""2 ms one way on every access link."""
SPANS = {"c": "0:4", "d": "4:8"}
MAX_TOKENS = 24
LONG_TOKENS = 120
"""Long enough that the stream is still running when its relay is killed."""
KILL_AFTER_CHUNKS = 4
START_TIMEOUT_S = 40.0
"""Five interpreters starting at once on a loaded 2-core machine, two of
them importing torch."""
RELAYED_TIMEOUT_S = 30.0
"""The reachability verdict (a first round after a second, a silent
prober's five seconds), a reservation, and the join through the relay."""
COVERAGE_TIMEOUT_S = 40.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / MODEL, layers=8, name=MODEL)


def node_args(site: str, model_dir: Path) -> list[str]:
    """`a` is the entry: no relay (so the relay killed is not the entry)
    and no copy of the model: it fetches the tokenizer from the home nodes
    that serve it, through their relayed APIs; `b` and `e` relay; `c` and
    `d` serve."""
    if site == "a":
        return ["--no-relay"]
    if site in SPANS:
        return ["--model", str(model_dir), "--layers", SPANS[site]]
    return []


async def start_sites(swarm: LocalSwarm, model_dir: Path) -> list[LocalNode]:
    """a, b, e, c, d; the home nodes join through a and b (a offers no relay)."""
    nodes = [swarm.new_node(site, args=node_args(site, model_dir), site=site) for site in "abecd"]
    try:
        await swarm.start_ready(nodes[0], timeout=START_TIMEOUT_S)
        await swarm.start_many(nodes[1:3], [nodes[0].seed], timeout=START_TIMEOUT_S)
        await swarm.start_many(nodes[3:], [nodes[0].seed, nodes[1].seed], timeout=START_TIMEOUT_S)
    except SwarmError as exc:
        pytest.fail(str(exc))
    return nodes


def own_record(document: dict[str, Any] | None) -> dict[str, Any]:
    own = next((m for m in (document or {}).get("members", []) if m["self"]), None)
    return dict((own or {}).get("record") or {})


def relayed_twice(home: list[LocalNode], lab: Lab) -> Callable[[Views], bool]:
    """A check: each home node holds two relays, its own record says
    `relayed` at `b`'s ports (the first relay it reserved at: its seed) for
    both planes and its API, and names both relays, `b`'s first."""
    at_b, at_e = f"//{lab.address('b')}:", f"//{lab.address('e')}:"

    def check(views: Views) -> bool:
        for node in home:
            document = views.get(node.name) or {}
            record = own_record(document)
            addresses = record.get("addresses") or {}
            planes = [addresses.get(plane) or "" for plane in ("control", "data", "api")]
            if record.get("reach") != "relayed" or not all(at_b in p for p in planes):
                return False
            relayed = [at["control"] for at in addresses.get("relayed", [])]
            if len(relayed) < 2 or at_b not in relayed[0] or at_e not in relayed[1]:
                return False
        return True

    return check


def direct_from_entry(entry: LocalNode, home: list[LocalNode]) -> Callable[[Views], bool]:
    """A check: the entry (public) holds direct paths past both home NATs,
    each punched by reversal (the home node dials the entry): control to
    both, data to the first hop, the one it sends activations to."""
    wanted = [(home[0], "data"), (home[0], "control"), (home[1], "control")]

    def check(views: Views) -> bool:
        direct = ((views.get(entry.name) or {}).get("relays") or {}).get("direct") or {}
        paths = {(p["node"], p["plane"]) for p in direct.get("paths", [])}
        return all((node.node_id[:16], plane) in paths for node, plane in wanted)

    return check


async def stream_killing(entry: LocalNode, victim: LocalNode, tokens: int) -> str:
    """A greedy streamed chat at `entry`; `victim` SIGKILLed after a few chunks."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": tokens, "temperature": 0}
    parts: list[str] = []
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream(
            "POST", entry.api + "/v1/chat/completions", json={**body, "stream": True}
        ) as r,
    ):
        assert r.status_code == 200, await r.aread()
        async for chunk in sse_chunks(r):
            assert "error" not in chunk, chunk
            parts.extend(c["delta"].get("content") or "" for c in chunk["choices"])
            if len(parts) == KILL_AFTER_CHUNKS:
                victim.kill()
    return "".join(parts)


ZMTP_CURVE_GREETING: Final = re.compile(rb"\xff.{8}\x7f\x03\x01CURVE\x00{15}", re.DOTALL)
"""ZMTP 3.1's greeting: signature, version, then the mechanism, CURVE."""
RELAY_LINE: Final = re.compile(
    rb"(HELLO|RESERVE|RESERVED|ACCEPT|CONNECT|PING|PONG)( [0-9a-z.:]+)*\n"
)
"""A relay protocol line (fields: hex, ports, the IP a `RESERVED` saw)."""
HTTP_START: Final = re.compile(rb"(GET|POST|HEAD) /[^ ]* HTTP/1\.1\r\n|HTTP/1\.1 \d{3} ")
"""A relayed API flow: an HTTP/1.1 request line, or the response's status line."""
CHAT_WORDS: Final = MESSAGES[0]["content"].encode()
"""The prompt, which only ever travels to the entry (not relayed) and, as
token ids, inside CURVE."""
PLAINTEXT: Final = (b"session", b"float32")
"""What any data-plane header says in the clear (its CBOR keys and dtype)."""


def start_capture(lab: Lab, site: str, out: Path) -> subprocess.Popen[bytes]:
    """`runtime.lab.capture` on `site`'s WAN interface, once it is reading."""
    argv = [sys.executable, "-m", "runtime.lab.capture", WAN_IF, str(out)]
    proc = lab.spawn(site, argv, stdout=subprocess.PIPE, cwd=Path(__file__).parents[2])
    assert proc.stdout is not None and json.loads(proc.stdout.readline())["ready"]
    return proc


def relayed_flows(out: Path) -> dict[str, bytes]:
    """From one relay's capture, the payload of every flow it relays: the
    reservation and dial-back connections (after their protocol lines) and
    the connections to the public ports its `RESERVED` lines named."""
    flows = {key: bytes.fromhex(f["head"]) for key, f in json.loads(out.read_text()).items()}
    ports: set[str] = set()
    relayed: dict[str, bytes] = {}
    for key, head in flows.items():
        rest = head
        while (line := RELAY_LINE.match(rest)) is not None:
            if line.group(1) == b"RESERVED":
                ports.update(p.decode() for p in line.group(0).split()[1:-1])
            rest = rest[line.end() :]
        if rest is not head:
            relayed[key] = rest
    for key, head in flows.items():
        source, target = (end.rsplit(":", 1)[1] for end in key.split(">"))
        if source in ports or target in ports:
            relayed[key] = head
    return relayed


def assert_curve_or_http(out: Path) -> tuple[int, int]:
    """Every relayed flow that carried anything is either ZeroMQ (opens
    with a ZMTP CURVE greeting and shows no plaintext header) or a call
    between nodes on the HTTP API (`/v1/network/...`: public files, signed
    calls; plain HTTP, as it is when direct), never a chat; how many of
    each."""
    curve = http = 0
    for key, payload in relayed_flows(out).items():
        if not payload:
            continue  # a reservation: protocol lines only
        if HTTP_START.match(payload):
            paths = re.findall(rb"(?:GET|POST|HEAD) (/[^ ]*) HTTP/1\.1\r\n", payload)
            assert all(p.startswith(b"/v1/network/") for p in paths), f"{key}: {paths}"
            assert CHAT_WORDS not in payload, f"{key} carries the chat"
            http += 1
            continue
        assert ZMTP_CURVE_GREETING.match(payload), f"{key} is not ZMTP/CURVE: {payload[:64]!r}"
        assert not any(word in payload for word in PLAINTEXT), f"{key} carries plaintext"
        curve += 1
    return curve, http


async def test_home_nodes_behind_nat_serve_through_relays_and_survive_a_relay_killed(
    make_lab: MakeLab,  # noqa: F811 - the fixture
    model_dir: Path,
    tmp_path: Path,
) -> None:
    lab = make_lab(SPEC)
    captures = {site: tmp_path / f"capture-{site}.json" for site in ("b", "e")}
    sniffers = [start_capture(lab, site, out) for site, out in captures.items()]
    text, _ = reference_text(model_dir, MAX_TOKENS)
    long_text, _ = reference_text(model_dir, LONG_TOKENS)
    async with LocalSwarm(tmp_path / "swarm", profile="local", lab=lab) as swarm:
        nodes: list[LocalNode] = []
        try:
            nodes = await start_sites(swarm, model_dir)
            entry, relay, home = nodes[0], nodes[1], nodes[3:]
            took = await wait_for(
                swarm, nodes, relayed_twice(home, lab), RELAYED_TIMEOUT_S, "relayed"
            )
            alive = all_see(nodes, nodes, "alive")
            joined = await wait_for(swarm, nodes, alive, RELAYED_TIMEOUT_S, "all members")
            ready = model_ready(MODEL, nodes)
            covered = await wait_for(swarm, nodes, ready, COVERAGE_TIMEOUT_S, "cover")
            print(f"relayed {took:.1f} s after start; members {joined:.1f} s later")
            print(f"covered {covered:.1f} s later")
            assert await streamed_text(entry) == text
            took = await wait_for(swarm, [entry], direct_from_entry(entry, home), 15.0, "direct")
            print(f"the entry's direct paths {took:.1f} s after the first chat")
            for node in home:
                says = (await swarm.status(node) or {})["reachability"]["says"]
                assert says.startswith(
                    f"behind NAT: serving through relay tcp://{lab.address('b')}:"
                )
            offered = (await swarm.status(relay) or {})["relays"]["offered"]
            assert offered["reservations"] == 2 and offered["sessions"] > 0
            began = trio.current_time()
            assert await stream_killing(entry, relay, LONG_TOKENS) == long_text
            took = trio.current_time() - began
            chat = (await swarm.status(entry) or {})["chat"]
            print(f"the long stream, relay b killed mid-way: {took:.1f} s; entry's chat: {chat}")
            moved = await swarm.views(home)
            for node in home:
                control = own_record(moved[node.name])["addresses"]["control"]
                assert f"//{lab.address('e')}:" in control, "moved to its other relay"
            for sniffer in sniffers:
                sniffer.terminate()
                sniffer.wait(10)
            spliced = {site: assert_curve_or_http(out) for site, out in captures.items()}
            print(f"relayed flows captured (ZMTP/CURVE, HTTP): {spliced}")
            assert all(curve > 0 for curve, _ in spliced.values())
            assert spliced["b"][1] > 0, "the entry fetched the tokenizer through b"
        except BaseException:
            print_logs(nodes)
            for node, view in (await swarm.views([n for n in nodes if n.running])).items():
                print(f"relays at {node}: {(view or {}).get('relays')}")
            raise
