"""Direct paths past NAT, as trio tasks: punch, splice, fall back to the relay.

Each `TICK_S` the initiator looks at the members reached through relays
that this node's planes talk to, and `mesh.punch.DirectPaths` picks which
to punch. A punch asks the peer over its HTTP API (`PUNCH_PATH`, signed)
to meet this node, then both open one TCP connection (`mesh.punch`: the
peer dials back, or both dial at once). The punched stream is spliced to
a port on this machine's loopback, and the plane sends what it meant for
the peer's relayed address there (`mesh.transport.Plane.redirect`): ZMTP
and CURVE run end to end over it, as over a relay, so the peer still
proves its key. When the stream closes the redirect goes and the plane
reconnects through the relay; a failed punch changes nothing. The
answering side (`answer`) splices its end to its own plane, as a relay's
dial-back does.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import httpx
import trio

from mesh.identity import Signer, node_id_text
from mesh.punch import (
    PUNCH_PLANES,
    PUNCH_TIMEOUT_S,
    DirectPaths,
    Key,
    PunchBudget,
    PunchError,
    PunchPlane,
    PunchRequest,
    meeting_point,
    method_for,
)
from mesh.records import Addresses, RelayedAt
from mesh.transport import Plane as ZmqPlane
from runtime.node.hostport import HostPort, parse_hostport
from runtime.node.relay_server import STREAM_ERRORS, splice
from runtime.node.signed_http import sign_request

log = logging.getLogger("shardmesh.node")

PUNCH_PATH: Final = "/v1/network/punch"
MAX_PUNCH_BYTES: Final = 512
"""A punch request is four short JSON fields."""
TICK_S: Final = 1.0
"""How often the relayed peers this node talks to are looked at."""
REDIAL_PAUSE_S: Final = 0.2
"""Between two connects of a simultaneous open: a refused SYN (a host
that answered before its NAT opened) is retried this soon."""


class PunchRefused(Exception):
    """This node will not answer the punch now (`mesh.punch.PunchBudget`'s reason)."""


class DirectSwarm(Protocol):
    """What the driver reads of the swarm (`runtime.node.swarm_view.SwarmView`)."""

    node_id: bytes

    def records(self) -> list[tuple[Any, Any]]: ...
    def dial_addresses(self, node: bytes) -> Addresses | None: ...


@dataclass(frozen=True, slots=True)
class Reach:
    """How this node is reached now: `direct` (at `host`), `relayed` (its
    NAT seen at `host` by a relay), or `unknown` (`host` None)."""

    how: str
    host: str | None


class NodeDirectPaths:
    """One node's direct paths, both sides; `run` in its nursery."""

    def __init__(
        self,
        signer: Signer,
        swarm: DirectSwarm,
        planes: dict[PunchPlane, ZmqPlane],
        local: dict[PunchPlane, HostPort],
        reach: Callable[[], Reach],
    ) -> None:
        """`planes` send through the paths; `local` is where each plane
        listens on this machine (the answering end splices there); `reach`
        says how this node is reached now."""
        self._signer = signer
        self._swarm = swarm
        self._planes = planes
        self._local = local
        self._reach = reach
        self.book = DirectPaths()
        self.budget = PunchBudget()
        self._nursery: trio.Nursery | None = None
        self._carrying: dict[Key, trio.CancelScope] = {}
        """The paths in use, each cancelled when its peer leaves `run`'s view."""

    def peers(self) -> int:
        """Members this node holds a direct path with, on any plane."""
        return len({node for node, _ in self.book.direct()})

    def status(self) -> dict[str, Any]:
        """The status document's `relays.direct`."""
        return {
            "paths": [
                {"node": node_id_text(node)[:16], "plane": plane}
                for node, plane in self.book.direct()
            ],
            "counters": dict(self.book.counters + self.budget.counters),
        }

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Punch what is worth it, for ever; `started` once punches can be answered."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await trio.sleep(TICK_S)
                reach = self._reach()
                if reach.host is None:
                    continue
                relayed = self._relayed()
                self.book.forget(relayed)
                for key, carrying in list(self._carrying.items()):
                    if key[0] not in relayed:
                        carrying.cancel()  # gone, or reachable directly now
                wanted = [
                    (node, plane)
                    for node, addresses in relayed.items()
                    for plane in PUNCH_PLANES
                    if self._planes[plane].talks_to(_plane_address(addresses, plane))
                ]
                for key in self.book.to_try(wanted, trio.current_time()):
                    nursery.start_soon(self._punch, key, relayed[key[0]], reach)

    def _relayed(self) -> dict[bytes, Addresses]:
        """Alive members reached through relays: where this node dials them."""
        found = {}
        for view, record in self._swarm.records():
            if record is None or record.reach != "relayed" or str(view.state) != "alive":
                continue
            addresses = self._swarm.dial_addresses(view.node)
            if view.node != self._swarm.node_id and addresses is not None:
                found[view.node] = addresses
        return found

    # --- the initiator -----------------------------------------------------------

    async def _punch(self, key: Key, addresses: Addresses, reach: Reach) -> None:
        node, plane = key
        method = method_for(reach.how == "direct")
        assert reach.host is not None
        sock = _bound_socket(reach.host)
        try:
            port = sock.getsockname()[1]
            if method == "reverse":
                sock.listen(1)
            meet = await self._ask(addresses, PunchRequest(plane, method, reach.host, port))
            with trio.fail_after(PUNCH_TIMEOUT_S):
                if method == "reverse":
                    stream = await _accept_from(sock, meet[0])
                else:
                    stream = await simultaneous_open(port, *meet)
        except (
            trio.TooSlowError,
            PunchError,
            PunchRefused,
            httpx.HTTPError,
            *STREAM_ERRORS,
        ) as exc:
            self.book.failed(key, _reason(exc), trio.current_time())
            log.info("direct path to %s (%s) not punched: %r", node_id_text(node)[:12], plane, exc)
            return
        finally:
            sock.close()
        self.book.succeeded(key, method)
        log.info("direct path to %s (%s) by %s", node_id_text(node)[:12], plane, method)
        await self._carry(key, stream, addresses)

    async def _ask(self, addresses: Addresses, request: PunchRequest) -> tuple[str, int]:
        """POST the request to the peer's API; its meeting point."""
        if addresses.api is None:
            raise PunchError("the peer names no API to ask")
        content = json.dumps(request.to_json()).encode()
        headers = {
            "content-type": "application/json",
            **sign_request(self._signer, "POST", PUNCH_PATH, content, time.time()),
        }
        async with httpx.AsyncClient(timeout=PUNCH_TIMEOUT_S) as client:
            reply = await client.post(addresses.api + PUNCH_PATH, content=content, headers=headers)
        if reply.status_code == 429:
            raise PunchRefused(reply.text[:200])
        reply.raise_for_status()
        try:
            answer = reply.json()
        except ValueError:
            raise PunchError("the peer's answer is not JSON") from None
        return meeting_point(answer)

    async def _carry(self, key: Key, stream: trio.SocketStream, addresses: Addresses) -> None:
        """Splice `stream` to a loopback port the plane sends the peer's
        traffic to, until either closes, the plane leaves it unused as long
        as it keeps an idle connection, or the peer is no longer a relayed
        member (`run` cancels it); then the relay again."""
        plane = self._planes[key[1]]
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        via = HostPort("127.0.0.1", listener.socket.getsockname()[1]).zmq()
        targets = _all_addresses(addresses, key[1])
        with trio.CancelScope() as self._carrying[key]:
            try:
                for target in targets:
                    plane.redirect(target, via)
                with trio.move_on_after(plane.config.idle_disconnect_s):
                    local = await listener.accept()
                    await listener.aclose()
                    await splice(local, b"", stream, b"", counters=self.book.counters)
            finally:
                del self._carrying[key]
                for target in targets:
                    plane.redirect(target, None)
                self.book.lost(key, trio.current_time())
                log.info("direct path to %s (%s) closed", node_id_text(key[0])[:12], key[1])
                with trio.CancelScope(shield=True):
                    await listener.aclose()
                    await stream.aclose()

    # --- the answering side ------------------------------------------------------

    async def answer(self, requester: bytes, request: PunchRequest) -> dict[str, Any]:
        """Meet `requester` as it asks (the HTTP route calls this); the
        meeting point to answer with. `PunchRefused` if not now."""
        reach = self._reach()
        if reach.host is None or self._nursery is None:
            raise PunchRefused("this node does not know its public address yet")
        refusal = self.budget.admit(requester, request.plane, trio.current_time())
        if refusal is not None:
            raise PunchRefused(refusal)
        sock = _bound_socket(reach.host)
        port = sock.getsockname()[1]
        self._nursery.start_soon(self._meet, request, sock)
        return {"host": reach.host, "port": port}

    async def _meet(self, request: PunchRequest, sock: socket.socket) -> None:
        """Dial the asker back (`reverse`) or meet it from `sock`'s port at
        once (`simultaneous`), then splice the stream to our own plane."""
        port = sock.getsockname()[1]
        sock.close()  # it held the port answered with; the dial binds it again
        stream: trio.SocketStream | None = None
        try:
            with trio.fail_after(PUNCH_TIMEOUT_S):
                if request.method == "reverse":
                    stream = await trio.open_tcp_stream(request.host, request.port)
                else:
                    stream = await simultaneous_open(port, request.host, request.port)
                own = self._local[request.plane]
                plane = await trio.open_tcp_stream(own.host, own.port)
        except (trio.TooSlowError, *STREAM_ERRORS):
            self.budget.done(connected=False)
            if stream is not None:
                await stream.aclose()
            return
        self.budget.done(connected=True)
        await splice(stream, b"", plane, b"", counters=self.budget.counters)


def _plane_address(addresses: Addresses | RelayedAt, plane: PunchPlane) -> str:
    return str(getattr(addresses, plane))


def _all_addresses(addresses: Addresses, plane: PunchPlane) -> list[str]:
    """Every address the peer is reached at on `plane`: the advertised
    one and each relay's it holds (a chain may name any of them)."""
    found = [_plane_address(addresses, plane)]
    for at in addresses.relayed:
        if _plane_address(at, plane) not in found:
            found.append(_plane_address(at, plane))
    return found


def _any_host(host: str) -> tuple[socket.AddressFamily, str]:
    """The address family of `host`, and that family's wildcard to bind."""
    return (socket.AF_INET6, "::") if ":" in host else (socket.AF_INET, "0.0.0.0")


def _bound_socket(host: str) -> socket.socket:
    """A TCP socket bound to a free port, reusable at once (the
    simultaneous open binds the same port again)."""
    family, wildcard = _any_host(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((wildcard, 0))
    sock.setblocking(False)
    return sock


async def _accept_from(sock: socket.socket, host: str) -> trio.SocketStream:
    """The first connection to listening `sock` from `host` (the peer's
    public address); others are closed (CURVE would refuse them anyway)."""
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock.dup()))
    try:
        while True:
            stream = await listener.accept()
            if stream.socket.getpeername()[0] == host:
                return stream
            await stream.aclose()
    finally:
        await listener.aclose()


async def simultaneous_open(port: int, host: str, peer_port: int) -> trio.SocketStream:
    """Connect from local `port` to `host:peer_port` while the peer does the
    same towards us, until it takes (the caller bounds the time): a SYN
    refused or dropped before the other NAT opened is simply sent again."""
    family, wildcard = _any_host(host)
    while True:
        sock = trio.socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            await sock.bind((wildcard, port))
            await sock.connect((host, peer_port))
            return trio.SocketStream(sock)
        except OSError as exc:
            sock.close()
            if exc.errno not in (errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EHOSTUNREACH):
                raise
        await trio.sleep(REDIAL_PAUSE_S)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "timeout"
    if isinstance(exc, PunchRefused):
        return "refused"
    if isinstance(exc, PunchError | httpx.HTTPError):
        return "no_answer"
    return "connect_error"


def public_reach(reach: str, advertised: str, seen_as: str | None) -> Reach:
    """How this node is reached, for `NodeDirectPaths`: a direct node at
    its advertised host (if it is an IP: a meeting point names no DNS
    name), a relayed one at the address its relay saw."""
    if reach == "relayed":
        return Reach("relayed", seen_as)
    if reach == "direct":
        host = parse_hostport(advertised).host
        try:
            meeting_point({"host": host, "port": 1})
        except PunchError:
            return Reach("direct", None)
        return Reach("direct", host)
    return Reach("unknown", None)
