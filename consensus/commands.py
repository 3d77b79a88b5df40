"""The placement ledger's commands, and their one encoding.

A command is what the leader proposes through Raft and every replica's
`consensus.ledger.PlacementLedger` applies: a frozen dataclass whose
constructor checks every field, so a command that exists is well formed.
On the wire it is a CBOR array ``[type_id, field, ...]`` in field order,
encoded canonically (one command, one byte string); `decode_command`
re-encodes and compares, refusing every other form in one check. These
bytes are in every node's Raft log on disk: type ids are append-only and a
field is never reinterpreted. The layout and its rules are in
docs/design/ledger.md ("Commands").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Final, NoReturn

import cbor2

from consensus.settings import POLICY_FIELDS, PlacementSettings, settings_error
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

__all__ = [
    "ASSIGNMENT_COMMANDS",
    "COMMAND_TYPE_IDS",
    "ELIGIBILITY_COMMANDS",
    "EVIDENCE_BYTES",
    "MAX_COMMAND_BYTES",
    "MAX_INT",
    "MAX_INVITATION_USES",
    "MAX_TEXT",
    "SWARM_MODES",
    "Admit",
    "Assign",
    "Command",
    "Eligible",
    "Found",
    "LedgerError",
    "MarkAdmissionFailed",
    "RecordDemand",
    "Release",
    "SetPolicy",
    "Verdict",
    "as_ledger_error",
    "checked_node",
    "checked_text",
    "decode_command",
    "encode_command",
    "refuse",
    "strict_loads",
]

MAX_COMMAND_BYTES: Final = 4096
"""Largest encoded command. Real ones are ~150 bytes; the cap bounds what a
buggy proposer can make every replica parse and store forever."""
MAX_TEXT: Final = 256
"""Model names, reasons: long enough for a manifest name, short enough to log."""
MAX_INT: Final = MAX_UINT
"""Epochs, counts, layers and indexes fit sqlite's and CBOR's signed 64 bits."""
EVIDENCE_BYTES: Final = 32
"""A verdict names its evidence by a sha256 digest of the evidence document."""
MAX_INVITATION_USES: Final = 1000
"""The most nodes one invitation may admit: a batch of machines set up
together. A token is a bearer secret, and a leaked one admits this many
strangers before anyone notices; a larger batch takes several tokens."""


class LedgerError(Exception):
    """A command or snapshot that cannot be decoded or is invalid."""


def refuse(msg: str) -> NoReturn:
    """Refuse a command or snapshot: raise `LedgerError` saying why."""
    raise LedgerError(msg)


def _ledger_error(exc: FieldError) -> LedgerError:
    # Commands come from the leader (a trusted voter), so the value is shown.
    return LedgerError(f"{exc.detail}, got {exc.value!r}")


as_ledger_error = reraise_as(_ledger_error)
"""Field checks (mesh.fields) in a command or a snapshot raise `LedgerError`."""


def checked_text(value: object, name: str) -> str:
    """A model name or reason: non-empty text of at most `MAX_TEXT` characters."""
    return text(value, name, max_chars=MAX_TEXT)


def checked_node(value: object) -> bytes:
    """A node id: exactly `NODE_ID_BYTES` bytes."""
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

    @as_ledger_error
    def __post_init__(self) -> None:
        checked_node(self.node)
        checked_text(self.model, "model")
        object.__setattr__(self, "layers", span(self.layers, "layers"))
        one_of(self.recipe, "recipe", RECIPES)
        one_of(self.tier, "tier", TIERS)
        boolean(self.managed, "managed")
        if self.managed != (self.tier == "managed"):
            refuse(f"managed={self.managed} contradicts tier {self.tier!r}")
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

    @as_ledger_error
    def __post_init__(self) -> None:
        checked_node(self.node)
        checked_text(self.model, "model")
        uint(self.epoch, "epoch", low=1)
        checked_text(self.reason, "reason")
        object.__setattr__(self, "at", number(self.at, "at"))


@dataclass(frozen=True, slots=True)
class RecordDemand:
    """`count` chat requests for `model` were seen (by `at`)."""

    model: str
    count: int
    at: float

    @as_ledger_error
    def __post_init__(self) -> None:
        checked_text(self.model, "model")
        uint(self.count, "count", low=1)
        object.__setattr__(self, "at", number(self.at, "at"))


@dataclass(frozen=True, slots=True)
class MarkAdmissionFailed:
    """`node` failed `doctor` for its assignment at `epoch`: the policy may place elsewhere."""

    node: bytes
    model: str
    epoch: int
    at: float

    @as_ledger_error
    def __post_init__(self) -> None:
        checked_node(self.node)
        checked_text(self.model, "model")
        uint(self.epoch, "epoch", low=1)
        object.__setattr__(self, "at", number(self.at, "at"))


@dataclass(frozen=True, slots=True)
class SetPolicy:
    """Set these policy knobs, swarm-wide, from `at` on: (name, value)
    pairs, sorted by name, each name once. Knobs not named keep their value."""

    settings: tuple[tuple[str, int | float], ...]
    at: float

    @as_ledger_error
    def __post_init__(self) -> None:
        if type(self.settings) not in (tuple, list) or not self.settings:
            refuse(f"settings must be a non-empty list of [name, value] pairs: {self.settings!r}")
        pairs = []
        for pair in self.settings:
            if type(pair) not in (tuple, list) or len(pair) != 2:
                refuse(f"a setting is a [name, value] pair, got {pair!r}")
            name, value = pair
            one_of(name, "setting name", POLICY_FIELDS)
            if POLICY_FIELDS[name] is float and type(value) is int:
                value = float(value)  # one knob value, one encoding
            pairs.append((name, value))
        names = [name for name, _ in pairs]
        if names != sorted(set(names)):
            refuse(f"settings must be sorted by name, each once, got {names}")
        error = settings_error(dict(pairs), PlacementSettings())
        if error is not None:
            refuse(error)
        object.__setattr__(self, "settings", tuple(pairs))
        object.__setattr__(self, "at", number(self.at, "at"))


SWARM_MODES: Final = ("open", "private")


@dataclass(frozen=True, slots=True)
class Found:
    """The swarm's identity (its founder's id) and mode, once and for all."""

    swarm: bytes
    mode: str
    at: float

    @as_ledger_error
    def __post_init__(self) -> None:
        checked_node(self.swarm)
        one_of(self.mode, "mode", SWARM_MODES)
        object.__setattr__(self, "at", number(self.at, "at"))


@dataclass(frozen=True, slots=True)
class Admit:
    """Admit `node` to a private swarm, by the invitation with this digest,
    which admits at most `uses` nodes (a voter's: one). `uses` None is an
    entry logged before invitations counted their uses (it has four fields
    on the wire): the ledger applies it as it did then, uncounted, so a log
    replayed and a snapshot restored give every replica the same members."""

    node: bytes
    voter: bool
    invitation: bytes
    at: float
    uses: int | None = None

    @as_ledger_error
    def __post_init__(self) -> None:
        checked_node(self.node)
        boolean(self.voter, "voter")
        fixed_bytes(self.invitation, "invitation", size=32)
        object.__setattr__(self, "at", number(self.at, "at"))
        if self.uses is not None:
            uint(self.uses, "uses", low=1, high=MAX_INVITATION_USES)
            if self.voter and self.uses != 1:
                refuse(f"a voter's invitation admits one node, not {self.uses}")


@dataclass(frozen=True, slots=True)
class Eligible:
    """An operator made `node` eligible to become a Raft voter."""

    node: bytes
    at: float

    @as_ledger_error
    def __post_init__(self) -> None:
        checked_node(self.node)
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

    @as_ledger_error
    def __post_init__(self) -> None:
        fixed_bytes(self.accused, "accused", size=NODE_ID_BYTES)
        fixed_bytes(self.reporter, "reporter", size=NODE_ID_BYTES)
        if self.accused == self.reporter:
            refuse("accused and reporter are the same node: a node cannot report itself")
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

COMMAND_TYPE_IDS: Final[Mapping[type, int]] = MappingProxyType(
    {
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
)
"""Each command's type id, its first array item. Append-only: never renumber
or reuse an id (the Raft logs on disk hold them); 0 is reserved."""
_TYPES_BY_ID: Final = {v: k for k, v in COMMAND_TYPE_IDS.items()}
_ADDED_FIELDS: Final[Mapping[type, int]] = MappingProxyType({Admit: 1})
"""How many of a command's last fields were added after its first entries
were logged. Each defaults to None; a command whose added fields are None
encodes without them (its old bytes, unchanged), and an entry without them
decodes with them None. Fields are only ever appended."""

ASSIGNMENT_COMMANDS: Final = (Assign, Release, MarkAdmissionFailed)
"""Commands that change a node's assignment."""
ELIGIBILITY_COMMANDS: Final = (Found, Admit, Eligible)
"""Commands that can change `PlacementLedger.eligible_voters`."""


def encode_command(command: Command) -> bytes:
    """Canonical CBOR ``[type_id, fields...]``: one command, one byte string."""
    values: list[Any] = [COMMAND_TYPE_IDS[type(command)]]
    for f in fields(command):
        value = getattr(command, f.name)
        values.append(_as_lists(value))
    for _ in range(_ADDED_FIELDS.get(type(command), 0)):
        if values[-1] is not None:
            break
        values.pop()  # an unset added field: the bytes it had before
    return cbor2.dumps(values, canonical=True)


def _as_lists(value: Any) -> Any:
    """Tuples (layers, settings) as the CBOR arrays they are on the wire."""
    return [_as_lists(v) for v in value] if isinstance(value, tuple) else value


def strict_loads(data: object, max_bytes: int) -> Any:
    """One item in the wire's strict CBOR dialect (no tags, no indefinite
    lengths, no duplicate keys, nothing trailing), or a `LedgerError`.

    Every item takes at least one byte, so `max_bytes` also bounds the item
    count: a big snapshot is limited by its size cap alone."""
    if type(data) is not bytes:
        refuse(f"expected bytes, got {type(data).__name__}")
    try:
        return decode_strict_cbor(data, max_bytes=max_bytes, allow_floats=True, max_items=max_bytes)
    except DecodeError as exc:
        refuse(f"not a valid ledger encoding ({exc.reason}: {exc.detail})")


def decode_command(data: bytes) -> Command:
    """Strictly decode `encode_command`'s output; anything else raises `LedgerError`."""
    value = strict_loads(data, MAX_COMMAND_BYTES)
    if type(value) is not list or not value:
        refuse("a command is a non-empty CBOR array")
    type_id = value[0]
    cls = _TYPES_BY_ID.get(type_id) if type(type_id) is int else None
    if cls is None:
        refuse(f"unknown command type {type_id!r}")
    names = [f.name for f in fields(cls)]
    least = len(names) - _ADDED_FIELDS.get(cls, 0)
    if not least <= len(value) - 1 <= len(names):
        expected = f"{least} to {len(names)}" if least < len(names) else str(len(names))
        refuse(f"{cls.__name__} takes {expected} fields, got {len(value) - 1}")
    try:
        command = cls(**dict(zip(names, value[1:], strict=False)))
    except TypeError as exc:  # e.g. an unhashable where a value was expected
        refuse(f"{cls.__name__}: {exc}")
    if encode_command(command) != data:
        refuse(f"{cls.__name__} is not in canonical encoding (or has trailing bytes)")
    return command
