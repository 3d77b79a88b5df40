"""`runtime.lab.check`: the default lab meets its spec, and a lab that has
drifted from its spec (a cap changed behind its back) fails the check."""

from __future__ import annotations

import subprocess

from runtime.lab.check import DEFAULT_SPEC, RTT_TOLERANCE_MS, run_check
from tests.runtime.lab.fixtures import MakeLab


def test_the_default_lab_meets_its_spec(make_lab: MakeLab) -> None:
    report = run_check(make_lab(DEFAULT_SPEC), count=50)
    print(f"default lab: RTT error {report['rtt_error_ms']} ms, rate {report['rate']}")
    assert report["ok"], report
    assert [pair["sites"] for pair in report["pairs"]] == [["a", "b"], ["a", "c"], ["b", "c"]]
    assert 0 <= report["rtt_error_ms"] <= RTT_TOLERANCE_MS
    assert report["rate"]["site"] == "c" and report["rate"]["configured"] == 1_000_000
    assert report["delayer"]["lost"] > 0  # 1% on every link


def test_a_cap_that_drifted_from_its_spec_fails(make_lab: MakeLab) -> None:
    lab = make_lab(
        {
            "link": {"delay_ms": 1},
            "sites": [{"name": "a"}, {"name": "b", "up": {"rate": 1_000_000}}],
        }
    )
    drift = ["qdisc", "change", "dev", "wan", "root", "tbf", "rate", "4000000bit"]
    drift += ["burst", "20000", "latency", "50ms"]  # half the spec's 1 MB/s
    subprocess.run(["tc", "-n", lab.plan.site("b").uplink_ns, *drift], check=True, timeout=10)
    report = run_check(lab, count=20)
    assert report["pairs"][0]["ok"]
    assert report["rate"]["error"] < -0.4 and not report["rate"]["ok"]
    assert not report["ok"]
