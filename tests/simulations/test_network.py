"""Simulated links, driven by a trivial echo protocol (no membership core)."""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Any

import pytest

from simulations.loop import EventLoop
from simulations.network import Network, NetworkConfig
from simulations.scenario import run_scenario
from simulations.seeds import component_rng, derive_seed


class Echo:
    """Node 0 sends numbered pings; every other node echoes what it gets.

    Records (arrival time, receiver, payload) so tests can check what the
    network did to each message.
    """

    def __init__(self, n: int, config: NetworkConfig, seed: int = 1) -> None:
        self.loop = EventLoop()
        self.arrivals: list[tuple[float, int, object]] = []
        self.net = Network(self.loop, config, component_rng(seed, "network"), self.deliver, n=n)

    def deliver(self, dst: int, message: object) -> None:
        self.arrivals.append((self.loop.now, dst, message))
        kind, src, payload = message  # type: ignore[misc]
        if kind == "ping":
            self.net.send(dst, src, ("echo", dst, payload))

    def ping(self, src: int, dst: int, payload: object) -> None:
        self.net.send(src, dst, ("ping", src, payload))

    def received(self, dst: int, kind: str = "ping") -> list[object]:
        return [m[2] for _, d, m in self.arrivals if d == dst and m[0] == kind]  # type: ignore[index]


def within(observed: float, n: int, p: float, sigmas: float = 5.0) -> bool:
    """Observed count within `sigmas` binomial standard deviations of n*p."""
    return abs(observed - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_seeds_are_stable_and_distinct() -> None:
    assert derive_seed(7, "network") == derive_seed(7, "network")
    assert derive_seed(7, "network") != derive_seed(8, "network")
    assert derive_seed(7, "network") != derive_seed(7, "node", 0)
    assert component_rng(7, "x").random() == component_rng(7, "x").random()


def test_uniform_latency_stays_in_its_band_and_reorders() -> None:
    config = NetworkConfig.lan(service_time=0.0)
    sim = Echo(2, config)
    sends = 2000
    for k in range(sends):
        sim.loop.call_at(k * 0.0002, lambda k=k: sim.ping(0, 1, (k, sim.loop.now)))
    sim.loop.run_until(10.0)
    pings = [(t, m[2]) for t, d, m in sim.arrivals if d == 1]  # type: ignore[index]
    assert len(pings) == sends
    delays = [t - sent for t, (_, sent) in pings]
    assert min(delays) >= config.base_latency
    assert max(delays) <= config.base_latency + config.jitter + 1e-12
    assert statistics.mean(delays) == pytest.approx(
        config.base_latency + config.jitter / 2, rel=0.05
    )
    order = [k for _, (k, _) in pings]
    assert order != sorted(order), "jitter larger than the send gap must reorder"
    assert sorted(order) == list(range(sends))


def test_lognormal_latency_has_its_median_and_a_tail() -> None:
    config = NetworkConfig.wan()
    sim = Echo(2, config)
    for k in range(4000):
        sim.loop.call_at(k * 0.001, lambda: sim.ping(0, 1, sim.loop.now))
    sim.loop.run_until(100.0)
    delays = [t - m[2] for t, d, m in sim.arrivals if d == 1]  # type: ignore[index]
    median = statistics.median(delays)
    assert median == pytest.approx(config.base_latency + config.jitter, rel=0.08)
    assert max(delays) > config.base_latency + 3 * config.jitter


def test_loss_and_duplication_rates_are_within_statistical_bounds() -> None:
    sends = 20_000
    lossy = Echo(2, NetworkConfig.lan(loss=0.1, service_time=0.0))
    for k in range(sends):
        lossy.ping(0, 1, k)
    lossy.loop.run_until(1.0)
    got = len(lossy.received(1))
    assert within(sends - got, sends, 0.1)
    assert lossy.net.drops["loss"] == (sends - got) + (got - len(lossy.received(0, "echo")))
    assert lossy.net.sent_messages == [sends, got]

    dup = Echo(2, NetworkConfig.lan(duplicate=0.05, service_time=0.0))
    for k in range(sends):
        dup.ping(0, 1, k)
    dup.loop.run_until(1.0)
    pings = dup.received(1)
    extra_pings = len(pings) - sends
    assert within(extra_pings, sends, 0.05)
    assert set(pings) == set(range(sends))
    assert dup.net.duplicated == len(pings) - sends + len(dup.received(0, "echo")) - len(pings)


def test_same_seed_same_arrivals_other_seed_different() -> None:
    def run(seed: int) -> list[tuple[float, int, object]]:
        sim = Echo(5, NetworkConfig.lan(loss=0.2, duplicate=0.1), seed=seed)
        for k in range(500):
            sim.loop.call_at(k * 0.001, lambda k=k: sim.ping(0, 1 + k % 4, k))
        sim.loop.run_until(5.0)
        return sim.arrivals

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_partition_drops_cross_group_messages_only_while_active() -> None:
    sim = Echo(4, NetworkConfig.lan(service_time=0.0))
    sim.net.schedule_partition([[0, 1], [2, 3]], start=1.0, heal=2.0)
    for when in (0.5, 1.5, 2.5):
        sim.loop.call_at(when, lambda: [sim.ping(0, d, sim.loop.now) for d in (1, 2, 3)])
    sim.loop.run_until(5.0)
    # Inside the group: always; across: before and after, never during.
    assert sim.received(1) == [0.5, 1.5, 2.5]
    assert sim.received(2) == [0.5, 2.5]
    assert sim.received(3) == [0.5, 2.5]
    assert sim.net.drops["partition"] == 2
    assert sim.net.can_reach(0, 2)


def test_messages_in_flight_when_a_partition_starts_are_dropped() -> None:
    config = NetworkConfig.lan(base_latency=0.5, jitter=0.0, service_time=0.0)
    sim = Echo(3, config)
    sim.ping(0, 2, "in flight")
    sim.net.schedule_partition([[0], [1, 2]], start=0.1)  # unlisted nodes: none
    sim.loop.run_until(1.0)
    assert sim.received(2) == []
    assert sim.net.drops["partition"] == 1


def test_unlisted_nodes_form_their_own_group_and_partitions_overlap() -> None:
    sim = Echo(4, NetworkConfig.lan(service_time=0.0))
    sim.net.schedule_partition([[0]], start=0.0, heal=10.0)
    sim.net.schedule_partition([[1]], start=0.0, heal=10.0)
    sim.loop.run_until(0.0)
    assert not sim.net.can_reach(0, 1)
    assert not sim.net.can_reach(0, 2)
    assert not sim.net.can_reach(1, 3)
    assert sim.net.can_reach(2, 3)
    sim.loop.run_until(10.0)
    assert sim.net.can_reach(0, 1)
    with pytest.raises(ValueError):
        sim.net.schedule_partition([[0]], start=5.0, heal=5.0)


def test_bounded_queue_serves_at_its_rate_and_drops_the_overflow() -> None:
    config = NetworkConfig.lan(jitter=0.0, service_time=0.01, queue_capacity=10)
    sim = Echo(2, config)
    for k in range(100):
        sim.net.send(0, 1, ("note", 0, k))
    sim.loop.run_until(5.0)
    times = [t for t, d, _ in sim.arrivals if d == 1]
    # One is served on arrival, ten wait, the rest find the queue full.
    assert len(times) == 11
    assert sim.net.drops["queue_full"] == 89
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(gap == pytest.approx(0.01) for gap in gaps)
    assert sim.received(1, "note") == list(range(11))


def test_paused_node_queues_and_works_off_the_queue_on_resume() -> None:
    config = NetworkConfig.lan(jitter=0.0, service_time=0.001, queue_capacity=5)
    sim = Echo(2, config)
    sim.loop.call_at(0.0, lambda: sim.net.pause(1))
    for k in range(8):
        sim.loop.call_at(0.1 * (k + 1), lambda k=k: sim.net.send(0, 1, ("note", 0, k)))
    sim.loop.call_at(2.0, lambda: sim.net.resume(1))
    sim.loop.run_until(1.5)
    assert sim.arrivals == []
    assert sim.net.queued(1) == 5
    assert sim.net.drops["queue_full"] == 3
    sim.loop.run_until(3.0)
    times = [t for t, d, _ in sim.arrivals if d == 1]
    assert times == pytest.approx([2.0, 2.001, 2.002, 2.003, 2.004])
    assert sim.received(1, "note") == [0, 1, 2, 3, 4]


def test_crashed_node_drops_everything_until_revived() -> None:
    sim = Echo(2, NetworkConfig.lan(jitter=0.0, service_time=0.0))
    sim.net.pause(1)
    sim.net.send(0, 1, ("note", 0, "queued then lost"))
    sim.loop.run_until(0.1)
    sim.net.crash(1)
    sim.net.send(0, 1, ("note", 0, "lost"))
    sim.loop.run_until(0.2)
    assert sim.net.is_crashed(1)
    assert sim.arrivals == []
    assert sim.net.drops["crashed"] == 2
    sim.net.revive(1)
    sim.net.send(0, 1, ("note", 0, "after restart"))
    sim.loop.run_until(0.3)
    assert sim.received(1, "note") == ["after restart"]


def test_bytes_are_counted_only_when_asked() -> None:
    loop = EventLoop()
    rng = component_rng(1, "network")
    quiet = Network(loop, NetworkConfig.lan(), rng, lambda d, m: None, n=2, size_of=len)
    quiet.send(0, 1, b"12345")
    assert quiet.sent_bytes == [0, 0]
    counting = Network(
        loop, NetworkConfig.lan(count_bytes=True), rng, lambda d, m: None, n=2, size_of=len
    )
    counting.send(0, 1, b"12345")
    counting.send(0, 1, b"12")
    assert counting.sent_bytes == [7, 0]
    assert counting.sent_messages == [2, 0]


def test_config_validation_and_profiles() -> None:
    with pytest.raises(ValueError):
        NetworkConfig(loss=1.5)
    with pytest.raises(ValueError):
        NetworkConfig(queue_capacity=0)
    with pytest.raises(ValueError):
        NetworkConfig.profile("moon")
    assert NetworkConfig.profile("wan", loss=0.1).jitter_kind == "lognormal"
    assert NetworkConfig.profile("lan").loss == 0.0


class Wire:
    """Byte strings on a network that sizes them by their length: arrival
    times by payload, to check what bandwidth does to each message."""

    def __init__(self, config: NetworkConfig, n: int = 3) -> None:
        self.loop = EventLoop()
        self.sized: list[bytes] = []
        self.arrived: dict[bytes, float] = {}
        self.net = Network(
            self.loop,
            config,
            component_rng(1, "network"),
            lambda dst, message: self.arrived.setdefault(message, self.loop.now),
            n=n,
            size_of=self.size_of,
        )

    def size_of(self, message: bytes) -> int:
        self.sized.append(message)
        return len(message)

    def send_at(self, at: float, src: int, dst: int, message: bytes) -> None:
        self.loop.call_at(at, lambda: self.net.send(src, dst, message))


def test_a_slow_link_adds_transmission_time_and_queues_messages_behind_each_other() -> None:
    """1,000 bytes/s and 10 ms of latency: a 500-byte message takes 0.51 s;
    the next one on the same directed link waits for it, while another
    link, the reverse direction included, is free."""
    wire = Wire(NetworkConfig.lan(base_latency=0.01, jitter=0.0, service_time=0.0, bandwidth=1e3))
    first, second, third = b"a" * 500, b"b" * 500, b"c" * 100
    for message in (first, second, third):
        wire.send_at(0.0, 0, 1, message)
    wire.send_at(0.0, 0, 2, b"d" * 250)
    wire.send_at(0.2, 1, 0, b"e" * 100)
    wire.send_at(5.0, 0, 1, b"f" * 200)  # the link has long been idle again
    wire.loop.run_until(10.0)
    expected = {first: 0.51, second: 1.01, third: 1.11, b"d" * 250: 0.26}
    expected |= {b"e" * 100: 0.31, b"f" * 200: 5.21}
    assert wire.arrived == pytest.approx(expected)


def test_only_links_with_a_bandwidth_measure_their_messages() -> None:
    """The unlimited default never sizes (encodes) a message; a link given
    a bandwidth sizes its own, and `bandwidth=None` makes a link unlimited
    in a limited network."""
    unlimited = Wire(NetworkConfig.lan(base_latency=0.01, jitter=0.0, service_time=0.0))
    unlimited.net.set_link([0], [2], bandwidth=100.0)
    for dst in (1, 2):
        unlimited.send_at(0.0, 0, dst, b"to %d" % dst)
    unlimited.send_at(0.0, 1, 2, b"from 1")
    unlimited.loop.run_until(1.0)
    assert unlimited.sized == [b"to 2"]
    assert unlimited.arrived == pytest.approx({b"to 1": 0.01, b"to 2": 0.05, b"from 1": 0.01})

    limited = Wire(NetworkConfig.lan(base_latency=0.01, jitter=0.0, bandwidth=10.0))
    limited.net.set_link([0], [1], bandwidth=None)
    limited.send_at(0.0, 0, 1, b"x" * 100)
    limited.loop.run_until(1.0)
    assert limited.sized == [] and limited.arrived == pytest.approx({b"x" * 100: 0.01})


def test_a_lognormal_link_gives_a_long_tail_to_its_group_only() -> None:
    """On a LAN (uniform 0.5-2 ms), the links from node 0 to the group
    {2, 3} get a lognormal delay with a 5 ms median: those, and only those,
    have a tail; the way back keeps the LAN's."""
    config = NetworkConfig.lan(service_time=0.0)
    sim = Echo(4, config)
    median = 0.005
    sim.net.set_link([0], [2, 3], jitter_kind="lognormal", jitter=median, jitter_sigma=1.0)
    for k in range(3000):
        sim.loop.call_at(k * 0.001, lambda k=k: sim.ping(0, 1 + k % 3, sim.loop.now))
        sim.loop.call_at(k * 0.001, lambda: sim.ping(2, 0, sim.loop.now))
    sim.loop.run_until(60.0)
    delays: dict[int, list[float]] = {0: [], 1: [], 2: [], 3: []}
    for t, dst, (kind, _, sent) in sim.arrivals:  # type: ignore[misc]
        if kind == "ping":
            delays[dst].append(t - sent)
    band = config.base_latency + config.jitter + 1e-12
    assert len(delays[1]) == 1000 and max(delays[1]) <= band
    for far in (2, 3):
        assert statistics.median(delays[far]) == pytest.approx(
            config.base_latency + median, rel=0.15
        )
        assert max(delays[far]) > config.base_latency + 5 * median  # the tail
    assert len(delays[0]) == 3000 and max(delays[0]) <= band  # from the group: LAN


def test_link_and_bandwidth_validation() -> None:
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        NetworkConfig(bandwidth=0.0)
    with pytest.raises(ValueError, match="jitter_sigma"):
        NetworkConfig(jitter_sigma=-0.5)
    net = Echo(2, NetworkConfig.lan()).net
    with pytest.raises(ValueError, match="a link cannot set duplicate"):
        net.set_link([0], [1], duplicate=0.5)
    with pytest.raises(ValueError, match="jitter_kind"):
        net.set_link([0], [1], jitter_kind="pareto")


def test_bytes_per_type_are_estimated_within_a_few_percent_when_not_counted() -> None:
    """The metrics' bytes per message type are always there: sampled while
    the network does not count bytes, and close to the exact count."""
    scenario: dict[str, Any] = {
        "duration": 60.0,
        "nodes": {"count": 60},
        "faults": [{"kind": "crash", "node": 3, "at": 10.0}],
    }
    by_type = {}
    for exact in (True, False):
        scenario["network"] = {"count_bytes": exact}
        metrics = run_scenario(scenario, seed=4)
        by_type[exact] = {
            kind: rates["bytes_per_node_second"]
            for kind, rates in metrics["traffic"]["by_type"].items()
        }
    assert by_type[False].keys() == by_type[True].keys()
    for kind in ("Ping", "Ack", "Gossip"):
        assert by_type[False][kind] == pytest.approx(by_type[True][kind], rel=0.05)
