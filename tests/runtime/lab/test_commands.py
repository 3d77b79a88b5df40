"""`runtime.lab.commands`: the text a lab is built from puts each piece
where the plan says (the lab tests then build it for real)."""

from __future__ import annotations

from runtime.lab.commands import (
    MIN_BURST,
    ROUTE_TABLE,
    core_batch,
    nat_ruleset,
    sysctl_script,
    tbf,
    tc_batches,
)
from runtime.lab.topology import Link, load_topology, make_plan

SITES = [
    {"name": "a", "up": {"rate": 1_000_000}},
    {"name": "h", "nat": "symmetric", "up": {"rate": 500_000}, "down": {"rate": 2_000_000}},
]
PLAN = make_plan(load_topology({"sites": SITES}), "lab1")


def test_every_site_veth_is_routed_through_the_tun() -> None:
    lines = core_batch(PLAN)
    assert f"route add default dev delay0 table {ROUTE_TABLE}" in lines
    for site in PLAN.sites:
        assert f"rule add iif {site.core_link} table {ROUTE_TABLE} pref {ROUTE_TABLE}" in lines
        assert f"link add {site.core_link} type veth peer name wan netns {site.uplink_ns}" in lines


def test_uplinks_are_capped_at_the_site_downlinks_at_the_core() -> None:
    assert tc_batches(PLAN) == {
        "lab1-a": [tbf("wan", Link(rate=1_000_000))],
        "lab1-h-nat": [tbf("wan", Link(rate=500_000))],
        "lab1-core": [tbf("site2", Link(rate=2_000_000))],
    }


def test_a_token_bucket_in_bits_with_20_ms_of_burst() -> None:
    assert tbf("wan", Link(rate=1_000_000)) == (
        "qdisc add dev wan root tbf rate 8000000bit burst 20000 latency 50ms"
    )
    assert f"burst {MIN_BURST} " in (tbf("wan", Link(rate=10_000)) or "")
    assert tbf("wan", Link()) is None


def test_symmetric_nat_draws_ports_and_port_preserving_keeps_them() -> None:
    assert 'oifname "wan" masquerade fully-random;' in nat_ruleset("symmetric")
    assert 'oifname "wan" masquerade;' in nat_ruleset("port-preserving")
    for nat in ("symmetric", "port-preserving"):
        assert nat_ruleset(nat).count('iifname "wan" drop;') == 2  # input and forward


def test_only_the_core_and_routers_forward() -> None:
    assert "ip_forward" in sysctl_script(forwards=True)
    assert "ip_forward" not in sysctl_script(forwards=False)
    assert "rp_filter" in sysctl_script(forwards=False)
