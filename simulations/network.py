"""Simulated links between simulated nodes.

Every message a node sends goes through ``Network.send``; what the network
does to it is what the real network and the real receiving process would
do: latency with uniform or lognormal jitter (so datagrams reorder), loss
and duplication, optional per-link bandwidth, partitions and one-way cuts,
and a bounded inbound queue served at a fixed rate (paused nodes queue,
crashed ones drop). Nodes are small integers; the cluster maps addresses
to them. The model, point by point: docs/design/simulator.md.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from simulations.loop import EventLoop

Deliver = Callable[[int, Any], None]
"""deliver(destination index, message): hands one message to its node."""

SizeOf = Callable[[Any], int]
"""size_of(message) -> bytes on the wire."""

_LinkRule = tuple[frozenset[int], float, Callable[[], float], float | None]
"""A link set apart (`Network.set_link`): targets, loss, latency, bandwidth."""

# LAN defaults: a switched datacentre or home LAN has one-way delays of a few
# hundred microseconds to a couple of milliseconds under load.
LAN_BASE_LATENCY = 0.0005
LAN_JITTER = 0.0015

# WAN defaults: volunteers spread over a continent. 10 ms of propagation at
# minimum, plus a lognormal tail with a 30 ms median (sigma 0.6 puts the
# 99th percentile near 120 ms), which is what cross-ISP paths look like.
WAN_BASE_LATENCY = 0.010
WAN_JITTER_MEDIAN = 0.030
WAN_JITTER_SIGMA = 0.6

DEFAULT_QUEUE_CAPACITY = 1000
"""Inbound messages a node holds before dropping: ZeroMQ's default HWM."""

BYTE_SAMPLE_EVERY = 64
"""While bytes are not counted (`NetworkConfig.count_bytes`), one message
in this many of each type is encoded and measured, so the metrics' bytes
per type are always there: a message type's sizes vary little (a Gossip's
with its updates, which a systematic sample follows: within 3% of the
exact count per type on a 100-node run), and measuring one in 64 costs
nothing measurable where measuring every message costs half the run again."""

DEFAULT_SERVICE_TIME = 0.0001
"""Virtual seconds a node spends on one inbound control message (10k msg/s).

About what one Python process decoding CBOR and running the membership core
manages. Steady SWIM traffic is tens of messages per second per node, so the
queue only matters under bursts, pauses and overload, which is the point.
"""


@dataclass(frozen=True)
class NetworkConfig:
    """How simulated links behave. All times are seconds of virtual time."""

    base_latency: float = LAN_BASE_LATENCY
    """The fixed part of every one-way delay."""
    jitter: float = LAN_JITTER
    """Uniform: the width of the jitter interval. Lognormal: its median."""
    jitter_kind: Literal["uniform", "lognormal"] = "uniform"
    """How the random part of a delay is drawn (lognormal: WAN's long tail)."""
    jitter_sigma: float = WAN_JITTER_SIGMA
    """Shape of the lognormal jitter; unused for uniform jitter."""
    loss: float = 0.0
    """Probability in [0, 1] that a message is lost, per message."""
    duplicate: float = 0.0
    """Probability in [0, 1] that a message is delivered twice."""
    queue_capacity: int = DEFAULT_QUEUE_CAPACITY
    """Messages a node's inbound queue holds; more are dropped (queue_full)."""
    service_time: float = DEFAULT_SERVICE_TIME
    """Virtual seconds a node spends on one inbound message."""
    count_bytes: bool = False
    """Measure every message's encoded size (costs an encode per message)."""
    bandwidth: float | None = None
    """Bytes per second each directed link transmits (unlimited when not
    set, None). When set, a message waits for the ones before it on its
    link and takes its encoded size / bandwidth to transmit (costs an
    encode per message)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.loss <= 1.0 or not 0.0 <= self.duplicate <= 1.0:
            raise ValueError("loss and duplicate are probabilities in [0, 1]")
        if self.base_latency < 0 or self.jitter < 0 or self.service_time < 0:
            raise ValueError("latencies and service time must be non-negative")
        if self.queue_capacity < 1:
            raise ValueError("queue_capacity must be at least 1")
        if self.jitter_kind not in ("uniform", "lognormal"):
            raise ValueError(f"unknown jitter_kind {self.jitter_kind!r}")
        if self.jitter_sigma < 0:
            raise ValueError("jitter_sigma must be non-negative")
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise ValueError("bandwidth must be positive (or None: unlimited)")

    @classmethod
    def lan(cls, **overrides: Any) -> NetworkConfig:
        """0.5-2 ms one-way, uniform jitter; override any field by keyword."""
        return replace(cls(), **overrides)

    @classmethod
    def wan(cls, **overrides: Any) -> NetworkConfig:
        """10 ms + lognormal(median 30 ms) one-way; override any field."""
        base = cls(
            base_latency=WAN_BASE_LATENCY,
            jitter=WAN_JITTER_MEDIAN,
            jitter_kind="lognormal",
            jitter_sigma=WAN_JITTER_SIGMA,
        )
        return replace(base, **overrides)

    @classmethod
    def profile(cls, name: str, **overrides: Any) -> NetworkConfig:
        """``lan`` or ``wan`` by name (scenario files name their profile)."""
        if name == "lan":
            return cls.lan(**overrides)
        if name == "wan":
            return cls.wan(**overrides)
        raise ValueError(f"unknown network profile {name!r} (lan, wan)")


LINK_FIELDS: frozenset[str] = frozenset(
    {"base_latency", "jitter", "jitter_kind", "jitter_sigma", "loss", "bandwidth"}
)
"""The `NetworkConfig` fields one link may set apart (`Network.set_link`):
what a path's length, quality and capacity decide. Duplication, the inbound
queue and byte counting belong to the network or the receiving node."""


@dataclass
class Partition:
    """One scheduled partition; ``active`` between ``start`` and ``heal``."""

    groups: tuple[tuple[int, ...], ...]
    start: float
    heal: float
    active: bool = False


@dataclass
class Cut:
    """One scheduled one-way cut: messages from `sources` to `targets` are
    lost while it is active (the reverse direction still works)."""

    sources: frozenset[int]
    targets: frozenset[int]
    start: float
    heal: float
    active: bool = False


@dataclass
class _Inbox:
    """A node's inbound side: its queue and service state."""

    queue: deque[Any] = field(default_factory=deque)
    busy_until: float = -math.inf
    draining: bool = False
    """A drain event is on the heap (so at most one is)."""
    paused: bool = False
    crashed: bool = False


class Network:
    """Links, partitions and inbound queues for ``n`` nodes (see module doc)."""

    def __init__(
        self,
        loop: EventLoop,
        config: NetworkConfig,
        rng: random.Random,
        deliver: Deliver,
        n: int = 0,
        size_of: SizeOf | None = None,
        sample_bytes: bool = False,
    ) -> None:
        self.loop = loop
        self.config = config
        self._rng = rng
        self._deliver = deliver
        if size_of is None:
            size_of = wire_size
        self._size_of = size_of if config.count_bytes else None
        self._measure = size_of
        self._sampling = sample_bytes and self._size_of is None
        """Whether to measure a sample of what it does not count
        (`BYTE_SAMPLE_EVERY`): for messages `size_of` can size."""
        """How bandwidth sizes a message; called only for links that have a
        bandwidth, so the unlimited default never encodes anything."""
        self._link_free: dict[tuple[int, int], float] = {}
        """Per directed link with a bandwidth, when it finishes transmitting
        what was sent on it so far (the next message starts then)."""
        self.sent_messages: list[int] = []
        self.sent_bytes: list[int] = []
        self.received_messages: list[int] = []
        self.sent_by_type: Counter[str] = Counter()
        """Messages sent, by the type of what they carry (Ping, Gossip, ...)."""
        self.bytes_by_type: Counter[str] = Counter()
        """The same in bytes, when the network counts bytes."""
        self.sampled_bytes: Counter[str] = Counter()
        self.sampled_messages: Counter[str] = Counter()
        """Bytes and count of the messages of each type measured while the
        network does not count bytes: every `BYTE_SAMPLE_EVERY`-th of each
        type, starting with the first (`estimated_bytes_by_type`)."""
        self.drops: Counter[str] = Counter()
        self.duplicated = 0
        """Extra copies the network made (not drops, so counted apart)."""
        self.partitions: list[Partition] = []
        self.cuts: list[Cut] = []
        self._blocked: dict[int, list[frozenset[int]]] | None = None
        """Per source node, the target sets active cuts block; None while no
        cut is active (the common, fast case)."""
        self._inboxes: list[_Inbox] = []
        self._group_key: list[int] | None = None
        """Per node, a key equal for two nodes iff no active partition splits
        them; None while no partition is active (the common, fast case)."""
        self._latency = self._make_latency(config, rng)
        self._links: dict[int, list[_LinkRule]] = {}
        """Per source node, (targets, loss, latency, bandwidth) of the links
        set apart from the config (`set_link`); the first that names a
        target wins."""
        for _ in range(n):
            self.add_node()

    @staticmethod
    def _make_latency(config: NetworkConfig, rng: random.Random) -> Callable[[], float]:
        base, jitter = config.base_latency, config.jitter
        if config.jitter_kind == "uniform":
            uniform = rng.random
            return lambda: base + jitter * uniform()
        if jitter == 0:
            return lambda: base
        mu, sigma = math.log(jitter), config.jitter_sigma
        lognormal = rng.lognormvariate
        return lambda: base + lognormal(mu, sigma)

    def add_node(self) -> int:
        """Add a node; returns its index."""
        self.sent_messages.append(0)
        self.sent_bytes.append(0)
        self.received_messages.append(0)
        self._inboxes.append(_Inbox())
        if self._group_key is not None:
            self._recompute_groups()
        return len(self._inboxes) - 1

    @property
    def size(self) -> int:
        return len(self._inboxes)

    # --- sending ----------------------------------------------------------

    def send(self, src: int, dst: int, message: Any) -> None:
        """Put ``message`` on the link from ``src`` to ``dst``: it arrives
        after its latency, plus, on a link with a bandwidth, its wait for the
        link and its transmission (``_transmit``)."""
        self.sent_messages[src] += 1
        kind = type(getattr(message, "message", message)).__name__
        self.sent_by_type[kind] += 1
        size = None
        if self._size_of is not None:
            size = self._size_of(message)
            self.sent_bytes[src] += size
            self.bytes_by_type[kind] += size
        elif self._sampling and self.sent_by_type[kind] % BYTE_SAMPLE_EVERY == 1:
            size = self._measure(message)
            self.sampled_bytes[kind] += size
            self.sampled_messages[kind] += 1
        config = self.config
        random_ = self._rng.random
        loss, latency, bandwidth = config.loss, self._latency, config.bandwidth
        if self._links:
            for targets, link_loss, link_latency, link_bandwidth in self._links.get(src, ()):
                if dst in targets:
                    loss, latency, bandwidth = link_loss, link_latency, link_bandwidth
                    break
        departs = self.loop.now
        if bandwidth is not None:
            if size is None:
                size = self._measure(message)
            departs = self._transmit(src, dst, size, bandwidth)
        if loss and random_() < loss:
            self.drops["loss"] += 1
            return
        keys = self._group_key
        if keys is not None and keys[src] != keys[dst]:
            self.drops["partition"] += 1
            return
        if self._blocked is not None and self._is_cut(src, dst):
            self.drops["cut"] += 1
            return
        post = self.loop.post
        item = (src, dst, message)
        post(departs + latency(), self._arrive, item)
        if config.duplicate and random_() < config.duplicate:
            self.duplicated += 1
            post(departs + latency(), self._arrive, item)

    def estimated_bytes_by_type(self) -> dict[str, float]:
        """Bytes sent per message type: exact when the network counts
        bytes, otherwise each type's count times the mean size of its
        sampled messages (`BYTE_SAMPLE_EVERY`)."""
        if self._size_of is not None:
            return {kind: float(size) for kind, size in self.bytes_by_type.items()}
        return {
            kind: count * self.sampled_bytes[kind] / self.sampled_messages[kind]
            for kind, count in self.sent_by_type.items()
            if self.sampled_messages[kind]
        }

    def _transmit(self, src: int, dst: int, size: int, bandwidth: float) -> float:
        """When a message of ``size`` bytes sent now has left ``src`` for
        ``dst``: after everything sent before it on that link, plus its own
        size / bandwidth (its latency comes on top).

        Trade-offs, to keep the model one float per link: the sender's queue
        is unbounded (an overloaded link shows as growing delay, never as
        send-side drops), each directed link has its own capacity (a node
        sending to many peers is not limited by one shared uplink), and a
        message lost or cut off on the way still took its transmission time,
        as it does on a real wire.
        """
        key = (src, dst)
        start = self._link_free.get(key, -math.inf)
        now = self.loop.now
        if start < now:
            start = now
        done = start + size / bandwidth
        self._link_free[key] = done
        return done

    # --- receiving --------------------------------------------------------

    def _arrive(self, item: tuple[int, int, Any]) -> None:
        src, dst, message = item
        keys = self._group_key
        if keys is not None and keys[src] != keys[dst]:
            self.drops["partition"] += 1
            return
        if self._blocked is not None and self._is_cut(src, dst):
            self.drops["cut"] += 1
            return
        inbox = self._inboxes[dst]
        if inbox.crashed:
            self.drops["crashed"] += 1
            return
        now = self.loop.now
        if inbox.paused or inbox.queue or inbox.busy_until > now:
            if len(inbox.queue) >= self.config.queue_capacity:
                self.drops["queue_full"] += 1
                return
            inbox.queue.append(message)
            if not inbox.paused and not inbox.draining:
                inbox.draining = True
                self.loop.post(inbox.busy_until, self._drain, dst)
            return
        inbox.busy_until = now + self.config.service_time
        self.received_messages[dst] += 1
        self._deliver(dst, message)

    def _drain(self, dst: int) -> None:
        inbox = self._inboxes[dst]
        if inbox.paused or inbox.crashed or not inbox.queue:
            inbox.draining = False
            return
        message = inbox.queue.popleft()
        inbox.busy_until = self.loop.now + self.config.service_time
        if inbox.queue:
            self.loop.post(inbox.busy_until, self._drain, dst)
        else:
            inbox.draining = False
        self.received_messages[dst] += 1
        self._deliver(dst, message)

    def queued(self, node: int) -> int:
        """Messages waiting in ``node``'s inbound queue."""
        return len(self._inboxes[node].queue)

    # --- node lifecycle ---------------------------------------------------

    def crash(self, node: int) -> None:
        """Drop the node's queue and everything that arrives from now on."""
        inbox = self._inboxes[node]
        inbox.crashed = True
        if inbox.queue:
            self.drops["crashed"] += len(inbox.queue)
            inbox.queue.clear()

    def revive(self, node: int) -> None:
        """A restarted process: empty queue, accepting messages again."""
        self._inboxes[node] = _Inbox(busy_until=self.loop.now)

    def is_crashed(self, node: int) -> bool:
        return self._inboxes[node].crashed

    def pause(self, node: int) -> None:
        """Stop serving the queue; arrivals keep queueing up to the bound."""
        self._inboxes[node].paused = True

    def resume(self, node: int) -> None:
        """Serve the queue again, at the service rate, from now."""
        inbox = self._inboxes[node]
        inbox.paused = False
        if inbox.queue and not inbox.draining and not inbox.crashed:
            inbox.draining = True
            self.loop.post(max(inbox.busy_until, self.loop.now), self._drain, node)

    def is_paused(self, node: int) -> bool:
        return self._inboxes[node].paused

    # --- partitions -------------------------------------------------------

    def schedule_partition(
        self, groups: Iterable[Iterable[int]], start: float, heal: float = math.inf
    ) -> Partition:
        """Split the nodes into ``groups`` from ``start`` until ``heal``.

        Nodes in no group form one more group together. Partitions may
        overlap in time; two nodes can talk only if every active partition
        has them in the same group.
        """
        frozen = tuple(tuple(sorted(set(group))) for group in groups)
        if heal <= start:
            raise ValueError("a partition must heal after it starts")
        partition = Partition(frozen, start, heal)
        self.partitions.append(partition)
        self.loop.call_at(start, lambda: self._set_active(partition, True))
        if heal != math.inf:
            self.loop.call_at(heal, lambda: self._set_active(partition, False))
        return partition

    def heal_all(self) -> None:
        """End every partition and cut in force now; ones scheduled later still start."""
        faults: list[Partition | Cut] = [*self.partitions, *self.cuts]
        for fault in faults:
            if fault.active:
                fault.heal = self.loop.now
                fault.active = False
        self._recompute_groups()
        self._blocked = None

    def _set_active(self, partition: Partition, active: bool) -> None:
        partition.active = active
        self._recompute_groups()

    def _recompute_groups(self) -> None:
        active = [p for p in self.partitions if p.active]
        if not active:
            self._group_key = None
            return
        lookups = []
        for partition in active:
            lookup = dict.fromkeys(range(self.size), len(partition.groups))
            for number, group in enumerate(partition.groups):
                for node in group:
                    lookup[node] = number
            lookups.append(lookup)
        interned: dict[tuple[int, ...], int] = {}
        self._group_key = [
            interned.setdefault(tuple(lookup[node] for lookup in lookups), len(interned))
            for node in range(self.size)
        ]

    def can_reach(self, src: int, dst: int) -> bool:
        """True when no active partition or cut stops ``src`` reaching ``dst``."""
        keys = self._group_key
        if keys is not None and keys[src] != keys[dst]:
            return False
        return self._blocked is None or not self._is_cut(src, dst)

    # --- links unlike the rest ---------------------------------------------

    def set_link(self, sources: Iterable[int], targets: Iterable[int], **fields: Any) -> None:
        """Give the links from ``sources`` to ``targets`` their own values of
        the config's ``LINK_FIELDS`` (one way; a field not given keeps the
        config's, and ``bandwidth=None`` makes them unlimited), e.g. a
        lognormal latency for a group of far-away nodes. Set before the run;
        a link named by several calls takes the first."""
        unknown = sorted(set(fields) - LINK_FIELDS)
        if unknown:
            raise ValueError(f"a link cannot set {', '.join(unknown)}")
        config = replace(self.config, **fields)  # validates the values like any config
        latency = self._make_latency(config, self._rng)
        rule = (frozenset(targets), config.loss, latency, config.bandwidth)
        for source in sources:
            self._links.setdefault(source, []).append(rule)

    # --- one-way cuts -----------------------------------------------------

    def schedule_cut(
        self, sources: Iterable[int], targets: Iterable[int], start: float, heal: float = math.inf
    ) -> Cut:
        """Lose every message from ``sources`` to ``targets`` from ``start``
        until ``heal``; ``targets`` still reach ``sources``. Cuts and
        partitions combine: a message must pass all of them."""
        if heal <= start:
            raise ValueError("a cut must heal after it starts")
        cut = Cut(frozenset(sources), frozenset(targets), start, heal)
        self.cuts.append(cut)
        self.loop.call_at(start, lambda: self._set_cut(cut, True))
        if heal != math.inf:
            self.loop.call_at(heal, lambda: self._set_cut(cut, False))
        return cut

    def _set_cut(self, cut: Cut, active: bool) -> None:
        cut.active = active
        blocked: dict[int, list[frozenset[int]]] = {}
        for each in self.cuts:
            if each.active:
                for source in each.sources:
                    blocked.setdefault(source, []).append(each.targets)
        self._blocked = blocked or None

    def _is_cut(self, src: int, dst: int) -> bool:
        assert self._blocked is not None
        return any(dst in targets for targets in self._blocked.get(src, ()))


def wire_size(message: Any) -> int:
    """Encoded size of an envelope on the real wire (``mesh.wire``).

    Imported lazily so the simulator does not depend on the wire codec when
    byte counting is off.
    """
    from mesh.wire import encode_envelope

    return len(encode_envelope(message))
