"""The `ip`, `tc` and `nft` input that builds a lab's `Plan`, as plain text.

`runtime.lab.netns.Lab` feeds these to `ip -n NS -batch -`, `tc -n NS
-batch -` and `nft -f -`; nothing here runs anything, so what a lab is made
of can be read (and tested) without root. The core holds one veth per site
(`site<i>`, 10.77.<i>.1) and the TUN; a rule per site veth sends what
arrives from the sites to table `ROUTE_TABLE`, whose default is the TUN,
while what the delayer writes back arrives on the TUN and takes the main
table's connected routes out to its site. A home router's WAN side is the
site's access link; its LAN is a second veth pair to the home host.
"""

from __future__ import annotations

from typing import Final

from runtime.lab.topology import LAN_IF, TUN_IF, WAN_IF, Link, NatKind, Plan, SitePlan

ROUTE_TABLE: Final = 100
"""The core's table for packets from the sites: its default is the TUN."""
TBF_BURST_S: Final = 0.02
"""A capped link lets 20 ms of its rate through at once (at least two full
frames): a token bucket needs a burst to reach its rate at all."""
MIN_BURST: Final = 2 * 1514
TBF_LATENCY_MS: Final = 50
"""The longest a packet queues at a capped link before it drops: a home
router's buffer, not a bufferbloated one."""


def sysctl_script(forwards: bool) -> str:
    """Shell for `ip netns exec NS sh -c`: no IPv6 (the delayer carries IPv4
    only), no reverse-path filter (the TUN returns packets from addresses it
    has no route to), and forwarding in the core and the routers."""
    lines = [
        "echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter",
        "echo 0 > /proc/sys/net/ipv4/conf/default/rp_filter",
        "if [ -d /proc/sys/net/ipv6 ]; then"
        " echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6;"
        " echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6; fi",
    ]
    if forwards:
        lines.append("echo 1 > /proc/sys/net/ipv4/ip_forward")
    return "set -e\n" + "\n".join(lines) + "\n"


def core_batch(plan: Plan) -> list[str]:
    lines = [
        "link set lo up",
        f"tuntap add dev {TUN_IF} mode tun",
        f"link set {TUN_IF} up",
        f"route add default dev {TUN_IF} table {ROUTE_TABLE}",
    ]
    for site in plan.sites:
        lines += [
            f"link add {site.core_link} type veth peer name {WAN_IF} netns {site.uplink_ns}",
            f"addr add {site.gateway}/24 dev {site.core_link}",
            f"link set {site.core_link} up",
            f"rule add iif {site.core_link} table {ROUTE_TABLE} pref {ROUTE_TABLE}",
        ]
    return lines


def router_batch(site: SitePlan) -> list[str]:
    assert site.router_ns is not None
    return [
        "link set lo up",
        f"addr add {site.wan_address}/24 dev {WAN_IF}",
        f"link set {WAN_IF} up",
        f"link add {LAN_IF} type veth peer name {WAN_IF} netns {site.host_ns}",
        f"addr add {site.host_gateway}/24 dev {LAN_IF}",
        f"link set {LAN_IF} up",
        f"route add default via {site.gateway}",
    ]


def host_batch(site: SitePlan) -> list[str]:
    return [
        "link set lo up",
        f"addr add {site.address}/24 dev {WAN_IF}",
        f"link set {WAN_IF} up",
        f"route add default via {site.host_gateway}",
    ]


def nat_ruleset(nat: NatKind) -> str:
    """A home router's nftables: masquerade out of the WAN side, keeping the
    source port where it is free (port-preserving: one external port for
    every destination) or drawing a fresh one per destination (symmetric);
    from the WAN, only what belongs to a connection from inside comes in."""
    assert nat != "none"
    flags = " fully-random" if nat == "symmetric" else ""
    inbound = f'iifname "{WAN_IF}" ct state established,related accept; iifname "{WAN_IF}" drop; '
    return (
        "table ip lab {\n"
        "  chain postrouting { type nat hook postrouting priority srcnat; policy accept; "
        f'oifname "{WAN_IF}" masquerade{flags}; }}\n'
        f"  chain input {{ type filter hook input priority filter; policy accept; {inbound}}}\n"
        f"  chain forward {{ type filter hook forward priority filter; policy accept; {inbound}}}\n"
        "}\n"
    )


def tbf(device: str, link: Link) -> str | None:
    """A `tc -batch` line capping `device`'s egress at the link's rate."""
    if link.rate is None:
        return None
    burst = max(MIN_BURST, int(link.rate * TBF_BURST_S))
    return (
        f"qdisc add dev {device} root tbf rate {link.rate * 8}bit "
        f"burst {burst} latency {TBF_LATENCY_MS}ms"
    )


def tc_batches(plan: Plan) -> dict[str, list[str]]:
    """Per namespace, its qdiscs: a site's uplink on its `wan` (the host's,
    or its router's), its downlink on the core's end of the access link."""
    batches: dict[str, list[str]] = {}
    for site, plan_site in zip(plan.topology.sites, plan.sites, strict=True):
        for ns, line in (
            (plan_site.uplink_ns, tbf(WAN_IF, site.up)),
            (plan.core_ns, tbf(plan_site.core_link, site.down)),
        ):
            if line is not None:
                batches.setdefault(ns, []).append(line)
    return batches
