"""This node's part in spot checks, connected to the leader.

`Verification` builds the entry's `SpotChecker` and the leader's
`Adjudicator` (`runtime.node.spot_check`) and routes between them: a check's
evidence goes to the leader (queued here when this node leads, else posted
to the leader's API, signed), and the leader's verdict goes into Raft.
"""

from __future__ import annotations

import logging

from consensus.commands import Verdict
from mesh.identity import Signer
from runtime.inference.chain import Pipeline
from runtime.node.raft_driver import NotLeader, ProposalFailed, RaftDriver
from runtime.node.spot_check import Adjudicator, Evidence, SpotChecker, send_evidence
from runtime.node.swarm_view import SwarmView

log = logging.getLogger("shardmesh.node")


class Verification:
    """The checker (`checks`) and the adjudicator, wired to Raft and the leader."""

    def __init__(
        self, *, swarm: SwarmView, pipeline: Pipeline, raft: RaftDriver, signer: Signer
    ) -> None:
        self._swarm = swarm
        self._raft = raft
        self._signer = signer
        self.checks = SpotChecker(
            swarm=swarm,
            pipeline=pipeline,
            fraction=lambda: raft.ledger.policy().verify_fraction,
            report=self.report,
        )
        self.adjudicator = Adjudicator(swarm=swarm, pipeline=pipeline, propose=self.commit)

    async def report(self, evidence: Evidence) -> bool:
        """Hand a spot check's evidence to the leader: queued here when
        this node leads, else posted to the leader's API, signed."""
        if self._raft.is_leader:
            return self.adjudicator.submit(evidence)
        leader = self._raft.leader()
        url = self._swarm.member_api(leader) if leader is not None else None
        return url is not None and await send_evidence(url, evidence, self._signer)

    async def commit(self, verdict: Verdict) -> bool:
        """Propose the leader's verdict; whether the ledger accepted it."""
        try:
            committed = await self._raft.propose(verdict)
        except (NotLeader, ProposalFailed) as exc:
            log.warning("verdict not committed: %s", exc)
            return False
        return committed.accepted
