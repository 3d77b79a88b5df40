"""A verdict through a real one-voter Raft driver (sqlite on disk): committed,
applied, named in the leader's notice, shown in the status document and
counted by the metric. The ledger rules themselves are in tests/consensus/test_ledger.py."""

from __future__ import annotations

import random
import time
from pathlib import Path

import trio
from prometheus_client.parser import text_string_to_metric_families

from consensus.commands import Verdict
from consensus.config import ConsensusConfig
from consensus.quarantine import QUARANTINE_BASE_S
from consensus.storage import RaftStorage
from mesh.identity import node_id_text
from runtime.api.metrics import prometheus_text
from runtime.node.raft_driver import RaftDriver

ME, LIAR, REPORTER = (bytes([i]) * 32 for i in (1, 2, 3))


def quarantined_gauge(status: dict[str, object]) -> float:
    """`shardmesh_quarantined_nodes` as Prometheus parses the status's exposition:
    only the families it needs are filled in (the others read empty fields)."""
    document = {
        "uptime_s": 0.0,
        "incarnation": 1,
        "health": 0,
        "members": [],
        "demand": {},
        "coverage": {},
        "drops": {},
        "sessions": 0,
        **status,
    }
    for family in text_string_to_metric_families(prometheus_text(document)):
        if family.name == "shardmesh_quarantined_nodes":
            return float(family.samples[0].value)
    raise AssertionError("no shardmesh_quarantined_nodes family")


async def test_a_committed_verdict_is_in_the_notice_the_status_and_the_metric(
    tmp_path: Path,
) -> None:
    with RaftStorage.open(tmp_path / "raft.sqlite3") as store:
        driver = RaftDriver(
            node_id=ME,
            storage=store,
            config=ConsensusConfig.local(),
            bootstrap=True,
            send=lambda to, payload: None,
            members=lambda: (),
            rng=random.Random(0),
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(driver.run)
            with trio.fail_after(10):
                while not driver.is_leader:
                    await trio.sleep(0.01)
            before = driver.status()
            assert before["quarantined"] == [] and before["quarantine"] == []
            assert quarantined_gauge({**before, "node_id": node_id_text(ME)}) == 0

            at = time.time()
            committed = await driver.propose(Verdict(LIAR, REPORTER, b"\x07" * 32, True, at))
            assert committed.accepted
            again = await driver.propose(Verdict(LIAR, REPORTER, b"\x07" * 32, True, at))
            assert (again.accepted, again.reason) == (False, "already_judged")

            notice = driver.notice()
            assert notice is not None
            assert notice.changed[-1] == (node_id_text(LIAR), committed.index)
            status = driver.status()
            assert status["quarantined"] == [node_id_text(LIAR)]
            (record,) = status["quarantine"]
            assert record["node_id"] == node_id_text(LIAR)
            assert (record["reason"], record["offences"]) == ("wrong_output", 1)
            assert record["until"] == at + QUARANTINE_BASE_S
            assert quarantined_gauge({**status, "node_id": node_id_text(ME)}) == 1
            nursery.cancel_scope.cancel()
