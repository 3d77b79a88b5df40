"""Quarantine: what a verdict does to a node's record, and for how long.

The leader judges a report that a hop's output diverged by recomputing it
and commits a `consensus.commands.Verdict`; the verdict counts against one
node (`counts_against`): the accused when guilty, else the reporter. A
guilty verdict benches the accused; every `FALSE_REPORT_LIMIT`-th refuted
report benches the reporter. Each bench is twice the last, capped, and
never shortened. Records outlive their quarantines so repeat offences cost
more. The ledger (`consensus.ledger`) keeps the records. The overview is in
docs/design/ledger.md ("Quarantine"); why each number, beside its constant.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final, Literal

from consensus.commands import (
    EVIDENCE_BYTES,
    MAX_INT,
    Verdict,
    as_ledger_error,
    checked_node,
    refuse,
)
from mesh.fields import fixed_bytes, number, one_of, uint

__all__ = [
    "FALSE_REPORT_LIMIT",
    "QUARANTINE_BASE_S",
    "QUARANTINE_MAX_S",
    "QUARANTINE_REASONS",
    "Quarantine",
    "QuarantineReason",
    "counted",
    "counts_against",
]

QUARANTINE_BASE_S: Final = 3600.0
"""A first proven wrong output benches a node for an hour: far longer than
it takes every entry to stop routing to it and placement to replace its
managed shard (seconds), short enough that a one-off fault (a flipped bit,
an overheated card) costs an honest volunteer little. Each further offence
doubles it: a node that keeps lying is benched for longer each time."""
QUARANTINE_MAX_S: Final = 30 * 24 * 3600.0
"""No quarantine is longer than 30 days (the doubling reaches it at the 11th
offence: the 10th is 2**9 hours, 21 days). By then a node is in effect
banned, and a longer bench protects nothing more; a volunteer who replaced
the faulty card or build can still come back one day."""
FALSE_REPORT_LIMIT: Final = 3
"""Every third report the leader's recomputation refutes counts as an
offence of its reporter, quarantining it like a liar. One or two refuted
reports can be honest (a replica's numerics near the tolerance); each costs
the leader a recomputation, so a reporter that keeps making them, by fault
or to wear the leader down or to smear honest nodes, is benched."""


QuarantineReason = Literal["wrong_output", "false_reports"]
QUARANTINE_REASONS: Final[tuple[QuarantineReason, ...]] = ("wrong_output", "false_reports")
"""Why a node is quarantined: a guilty verdict against it (`wrong_output`),
or another `FALSE_REPORT_LIMIT` of its reports refuted (`false_reports`)."""


@dataclass(frozen=True, slots=True)
class Quarantine:
    """A node's standing under verdicts: its offences and false reports,
    and its latest quarantine, which may have ended. Kept after a quarantine
    ends, so a repeat offence benches the node longer.

    `until`, `reason` and `evidence` (the verdict that last quarantined it)
    are None for a node never quarantined: a reporter with fewer refuted
    reports than the limit. Every quarantine is an offence, so a node has
    been quarantined exactly when `offences` > 0."""

    node: bytes
    until: float | None
    reason: QuarantineReason | None
    evidence: bytes | None
    offences: int
    false_reports: int

    @as_ledger_error
    def __post_init__(self) -> None:
        checked_node(self.node)
        uint(self.offences, "offences")
        uint(self.false_reports, "false_reports")
        if self.offences == 0:
            if (self.until, self.reason, self.evidence) != (None, None, None):
                refuse("a node never quarantined has no until, reason or evidence")
            return
        object.__setattr__(self, "until", number(self.until, "until", non_negative=True))
        one_of(self.reason, "reason", QUARANTINE_REASONS)
        fixed_bytes(self.evidence, "evidence", size=EVIDENCE_BYTES)

    def in_force(self, now: float) -> bool:
        """The node is quarantined at `now` (serves nothing, is assigned nothing)."""
        return self.until is not None and self.until > now


def counts_against(verdict: Verdict) -> bytes:
    """The node whose record `verdict` changes: the accused when guilty,
    else the reporter whose report the leader's recomputation refuted."""
    return verdict.accused if verdict.guilty else verdict.reporter


def counted(record: Quarantine, verdict: Verdict) -> Quarantine:
    """`record`, the standing of `counts_against(verdict)`, after `verdict`:
    a guilty one is an offence; a refuted report is one more false report,
    and every `FALSE_REPORT_LIMIT`-th of them is an offence too."""
    if verdict.guilty:
        return _benched(record, "wrong_output", verdict)
    record = replace(record, false_reports=min(record.false_reports + 1, MAX_INT))
    if record.false_reports % FALSE_REPORT_LIMIT == 0:
        record = _benched(record, "false_reports", verdict)
    return record


def _benched(record: Quarantine, reason: QuarantineReason, cmd: Verdict) -> Quarantine:
    """`record` after one more offence, judged at `cmd.at`: quarantined for
    `QUARANTINE_BASE_S` doubled per earlier offence, at most
    `QUARANTINE_MAX_S`. Never shortened: a verdict stamped earlier than the
    one in force (another leader's clock) leaves its end where it was."""
    offences = min(record.offences + 1, MAX_INT)
    # 2**62 hours is far past the cap; the exponent bound keeps the float finite.
    length = min(QUARANTINE_BASE_S * 2.0 ** min(offences - 1, 62), QUARANTINE_MAX_S)
    until = cmd.at + length
    if record.until is not None:
        until = max(until, record.until)
    return replace(record, until=until, reason=reason, evidence=cmd.evidence, offences=offences)
