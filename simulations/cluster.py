"""Many real membership cores on one simulated network.

``MembershipCluster`` runs n instances of the real ``mesh.membership``
protocol object, each with its own simulated identity and random stream, and
drives them exactly as the trio node does: inbound messages go to
``receive``, timers to ``tick`` at ``next_deadline()``, and after every step
the node's sends go onto the simulated network and its events into the trace.
Nothing here reaches into the core's private state; everything is measured
through its public API and its events.

What the cluster adds is the outside world: when nodes start, crash, pause,
restart, leave and get partitioned, and what the swarm looked like while it
happened (spread of a record, time to detect a crash, false accusations,
messages and bytes). Every run is reproducible from its seed; the trace
digest is what "run each seed twice and compare" compares.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Literal

from mesh.config import MembershipConfig
from mesh.member_table import GONE_STATES, LIVE_STATES, StartingView
from mesh.membership import MemberEvent, Membership
from mesh.messages import Alive, Envelope, alive_signing_bytes
from simulations.clock import NodeClock
from simulations.loop import EventLoop, Timer
from simulations.network import Cut, Network, NetworkConfig, Partition, SizeOf
from simulations.seeds import component_rng
from simulations.signing import SimSigner, sim_verify

JoinMode = Literal["seed", "preconverged"]

ADDR_PREFIX = "sim://"

DEFAULT_STAGGER = 0.01
"""Seconds between node starts in ``join="seed"`` mode: 1,000 nodes join
over 10 s, a brisk but not instantaneous ramp (each join is a full-state
exchange with a seed, which a real seed would not serve 1,000 of at once)."""

DEFAULT_SEEDS = 1
"""Nodes others join through in ``join="seed"`` mode (the first k started)."""

LEAVE_LINGER = 2.0
"""Seconds a leaving node keeps running after ``leave`` before it exits.

A real process that leaves gossips its farewell for a few rounds before it
shuts down (memberlist's Leave waits for its broadcast); ten LAN gossip
rounds is enough for the farewell to be out of its hands."""

DEFAULT_RECORD_SIZE = 1024
"""Bytes of body in a record ``publish`` makes: a realistic node record
(addresses, capability report, models, demand) encodes to about 1 KiB."""


AGREEMENT_OBSERVERS = 100
"""Observers sampled by ``view_agreement``: 100 x n lookups is well under a
second at 10,000 nodes, and 100 independent views catch any split."""


class NodeStatus(StrEnum):
    """What the simulated process is doing (not what anyone thinks of it)."""

    NOT_STARTED = "not_started"
    UP = "up"
    PAUSED = "paused"
    CRASHED = "crashed"
    LEFT = "left"


Verdict = tuple[float, int, str, int, int]
"""(time, observer, kind, subject, incarnation): one node's changed belief."""


class _Verdicts:
    """Every verdict of a run, in order, stored by column.

    A healed partition makes every node change its mind about every node
    across, a few times over: 2.3 million verdicts at 1,000 nodes, which as
    tuples of Python objects took some 370 MB. Columns of machine numbers
    take 25 bytes a verdict."""

    KINDS: tuple[str, ...] = ("suspect", "dead", "left", "alive", "twin")
    """The kinds a verdict can have (`MemberEvent`'s but "joined" and "record")."""

    def __init__(self) -> None:
        self._at = array("d")
        self._observer = array("i")
        self._kind = array("B")
        self._subject = array("i")
        self._incarnation = array("q")
        self._code = {kind: code for code, kind in enumerate(self.KINDS)}

    def append(self, at: float, observer: int, kind: str, subject: int, incarnation: int) -> None:
        self._at.append(at)
        self._observer.append(observer)
        self._kind.append(self._code[kind])
        self._subject.append(subject)
        self._incarnation.append(incarnation)

    def __iter__(self) -> Iterator[Verdict]:
        kinds = self.KINDS
        for at, observer, kind, subject, incarnation in zip(
            self._at, self._observer, self._kind, self._subject, self._incarnation, strict=True
        ):
            yield at, observer, kinds[kind], subject, incarnation


@dataclass
class _Fault:
    kind: str  # "crash" | "pause" | "left"
    start: float
    end: float = math.inf


class _SimNode:
    __slots__ = ("addr", "clock", "faults", "index", "lives", "membership", "status", "tick")

    def __init__(self, index: int) -> None:
        self.index = index
        self.addr = f"{ADDR_PREFIX}{index}"
        self.membership: Membership | None = None
        self.tick: Timer | None = None
        self.status = NodeStatus.NOT_STARTED
        self.lives = 0
        self.faults: list[_Fault] = []
        """When this node was crashed, paused or gone, oldest first."""
        self.clock: NodeClock | None = None
        """Its own clock once skewed (`MembershipCluster.skew`); None: it
        reads virtual time. The machine's, so it outlives crashes."""


@dataclass
class Publication:
    """A record published by ``publish``; ``first_held`` fills in as it spreads.

    A node counts as holding the record once it holds that seq *or a newer
    one* (a newer record supersedes it, so it will never hold the older).
    """

    node: int
    at: float
    seq: int | None = None
    first_held: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TrafficMark:
    """Send counters at one moment (see ``MembershipCluster.traffic``)."""

    at: float
    messages: tuple[int, ...]
    bytes: tuple[int, ...]


class MembershipCluster:
    """n real ``Membership`` cores on a simulated network (see module doc).

    All lifecycle methods take ``at`` (virtual time; default: now) and only
    schedule the action, so a whole fault schedule can be laid down before
    ``run_until``.
    """

    def __init__(
        self,
        n: int,
        seed: int,
        config: MembershipConfig | None = None,
        network: NetworkConfig | None = None,
        join: JoinMode = "preconverged",
        *,
        seeds: int = DEFAULT_SEEDS,
        stagger: float = DEFAULT_STAGGER,
        size_of: SizeOf | None = None,
        keep_trace: bool = False,
        record_size: int = DEFAULT_RECORD_SIZE,
        loop: EventLoop | None = None,
    ) -> None:
        if n < 1:
            raise ValueError("a cluster needs at least one node")
        if join not in ("seed", "preconverged"):
            raise ValueError(f"unknown join mode {join!r} (seed, preconverged)")
        self.n = n
        self.seed = seed
        self.config = config or MembershipConfig.lan()
        # A given loop is shared with another simulated cluster (placement's
        # Raft voters), so both advance in one virtual time.
        self.loop = EventLoop() if loop is None else loop
        self.network = Network(
            self.loop,
            network or NetworkConfig.lan(),
            component_rng(seed, "network"),
            self._deliver,
            n=n,
            size_of=size_of,
            sample_bytes=True,
        )
        self.record_size = record_size
        self.nodes = [_SimNode(i) for i in range(n)]
        self.signers = [SimSigner(seed, i) for i in range(n)]
        self._index_of_id = {signer.node_id: i for i, signer in enumerate(self.signers)}
        self._index_of_addr = {node.addr: i for i, node in enumerate(self.nodes)}
        self._trace = hashlib.sha256()
        self.trace_lines: list[str] | None = [] if keep_trace else None
        self.trace_length = 0
        self.event_counts: Counter[str] = Counter()
        self.updates_sent = 0
        """Updates sent riding on messages (one per copy), what a partition's
        cost grows with: every member re-sends each change it learns."""
        self._verdicts = _Verdicts()
        self._watched: dict[int, list[Publication]] = {}
        self.publications: list[Publication] = []
        self._partitions: list[tuple[float, float]] = []
        self._cuts: list[Cut] = []
        self._splits: list[Partition] = []
        self._retired_drops: Counter[str] = Counter()
        """Drop counters of cores that crashed or restarted (kept for totals)."""

        for node in self.nodes:
            self.network.crash(node.index)  # nobody listens before it starts
        if join == "preconverged":
            self._start_preconverged()
        else:
            for node in self.nodes:
                start = node.index * stagger
                self.loop.call_at(start, lambda node=node: self._start_seeded(node, seeds))

    # --- driving --------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.loop.now

    def run_until(self, until: float) -> None:
        """Advance virtual time to ``until``, running everything due."""
        self.loop.run_until(until)

    def run_for(self, duration: float) -> None:
        self.loop.run_until(self.loop.now + duration)

    def membership(self, index: int) -> Membership:
        """The live core of node ``index`` (raises if it is not running)."""
        core = self.nodes[index].membership
        if core is None:
            raise LookupError(f"node {index} has no running membership core")
        return core

    def node_id(self, index: int) -> bytes:
        return self.signers[index].node_id

    def index_of(self, node_id: bytes) -> int:
        return self._index_of_id[node_id]

    def status(self, index: int) -> NodeStatus:
        return self.nodes[index].status

    def running(self) -> list[int]:
        """Nodes whose process is up (not paused, crashed, left or unstarted)."""
        return [node.index for node in self.nodes if node.status is NodeStatus.UP]

    # --- the per-node driver (hot path) ----------------------------------------

    def _deliver(self, index: int, envelope: Envelope) -> None:
        node = self.nodes[index]
        core = node.membership
        if core is None or node.status is not NodeStatus.UP:
            return
        now = self.loop.now
        core.receive(envelope, now if node.clock is None else node.clock.local(now))
        self._flush(node, core)

    def _tick(self, node: _SimNode) -> None:
        node.tick = None
        core = node.membership
        if core is not None and node.status is NodeStatus.UP:
            now = self.loop.now
            core.tick(now if node.clock is None else node.clock.local(now))
            self._flush(node, core)

    def _flush(self, node: _SimNode, core: Membership) -> None:
        """Send what the core wants sent, record its events, re-arm its timer."""
        sends = core.take_sends()
        if sends:
            index_of_addr = self._index_of_addr
            send = self.network.send
            src = node.index
            riding = 0
            for out in sends:
                dst = index_of_addr.get(out.addr)
                if dst is None:
                    self.network.drops["unknown_addr"] += 1
                else:
                    send(src, dst, out.envelope)
                    riding += len(getattr(out.envelope.message, "updates", ()))
            self.updates_sent += riding
        events = core.take_events()
        if events:
            if node.clock is not None:
                # Stamped by its own clock in the step being flushed: the
                # trace and the metrics keep virtual time.
                events = [replace(event, at=self.loop.now) for event in events]
            self._on_events(node.index, events)
        # Exactly one pending tick per node: keep the armed one if it fires no
        # later than needed (an early tick is harmless: the core fires nothing
        # that is not due), otherwise replace it.
        deadline = core.next_deadline()
        if node.clock is not None:
            deadline = node.clock.virtual(deadline)
        tick = node.tick
        if tick is not None:
            if tick[0] <= deadline:
                return
            tick.cancel()
        node.tick = None if deadline == math.inf else self.loop.call_at(deadline, self._tick, node)

    def _on_events(self, observer: int, events: list[MemberEvent]) -> None:
        index_of_id = self._index_of_id
        lines = []
        for event in events:
            kind = event.kind
            subject = index_of_id.get(event.node, -1)
            lines.append(f"{event.at:.6f} {observer} {kind} {subject} {event.incarnation}\n")
            if kind == "record":
                watched = self._watched.get(subject)
                if watched:
                    self._record_held(watched, observer, event.incarnation, event.at)
            elif kind != "joined":
                self._verdicts.append(event.at, observer, kind, subject, event.incarnation)
            self.event_counts[kind] += 1
        self._append_trace(lines)

    @staticmethod
    def _record_held(watched: list[Publication], observer: int, seq: int, at: float) -> None:
        for publication in watched:
            if (
                publication.seq is not None
                and seq >= publication.seq
                and observer not in publication.first_held
            ):
                publication.first_held[observer] = at

    def _append_trace(self, lines: list[str]) -> None:
        self._trace.update("".join(lines).encode())
        self.trace_length += len(lines)
        if self.trace_lines is not None:
            self.trace_lines.extend(line.rstrip("\n") for line in lines)

    def _trace_action(self, index: int, action: str, value: int = 0) -> None:
        self._append_trace([f"{self.loop.now:.6f} {index} {action} {index} {value}\n"])

    def trace_scenario(self, digest: str) -> None:
        """Put the resolved scenario's digest first in the trace, so two
        scenarios that happen to trace the same events still differ."""
        self._append_trace([f"{self.loop.now:.6f} -1 scenario -1 {digest}\n"])

    def trace_digest(self) -> str:
        """sha256 (hex) over every trace line so far: same seed, same digest."""
        return self._trace.hexdigest()

    def _clock(self, node: _SimNode) -> float:
        """What ``node``'s own clock reads now: the time its core is told."""
        now = self.loop.now
        return now if node.clock is None else node.clock.local(now)

    # --- starting nodes ------------------------------------------------------

    def _new_core(self, node: _SimNode, view: StartingView | None = None) -> Membership:
        node.lives += 1
        core = Membership(
            signer=self.signers[node.index],
            verifier=sim_verify,
            addr=node.addr,
            config=self.config,
            rng=component_rng(self.seed, "node", node.index, "life", node.lives),
            now=self._clock(node),
            starting_view=view,
        )
        node.membership = core
        node.status = NodeStatus.UP
        self.network.revive(node.index)
        return core

    def _start_preconverged(self) -> None:
        """Every node starts at t=0 already knowing every other member.

        All cores share one read-only ``StartingView`` (everyone alive at
        incarnation 0, each ``Alive`` signed by its subject's simulated key)
        and copy an entry only when it changes. Building n full views would
        cost n^2 entries: 100 million, tens of GB, at 10,000 nodes. The view
        is what a completed join would have taught each node, without the
        n^2 "joined" events; the trace gets one line saying how many members
        each node starts with.
        """
        now = self.loop.now
        alives = [self._alive(node.index, 0) for node in self.nodes]
        view = StartingView.build(alives, (), now, sim_verify)
        cores = [self._new_core(node, view) for node in self.nodes]
        self._append_trace([f"{now:.6f} -1 bootstrap -1 {len(view.members)}\n"])
        for node, core in zip(self.nodes, cores, strict=True):
            self._flush(node, core)

    def _alive(self, index: int, incarnation: int) -> Alive:
        addr = self.nodes[index].addr
        signature = self.signers[index].sign(
            alive_signing_bytes(self.node_id(index), incarnation, addr)
        )
        return Alive(self.node_id(index), incarnation, addr, signature)

    def _start_seeded(self, node: _SimNode, seeds: int) -> None:
        core = self._new_core(node)
        self._trace_action(node.index, "start")
        contacts = [self._seed(i) for i in range(min(seeds, node.index))]
        if contacts:
            core.join(contacts, self._clock(node))
        self._flush(node, core)

    def _seed(self, index: int) -> tuple[bytes, str]:
        """How a joiner names node `index`: its id and its address."""
        return self.node_id(index), self.nodes[index].addr

    def _live_seed(self, exclude: int) -> tuple[bytes, str] | None:
        for node in self.nodes:
            if node.index != exclude and node.status is NodeStatus.UP:
                return self._seed(node.index)
        return None

    # --- lifecycle (scheduled) --------------------------------------------------

    def _at(self, at: float | None, action: Callable[[], None]) -> None:
        self.loop.call_at(self.loop.now if at is None else at, action)

    def crash(self, index: int, at: float | None = None) -> None:
        """The process dies: no more sends, ticks or receives, state lost."""
        self._at(at, lambda: self._crash(index))

    def _crash(self, index: int) -> None:
        node = self.nodes[index]
        if node.status in (NodeStatus.CRASHED, NodeStatus.NOT_STARTED, NodeStatus.LEFT):
            return
        self._trace_action(index, "crash")
        if node.status is NodeStatus.PAUSED:
            node.faults[-1].end = self.loop.now
        self._stop(node, NodeStatus.CRASHED)

    def _stop(self, node: _SimNode, status: NodeStatus) -> None:
        """The process is gone (crash or exit after leave)."""
        if node.tick is not None:
            node.tick.cancel()
            node.tick = None
        if node.membership is not None:
            self._retired_drops.update(node.membership.drops)
        node.membership = None
        node.status = status
        self.network.crash(node.index)
        if status is NodeStatus.CRASHED:
            node.faults.append(_Fault("crash", self.loop.now))

    def pause(self, index: int, at: float | None = None, duration: float = 10.0) -> None:
        """The process stops running (GC pause, SIGSTOP, swapped out) for
        ``duration``: inbound messages queue (up to the bound), timers wait,
        and on resume everything overdue fires at once."""
        if duration <= 0:
            raise ValueError("a pause needs a positive duration")

        def start() -> None:
            node = self.nodes[index]
            if node.status is not NodeStatus.UP:
                return
            self._trace_action(index, "pause")
            node.status = NodeStatus.PAUSED
            if node.tick is not None:
                node.tick.cancel()
                node.tick = None
            self.network.pause(index)
            node.faults.append(_Fault("pause", self.loop.now, self.loop.now + duration))
            self.loop.call_later(duration, lambda: self._resume(node))

        self._at(at, start)

    def _resume(self, node: _SimNode) -> None:
        if node.status is not NodeStatus.PAUSED or node.membership is None:
            return
        self._trace_action(node.index, "resume")
        node.status = NodeStatus.UP
        self.network.resume(node.index)
        node.tick = self.loop.call_at(self.loop.now, self._tick, node)

    def skew(
        self, index: int, at: float | None = None, rate: float = 1.0, jump: float = 0.0
    ) -> None:
        """From ``at`` on, node ``index``'s clock counts ``rate`` seconds per
        second, after leaping ``jump`` seconds ahead (`simulations.clock`):
        its core is told that clock's time, so its timers fire early (rate
        above 1), late (below 1), or all at once (a jump). Messages still
        travel in virtual time. The clock is the machine's: it stays skewed
        through crashes and restarts until another skew sets it."""

        def start() -> None:
            node = self.nodes[index]
            if node.clock is None:
                node.clock = NodeClock(self.loop.now, self.loop.now, 1.0)
            node.clock.skew(self.loop.now, rate, jump)
            self._trace_action(index, "skew")
            if node.tick is not None:
                # Armed by the old clock: re-arm by the new one (an early
                # tick fires nothing that is not due, then re-reads it).
                node.tick.cancel()
                node.tick = self.loop.call_at(self.loop.now, self._tick, node)

        if rate <= 0 or jump < 0:
            raise ValueError("a clock runs at a positive rate and only jumps forward")
        self._at(at, start)

    def restart(self, index: int, at: float | None = None) -> None:
        """Start a crashed (or departed) node again with the same identity.

        A fresh core at incarnation 0, as a real restart without saved state
        would be, joining through the lowest-numbered running node. It is up
        to the core to notice the swarm remembers a later incarnation of it
        and outbid it.
        """

        def start() -> None:
            node = self.nodes[index]
            if node.status not in (NodeStatus.CRASHED, NodeStatus.LEFT):
                return
            core = self._new_core(node)
            self._trace_action(index, "restart", node.lives)
            node.faults[-1].end = self.loop.now
            seed = self._live_seed(index)
            if seed is not None:
                core.join([seed], self._clock(node))
            self._flush(node, core)

        self._at(at, start)

    def leave(self, index: int, at: float | None = None) -> None:
        """Graceful leave: announce it, linger ``LEAVE_LINGER`` s, exit."""

        def start() -> None:
            node = self.nodes[index]
            core = node.membership
            if node.status is not NodeStatus.UP or core is None:
                return
            self._trace_action(index, "leave")
            # Gone from the swarm's point of view from the announcement on.
            node.faults.append(_Fault("left", self.loop.now))
            core.leave(self._clock(node))
            self._flush(node, core)
            self.loop.call_later(LEAVE_LINGER, lambda: self._exit(node, core))

        self._at(at, start)

    def _exit(self, node: _SimNode, core: Membership) -> None:
        if node.membership is core and node.status in (NodeStatus.UP, NodeStatus.PAUSED):
            self._trace_action(node.index, "exit")
            self._stop(node, NodeStatus.LEFT)

    def partition(
        self, groups: Iterable[Iterable[int]], start: float, heal: float = math.inf
    ) -> None:
        """Cut the network into ``groups`` from ``start`` until ``heal``.

        Nodes in no group form one more group together.
        """
        frozen = [sorted(set(group)) for group in groups]
        number = len(self._partitions)
        self._partitions.append((start, heal))
        self._splits.append(self.network.schedule_partition(frozen, start, heal))
        self.loop.call_at(start, lambda: self._trace_action(-1, "partition", number))
        if heal != math.inf:
            self.loop.call_at(heal, lambda: self._trace_action(-1, "heal", number))

    def cut(
        self,
        sources: Iterable[int],
        targets: Iterable[int],
        start: float,
        heal: float = math.inf,
    ) -> None:
        """Lose messages from ``sources`` to ``targets`` (one way) from
        ``start`` until ``heal``; shown with the partitions in reports."""
        number = len(self._partitions)
        self._partitions.append((start, heal))
        self._cuts.append(self.network.schedule_cut(sources, targets, start, heal))
        self.loop.call_at(start, lambda: self._trace_action(-1, "cut", number))
        if heal != math.inf:
            self.loop.call_at(heal, lambda: self._trace_action(-1, "heal", number))

    def heal(self, at: float | None = None) -> None:
        """End every partition in force at ``at`` (default: now), whatever
        heal time it was scheduled with: for runs that heal on a condition."""

        def start() -> None:
            now = self.loop.now
            for number, (begun, healed) in enumerate(self._partitions):
                if begun <= now < healed:
                    self._partitions[number] = (begun, now)
                    self._trace_action(-1, "heal", number)
            self.network.heal_all()

        self._at(at, start)

    def publish(
        self, index: int, at: float | None = None, body: bytes | None = None
    ) -> Publication:
        """Publish a new record on node ``index``; returns a handle whose
        ``seq`` and ``first_held`` fill in once it is published and spreads.
        ``body`` defaults to ``record_size`` bytes naming the node and time."""
        publication = Publication(index, self.loop.now if at is None else at)
        self.publications.append(publication)
        self._watched.setdefault(index, []).append(publication)

        def start() -> None:
            node = self.nodes[index]
            core = node.membership
            if node.status is not NodeStatus.UP or core is None:
                return
            payload = body
            if payload is None:
                label = f"sim-record node={index} t={self.loop.now:.6f} ".encode()
                payload = label.ljust(self.record_size, b".")[: max(self.record_size, 1)]
            record = core.publish_record(payload, self._clock(node))
            publication.seq = record.seq
            publication.at = self.loop.now
            self._trace_action(index, "publish", record.seq)
            self._flush(node, core)

        self._at(at, start)
        return publication

    # --- metrics ------------------------------------------------------------

    def spread_times(self, publication: Publication) -> dict[int, float | None]:
        """For every running node: seconds from publishing until it first
        held the record (or a newer one); None if it never did."""
        return {
            index: (
                publication.first_held[index] - publication.at
                if index in publication.first_held
                else None
            )
            for index in self.running()
        }

    def detection_times(self, crashed: int, since: float | None = None) -> dict[int, float | None]:
        """For every running node but ``crashed``: seconds from its crash
        (or exit) until that node first marked it dead or left; None: never.

        ``since`` picks which crash (its time); default: the latest. Verdicts
        after the node came back (restart) do not count for that crash.
        """
        downs = [f for f in self.nodes[crashed].faults if f.kind != "pause"]
        if since is not None:
            downs = [f for f in downs if f.start == since]
        if not downs:
            raise ValueError(f"node {crashed} was never down (at {since})")
        down = downs[-1]
        first: dict[int, float] = {}
        for at, observer, kind, subject, _ in self._verdicts:
            if subject == crashed and down.start <= at <= down.end and kind in GONE_STATES:
                first.setdefault(observer, at - down.start)
        return {i: first.get(i) for i in self.running() if i != crashed}

    def fault_window(self) -> float:
        """How long after a fault a ``dead`` about its node still counts as
        caused by it: the longest suspicion timeout, twice over (a refutation
        racing a second accusation), plus one sync period, after which any
        stale news has been replaced by a state sync."""
        n = self.n
        return 2 * self.config.suspicion_max_timeout(n) + self.config.push_pull_period(n)

    def false_positives(self, window: float | None = None) -> list[tuple[float, int, int]]:
        """``dead`` verdicts, as (time, observer, subject), about nodes that
        had nothing wrong with them.

        A verdict is justified when, within ``window`` seconds before it (see
        ``fault_window``), its subject was crashed, paused or gone, or any
        partition was in force (a partition cuts every node off from
        someone, and its verdicts travel after the heal). A verdict made by
        a node that was itself paused is *not* excused: accusing healthy
        peers because you were slow is exactly the false positive Lifeguard
        exists to prevent.
        """
        window = self.fault_window() if window is None else window
        found = []
        for at, observer, kind, subject, _ in self._verdicts:
            if kind != "dead" or subject < 0:
                continue
            lo = at - window
            faults = self.nodes[subject].faults
            if any(f.start <= at and f.end >= lo for f in faults):
                continue
            if any(start <= at and heal >= lo for start, heal in self._partitions):
                continue
            found.append((at, observer, subject))
        return found

    def partitions(self) -> list[tuple[float, float]]:
        """Every scheduled partition as (start, heal), in scheduling order."""
        return list(self._partitions)

    def splits(self) -> list[Partition]:
        """Every scheduled partition, with its groups, in scheduling order."""
        return list(self._splits)

    def cuts(self) -> list[Cut]:
        """Every scheduled one-way cut, in scheduling order."""
        return list(self._cuts)

    def verdicts(self) -> Iterator[Verdict]:
        """Every (time, observer, kind, subject, incarnation) state change
        other than "joined" and "record", in order, one at a time (a large
        run has millions)."""
        return iter(self._verdicts)

    def view_agreement(self, observers: Sequence[int] | None = None) -> float:
        """Fraction of (observer, subject) pairs of running nodes in which the
        observer counts the subject as a live member (alive, or suspect and
        not yet dead: suspicion under loss is normal and refuted); 1.0 is
        full membership everywhere.

        By default at most ``AGREEMENT_OBSERVERS`` evenly spaced running
        nodes observe (each still looks at every running subject), so the
        check stays O(n), not O(n^2), on 10,000-node runs.
        """
        running = self.running()
        if observers is None:
            step = max(1, len(running) // AGREEMENT_OBSERVERS)
            observers = running[::step]
        good = total = 0
        for observer in observers:
            core = self.membership(observer)
            for subject in running:
                if subject == observer:
                    continue
                total += 1
                view = core.member(self.node_id(subject))
                good += view is not None and view.state in LIVE_STATES
        return good / total if total else 1.0

    def traffic_mark(self) -> TrafficMark:
        """A snapshot of the send counters, to measure traffic from here on."""
        net = self.network
        return TrafficMark(self.loop.now, tuple(net.sent_messages), tuple(net.sent_bytes))

    def traffic(self, since: TrafficMark | None = None) -> dict[str, Any]:
        """Messages and bytes sent per node since ``since`` (default: t=0),
        as totals and as per-node-second rates (mean over nodes, and the
        busiest node). Bytes stay 0 unless the network counts them."""
        start = 0.0 if since is None else since.at
        elapsed = self.loop.now - start
        messages = list(self.network.sent_messages)
        sent_bytes = list(self.network.sent_bytes)
        if since is not None:
            messages = [now - then for now, then in zip(messages, since.messages, strict=True)]
            sent_bytes = [now - then for now, then in zip(sent_bytes, since.bytes, strict=True)]
        per_second = 1.0 / elapsed if elapsed > 0 else 0.0
        return {
            "seconds": elapsed,
            "messages": messages,
            "bytes": sent_bytes,
            "messages_per_node_second": sum(messages) * per_second / self.n,
            "bytes_per_node_second": sum(sent_bytes) * per_second / self.n,
            "max_messages_per_node_second": max(messages) * per_second,
            "max_bytes_per_node_second": max(sent_bytes) * per_second,
        }

    def drops(self) -> dict[str, Counter[str]]:
        """Drop counters: the network's, and the cores' (all lives) summed."""
        cores: Counter[str] = Counter(self._retired_drops)
        for node in self.nodes:
            if node.membership is not None:
                cores.update(node.membership.drops)
        return {"network": Counter(self.network.drops), "membership": cores}
