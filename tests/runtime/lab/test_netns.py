"""`runtime.lab.netns`: real namespaces (root; skipped elsewhere, saying why).

The lab must be what it is configured to be: RTT within a small tolerance
of the configuration (the measured error is printed), jitter and loss near
their settings, TBF caps holding, NAT routers that let a home host out and
nothing in unasked, port-preserving and symmetric mappings that differ as
their names say, and a teardown that leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.lab.check import EARLY_TOLERANCE_MS, RTT_TOLERANCE_MS
from runtime.lab.netns import ECHO_PORT, Lab, LabError, leftovers, namespaces, unavailable
from runtime.lab.topology import TopologyError, load_topology
from tests import REPO
from tests.runtime.lab.fixtures import MakeLab, skip_without_lab

NEVER_EARLY_MS = EARLY_TOLERANCE_MS
FLOOR_MS = 1.0
"""The fastest round trip is the configuration plus the path's own cost
(measured +0.3 to +0.45 ms, idle or busy): the delay itself is right."""
PUBLIC_40MS = {"link": {"delay_ms": 10}, "sites": [{"name": "a"}, {"name": "b"}]}


def _nat_lab(nat: str) -> dict[str, object]:
    return {
        "link": {"delay_ms": 2},
        "sites": [{"name": "a"}, {"name": "b"}, {"name": "home", "nat": nat}],
    }


def test_rtt_between_public_sites_is_the_configured_rtt(make_lab: MakeLab) -> None:
    lab = make_lab(PUBLIC_40MS)
    sample = lab.rtt("a", "b", count=100, interval_s=0.01)
    error = sample.median - 40.0
    print(f"RTT 40 ms configured: {sample.summary()}, error {error:+.3f} ms ({lab.priority})")
    assert sample.loss == 0.0
    assert abs(error) <= RTT_TOLERANCE_MS
    assert 40.0 - NEVER_EARLY_MS <= min(sample.rtt_ms) <= 40.0 + FLOOR_MS
    stats = lab.delayer_stats()
    assert stats["paths"]["a>b"] == {"sent": 100, "lost": 0} and stats["unroutable"] == 0


def test_each_direction_of_each_link_adds_its_delay(make_lab: MakeLab) -> None:
    lab = make_lab(
        {
            "sites": [
                {"name": "a", "up": {"delay_ms": 5}, "down": {"delay_ms": 25}},
                {"name": "b", "up": {"delay_ms": 15}, "down": {"delay_ms": 3}},
                {"name": "c", "up": {"delay_ms": 1}, "down": {"delay_ms": 1}},
            ]
        }
    )
    for site in ("b", "c"):
        lab.echo(site)
    to_b, to_c = (f"{lab.address(site)}:{ECHO_PORT}" for site in ("b", "c"))
    from_a = lab.ping("a", [to_b, to_c], count=10)["targets"]
    from_b = lab.ping("b", [to_c], count=10)["targets"]
    fastest = {
        ("a", "b"): min(from_a[to_b]["rtt_ms"]),
        ("a", "c"): min(from_a[to_c]["rtt_ms"]),
        ("b", "c"): min(from_b[to_c]["rtt_ms"]),
    }
    configured = {("a", "b"): 48.0, ("a", "c"): 32.0, ("b", "c"): 20.0}
    assert {pair: lab.topology.rtt_ms(*pair) for pair in configured} == configured
    for pair, rtt in fastest.items():
        assert -NEVER_EARLY_MS <= rtt - configured[pair] <= FLOOR_MS, (pair, rtt)


def test_jitter_spreads_round_trips_as_configured(make_lab: MakeLab) -> None:
    lab = make_lab(
        {"link": {"delay_ms": 10, "jitter_ms": 4}, "sites": [{"name": "a"}, {"name": "b"}]}
    )
    rtts = lab.rtt("a", "b", count=60, interval_s=0.015).rtt_ms
    # four uniform draws of ±4 ms: about normal with a 4.6 ms standard deviation,
    # an interquartile range of 6 ms (a quantile: a loaded host's outliers barely move it)
    quartiles = statistics.quantiles(rtts, n=4)
    print(f"jitter ±4 ms per link: quartiles {quartiles}")
    assert 3.0 < quartiles[2] - quartiles[0] < 9.5
    assert min(rtts) >= 24.0 - NEVER_EARLY_MS


def test_loss_is_near_the_configured_fraction(make_lab: MakeLab) -> None:
    lab = make_lab({"link": {"delay_ms": 1}, "sites": [{"name": "a", "loss": 0.1}, {"name": "b"}]})
    sample = lab.rtt("a", "b", count=500, interval_s=0.002)
    configured = 1 - 0.9 * 0.9  # a's uplink out, a's downlink back
    sigma = (configured * (1 - configured) / 500) ** 0.5
    print(f"round-trip loss {sample.loss:.3f} against {configured:.3f} (sigma {sigma:.3f})")
    assert abs(sample.loss - configured) <= 4 * sigma


@pytest.mark.parametrize("direction", ["up", "down"])
def test_a_rate_cap_limits_throughput(make_lab: MakeLab, direction: str) -> None:
    capped = "a" if direction == "up" else "b"
    spec = {"sites": [{"name": "a"}, {"name": "b"}]}
    spec["sites"][capped == "b"][direction] = {"rate": 500_000}  # type: ignore[index]
    lab = make_lab(spec)
    measured = lab.throughput("a", "b", rate=1_500_000, duration_s=1.0)
    print(f"{direction}link capped at 500000 B/s: {measured}")
    assert measured["rate"] == pytest.approx(500_000, rel=0.15)


@pytest.mark.parametrize("nat", ["port-preserving", "symmetric"])
def test_a_home_host_reaches_out_and_nothing_reaches_in(make_lab: MakeLab, nat: str) -> None:
    lab = make_lab(_nat_lab(nat))
    wan = lab.public_address("home")
    assert lab.address("home").startswith("192.168.") and wan.startswith("10.77.")
    out = lab.rtt("home", "a", count=5)
    assert len(out.rtt_ms) == 5
    lab.echo("home")
    unasked = [f"{lab.address('home')}:{ECHO_PORT}", f"{wan}:{ECHO_PORT}"]
    replies = lab.ping("a", unasked, count=5, wait_s=0.3)["targets"]
    assert {t: len(r["rtt_ms"]) for t, r in replies.items()} == dict.fromkeys(unasked, 0)


def test_a_home_router_forwards_nothing_unasked_even_when_routed_to(make_lab: MakeLab) -> None:
    """Its ISP (the core) routes straight to the private address: the
    router's forward chain still drops what no one inside asked for."""
    lab = make_lab(_nat_lab("port-preserving"))
    home = lab.plan.site("home")
    core = lab.plan.core_ns
    subprocess.run(
        ["ip", "-n", core, "route", "add", f"{home.address}/32", "via", home.wan_address],
        check=True,
    )
    lab.echo("home")
    ping = [
        sys.executable,
        "-m",
        "runtime.lab.probe",
        "ping",
        "--to",
        f"{home.address}:{ECHO_PORT}",
    ]
    done = subprocess.run(
        ["ip", "netns", "exec", core, *ping, "--count", "5", "--wait", "0.3"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    assert '"rtt_ms": []' in done.stdout, done.stdout


def _seen_ports(lab: Lab) -> list[str]:
    targets = [f"{lab.address(site)}:{ECHO_PORT}" for site in ("a", "b")]
    for site in ("a", "b"):
        lab.echo(site)
    replies = lab.ping("home", targets, count=3, port=40_000)["targets"]
    return [replies[t]["seen_as"] for t in targets]


def test_port_preserving_nat_shows_one_port_to_every_peer(make_lab: MakeLab) -> None:
    lab = make_lab(_nat_lab("port-preserving"))
    wan = lab.public_address("home")
    assert _seen_ports(lab) == [f"{wan}:40000", f"{wan}:40000"]


def test_symmetric_nat_shows_each_peer_another_port(make_lab: MakeLab) -> None:
    lab = make_lab(_nat_lab("symmetric"))
    seen_a, seen_b = _seen_ports(lab)
    assert seen_a.split(":")[0] == seen_b.split(":")[0] == lab.public_address("home")
    assert seen_a != seen_b


@pytest.mark.parametrize(("nat", "punched"), [("port-preserving", 3), ("symmetric", 0)])
def test_a_punched_hole_lets_in_only_the_peer_it_was_punched_to(
    make_lab: MakeLab, nat: str, punched: int
) -> None:
    """The home echo sends to a's port 40000 first: a, from that port, then
    reaches it at the router's same port (where the NAT kept it); b does not."""
    lab = make_lab(_nat_lab(nat))
    lab.echo("home", punch=[f"{lab.address('a')}:40000"])
    hole = f"{lab.public_address('home')}:{ECHO_PORT}"
    from_a = lab.ping("a", [hole], count=3, port=40_000, wait_s=0.3)["targets"][hole]
    from_b = lab.ping("b", [hole], count=3, port=40_000, wait_s=0.3)["targets"][hole]
    assert (len(from_a["rtt_ms"]), len(from_b["rtt_ms"])) == (punched, 0)


def _state(pid: int) -> str:
    """A process's state letter, or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "gone"


def _root_links() -> set[str]:
    done = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return {line.split(":")[1].strip() for line in done.stdout.splitlines()}


def test_teardown_leaves_nothing_even_after_an_exception() -> None:
    skip_without_lab()
    links = _root_links()
    lab = Lab(load_topology(_nat_lab("symmetric")))
    with pytest.raises(RuntimeError, match="inside the lab"), lab:
        shell = lab.spawn(
            "home", ["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE, text=True
        )
        assert shell.stdout is not None
        grandchild = int(shell.stdout.readline())
        made = set(lab.plan.namespaces)
        assert made <= set(namespaces())
        raise RuntimeError("inside the lab")
    assert not made & set(namespaces()) and leftovers(lab.plan.prefix) == []
    assert shell.poll() is not None
    assert _state(grandchild) in ("gone", "Z")  # killed with its process group
    assert _root_links() == links
    lab.close()  # twice is fine


def test_two_labs_at_once_and_one_closed(make_lab: MakeLab) -> None:
    first = make_lab(PUBLIC_40MS)
    with Lab(load_topology({"sites": [{"name": "a"}, {"name": "b"}]})) as second:
        assert first.plan.prefix != second.plan.prefix
        assert min(second.rtt("a", "b", count=5).rtt_ms) < FLOOR_MS
    assert min(first.rtt("a", "b", count=5).rtt_ms) >= 40.0 - NEVER_EARLY_MS


def test_a_prefix_in_use_is_refused_and_the_other_lab_kept(make_lab: MakeLab) -> None:
    first = make_lab(PUBLIC_40MS)
    with pytest.raises(LabError, match="exist already"), Lab(first.topology, first.plan.prefix):
        pass
    assert set(first.plan.namespaces) <= set(namespaces())
    assert min(first.rtt("a", "b", count=3).rtt_ms) >= 40.0 - NEVER_EARLY_MS


def test_bad_requests_fail_clearly(make_lab: MakeLab) -> None:
    lab = make_lab(
        {
            "sites": [
                {"name": "a"},
                {"name": "h1", "nat": "symmetric"},
                {"name": "h2", "nat": "symmetric"},
            ]
        }
    )
    with pytest.raises(LabError, match="both behind NAT"):
        lab.rtt("h1", "h2")
    with pytest.raises(LabError, match="to itself"):
        lab.rtt("a", "a")
    with pytest.raises(TopologyError, match="no site 'zz'"):
        lab.address("zz")
    with pytest.raises(LabError, match="behind NAT"):
        lab.throughput("a", "h1", rate=100_000)


def test_an_unbuilt_lab_says_how_to_build_it() -> None:
    with pytest.raises(LabError, match="with Lab"):
        _ = Lab(load_topology(PUBLIC_40MS)).plan


def test_without_root_the_reason_is_given() -> None:
    """The check itself, run as nobody (with the system's Python: the venv
    may sit where nobody can read)."""
    skip_without_lab()
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 to run as another user")
    done = subprocess.run(
        [python, "-c", "from runtime.lab.netns import unavailable; print(unavailable())"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        user=65534,
        group=65534,
        extra_groups=[],
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)},
        cwd="/",
    )
    assert "need root" in done.stdout
    assert unavailable() is None


def test_a_built_lab_refuses_to_build_again(make_lab: MakeLab) -> None:
    """`shardmesh lab up` and `check` once entered a lab they had built: a
    second lab, under a fresh prefix, was built over the first, and the
    first's namespaces were left behind on every run."""
    lab = make_lab({"sites": [{"name": "a"}, {"name": "b"}]})
    with pytest.raises(LabError, match="built already"):
        lab.__enter__()
    assert sorted(leftovers(lab.plan.prefix)) == sorted(lab.plan.namespaces)  # still only one
