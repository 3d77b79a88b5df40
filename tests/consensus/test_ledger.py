"""The placement ledger: ADR-0026 rules, quarantines, snapshots and determinism.

The property tests are the contract Raft relies on: the same committed
commands give the same state on every replica, whether it applied them all
or restored a snapshot halfway, and no committed bytes can make apply raise.
"""

from __future__ import annotations

from unittest import mock

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consensus.commands import (
    Admit,
    Assign,
    Command,
    Eligible,
    Found,
    LedgerError,
    MarkAdmissionFailed,
    RecordDemand,
    Release,
    SetPolicy,
    Verdict,
    encode_command,
)
from consensus.ledger import (
    DEMAND_HORIZON_S,
    MAX_DEMAND_MODELS,
    REASON_ALREADY_JUDGED,
    REASON_BAD_POLICY,
    REASON_NO_ASSIGNMENT,
    REASON_PINNED,
    REASON_QUARANTINED,
    REASON_STALE_EPOCH,
    REASON_STALE_INDEX,
    REASON_UNDECODABLE,
    REASON_WRONG_EPOCH,
    REASON_WRONG_MODEL,
    ApplyResult,
    PlacementLedger,
    changed_node,
)
from consensus.quarantine import FALSE_REPORT_LIMIT, QUARANTINE_BASE_S, QUARANTINE_MAX_S, Quarantine
from consensus.settings import PlacementSettings
from mesh.identity import curve_twin

N1, N2, N3 = (bytes([i]) * 32 for i in (1, 2, 3))


def assign(node: bytes, model: str, epoch: int, tier: str = "managed", at: float = 1.0) -> Assign:
    return Assign(node, model, (0, 8), "bf16", tier, tier == "managed", epoch, at)  # type: ignore[arg-type]


def run(ledger: PlacementLedger, *commands: Command) -> list[tuple[bool, str]]:
    start = ledger.applied_index
    results = [ledger.apply(start + i + 1, encode_command(c)) for i, c in enumerate(commands)]
    return [(r.accepted, r.reason) for r in results]


OK = (True, "")


# -- apply rules ---------------------------------------------------------------


def test_assign_release_reassign() -> None:
    ledger = PlacementLedger()
    assert (
        run(
            ledger,
            assign(N1, "qwen3", 1),
            assign(N2, "qwen3", 1, "operator"),
            Release(N1, "qwen3", 1, "retarget", 2.0),
            assign(N1, "llama", 2),
        )
        == [OK] * 4
    )
    assert [(a.node, a.model, a.epoch) for a in ledger.assignments()] == [
        (N1, "llama", 2),
        (N2, "qwen3", 1),
    ]
    assert ledger.applied_index == 4


def test_epochs_only_increase_per_node_even_across_releases() -> None:
    ledger = PlacementLedger()
    results = run(
        ledger,
        assign(N1, "m", 5),
        assign(N1, "m", 5),
        assign(N1, "m", 4),
        Release(N1, "m", 5, "left", 2.0),
        assign(N1, "m", 3),
        assign(N2, "m", 1),  # epochs are per node
        assign(N1, "m", 6),
    )
    stale = (False, REASON_STALE_EPOCH)
    assert results == [OK, stale, stale, OK, stale, OK, OK]
    assert ledger.epoch(N1) == 6


@pytest.mark.parametrize("tier", ["operator", "bootstrap"])
def test_pinned_assignment_is_never_retargeted(tier: str) -> None:
    ledger = PlacementLedger()
    results = run(
        ledger,
        assign(N1, "qwen3", 1, tier),
        assign(N1, "llama", 2, "managed"),
        assign(N1, "llama", 3, "operator"),
        assign(N1, "qwen3", 4, "managed"),  # same model, but managed: not spare capacity
    )
    assert results == [OK] + [(False, REASON_PINNED)] * 3
    assert ledger.assignment(N1) == ledger.assignments()[0]
    assert (ledger.assignment(N1).model, ledger.assignment(N1).tier) == ("qwen3", tier)  # type: ignore[union-attr]
    # an operator reload of the same model is not a retarget; a release frees the node
    assert run(ledger, assign(N1, "qwen3", 5, "operator")) == [OK]
    assert run(
        ledger, Release(N1, "qwen3", 5, "operator restart", 3.0), assign(N1, "llama", 6)
    ) == [
        OK,
        OK,
    ]


def test_managed_assignment_may_be_retargeted() -> None:
    ledger = PlacementLedger()
    assert run(ledger, assign(N1, "qwen3", 1), assign(N1, "llama", 2)) == [OK, OK]
    assert ledger.assignment(N1).model == "llama"  # type: ignore[union-attr]


def test_release_must_name_the_live_assignment() -> None:
    ledger = PlacementLedger()
    results = run(
        ledger,
        Release(N1, "m", 1, "x", 0.0),
        assign(N1, "m", 2),
        Release(N1, "m", 1, "late duplicate", 0.0),
        Release(N1, "other", 2, "x", 0.0),
        MarkAdmissionFailed(N1, "m", 3, 0.0),
        MarkAdmissionFailed(N1, "m", 2, 9.0),
        Release(N1, "m", 2, "doctor failed", 10.0),
        Release(N1, "m", 2, "again", 11.0),
    )
    assert results == [
        (False, REASON_NO_ASSIGNMENT),
        OK,
        (False, REASON_WRONG_EPOCH),
        (False, REASON_WRONG_MODEL),
        (False, REASON_WRONG_EPOCH),
        OK,
        OK,
        (False, REASON_NO_ASSIGNMENT),
    ]
    assert ledger.assignments() == ()
    assert ledger.rejected() == {
        REASON_NO_ASSIGNMENT: 2,
        REASON_WRONG_EPOCH: 2,
        REASON_WRONG_MODEL: 1,
    }


def test_admission_failure_is_recorded() -> None:
    ledger = PlacementLedger()
    run(ledger, assign(N1, "m", 1), MarkAdmissionFailed(N1, "m", 1, 4.0))
    assert ledger.assignment(N1).admission_failed_at == 4.0  # type: ignore[union-attr]
    assert ledger.to_json()["ledger"][0]["admission_failed"] is True


def test_demand_accumulates_raw_counts_and_times() -> None:
    ledger = PlacementLedger()
    run(ledger, RecordDemand("b", 2, 5.0), RecordDemand("a", 1, 3.0), RecordDemand("b", 3, 4.0))
    assert [(m, d.count, d.first_at, d.last_at) for m, d in ledger.demand().items()] == [
        ("a", 1, 3.0, 3.0),
        ("b", 5, 4.0, 5.0),
    ]


def demand_rows(ledger: PlacementLedger) -> dict[str, tuple[int, float, float]]:
    return {m: (d.count, d.first_at, d.last_at) for m, d in ledger.demand().items()}


def test_demand_for_many_models_keeps_the_most_recent_within_the_bound() -> None:
    ledger = PlacementLedger()
    names = [f"invented-{i:04d}" for i in range(MAX_DEMAND_MODELS + 200)]
    run(ledger, *(RecordDemand(name, 1, 1000.0 + i) for i, name in enumerate(names)))
    assert len(ledger.demand()) == MAX_DEMAND_MODELS
    assert set(ledger.demand()) == set(names[-MAX_DEMAND_MODELS:])
    assert ledger.rejected() == {}  # bounded by forgetting, not by refusing commands


def test_a_full_table_gives_up_its_least_recently_seen_model() -> None:
    ledger = PlacementLedger()
    names = [f"m{i:03d}" for i in range(MAX_DEMAND_MODELS)]
    run(ledger, *(RecordDemand(name, 5, float(i)) for i, name in enumerate(names)))
    # m000 is the oldest row, but asked for again it is the most recent.
    run(ledger, RecordDemand("m000", 1, 500.0), RecordDemand("new", 1, 501.0))
    assert "m001" not in ledger.demand() and len(ledger.demand()) == MAX_DEMAND_MODELS
    assert demand_rows(ledger)["m000"] == (6, 0.0, 500.0)
    assert demand_rows(ledger)["new"] == (1, 501.0, 501.0)
    # A report older than every row (a late one) is itself the least recent.
    run(ledger, RecordDemand("late", 1, -1.0))
    assert "late" not in ledger.demand() and "m002" in ledger.demand()


def test_equal_times_evict_by_name_so_every_replica_keeps_the_same_rows() -> None:
    with mock.patch("consensus.ledger.MAX_DEMAND_MODELS", 2):
        ledger = PlacementLedger()
        run(ledger, RecordDemand("c", 1, 1.0), RecordDemand("a", 1, 1.0), RecordDemand("b", 1, 1.0))
        assert list(ledger.demand()) == ["b", "c"]  # "a" sorts first among equals


def test_demand_older_than_the_horizon_is_dropped_when_new_demand_applies() -> None:
    ledger = PlacementLedger()
    run(ledger, RecordDemand("old", 3, 0.0), RecordDemand("recent", 1, 100.0))
    assert ledger.demand_horizon() == DEMAND_HORIZON_S  # the defaults read less than a day
    # Time is the commands' `at`: nothing is forgotten until demand arrives,
    # and exactly on the horizon a row is still kept.
    run(ledger, RecordDemand("new", 1, DEMAND_HORIZON_S))
    assert set(ledger.demand()) == {"old", "recent", "new"}
    run(ledger, RecordDemand("new", 1, DEMAND_HORIZON_S + 50.0))
    assert set(ledger.demand()) == {"recent", "new"}
    # Other commands never forget demand, however late their `at`.
    run(ledger, Release(N1, "m", 1, "x", 1e9), SetPolicy((("max_copies", 2),), 1e9))
    assert set(ledger.demand()) == {"recent", "new"}
    # A model asked for again after it was forgotten starts a fresh row.
    run(ledger, RecordDemand("old", 2, DEMAND_HORIZON_S + 60.0))
    assert demand_rows(ledger)["old"] == (2, DEMAND_HORIZON_S + 60.0, DEMAND_HORIZON_S + 60.0)


def test_the_horizon_follows_a_policy_that_reads_demand_for_longer() -> None:
    ledger = PlacementLedger()
    two_days = 2 * 86400.0
    run(ledger, SetPolicy((("idle_release_s", two_days),), 0.0), RecordDemand("a", 1, 0.0))
    assert ledger.demand_horizon() == two_days
    run(ledger, RecordDemand("b", 1, 1.5 * 86400))
    assert set(ledger.demand()) == {"a", "b"}  # within idle_release_s: placement still reads it
    run(ledger, SetPolicy((("demand_window_s", 86400.0),), 0.0))
    assert ledger.demand_horizon() == 20 * 86400.0


def test_a_full_demand_table_survives_a_snapshot() -> None:
    ledger = PlacementLedger()
    run(ledger, *(RecordDemand(f"m{i}", i + 1, float(i)) for i in range(MAX_DEMAND_MODELS + 5)))
    restored = PlacementLedger.restore(ledger.snapshot())
    assert restored == ledger and demand_rows(restored) == demand_rows(ledger)
    future = [RecordDemand("x", 1, 9000.0), RecordDemand("m7", 1, 100.0)]
    assert run(restored, *future) == run(ledger, *future)
    assert restored.snapshot() == ledger.snapshot()


def test_an_oversized_table_from_an_older_build_restores_and_is_trimmed_by_new_demand() -> None:
    ledger = PlacementLedger()
    run(ledger, RecordDemand("m", 1, 0.0))
    state = cbor2.loads(ledger.snapshot())
    state[4] = [[f"m{i:04d}", 1, float(i), float(i)] for i in range(MAX_DEMAND_MODELS + 10)]
    restored = PlacementLedger.restore(cbor2.dumps(state, canonical=True))
    assert len(restored.demand()) == MAX_DEMAND_MODELS + 10  # as committed: restore changes nothing
    run(restored, RecordDemand("fresh", 1, 5000.0))
    assert len(restored.demand()) == MAX_DEMAND_MODELS
    assert "fresh" in restored.demand() and "m0010" not in restored.demand()
    assert "m0011" in restored.demand()


def test_policy_settings_accumulate_and_every_replica_decides_with_them() -> None:
    ledger = PlacementLedger()
    assert ledger.policy() == PlacementSettings() and ledger.policy_settings() == {}
    assert run(
        ledger,
        SetPolicy((("idle_release_s", 4.0),), 1.0),
        SetPolicy((("cooldown_s", 9.0), ("max_copies", 2)), 2.0),
        SetPolicy((("idle_release_s", 6.0),), 3.0),
    ) == [OK, OK, OK]
    assert ledger.policy_settings() == {"cooldown_s": 9.0, "idle_release_s": 6.0, "max_copies": 2}
    policy = ledger.policy()
    assert (policy.idle_release_s, policy.cooldown_s, policy.max_copies) == (6.0, 9.0, 2)
    assert policy.demand_window_s == PlacementSettings().demand_window_s  # not set: the default


def test_settings_that_clash_with_those_in_force_are_rejected_and_change_nothing() -> None:
    ledger = PlacementLedger()
    run(ledger, SetPolicy((("max_admission_backoff_s", 100.0),), 1.0))
    before = ledger.snapshot()
    # Valid alone (60 <= 100 is fine, 200 > 100 is not once combined).
    assert run(ledger, SetPolicy((("admission_backoff_s", 200.0),), 2.0)) == [
        (False, REASON_BAD_POLICY)
    ]
    assert ledger.policy_settings() == {"max_admission_backoff_s": 100.0}
    assert ledger.rejected() == {REASON_BAD_POLICY: 1}
    assert ledger.snapshot() != before  # only the applied index and the rejection count moved
    assert ledger.policy() == PlacementLedger.restore(before).policy()


def test_replayed_and_garbage_entries_change_nothing() -> None:
    ledger = PlacementLedger()
    run(ledger, assign(N1, "m", 1))
    before = ledger.snapshot()
    replay = ledger.apply(1, encode_command(assign(N1, "x", 9)))
    assert (replay.accepted, replay.reason) == (False, REASON_STALE_INDEX)
    assert ledger.snapshot() == before
    bad = ledger.apply(5, b"\x00garbage")
    assert (bad.accepted, bad.reason, bad.command) == (False, REASON_UNDECODABLE, None)
    assert ledger.applied_index == 5
    assert ledger.rejected() == {REASON_UNDECODABLE: 1}


def test_to_json_shape() -> None:
    ledger = PlacementLedger()
    run(ledger, assign(N2, "qwen3", 3, "bootstrap", at=2.0), RecordDemand("qwen3", 4, 2.5))
    assert ledger.to_json() == {
        "ledger": [
            {
                "node_id": N2.hex(),
                "model": "qwen3",
                "layers": [0, 8],
                "recipe": "bf16",
                "tier": "bootstrap",
                "managed": False,
                "epoch": 3,
                "assigned_at": 2.0,
                "admission_failed": False,
            }
        ],
        "demand": {"qwen3": {"count": 4, "first_at": 2.5, "last_at": 2.5}},
        "ledger_applied_index": 2,
        "ledger_rejected": {},
        "policy_settings": {},
        "swarm": None,
        "eligible_voters": [],
        "quarantine": [],
    }


# -- snapshots -----------------------------------------------------------------


def test_snapshot_restore_round_trip_and_same_future() -> None:
    ledger = PlacementLedger()
    run(
        ledger,
        assign(N1, "m", 1, "operator"),
        assign(N2, "m", 2),
        MarkAdmissionFailed(N2, "m", 2, 3.0),
        RecordDemand("m", 2, 1.0),
        Release(N3, "m", 1, "x", 0.0),
        SetPolicy((("idle_release_s", 4.0),), 1.0),
    )
    restored = PlacementLedger.restore(ledger.snapshot())
    assert restored.policy().idle_release_s == 4.0
    assert restored == ledger
    assert restored.snapshot() == ledger.snapshot()
    future = [assign(N1, "other", 7), assign(N3, "m", 1), Release(N2, "m", 2, "y", 4.0)]
    assert run(restored, *future) == run(ledger, *future)
    assert restored.snapshot() == ledger.snapshot()


def test_older_snapshot_versions_still_restore_with_defaults() -> None:
    ledger = PlacementLedger()
    run(ledger, assign(N1, "m", 1, "operator"), RecordDemand("m", 2, 1.0))
    # Version 1 (before policy settings): the same six items, no seventh;
    # version 2 (before the swarm): seven, no founding and no admissions;
    # version 3 (before eligibility): nine; version 4 (before quarantine): ten.
    old = cbor2.loads(ledger.snapshot())
    assert old[0] == 5 and old[6] == [] and old[7] is None and old[8] == [] and old[9] == []
    assert old[10] == [] and old[11] == []
    for version, items in ((1, old[1:6]), (2, old[1:7]), (3, old[1:9]), (4, old[1:10])):
        restored = PlacementLedger.restore(cbor2.dumps([version, *items], canonical=True))
        assert restored == ledger and restored.policy() == PlacementSettings()
        assert restored.founding is None and restored.admitted_keys() == {}


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xa0",
        cbor2.dumps([2, 0, [], [], [], []]),  # version 2 has seven items
        cbor2.dumps([1, 0, [], [], [], [], []]),  # and version 1 six
        cbor2.dumps([[2], 0, [], [], [], [], []]),
        cbor2.dumps([2, 0, [], [], [], [], [["idle_release_s", -1.0]]]),
        cbor2.dumps([2, 0, [], [], [], [], 0]),
        cbor2.dumps([1, 0, [], [], [["m", 1, 1.0, 1.0], ["m", 1, 1.0, 1.0]], []]),
        cbor2.dumps([1, 0, [[N1, "m", [0, 1], "q4", "managed", True, 3, 0.0, None]], [], [], []]),
    ],
)
def test_restore_refuses_anything_but_a_snapshot(data: bytes) -> None:
    with pytest.raises(LedgerError):
        PlacementLedger.restore(data)


# -- properties ----------------------------------------------------------------

nodes = st.sampled_from([N1, N2, N3])
models = st.sampled_from(["qwen3", "llama"])
times = st.floats(min_value=0, max_value=1e6, allow_nan=False)
epochs = st.integers(min_value=1, max_value=6)


def _valid_alone(knobs: dict[str, float]) -> bool:
    """Knobs that make a valid policy with the defaults (a SetPolicy that may
    still clash, at apply time, with an earlier one: that path is tested too)."""
    default = PlacementSettings()
    backoff = knobs.get("admission_backoff_s", default.admission_backoff_s)
    return backoff <= knobs.get("max_admission_backoff_s", default.max_admission_backoff_s)


commands = st.one_of(
    st.builds(
        lambda n, m, tier, e, at: assign(n, m, e, tier, at),
        nodes,
        models,
        st.sampled_from(["operator", "bootstrap", "managed"]),
        epochs,
        times,
    ),
    st.builds(Release, nodes, models, epochs, st.just("r"), times),
    st.builds(RecordDemand, models, st.integers(1, 50), times),
    st.builds(MarkAdmissionFailed, nodes, models, epochs, times),
    st.builds(Found, nodes, st.sampled_from(["open", "private"]), times),
    st.builds(Admit, nodes, st.booleans(), st.just(b"\x11" * 32), times),
    st.builds(Eligible, nodes, times),
    st.builds(
        lambda pair, evidence, guilty, at: Verdict(pair[0], pair[1], evidence, guilty, at),
        st.permutations([N1, N2, N3]),
        st.sampled_from([bytes([i]) * 32 for i in range(0x20, 0x24)]),
        st.booleans(),
        times,
    ),
    st.builds(
        lambda knobs, at: SetPolicy(tuple(sorted(knobs.items())), at),
        st.dictionaries(
            st.sampled_from(["idle_release_s", "admission_backoff_s", "max_admission_backoff_s"]),
            st.floats(min_value=0, max_value=1e4),
            min_size=1,
        ).filter(_valid_alone),
        times,
    ),
)
entries = st.lists(
    st.one_of(commands.map(encode_command), st.binary(max_size=40)),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(entries, st.data())
def test_restored_midway_ends_identical(datas: list[bytes], data: st.DataObject) -> None:
    whole = PlacementLedger()
    results = [whole.apply(i + 1, d) for i, d in enumerate(datas)]
    cut = data.draw(st.integers(0, len(datas)))
    first = PlacementLedger()
    for i, d in enumerate(datas[:cut]):
        first.apply(i + 1, d)
    second = PlacementLedger.restore(first.snapshot())
    rest = [second.apply(i + 1, d) for i, d in enumerate(datas) if i >= cut]
    assert rest == results[cut:]
    assert second.snapshot() == whole.snapshot()
    assert second.to_json() == whole.to_json()


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_never_raises(data: bytes) -> None:
    ledger = PlacementLedger()
    result = ledger.apply(1, data)
    assert result.index == 1
    with pytest.raises(LedgerError):
        PlacementLedger.restore(data)


demand_commands = st.builds(
    RecordDemand,
    st.sampled_from([f"model-{i}" for i in range(12)]),
    st.integers(1, 5),
    st.floats(min_value=0, max_value=4 * DEMAND_HORIZON_S, allow_nan=False),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(demand_commands, max_size=60), st.data())
def test_bounded_decaying_demand_is_the_same_on_every_replica(
    demands: list[RecordDemand], data: st.DataObject
) -> None:
    # A small bound so 12 models overflow it: eviction and expiry both run.
    with mock.patch("consensus.ledger.MAX_DEMAND_MODELS", 4):
        datas = [encode_command(d) for d in demands]
        replicas = [PlacementLedger(), PlacementLedger()]
        for replica in replicas:
            for i, d in enumerate(datas):
                assert replica.apply(i + 1, d).accepted
                assert len(replica.demand()) <= 4
                at = demands[i].at
                assert all(
                    row.last_at >= at - DEMAND_HORIZON_S for row in replica.demand().values()
                )
                assert demands[i].model in replica.demand() or all(
                    row.last_at >= at for row in replica.demand().values()
                )
        cut = data.draw(st.integers(0, len(datas)))
        halfway = PlacementLedger()
        for i, d in enumerate(datas[:cut]):
            halfway.apply(i + 1, d)
        restored = PlacementLedger.restore(halfway.snapshot())
        for i, d in enumerate(datas[cut:], start=cut):
            restored.apply(i + 1, d)
        assert replicas[0].snapshot() == replicas[1].snapshot() == restored.snapshot()


def _private_ledger() -> PlacementLedger:
    ledger = PlacementLedger()
    assert ledger.apply(1, encode_command(Found(FOUNDER, "private", 1.0))).accepted
    return ledger


FOUNDER = b"\xf0" * 32
INVITATION = b"\x11" * 32


def test_a_swarm_is_founded_once_and_keeps_its_mode() -> None:
    ledger = _private_ledger()
    again = ledger.apply(2, encode_command(Found(b"\x01" * 32, "open", 2.0)))
    assert not again.accepted and again.reason == "already_founded"
    assert ledger.founding == Found(FOUNDER, "private", 1.0)
    with pytest.raises(LedgerError, match="mode"):
        Found(FOUNDER, "public", 1.0)


def test_a_private_swarm_admits_each_member_once_and_an_open_one_none() -> None:
    ledger = _private_ledger()
    newcomer = b"\x02" * 32
    assert ledger.apply(2, encode_command(Admit(newcomer, True, INVITATION, 2.0))).accepted
    twice = ledger.apply(3, encode_command(Admit(newcomer, False, INVITATION, 3.0)))
    assert twice.reason == "already_admitted"
    founder = ledger.apply(4, encode_command(Admit(FOUNDER, False, INVITATION, 4.0)))
    assert founder.reason == "already_admitted"
    assert list(ledger.admitted_keys()) == [newcomer] and ledger.admitted_keys()[newcomer].voter
    assert ledger.to_json()["swarm"]["admitted"][0]["node_id"] == newcomer.hex()
    restored = PlacementLedger.restore(ledger.snapshot())
    assert restored == ledger and restored.founding == ledger.founding

    open_swarm = PlacementLedger()
    assert open_swarm.apply(1, encode_command(Found(FOUNDER, "open", 1.0))).accepted
    refused = open_swarm.apply(2, encode_command(Admit(newcomer, False, INVITATION, 2.0)))
    assert refused.reason == "not_private"
    unfounded = PlacementLedger().apply(1, encode_command(Admit(newcomer, False, INVITATION, 1.0)))
    assert unfounded.reason == "not_private"


def test_the_founder_and_the_nodes_made_eligible_may_vote_and_no_one_else() -> None:
    ledger = PlacementLedger()
    operator_pick, stranger = b"\x03" * 32, b"\x00" * 32
    assert ledger.eligible_voters() == frozenset()  # not founded yet
    assert ledger.apply(1, encode_command(Found(FOUNDER, "open", 1.0))).accepted
    assert ledger.eligible_voters() == {FOUNDER}
    assert ledger.apply(2, encode_command(Eligible(operator_pick, 2.0))).accepted
    again = ledger.apply(3, encode_command(Eligible(operator_pick, 3.0)))
    founder = ledger.apply(4, encode_command(Eligible(FOUNDER, 4.0)))
    assert again.reason == founder.reason == "already_eligible"
    assert ledger.eligible_voters() == {FOUNDER, operator_pick}
    assert stranger not in ledger.eligible_voters()
    assert ledger.to_json()["eligible_voters"] == sorted(n.hex() for n in (FOUNDER, operator_pick))
    restored = PlacementLedger.restore(ledger.snapshot())
    assert restored == ledger and restored.eligible_voters() == ledger.eligible_voters()


def test_a_private_swarm_member_invited_as_a_voter_is_eligible() -> None:
    ledger = _private_ledger()
    voter, member = b"\x02" * 32, b"\x04" * 32
    assert ledger.apply(2, encode_command(Admit(voter, True, INVITATION, 2.0))).accepted
    assert ledger.apply(3, encode_command(Admit(member, False, INVITATION, 3.0))).accepted
    assert ledger.eligible_voters() == {FOUNDER, voter}
    made = ledger.apply(4, encode_command(Eligible(voter, 4.0)))
    assert made.reason == "already_eligible"


def _admitting(
    ledger: PlacementLedger, nodes: list[bytes], voter: bool, uses: int | None
) -> list[ApplyResult]:
    """Apply one admission per node, all by one invitation; the results."""
    first = ledger.applied_index + 1
    return [
        ledger.apply(first + i, encode_command(Admit(node, voter, INVITATION, 2.0, uses)))
        for i, node in enumerate(nodes)
    ]


def test_a_member_invitation_admits_one_node_and_a_second_is_refused() -> None:
    ledger = _private_ledger()
    first, second = _admitting(ledger, [b"\x02" * 32, b"\x03" * 32], False, 1)
    assert first.accepted and not second.accepted
    assert second.reason == "invitation_used" and "ask for a new one" in second.detail
    assert list(ledger.admitted_keys()) == [b"\x02" * 32]
    assert ledger.redemptions(INVITATION) == 1
    # Every replica agrees: a restored copy counts the use and refuses too.
    restored = PlacementLedger.restore(ledger.snapshot())
    (again,) = _admitting(restored, [b"\x04" * 32], False, 1)
    assert again.reason == "invitation_used"


def test_a_voter_invitation_used_by_three_keys_makes_one_voter() -> None:
    ledger = _private_ledger()
    results = _admitting(ledger, [bytes([n]) * 32 for n in (2, 3, 4)], True, 1)
    assert [r.accepted for r in results] == [True, False, False]
    assert ledger.eligible_voters() == {FOUNDER, b"\x02" * 32}


def test_an_invitation_minted_for_three_admits_exactly_three() -> None:
    ledger = _private_ledger()
    results = _admitting(ledger, [bytes([n]) * 32 for n in range(2, 7)], False, 3)
    assert [r.accepted for r in results] == [True, True, True, False, False]
    assert len(ledger.admitted_keys()) == 3 and ledger.redemptions(INVITATION) == 3


def test_an_admission_logged_before_uses_were_counted_is_applied_as_then() -> None:
    """Uncounted, as every replica applied it when it was logged: a log
    replayed and a snapshot restored must give the same members."""
    ledger = _private_ledger()
    results = _admitting(ledger, [bytes([n]) * 32 for n in range(2, 5)], False, None)
    assert all(r.accepted for r in results) and ledger.redemptions(INVITATION) == 3
    (counted,) = _admitting(ledger, [b"\x09" * 32], False, 3)
    assert counted.reason == "invitation_used"


def test_an_id_whose_sign_bit_twin_is_a_member_is_refused() -> None:
    """Both ids map to one CURVE key, which the same secret proves: one key, one member."""
    ledger = _private_ledger()
    member = b"\x02" * 32
    assert _admitting(ledger, [member], False, 2)[0].accepted
    twins = _admitting(ledger, [curve_twin(member), curve_twin(FOUNDER)], False, None)
    assert [r.reason for r in twins] == ["same_key", "same_key"]
    assert "sign bit" in twins[0].detail
    assert list(ledger.admitted_keys()) == [member]


# -- verdicts and quarantine ---------------------------------------------------

HOUR = 3600.0
ACCUSED, REPORTER = N1, N2


def evidence(i: int) -> bytes:
    return i.to_bytes(32, "big")


def verdict(
    i: int, guilty: bool, at: float, accused: bytes = ACCUSED, reporter: bytes = REPORTER
) -> Verdict:
    return Verdict(accused, reporter, evidence(i), guilty, at)


def test_the_constants_say_an_hour_doubling_to_at_most_30_days_and_three_false_reports() -> None:
    # The numbers the tests below spell out; the reasoning is next to the constants.
    assert (QUARANTINE_BASE_S, QUARANTINE_MAX_S, FALSE_REPORT_LIMIT) == (HOUR, 30 * 24 * HOUR, 3)


def test_each_guilty_verdict_benches_the_accused_twice_as_long_as_the_last() -> None:
    ledger = PlacementLedger()
    lengths = []
    for i, at in enumerate((1000.0, 50_000.0, 90_000.0), start=1):
        assert run(ledger, verdict(i, True, at)) == [OK]
        record = ledger.quarantine(ACCUSED)
        assert record is not None and record.until is not None
        assert (record.offences, record.reason, record.evidence) == (i, "wrong_output", evidence(i))
        lengths.append(record.until - at)
    assert lengths == [HOUR, 2 * HOUR, 4 * HOUR]
    assert ledger.quarantine(REPORTER) is None  # a true report costs the reporter nothing


def test_the_quarantine_is_capped_at_30_days() -> None:
    ledger = PlacementLedger()
    run(ledger, *(verdict(i, True, 0.0) for i in range(1, 11)))
    assert ledger.quarantine(ACCUSED).until == 2**9 * HOUR  # type: ignore[union-attr]
    run(ledger, verdict(11, True, 0.0))  # 2**10 hours would be 42 days
    assert ledger.quarantine(ACCUSED).until == QUARANTINE_MAX_S  # type: ignore[union-attr]
    run(ledger, *(verdict(i, True, 0.0) for i in range(12, 80)))
    record = ledger.quarantine(ACCUSED)
    assert record is not None and record.until == QUARANTINE_MAX_S and record.offences == 79


def test_a_quarantine_ends_but_the_record_stays_and_the_next_offence_is_longer() -> None:
    ledger = PlacementLedger()
    run(ledger, verdict(1, True, 1000.0))
    assert list(ledger.quarantined(1000.0 + HOUR - 1)) == [ACCUSED]
    assert ledger.quarantined(1000.0 + HOUR) == {}  # `until` is the first free second
    ended = ledger.quarantine(ACCUSED)
    assert ended is not None and not ended.in_force(10 * HOUR) and ended.offences == 1
    run(ledger, verdict(2, True, 10 * HOUR))
    assert ledger.quarantined(10 * HOUR)[ACCUSED].until == 12 * HOUR


def test_refuted_reports_bench_the_reporter_at_every_multiple_of_the_limit() -> None:
    ledger = PlacementLedger()
    run(ledger, verdict(1, False, 10.0), verdict(2, False, 20.0))
    assert ledger.quarantine(REPORTER) == Quarantine(REPORTER, None, None, None, 0, 2)
    assert ledger.quarantined(20.0) == {}
    run(ledger, verdict(3, False, 30.0))
    assert ledger.quarantined(30.0) == {
        REPORTER: Quarantine(REPORTER, 30.0 + HOUR, "false_reports", evidence(3), 1, 3)
    }
    run(ledger, verdict(4, False, 5 * HOUR), verdict(5, False, 5 * HOUR))
    assert ledger.quarantined(5 * HOUR) == {}  # 5 refuted: the next bench is at 6
    run(ledger, verdict(6, False, 5 * HOUR))
    assert ledger.quarantined(5 * HOUR)[REPORTER].until == 7 * HOUR  # second offence: 2 hours
    # A false report says nothing against the node it accused.
    assert ledger.quarantine(ACCUSED) is None


def test_offences_and_false_reports_count_towards_one_bench() -> None:
    ledger = PlacementLedger()
    run(ledger, verdict(1, True, 0.0, accused=REPORTER, reporter=N3))  # the reporter lied once
    run(ledger, *(verdict(i, False, 10 * HOUR) for i in range(2, 5)))
    record = ledger.quarantine(REPORTER)
    assert record == Quarantine(REPORTER, 12 * HOUR, "false_reports", evidence(4), 2, 3)


def test_a_verdict_stamped_earlier_never_shortens_a_quarantine() -> None:
    """A new leader's clock may run behind the last one's."""
    ledger = PlacementLedger()
    run(ledger, verdict(1, True, 100 * HOUR), verdict(2, True, 0.0))
    record = ledger.quarantine(ACCUSED)
    assert record is not None and record.until == 101 * HOUR and record.offences == 2
    assert record.evidence == evidence(2)  # the latest verdict is the one on record


def test_the_same_evidence_is_judged_once() -> None:
    ledger = PlacementLedger()
    run(ledger, verdict(1, True, 0.0))
    before = ledger.to_json()["quarantine"]
    again = Verdict(N3, REPORTER, evidence(1), False, 5.0)  # whatever else it says
    assert run(ledger, again) == [(False, REASON_ALREADY_JUDGED)]
    assert ledger.judged(evidence(1)) and not ledger.judged(evidence(2))
    assert ledger.rejected() == {REASON_ALREADY_JUDGED: 1}
    assert ledger.to_json()["quarantine"] == before  # no one's record changed


def test_only_the_most_recent_judged_evidence_is_kept() -> None:
    with mock.patch("consensus.ledger.MAX_JUDGED_EVIDENCE", 3):
        ledger = PlacementLedger()
        run(ledger, *(verdict(i, False, 0.0, reporter=N3) for i in range(1, 5)))
        assert [ledger.judged(evidence(i)) for i in range(1, 5)] == [False, True, True, True]
        assert run(ledger, verdict(1, True, 0.0)) == [OK]  # forgotten: judged anew
        assert run(ledger, verdict(4, True, 0.0)) == [(False, REASON_ALREADY_JUDGED)]


def test_a_full_quarantine_table_forgets_the_longest_ended_record_first() -> None:
    n4, n5 = b"\x04" * 32, b"\x05" * 32
    with mock.patch("consensus.ledger.MAX_QUARANTINE_RECORDS", 3):
        ledger = PlacementLedger()
        run(
            ledger,
            verdict(1, True, 0.0, accused=N1, reporter=N2),  # N1 benched to 1 h
            verdict(2, True, HOUR, accused=N3, reporter=N2),  # N3 benched to 2 h
            verdict(3, False, HOUR, accused=N3, reporter=N2),  # N2: one false report
        )
        assert [ledger.quarantine(n) is not None for n in (N1, N2, N3)] == [True] * 3
        run(ledger, verdict(4, True, HOUR, accused=n4, reporter=N1))
        assert ledger.quarantine(N2) is None  # never benched: forgotten first
        run(ledger, verdict(5, True, HOUR, accused=n5, reporter=N1))
        assert ledger.quarantine(N1) is None  # its quarantine ended longest ago
        assert {n for n in (N3, n4, n5) if ledger.quarantine(n)} == {N3, n4, n5}


def test_a_self_report_that_reached_the_log_is_rejected_and_changes_nothing() -> None:
    """The leader cannot even build one; committed bytes of one are undecodable."""
    forged = cbor2.dumps([9, N1, N1, evidence(1), True, 0.0], canonical=True)
    ledger = PlacementLedger()
    result = ledger.apply(1, forged)
    assert (result.accepted, result.reason) == (False, REASON_UNDECODABLE)
    assert "cannot report itself" in result.detail
    assert ledger.quarantine(N1) is None and not ledger.judged(evidence(1))


def test_a_quarantined_node_gets_no_managed_assignment_but_pinned_work_is_recorded() -> None:
    ledger = PlacementLedger()
    run(ledger, verdict(1, True, 0.0))
    assert run(ledger, assign(ACCUSED, "m", 1, "managed", at=HOUR - 1)) == [
        (False, REASON_QUARANTINED)
    ]
    assert ledger.epoch(ACCUSED) == 0  # a rejected Assign spends no epoch
    assert run(ledger, assign(ACCUSED, "m", 1, "operator", at=1.0)) == [OK]
    assert run(ledger, Release(ACCUSED, "m", 1, "operator_reload", 2.0)) == [OK]
    assert run(ledger, assign(ACCUSED, "m", 2, "managed", at=HOUR)) == [OK]  # it ended


def test_the_notice_names_whoever_a_verdict_counts_against() -> None:
    def node_of(command: Command, accepted: bool = True) -> bytes | None:
        return changed_node(ApplyResult(1, command, accepted))

    assert node_of(verdict(1, True, 0.0)) == ACCUSED
    assert node_of(verdict(1, False, 0.0)) == REPORTER
    assert node_of(verdict(1, True, 0.0), accepted=False) is None
    assert node_of(assign(N3, "m", 1)) == N3
    assert node_of(RecordDemand("m", 1, 0.0)) is None


def test_quarantines_in_to_json() -> None:
    ledger = PlacementLedger()
    run(ledger, verdict(1, True, 5.0), verdict(2, False, 6.0))
    assert ledger.to_json()["quarantine"] == [
        {
            "node_id": ACCUSED.hex(),
            "reason": "wrong_output",
            "until": 5.0 + HOUR,
            "evidence": evidence(1).hex(),
            "offences": 1,
            "false_reports": 0,
        },
        {
            "node_id": REPORTER.hex(),
            "reason": None,
            "until": None,
            "evidence": None,
            "offences": 0,
            "false_reports": 1,
        },
    ]


def test_quarantines_and_judged_evidence_survive_a_snapshot_with_the_same_future() -> None:
    ledger = PlacementLedger()
    run(ledger, verdict(1, True, 0.0), verdict(2, False, 1.0), verdict(3, False, 2.0))
    data = ledger.snapshot()
    assert cbor2.loads(data)[0] == 5
    restored = PlacementLedger.restore(data)
    assert restored == ledger and restored.snapshot() == data
    assert restored.quarantined(0.0) == ledger.quarantined(0.0)
    assert restored.quarantine(REPORTER) == ledger.quarantine(REPORTER)
    future = [verdict(2, True, 3.0), verdict(4, False, 4.0), verdict(5, True, 5.0)]
    assert run(restored, *future) == run(ledger, *future)
    assert restored.snapshot() == ledger.snapshot()
    assert restored.quarantine(REPORTER).offences == 1  # type: ignore[union-attr]


def test_a_version_4_snapshot_restores_with_no_quarantines() -> None:
    ledger = PlacementLedger()
    run(ledger, assign(N1, "m", 1, "operator"), Eligible(N2, 1.0))
    v4 = cbor2.dumps([4, *cbor2.loads(ledger.snapshot())[1:10]], canonical=True)
    restored = PlacementLedger.restore(v4)
    assert restored == ledger and restored.quarantined(0.0) == {}
    assert restored.to_json()["quarantine"] == []
    assert run(restored, verdict(1, True, 0.0)) == [OK]  # and takes verdicts from then on


GOOD_ROW = [N1, 10.0, "wrong_output", evidence(1), 1, 0]


@pytest.mark.parametrize(
    ("rows", "judged"),
    [
        ([[N1, None, None, None, 0, 0]], []),  # a record of nothing
        ([[N1, 10.0, "wrong_output", evidence(1), 0, 1]], []),  # benched without an offence
        ([[N1, None, None, None, 1, 0]], []),  # an offence without a bench
        ([[N1, 10.0, "sloth", evidence(1), 1, 0]], []),
        ([[N1, 10.0, "wrong_output", b"\x01", 1, 0]], []),
        ([[N1, -1.0, "wrong_output", evidence(1), 1, 0]], []),
        ([[N1, 10.0, "wrong_output", evidence(1), 1]], []),
        ([GOOD_ROW, GOOD_ROW], []),  # one record per node
        ([[N2, *GOOD_ROW[1:]], GOOD_ROW], []),  # in node order
        ([GOOD_ROW], [evidence(1), evidence(1)]),  # each digest once
        ([GOOD_ROW], [b"\x01" * 31]),
    ],
)
def test_restore_refuses_a_bad_quarantine_table(rows: list[object], judged: list[bytes]) -> None:
    snapshot = cbor2.loads(PlacementLedger().snapshot())
    snapshot[10], snapshot[11] = rows, judged
    with pytest.raises(LedgerError):
        PlacementLedger.restore(cbor2.dumps(snapshot, canonical=True))


def test_a_good_quarantine_table_restores() -> None:
    """The counterpart of the refusals above: only the broken part differs."""
    snapshot = cbor2.loads(PlacementLedger().snapshot())
    snapshot[10], snapshot[11] = [GOOD_ROW], [evidence(1)]
    restored = PlacementLedger.restore(cbor2.dumps(snapshot, canonical=True))
    assert restored.quarantined(9.0) == {N1: Quarantine(*GOOD_ROW)}  # type: ignore[arg-type]
    assert restored.judged(evidence(1))


verdict_nodes = [N1, N2, N3, b"\x04" * 32]
verdicts = st.builds(
    lambda pair, i, guilty, at: Verdict(pair[0], pair[1], evidence(i), guilty, at),
    st.permutations(verdict_nodes).map(lambda p: p[:2]),
    st.integers(0, 30),  # few digests: duplicates are common
    st.booleans(),
    st.floats(min_value=0, max_value=1e7, allow_nan=False),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(verdicts, max_size=50), st.data())
def test_random_verdicts_agree_on_every_replica_and_never_shorten_a_quarantine(
    log: list[Verdict], data: st.DataObject
) -> None:
    datas = [encode_command(v) for v in log]
    replicas = [PlacementLedger(), PlacementLedger()]
    for replica in replicas:
        last: dict[bytes, Quarantine] = {}
        judged: set[bytes] = set()
        guilty: dict[bytes, int] = dict.fromkeys(verdict_nodes, 0)
        for i, (command, d) in enumerate(zip(log, datas, strict=True)):
            result = replica.apply(i + 1, d)
            assert result.accepted == (command.evidence not in judged)
            judged.add(command.evidence)
            if result.accepted and command.guilty:
                guilty[command.accused] += 1
            for node in verdict_nodes:
                record = replica.quarantine(node)
                before = last.get(node)
                if record is None:
                    assert before is None
                    continue
                # Counters only grow; a quarantine's end never moves earlier.
                if before is not None:
                    assert record.offences >= before.offences
                    assert record.false_reports >= before.false_reports
                    if before.until is not None:
                        assert record.until is not None and record.until >= before.until
                # Each offence is a guilty verdict or a limit's worth of false reports.
                refuted = record.false_reports // FALSE_REPORT_LIMIT
                assert record.offences == guilty[node] + refuted
                last[node] = record
    cut = data.draw(st.integers(0, len(datas)))
    halfway = PlacementLedger()
    for i, d in enumerate(datas[:cut]):
        halfway.apply(i + 1, d)
    restored = PlacementLedger.restore(halfway.snapshot())
    for i, d in enumerate(datas[cut:], start=cut):
        restored.apply(i + 1, d)
    assert replicas[0].snapshot() == replicas[1].snapshot() == restored.snapshot()
    now = data.draw(st.floats(min_value=0, max_value=2e7))
    assert replicas[0].quarantined(now) == restored.quarantined(now)
