"""`runtime.lab.topology`: specs load to the sites they say, bad ones fail
naming the field, and a plan's names and addresses fit Linux's limits."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.lab.topology import (
    IFNAMSIZ,
    MAX_SITES,
    Link,
    Topology,
    TopologyError,
    load_topology,
    make_plan,
    uniform,
)

SPEC: dict[str, Any] = {
    "seed": 7,
    "link": {"delay_ms": 10, "loss": 0.01},
    "sites": [
        {"name": "a"},
        {"name": "b", "delay_ms": 30, "up": {"rate": 1_000_000}},
        {"name": "home", "nat": "symmetric", "down": {"jitter_ms": 2, "loss": 0.0}},
    ],
}


def test_a_spec_layers_defaults_site_fields_and_directions() -> None:
    topology = load_topology(SPEC)
    a, b, home = topology.sites
    assert topology.seed == 7
    assert a.up == a.down == Link(delay_ms=10, loss=0.01)
    assert b.up == Link(delay_ms=30, loss=0.01, rate=1_000_000)
    assert b.down == Link(delay_ms=30, loss=0.01)
    assert home.behind_nat and home.nat == "symmetric"
    assert home.down == Link(delay_ms=10, jitter_ms=2, loss=0.0)
    assert topology.one_way_ms("a", "b") == 10 + 30
    assert topology.rtt_ms("a", "home") == 40
    assert topology.path_loss("a", "home") == pytest.approx(0.01)
    assert topology.path_loss("home", "a") == pytest.approx(1 - 0.99 * 0.99)


def test_to_spec_loads_back_to_the_same_topology() -> None:
    topology = load_topology(SPEC)
    assert load_topology(topology.to_spec()) == topology


def test_uniform_sets_every_link() -> None:
    topology = uniform(load_topology(SPEC), delay_ms=5)
    assert {(s.up, s.down) for s in topology.sites} == {(Link(delay_ms=5), Link(delay_ms=5))}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([], "the spec: expected an object"),
        ({"sites": []}, "at least one site"),
        ({"sites": "a"}, "expected a list"),
        ({"sites": [{"name": "a"}], "extra": 1}, "unknown keys ['extra']"),
        ({"sites": [{"name": "a", "delay": 10}]}, "sites[0]: unknown keys ['delay']"),
        ({"sites": [{"name": "A"}]}, "site name 'A'"),
        ({"sites": [{"name": "abcdefghijk"}]}, "at most 10"),
        ({"sites": [{"name": "a"}, {"name": "a"}]}, "['a'] are used more than once"),
        ({"sites": [{"name": "a", "nat": "full-cone"}]}, "nat 'full-cone' is not one of"),
        ({"sites": [{"name": "a", "loss": 1}]}, "drops everything"),
        ({"sites": [{"name": "a", "loss": -0.1}]}, "loss: -0.1 is outside"),
        ({"sites": [{"name": "a", "delay_ms": "10"}]}, "delay_ms: '10' is not a number"),
        ({"sites": [{"name": "a", "delay_ms": float("nan")}]}, "is not a number"),
        ({"sites": [{"name": "a", "up": {"rate": 1.5e6}}]}, "sites[0] ('a'): rate: 1500000.0"),
        ({"sites": [{"name": "a", "up": {"rate": 100}}]}, "rate: 100 is outside"),
        ({"sites": [{"name": "a", "up": {"delay": 1}}]}, "sites[0].up: unknown keys"),
        ({"link": {"rate": True}, "sites": [{"name": "a"}]}, "rate: True"),
        ({"seed": "x", "sites": [{"name": "a"}]}, "seed: 'x' is not an integer"),
    ],
)
def test_bad_specs_fail_naming_the_field(spec: object, message: str) -> None:
    with pytest.raises(TopologyError) as error:
        load_topology(spec)
    assert message in str(error.value)


def test_too_many_sites() -> None:
    with pytest.raises(TopologyError, match=f"more than {MAX_SITES}"):
        load_topology({"sites": [{"name": f"s{i}"} for i in range(MAX_SITES + 1)]})


def test_a_plan_names_and_addresses_every_site() -> None:
    topology = load_topology(SPEC)
    plan = make_plan(topology, "lab12ab")
    a, _, home = plan.sites
    assert plan.core_ns == "lab12ab-core"
    assert (a.host_ns, a.router_ns, a.address, a.wan_address) == (
        "lab12ab-a",
        None,
        "10.77.1.2",
        "10.77.1.2",
    )
    assert (home.host_ns, home.router_ns) == ("lab12ab-home", "lab12ab-home-nat")
    assert (home.address, home.wan_address, home.host_gateway) == (
        "192.168.3.2",
        "10.77.3.2",
        "192.168.3.1",
    )
    assert home.uplink_ns == home.router_ns and a.uplink_ns == a.host_ns
    assert plan.namespaces == (
        "lab12ab-core",
        "lab12ab-a",
        "lab12ab-b",
        "lab12ab-home-nat",
        "lab12ab-home",
    )
    assert plan.site_of("10.77.3.2") == "home" and plan.site_of("192.168.3.2") is None


def test_interface_names_fit_for_the_largest_lab() -> None:
    many = load_topology({"sites": [{"name": f"s{i}"} for i in range(MAX_SITES)]})
    plan = make_plan(many, "abcdefgh")
    assert max(len(site.core_link) for site in plan.sites) <= IFNAMSIZ
    assert isinstance(plan.topology, Topology) and plan.sites[-1].gateway == "10.77.250.1"


@pytest.mark.parametrize("prefix", ["", "a", "Lab1", "lab-1", "abcdefghi", "1ab"])
def test_bad_prefixes(prefix: str) -> None:
    with pytest.raises(TopologyError, match="prefix"):
        make_plan(load_topology(SPEC), prefix)
