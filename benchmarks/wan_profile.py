"""The `wan` membership profile's timings, measured in the WAN lab rather than guessed.

    python -m benchmarks.wan_profile [--json] [--quick] [--minutes M] [--case RTT:LOSS]

Per case (`CASES`) one lab of five public sites runs, side by side, a
five-node swarm of real `shardmesh node` processes (no model) per candidate
probe_interval / probe_timeout / suspicion_mult, started through this
module's `--node-settings` launcher (the wan profile overridden in that
process only). Each swarm is watched for `--minutes`, then its node in
site e is SIGKILLed. The nodes' logs give false suspicions and deaths per
node-minute and kill-to-dead time (beside `detection_bound(5)`); a capture
per site, the bytes a node sends. `chosen`: the fastest candidate clean in
every case. `--quick`: the shipped profile alone, 40 ms, 10 s. Root only;
the last line is one JSON object (docs/benchmarks.md#wan_profile).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import trio

from mesh.config import MembershipConfig
from runtime.cli.localswarm import LocalNode, LocalSwarm, all_see
from runtime.lab.check import run_check
from runtime.lab.netns import Lab, unavailable
from runtime.lab.topology import WAN_IF, load_topology

REPO = Path(__file__).resolve().parents[1]
NODE_SETTINGS_FLAG = "--node-settings"
"""`python -m benchmarks.wan_profile --node-settings JSON node ...`: a node
whose wan profile has the JSON's fields overridden (`run_candidate_node`)."""
TUNED = ("probe_interval", "probe_timeout", "suspicion_mult")
"""The fields the candidates vary; every other field is the wan profile's."""
CANDIDATES: tuple[dict[str, float], ...] = (
    {"probe_interval": 5.0, "probe_timeout": 3.0, "suspicion_mult": 6},
    {"probe_interval": 3.0, "probe_timeout": 1.5, "suspicion_mult": 5},
    {"probe_interval": 2.0, "probe_timeout": 1.0, "suspicion_mult": 4},
    {"probe_interval": 1.0, "probe_timeout": 0.5, "suspicion_mult": 3},
)
"""A ladder from slow to fast: the profile's first, guessed values (5 s /
3 s / 6), two steps between, and lan's probe and suspicion timings."""
CASES = ((40.0, 0.01), (100.0, 0.03), (300.0, 0.01))
"""(RTT ms between every pair, loss on every access link): the issue's
volunteers; a harsh internet (3% on each access link, so about 6% on
each path one way); and the far end of the profile's range, a home link across the
world (300 ms), where a lost packet's TCP retransmission alone takes
longer than a short probe timeout."""
SITES = ("a", "b", "c", "d", "e")
VICTIM = "e"
"""The site whose node is SIGKILLed (a founds each swarm and stays)."""
DEFAULT_MINUTES = 5.0
"""Watched per case: three cases and their kills in about 20 minutes."""
QUICK_OBSERVE_S = 10.0
MAX_FALSE_SUSPICIONS_PER_NODE_MINUTE = 0.1
""""Few": a live node falsely suspected at most once in ten minutes. Each
one costs a suspect and a refutation that every node relays
retransmit_mult * log10(N) times, so at 1,000 nodes this rate is already
about a hundred of each a minute swarm-wide."""
START_TIMEOUT_S = 60.0
CONVERGE_TIMEOUT_S = 60.0
"""Four swarms of five joining at once on a shared 2-core machine."""
CHECK_PROBES = 20
"""Round trips per pair in the lab's own check (`runtime.lab.check`)."""
DETECT_POLL_S = 0.5
CAPTURE_STOP_S = 5.0
LOG_EVENT = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ shardmesh\.node: "
    r"member ([0-9a-f]{12}) (suspect|dead) \(incarnation (\d+)\)"
)
"""A membership event as `runtime.node.membership_driver` logs it."""
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"


@dataclass(frozen=True)
class Event:
    """One node's log line: it took `subject` (a 12-hex id prefix) for `kind`."""

    at: float
    observer: str
    subject: str
    kind: str
    incarnation: int


@dataclass
class Run:
    """One candidate's swarm in one case."""

    settings: dict[str, float]
    swarm: LocalSwarm
    nodes: list[LocalNode] = field(default_factory=list)
    converge_s: float | None = None

    @property
    def config(self) -> MembershipConfig:
        return MembershipConfig.wan().with_overrides(**self.settings)

    @property
    def victim(self) -> LocalNode:
        return next(node for node in self.nodes if node.site == VICTIM)


def name_of(settings: dict[str, float]) -> str:
    """`p2-t1-s4`: probe interval, probe timeout (s), suspicion multiplier."""
    p, t, s = (settings[key] for key in TUNED)
    return f"p{p:g}-t{t:g}-s{s:g}"


def shipped() -> dict[str, float]:
    """The tuned fields as `MembershipConfig.wan()` has them today."""
    wan = MembershipConfig.wan()
    return {key: getattr(wan, key) for key in TUNED}


def spec(rtt_ms: float, loss: float) -> dict[str, Any]:
    """Five public sites, RTT/4 one way on every access link, `loss` on each."""
    link = {"delay_ms": rtt_ms / 4, "jitter_ms": 0, "loss": loss}
    return {"seed": 29, "link": link, "sites": [{"name": name} for name in SITES]}


# --- the node side: a wan profile overridden in one process --------------------


def run_candidate_node(settings: dict[str, float], argv: Sequence[str]) -> int:
    """Run `shardmesh ARGV` with the wan profile's fields overridden."""
    from runtime.cli.main import main as cli_main

    tuned = MembershipConfig.wan().with_overrides(**settings)  # validated here
    setattr(MembershipConfig, "wan", classmethod(lambda cls: tuned))  # noqa: B010 - a method
    return cli_main(argv)


class CandidateSwarm(LocalSwarm):
    """A `LocalSwarm` whose nodes start through `run_candidate_node`."""

    def __init__(self, root: Path, lab: Lab, settings: dict[str, float]) -> None:
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        super().__init__(root, profile="wan", lab=lab, extra_env={"PYTHONPATH": path})
        self.settings = settings

    @property
    def interpreter(self) -> list[str]:
        settings = json.dumps(self.settings)
        return [self.python, "-m", "benchmarks.wan_profile", NODE_SETTINGS_FLAG, settings]


# --- reading what happened from the nodes' logs ----------------------------------


def parse_events(observer: str, lines: Iterable[str]) -> list[Event]:
    """The suspect and dead events in one node's log."""
    events = []
    for line in lines:
        match = LOG_EVENT.match(line)
        if match is not None:
            at = datetime.strptime(match[1], LOG_TIME).timestamp()
            events.append(Event(at, observer, match[2], match[3], int(match[4])))
    return events


def node_events(nodes: Iterable[LocalNode]) -> list[Event]:
    found = []
    for node in nodes:
        text = node.log_path.read_text(errors="replace") if node.log_path.exists() else ""
        found += parse_events(node.name, text.splitlines())
    return found


def short_id(node: LocalNode) -> str:
    return node.node_id[:12]


def detection(
    events: Iterable[Event], survivors: Sequence[str], victim: str, since: float
) -> dict[str, float] | None:
    """Seconds from `since` to `dead` at the first and at every survivor
    (None until every survivor logged it)."""
    first: dict[str, float] = {}
    for event in events:
        if event.kind == "dead" and event.subject == victim and event.at >= since:
            first[event.observer] = min(first.get(event.observer, event.at), event.at)
    if not set(survivors) <= set(first):
        return None
    times = [first[name] - since for name in survivors]
    return {"first_s": round(min(times), 2), "all_s": round(max(times), 2)}


def false_alarms(
    events: Iterable[Event], window: tuple[float, float], victim: str, killed_at: float
) -> dict[str, int]:
    """False suspicions and deaths in `window`: of a node that was running
    (the victim only before `killed_at`). An episode is one (subject,
    incarnation): one accusation, however many nodes heard it; a view is
    one node's log line of it."""
    episodes: dict[str, set[tuple[str, int]]] = {"suspect": set(), "dead": set()}
    views = {"suspect": 0, "dead": 0}
    for event in events:
        running = event.subject != victim or event.at < killed_at
        if running and window[0] <= event.at <= window[1]:
            episodes[event.kind].add((event.subject, event.incarnation))
            views[event.kind] += 1
    return {
        "false_suspicions": len(episodes["suspect"]),
        "false_deaths": len(episodes["dead"]),
        "suspect_views": views["suspect"],
        "dead_views": views["dead"],
    }


# --- bandwidth: a capture in every site -----------------------------------------


def start_captures(lab: Lab, folder: Path) -> dict[str, tuple[subprocess.Popen[bytes], Path]]:
    """`runtime.lab.capture` on every site's WAN interface, once each is reading."""
    captures = {}
    for site in SITES:
        out = folder / f"capture-{site}.json"
        argv = [sys.executable, "-m", "runtime.lab.capture", WAN_IF, str(out)]
        proc = lab.spawn(site, argv, stdout=subprocess.PIPE, cwd=REPO)
        assert proc.stdout is not None and json.loads(proc.stdout.readline())["ready"]
        captures[site] = (proc, out)
    return captures


def stop_captures(
    captures: dict[str, tuple[subprocess.Popen[bytes], Path]],
) -> dict[str, dict[str, Any]]:
    """Each site's flows (`src:port>dst:port` -> bytes), once its capture wrote them."""
    for proc, _ in captures.values():
        proc.send_signal(signal.SIGTERM)
    flows = {}
    for site, (proc, out) in captures.items():
        proc.wait(CAPTURE_STOP_S)
        flows[site] = {key: flow["bytes"] for key, flow in json.loads(out.read_text()).items()}
    return flows


def endpoints(node: LocalNode) -> list[str]:
    """`host:port` of every port the node listens on (from its ready file)."""
    found = []
    for key in ("control", "data", "api", "relay"):
        if node.info.get(key):
            parts = urlsplit(str(node.info[key]))
            found.append(f"{parts.hostname}:{parts.port}")
    return found


def sent_bytes(flows: dict[str, dict[str, int]], owner: dict[str, str], lab: Lab) -> dict[str, int]:
    """TCP payload bytes each swarm's nodes sent, by candidate name: every
    flow a site sent, charged to the swarm one of whose ports it touches."""
    sent: dict[str, int] = {}
    for site, by_flow in flows.items():
        address = lab.address(site)
        for key, count in by_flow.items():
            source, target = key.split(">")
            swarm = owner.get(source) or owner.get(target)
            if swarm is not None and source.rsplit(":", 1)[0] == address:
                sent[swarm] = sent.get(swarm, 0) + count
    return sent


# --- one case --------------------------------------------------------------------


async def start_runs(
    stack: AsyncExitStack, lab: Lab, root: Path, candidates: Sequence[dict[str, float]]
) -> list[Run]:
    """Every candidate's swarm started (a founds it, the rest join) and converged."""
    runs = []
    for settings in candidates:
        swarm = CandidateSwarm(root / name_of(settings), lab, settings)
        runs.append(Run(settings, await stack.enter_async_context(swarm)))
    for run in runs:
        began = trio.current_time()
        run.nodes = [run.swarm.new_node(site, site=site) for site in SITES]
        await run.swarm.start_ready(run.nodes[0], timeout=START_TIMEOUT_S)
        await run.swarm.start_many(run.nodes[1:], [run.nodes[0].seed], timeout=START_TIMEOUT_S)
        alive = all_see(run.nodes, run.nodes, "alive")
        await run.swarm.wait_for(run.nodes, alive, CONVERGE_TIMEOUT_S, "full membership")
        run.converge_s = round(trio.current_time() - began, 2)
    return runs


async def await_detection(
    runs: Sequence[Run], killed_at: float
) -> dict[str, dict[str, float] | None]:
    """Each run's detection, polled from the survivors' logs until every run
    saw its victim dead everywhere or passed its documented bound."""
    found: dict[str, dict[str, float] | None] = {name_of(run.settings): None for run in runs}
    pending = list(runs)
    while pending:
        await trio.sleep(DETECT_POLL_S)
        for run in list(pending):
            survivors = [node for node in run.nodes if node is not run.victim]
            events = node_events(survivors)
            seen = detection(events, [n.name for n in survivors], short_id(run.victim), killed_at)
            found[name_of(run.settings)] = seen
            if seen is not None or time.time() > killed_at + run.config.detection_bound(len(SITES)):
                pending.remove(run)
    return found


def summarize_run(
    run: Run,
    window: tuple[float, float],
    killed_at: float,
    seen: dict[str, float] | None,
    sent_per_node_s: float | None,
) -> dict[str, Any]:
    """One candidate in one case: false alarms per node-minute, detection, bytes."""
    n = len(run.nodes)
    node_minutes = (n * (killed_at - window[0]) + (n - 1) * (window[1] - killed_at)) / 60
    alarms = false_alarms(node_events(run.nodes), window, short_id(run.victim), killed_at)
    bound = run.config.detection_bound(n)
    return {
        "settings": run.settings,
        "converge_s": run.converge_s,
        "node_minutes": round(node_minutes, 1),
        **alarms,
        "false_suspicions_per_node_minute": round(alarms["false_suspicions"] / node_minutes, 4),
        "false_deaths_per_node_minute": round(alarms["false_deaths"] / node_minutes, 4),
        "detect_s": None if seen is None else seen["all_s"],
        "detect_first_s": None if seen is None else seen["first_s"],
        "detection_bound_s": round(bound, 1),
        "within_bound": seen is not None and seen["all_s"] <= bound,
        "sent_bytes_per_node_s": sent_per_node_s,
    }


async def measure(
    lab: Lab, root: Path, candidates: Sequence[dict[str, float]], observe_s: float
) -> dict[str, dict[str, Any]]:
    """All candidates' swarms in one lab: watched, then one node of each killed."""
    async with AsyncExitStack() as stack:
        runs = await start_runs(stack, lab, root, candidates)
        owner = {
            end: name_of(run.settings) for run in runs for n in run.nodes for end in endpoints(n)
        }
        captures = start_captures(lab, root)
        watched_from = time.time()
        await trio.sleep(observe_s)
        flows = stop_captures(captures)
        captured_s = time.time() - watched_from
        killed_at = time.time()
        for run in runs:
            run.victim.kill()
        seen = await await_detection(runs, killed_at)
        window = (watched_from, time.time())
        sent = sent_bytes(flows, owner, lab)
        results = {}
        for run in runs:
            name = name_of(run.settings)
            per_node = round(sent.get(name, 0) / len(SITES) / captured_s)
            results[name] = summarize_run(run, window, killed_at, seen[name], per_node)
        return results


def run_case(
    root: Path, case: tuple[float, float], candidates: Sequence[dict[str, float]], observe_s: float
) -> dict[str, Any]:
    """A fresh lab for one (RTT, loss): checked, then every candidate in it."""
    rtt_ms, loss = case
    with Lab(load_topology(spec(rtt_ms, loss))) as lab:
        check = run_check(lab, count=CHECK_PROBES)
        folder = root / f"rtt{rtt_ms:g}-loss{loss:g}"
        folder.mkdir(parents=True)
        runs = trio.run(measure, lab, folder, candidates, observe_s)
    return {
        "rtt_ms": rtt_ms,
        "loss": loss,
        "lab_ok": check["ok"],
        "rtt_error_ms": check["rtt_error_ms"],
        "observed_s": observe_s,
        "candidates": runs,
    }


# --- the choice ------------------------------------------------------------------


def eligible(per_case: Sequence[dict[str, Any]]) -> bool:
    """No false death, few false suspicions, and a detection within the bound, in every case."""
    return all(
        row["false_deaths"] == 0
        and row["false_suspicions_per_node_minute"] <= MAX_FALSE_SUSPICIONS_PER_NODE_MINUTE
        and row["within_bound"]
        for row in per_case
    )


def by_candidate(cases: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each candidate's rows across the cases, whether it qualifies (in
    every case), and its slowest detection (what the choice ranks by)."""
    table: dict[str, dict[str, Any]] = {}
    for case in cases:
        label = f"{case['rtt_ms']:g}ms/{case['loss']:g}"
        for name, row in case["candidates"].items():
            entry = table.setdefault(name, {"settings": row["settings"], "by_case": {}})
            entry["by_case"][label] = row
    for entry in table.values():
        rows = list(entry["by_case"].values())
        entry["eligible"] = len(rows) == len(cases) and eligible(rows)
        detections = [row["detect_s"] for row in rows]
        entry["worst_detect_s"] = None if None in detections else max(detections)
    return table


def choose(table: dict[str, dict[str, Any]]) -> str | None:
    """The qualifying candidate with the fastest worst-case detection."""
    ranked = sorted(
        (entry["worst_detect_s"], name) for name, entry in table.items() if entry["eligible"]
    )
    return ranked[0][1] if ranked else None


def result(cases: list[dict[str, Any]], began: float) -> dict[str, Any]:
    table = by_candidate(cases)
    chosen = choose(table)
    entry = table.get(chosen or "")
    rows = list(entry["by_case"].values()) if entry else []
    return {
        "benchmark": "wan_profile",
        "chosen": entry["settings"] if entry else None,
        "chosen_name": chosen,
        "shipped": shipped(),
        "chosen_is_shipped": entry is not None and entry["settings"] == shipped(),
        "false_deaths": sum(row["false_deaths"] for row in rows) if entry else None,
        "false_suspicions": sum(row["false_suspicions"] for row in rows) if entry else None,
        "detect_s": entry["worst_detect_s"] if entry else None,
        "detection_bound_s": rows[0]["detection_bound_s"] if rows else None,
        "max_false_suspicions_per_node_minute": MAX_FALSE_SUSPICIONS_PER_NODE_MINUTE,
        "candidates": table,
        "cases": [{k: v for k, v in case.items() if k != "candidates"} for case in cases],
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "wall_s": round(time.perf_counter() - began, 1),
    }


def print_case(case: dict[str, Any]) -> None:
    print(
        f"{case['rtt_ms']:g} ms RTT, loss {case['loss']:g}, lab ok {case['lab_ok']}:",
        file=sys.stderr,
    )
    for name, row in case["candidates"].items():
        print(
            f"  {name:14} converge {row['converge_s']} s, false suspicions "
            f"{row['false_suspicions']} ({row['false_suspicions_per_node_minute']}/node-min), "
            f"false deaths {row['false_deaths']}, detect {row['detect_s']} s "
            f"(bound {row['detection_bound_s']}), sent {row['sent_bytes_per_node_s']} B/s/node",
            file=sys.stderr,
        )


def case_arg(text: str) -> tuple[float, float]:
    """`100:0.03` -> (100.0, 0.03): RTT in ms, loss as a fraction."""
    try:
        rtt, loss = (float(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want RTT_MS:LOSS, e.g. 100:0.03") from None
    if not (rtt > 0 and 0 <= loss < 1):
        raise argparse.ArgumentTypeError(f"{text!r}: RTT must be > 0 and loss in [0, 1)")
    return rtt, loss


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [NODE_SETTINGS_FLAG] and len(argv) >= 2:
        return run_candidate_node(json.loads(argv[1]), argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument(
        "--quick", action="store_true", help="the shipped profile at 40 ms, 1%% loss, briefly"
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help=f"watched per case (default {DEFAULT_MINUTES:g}; --quick {QUICK_OBSERVE_S:g} s)",
    )
    parser.add_argument(
        "--case",
        action="append",
        type=case_arg,
        metavar="RTT:LOSS",
        help="measure this case (ms, fraction) instead of the defaults; repeatable",
    )
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason is not None:
        parser.error(f"no WAN lab here: {reason}")
    default_s = QUICK_OBSERVE_S if args.quick else DEFAULT_MINUTES * 60
    observe_s = default_s if args.minutes is None else args.minutes * 60
    cases_run = args.case or (CASES[:1] if args.quick else CASES)
    candidates = [shipped()] if args.quick else list(CANDIDATES)
    began = time.perf_counter()
    cases = []
    with tempfile.TemporaryDirectory(prefix="shardmesh-wan-profile-") as tmp:
        for case in cases_run:
            cases.append(run_case(Path(tmp), case, candidates, observe_s))
            if not args.json:
                print_case(cases[-1])
    print(json.dumps(result(cases, began)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
