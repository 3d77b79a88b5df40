"""What a WAN lab is made of, as plain values: sites, their access links, names.

A `Topology` is a star: every site (a public host, or a home host behind a
NAT router) hangs off one internet core by its access link, which has a
one-way delay, jitter, loss and rate in each direction (`Link`). The path
from site A to site B is A's uplink then B's downlink, so 40 ms of RTT
between every pair is 10 ms one way on every access link. `Plan` gives a
built lab its names and addresses: namespaces and interfaces under a short
per-lab prefix (several labs may exist at once), public 10.77.<i>.2/24 with
the core at 10.77.<i>.1, home LANs 192.168.<i>.0/24. No I/O here: the lab
(`runtime.lab.netns`), the delayer and the CLI all read the same values,
loaded from a small JSON spec by `load_topology` with clear errors.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal, cast, get_args

NatKind = Literal["none", "port-preserving", "symmetric"]
NAT_KINDS: Final = cast(tuple[str, ...], get_args(NatKind))

MAX_SITES: Final = 250
"""Site i's networks are 10.77.<i>.0/24 and 192.168.<i>.0/24: one octet."""
MAX_DELAY_MS: Final = 10_000.0
"""Ten seconds one way is already no WAN anyone serves over; more is a typo."""
MIN_RATE: Final = 8_000
"""Bytes/s. Below about a 64 kbit/s modem, TBF's burst of two MTUs dominates."""
MAX_RATE: Final = 10_000_000_000
MAX_NAME: Final = 10
"""A site's name goes into namespace names; short keeps them readable."""
NAME = re.compile(r"[a-z][a-z0-9]*\Z")
PREFIX = re.compile(r"[a-z][a-z0-9]{1,7}\Z")
IFNAMSIZ: Final = 15
"""Linux interface names are at most 15 bytes."""
LINK_FIELDS: Final = ("delay_ms", "jitter_ms", "loss", "rate")
SITE_FIELDS: Final = ("name", "nat", *LINK_FIELDS, "up", "down")


class TopologyError(ValueError):
    """A spec that cannot describe a lab; the message names the field."""


@dataclass(frozen=True)
class Link:
    """One direction of an access link. Jitter is uniform in
    [-jitter_ms, +jitter_ms] around the delay (never below zero); loss is
    the chance a packet is dropped; rate is bytes/s, None for unlimited."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    rate: int | None = None

    def __post_init__(self) -> None:
        _number(self.delay_ms, "delay_ms", 0.0, MAX_DELAY_MS)
        _number(self.jitter_ms, "jitter_ms", 0.0, MAX_DELAY_MS)
        _number(self.loss, "loss", 0.0, 1.0)
        if self.loss >= 1.0:
            raise TopologyError(f"loss: {self.loss} drops everything (must be below 1)")
        if self.rate is not None:
            if isinstance(self.rate, bool) or not isinstance(self.rate, int):
                raise TopologyError(f"rate: {self.rate!r} is not whole bytes per second")
            _number(self.rate, "rate", MIN_RATE, MAX_RATE)


@dataclass(frozen=True)
class Site:
    """A host on the WAN: public (`nat` "none") or at home behind a router."""

    name: str
    nat: NatKind = "none"
    up: Link = field(default_factory=Link)
    down: Link = field(default_factory=Link)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.match(self.name):
            raise TopologyError(
                f"site name {self.name!r}: lower-case letters and digits, starting with a letter"
            )
        if len(self.name) > MAX_NAME:
            raise TopologyError(f"site name {self.name!r}: at most {MAX_NAME} characters")
        if self.nat not in NAT_KINDS:
            raise TopologyError(f"site {self.name}: nat {self.nat!r} is not one of {NAT_KINDS}")

    @property
    def behind_nat(self) -> bool:
        return self.nat != "none"


@dataclass(frozen=True)
class Topology:
    """The sites of one lab, in order (site i is the i-th, from 1), and the
    seed of the delayer's random loss and jitter."""

    sites: tuple[Site, ...]
    seed: int = 1

    def __post_init__(self) -> None:
        if not self.sites:
            raise TopologyError("sites: a lab needs at least one site")
        if len(self.sites) > MAX_SITES:
            raise TopologyError(f"sites: {len(self.sites)} is more than {MAX_SITES}")
        names = [site.name for site in self.sites]
        doubled = sorted({name for name in names if names.count(name) > 1})
        if doubled:
            raise TopologyError(f"sites: the names {doubled} are used more than once")

    def site(self, name: str) -> Site:
        for site in self.sites:
            if site.name == name:
                return site
        raise TopologyError(f"no site {name!r} (sites: {[s.name for s in self.sites]})")

    def index(self, name: str) -> int:
        """Site `name`'s number, from 1: its networks' third octet."""
        self.site(name)
        return [site.name for site in self.sites].index(name) + 1

    def one_way_ms(self, src: str, dst: str) -> float:
        """The configured delay from `src` to `dst`: src's uplink, dst's downlink."""
        return self.site(src).up.delay_ms + self.site(dst).down.delay_ms

    def rtt_ms(self, a: str, b: str) -> float:
        return self.one_way_ms(a, b) + self.one_way_ms(b, a)

    def path_loss(self, src: str, dst: str) -> float:
        """The chance a packet from src to dst is lost on one of its two links."""
        return 1.0 - (1.0 - self.site(src).up.loss) * (1.0 - self.site(dst).down.loss)

    def to_spec(self) -> dict[str, Any]:
        """The JSON spec `load_topology` reads back to this topology."""
        return {
            "seed": self.seed,
            "sites": [
                {"name": s.name, "nat": s.nat, "up": _link_spec(s.up), "down": _link_spec(s.down)}
                for s in self.sites
            ],
        }


def _link_spec(link: Link) -> dict[str, Any]:
    return {name: getattr(link, name) for name in LINK_FIELDS}


def _number(value: object, name: str, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TopologyError(f"{name}: {value!r} is not a number")
    if not low <= value <= high:
        raise TopologyError(f"{name}: {value} is outside [{low}, {high}]")


def load_topology(spec: object) -> Topology:
    """A topology from its spec (a parsed JSON object):

    `{"seed": 1, "link": {...}, "sites": [{"name": "a", "nat": "symmetric",
    "delay_ms": 10, "loss": 0.01, "up": {"rate": 1000000}}, ...]}`

    A site's link fields apply both ways, its `up` and `down` objects
    override them one way, and the top-level `link` is every site's default.
    """
    top = _object(spec, "the spec", ("seed", "link", "sites"))
    default = _link_fields(top.get("link", {}), "link", LINK_FIELDS)
    sites = top.get("sites")
    if not isinstance(sites, list):
        raise TopologyError("sites: expected a list of site objects")
    seed = top.get("seed", 1)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TopologyError(f"seed: {seed!r} is not an integer")
    return Topology(tuple(_site(raw, n, default) for n, raw in enumerate(sites, 1)), seed)


def _site(raw: object, n: int, default: Mapping[str, Any]) -> Site:
    where = f"sites[{n - 1}]"
    fields = _object(raw, where, SITE_FIELDS)
    name = fields.get("name")
    both = {**default, **_link_fields(fields, where, LINK_FIELDS, strict=False)}
    try:
        up = _link({**both, **_link_fields(fields.get("up", {}), f"{where}.up", LINK_FIELDS)})
        down = _link({**both, **_link_fields(fields.get("down", {}), f"{where}.down", LINK_FIELDS)})
        return Site(name=cast(str, name), nat=fields.get("nat", "none"), up=up, down=down)
    except TopologyError as exc:
        raise TopologyError(f"{where} ({name!r}): {exc}") from None


def _link(fields: Mapping[str, Any]) -> Link:
    return Link(**fields)


def _object(raw: object, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise TopologyError(f"{where}: expected an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise TopologyError(f"{where}: unknown keys {unknown} (allowed: {list(allowed)})")
    return raw


def _link_fields(
    raw: object, where: str, names: tuple[str, ...], strict: bool = True
) -> dict[str, Any]:
    fields = _object(raw, where, names) if strict else cast(dict[str, Any], raw)
    return {name: fields[name] for name in names if name in fields}


def uniform(topology: Topology, **link: Any) -> Topology:
    """The same topology with every access link, both ways, set to `link`."""
    shape = Link(**link)
    return replace(topology, sites=tuple(replace(s, up=shape, down=shape) for s in topology.sites))


# --- names and addresses of a built lab -------------------------------------------


@dataclass(frozen=True)
class SitePlan:
    """Where one site lives in a built lab."""

    name: str
    index: int
    host_ns: str
    """The namespace the site's processes run in."""
    router_ns: str | None
    """The NAT router's namespace (home sites only)."""
    address: str
    """The host's own address: public, or private on its home LAN."""
    wan_address: str
    """The address the core sees: the host's, or its router's WAN side."""
    gateway: str
    """The core's address on the site's access network."""
    host_gateway: str
    """The host's default route: the core, or its router's LAN side."""
    core_link: str
    """The core's end of the access link (its downlink qdisc is here)."""
    uplink_ns: str
    """The namespace whose `wan` interface carries the uplink qdisc."""


@dataclass(frozen=True)
class Plan:
    """Every name and address of one lab, from its topology and prefix."""

    prefix: str
    topology: Topology
    core_ns: str
    tun: str
    sites: tuple[SitePlan, ...]

    def site(self, name: str) -> SitePlan:
        return self.sites[self.topology.index(name) - 1]

    @property
    def namespaces(self) -> tuple[str, ...]:
        names = [self.core_ns]
        for site in self.sites:
            names.extend(ns for ns in (site.router_ns, site.host_ns) if ns is not None)
        return tuple(names)

    def site_of(self, address: str) -> str | None:
        """The site whose WAN address is `address` (what the core routes by)."""
        for site in self.sites:
            if site.wan_address == address:
                return site.name
        return None


WAN_IF: Final = "wan"
"""A site's side of its access link, in the host's or the router's namespace."""
LAN_IF: Final = "lan"
"""A home router's side of its LAN; the home host's side is `WAN_IF` too."""
TUN_IF: Final = "delay0"


def make_plan(topology: Topology, prefix: str) -> Plan:
    """Names and addresses for `topology` under `prefix` (a-z0-9, 2-8 chars)."""
    if not isinstance(prefix, str) or not PREFIX.match(prefix):
        raise TopologyError(f"prefix {prefix!r}: 2-8 lower-case letters and digits")
    sites = []
    for i, site in enumerate(topology.sites, 1):
        host_ns = f"{prefix}-{site.name}"
        router_ns = f"{prefix}-{site.name}-nat" if site.behind_nat else None
        wan = f"10.77.{i}.2"
        sites.append(
            SitePlan(
                name=site.name,
                index=i,
                host_ns=host_ns,
                router_ns=router_ns,
                address=f"192.168.{i}.2" if site.behind_nat else wan,
                wan_address=wan,
                gateway=f"10.77.{i}.1",
                host_gateway=f"192.168.{i}.1" if site.behind_nat else f"10.77.{i}.1",
                core_link=f"site{i}",
                uplink_ns=router_ns or host_ns,
            )
        )
    for name in (TUN_IF, *(s.core_link for s in sites)):
        assert len(name) <= IFNAMSIZ, name
    return Plan(prefix, topology, f"{prefix}-core", TUN_IF, tuple(sites))
