"""What `shardmesh node` was asked to do, and the two planes it binds.

`NodeOptions` is the daemon's whole input (the CLI builds it from flags);
`open_node_planes` binds the control and data planes it names;
`NodeStartupError` is how any start-up step says the node cannot start.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import zmq

from mesh.identity import PlaneKeys
from mesh.transport import Plane, open_planes
from mesh.wire import MAX_CONTROL_MESSAGE_BYTES
from runtime.model.hub import HubSource
from runtime.node.admission import ServeOptions
from runtime.node.hostport import HostPort, Seed, parse_hostport

log = logging.getLogger("shardmesh.node")

PROFILES: Final = ("lan", "wan", "local")
SWARM_MODES: Final = ("open", "private")

CONTROL_FRAME_HEADROOM: Final = 64 * 1024
"""libzmq refuses a frame over the transport's limit by dropping the whole
connection, before anything is read: nothing can count it. Setting that
limit a little above the wire's decode cap means a frame just over the cap
is read and refused by `mesh.wire` as `oversized` (counted, visible in the
status API), while a grossly oversized one is still cut off by libzmq
without ever being buffered. Memory per message stays bounded either way."""
CONTROL_FRAME_LIMIT: Final = MAX_CONTROL_MESSAGE_BYTES + CONTROL_FRAME_HEADROOM


class NodeStartupError(Exception):
    """The node could not start (an address in use, a bad bind address)."""


def first_leaf(group: BaseExceptionGroup) -> BaseException:
    """The first exception at the bottom of `group`'s nesting: a start-up
    failure raised inside nurseries arrives wrapped, the CLI prints one line."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


@dataclass(frozen=True)
class Provision:
    """What `shardmesh serve` was asked to serve."""

    model_dir: Path
    """The model folder: the local model, or where a hub model's files go."""
    hub: HubSource | None = None
    """`--model hf:REPO[@REVISION]`; its metadata is in `model_dir` already
    (the command fetched it before the node started)."""
    name: str | None = None
    """`--name`: the model's name if this node builds its manifest (default:
    the repository's name, else the folder's)."""


@dataclass(frozen=True)
class NodeOptions:
    """Everything `shardmesh node` was asked to do."""

    listen: HostPort
    state_dir: Path
    api: HostPort | None = None
    """`--api`; None: a free port on 127.0.0.1, or, with `--advertise`, on
    the `--listen` host, since an advertised API must be reachable where
    it is advertised (`api_bind`)."""
    joins: tuple[Seed, ...] = ()
    profile: str = "lan"
    data_listen: HostPort | None = None
    advertise: str | None = None
    fault_injection: bool = False
    """Serve `POST /v1/debug/faults` (tests cut a node off the control
    plane with it). Off by default: it lets anyone who reaches the API
    partition the node."""
    swarm: str = "open"
    """`--swarm`: the mode a founding node gives the swarm (`open` or
    `private`); ignored by a node that joins (the founder decided)."""
    invite: str | None = None
    """`--invite TOKEN`: redeem this invitation to a private swarm, then join
    through the inviter it names."""
    encrypted: bool = True
    """CurveZMQ on both planes. Off (`--insecure-plaintext`, hidden) only to
    measure what encryption costs: such a node can talk only to other
    plaintext nodes, and takes every peer's id on trust."""
    serve: ServeOptions | None = None
    """The operator's pinned shard (`--model --layers --recipe`), if any."""
    models: Path | None = None
    """The local model store (`--models STORE`): what the placement leader
    may ask this node to load."""
    backend: str | None = None
    """`--backend` (default: the platform's) for managed shards and the
    capacity a model-less node offers."""
    auto_join: bool = False
    """`--auto-join`: take the placement's best gap as a bootstrap assignment."""
    recipe: str | None = None
    """`--recipe` for an auto-joined shard (the operator's pinned shard has
    its own, in `serve`); None: the suggestion's, the model's stored precision."""
    max_memory: int | None = None
    """`--max-memory`: the most bytes a model-less node offers placement
    (None: whatever memory is free when it starts)."""
    provision: Provision | None = None
    """`shardmesh serve`: the model folder this node makes servable and
    offers its capacity for (`runtime.node.provision`); with `auto_join`."""
    max_chats_per_client: int | None = None
    """`--max-chats-per-client`: chats one HTTP client may run at once on
    this node (None: `runtime.api.quota.MAX_CONCURRENT_PER_CLIENT`)."""
    relay: bool = True
    """Offer to relay for nodes behind NAT (`--no-relay` turns it off;
    `runtime.node.relays`)."""
    relay_port: int | None = None
    """`--relay-port`: where reservations come in (None: the control port
    plus `mesh.relay.RELAY_PORT_OFFSET`, so seeds are found without it)."""

    def __post_init__(self) -> None:
        if self.swarm not in SWARM_MODES:
            raise ValueError(f"unknown swarm mode {self.swarm!r}; use one of {SWARM_MODES}")
        if self.provision is not None and (self.serve is not None or not self.auto_join):
            raise ValueError("a served model folder takes its span by auto-join, never pinned")
        if self.max_memory is not None and self.max_memory < 1:
            raise ValueError(f"--max-memory {self.max_memory}: must be at least one byte")
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; use one of {', '.join(PROFILES)}")
        if self.listen.is_wildcard and not self.advertise:
            raise ValueError(
                f"--listen {self.listen.text()} listens on every interface; peers need one "
                "address to reach this node: give --advertise HOST"
            )

    @property
    def api_bind(self) -> HostPort:
        """Where the HTTP API listens (see `api`)."""
        if self.api is not None:
            return self.api
        return HostPort(self.listen.host if self.advertise else "127.0.0.1", 0)

    def seed_addresses(self) -> list[tuple[bytes, str]]:
        """(node id, control address) of each node this one joins through."""
        return [(seed.node, seed.at.zmq()) for seed in self.joins]

    def advertised(self, address: str) -> str:
        """The address peers should use: the bound one, with the host
        replaced when the node listens on a wildcard."""
        if not self.advertise:
            return address
        return HostPort(self.advertise, parse_hostport(address).port).zmq()


@asynccontextmanager
async def open_node_planes(
    options: NodeOptions, drops: Counter[str], keys: PlaneKeys
) -> AsyncIterator[tuple[Plane, Plane]]:
    """The control and data planes, encrypted under the node's keys; a bind
    failure becomes a NodeStartupError naming the addresses (errors after
    start-up pass)."""
    if not options.encrypted:
        log.warning("--insecure-plaintext: the planes are NOT encrypted or authenticated")
    listen = options.listen.zmq()
    data_listen = (options.data_listen or HostPort(options.listen.host, 0)).zmq()
    entered = False
    try:
        async with open_planes(
            listen,
            data_listen,
            drops=drops,
            keys=keys,
            encrypted=options.encrypted,
            control_max_message_bytes=CONTROL_FRAME_LIMIT,
        ) as planes:
            entered = True
            yield planes
    except zmq.ZMQError as exc:
        if entered:
            raise
        raise NodeStartupError(f"cannot listen on {listen} / {data_listen}: {exc}") from exc
