"""The placement ledger: the replicated state machine behind placement.

Every node applies the same committed Raft entries (`consensus.commands`) in
the same order, so `PlacementLedger` is a pure function of that sequence: no
clock, no randomness, no machine-dependent order, and canonical snapshot
bytes. It records who serves what (assignments, per ADR-0026), demand per
model, the swarm's policy settings, its founding and admitted keys, who may
vote, and quarantines (`consensus.quarantine`). `apply` never raises: a bad
command is recorded as rejected with a reason, so no committed entry can
wedge the cluster. What it holds, the rules it enforces at apply time and
the snapshot versions are in docs/design/ledger.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, Final

import cbor2

from consensus.commands import (
    ASSIGNMENT_COMMANDS,
    EVIDENCE_BYTES,
    MAX_INT,
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
    as_ledger_error,
    checked_node,
    checked_text,
    decode_command,
    refuse,
    strict_loads,
)
from consensus.quarantine import Quarantine, counted, counts_against
from consensus.settings import PlacementSettings, settings_error, with_settings
from mesh.fields import fixed_bytes, number, uint
from mesh.identity import curve_twin

PINNED_TIERS: Final = frozenset({"operator", "bootstrap"})
"""ADR-0026: these are never retargeted by the tracker."""

MAX_SNAPSHOT_BYTES: Final = 256 * 1024 * 1024
"""A snapshot holds one row per node and model; 256 MiB is orders beyond a
10,000-node swarm and still refuses a runaway or hostile blob."""
SNAPSHOT_VERSION: Final = 5
"""Version 2 added the policy settings, version 3 the swarm and its admitted
members, version 4 the nodes made eligible to vote, version 5 the quarantine
table and the judged evidence; older snapshots are still read.
Bounding the demand table changed what apply does, not the encoding: a
snapshot holds the rows left, in the same format."""
MAX_DEMAND_MODELS: Final = 256
"""Most models the demand table holds. The leader records demand only for
models some member can serve (`runtime.node.swarm_view.SwarmView.known_models`),
so this is a ceiling on a swarm's catalogue, not a working size: every model
in it needs volunteers holding its weights, and a swarm serving even dozens
is large. At ~300 bytes a row it keeps the snapshot and each placement round
(which reads every row) small, whatever a buggy or hostile proposer sends.
When it is full, a model new to the table takes the place of the least
recently asked-for one: the row whose loss changes the policy least, its rate
having decayed the most."""
DEMAND_HORIZON_S: Final = 24 * 3600.0
"""A model nobody asked for in a day is dropped from the demand table. The
policy reads demand within `idle_release_s` (30 min by default) and decays
rates with `demand_window_s` (5 min: after a day a rate is e**-288 of what it
was), so a day loses nothing it uses. An operator who sets those knobs
longer moves the horizon with them (`PlacementLedger.demand_horizon`)."""
DEMAND_DECAY_WINDOWS: Final = 20
"""The horizon is at least this many `demand_window_s`: by then a rate has
decayed to e**-20 (2e-9) of its value, nothing the policy can tell from 0."""
MAX_JUDGED_EVIDENCE: Final = 4096
"""The most recent judged evidence digests kept, oldest dropped first. A
report is judged within seconds of the replay that found it, and the ones
to refuse are repeats: a reporter resending it, a leader retrying a
proposal whose answer it lost. 4096 verdicts outlast any such retry by
hours even at a verdict a second, and cost 128 KiB in every snapshot."""
MAX_QUARANTINE_RECORDS: Final = 65536
"""Most nodes the quarantine table keeps records for. Every verdict may add
one (a new accused or reporter), and each takes a recomputation by the
leader, so the table grows slowly, but it must not grow without end in
every replica. 65536 is six times a 10,000-node swarm at ~100 bytes a
record (6 MiB); when it is full the record of the node whose quarantine
ended longest ago (never-quarantined reporters first) gives way: forgetting
it only makes that node's next offence count as an early one."""


def snapshot_digest(snapshot: bytes) -> str:
    """sha256 of `PlacementLedger.snapshot()` bytes, hex: one ledger state,
    one digest (the snapshot is canonical). What a leader's notice names and
    what a member checks a pulled copy against."""
    return hashlib.sha256(snapshot).hexdigest()


@dataclass(frozen=True, slots=True)
class LedgerAssignment:
    """A node's live assignment as the ledger holds it: the shard a node's
    record calls its `mesh.records.Assignment`, plus whose node it is, when
    it was made, and whether its admission failed. The one `Assignment` is
    the record's; this is the ledger's row about one."""

    node: bytes
    model: str
    layers: tuple[int, int]
    recipe: str
    tier: str
    managed: bool
    epoch: int
    assigned_at: float
    admission_failed_at: float | None = None

    @property
    def pinned(self) -> bool:
        """Operator and bootstrap assignments are pinned (ADR-0026)."""
        return self.tier in PINNED_TIERS


@dataclass(frozen=True, slots=True)
class Demand:
    """Raw demand for one model: total requests and when they were first and last seen."""

    count: int
    first_at: float
    last_at: float


@dataclass(frozen=True, slots=True)
class AdmittedKey:
    """A key admitted to a private swarm (a committed `Admit`): whether it may
    become a voter, the digest of the invitation that let it in, and when."""

    voter: bool
    invitation: bytes
    at: float


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What one committed entry did: `accepted`, or rejected with a `reason` code and `detail`."""

    index: int
    command: Command | None
    accepted: bool
    reason: str = ""
    detail: str = ""


def changed_node(result: ApplyResult) -> bytes | None:
    """The node whose standing an applied entry changed: the one an accepted
    assignment command is about, or the one an accepted verdict counts
    against (the accused when guilty, else the reporter). The leader's
    ledger notice names it (`mesh.records.LedgerNotice.changed`), so that
    node learns of its new assignment or quarantine within a gossip spread.
    None: a rejected entry, or a command about no one node."""
    if not result.accepted:
        return None
    command = result.command
    if isinstance(command, ASSIGNMENT_COMMANDS):
        return command.node
    if isinstance(command, Verdict):
        return counts_against(command)
    return None


# Rejection reason codes (stable: counted in the state and shown in status).
REASON_UNDECODABLE: Final = "undecodable"
REASON_STALE_INDEX: Final = "stale_index"
REASON_STALE_EPOCH: Final = "stale_epoch"
REASON_PINNED: Final = "pinned"
REASON_NO_ASSIGNMENT: Final = "no_assignment"
REASON_WRONG_EPOCH: Final = "wrong_epoch"
REASON_WRONG_MODEL: Final = "wrong_model"
REASON_BAD_POLICY: Final = "bad_policy"
REASON_ALREADY_FOUNDED: Final = "already_founded"
REASON_NOT_PRIVATE: Final = "not_private"
REASON_ALREADY_ADMITTED: Final = "already_admitted"
REASON_SAME_KEY: Final = "same_key"
REASON_INVITATION_USED: Final = "invitation_used"
REASON_ALREADY_ELIGIBLE: Final = "already_eligible"
REASON_QUARANTINED: Final = "quarantined"
REASON_ALREADY_JUDGED: Final = "already_judged"


def _ended(record: Quarantine) -> float:
    """When `record`'s quarantine ends, -1 for one never quarantined (the
    order in which a full table forgets records)."""
    return -1.0 if record.until is None else record.until


class _Reject(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class PlacementLedger:
    """The ledger state; mutate it only through `apply` (or `restore`)."""

    def __init__(self, applied_index: int = 0) -> None:
        """An empty ledger; `applied_index` is where a restored one resumes."""
        self.applied_index = applied_index
        self._assignments: dict[bytes, LedgerAssignment] = {}
        self._epochs: dict[bytes, int] = {}
        self._demand: dict[str, Demand] = {}
        self._rejected: dict[str, int] = {}
        self._settings: dict[str, int | float] = {}
        self._founding: Found | None = None
        self._admitted_keys: dict[bytes, AdmittedKey] = {}
        self._eligible: dict[bytes, float] = {}  # node -> when it was made eligible
        self._quarantine: dict[bytes, Quarantine] = {}
        self._judged: dict[bytes, None] = {}  # evidence digests, oldest first

    def __eq__(self, other: object) -> bool:
        """Equal when their snapshots are byte-identical (the determinism contract)."""
        if not isinstance(other, PlacementLedger):
            return NotImplemented
        return self.snapshot() == other.snapshot()

    __hash__ = None  # type: ignore[assignment]  # mutable

    # -- applying ------------------------------------------------------------

    def apply(self, index: int, data: bytes) -> ApplyResult:
        """Apply the committed command at log `index`. Never raises on bad input.

        Indexes must increase (gaps are fine: NOOP and CONFIG entries are not
        applied here). An index at or below `applied_index` is a replay and
        changes nothing, so re-feeding entries after a restore is harmless.
        """
        if type(index) is not int or index <= self.applied_index:
            return ApplyResult(
                index, None, False, REASON_STALE_INDEX, f"already applied {self.applied_index}"
            )
        self.applied_index = index
        try:
            command = decode_command(data)
        except LedgerError as exc:
            return self._rejected_result(index, None, REASON_UNDECODABLE, str(exc))
        except Exception as exc:  # belt and braces: a committed entry must never wedge us
            return self._rejected_result(index, None, REASON_UNDECODABLE, repr(exc))
        try:
            match command:
                case Assign():
                    self._assign(command)
                case Release():
                    self._release(command)
                case RecordDemand():
                    self._record_demand(command)
                case MarkAdmissionFailed():
                    self._mark_failed(command)
                case SetPolicy():
                    self._set_policy(command)
                case Found():
                    self._found(command)
                case Admit():
                    self._admit(command)
                case Eligible():
                    self._make_eligible(command)
                case Verdict():
                    self._judge(command)
        except _Reject as rej:
            return self._rejected_result(index, command, rej.reason, rej.detail)
        return ApplyResult(index, command, True)

    def _rejected_result(
        self, index: int, command: Command | None, reason: str, detail: str
    ) -> ApplyResult:
        self._rejected[reason] = self._rejected.get(reason, 0) + 1
        return ApplyResult(index, command, False, reason, detail)

    def _assign(self, cmd: Assign) -> None:
        last_epoch = self._epochs.get(cmd.node, 0)
        if cmd.epoch <= last_epoch:
            raise _Reject(REASON_STALE_EPOCH, f"epoch {cmd.epoch} <= node's epoch {last_epoch}")
        benched = self._quarantine.get(cmd.node)
        if cmd.managed and benched is not None and benched.in_force(cmd.at):
            raise _Reject(
                REASON_QUARANTINED,
                f"node is quarantined until {benched.until} ({benched.reason}); "
                "managed placements never go to a quarantined node",
            )
        live = self._assignments.get(cmd.node)
        if live is not None and live.pinned:
            if cmd.model != live.model:
                raise _Reject(
                    REASON_PINNED,
                    f"node holds a pinned {live.tier} assignment of {live.model!r}; "
                    "pinned assignments are never retargeted (release it first)",
                )
            if cmd.managed:
                raise _Reject(
                    REASON_PINNED,
                    f"node holds a pinned {live.tier} assignment; managed placements "
                    "go only to spare capacity",
                )
        self._epochs[cmd.node] = cmd.epoch
        self._assignments[cmd.node] = LedgerAssignment(
            node=cmd.node,
            model=cmd.model,
            layers=cmd.layers,
            recipe=cmd.recipe,
            tier=cmd.tier,
            managed=cmd.managed,
            epoch=cmd.epoch,
            assigned_at=cmd.at,
        )

    def _found(self, cmd: Found) -> None:
        if self._founding is not None:
            raise _Reject(
                REASON_ALREADY_FOUNDED,
                f"the swarm was founded {self._founding.mode} and stays so",
            )
        self._founding = cmd

    def _admit(self, cmd: Admit) -> None:
        refusal = self.admission_refusal(cmd)
        if refusal is not None:
            raise _Reject(*refusal)
        self._admitted_keys[cmd.node] = AdmittedKey(cmd.voter, cmd.invitation, cmd.at)

    def admission_refusal(self, cmd: Admit) -> tuple[str, str] | None:
        """Why applying `cmd` now would be rejected, (reason code, detail),
        or None: what `apply` enforces, asked before proposing too (the door
        refuses early; the ledger decides). One id per CURVE key: an id
        whose sign-bit twin is a member holds that member's key already."""
        swarm = self._founding
        if swarm is None or swarm.mode != "private":
            return REASON_NOT_PRIVATE, "only a private swarm admits members"
        members = {swarm.swarm, *self._admitted_keys}
        if cmd.node in members:
            return REASON_ALREADY_ADMITTED, "the node is a member already"
        if curve_twin(cmd.node) in members:
            return REASON_SAME_KEY, (
                f"the node's key is member {curve_twin(cmd.node).hex()[:12]}'s "
                "(the two ids differ only in their sign bit): one key, one member"
            )
        if cmd.uses is not None and self.redemptions(cmd.invitation) >= cmd.uses:
            return REASON_INVITATION_USED, (
                f"the invitation has admitted all the nodes it may ({cmd.uses}): ask for a new one"
            )
        return None

    def redemptions(self, invitation: bytes) -> int:
        """How many admitted keys the invitation with this digest let in
        (read from the admitted keys themselves, so a snapshot needs no
        counter of its own)."""
        return sum(1 for a in self._admitted_keys.values() if a.invitation == invitation)

    def _make_eligible(self, cmd: Eligible) -> None:
        if cmd.node in self.eligible_voters():
            raise _Reject(REASON_ALREADY_ELIGIBLE, "the node may become a voter already")
        self._eligible[cmd.node] = cmd.at

    def _judge(self, cmd: Verdict) -> None:
        if cmd.evidence in self._judged:
            raise _Reject(REASON_ALREADY_JUDGED, "this evidence has been judged already")
        self._judged[cmd.evidence] = None
        while len(self._judged) > MAX_JUDGED_EVIDENCE:  # one at most, or a restored excess
            del self._judged[next(iter(self._judged))]
        self._store_standing(counted(self._standing(counts_against(cmd)), cmd))

    def _standing(self, node: bytes) -> Quarantine:
        """`node`'s record, or the blank one of a node no verdict counted against."""
        return self._quarantine.get(node) or Quarantine(node, None, None, None, 0, 0)

    def _store_standing(self, record: Quarantine) -> None:
        self._quarantine[record.node] = record
        while len(self._quarantine) > MAX_QUARANTINE_RECORDS:  # one at most, or a restored excess
            # Ties break by node id, so every replica forgets the same record.
            oldest = min(
                (n for n in self._quarantine if n != record.node),
                key=lambda n: (_ended(self._quarantine[n]), n),
            )
            del self._quarantine[oldest]

    def _live_for(self, node: bytes, model: str, epoch: int) -> LedgerAssignment:
        live = self._assignments.get(node)
        if live is None:
            raise _Reject(REASON_NO_ASSIGNMENT, "node has no live assignment")
        if epoch != live.epoch:
            raise _Reject(REASON_WRONG_EPOCH, f"epoch {epoch} is not the live epoch {live.epoch}")
        if model != live.model:
            raise _Reject(REASON_WRONG_MODEL, f"model {model!r} is not the live {live.model!r}")
        return live

    def _release(self, cmd: Release) -> None:
        self._live_for(cmd.node, cmd.model, cmd.epoch)
        del self._assignments[cmd.node]

    def _mark_failed(self, cmd: MarkAdmissionFailed) -> None:
        live = self._live_for(cmd.node, cmd.model, cmd.epoch)
        self._assignments[cmd.node] = replace(live, admission_failed_at=cmd.at)

    def _record_demand(self, cmd: RecordDemand) -> None:
        # Forget first: time is the command's `at` (never a clock), and ties
        # break by model name, so every replica keeps the same rows.
        oldest = cmd.at - self.demand_horizon()
        for model in [m for m, d in self._demand.items() if d.last_at < oldest]:
            del self._demand[model]
        old = self._demand.get(cmd.model)
        if old is None:
            self._demand[cmd.model] = Demand(cmd.count, cmd.at, cmd.at)
        else:
            self._demand[cmd.model] = Demand(
                min(old.count + cmd.count, MAX_INT),  # saturate: must stay encodable
                min(old.first_at, cmd.at),
                max(old.last_at, cmd.at),
            )
        while len(self._demand) > MAX_DEMAND_MODELS:  # one row at most, or a restored excess
            stalest = min(self._demand, key=lambda m: (self._demand[m].last_at, m))
            del self._demand[stalest]

    def _set_policy(self, cmd: SetPolicy) -> None:
        settings = {**self._settings, **dict(cmd.settings)}
        # Each knob was checked alone when decoded; together with the
        # settings already in force they must still make a valid policy.
        error = settings_error(settings, PlacementSettings())
        if error is not None:
            raise _Reject(REASON_BAD_POLICY, error)
        self._settings = {name: settings[name] for name in sorted(settings)}

    # -- reading -------------------------------------------------------------

    def assignments(self) -> tuple[LedgerAssignment, ...]:
        """Live assignments, ordered by node id (same order on every replica)."""
        return tuple(self._assignments[n] for n in sorted(self._assignments))

    def assignment(self, node: bytes) -> LedgerAssignment | None:
        """`node`'s live assignment, if any."""
        return self._assignments.get(node)

    def epoch(self, node: bytes) -> int:
        """The highest epoch ever accepted for `node` (0: never); the next must exceed it."""
        return self._epochs.get(node, 0)

    def demand(self) -> dict[str, Demand]:
        """Demand per model, ordered by model name."""
        return {m: self._demand[m] for m in sorted(self._demand)}

    @property
    def founding(self) -> Found | None:
        """The swarm's founding, its id and mode (None until the founder commits it)."""
        return self._founding

    def admitted_keys(self) -> dict[bytes, AdmittedKey]:
        """A private swarm's admitted keys, by node id (the founder is
        implicitly one), in id order."""
        return {n: self._admitted_keys[n] for n in sorted(self._admitted_keys)}

    def eligible_voters(self) -> frozenset[bytes]:
        """Who may become a Raft voter: the founder, the nodes made
        `Eligible`, and a private swarm's members admitted as voters. Empty
        until the swarm is founded (its founder is then the one voter)."""
        if self._founding is None:
            return frozenset(self._eligible)
        admitted = (n for n, a in self._admitted_keys.items() if a.voter)
        return frozenset({self._founding.swarm, *self._eligible, *admitted})

    def quarantine(self, node: bytes) -> Quarantine | None:
        """`node`'s standing under verdicts, its quarantine in force or ended
        (None: no verdict ever counted against it)."""
        return self._quarantine.get(node)

    def quarantined(self, now: float) -> dict[bytes, Quarantine]:
        """The nodes quarantined at `now` (the caller's clock: the ledger has
        none), by node id: they must serve nothing and be assigned nothing."""
        return {n: q for n, q in sorted(self._quarantine.items()) if q.in_force(now)}

    def judged(self, evidence: bytes) -> bool:
        """A verdict on this evidence digest is among the recent ones kept
        (`MAX_JUDGED_EVIDENCE`): the leader need not recompute it, as a
        second verdict on it would be rejected."""
        return evidence in self._judged

    def policy(self) -> PlacementSettings:
        """The swarm's placement policy: the defaults with its settings applied."""
        return with_settings(PlacementSettings(), self._settings)

    def demand_horizon(self) -> float:
        """Seconds after its last request that a model's demand is dropped:
        `DEMAND_HORIZON_S`, or longer when the swarm's policy reads demand
        for longer (`idle_release_s`, `DEMAND_DECAY_WINDOWS` rate windows)."""
        policy = self.policy()
        return max(
            DEMAND_HORIZON_S,
            policy.idle_release_s,
            DEMAND_DECAY_WINDOWS * policy.demand_window_s,
        )

    def policy_settings(self) -> dict[str, int | float]:
        """The knobs the swarm set (a committed `SetPolicy`), by name."""
        return dict(self._settings)

    def rejected(self) -> dict[str, int]:
        """How many committed commands were rejected, per reason code."""
        return {r: self._rejected[r] for r in sorted(self._rejected)}

    def to_json(self) -> dict[str, Any]:
        """The `/v1/network/status` fields: "ledger" (a list of assignments) and "demand"."""
        return {
            "ledger": [
                {
                    "node_id": a.node.hex(),
                    "model": a.model,
                    "layers": [a.layers[0], a.layers[1]],
                    "recipe": a.recipe,
                    "tier": a.tier,
                    "managed": a.managed,
                    "epoch": a.epoch,
                    "assigned_at": a.assigned_at,
                    "admission_failed": a.admission_failed_at is not None,
                }
                for a in self.assignments()
            ],
            "demand": {
                m: {"count": d.count, "first_at": d.first_at, "last_at": d.last_at}
                for m, d in self.demand().items()
            },
            "ledger_applied_index": self.applied_index,
            "ledger_rejected": self.rejected(),
            "policy_settings": self.policy_settings(),
            "swarm": None
            if self._founding is None
            else {
                "id": self._founding.swarm.hex(),
                "mode": self._founding.mode,
                "admitted": [
                    {"node_id": n.hex(), "voter": a.voter, "invitation": a.invitation.hex()}
                    for n, a in self.admitted_keys().items()
                ],
            },
            "eligible_voters": sorted(n.hex() for n in self.eligible_voters()),
            # Every node a verdict counted against, its quarantine in force or
            # not (the ledger has no clock: compare `until` with the time).
            "quarantine": [
                {
                    "node_id": q.node.hex(),
                    "reason": q.reason,
                    "until": q.until,
                    "evidence": None if q.evidence is None else q.evidence.hex(),
                    "offences": q.offences,
                    "false_reports": q.false_reports,
                }
                for _, q in sorted(self._quarantine.items())
            ],
        }

    # -- snapshots -----------------------------------------------------------

    def snapshot(self) -> bytes:
        """Canonical CBOR of the whole state: equal ledgers give equal bytes."""
        return self._snapshot(SNAPSHOT_VERSION)

    def _snapshot(self, version: int) -> bytes:
        state = [
            version,
            self.applied_index,
            [
                [
                    a.node,
                    a.model,
                    list(a.layers),
                    a.recipe,
                    a.tier,
                    a.managed,
                    a.epoch,
                    a.assigned_at,
                    a.admission_failed_at,
                ]
                for a in self.assignments()
            ],
            [[n, self._epochs[n]] for n in sorted(self._epochs)],
            [[m, d.count, d.first_at, d.last_at] for m, d in self.demand().items()],
            [[r, c] for r, c in self.rejected().items()],
        ]
        if version >= 2:
            state.append([[name, value] for name, value in self._settings.items()])
        if version >= 3:
            swarm = self._founding
            state.append(None if swarm is None else [swarm.swarm, swarm.mode, swarm.at])
            state.append(
                [[n, a.voter, a.invitation, a.at] for n, a in self.admitted_keys().items()]
            )
        if version >= 4:
            state.append([[n, self._eligible[n]] for n in sorted(self._eligible)])
        if version >= 5:
            state.append(
                [
                    [q.node, q.until, q.reason, q.evidence, q.offences, q.false_reports]
                    for _, q in sorted(self._quarantine.items())
                ]
            )
            state.append(list(self._judged))
        return cbor2.dumps(state, canonical=True)

    @classmethod
    @as_ledger_error
    def restore(cls, data: bytes) -> PlacementLedger:
        """Rebuild a ledger from `snapshot()` bytes; `LedgerError` if they are not exactly that."""
        value = strict_loads(data, MAX_SNAPSHOT_BYTES)
        # Version 2 appended the policy settings, version 3 the swarm and
        # its admitted members, version 4 the eligible voters, version 5 the
        # quarantine table and the judged evidence.
        sizes = {1: 6, 2: 7, 3: 9, 4: 10, SNAPSHOT_VERSION: 12}
        if type(value) is not list or not value or type(value[0]) is not int:
            refuse("a ledger snapshot is an array that starts with its version")
        if sizes.get(value[0]) != len(value):
            refuse(
                f"ledger snapshot version {value[0]} with {len(value)} items; this build "
                f"reads versions 1 (6 items), 2 (7), 3 (9), 4 (10) and {SNAPSHOT_VERSION} (12)"
            )
        version, applied, assignments, epochs, demand, rejected, *later = value
        defaults: list[Any] = [[], None, [], [], [], []]  # what older versions lack
        settings, founding, admitted, eligible, quarantine, judged = [
            *later,
            *defaults[len(later) :],
        ]
        ledger = cls(applied_index=uint(applied, "applied_index"))
        try:
            for node, epoch in epochs:
                ledger._epochs[checked_node(node)] = uint(epoch, "epoch", low=1)
            for node, model, layers, recipe, tier, managed, epoch, at, failed_at in assignments:
                cmd = Assign(node, model, layers, recipe, tier, managed, epoch, at)
                if ledger._epochs.get(cmd.node, 0) < cmd.epoch:
                    refuse("an assignment's epoch is above its node's epoch")
                failed = None if failed_at is None else number(failed_at, "admission_failed_at")
                ledger._assignments[cmd.node] = LedgerAssignment(
                    cmd.node, cmd.model, cmd.layers, cmd.recipe, cmd.tier, cmd.managed,
                    cmd.epoch, cmd.at, failed,
                )  # fmt: skip
            for model, count, first_at, last_at in demand:
                ledger._demand[checked_text(model, "model")] = Demand(
                    uint(count, "count", low=1),
                    number(first_at, "first_at"),
                    number(last_at, "last_at"),
                )
            for reason, count in rejected:
                ledger._rejected[checked_text(reason, "reason")] = uint(count, "count", low=1)
            if settings:
                ledger._settings = dict(SetPolicy(settings, 0.0).settings)
            if founding is not None:
                ledger._founding = Found(*founding)
            for node, voter, invitation, at in admitted:
                admit = Admit(node, voter, invitation, at)
                ledger._admitted_keys[admit.node] = AdmittedKey(
                    admit.voter, admit.invitation, admit.at
                )
            for node, at in eligible:
                made = Eligible(node, at)
                ledger._eligible[made.node] = made.at
            for row in quarantine:
                record = Quarantine(*row)
                if record.offences == record.false_reports == 0:
                    refuse("a quarantine record with neither offences nor false reports")
                ledger._quarantine[record.node] = record
            for evidence in judged:
                ledger._judged[fixed_bytes(evidence, "evidence", size=EVIDENCE_BYTES)] = None
        except (TypeError, ValueError) as exc:
            refuse(f"malformed ledger snapshot: {exc}")
        if ledger._snapshot(version) != data:
            refuse("ledger snapshot is not in canonical form (duplicates, order or encoding)")
        return ledger
