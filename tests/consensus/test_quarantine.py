"""Quarantine rules on one node's record: who a verdict counts against, how
long each bench lasts, and what a record may hold. The ledger's tests cover
the table (judged evidence, bounds, snapshots) around these rules."""

from __future__ import annotations

import pytest

from consensus.commands import LedgerError, Verdict
from consensus.quarantine import (
    FALSE_REPORT_LIMIT,
    QUARANTINE_BASE_S,
    QUARANTINE_MAX_S,
    Quarantine,
    counted,
    counts_against,
)

ACCUSED, REPORTER = b"\x01" * 32, b"\x02" * 32
HOUR = 3600.0


def verdict(i: int, guilty: bool, at: float) -> Verdict:
    return Verdict(ACCUSED, REPORTER, i.to_bytes(32, "big"), guilty, at)


def blank(node: bytes) -> Quarantine:
    return Quarantine(node, None, None, None, 0, 0)


def test_a_verdict_counts_against_the_accused_if_guilty_else_the_reporter() -> None:
    assert counts_against(verdict(1, True, 0.0)) == ACCUSED
    assert counts_against(verdict(1, False, 0.0)) == REPORTER


def test_each_offence_doubles_the_bench_up_to_the_cap() -> None:
    record = blank(ACCUSED)
    lengths = []
    for i in range(1, 13):
        record = counted(record, verdict(i, True, 0.0))
        assert record.until is not None and record.reason == "wrong_output"
        lengths.append(record.until)
    assert lengths[:3] == [HOUR, 2 * HOUR, 4 * HOUR]
    assert lengths[9] == 2**9 * QUARANTINE_BASE_S
    assert lengths[10:] == [QUARANTINE_MAX_S, QUARANTINE_MAX_S]
    assert record.offences == 12 and record.false_reports == 0


def test_every_limit_th_refuted_report_benches_the_reporter() -> None:
    record = blank(REPORTER)
    for i in range(1, FALSE_REPORT_LIMIT):
        record = counted(record, verdict(i, False, 10.0))
        assert record == Quarantine(REPORTER, None, None, None, 0, i)
    record = counted(record, verdict(FALSE_REPORT_LIMIT, False, 10.0))
    assert record.offences == 1 and record.reason == "false_reports"
    assert record.until == 10.0 + QUARANTINE_BASE_S


def test_an_earlier_verdict_never_shortens_a_bench() -> None:
    record = counted(blank(ACCUSED), verdict(1, True, 100 * HOUR))
    later = counted(record, verdict(2, True, 0.0))
    assert later.until == record.until and later.evidence == (2).to_bytes(32, "big")


def test_in_force_until_the_first_free_second() -> None:
    record = counted(blank(ACCUSED), verdict(1, True, 0.0))
    assert record.in_force(HOUR - 1) and not record.in_force(HOUR)
    assert not blank(ACCUSED).in_force(0.0)


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ((ACCUSED, 5.0, None, None, 0, 1), "never quarantined"),
        ((ACCUSED, 5.0, "bored", b"\x00" * 32, 1, 0), "one of"),
        ((ACCUSED, -1.0, "wrong_output", b"\x00" * 32, 1, 0), ">= 0"),
        ((ACCUSED, 5.0, "wrong_output", b"\x00" * 31, 1, 0), "32 bytes"),
        ((ACCUSED, 5.0, "wrong_output", b"\x00" * 32, -1, 0), "offences"),
        ((b"short", None, None, None, 0, 1), "32 bytes"),
    ],
)
def test_a_record_holds_only_what_a_verdict_could_have_made(row: tuple, match: str) -> None:
    with pytest.raises(LedgerError, match=match):
        Quarantine(*row)
