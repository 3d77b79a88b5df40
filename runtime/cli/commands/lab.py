"""`shardmesh lab`: the WAN testbed (`runtime.lab`, docs/lab.md) by hand.

`up` builds a lab from a JSON spec (or the default one), prints its sites,
addresses and how to run a command in each, and keeps it until Ctrl-C or
SIGTERM, then removes it. `check` builds a lab, measures its RTT, loss and
rate against the spec, prints JSON and removes it (exit 1 when a figure is
out of tolerance). `down` removes what a killed `up` left; `example` prints
the default spec to start one from. All but `example` need root.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.cli import argtypes
from runtime.cli.command import PROG, Commands, fail

if TYPE_CHECKING:
    from runtime.lab.netns import Lab
    from runtime.lab.topology import Topology

WATCH_S = 1.0
"""How often `up` looks whether the delayer still runs (and the clock)."""


def register(commands: Commands) -> None:
    lab = commands.add_parser(
        "lab",
        help="a WAN of network namespaces: delay, jitter, loss, rate, NAT routers (root)",
        description=(
            "Build Linux network namespaces joined through an internet core with per-link "
            "one-way delay, jitter, loss and rate, and home sites behind NAT routers "
            "(docs/lab.md). Needs root, iproute2, nftables and /dev/net/tun."
        ),
    )
    labs = lab.add_subparsers(dest="lab_command", title="lab commands", required=True)
    spec_help = "the lab's JSON spec (default: the spec `lab example` prints)"
    up = labs.add_parser(
        "up",
        help="build a lab and keep it until Ctrl-C",
        description="Build the lab, print its sites, keep it until Ctrl-C or SIGTERM.",
    )
    up.add_argument("spec", type=Path, nargs="?", metavar="SPEC.json", help=spec_help)
    up.add_argument("--prefix", help="the namespaces' prefix (default: lab and 4 hex digits)")
    up.add_argument("--json", action="store_true", help="print the sites as JSON")
    up.add_argument(
        "--for", dest="hold_s", type=argtypes.duration, help="tear down after this long (90s, 2h)"
    )
    up.set_defaults(run=run_up)
    check = labs.add_parser(
        "check",
        help="build a lab, measure it against its spec, print JSON",
        description="Build the lab, measure RTT, loss and rate against the spec, print JSON, "
        "remove it. Exits 1 when a figure is out of its tolerance.",
    )
    check.add_argument("spec", type=Path, nargs="?", metavar="SPEC.json", help=spec_help)
    check.add_argument(
        "--count",
        type=argtypes.positive_int,
        default=100,
        help="probes per pair, 10 ms apart (default 100)",
    )
    check.set_defaults(run=run_check)
    down = labs.add_parser(
        "down",
        help="remove a lab's leftover namespaces",
        description="Remove the namespaces (and kill the processes in them) of lab PREFIX, or "
        "of every lab that named itself (lab and 4 hex digits) when none is given.",
    )
    down.add_argument(
        "prefix",
        nargs="?",
        metavar="PREFIX",
        help="the lab's prefix (`lab up` prints it); default: every lab's leftovers",
    )
    down.set_defaults(run=run_down)
    example = labs.add_parser("example", help="print the default lab's spec (JSON)")
    example.set_defaults(run=run_example)


def _topology(spec: Path | None) -> Topology | str:
    """The spec's topology, or what is wrong with it (one line)."""
    from runtime.lab.check import DEFAULT_SPEC
    from runtime.lab.topology import TopologyError, load_topology

    try:
        raw = DEFAULT_SPEC if spec is None else json.loads(spec.read_text(encoding="utf-8"))
        return load_topology(raw)
    except OSError as exc:
        return f"cannot read {spec}: {exc.strerror or exc}"
    except ValueError as exc:  # TopologyError, or JSON that does not parse
        kind = "" if isinstance(exc, TopologyError) else "not JSON: "
        return f"{spec or 'the default spec'}: {kind}{exc}"


def _build(command: str, spec: Path | None, prefix: str | None = None) -> Lab | int:
    from runtime.lab.netns import Lab, LabError, unavailable
    from runtime.lab.topology import TopologyError

    topology = _topology(spec)
    if isinstance(topology, str):
        return fail(command, topology)
    reason = unavailable()
    if reason is not None:
        return fail(command, f"no lab can be built here: {reason}")
    lab = Lab(topology, prefix)
    try:
        return lab.__enter__()
    except (LabError, TopologyError) as exc:
        return fail(command, str(exc))


def describe(lab: Lab) -> dict[str, Any]:
    """What `up` prints: each site's namespace, addresses, NAT and links."""
    sites = []
    for shape, site in zip(lab.topology.sites, lab.plan.sites, strict=True):
        sites.append(
            {
                "name": site.name,
                "namespace": site.host_ns,
                "address": site.address,
                "public_address": site.wan_address,
                "nat": shape.nat,
                "up": vars(shape.up),
                "down": vars(shape.down),
            }
        )
    return {"prefix": lab.plan.prefix, "delayer_priority": lab.priority, "sites": sites}


def _link_text(link: dict[str, Any]) -> str:
    parts = [f"{link['delay_ms']:g} ms"]
    if link["jitter_ms"]:
        parts.append(f"±{link['jitter_ms']:g} ms")
    if link["loss"]:
        parts.append(f"{link['loss']:.2%} loss")
    if link["rate"]:
        parts.append(f"{link['rate']:,} B/s")
    return ", ".join(parts)


def render(document: dict[str, Any]) -> str:
    prefix = document["prefix"]
    lines = [f"lab {prefix} is up (delayer at {document['delayer_priority']})", ""]
    for site in document["sites"]:
        seen = site["public_address"]
        where = f"behind {site['nat']} NAT, seen as {seen}" if site["nat"] != "none" else "public"
        lines.append(f"  {site['name']:<10} {site['namespace']:<20} {site['address']:<13} {where}")
        lines.append(f"  {'':<10} up {_link_text(site['up'])}; down {_link_text(site['down'])}")
    first = document["sites"][0]
    lines += [
        "",
        f"run a command in a site:  ip netns exec {first['namespace']} COMMAND",
        "Ctrl-C or SIGTERM removes the lab; if this process is killed, "
        f"`{PROG} lab down {prefix}` removes what is left.",
    ]
    return "\n".join(lines)


class _Stopped(Exception):
    """SIGINT or SIGTERM arrived: remove the lab and exit 0."""


def _stop_on_signals() -> None:
    """From here, SIGINT or SIGTERM raises `_Stopped` once (a handler, not a
    blocked mask: children inherit a mask, not a handler); any more are
    ignored, so the teardown they asked for runs to its end."""

    def stop(signum: int, frame: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise _Stopped

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def run_up(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _stop_on_signals()  # before the build: a half-built lab is removed too
    try:
        lab = _build("lab up", args.spec, args.prefix)
        if isinstance(lab, int):
            return lab
        try:  # built by _build already: entering it again would build a second lab
            document = describe(lab)
            print(json.dumps(document) if args.json else render(document), flush=True)
            return _hold(lab, args.hold_s)
        finally:
            lab.close()
    except _Stopped:
        print("shardmesh lab up: stopped; the lab is removed", file=sys.stderr)
        return 0


def _hold(lab: Lab, hold_s: float | None) -> int:
    """Until a signal (`_Stopped`), `hold_s`, or the delayer's end; the
    caller's `with` removes the lab."""
    deadline = None if hold_s is None else time.monotonic() + hold_s
    while deadline is None or time.monotonic() < deadline:
        left = WATCH_S if deadline is None else deadline - time.monotonic()
        time.sleep(max(0.0, min(WATCH_S, left)))
        if not lab.delayer_running():
            return fail("lab up", "the delayer stopped, so the lab no longer delays: removed it")
    return 0


def run_check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.lab.check import run_check as measure
    from runtime.lab.netns import LabError

    lab = _build("lab check", args.spec)
    if isinstance(lab, int):
        return lab
    try:
        try:
            report = measure(lab, count=args.count)
        finally:
            lab.close()
    except LabError as exc:
        return fail("lab check", str(exc))
    print(json.dumps(report, indent=2))
    if not report["ok"]:
        return fail("lab check", "a measured figure is out of its tolerance (see ok: false)")
    return 0


def run_down(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.lab.netns import LabError, leftovers, remove_namespaces, unavailable

    reason = unavailable()
    if reason is not None:
        return fail("lab down", reason)
    try:
        removed = remove_namespaces(leftovers(args.prefix))
    except LabError as exc:
        return fail("lab down", str(exc))
    print("\n".join(f"removed {name}" for name in removed) or "no lab namespaces to remove")
    return 0


def run_example(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.lab.check import DEFAULT_SPEC

    print(json.dumps(DEFAULT_SPEC, indent=2))
    return 0
