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
  model.

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
from typing import Any, Final, NoReturn

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
SNAPSHOT_VERSION: Final = 4
"""Version 2 added the policy settings, version 3 the swarm and its admitted
members, version 4 the nodes made eligible to vote; older snapshots are
still read.
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


Command = (
    Assign | Release | RecordDemand | MarkAdmissionFailed | SetPolicy | Found | Admit | Eligible
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
}
_TYPES_BY_ID: Final = {v: k for k, v in _TYPE_IDS.items()}

ASSIGNMENT_COMMANDS: Final = (Assign, Release, MarkAdmissionFailed)
"""Commands that change a node's assignment: the leader's ledger notice
names their nodes, so each learns of its own change within a gossip spread."""
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


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What one committed entry did: `accepted`, or rejected with a `reason` code and `detail`."""

    index: int
    command: Command | None
    accepted: bool
    reason: str = ""
    detail: str = ""


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
        return cbor2.dumps(state, canonical=True)

    @classmethod
    @_as_ledger_error
    def restore(cls, data: bytes) -> PlacementLedger:
        """Rebuild a ledger from `snapshot()` bytes; `LedgerError` if they are not exactly that."""
        value = _loads(data, MAX_SNAPSHOT_BYTES)
        # Version 2 appended the policy settings, version 3 the swarm and
        # its admitted members, version 4 the eligible voters.
        sizes = {1: 6, 2: 7, 3: 9, SNAPSHOT_VERSION: 10}
        if type(value) is not list or not value or type(value[0]) is not int:
            _fail("a ledger snapshot is an array that starts with its version")
        if sizes.get(value[0]) != len(value):
            _fail(
                f"ledger snapshot version {value[0]} with {len(value)} items; this build "
                f"reads versions 1 (6 items), 2 (7), 3 (9) and {SNAPSHOT_VERSION} (10)"
            )
        version, applied, assignments, epochs, demand, rejected, *later = value
        defaults: list[Any] = [[], None, [], []]  # what older versions lack
        settings, founding, admitted, eligible = [*later, *defaults[len(later) :]]
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
        except (TypeError, ValueError) as exc:
            _fail(f"malformed ledger snapshot: {exc}")
        if ledger._snapshot(version) != data:
            _fail("ledger snapshot is not in canonical form (duplicates, order or encoding)")
        return ledger
