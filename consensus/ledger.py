"""The placement ledger: the replicated state machine behind placement.

Every node applies the same committed Raft entries in the same order, so the
ledger must be a pure function of that sequence: no clock (each command
carries the leader's `at`), no randomness, no iteration order that depends
on the machine, and canonical bytes for its snapshot.

It records, per ADR-0026, who serves what and why:

* an **assignment** per node: model, layer range `[a, b)`, recipe, tier
  (`operator`, `bootstrap` or `managed`), the `managed` flag, an epoch that
  only grows per node, and when it was made (the policy's cooldown clock);
* the **demand table**: raw request counts and first/last times per model
  (how a count turns into a rate is policy, `consensus.placement`). It is
  bounded and forgets: applying demand first drops models not asked for
  within the horizon (`demand_horizon`, measured from the command's `at`),
  and a table of `MAX_DEMAND_MODELS` gives up its least recently asked-for
  model for a new one, so demand cannot grow the state of every replica
  without end;
* the swarm's **policy settings** (`consensus.settings`): the knobs an
  operator changed from their defaults, so every leader decides alike;
* the **swarm**: its founder's id and its mode, `open` (any key may be a
  member) or `private` (only admitted keys complete a handshake), fixed by
  the first `Found` and never changed; and, in a private swarm, the
  **admitted** members: each with whether it may become a voter and the
  digest of the invitation that let it in (`consensus.invitations`);
* the nodes **eligible to vote**: the founder, nodes an operator made
  eligible (`Eligible`) and, in a private swarm, nodes admitted with a voter
  invitation. Raft's autopilot promotes no one else (DESIGN.md, "Trust":
  voters are the members the swarm trusts to follow the protocol);
* **quarantines** (DESIGN.md, "Trust": proven liars are quarantined through
  the ledger): the leader judges a report that a hop's output diverged by
  recomputing it and commits a `Verdict`. A guilty one benches the accused,
  a refuted one counts against the reporter; each node's offences and false
  reports are kept after its quarantine ends, so repeat offences bench it
  longer. The digests of recently judged evidence are kept too, so the same
  evidence is never judged twice;
* counts of rejected commands per reason, so a bad proposer is visible.

Rules enforced at apply time (the policy on the leader should never propose
a command that breaks them; the ledger makes sure it cannot matter if one
does):

* epochs strictly increase per node, across releases, so a late or
  duplicated command about an old placement cannot act on a newer one;
* a live *pinned* (operator or bootstrap) assignment is never retargeted: an
  Assign to a different model is rejected, and a managed Assign onto a
  pinned node is rejected because managed placements only go to spare
  capacity (until multi-shard slots exist, a pinned node has none);
* Release and MarkAdmissionFailed must name the live assignment's epoch and
  model;
* a managed Assign onto a node quarantined at the command's `at` is
  rejected: placement never gives a quarantined node work (pinned tiers are
  still recorded: they record what an operator started, and coverage keeps
  a quarantined node out of every route whatever it holds);
* a Verdict about evidence already judged is rejected.

`apply` never raises on a bad command. A committed entry is committed on
every replica; if applying it raised, every replica would crash on the same
entry after every restart and the cluster would be wedged. Instead it is
recorded as rejected, with a reason, and the state is unchanged.

Commands are CBOR arrays ``[type_id, field, ...]`` (type ids append-only,
never reused) encoded canonically, so one command has exactly one encoding;
decoding re-encodes and compares, which refuses every non-canonical form,
trailing byte and smuggled tag in one check.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Final, Literal, NoReturn

import cbor2

from consensus.settings import POLICY_FIELDS, PlacementSettings, settings_error, with_settings
from mesh.fields import (
    MAX_UINT,
    FieldError,
    boolean,
    fixed_bytes,
    number,
    one_of,
    reraise_as,
    span,
    text,
    uint,
)
from mesh.identity import NODE_ID_BYTES
from mesh.records import RECIPES, TIERS, Tier
from mesh.wire import DecodeError, decode_strict_cbor

PINNED_TIERS: Final = frozenset({"operator", "bootstrap"})
"""ADR-0026: these are never retargeted by the tracker."""

MAX_COMMAND_BYTES: Final = 4096
"""Largest encoded command. Real ones are ~150 bytes; the cap bounds what a
buggy proposer can make every replica parse and store forever."""
MAX_SNAPSHOT_BYTES: Final = 256 * 1024 * 1024
"""A snapshot holds one row per node and model; 256 MiB is orders beyond a
10,000-node swarm and still refuses a runaway or hostile blob."""
MAX_TEXT: Final = 256
"""Model names, reasons: long enough for a manifest name, short enough to log."""
MAX_INT: Final = MAX_UINT
"""Epochs, counts, layers and indexes fit sqlite's and CBOR's signed 64 bits."""
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
EVIDENCE_BYTES: Final = 32
"""A verdict names its evidence by a sha256 digest of the evidence document."""
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


class LedgerError(Exception):
    """A command or snapshot that cannot be decoded or is invalid."""


def _fail(msg: str) -> NoReturn:
    raise LedgerError(msg)


def _ledger_error(exc: FieldError) -> LedgerError:
    # Commands come from the leader (a trusted voter), so the value is shown.
    return LedgerError(f"{exc.detail}, got {exc.value!r}")


_as_ledger_error = reraise_as(_ledger_error)
"""Field checks (mesh.fields) in a command or a snapshot raise `LedgerError`."""


def _text(value: object, name: str) -> str:
    return text(value, name, max_chars=MAX_TEXT)


def _node(value: object) -> bytes:
    return fixed_bytes(value, "node", size=NODE_ID_BYTES)


@dataclass(frozen=True, slots=True)
class Assign:
    """Give `node` the shard `layers` of `model` with `recipe`, as `tier`, at `epoch`."""

    node: bytes
    model: str
    layers: tuple[int, int]
    recipe: str
    tier: Tier
    managed: bool
    epoch: int
    at: float

    @_as_ledger_error
    def __post_init__(self) -> None:
        _node(self.node)
        _text(self.model, "model")
        object.__setattr__(self, "layers", span(self.layers, "layers"))
        one_of(self.recipe, "recipe", RECIPES)
        one_of(self.tier, "tier", TIERS)
        boolean(self.managed, "managed")
        if self.managed != (self.tier == "managed"):
            _fail(f"managed={self.managed} contradicts tier {self.tier!r}")
        uint(self.epoch, "epoch", low=1)
        object.__setattr__(self, "at", number(self.at, "at"))


@dataclass(frozen=True, slots=True)
class Release:
    """End `node`'s assignment of `model` at `epoch` (node left, operator reload, retarget)."""

    node: bytes
    model: str
    epoch: int
    reason: str
    at: float

    @_as_ledger_error
    def __post_init__(self) -> None:
        _node(self.node)
        _text(self.model, "model")
        uint(self.epoch, "epoch", low=1)
        _text(self.reason, "reason")
        object.__setattr__(self, "at", number(self.at, "at"))


@dataclass(frozen=True, slots=True)
class RecordDemand:
    """`count` chat requests for `model` were seen (by `at`)."""

    model: str
    count: int
    at: float

    @_as_ledger_error
    def __post_init__(self) -> None:
        _text(self.model, "model")
        uint(self.count, "count", low=1)
        object.__setattr__(self, "at", number(self.at, "at"))


@dataclass(frozen=True, slots=True)
class MarkAdmissionFailed:
    """`node` failed `doctor` for its assignment at `epoch`: the policy may place elsewhere."""

    node: bytes
    model: str
    epoch: int
    at: float

    @_as_ledger_error
    def __post_init__(self) -> None:
        _node(self.node)
        _text(self.model, "model")
        uint(self.epoch, "epoch", low=1)
        object.__setattr__(self, "at", number(self.at, "at"))


@dataclass(frozen=True, slots=True)
class SetPolicy:
    """Set these policy knobs, swarm-wide, from `at` on: (name, value)
    pairs, sorted by name, each name once. Knobs not named keep their value."""

    settings: tuple[tuple[str, int | float], ...]
    at: float

    @_as_ledger_error
    def __post_init__(self) -> None:
        if type(self.settings) not in (tuple, list) or not self.settings:
            _fail(f"settings must be a non-empty list of [name, value] pairs: {self.settings!r}")
        pairs = []
        for pair in self.settings:
            if type(pair) not in (tuple, list) or len(pair) != 2:
                _fail(f"a setting is a [name, value] pair, got {pair!r}")
            name, value = pair
            one_of(name, "setting name", POLICY_FIELDS)
            if POLICY_FIELDS[name] is float and type(value) is int:
                value = float(value)  # one knob value, one encoding
            pairs.append((name, value))
        names = [name for name, _ in pairs]
        if names != sorted(set(names)):
            _fail(f"settings must be sorted by name, each once, got {names}")
        error = settings_error(dict(pairs), PlacementSettings())
        if error is not None:
            _fail(error)
        object.__setattr__(self, "settings", tuple(pairs))
        object.__setattr__(self, "at", number(self.at, "at"))


SWARM_MODES: Final = ("open", "private")


@dataclass(frozen=True, slots=True)
class Found:
    """The swarm's identity (its founder's id) and mode, once and for all."""

    swarm: bytes
    mode: str
    at: float

    @_as_ledger_error
    def __post_init__(self) -> None:
        _node(self.swarm)
        one_of(self.mode, "mode", SWARM_MODES)
        object.__setattr__(self, "at", number(self.at, "at"))


@dataclass(frozen=True, slots=True)
class Admit:
    """Admit `node` to a private swarm, by the invitation with this digest."""

    node: bytes
    voter: bool
    invitation: bytes
    at: float

    @_as_ledger_error
    def __post_init__(self) -> None:
        _node(self.node)
        boolean(self.voter, "voter")
        fixed_bytes(self.invitation, "invitation", size=32)
        object.__setattr__(self, "at", number(self.at, "at"))


@dataclass(frozen=True, slots=True)
class Eligible:
    """An operator made `node` eligible to become a Raft voter."""

    node: bytes
    at: float

    @_as_ledger_error
    def __post_init__(self) -> None:
        _node(self.node)
        object.__setattr__(self, "at", number(self.at, "at"))


@dataclass(frozen=True, slots=True)
class Verdict:
    """The leader's judgement, by recomputation, of `reporter`'s signed
    evidence that `accused` returned a wrong output: `guilty` when the
    accused's output was wrong, else the report was false. `evidence` is the
    evidence document's digest; `at` is when the leader judged (its wall
    clock, Unix seconds), from which a quarantine runs."""

    accused: bytes
    reporter: bytes
    evidence: bytes
    guilty: bool
    at: float

    @_as_ledger_error
    def __post_init__(self) -> None:
        fixed_bytes(self.accused, "accused", size=NODE_ID_BYTES)
        fixed_bytes(self.reporter, "reporter", size=NODE_ID_BYTES)
        if self.accused == self.reporter:
            _fail("accused and reporter are the same node: a node cannot report itself")
        fixed_bytes(self.evidence, "evidence", size=EVIDENCE_BYTES)
        boolean(self.guilty, "guilty")
        object.__setattr__(self, "at", number(self.at, "at", non_negative=True))


Command = (
    Assign
    | Release
    | RecordDemand
    | MarkAdmissionFailed
    | SetPolicy
    | Found
    | Admit
    | Eligible
    | Verdict
)

# Append-only: never renumber or reuse an id; 0 is reserved.
_TYPE_IDS: Final[Mapping[type, int]] = {
    Assign: 1,
    Release: 2,
    RecordDemand: 3,
    MarkAdmissionFailed: 4,
    SetPolicy: 5,
    Found: 6,
    Admit: 7,
    Eligible: 8,
    Verdict: 9,
}
_TYPES_BY_ID: Final = {v: k for k, v in _TYPE_IDS.items()}

ASSIGNMENT_COMMANDS: Final = (Assign, Release, MarkAdmissionFailed)
"""Commands that change a node's assignment."""
ELIGIBILITY_COMMANDS: Final = (Found, Admit, Eligible)
"""Commands that can change `PlacementLedger.eligible_voters`."""


def snapshot_digest(snapshot: bytes) -> str:
    """sha256 of `PlacementLedger.snapshot()` bytes, hex: one ledger state,
    one digest (the snapshot is canonical). What a leader's notice names and
    what a member checks a pulled copy against."""
    return hashlib.sha256(snapshot).hexdigest()


def encode_command(command: Command) -> bytes:
    """Canonical CBOR ``[type_id, fields...]``: one command, one byte string."""
    values: list[Any] = [_TYPE_IDS[type(command)]]
    for f in fields(command):
        value = getattr(command, f.name)
        values.append(_as_lists(value))
    return cbor2.dumps(values, canonical=True)


def _as_lists(value: Any) -> Any:
    """Tuples (layers, settings) as the CBOR arrays they are on the wire."""
    return [_as_lists(v) for v in value] if isinstance(value, tuple) else value


def _loads(data: object, max_bytes: int) -> Any:
    """One item in the wire's strict CBOR dialect (no tags, no indefinite
    lengths, no duplicate keys, nothing trailing), or a `LedgerError`.

    Every item takes at least one byte, so `max_bytes` also bounds the item
    count: a big snapshot is limited by its size cap alone."""
    if type(data) is not bytes:
        _fail(f"expected bytes, got {type(data).__name__}")
    try:
        return decode_strict_cbor(data, max_bytes=max_bytes, allow_floats=True, max_items=max_bytes)
    except DecodeError as exc:
        _fail(f"not a valid ledger encoding ({exc.reason}: {exc.detail})")


def decode_command(data: bytes) -> Command:
    """Strictly decode `encode_command`'s output; anything else raises `LedgerError`."""
    value = _loads(data, MAX_COMMAND_BYTES)
    if type(value) is not list or not value:
        _fail("a command is a non-empty CBOR array")
    type_id = value[0]
    cls = _TYPES_BY_ID.get(type_id) if type(type_id) is int else None
    if cls is None:
        _fail(f"unknown command type {type_id!r}")
    names = [f.name for f in fields(cls)]
    if len(value) != 1 + len(names):
        _fail(f"{cls.__name__} takes {len(names)} fields, got {len(value) - 1}")
    try:
        command = cls(**dict(zip(names, value[1:], strict=True)))
    except TypeError as exc:  # e.g. an unhashable where a value was expected
        _fail(f"{cls.__name__}: {exc}")
    if encode_command(command) != data:
        _fail(f"{cls.__name__} is not in canonical encoding (or has trailing bytes)")
    return command


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
class Admission:
    """A member admitted to a private swarm."""

    voter: bool
    invitation: bytes
    at: float


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

    @_as_ledger_error
    def __post_init__(self) -> None:
        _node(self.node)
        uint(self.offences, "offences")
        uint(self.false_reports, "false_reports")
        if self.offences == 0:
            if (self.until, self.reason, self.evidence) != (None, None, None):
                _fail("a node never quarantined has no until, reason or evidence")
            return
        object.__setattr__(self, "until", number(self.until, "until", non_negative=True))
        one_of(self.reason, "reason", QUARANTINE_REASONS)
        fixed_bytes(self.evidence, "evidence", size=EVIDENCE_BYTES)

    def in_force(self, now: float) -> bool:
        """The node is quarantined at `now` (serves nothing, is assigned nothing)."""
        return self.until is not None and self.until > now


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
        return command.accused if command.guilty else command.reporter
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
REASON_ALREADY_ELIGIBLE: Final = "already_eligible"
REASON_QUARANTINED: Final = "quarantined"
REASON_ALREADY_JUDGED: Final = "already_judged"


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
        self._swarm: Found | None = None
        self._admitted: dict[bytes, Admission] = {}
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
        if self._swarm is not None:
            raise _Reject(
                REASON_ALREADY_FOUNDED,
                f"the swarm was founded {self._swarm.mode} and stays so",
            )
        self._swarm = cmd

    def _admit(self, cmd: Admit) -> None:
        if self._swarm is None or self._swarm.mode != "private":
            raise _Reject(REASON_NOT_PRIVATE, "only a private swarm admits members")
        if cmd.node in self._admitted or cmd.node == self._swarm.swarm:
            raise _Reject(REASON_ALREADY_ADMITTED, "the node is a member already")
        self._admitted[cmd.node] = Admission(cmd.voter, cmd.invitation, cmd.at)

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
        if cmd.guilty:
            self._store_standing(_benched(self._standing(cmd.accused), "wrong_output", cmd))
            return
        reporter = self._standing(cmd.reporter)
        reporter = replace(reporter, false_reports=min(reporter.false_reports + 1, MAX_INT))
        if reporter.false_reports % FALSE_REPORT_LIMIT == 0:
            reporter = _benched(reporter, "false_reports", cmd)
        self._store_standing(reporter)

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
    def swarm(self) -> Found | None:
        """The swarm's founding (None until the founder commits it)."""
        return self._swarm

    def admitted(self) -> dict[bytes, Admission]:
        """A private swarm's admitted members, by node id (the founder is
        implicitly one), in id order."""
        return {n: self._admitted[n] for n in sorted(self._admitted)}

    def eligible_voters(self) -> frozenset[bytes]:
        """Who may become a Raft voter: the founder, the nodes made
        `Eligible`, and a private swarm's members admitted as voters. Empty
        until the swarm is founded (its founder is then the one voter)."""
        if self._swarm is None:
            return frozenset(self._eligible)
        admitted = (n for n, a in self._admitted.items() if a.voter)
        return frozenset({self._swarm.swarm, *self._eligible, *admitted})

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
            if self._swarm is None
            else {
                "id": self._swarm.swarm.hex(),
                "mode": self._swarm.mode,
                "admitted": [
                    {"node_id": n.hex(), "voter": a.voter, "invitation": a.invitation.hex()}
                    for n, a in self.admitted().items()
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
            swarm = self._swarm
            state.append(None if swarm is None else [swarm.swarm, swarm.mode, swarm.at])
            state.append([[n, a.voter, a.invitation, a.at] for n, a in self.admitted().items()])
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
    @_as_ledger_error
    def restore(cls, data: bytes) -> PlacementLedger:
        """Rebuild a ledger from `snapshot()` bytes; `LedgerError` if they are not exactly that."""
        value = _loads(data, MAX_SNAPSHOT_BYTES)
        # Version 2 appended the policy settings, version 3 the swarm and
        # its admitted members, version 4 the eligible voters, version 5 the
        # quarantine table and the judged evidence.
        sizes = {1: 6, 2: 7, 3: 9, 4: 10, SNAPSHOT_VERSION: 12}
        if type(value) is not list or not value or type(value[0]) is not int:
            _fail("a ledger snapshot is an array that starts with its version")
        if sizes.get(value[0]) != len(value):
            _fail(
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
                ledger._epochs[_node(node)] = uint(epoch, "epoch", low=1)
            for node, model, layers, recipe, tier, managed, epoch, at, failed_at in assignments:
                cmd = Assign(node, model, layers, recipe, tier, managed, epoch, at)
                if ledger._epochs.get(cmd.node, 0) < cmd.epoch:
                    _fail("an assignment's epoch is above its node's epoch")
                failed = None if failed_at is None else number(failed_at, "admission_failed_at")
                ledger._assignments[cmd.node] = LedgerAssignment(
                    cmd.node, cmd.model, cmd.layers, cmd.recipe, cmd.tier, cmd.managed,
                    cmd.epoch, cmd.at, failed,
                )  # fmt: skip
            for model, count, first_at, last_at in demand:
                ledger._demand[_text(model, "model")] = Demand(
                    uint(count, "count", low=1),
                    number(first_at, "first_at"),
                    number(last_at, "last_at"),
                )
            for reason, count in rejected:
                ledger._rejected[_text(reason, "reason")] = uint(count, "count", low=1)
            if settings:
                ledger._settings = dict(SetPolicy(settings, 0.0).settings)
            if founding is not None:
                ledger._swarm = Found(*founding)
            for node, voter, invitation, at in admitted:
                admit = Admit(node, voter, invitation, at)
                ledger._admitted[admit.node] = Admission(admit.voter, admit.invitation, admit.at)
            for node, at in eligible:
                made = Eligible(node, at)
                ledger._eligible[made.node] = made.at
            for row in quarantine:
                record = Quarantine(*row)
                if record.offences == record.false_reports == 0:
                    _fail("a quarantine record with neither offences nor false reports")
                ledger._quarantine[record.node] = record
            for evidence in judged:
                ledger._judged[fixed_bytes(evidence, "evidence", size=EVIDENCE_BYTES)] = None
        except (TypeError, ValueError) as exc:
            _fail(f"malformed ledger snapshot: {exc}")
        if ledger._snapshot(version) != data:
            _fail("ledger snapshot is not in canonical form (duplicates, order or encoding)")
        return ledger
