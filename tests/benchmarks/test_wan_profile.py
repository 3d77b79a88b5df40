"""The wan-profile benchmark (`benchmarks.wan_profile`): how it reads the
nodes' logs and picks a candidate, and that its launcher really gives a
node process the candidate's profile. The shipped profile in a lab (no
live node taken for dead, a killed one dead within the bound, at 40 ms
and 1% loss) is tests/processes/test_wan.py's to hold in the suite; the
benchmark's own runs, `--quick` included, are by hand
(docs/benchmarks.md#wan_profile)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.wan_profile import (
    MAX_FALSE_SUSPICIONS_PER_NODE_MINUTE,
    REPO,
    Event,
    by_candidate,
    choose,
    detection,
    false_alarms,
    parse_events,
    shipped,
)
from mesh.config import MembershipConfig

LOG = """\
2026-12-07 01:51:24,459 INFO shardmesh.node: member b70794ea116d joined (incarnation 0)
2026-12-07 01:52:00,100 INFO shardmesh.node: member b70794ea116d suspect (incarnation 0)
2026-12-07 01:52:00,900 INFO shardmesh.node: member b70794ea116d alive (incarnation 1)
2026-12-07 01:53:10,250 INFO shardmesh.node: member 9abbfb6f1ec2 dead (incarnation 3)
2026-12-07 01:53:10,300 INFO httpx: HTTP Request: GET http://10.77.1.2:41303/ "HTTP/1.1 200 "
"""


def test_the_nodes_logs_give_each_suspicion_and_death_with_its_time() -> None:
    events = parse_events("b", LOG.splitlines())
    assert [(e.subject, e.kind, e.incarnation) for e in events] == [
        ("b70794ea116d", "suspect", 0),
        ("9abbfb6f1ec2", "dead", 3),
    ]
    assert events[1].at - events[0].at == pytest.approx(70.15)
    assert {e.observer for e in events} == {"b"}


def test_an_accusation_heard_by_many_is_one_episode_and_the_victims_death_is_not_false() -> None:
    events = [
        Event(10.0, "a", "bbb", "suspect", 0),
        Event(10.2, "c", "bbb", "suspect", 0),  # the same accusation, gossiped
        Event(40.0, "a", "bbb", "suspect", 1),  # a new one, after the refutation
        Event(45.0, "a", "ccc", "dead", 0),
        Event(55.0, "a", "eee", "suspect", 0),  # the victim, before the kill: false
        Event(65.0, "a", "eee", "dead", 0),  # after it: the detection
        Event(99.0, "a", "ccc", "suspect", 2),  # outside the window
    ]
    found = false_alarms(events, (5.0, 90.0), victim="eee", killed_at=60.0)
    assert found == {"false_suspicions": 3, "false_deaths": 1, "suspect_views": 4, "dead_views": 1}


def test_detection_waits_for_every_survivor() -> None:
    events = [Event(65.0, "a", "eee", "dead", 0), Event(71.5, "b", "eee", "dead", 0)]
    assert detection(events, ["a", "b"], "eee", since=60.0) == {"first_s": 5.0, "all_s": 11.5}
    assert detection(events, ["a", "b", "c"], "eee", since=60.0) is None
    assert detection(events, ["a", "b"], "eee", since=70.0) is None  # a's was before


def row(detect_s: float | None, deaths: int = 0, suspicions: float = 0.0) -> dict[str, object]:
    return {
        "settings": {},
        "detect_s": detect_s,
        "false_deaths": deaths,
        "false_suspicions_per_node_minute": suspicions,
        "within_bound": detect_s is not None,
    }


def test_the_choice_is_the_fastest_worst_case_among_candidates_clean_in_every_case() -> None:
    noisy = MAX_FALSE_SUSPICIONS_PER_NODE_MINUTE * 2
    cases = [
        {
            "rtt_ms": 40.0,
            "loss": 0.01,
            "candidates": {"slow": row(40.0), "mid": row(12.0), "fast": row(5.0), "x": row(4.0)},
        },
        {
            "rtt_ms": 100.0,
            "loss": 0.03,
            "candidates": {
                "slow": row(45.0),
                "mid": row(20.0),
                "fast": row(6.0, deaths=1),  # one false death anywhere rules it out
                "x": row(5.0, suspicions=noisy),
            },
        },
    ]
    table = by_candidate(cases)
    assert table["mid"]["worst_detect_s"] == 20.0
    assert [name for name, entry in table.items() if entry["eligible"]] == ["slow", "mid"]
    assert choose(table) == "mid"
    cases[1]["candidates"] = {"slow": row(None), "mid": row(None), "fast": row(6.0, deaths=1)}
    assert choose(by_candidate(cases)) is None  # none detected within its bound


def test_the_launcher_gives_the_node_process_the_candidates_wan_profile() -> None:
    settings = {"probe_interval": 2.5, "probe_timeout": 1.25, "suspicion_mult": 7}
    script = (
        "import json, sys\n"
        "from benchmarks.wan_profile import main\n"
        "from mesh.config import MembershipConfig\n"
        "try:\n"
        f"    main(['--node-settings', {json.dumps(settings)!r}, '--version'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "wan = MembershipConfig.profile('wan')\n"
        "print(json.dumps([wan.probe_interval, wan.probe_timeout, wan.suspicion_mult]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out.splitlines()[-1]) == [2.5, 1.25, 7]
    assert MembershipConfig.wan().probe_interval == shipped()["probe_interval"]  # not here
